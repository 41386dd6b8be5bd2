"""The GGUF architectures mlxserve maps onto mlx-lm models, one table each."""

from __future__ import annotations

from mlxserve.mlx_backend.loading.gguf.architectures.base import Architecture, UnsupportedModel
from mlxserve.mlx_backend.loading.gguf.architectures.gemma import GEMMA2, GEMMA3
from mlxserve.mlx_backend.loading.gguf.architectures.lfm2 import LFM2
from mlxserve.mlx_backend.loading.gguf.architectures.llama import LLAMA
from mlxserve.mlx_backend.loading.gguf.architectures.phi3 import PHI3
from mlxserve.mlx_backend.loading.gguf.architectures.qwen import QWEN2, QWEN3, QWEN3MOE

ARCHITECTURES: dict[str, Architecture] = {
    a.gguf_name: a for a in (LLAMA, QWEN2, QWEN3, QWEN3MOE, GEMMA2, GEMMA3, PHI3, LFM2)
}


def architecture_for(name: str | None) -> Architecture:
    """The table for ``general.architecture``.

    Raises:
        UnsupportedModel: no table for it (the message lists the supported ones).
    """
    if name not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise UnsupportedModel(f"Unsupported GGUF architecture {name!r} (supported: {supported})")
    return ARCHITECTURES[name]
