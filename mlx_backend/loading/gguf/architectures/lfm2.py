"""``lfm2`` GGUFs (Liquid LFM2: gated short convolutions + attention) -> mlx-lm ``lfm2``.

Which layers attend is written as a per-layer ``attention.head_count_kv`` (0 for the
convolution layers). llama.cpp squeezes the conv kernel to ``[hidden, L]``; mlx-lm's
``Conv1d`` wants ``[hidden, L, 1]``. The head is always tied to the embeddings.
"""

from __future__ import annotations

from typing import Any

from mlxserve.mlx_backend.loading.gguf.architectures.base import (
    Architecture,
    Hparams,
    Transform,
    UnsupportedModel,
)


def _lfm2(hp: Hparams) -> dict[str, Any]:
    n_layers = hp.get_int("block_count")
    kv = hp.require("attention.head_count_kv")
    kv_per_layer = kv if isinstance(kv, list) else [kv] * n_layers
    if len(kv_per_layer) != n_layers:
        raise UnsupportedModel(
            f"lfm2: {len(kv_per_layer)} head_count_kv values for {n_layers} layers"
        )
    if hp.has_tensor("output.weight"):
        raise UnsupportedModel(
            "lfm2: the file has an untied output.weight; mlx-lm's lfm2 ties its head"
        )
    hidden = hp.get_int("embedding_length")
    return {
        "model_type": "lfm2",
        "architectures": ["Lfm2ForCausalLM"],
        "vocab_size": hp.vocab_size,
        "hidden_size": hidden,
        "num_hidden_layers": n_layers,
        "num_attention_heads": hp.get_int("attention.head_count"),
        "num_key_value_heads": max(int(k) for k in kv_per_layer),
        "layer_types": ["full_attention" if int(k) else "conv" for k in kv_per_layer],
        "max_position_embeddings": hp.get_int("context_length", 128_000),
        "norm_eps": hp.get_float("attention.layer_norm_rms_epsilon", 1e-5),
        "conv_bias": hp.has_tensor("blk.0.shortconv.conv.bias"),
        "conv_L_cache": hp.get_int("shortconv.l_cache"),
        "block_dim": hidden,
        "block_ff_dim": hp.get_int("feed_forward_length"),
        # The file's feed_forward_length is the adjusted width already.
        "block_auto_adjust_ff_dim": False,
        "block_multiple_of": 256,
        "block_ffn_dim_multiplier": 1.0,
        "rope_theta": hp.get_float("rope.freq_base", 1_000_000.0),
        "tie_word_embeddings": True,
    }


LFM2 = Architecture(
    gguf_name="lfm2",
    mlx_module="lfm2",
    config=_lfm2,
    chat_family="chatml",
    transforms=(
        Transform(r".*\.conv\.conv\.weight", lambda w, c: w.reshape(*w.shape, 1), needs_float=True),
    ),
)
