"""The tiny architectures' configs (``tests/tiny_models.py`` builds and saves them): shared
sizes, the tokenizer's shape, and one small config per mlx-lm architecture, each with at
least one layer of every kind it has."""

from __future__ import annotations

from typing import Any

# Sliding window used by every sliding-window model here: prompts longer than this
# make the rotating caches wrap.
WINDOW = 8
HIDDEN = 64

# Tokenizer: 256 byte tokens, NUM_MERGES merges, then the end-of-sequence token.
NUM_MERGES = 63
EOS_TOKEN = "<|endoftext|>"
EOS_TOKEN_ID = 256 + NUM_MERGES
VOCAB_SIZE = EOS_TOKEN_ID + 1  # 320
TIED_EMBED_STD = 0.1
# Untied heads are scaled up so that logits have a std of about HEAD_GAIN: greedy tokens
# are the same, but the gap between the best two logits, which decides how much numeric
# noise (batching, padding) a greedy comparison tolerates, grows with it.
HEAD_GAIN = 4.0

COMMON = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": HIDDEN,
    "max_position_embeddings": 4096,
    "eos_token_id": EOS_TOKEN_ID,
    # transformers fills in its own defaults otherwise (and warns they are out of vocab).
    "bos_token_id": None,
    "pad_token_id": None,
    "tie_word_embeddings": False,
}

# Per architecture: the config (merged over COMMON). Comments give the layer layout and
# make_cache() kinds.
CONFIGS: dict[str, dict[str, Any]] = {
    # Mamba2 + attention + MoE blocks; make_cache() has entries only for "M" and "*"
    # blocks, so the cache list is shorter than model.layers:
    # layers M * M E -> caches [ArraysCache, KVCache, ArraysCache].
    "nemotron_h": {
        "model_type": "nemotron_h",
        "hybrid_override_pattern": ["M", "*", "M", "E"],
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "attention_bias": False,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "mamba_proj_bias": False,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "n_groups": 2,
        "mlp_bias": False,
        "layer_norm_epsilon": 1e-5,
        "use_bias": False,
        "use_conv_bias": True,
        "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 32,
        "n_group": 1,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "topk_group": 1,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "time_step_limit": [0.0, 1e4],
    },
    # Every layer runs Mamba2 and attention in parallel: one CacheList(ArraysCache, KVCache)
    # per layer.
    "falcon_h1": {
        "model_type": "falcon_h1",
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "mamba_d_ssm": 64,
        "mamba_n_heads": 4,
        "mamba_d_head": 16,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_n_groups": 1,
        "mamba_chunk_size": 16,
        "mamba_rms_norm": True,
        "rope_theta": 10000.0,
    },
    # Gated delta-net linear attention every layer but each 2nd: [A, K, A, K]; MoE on all
    # layers but layer 0 (dense).
    "qwen3_next": {
        "model_type": "qwen3_next",
        "num_hidden_layers": 4,
        "full_attention_interval": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 32,
        "mlp_only_layers": [0],
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
    },
    # [mamba, attention, mamba] with MoE + shared MLP on every layer.
    "granitemoehybrid": {
        "model_type": "granitemoehybrid",
        "num_hidden_layers": 3,
        "layer_types": ["mamba", "attention", "mamba"],
        "intermediate_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "attention_bias": False,
        "embedding_multiplier": 1.0,
        "attention_multiplier": 0.25,
        "logits_scaling": 1.0,
        "residual_multiplier": 1.0,
        "rms_norm_eps": 1e-5,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "shared_intermediate_size": 64,
        "mamba_n_heads": 4,
        "mamba_d_head": 32,
        "mamba_expand": 2,
        "mamba_proj_bias": False,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_n_groups": 1,
        "mamba_conv_bias": True,
        "position_embedding_type": "rope",
        "rope_theta": 10000.0,
    },
    # Pure Mamba2 (recurrent only): all ArraysCache.
    "mamba2": {
        "model_type": "mamba2",
        "num_hidden_layers": 2,
        "num_heads": 4,
        "head_dim": 32,
        "intermediate_size": 128,
        "state_size": 16,
        "layer_norm_epsilon": 1e-5,
        "conv_kernel": 4,
        "n_groups": 1,
        "use_bias": False,
        "use_conv_bias": True,
        "time_step_limit": [0.0, 1e4],
        "time_step_rank": 4,
    },
    # Short gated convolutions + attention: [conv, attention, conv]. Always a tied head.
    "lfm2": {
        "model_type": "lfm2",
        "num_hidden_layers": 3,
        "layer_types": ["conv", "full_attention", "conv"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": HIDDEN,
        "block_ff_dim": 128,
        "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    },
    # Mamba(1) + attention: [mamba, attention, mamba, attention], MoE on layers 1 and 3.
    "jamba": {
        "model_type": "jamba",
        "num_hidden_layers": 4,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "attn_layer_offset": 1,
        "attn_layer_period": 2,
        "expert_layer_offset": 1,
        "expert_layer_period": 2,
        "mamba_d_conv": 4,
        "mamba_d_state": 8,
        "mamba_expand": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "rms_norm_eps": 1e-6,
    },
    # Every 3rd layer global: [sliding, sliding, full, sliding].
    "gemma3_text": {
        "model_type": "gemma3_text",
        "num_hidden_layers": 4,
        "sliding_window_pattern": 3,
        "sliding_window": WINDOW,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
    },
    # Alternating sliding/full attention with attention sinks and 4 experts (top-2).
    "gpt_oss": {
        "model_type": "gpt_oss",
        "num_hidden_layers": 3,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "sliding_window": WINDOW,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000,
    },
    # llama with per-layer sliding windows: [sliding, full, sliding].
    "llama_swa": {
        "model_type": "llama",
        "num_hidden_layers": 3,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "sliding_window": WINDOW,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
    },
    # Controls: plain full attention.
    "llama": {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
    },
    "qwen3": {
        "model_type": "qwen3",
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
    },
    # Griffin: RG-LRU recurrent blocks + local (sliding) attention: [rec, attn, rec] ->
    # [ArraysCache, RotatingKVCache(8), ArraysCache]. Attention has a single KV head.
    "recurrent_gemma": {
        "model_type": "recurrent_gemma",
        "num_hidden_layers": 3,
        "block_types": ["recurrent", "attention"],
        "attention_window_size": WINDOW,
        "attention_bias": False,
        "conv1d_width": 4,
        "intermediate_size": 128,
        "logits_soft_cap": 30.0,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "embeddings_scale_by_sqrt_dim": True,
    },
    # Every layer: CacheList(ArraysCache (last key/value for the 2-tap key/value conv),
    # RotatingKVCache(8) on sliding layers 0 and 2 / KVCache on layer 1).
    "baichuan_m1": {
        "model_type": "baichuan_m1",
        "num_hidden_layers": 3,
        "sliding_window": WINDOW,
        "sliding_window_layers": [0, 2],
        "conv_window": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_swa_attention_heads": 4,
        "num_swa_key_value_heads": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
    },
}
