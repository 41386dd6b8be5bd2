"""Tiny random-weight models of many mlx-lm architectures, saved as loadable model dirs.

Each architecture gets a config small enough to run in milliseconds on a CPU but with at
least one layer of every kind it has (attention + recurrent for hybrids, sliding + full
attention for sliding-window models), a sliding window of ``WINDOW`` tokens so windows
really slide, and 2-4 tiny experts for MoE models. ``build_tiny_model_dir`` writes
``config.json``, ``model.safetensors`` and a byte-level BPE tokenizer, so the directory
loads through ``mlxserve.mlx_backend.loading.loader.load_model`` (that is, ``mlx_lm.utils.load``).

The weights are random but scaled so that greedy decoding moves from token to token
(untied heads where the architecture allows, unit-scale embeddings for those, linear
weights drawn from normal(0, 1/sqrt(fan_in))), which makes a wrong cache read show up as
a different token. The end-of-sequence token exists in the tokenizer but its output row
is zeroed, so a random model practically never emits it.

Not here: an all-sliding mistral (mlx-lm maps ``mistral`` to ``llama``, which ignores
``sliding_window`` without ``layer_types`` and needs a ``full_attention`` layer with
them), and gear's directory (``IN_MEMORY_ARCHITECTURES``: transformers rejects its
config when the tokenizer is loaded).

Usage::

    path = build_tiny_model_dir("nemotron_h", tmp_path / "nemotron_h")
    loaded = load_model(str(path))
    cache_kinds(loaded.model)  # ["ArraysCache", "KVCache", "ArraysCache"]
"""

from __future__ import annotations

import copy
import importlib
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxserve.server.serving.token_logprobs import bytes_to_unicode
from tests.tiny_model_configs import (  # noqa: F401 - part of this module's interface
    COMMON,
    CONFIGS,
    EOS_TOKEN,
    EOS_TOKEN_ID,
    HEAD_GAIN,
    HIDDEN,
    NUM_MERGES,
    TIED_EMBED_STD,
    VOCAB_SIZE,
    WINDOW,
)

# Recurrent + full-attention hybrids beyond the list above, with other recurrent cache
# layouts (checked because they might mix in sliding layers; they do not).
_EXTRA_CONFIGS: dict[str, dict[str, Any]] = {
    # Kimi delta attention (ArraysCache(4): q/k/v conv states + ssm state) and MLA full
    # attention whose KVCache holds (latent, rope-key) pairs of different widths:
    # [kda, mla, kda]; MoE after layer 0.
    "kimi_linear": {
        "model_type": "kimi_linear",
        "num_hidden_layers": 3,
        "linear_attn_config": {
            "kda_layers": [1, 3],
            "full_attn_layers": [2],
            "num_heads": 4,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
        },
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 16,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "mla_use_nope": True,
        "num_experts": 4,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "model_max_length": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
    },
    # Gated delta-net with separate q/k/v convs (ArraysCache(4)): [linear, full, linear].
    "olmo_hybrid": {
        "model_type": "olmo_hybrid",
        "num_hidden_layers": 3,
        "layer_types": ["linear_attention", "full_attention", "linear_attention"],
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "linear_allow_neg_eigval": True,
        "attention_bias": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
    },
    # Lightning / gated linear attention (ArraysCache(1): the state matrix) + attention:
    # layer_group_size 2 over 3 layers -> [linear, attention, attention]; MoE after layer 0.
    "bailing_moe_linear": {
        "model_type": "bailing_moe_linear",
        "num_hidden_layers": 3,
        "layer_group_size": 2,
        "group_norm_size": 1,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_experts": 4,
        "num_shared_experts": 1,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
    },
    # Mamba2 + attention alternating (mamba_step 2): [mamba, attention, mamba]. Its
    # attention_window_size is not used for caching (KVCache; a TODO in mlx-lm).
    "plamo2": {
        "model_type": "plamo2",
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size_per_head": 16,
        "attention_window_size": WINDOW,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_num_heads": 4,
        "mamba_step": 2,
        "mamba_chunk_size": 16,
        "intermediate_size": 128,
        "rms_norm_eps": 1e-6,
    },
}

# Builds and runs in memory, but its directory does not load: transformers (which
# mlx-lm's tokenizer loading runs on config.json) rejects the "conv_mixer" layer type.
_IN_MEMORY_CONFIGS: dict[str, dict[str, Any]] = {
    # Conv-gated KV mixers + sliding + full attention, the only layout with all three
    # cache kinds: [conv_mixer, sliding, full, conv_mixer] ->
    # [ArraysCache, RotatingKVCache(8), KVCache, ArraysCache].
    "gear": {
        "model_type": "gear",
        "num_hidden_layers": 4,
        "layer_types": ["conv_mixer", "sliding_attention", "full_attention", "conv_mixer"],
        "sliding_window": WINDOW,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "conv_L_cache": 3,
        "rms_norm_eps": 1e-6,
    },
}

# What the brief asked for (plus the recurrent + sliding hybrids found in mlx-lm).
ARCHITECTURES: list[str] = list(CONFIGS)
# Extra recurrent + full-attention hybrids; they also load from a dir.
EXTRA_ARCHITECTURES: list[str] = list(_EXTRA_CONFIGS)
# Only through build_tiny_model (see _IN_MEMORY_CONFIGS).
IN_MEMORY_ARCHITECTURES: list[str] = list(_IN_MEMORY_CONFIGS)
GEAR_LOAD_FAILURE = (
    "transformers' config validation (run by AutoTokenizer on config.json) rejects the "
    "'conv_mixer' layer type; load_model reports it as a one-line ModelLoadError"
)

# The loadable architectures with at least one recurrent-state (ArraysCache) cache, and
# those with at least one sliding-window (RotatingKVCache) cache.
RECURRENT_ARCHITECTURES: list[str] = [
    "nemotron_h",
    "falcon_h1",
    "qwen3_next",
    "granitemoehybrid",
    "mamba2",
    "lfm2",
    "jamba",
    "recurrent_gemma",
    "baichuan_m1",
    *EXTRA_ARCHITECTURES,
]
SLIDING_ARCHITECTURES: list[str] = [
    "gemma3_text",
    "gpt_oss",
    "llama_swa",
    "recurrent_gemma",
    "baichuan_m1",
]

# Where mlx-lm's own padded batch prefill is not exact (measured with its Batch*Cache
# classes; the unpadded longest prompt is always right). Left padding: the recurrent layers
# ignore the padding mask (jamba's Mamba, recurrent_gemma's RG-LRU and conv, baichuan_m1's
# key/value conv state, olmo_hybrid's q/k/v conv states, bailing_moe_linear's linear
# attention), so pad tokens leak into the state. Right padding (``cache.prepare(lengths=)``)
# breaks those and also nemotron_h, whose Mamba2 passes the mask but not ``cache.lengths``
# to ``ssm_update``, so a padded row's SSM state ends up empty.
LEFT_PADDING_UNSAFE: list[str] = [
    "jamba",
    "recurrent_gemma",
    "baichuan_m1",
    "olmo_hybrid",
    "bailing_moe_linear",
]
RIGHT_PADDING_UNSAFE: list[str] = [*LEFT_PADDING_UNSAFE, "nemotron_h"]

_ALL_CONFIGS = {**CONFIGS, **_EXTRA_CONFIGS, **_IN_MEMORY_CONFIGS}


def tiny_config(arch: str) -> dict[str, Any]:
    """The config.json contents for ``arch`` (a fresh copy)."""
    if arch not in _ALL_CONFIGS:
        raise ValueError(f"unknown tiny architecture {arch!r}; known: {list(_ALL_CONFIGS)}")
    config = copy.deepcopy(COMMON)
    config.update(copy.deepcopy(_ALL_CONFIGS[arch]))
    return config


def _model_module(config: dict[str, Any]):
    from mlx_lm.utils import MODEL_REMAPPING

    model_type = MODEL_REMAPPING.get(config["model_type"], config["model_type"])
    return importlib.import_module(f"mlx_lm.models.{model_type}")


def _fan_in(name: str, shape: tuple[int, ...]) -> int:
    # mlx Conv1d weights are (out, kernel, in / groups); everything else multiplies the
    # input against its last axis (Linear (out, in), SwitchLinear (experts, out, in)).
    if "conv" in name and len(shape) == 3:
        return shape[1] * shape[2]
    return shape[-1]


# State-space parameters whose mlx-lm init is already meaningful (decay rates, skip
# gains); random normal values there would make the recurrences blow up.
_KEEP_INIT = {"A_log", "D", "dt_bias"}


def _random_weights(model: nn.Module) -> list[tuple[str, mx.array]]:
    params = tree_flatten(model.parameters())
    embeddings = {
        f"{name}.weight"
        for name, module in model.named_modules()
        if isinstance(module, nn.Embedding)
    }
    heads = {name for name, _ in params if name.endswith("lm_head.weight")}
    # The output projection is lm_head, or the embedding when the head is tied. With a
    # tied head a unit-scale embedding of the input token dominates the residual stream
    # and the model keeps repeating its input; a small one does not.
    if not heads:
        heads = embeddings
    embed_std = 1.0 if heads != embeddings else TIED_EMBED_STD
    weights = []
    for name, w in params:
        leaf = name.rsplit(".", 1)[-1]
        if w.ndim >= 2 and leaf not in _KEEP_INIT and not leaf.endswith(("bias", "biases")):
            std = embed_std if name in embeddings else _fan_in(name, w.shape) ** -0.5
            if name in heads and name not in embeddings:
                std *= HEAD_GAIN
            w = mx.random.normal(w.shape) * std
            if name in heads:
                # A zero output row makes the eos logit exactly 0, below the max of the
                # other (random) logits, so greedy decoding never stops on its own.
                w[EOS_TOKEN_ID] = 0.0
        elif leaf == "sinks":
            w = mx.random.normal(w.shape)
        weights.append((name, w.astype(mx.float32)))
    return weights


# Where the head cannot carry HEAD_GAIN (tied to the embedding, or row-normalized by
# sanitize), the final norm's weight does.
_FINAL_NORMS = {"lfm2": "model.embedding_norm.weight", "baichuan_m1": "model.norm.weight"}


def build_tiny_model(
    arch: str, seed: int = 0, overrides: dict[str, Any] | None = None
) -> tuple[nn.Module, dict[str, Any]]:
    """Build the random model for ``arch`` in memory through mlx-lm's own classes.

    Args:
        arch: a name from ``ARCHITECTURES``, ``EXTRA_ARCHITECTURES`` or
            ``IN_MEMORY_ARCHITECTURES``.
        seed: seeds mlx's global random state; the same seed gives the same weights.
        overrides: config entries to replace. Ones that keep every parameter shape (a
            window size, say) keep the weights too.

    Returns:
        ``(model, config)``: the model in eval mode with the weights that
        ``build_tiny_model_dir`` saves (already passed through ``model.sanitize``, so a
        load reproduces them), and the config dict.
    """
    config = tiny_config(arch)
    config.update(copy.deepcopy(overrides or {}))
    module = _model_module(config)
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    weights = _random_weights(model)
    if arch in _FINAL_NORMS:
        weights = [
            (name, w * HEAD_GAIN if name == _FINAL_NORMS[arch] else w) for name, w in weights
        ]
    if hasattr(model, "sanitize"):
        # Whatever load-time transform sanitize applies to these names (e.g. baichuan_m1
        # normalizes lm_head rows) is applied here too, so loading is a fixed point.
        weights = list(model.sanitize(dict(weights)).items())
    model.load_weights(weights, strict=True)
    model.eval()
    mx.eval(model.parameters())
    return model, config


def _byte_level_tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    # bytes_to_unicode order: byte b has id b.
    byte_chars = bytes_to_unicode()
    assert sorted(byte_chars.values()) == sorted(alphabet)
    vocab = {byte_chars[b]: b for b in range(256)}
    merges: list[tuple[str, str]] = []
    space = byte_chars[ord(" ")]
    pairs = [(space, c) for c in "tashwiobmfcdplnegruy"]
    pairs += [(a, b) for a, b in ("th", "he", "in", "er", "an", "re", "on", "at", "en", "nd")]
    pairs += [(a, b) for a, b in ("ti", "es", "or", "te", "of", "ed", "is", "it", "al", "ar")]
    pairs += [(a, b) for a, b in ("st", "to", "nt", "ng", "se", "ha", "as", "ou", "io", "le")]
    pairs += [(a, b) for a, b in ("ve", "co", "me", "de", "hi", "ri", "ro", "ic", "ne")]
    pairs += [(a, b) for a, b in ("ea", "ra", "ce", "li")]
    assert len(pairs) == NUM_MERGES, len(pairs)
    for a, b in pairs:
        merges.append((a, b))
        vocab[a + b] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([EOS_TOKEN])
    assert tokenizer.token_to_id(EOS_TOKEN) == EOS_TOKEN_ID
    assert tokenizer.get_vocab_size() == VOCAB_SIZE
    return tokenizer.to_str()


_TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "eos_token": EOS_TOKEN,
    "bos_token": None,
    "unk_token": None,
    "pad_token": EOS_TOKEN,
    "model_max_length": 4096,
    "clean_up_tokenization_spaces": False,
    "chat_template": (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    ),
}


def build_tiny_model_dir(arch: str, path: Path, seed: int = 0) -> Path:
    """Write a loadable model dir for ``arch`` at ``path`` (created if missing).

    Writes ``config.json``, ``model.safetensors`` (float32, the parameter names of the
    mlx-lm model, which its ``sanitize`` leaves as they are) and a byte-level BPE
    ``tokenizer.json`` + ``tokenizer_config.json`` (eos ``<|endoftext|>``, id
    ``EOS_TOKEN_ID``, which the model practically never emits).

    Returns:
        ``path``.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model, config = build_tiny_model(arch, seed)
    mx.save_safetensors(
        str(path / "model.safetensors"),
        dict(tree_flatten(model.parameters())),
        metadata={"format": "mlx"},
    )
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (path / "tokenizer.json").write_text(_byte_level_tokenizer_json())
    (path / "tokenizer_config.json").write_text(json.dumps(_TOKENIZER_CONFIG, indent=2) + "\n")
    return path


def _describe(cache: Any) -> str:
    name = type(cache).__name__
    if name == "RotatingKVCache":
        return f"RotatingKVCache({cache.max_size})"
    if name == "CacheList":
        return f"CacheList({', '.join(_describe(c) for c in cache.caches)})"
    return name


def cache_kinds(model: nn.Module) -> list[str]:
    """The kind of each entry of the model's prompt cache, in order.

    The class name of each ``model.make_cache()`` entry (``KVCache`` per layer when the
    model has no ``make_cache``), with the size for rotating caches and the parts of a
    ``CacheList``: e.g. ``["RotatingKVCache(8)", "KVCache"]`` or
    ``["CacheList(ArraysCache, KVCache)"]``. Note that the list follows ``make_cache()``,
    which for nemotron_h has no entries for its MLP / MoE blocks.
    """
    from mlx_lm.models.cache import make_prompt_cache

    return [_describe(c) for c in make_prompt_cache(model)]


# Prompts of 5, 11 and 20 tokens: the last two are longer than WINDOW, so their sliding
# layers attend to a window, not the whole prompt. (A RotatingKVCache keeps a whole
# prefill's keys until the next step, then trims to WINDOW.)
ORACLE_PROMPTS: list[list[int]] = [
    [72, 101, 108, 108, 111],
    [(7 * i + 3) % EOS_TOKEN_ID for i in range(11)],
    [(31 * i + 17) % EOS_TOKEN_ID for i in range(20)],
]


def greedy_tokens(model: nn.Module, prompt: list[int], max_tokens: int = 16) -> list[int]:
    """mlx-lm's own single-sequence greedy decoding (``generate_step``): the oracle."""
    from mlx_lm.generate import generate_step

    def sampler(logprobs: mx.array) -> mx.array:
        return mx.argmax(logprobs, axis=-1)

    steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens, sampler=sampler)
    return [int(token) for token, _ in steps]
