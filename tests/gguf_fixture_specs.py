"""Per-architecture specs of the tiny GGUF fixtures (``tests/gguf_fixtures.py`` writes them).

Written independently of mlxserve's architecture tables, from llama.cpp's converter: the
mlx-lm config each file stands for, the GGUF name of every mlx-lm parameter, what the
converter does to a tensor on the way (q/k row permutation for llama, ``w + 1`` for Gemma
norms, the squeezed LFM2 conv kernel), the metadata it writes, and which GGUF type each
tensor gets. Widths are 256 (K-quant blocks) except the feed-forward width of 320, whose
``ffn_down`` rows fall back from K-quants to Q5_0 / Q8_0 as llama.cpp's Q4_K_M does.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

HIDDEN, FF, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 256, 320, 4, 2, 64, 2
GPT2_VOCAB = 320  # the byte-level BPE of tests/tiny_models.py
SPM_VOCAB = 400  # a SentencePiece model trained at test time
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

_BASE = {
    "hidden_size": HIDDEN,
    "num_hidden_layers": LAYERS,
    "intermediate_size": FF,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "max_position_embeddings": 4096,
}

# arch -> (mlx-lm module, config, tokenizer kind)
CONFIGS: dict[str, tuple[str, dict[str, Any], str]] = {
    "llama": (
        "llama",
        {**_BASE, "model_type": "llama", "head_dim": HEAD_DIM, "rms_norm_eps": 1e-5,
         "vocab_size": SPM_VOCAB, "rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE,
         "tie_word_embeddings": False},
        "spm",
    ),
    "qwen2": (
        "qwen2",
        {**_BASE, "model_type": "qwen2", "rms_norm_eps": 1e-6, "vocab_size": GPT2_VOCAB,
         "rope_theta": 1_000_000.0, "tie_word_embeddings": False},
        "gpt2",
    ),
    "qwen3": (
        "qwen3",
        {**_BASE, "model_type": "qwen3", "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6,
         "vocab_size": GPT2_VOCAB, "rope_theta": 1_000_000.0, "tie_word_embeddings": True},
        "gpt2",
    ),
    "qwen3moe": (
        "qwen3_moe",
        {**_BASE, "model_type": "qwen3_moe", "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6,
         "vocab_size": GPT2_VOCAB, "rope_theta": 1_000_000.0, "tie_word_embeddings": False,
         "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
         "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True},
        "gpt2",
    ),
    "gemma2": (
        "gemma2",
        {**_BASE, "model_type": "gemma2", "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6,
         "vocab_size": GPT2_VOCAB, "rope_theta": 10000.0, "query_pre_attn_scalar": HEAD_DIM,
         "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
        "gpt2",
    ),
    "gemma3": (
        "gemma3_text",
        {**_BASE, "model_type": "gemma3_text", "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6,
         "vocab_size": SPM_VOCAB, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10000.0,
         "query_pre_attn_scalar": HEAD_DIM, "sliding_window": 8, "sliding_window_pattern": 2,
         "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        "spm",
    ),
    "phi3": (
        "phi3",
        {**_BASE, "model_type": "phi3", "rms_norm_eps": 1e-5, "vocab_size": GPT2_VOCAB,
         "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
         "original_max_position_embeddings": 1024, "tie_word_embeddings": False,
         "rope_scaling": {"type": "longrope",
                          "short_factor": [1.0 + 0.05 * i for i in range(16)],
                          "long_factor": [1.0 + 0.3 * i for i in range(16)]}},
        "gpt2",
    ),
    "lfm2": (
        "lfm2",
        {"model_type": "lfm2", "vocab_size": GPT2_VOCAB, "hidden_size": HIDDEN,
         "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
         "num_key_value_heads": KV_HEADS, "max_position_embeddings": 4096, "norm_eps": 1e-5,
         "conv_bias": False, "conv_L_cache": 3, "block_dim": HIDDEN, "block_ff_dim": FF,
         "block_multiple_of": 256, "block_ffn_dim_multiplier": 1.0,
         "block_auto_adjust_ff_dim": False, "rope_theta": 1_000_000.0,
         "layer_types": ["conv", "full_attention"], "tie_word_embeddings": True},
        "gpt2",
    ),
}  # fmt: skip
ARCHES = tuple(CONFIGS)

# mlx-lm parameter name (regex) -> GGUF name (llama.cpp's convert_hf_to_gguf names).
_LAYER = r"model\.layers\.(\d+)\."
_COMMON_NAMES = [
    (r"model\.embed_tokens\.weight", "token_embd.weight"),
    (r"model\.norm\.weight", "output_norm.weight"),
    (r"model\.embedding_norm\.weight", "token_embd_norm.weight"),
    (r"lm_head\.weight", "output.weight"),
    (_LAYER + r"self_attn\.q_proj\.(weight|bias)", "blk.{0}.attn_q.{1}"),
    (_LAYER + r"self_attn\.k_proj\.(weight|bias)", "blk.{0}.attn_k.{1}"),
    (_LAYER + r"self_attn\.v_proj\.(weight|bias)", "blk.{0}.attn_v.{1}"),
    (_LAYER + r"self_attn\.(o|out)_proj\.weight", "blk.{0}.attn_output.weight"),
    (_LAYER + r"self_attn\.qkv_proj\.weight", "blk.{0}.attn_qkv.weight"),
    (_LAYER + r"self_attn\.(q_norm|q_layernorm)\.weight", "blk.{0}.attn_q_norm.weight"),
    (_LAYER + r"self_attn\.(k_norm|k_layernorm)\.weight", "blk.{0}.attn_k_norm.weight"),
    (_LAYER + r"mlp\.gate_proj\.weight", "blk.{0}.ffn_gate.weight"),
    (_LAYER + r"mlp\.(up|gate_up)_proj\.weight", "blk.{0}.ffn_up.weight"),
    (_LAYER + r"mlp\.down_proj\.weight", "blk.{0}.ffn_down.weight"),
    (_LAYER + r"mlp\.gate\.weight", "blk.{0}.ffn_gate_inp.weight"),
    (_LAYER + r"mlp\.switch_mlp\.(gate|up|down)_proj\.weight", "blk.{0}.ffn_{1}_exps.weight"),
    (_LAYER + r"feed_forward\.w1\.weight", "blk.{0}.ffn_gate.weight"),
    (_LAYER + r"feed_forward\.w3\.weight", "blk.{0}.ffn_up.weight"),
    (_LAYER + r"feed_forward\.w2\.weight", "blk.{0}.ffn_down.weight"),
    (_LAYER + r"conv\.conv\.weight", "blk.{0}.shortconv.conv.weight"),
    (_LAYER + r"conv\.in_proj\.weight", "blk.{0}.shortconv.in_proj.weight"),
    (_LAYER + r"conv\.out_proj\.weight", "blk.{0}.shortconv.out_proj.weight"),
    (_LAYER + r"(input_layernorm|operator_norm)\.weight", "blk.{0}.attn_norm.weight"),
    (_LAYER + r"ffn_norm\.weight", "blk.{0}.ffn_norm.weight"),
]
_GEMMA_NAMES = [
    (_LAYER + r"post_attention_layernorm\.weight", "blk.{0}.post_attention_norm.weight"),
    (_LAYER + r"pre_feedforward_layernorm\.weight", "blk.{0}.ffn_norm.weight"),
    (_LAYER + r"post_feedforward_layernorm\.weight", "blk.{0}.post_ffw_norm.weight"),
]
_LLAMA_NORM = [(_LAYER + r"post_attention_layernorm\.weight", "blk.{0}.ffn_norm.weight")]


def gguf_name(arch: str, mlx_name: str) -> str:
    table = (_GEMMA_NAMES if arch.startswith("gemma") else _LLAMA_NORM) + _COMMON_NAMES
    for pattern, template in table:
        if (m := re.fullmatch(pattern, mlx_name)) is not None:
            return template.format(*m.groups())
    raise KeyError(f"no GGUF name for {arch} {mlx_name}")


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's [first half; second half] rows -> pairs."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def to_gguf(arch: str, mlx_name: str, w: np.ndarray) -> np.ndarray:
    """What llama.cpp's converter does to a tensor before writing it."""
    if arch == "llama" and re.search(r"self_attn\.q_proj", mlx_name):
        return _permute(w, HEADS)
    if arch == "llama" and re.search(r"self_attn\.k_proj", mlx_name):
        return _permute(w, KV_HEADS)
    if arch.startswith("gemma") and mlx_name.endswith("norm.weight"):
        return w + 1.0
    if "conv.conv.weight" in mlx_name:
        return w.reshape(w.shape[0], w.shape[1])  # (hidden, L, 1) -> (hidden, L)
    return w


def from_gguf(arch: str, mlx_name: str, w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The inverse of ``to_gguf`` (for the float reference)."""
    if arch == "llama" and re.search(r"self_attn\.(q|k)_proj", mlx_name):
        n = HEADS if ".q_proj" in mlx_name else KV_HEADS
        return w.reshape(n, w.shape[0] // n // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    if arch.startswith("gemma") and mlx_name.endswith("norm.weight"):
        return w - 1.0
    return w.reshape(shape)


_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
_LEGACY_CYCLE = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16", "BF16", "Q5_K"]


def tensor_type(arch: str, name: str, shape: tuple[int, ...], index: int) -> str:
    """The GGUF type of each tensor: Q4_K_M-style for most, a cycle of every legacy type
    for llama, Q5_K_M-style for gemma2; norms, biases, routers and conv kernels in F32."""
    cols = shape[-1]
    if len(shape) == 1 or "shortconv.conv" in name or "ffn_gate_inp" in name:
        return "F32"
    layer = int(m.group(1)) if (m := re.match(r"blk\.(\d+)\.", name)) else -1
    if arch == "llama":
        want = _LEGACY_CYCLE[index % len(_LEGACY_CYCLE)]
    elif arch == "gemma2":
        want = "BF16" if name == "token_embd.weight" else ("Q6_K" if "attn_v" in name else "Q5_K")
    elif arch == "phi3" and name == f"blk.{LAYERS - 1}.ffn_down.weight":
        want = "MXFP4"
    elif "attn_v" in name or name == "output.weight" or ("ffn_down" in name and layer == 0):
        want = "Q6_K"
    else:
        want = "Q4_K"
    if want in _FALLBACK and cols % 256:
        want = _FALLBACK[want]
    return want


def write_metadata(writer: Any, arch: str, config: dict[str, Any]) -> None:
    """The hyper-parameters llama.cpp's converter writes for ``arch``."""
    w = writer
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_head_count(config["num_attention_heads"])
    w.add_rope_freq_base(config["rope_theta"])
    if arch == "lfm2":
        kv = [config["num_key_value_heads"] if t != "conv" else 0 for t in config["layer_types"]]
        w.add_head_count_kv(kv)
        w.add_feed_forward_length(config["block_ff_dim"])
        w.add_layer_norm_rms_eps(config["norm_eps"])
        w.add_shortconv_l_cache(config["conv_L_cache"])
        w.add_vocab_size(config["vocab_size"])
        return
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if "head_dim" in config:
        w.add_key_length(config["head_dim"])
        w.add_value_length(config["head_dim"])
    if arch == "llama":
        w.add_rope_dimension_count(config["head_dim"])
    if arch == "qwen3moe":
        w.add_expert_count(config["num_experts"])
        w.add_expert_used_count(config["num_experts_per_tok"])
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        w.add_final_logit_softcapping(config["final_logit_softcapping"])
        w.add_sliding_window(4096)
    if arch == "gemma3":
        w.add_sliding_window(config["sliding_window"])
        pattern = config["sliding_window_pattern"]
        w.add_sliding_window_pattern([(i + 1) % pattern != 0 for i in range(LAYERS)])
        w.add_rope_scaling_type(__import__("gguf").RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(config["rope_scaling"]["factor"])
    if arch == "phi3":
        head_dim = config["hidden_size"] // config["num_attention_heads"]
        w.add_rope_dimension_count(int(head_dim * config["partial_rotary_factor"]))
        w.add_rope_scaling_orig_ctx_len(config["original_max_position_embeddings"])


def llama3_rope_factors(config: dict[str, Any]) -> np.ndarray:
    """llama.cpp's LlamaModel.generate_extra_tensors: the rope_freqs of a llama3 scaling."""
    s, base, dim = config["rope_scaling"], config["rope_theta"], config["head_dim"]
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    low_wl = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wl = s["original_max_position_embeddings"] / s["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < high_wl:
            factors.append(1.0)
        elif wavelen > low_wl:
            factors.append(s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"]
            )
            factors.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(factors, dtype=np.float32)
