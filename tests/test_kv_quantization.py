"""Quantized K/V pools (``--kv-bits``) on a tiny llama: against mlx-lm's quantized cache,
through batching, chunked prefill, the prefix cache, preemption and decode row groups.

The reference is mlx-lm generating each prompt alone on a ``QuantizedKVCache(group_size,
bits)`` per layer from the first token (``tests/quantized_reference.py``). Which path
attention takes decides what "equal" means, and each test's name says which holds:

- ``quantized-sdpa`` (Metal's default; forced here on the CPU) runs mlx-lm's own
  quantized attention on the pool's packed rows: greedy tokens equal the reference
  exactly, whatever the batching.
- ``folded`` (the CPU default) and ``dequantize`` compute the same attention in another
  order: greedy tokens equal on these prompts. With the native op active, "folded" runs
  the op on the packed pools (in-kernel dequantization, every layer ragged, packed steps);
  ``native_off`` forces MLX's folded attention for the tests of that path.

Logprobs agree within the tolerances of ``tests/quantized_reference.py`` on every path
(not bit for bit: a last-bit difference upstream can move a value across a quantization
level).

The tiny llama has head dim 32 (the smallest group size is 32) and, with
``HEAD_DIM_64``, 64 so that group size 32 means two groups per row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from mlxserve.mlx_backend.attention import dispatch as attention_dispatch
from mlxserve.mlx_backend.attention import native
from mlxserve.mlx_backend.executor import MLXExecutor
from mlxserve.mlx_backend.kv import cache_view
from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler import row_groups
from mlxserve.scheduler.config import EngineConfig
from mlxserve.scheduler.engine import Engine
from tests.conftest import audit_and_stop, make_tiny_llama
from tests.quantized_reference import (
    ROUNDING_TOL,
    assert_matches,
    logprob_gaps,
    reference,
    run_greedy,
)

MLX_LM_SDPA = attention_dispatch._mlx_lm_sdpa
NATIVE_QUANTIZED = native.native_status().quantized
needs_native_quantized = pytest.mark.skipif(
    not NATIVE_QUANTIZED, reason=native.native_status().quantized_reason
)

PROMPT_LENGTHS = (3, 11, 5, 40, 1, 9, 26)
MAX_TOKENS = 12
CHUNK = 7


def make_llama(head_dim: int = 32, seed: int = 0) -> LoadedModel:
    """``tests/conftest.py:make_tiny_llama`` with 2 K/V heads of ``head_dim`` (a group size
    must divide it)."""
    return make_tiny_llama(seed, head_dim=head_dim)


@pytest.fixture(scope="module")
def llama32() -> LoadedModel:
    return make_llama(32)


@pytest.fixture(scope="module")
def llama64() -> LoadedModel:
    return make_llama(64)


def prompts_for(lengths=PROMPT_LENGTHS) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 200 + 10 for j in range(n)] for i, n in enumerate(lengths)]


@pytest.fixture
def quant_engine() -> Iterator[Callable[..., Engine]]:
    """Started engines over an MLX executor with the given attention path; on teardown
    each must go idle with every slot accounted for."""
    engines: list[Engine] = []

    def build(loaded: LoadedModel, path: str | None = None, **config) -> Engine:
        engine = Engine(
            MLXExecutor(loaded.model, kv_attention=path),
            EngineConfig(**config),
            context_length=loaded.context_length,
        )
        engine.start()
        engines.append(engine)
        return engine

    yield build
    audit_and_stop(engines)


@pytest.fixture
def native_off(monkeypatch) -> None:
    """The native op declines quantized pools (as when its quantized self-test failed):
    "folded" runs MLX's folded attention."""
    off = dataclasses.replace(
        native.native_status(), quantized=False, quantized_reason="switched off by a test"
    )
    monkeypatch.setattr(native, "_status", off)


def references(loaded, prompts, bits, group_size, max_tokens=MAX_TOKENS):
    refs = [reference(loaded.model, p, max_tokens, bits, group_size) for p in prompts]
    return [r[0] for r in refs], [r[1] for r in refs]


class TestTheReferenceSeesQuantization:
    @pytest.mark.parametrize("bits", [8, 4])
    def test_quantized_reference_logprobs_differ_from_the_float_cache(self, llama32, bits):
        # Otherwise the exactness tests below could not tell a quantized pool from a
        # float one.
        prompts = prompts_for()[:3]
        _, quant = references(llama32, prompts, bits, 32)
        _, float_ = references(llama32, prompts, None, 32)
        gaps = logprob_gaps(quant, float_)
        assert np.median(gaps) > 10 * ROUNDING_TOL, (
            f"{bits}-bit K/V moved the median logprob by only {np.median(gaps):.1e}"
        )


class TestQuantizedSdpaPathIsExact:
    @pytest.mark.parametrize("bits", [8, 4])
    def test_concurrent_chunked_requests_equal_mlx_lm_exactly(self, llama32, quant_engine, bits):
        prompts = prompts_for()
        refs = references(llama32, prompts, bits, 32)
        engine = quant_engine(
            llama32,
            "quantized-sdpa",
            max_total_tokens=512,
            max_running_requests=8,
            max_prefill_tokens=CHUNK,
            kv_bits=bits,
            kv_group_size=32,
        )
        assert engine.executor.quantized_attention == "quantized-sdpa"
        assert_matches(f"{bits}-bit", run_greedy(engine, prompts, MAX_TOKENS), refs)

    def test_two_groups_per_row_equal_mlx_lm_exactly(self, llama64, quant_engine):
        prompts = prompts_for()[:4]
        refs = references(llama64, prompts, 4, 32)
        engine = quant_engine(
            llama64, "quantized-sdpa", max_total_tokens=512, kv_bits=4, kv_group_size=32
        )
        assert_matches("4-bit group 32", run_greedy(engine, prompts, MAX_TOKENS), refs)


class TestFoldedAndDequantizePathsWithinTolerance:
    @pytest.mark.parametrize("path", ["folded", "folded-mlx", "dequantize"])
    @pytest.mark.parametrize(
        ("bits", "head_dim", "group_size"), [(8, 32, 32), (4, 64, 32), (4, 64, 64)]
    )
    def test_concurrent_requests_match_mlx_lm_within_tolerance(
        self, llama32, llama64, quant_engine, monkeypatch, path, bits, head_dim, group_size
    ):
        # "folded": the native op where it is active; "folded-mlx": MLX's folded attention.
        if path == "folded-mlx":
            off = dataclasses.replace(native.native_status(), quantized=False)
            monkeypatch.setattr(native, "_status", off)
            path = "folded"
        loaded = llama32 if head_dim == 32 else llama64
        prompts = prompts_for()
        refs = references(loaded, prompts, bits, group_size)
        engine = quant_engine(
            loaded,
            path,
            max_total_tokens=512,
            max_running_requests=8,
            max_prefill_tokens=CHUNK,
            kv_bits=bits,
            kv_group_size=group_size,
        )
        assert engine.executor.quantized_attention == path
        label = f"{path} {bits}-bit d{head_dim} g{group_size}"
        assert_matches(label, run_greedy(engine, prompts, MAX_TOKENS), refs)

    def test_folded_path_runs_its_own_attention(
        self, llama32, quant_engine, monkeypatch, native_off
    ):
        calls = []
        original = cache_view.folded_attention

        def counting(*args, **kwargs):
            calls.append(args[1].shape)
            return original(*args, **kwargs)

        monkeypatch.setattr(cache_view, "folded_attention", counting)
        engine = quant_engine(llama32, "folded", max_total_tokens=256, kv_bits=8, kv_group_size=32)
        run_greedy(engine, prompts_for((5,)), 3)
        # 2 layers x (1 prefill + 2 decode) forwards.
        assert len(calls) == 6, f"the folded attention ran {len(calls)} times, not 6"
        assert mx.uint32 == engine.executor.kv.k[0].dtype, "the pool should hold packed rows"


@needs_native_quantized
class TestNativeOpOnQuantizedPoolsWithinTolerance:
    """The CPU default with the native op: every layer on the op, steps packed and unsplit;
    it dequantizes in another order than mlx-lm's quantized SDPA, so greedy tokens equal
    the reference on these prompts and logprobs within ``assert_matches``' tolerances."""

    def test_every_layer_runs_on_the_op_with_packed_steps(self, llama32, quant_engine, monkeypatch):
        calls = []
        original = native.ragged_attention

        def counting(*args, **kwargs):
            calls.append((kwargs["bits"], kwargs["group_size"], args[1].dtype))
            return original(*args, **kwargs)

        monkeypatch.setattr(native, "ragged_attention", counting)
        engine = quant_engine(llama32, max_total_tokens=256, kv_bits=4, kv_group_size=32)
        run_greedy(engine, prompts_for((5,)), 3)
        executor = engine.executor
        specs = {s.pool_index for s in executor.layout.attention}
        assert executor.attention.ragged_layers == specs, executor.attention.fallbacks
        assert "dequantized in the kernel" in executor.attention.path, executor.attention.path
        assert engine.scheduler.plan.ragged_attention, "quantized pools should run packed steps"
        # 2 layers x (1 prefill + 2 decode) forwards, each on the packed uint32 pools.
        assert calls == [(4, 32, mx.uint32)] * 6, calls

    @pytest.mark.parametrize("bits", [8, 4])
    def test_prefix_cache_hits_reuse_quantized_slots(self, llama32, quant_engine, bits):
        base = prompts_for((30,))[0]
        prompts = [base[:20], base, base[:25] + [99, 98]]
        refs = references(llama32, prompts, bits, 32)
        engine = quant_engine(llama32, max_total_tokens=512, kv_bits=bits, kv_group_size=32)
        outputs, hits = one_after_another(engine, prompts)
        assert 0 < hits[1] < hits[2], f"the later prompts should hit the cache: {hits}"
        assert_matches(f"native op prefix cache {bits}-bit", outputs, refs)

    @pytest.mark.parametrize("bits", [8, 4])
    def test_preempted_chunked_requests(self, llama32, quant_engine, bits):
        prompts = prompts_for((4, 6, 5, 7, 3, 6))
        refs = references(llama32, prompts, bits, 32, max_tokens=20)
        engine = quant_engine(
            llama32,
            max_total_tokens=64,
            max_running_requests=6,
            max_prefill_tokens=CHUNK,
            kv_bits=bits,
            kv_group_size=32,
        )
        outputs = run_greedy(engine, prompts, 20, late=False)
        assert engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
        assert_matches(f"native op preempted {bits}-bit", outputs, refs)


class TestQuantizedPoolsUnderEngineFeatures:
    """Exact path, so every difference is a bug of the feature, not rounding."""

    def test_prefix_cache_hits_reuse_quantized_slots_exactly(self, llama32, quant_engine):
        base = prompts_for((30,))[0]
        prompts = [base[:20], base, base[:25] + [99, 98]]
        refs = references(llama32, prompts, 8, 32)
        engine = quant_engine(
            llama32, "quantized-sdpa", max_total_tokens=512, kv_bits=8, kv_group_size=32
        )
        outputs, hits = one_after_another(engine, prompts)
        assert 0 < hits[1] < hits[2], f"the later prompts should hit the cache: {hits}"
        assert_matches("prefix cache", outputs, refs)

    def test_preempted_requests_equal_mlx_lm_exactly(self, llama32, quant_engine):
        prompts = prompts_for((4, 6, 5, 7, 3, 6))
        refs = references(llama32, prompts, 8, 32, max_tokens=20)
        engine = quant_engine(
            llama32,
            "quantized-sdpa",
            max_total_tokens=64,
            max_running_requests=6,
            max_prefill_tokens=CHUNK,
            kv_bits=8,
            kv_group_size=32,
        )
        outputs = run_greedy(engine, prompts, 20, late=False)
        assert engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
        assert_matches("preempted", outputs, refs)

    def test_decode_split_by_context_equals_mlx_lm_exactly(
        self, llama32, quant_engine, monkeypatch
    ):
        monkeypatch.setattr(row_groups, "DECODE_OVERHEAD_KEYS", 0)
        prompts = prompts_for()
        refs = references(llama32, prompts, 4, 32)
        engine = quant_engine(
            llama32, "quantized-sdpa", max_total_tokens=512, kv_bits=4, kv_group_size=32
        )
        assert_matches(
            "row groups",
            run_greedy(engine, prompts, MAX_TOKENS, late=False),
            refs,
        )


class TestAttentionDispatch:
    def test_other_caches_get_mlx_lm_attention_unchanged(self, llama32):
        routed = attention_dispatch.install_dispatch(llama32.model)
        assert "mlx_lm.models.llama" in routed, routed
        assert llama.scaled_dot_product_attention is attention_dispatch.scaled_dot_product_attention
        q, k, v = (mx.random.normal((1, 4, 3, 32)) for _ in range(3))
        mask = mx.random.uniform(shape=(1, 1, 3, 3)) > 0.3
        for cache in (None, KVCache(), QuantizedKVCache(32, 8)):
            keys, values = (
                (k, v)
                if not isinstance(cache, QuantizedKVCache)
                else (
                    mx.quantize(k, group_size=32, bits=8),
                    mx.quantize(v, group_size=32, bits=8),
                )
            )
            # NOTE: fresh queries per call: mlx-lm's quantized SDPA scales them in place.
            want = MLX_LM_SDPA(q * 1, keys, values, cache=cache, scale=0.2, mask=mask)
            got = attention_dispatch.scaled_dot_product_attention(
                q * 1, keys, values, cache=cache, scale=0.2, mask=mask
            )
            assert mx.array_equal(got, want).item(), f"dispatch changed {type(cache).__name__}"

    def test_folded_view_declines_calls_it_does_not_cover(self, llama32):
        from mlxserve.mlx_backend.kv.kv_pool import KVPool
        from mlxserve.mlx_backend.kv.layer_layout import probe_layout
        from mlxserve.mlx_backend.kv.quantization import KVQuantization

        layout = probe_layout(llama32.model)
        pool = KVPool(layout, 16, 0, KVQuantization(8, 32))
        ctx = _one_row_context(prompt_len=3)
        view = cache_view.FoldedPoolKVCacheView(pool, layout.attention[0], ctx)
        q = mx.random.normal((1, 4, 3, 32))
        k, v = (mx.random.normal((1, 2, 3, 32)) for _ in range(2))
        keys, values = view.update_and_fetch(k, v)
        mask = view.make_mask(3)
        assert view.attention(q, keys, values, 0.2, mask, None) is not None
        assert view.attention(q, keys * 1, values, 0.2, mask, None) is None, "foreign keys"
        assert view.attention(q, keys, values, 0.2, mask, mx.zeros((4,))) is None, "sinks"
        assert view.attention(q, keys, values, 0.2, "causal", None) is None, "string mask"


def _one_row_context(prompt_len: int) -> cache_view.BatchContext:
    """The index arrays of one fresh row prefilling ``prompt_len`` tokens into slots
    ``1..prompt_len`` (the fields of a ``ForwardBatch`` that ``BatchContext`` reads)."""
    n = prompt_len
    slots = np.arange(1, n + 1, dtype=np.int32)[None]
    batch = SimpleNamespace(
        batch_size=1,
        input_ids=np.zeros((1, n), np.int32),
        computed_lens=np.zeros(1, np.int32),
        extend_lens=np.array([n], np.int32),
        write_slots=slots,
        read_slots=slots,
        sliding_write_slots=np.zeros((1, n), np.int32),
        sliding_read_slots=np.zeros((1, n), np.int32),
        sliding_read_start=np.zeros(1, np.int32),
        state_slots=np.zeros(1, np.int32),
        fresh_rows=np.ones(1, bool),
    )
    return cache_view.BatchContext(batch)


SMOLLM_TEXTS = (
    "The capital of France is",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "List three colors:",
)


@pytest.fixture(scope="module")
def smollm_refs(smollm):
    prompts = [smollm.tokenizer.encode(t) for t in SMOLLM_TEXTS]
    refs = references(smollm, prompts, 8, 64, max_tokens=8)
    floats = references(smollm, prompts, None, 64, max_tokens=8)
    assert refs[0] == floats[0], "pick prompts whose tokens 8-bit K/V leaves alone"
    return prompts, refs, logprob_gaps(refs[1], floats[1])


class TestSmolLM2:
    # NOTE: 30 layers of 192 K and V values per token: last-bit differences upstream
    # (batching, another attention order) move a few values across a quantization level
    # every token, so batched logprobs sit a median ~1.2e-3 from the reference on either
    # path (4e-5 for a request alone on quantized-sdpa), where 8-bit K/V itself moves
    # them a median ~5.7e-3 from the float cache (measured; up to 0.19). The bounds are
    # relative: half of what quantization itself moves, at the median and at the worst.
    @pytest.mark.parametrize("path", ["quantized-sdpa", "folded"])
    def test_concurrent_requests_match_mlx_lm(self, smollm, smollm_refs, quant_engine, path):
        # quantized-sdpa: tokens exactly; folded (the CPU default): equal on these prompts.
        prompts, refs, moved = smollm_refs
        engine = quant_engine(smollm, path, max_total_tokens=1024, kv_bits=8, kv_group_size=64)
        outputs = run_greedy(engine, prompts, 8)
        tols = {"rounding_tol": 0.5 * np.median(moved), "level_flip_tol": 0.5 * moved.max()}
        assert_matches(f"SmolLM2 {path}", outputs, refs, **tols)


def one_after_another(engine, prompts):  # noqa: ANN001, ANN201
    """Greedy outputs and logprobs of ``prompts`` run one after another (so each finds the
    last one cached), with the prefix-cache hits counted after each."""
    outputs, hits = ([], []), []
    for prompt in prompts:
        tokens, logprobs = run_greedy(engine, [prompt], MAX_TOKENS)
        outputs[0].append(tokens[0])
        outputs[1].append(logprobs[0])
        hits.append(engine.stats().prefix_cache_hits)
    return outputs, hits
