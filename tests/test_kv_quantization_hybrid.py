"""Quantized K/V pools on the hybrid suite's attention layers (recurrent + attention,
sliding + full, ``CacheList``): against mlx-lm with a quantized cache per attention layer
(``tests/quantized_reference.py``), recurrent state float.

The tiny architectures of ``tests/tiny_models.py`` with attention head dims raised to 32
(the smallest group size), windows of 8 that really slide, prompts chunked by 7. On the
``quantized-sdpa`` path (mlx-lm's own quantized attention) greedy tokens equal the
reference exactly; on the ``folded`` path (the CPU default; with the native op active,
every attention layer runs the op on the packed pools) they equal it on these prompts;
logprobs within the tolerances of ``tests/quantized_reference.py``.
"""

from __future__ import annotations

import logging

import pytest

from mlxserve.mlx_backend.attention import native
from mlxserve.mlx_backend.executor import MLXExecutor
from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.config import EngineConfig
from mlxserve.scheduler.engine import Engine
from tests.conftest import NoEosTokenizer
from tests.quantized_reference import assert_matches, reference, run_greedy
from tests.tiny_models import build_tiny_model

PROMPT_LENGTHS = (3, 11, 5, 20, 1, 9)
MAX_TOKENS = 12
CHUNK = 7
GROUP = 32

# Config changes that give every attention cache head dims of 32.
HEAD_DIM_32 = {
    "nemotron_h": {"head_dim": 32},  # Mamba2 + attention + MoE
    "falcon_h1": {"head_dim": 32},  # CacheList(Mamba, attention) per layer
    "qwen3_next": {"head_dim": 32},  # gated delta-net + gated attention
    "jamba": {"num_attention_heads": 2, "num_key_value_heads": 1},  # Mamba + attention
    "gemma3_text": {"head_dim": 32, "query_pre_attn_scalar": 32},  # sliding + full
    "llama_swa": {"head_dim": 32},  # sliding + full
    "recurrent_gemma": {"num_attention_heads": 2},  # RG-LRU + sliding attention
    "baichuan_m1": {  # conv-state attention, sliding + full
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "num_swa_attention_heads": 2,
    },
}


def prompts_for(lengths=PROMPT_LENGTHS) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 200 + 10 for j in range(n)] for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def models() -> dict[str, LoadedModel]:
    out = {}
    for arch, overrides in {**HEAD_DIM_32, "gpt_oss": {"head_dim": 32}}.items():
        model, _ = build_tiny_model(arch, overrides=overrides)
        out[arch] = LoadedModel(model, NoEosTokenizer(), arch, {}, context_length=512)
    return out


def run_engine(loaded: LoadedModel, path: str, prompts, bits: int, **config):
    engine = Engine(
        MLXExecutor(loaded.model, kv_attention=path),
        EngineConfig(
            max_total_tokens=512,
            max_running_requests=8,
            max_prefill_tokens=CHUNK,
            kv_bits=bits,
            kv_group_size=GROUP,
            **config,
        ),
        context_length=loaded.context_length,
    )
    engine.start()
    try:
        outputs = run_greedy(engine, prompts, MAX_TOKENS)
        assert engine.wait_idle(60), "engine did not go idle"
        engine.check_integrity()
        executor = engine.executor
        attention = {spec.pool_index for spec in executor.layout.attention}
        on_op = executor.attention.ragged_layers == attention
        return executor.quantized_attention, outputs, on_op
    finally:
        engine.shutdown()


def references(loaded, prompts, bits):
    refs = [reference(loaded.model, p, MAX_TOKENS, bits, GROUP) for p in prompts]
    return [r[0] for r in refs], [r[1] for r in refs]


class TestQuantizedSdpaPathIsExact:
    @pytest.mark.parametrize("arch", list(HEAD_DIM_32))
    def test_concurrent_chunked_requests_equal_mlx_lm_exactly(self, models, arch):
        loaded = models[arch]
        prompts = prompts_for()
        refs = references(loaded, prompts, 8)
        path, outputs, _ = run_engine(loaded, "quantized-sdpa", prompts, 8)
        assert path == "quantized-sdpa", f"{arch} fell back to {path}"
        assert_matches(f"{arch} quantized-sdpa", outputs, refs)


class TestFoldedPathWithinTolerance:
    @pytest.mark.parametrize("arch", list(HEAD_DIM_32))
    def test_concurrent_chunked_requests_match_mlx_lm(self, models, arch):
        loaded = models[arch]
        prompts = prompts_for()
        refs = references(loaded, prompts, 4)
        path, outputs, on_op = run_engine(loaded, "folded", prompts, 4)
        assert path == "folded"
        if native.native_status().quantized:
            assert on_op, f"{arch}: every attention layer should run the native op"
        assert_matches(f"{arch} folded", outputs, refs)


class TestAttentionSinksFallBack:
    def test_sinks_model_dequantizes_and_matches_mlx_lm_on_dequantized_values(self, models, caplog):
        # mlx-lm's quantized SDPA refuses attention sinks (gpt_oss): mlx-lm cannot run this
        # model on its QuantizedKVCache. The pools stay quantized and attention falls back
        # to dequantize; the reference is mlx-lm's dense attention (with sinks) on the
        # values a QuantizedKVCache holds.
        loaded = models["gpt_oss"]
        prompts = prompts_for()
        refs = [reference(loaded.model, p, MAX_TOKENS, 8, GROUP, dense=True) for p in prompts]
        with caplog.at_level(logging.WARNING, logger="mlxserve.mlx_backend.executor"):
            path, outputs, _ = run_engine(loaded, "quantized-sdpa", prompts, 8)
        assert path == "dequantize", f"gpt_oss should fall back, got {path}"
        assert "sinks" in caplog.text, f"the fallback should name its reason: {caplog.text}"
        assert_matches("gpt_oss dequantize", outputs, ([r[0] for r in refs], [r[1] for r in refs]))
        # "folded": the native op takes the sinks in the kernel; MLX's folded attention
        # declines them and they run dense.
        _, folded, _ = run_engine(loaded, "folded", prompts, 8)
        assert_matches(
            "gpt_oss folded (sinks: native op or dense)",
            folded,
            ([r[0] for r in refs], [r[1] for r in refs]),
        )
