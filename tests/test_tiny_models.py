"""The tiny random models of tests/tiny_models.py: they load, match, vary and slide.

These are the oracles the batched-engine tests compare against, so each property an
engine test relies on is checked here once per architecture: the directory loads through
``load_model``, the loaded model computes what the in-memory one does, mlx-lm's own greedy
decoding moves from token to token (and agrees with a cache-free recomputation), each
architecture has the cache layout it is meant to exercise, and sliding windows really
slide.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    CacheList,
    make_prompt_cache,
)

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.mlx_backend.loading.loader import ModelLoadError, load_model
from tests.tiny_models import (
    ARCHITECTURES,
    EOS_TOKEN_ID,
    EXTRA_ARCHITECTURES,
    GEAR_LOAD_FAILURE,
    IN_MEMORY_ARCHITECTURES,
    LEFT_PADDING_UNSAFE,
    ORACLE_PROMPTS,
    RECURRENT_ARCHITECTURES,
    RIGHT_PADDING_UNSAFE,
    SLIDING_ARCHITECTURES,
    VOCAB_SIZE,
    WINDOW,
    build_tiny_model,
    build_tiny_model_dir,
    cache_kinds,
    greedy_tokens,
)

LOADABLE = ARCHITECTURES + EXTRA_ARCHITECTURES
EVERY = LOADABLE + IN_MEMORY_ARCHITECTURES
MAX_TOKENS = 16

ROT = f"RotatingKVCache({WINDOW})"
# The layouts the engine tests rely on: one entry per make_cache() entry.
EXPECTED_CACHE_KINDS = {
    # make_cache() skips nemotron_h's MoE block: 4 layers, 3 cache entries.
    "nemotron_h": ["ArraysCache", "KVCache", "ArraysCache"],
    "falcon_h1": ["CacheList(ArraysCache, KVCache)"] * 2,
    "qwen3_next": ["ArraysCache", "KVCache", "ArraysCache", "KVCache"],
    "granitemoehybrid": ["ArraysCache", "KVCache", "ArraysCache"],
    "mamba2": ["ArraysCache", "ArraysCache"],
    "lfm2": ["ArraysCache", "KVCache", "ArraysCache"],
    "jamba": ["ArraysCache", "KVCache", "ArraysCache", "KVCache"],
    "gemma3_text": [ROT, ROT, "KVCache", ROT],
    "gpt_oss": [ROT, "KVCache", ROT],
    "llama_swa": [ROT, "KVCache", ROT],
    "llama": ["KVCache", "KVCache"],
    "qwen3": ["KVCache", "KVCache"],
    "recurrent_gemma": ["ArraysCache", ROT, "ArraysCache"],
    "baichuan_m1": [
        f"CacheList(ArraysCache, {ROT})",
        "CacheList(ArraysCache, KVCache)",
        f"CacheList(ArraysCache, {ROT})",
    ],
    "kimi_linear": ["ArraysCache", "KVCache", "ArraysCache"],
    "olmo_hybrid": ["ArraysCache", "KVCache", "ArraysCache"],
    "bailing_moe_linear": ["ArraysCache", "KVCache", "KVCache"],
    "plamo2": ["ArraysCache", "KVCache", "ArraysCache"],
    "gear": ["ArraysCache", ROT, "KVCache", "ArraysCache"],
}
# The config entry holding each sliding model's window.
WINDOW_KEYS = {"recurrent_gemma": "attention_window_size"}


@dataclass
class Tiny:
    arch: str
    path: Path | None
    model: nn.Module  # built in memory
    config: dict
    loaded: LoadedModel | None  # through load_model(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``tiny(arch)``: the architecture's model, built (and loaded) once per module."""
    built: dict[str, Tiny] = {}

    def get(arch: str) -> Tiny:
        if arch not in built:
            model, config = build_tiny_model(arch)
            path = loaded = None
            if arch in LOADABLE:
                path = build_tiny_model_dir(arch, tmp_path_factory.mktemp(arch))
                loaded = load_model(str(path))
            built[arch] = Tiny(arch, path, model, config, loaded)
        return built[arch]

    return get


def _flat_kinds(kinds: list[str]) -> str:
    return " ".join(kinds)


class TestConfig:
    @pytest.mark.parametrize("arch", EVERY)
    def test_config_is_tiny(self, tiny, arch):
        config = tiny(arch).config
        assert config["hidden_size"] == 64, f"{arch}: hidden_size {config['hidden_size']}"
        assert config["vocab_size"] == VOCAB_SIZE, f"{arch}: vocab_size {config['vocab_size']}"
        n_layers = len(tiny(arch).model.layers)
        assert 2 <= n_layers <= 4, f"{arch}: {n_layers} layers"
        for key in ("num_experts", "num_local_experts", "n_routed_experts"):
            if key in config:
                assert 2 <= config[key] <= 4, f"{arch}: {key}={config[key]}"

    @pytest.mark.parametrize("arch", EVERY)
    def test_written_config_has_model_type(self, tiny, arch, tmp_path):
        path = build_tiny_model_dir(arch, tmp_path / arch)
        written = json.loads((path / "config.json").read_text())
        assert written["model_type"] == tiny(arch).config["model_type"], (
            f"{arch}: config.json model_type {written.get('model_type')!r}"
        )
        for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            assert (path / name).is_file(), f"{arch}: {name} not written"


class TestCacheLayout:
    @pytest.mark.parametrize("arch", EVERY)
    def test_cache_kinds(self, tiny, arch):
        kinds = cache_kinds(tiny(arch).model)
        assert kinds == EXPECTED_CACHE_KINDS[arch], f"{arch}: make_cache() gives {kinds}"

    @pytest.mark.parametrize("arch", RECURRENT_ARCHITECTURES + IN_MEMORY_ARCHITECTURES)
    def test_recurrent_models_have_state_caches(self, tiny, arch):
        kinds = _flat_kinds(cache_kinds(tiny(arch).model))
        assert "ArraysCache" in kinds, f"{arch}: no recurrent-state cache in {kinds}"

    @pytest.mark.parametrize("arch", SLIDING_ARCHITECTURES + IN_MEMORY_ARCHITECTURES)
    def test_sliding_models_have_rotating_caches(self, tiny, arch):
        kinds = _flat_kinds(cache_kinds(tiny(arch).model))
        assert ROT in kinds, f"{arch}: no {ROT} in {kinds}"

    @pytest.mark.parametrize("arch", LOADABLE)
    def test_loaded_model_has_the_same_layout(self, tiny, arch):
        t = tiny(arch)
        assert cache_kinds(t.loaded.model) == cache_kinds(t.model), (
            f"{arch}: the loaded model's cache layout differs from the built one"
        )


class TestLoad:
    @pytest.mark.parametrize("arch", LOADABLE)
    def test_loads_through_load_model(self, tiny, arch):
        t = tiny(arch)
        assert t.loaded.model_id == t.path.name, f"{arch}: model_id {t.loaded.model_id!r}"
        assert t.loaded.config["model_type"] == t.config["model_type"], (
            f"{arch}: loaded config model_type {t.loaded.config['model_type']!r}"
        )

    @pytest.mark.parametrize("arch", LOADABLE)
    def test_logits_match_in_memory_model(self, tiny, arch):
        t = tiny(arch)
        tokens = mx.array([ORACLE_PROMPTS[2]])
        built = np.array(t.model(tokens))
        loaded = np.array(t.loaded.model(tokens))
        assert built.shape == loaded.shape == (1, len(ORACLE_PROMPTS[2]), VOCAB_SIZE), (
            f"{arch}: logits shapes {built.shape} vs {loaded.shape}"
        )
        worst = float(np.abs(built - loaded).max())
        assert np.allclose(built, loaded, rtol=1e-4, atol=1e-4), (
            f"{arch}: loaded logits differ from the in-memory model's by up to {worst}"
        )

    @pytest.mark.parametrize("arch", IN_MEMORY_ARCHITECTURES)
    @pytest.mark.xfail(reason=GEAR_LOAD_FAILURE, raises=ModelLoadError, strict=False)
    def test_in_memory_only_architectures_load(self, arch, tmp_path):
        # Documents the failure; an XPASS means transformers or mlx-lm fixed it and the
        # architecture can move to EXTRA_ARCHITECTURES.
        load_model(str(build_tiny_model_dir(arch, tmp_path / arch)))


class TestTokenizer:
    @pytest.mark.parametrize("arch", ["llama", "nemotron_h"])
    def test_round_trip_and_eos(self, tiny, arch):
        tokenizer = tiny(arch).loaded.tokenizer
        text = "the cat sat on the mat, ünïcödé!"
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text, f"{arch}: {ids} decodes differently"
        assert all(0 <= i < VOCAB_SIZE for i in ids), f"{arch}: ids out of range: {ids}"
        assert len(ids) < len(text.encode()), f"{arch}: no merges were applied: {ids}"
        assert set(tokenizer.eos_token_ids) == {EOS_TOKEN_ID}, (
            f"{arch}: eos ids {tokenizer.eos_token_ids}"
        )
        assert len(tokenizer.get_vocab()) == VOCAB_SIZE, f"{arch}: tokenizer vocab size"


class TestGreedyOracle:
    @pytest.mark.parametrize("arch", LOADABLE)
    def test_greedy_output_varies(self, tiny, arch):
        model = tiny(arch).loaded.model
        for prompt in ORACLE_PROMPTS:
            out = greedy_tokens(model, prompt, MAX_TOKENS)
            assert len(out) == MAX_TOKENS, f"{arch}: {len(out)} tokens for {len(prompt)}"
            assert len(set(out)) >= MAX_TOKENS // 2, (
                f"{arch}: greedy output for a {len(prompt)}-token prompt barely varies: {out}"
            )
            assert EOS_TOKEN_ID not in out, f"{arch}: emitted eos: {out}"

    @pytest.mark.parametrize("arch", IN_MEMORY_ARCHITECTURES)
    def test_in_memory_greedy_output_varies(self, tiny, arch):
        for prompt in ORACLE_PROMPTS:
            out = greedy_tokens(tiny(arch).model, prompt, MAX_TOKENS)
            assert len(set(out)) >= MAX_TOKENS // 2, f"{arch}: barely varies: {out}"

    @pytest.mark.parametrize("arch", EVERY)
    def test_cached_decoding_matches_recomputation(self, tiny, arch):
        # The oracle itself must be right: each greedy token is also the argmax of a
        # cache-free forward pass over the prompt and the tokens before it.
        model = tiny(arch).model
        for prompt in ORACLE_PROMPTS:
            out = greedy_tokens(model, prompt, MAX_TOKENS)
            logits = model(mx.array([prompt + out[:-1]]))[0, len(prompt) - 1 :]
            recomputed = mx.argmax(logits, axis=-1).tolist()
            assert recomputed == out, (
                f"{arch}: cached greedy {out} != recomputed {recomputed} "
                f"for a {len(prompt)}-token prompt"
            )


class TestSlidingWindow:
    @pytest.mark.parametrize("arch", SLIDING_ARCHITECTURES + IN_MEMORY_ARCHITECTURES)
    def test_rotating_caches_wrap(self, tiny, arch):
        model = tiny(arch).model
        cache = make_prompt_cache(model)
        prompt = ORACLE_PROMPTS[2]
        assert len(prompt) > WINDOW
        logits = model(mx.array([prompt]), cache=cache)
        model(mx.argmax(logits[:, -1:], axis=-1), cache=cache)
        rotating = [
            c
            for entry in cache
            for c in getattr(entry, "caches", [entry])
            if type(c).__name__ == "RotatingKVCache"
        ]
        assert rotating, f"{arch}: no rotating caches"
        for c in rotating:
            assert c.offset == len(prompt) + 1, f"{arch}: offset {c.offset}"
            assert c.keys.shape[2] == WINDOW, (
                f"{arch}: rotating cache holds {c.keys.shape[2]} positions, not {WINDOW}"
            )

    @pytest.mark.parametrize("arch", SLIDING_ARCHITECTURES + IN_MEMORY_ARCHITECTURES)
    def test_window_changes_the_output(self, tiny, arch):
        # Same weights, a window longer than the prompt: the logits must differ, or the
        # window would not be exercised by prompts of this length.
        key = WINDOW_KEYS.get(arch, "sliding_window")
        wide, _ = build_tiny_model(arch, overrides={key: 4096})
        tokens = mx.array([ORACLE_PROMPTS[2]])
        narrow_logits = np.array(tiny(arch).model(tokens))
        wide_logits = np.array(wide(tokens))
        head = WINDOW  # positions before the window is full see the same keys
        assert np.allclose(narrow_logits[:, :head], wide_logits[:, :head], atol=1e-4), (
            f"{arch}: the window changed logits of positions inside it"
        )
        assert not np.allclose(narrow_logits[:, head:], wide_logits[:, head:], atol=1e-3), (
            f"{arch}: a {WINDOW}-token window gives the same logits as a 4096-token one"
        )


def _batch_cache(entry, left_padding: list[int]):
    """The batched counterpart of one make_cache() entry, as mlx-lm's batching builds it."""
    kind = type(entry).__name__
    if kind == "KVCache":
        return BatchKVCache(left_padding)
    if kind == "RotatingKVCache":
        return BatchRotatingKVCache(entry.max_size, left_padding)
    if kind == "ArraysCache":
        return ArraysCache(len(entry.cache), left_padding=left_padding)
    if kind == "CacheList":
        return CacheList(*(_batch_cache(c, left_padding) for c in entry.caches))
    raise TypeError(f"no batched cache for {kind}")


def _next_logits_single(model, prompt: list[int], token: int) -> np.ndarray:
    cache = make_prompt_cache(model)
    model(mx.array([prompt]), cache=cache)
    return np.array(model(mx.array([[token]]), cache=cache)[0, -1])


class TestMlxLmBatchedPadding:
    """Which models mlx-lm itself can prefill padded in a batch (the prompts differ in
    length); the ones listed as unsafe in tiny_models are skipped, not asserted broken."""

    TOKEN = 5

    @pytest.mark.parametrize("arch", [a for a in EVERY if a not in LEFT_PADDING_UNSAFE])
    def test_left_padded_prefill_is_exact(self, tiny, arch):
        model = tiny(arch).model
        prompts = ORACLE_PROMPTS
        longest = max(map(len, prompts))
        padding = [longest - len(p) for p in prompts]
        cache = [_batch_cache(c, padding) for c in make_prompt_cache(model)]
        model(mx.array([[0] * pad + p for pad, p in zip(padding, prompts, strict=True)]), cache)
        got = np.array(model(mx.array([[self.TOKEN]] * len(prompts)), cache=cache)[:, -1])
        for i, prompt in enumerate(prompts):
            want = _next_logits_single(model, prompt, self.TOKEN)
            assert np.allclose(got[i], want, atol=1e-4), (
                f"{arch}: left-padded row {i} ({len(prompt)} tokens) differs by "
                f"{float(np.abs(got[i] - want).max())}"
            )

    @pytest.mark.parametrize("arch", [a for a in EVERY if a not in RIGHT_PADDING_UNSAFE])
    def test_right_padded_prefill_is_exact(self, tiny, arch):
        model = tiny(arch).model
        prompts = ORACLE_PROMPTS
        lengths = [len(p) for p in prompts]
        longest = max(lengths)
        cache = [_batch_cache(c, [0] * len(prompts)) for c in make_prompt_cache(model)]
        for c in cache:
            c.prepare(lengths=lengths, right_padding=[longest - n for n in lengths])
        model(mx.array([p + [0] * (longest - len(p)) for p in prompts]), cache=cache)
        for c in cache:
            c.finalize()
        got = np.array(model(mx.array([[self.TOKEN]] * len(prompts)), cache=cache)[:, -1])
        for i, prompt in enumerate(prompts):
            want = _next_logits_single(model, prompt, self.TOKEN)
            assert np.allclose(got[i], want, atol=1e-4), (
                f"{arch}: right-padded row {i} ({len(prompt)} tokens) differs by "
                f"{float(np.abs(got[i] - want).max())}"
            )
