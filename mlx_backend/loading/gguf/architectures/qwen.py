"""``qwen2``, ``qwen3`` and ``qwen3moe`` GGUFs -> mlx-lm ``qwen2`` / ``qwen3`` / ``qwen3_moe``.

llama.cpp does not permute these (they use NeoX-style RoPE, like mlx-lm), so tensors map
one to one: qwen2 adds q/k/v biases, qwen3 q/k norms and a ``key_length`` head dim,
qwen3moe a router (``ffn_gate_inp``) and experts stacked as ``ffn_{gate,up,down}_exps``,
which is mlx-lm's ``switch_mlp`` layout already.
"""

from __future__ import annotations

from typing import Any

from mlxserve.mlx_backend.loading.gguf.architectures.base import (
    Architecture,
    Hparams,
    UnsupportedModel,
)


def _dense(hp: Hparams, model_type: str, architecture: str) -> dict[str, Any]:
    config: dict[str, Any] = {"model_type": model_type, "architectures": [architecture]}
    config.update(hp.common())
    config["rope_theta"] = hp.get_float("rope.freq_base", 1_000_000.0)
    if model_type != "qwen3_moe":
        config["intermediate_size"] = hp.get_int("feed_forward_length")
    scaling = hp.linear_rope_scaling()
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def _qwen2(hp: Hparams) -> dict[str, Any]:
    config = _dense(hp, "qwen2", "Qwen2ForCausalLM")
    head_dim = hp.head_dim(config)
    if head_dim != config["hidden_size"] // config["num_attention_heads"]:
        raise UnsupportedModel(f"qwen2: key_length {head_dim} != hidden / heads (mlx-lm's qwen2)")
    return config


def _qwen3(hp: Hparams) -> dict[str, Any]:
    config = _dense(hp, "qwen3", "Qwen3ForCausalLM")
    config["head_dim"] = hp.head_dim(config)
    return config


def _qwen3moe(hp: Hparams) -> dict[str, Any]:
    config = _dense(hp, "qwen3_moe", "Qwen3MoeForCausalLM")
    config["head_dim"] = hp.head_dim(config)
    config["num_experts"] = hp.get_int("expert_count")
    config["num_experts_per_tok"] = hp.get_int("expert_used_count")
    config["moe_intermediate_size"] = hp.get_int("expert_feed_forward_length")
    # mlx-lm requires the field; qwen3moe files without dense layers may omit it.
    config["intermediate_size"] = hp.get_int("feed_forward_length", config["moe_intermediate_size"])
    # Every block of a qwen3moe GGUF is sparse (llama.cpp has no dense-layer list for it).
    config["decoder_sparse_step"] = 1
    config["mlp_only_layers"] = []
    config["norm_topk_prob"] = bool(hp.get("expert_weights_norm", True))
    return config


QWEN2 = Architecture(gguf_name="qwen2", mlx_module="qwen2", config=_qwen2, chat_family="chatml")
QWEN3 = Architecture(gguf_name="qwen3", mlx_module="qwen3", config=_qwen3, chat_family="chatml")
QWEN3MOE = Architecture(
    gguf_name="qwen3moe",
    mlx_module="qwen3_moe",
    config=_qwen3moe,
    chat_family="chatml",
    tensor_overrides={
        r"model\.layers\.(\d+)\.mlp\.switch_mlp\.(gate|up|down)_proj\.weight": (
            "blk.{0}.ffn_{1}_exps.weight"
        ),
    },
)
