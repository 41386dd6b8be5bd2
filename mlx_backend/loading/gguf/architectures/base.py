"""What an architecture table says, and the metadata reader its config builder uses.

An ``Architecture`` maps one GGUF ``general.architecture`` onto an mlx-lm model module:

- ``config(hp)`` turns the file's metadata (and tensor shapes) into the mlx-lm ``ModelArgs``
  dict, shaped like an HF ``config.json`` so ``mlxserve convert`` can write it out as is;
- tensor names come from gguf-py's per-architecture name map (the HF names mlx-lm also
  uses -> GGUF names); ``tensor_overrides`` covers the parameters that map does not know
  (stacked experts), ``extra_tensors`` the GGUF tensors the config consumes (rope factors);
- ``transforms`` undo what llama.cpp's converter did to a tensor (q/k row permutation,
  norms stored as ``w + 1``, a squeezed conv kernel), keyed by a regex on the mlx-lm name.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from mlxserve.mlx_backend.loading.gguf.reader import TensorInfo


class UnsupportedModel(ValueError):
    """The file describes something mlxserve cannot load; the message names it."""


def float32_value(x: float) -> float:
    # GGUF stores these as float32; 7 significant digits give back the intended value
    # (1e-05 rather than 9.999999747378752e-06) for config.json.
    return float(f"{float(x):.7g}")


class Hparams:
    """Typed access to one architecture's GGUF metadata (``{arch}.key``) and tensor table."""

    def __init__(
        self,
        arch: str,
        metadata: dict[str, Any],
        tensors: dict[str, TensorInfo],
        read_float: Callable[[str], np.ndarray],
    ) -> None:
        self.arch, self.metadata, self.tensors = arch, metadata, tensors
        self._read_float = read_float

    def float_tensor(self, name: str) -> np.ndarray:
        """A small tensor's values as float32 (rope factors, ...)."""
        return self._read_float(name)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.arch}.{key}", default)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise UnsupportedModel(f"GGUF metadata lacks {self.arch}.{key}")
        return value

    def get_int(self, key: str, default: int | None = None) -> int:
        value = self.get(key, default) if default is not None else self.require(key)
        if isinstance(value, list):
            raise UnsupportedModel(
                f"{self.arch}.{key} is per layer ({value}); this architecture needs one value"
            )
        return int(value)

    def get_float(self, key: str, default: float) -> float:
        return float32_value(self.get(key, default))

    def has_tensor(self, name: str) -> bool:
        return name in self.tensors

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    @property
    def vocab_size(self) -> int:
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        if "token_embd.weight" in self.tensors:
            return self.tensors["token_embd.weight"].shape[0]
        if self.get("vocab_size") is not None:
            return int(self.get("vocab_size"))
        if tokens:
            return len(tokens)
        raise UnsupportedModel("cannot tell the vocabulary size (no token_embd.weight)")

    def common(self) -> dict[str, Any]:
        """The fields every decoder-only table shares (llama naming)."""
        n_heads = self.get_int("attention.head_count")
        hidden = self.get_int("embedding_length")
        return {
            "hidden_size": hidden,
            "num_hidden_layers": self.get_int("block_count"),
            "num_attention_heads": n_heads,
            "num_key_value_heads": self.get_int("attention.head_count_kv", n_heads),
            "rms_norm_eps": self.get_float("attention.layer_norm_rms_epsilon", 1e-5),
            "rope_theta": self.get_float("rope.freq_base", 10000.0),
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.get_int("context_length", 4096),
            "tie_word_embeddings": not self.has_tensor("output.weight"),
        }

    def head_dim(self, config: dict[str, Any]) -> int:
        return self.get_int(
            "attention.key_length", config["hidden_size"] // config["num_attention_heads"]
        )

    def linear_rope_scaling(self) -> dict[str, Any] | None:
        """``rope_scaling`` for ``{arch}.rope.scaling.type``; only none/linear are mapped."""
        kind = self.get("rope.scaling.type")
        if kind in (None, "none"):
            return None
        if kind != "linear":
            raise UnsupportedModel(f"{self.arch}: rope scaling {kind!r} is not supported")
        return {
            "type": "linear",
            "rope_type": "linear",
            "factor": float(self.require("rope.scaling.factor")),
        }


@dataclass(frozen=True)
class Transform:
    """A change applied to the converted tensors of every mlx-lm parameter matching ``pattern``.

    ``fn(array, config)`` runs on each array of the tensor (packed weight, scales, biases:
    row-wise functions only) or, with ``needs_float``, on the float values.
    """

    pattern: str
    fn: Callable[[mx.array, dict], mx.array]
    needs_float: bool = False

    def matches(self, mlx_name: str) -> bool:
        return re.fullmatch(self.pattern, mlx_name) is not None


@dataclass(frozen=True)
class Architecture:
    """One GGUF architecture -> one mlx-lm model module (see the module doc)."""

    gguf_name: str
    mlx_module: str
    config: Callable[[Hparams], dict[str, Any]]
    chat_family: str
    tensor_overrides: dict[str, str] = field(default_factory=dict)
    transforms: tuple[Transform, ...] = ()
    extra_tensors: frozenset[str] = frozenset()
    # Runs on the loaded model with the file's extra tensors as float32 numpy arrays.
    post_load: Callable[[Any, dict[str, np.ndarray], dict], None] | None = None

    def override(self, mlx_name: str) -> str | None:
        for pattern, template in self.tensor_overrides.items():
            match = re.fullmatch(pattern, mlx_name)
            if match is not None:
                return template.format(*match.groups())
        return None


def unpermute_rows(w: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's ``permute`` of q/k rows (HF half-split RoPE -> interleaved pairs).

    llama.cpp reorders each head's rows from ``[first half, second half]`` into interleaved
    pairs so its RoPE kernel rotates adjacent values; mlx-lm's models use the HF layout.
    Quantization groups run along columns, so the same permutation applies to packed
    weights, scales and biases (and to 1-D biases).
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
