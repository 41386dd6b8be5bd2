"""``phi3`` GGUFs (Phi-3, Phi-3.5, Phi-4-mini) -> mlx-lm ``phi3``.

q/k/v and gate/up stay fused (``attn_qkv``, ``ffn_up`` of twice the width), as in mlx-lm.
LongRoPE factors travel as tensors (``rope_factors_long`` / ``rope_factors_short``) and go
into ``rope_scaling``; partial rotary comes from ``rope.dimension_count``.
"""

from __future__ import annotations

from typing import Any

from mlxserve.mlx_backend.loading.gguf.architectures.base import Architecture, Hparams

LONG, SHORT = "rope_factors_long.weight", "rope_factors_short.weight"


def _phi3(hp: Hparams) -> dict[str, Any]:
    config: dict[str, Any] = {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"]}
    config.update(hp.common())
    config["intermediate_size"] = hp.get_int("feed_forward_length")
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    rope_dims = hp.get_int("rope.dimension_count", head_dim)
    config["partial_rotary_factor"] = rope_dims / head_dim
    config["original_max_position_embeddings"] = hp.get_int(
        "rope.scaling.original_context_length", config["max_position_embeddings"]
    )
    if hp.has_tensor(LONG):
        long = [float(x) for x in hp.float_tensor(LONG)]
        short = [float(x) for x in hp.float_tensor(SHORT)] if hp.has_tensor(SHORT) else long
        config["rope_scaling"] = {"type": "longrope", "long_factor": long, "short_factor": short}
    elif (scaling := hp.linear_rope_scaling()) is not None:
        config["rope_scaling"] = scaling
    return config


PHI3 = Architecture(
    gguf_name="phi3",
    mlx_module="phi3",
    config=_phi3,
    chat_family="phi3",
    extra_tensors=frozenset({LONG, SHORT}),
)
