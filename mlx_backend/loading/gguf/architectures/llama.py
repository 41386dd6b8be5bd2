"""``llama`` GGUFs (Llama 1-3.x, Mistral, SmolLM, TinyLlama, ...) -> mlx-lm ``llama``.

llama.cpp's converter permutes the q/k rows of these files (its RoPE kernel rotates
adjacent pairs), so the loader un-permutes them. Llama 3.1+ files carry their RoPE
scaling as a ``rope_freqs`` tensor rather than metadata: the loader sets mlx-lm's
``Llama3RoPE`` periods from it exactly, and the config gets parameters fitted to it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mlxserve.mlx_backend.loading.gguf.architectures.base import (
    Architecture,
    Hparams,
    Transform,
    UnsupportedModel,
    unpermute_rows,
)
from mlxserve.mlx_backend.loading.gguf.rope_freqs import exact_periods, fit_llama3_scaling

ROPE_FREQS = "rope_freqs.weight"


def _config(hp: Hparams) -> dict[str, Any]:
    config: dict[str, Any] = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    config.update(hp.common())
    config["intermediate_size"] = hp.get_int("feed_forward_length")
    config["head_dim"] = hp.head_dim(config)
    config["attention_bias"] = hp.has_tensor("blk.0.attn_q.bias")
    config["mlp_bias"] = hp.has_tensor("blk.0.ffn_up.bias")
    rope_dims = hp.get("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != config["head_dim"]:
        raise UnsupportedModel(
            f"llama: partial rotary embeddings ({rope_dims} of {config['head_dim']} dims) "
            "are not supported by mlx-lm's llama"
        )
    scaling = hp.linear_rope_scaling()
    if hp.has_tensor(ROPE_FREQS):
        if scaling is not None:
            raise UnsupportedModel("llama: both rope_freqs and a rope scaling type are given")
        scaling, _ = fit_llama3_scaling(
            hp.float_tensor(ROPE_FREQS),
            config["rope_theta"],
            config["head_dim"],
            hp.get("rope.scaling.original_context_length"),
        )
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def _set_rope_periods(model: Any, extra: dict[str, np.ndarray], config: dict) -> None:
    factors = extra.get(ROPE_FREQS)
    if factors is None:
        return
    periods = exact_periods(factors, config["rope_theta"], config["head_dim"])
    for layer in model.model.layers:
        layer.self_attn.rope._freqs = periods


LLAMA = Architecture(
    gguf_name="llama",
    mlx_module="llama",
    config=_config,
    chat_family="llama",
    transforms=(
        Transform(
            r".*\.self_attn\.q_proj\.(weight|bias)",
            lambda w, c: unpermute_rows(w, c["num_attention_heads"]),
        ),
        Transform(
            r".*\.self_attn\.k_proj\.(weight|bias)",
            lambda w, c: unpermute_rows(w, c["num_key_value_heads"]),
        ),
    ),
    extra_tensors=frozenset({ROPE_FREQS}),
    post_load=_set_rope_periods,
)
