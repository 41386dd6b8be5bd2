"""``gemma2`` and ``gemma3`` GGUFs -> mlx-lm ``gemma2`` / ``gemma3_text``.

llama.cpp stores Gemma's RMSNorm weights as ``w + 1`` (Gemma scales by ``1 + w``; llama.cpp's
kernel by ``w``), so every norm gets 1 subtracted back. What llama.cpp derives rather than
reads, the tables derive the same way: the query scale is ``1/sqrt(head_dim)`` except for
the 27B models (``1/sqrt(hidden / heads)``, told apart by their block count); Gemma 3's
local RoPE base is 10,000 and every 6th layer is global unless the file says otherwise.
"""

from __future__ import annotations

from typing import Any

from mlxserve.mlx_backend.loading.gguf.architectures.base import (
    Architecture,
    Hparams,
    Transform,
    UnsupportedModel,
)

# Block counts of the 27B models, whose query scale llama.cpp special-cases.
_GEMMA2_27B_BLOCKS = 46
_GEMMA3_27B_BLOCKS = 62
_GEMMA3_SLIDING_PATTERN = 6
_GEMMA3_LOCAL_ROPE_BASE = 10_000.0


def _query_pre_attn_scalar(hp: Hparams, config: dict, blocks_27b: int) -> int | float:
    if (scale := hp.get("attention.scale")) is not None:
        value = float(scale) ** -2
    elif config["num_hidden_layers"] == blocks_27b:
        value = config["hidden_size"] / config["num_attention_heads"]
    else:
        value = config["head_dim"]
    # transformers validates it as an int when config.json is read back.
    return int(round(value)) if abs(value - round(value)) < 1e-3 else value


def _base(hp: Hparams, model_type: str, architecture: str) -> dict[str, Any]:
    config: dict[str, Any] = {"model_type": model_type, "architectures": [architecture]}
    config.update(hp.common())
    config["rms_norm_eps"] = hp.get_float("attention.layer_norm_rms_epsilon", 1e-6)
    config["intermediate_size"] = hp.get_int("feed_forward_length")
    config["head_dim"] = hp.head_dim(config)
    return config


def _gemma2(hp: Hparams) -> dict[str, Any]:
    config = _base(hp, "gemma2", "Gemma2ForCausalLM")
    config["attn_logit_softcapping"] = hp.get_float("attn_logit_softcapping", 50.0)
    config["final_logit_softcapping"] = hp.get_float("final_logit_softcapping", 30.0)
    config["query_pre_attn_scalar"] = _query_pre_attn_scalar(hp, config, _GEMMA2_27B_BLOCKS)
    return config


def _sliding_pattern(hp: Hparams, n_layers: int) -> int:
    """mlx-lm's period (every n-th layer global) from the file's per-layer flags, if any."""
    flags = hp.get("attention.sliding_window_pattern")
    if flags is None:
        return _GEMMA3_SLIDING_PATTERN
    if isinstance(flags, int):
        return flags
    for period in range(1, n_layers + 1):
        if all(bool(f) == ((i + 1) % period != 0) for i, f in enumerate(flags)):
            return period
    raise UnsupportedModel(
        f"gemma3: sliding-window layers {flags} are not periodic, which mlx-lm's gemma3_text needs"
    )


def _gemma3(hp: Hparams) -> dict[str, Any]:
    config = _base(hp, "gemma3_text", "Gemma3ForCausalLM")
    if hp.get("final_logit_softcapping") is not None:
        raise UnsupportedModel("gemma3: final_logit_softcapping is not supported by mlx-lm")
    config["query_pre_attn_scalar"] = _query_pre_attn_scalar(hp, config, _GEMMA3_27B_BLOCKS)
    config["rope_local_base_freq"] = hp.get_float("rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_BASE)
    window = hp.get("attention.sliding_window")
    if window is None:  # the converter writes none when no layer slides
        config["sliding_window_pattern"] = 1
        config["sliding_window"] = config["max_position_embeddings"]
    else:
        config["sliding_window"] = int(window)
        config["sliding_window_pattern"] = _sliding_pattern(hp, config["num_hidden_layers"])
    scaling = hp.linear_rope_scaling()
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


_NORMS_STORED_PLUS_ONE = Transform(r".*norm\.weight", lambda w, c: w - 1.0, needs_float=True)

GEMMA2 = Architecture(
    gguf_name="gemma2",
    mlx_module="gemma2",
    config=_gemma2,
    chat_family="gemma",
    transforms=(_NORMS_STORED_PLUS_ONE,),
)
GEMMA3 = Architecture(
    gguf_name="gemma3",
    mlx_module="gemma3_text",
    config=_gemma3,
    chat_family="gemma",
    transforms=(_NORMS_STORED_PLUS_ONE,),
)
