"""The native ragged attention op against gather + mask + ``mx.fast.scaled_dot_product_attention``.

Each case builds flat head-major pools (``[H * rows, D]``, as ``KVPool`` stores them), scatters
rows of random slots, and compares the op's output for every real query with MLX's SDPA over
the same K/V gathered and masked the way ``BatchContext`` masks them. The tolerance is 2e-5
on unit-scale data: the kernel's polynomial exp and its summation order differ from MLX's by
~1e-6 (measured max below).

Over quantized pools (``--kv-bits``: packed rows, ``kv/quantization.py``) the reference is
the same SDPA over the pools' rows dequantized by ``PackedRows.dequantize``, within the same
tolerance: the kernel dequantizes with the same arithmetic (at most a fused multiply-add
apart, ~1e-7), so what is left is the float kernel's own difference to MLX.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxserve.mlx_backend.attention import native
from mlxserve.mlx_backend.kv.quantization import PackedRows

pytestmark = pytest.mark.skipif(
    not native.native_status().active, reason=f"native attention: {native.native_status().reason}"
)

TOLERANCE = 2e-5


def _case(
    rng: np.random.Generator,
    key_counts: list[int],
    q_lens: list[int],
    q_heads: int,
    kv_heads: int,
    dim: int = 32,
    v_dim: int | None = None,
    window: int = 0,
    key_start: list[int] | None = None,
    sinks: bool = False,
    rows: int | None = None,
    packed: bool = False,
    quantized: tuple[int, int] | None = None,
) -> tuple[mx.array, mx.array]:
    """(op output, reference) over the real queries of every row (padded ones zeroed).
    ``packed``: the queries go to the op as one-token rows (``PackedBatchContext``'s
    layout) and the output is put back in the padded layout to compare. ``quantized``:
    ``(bits, group_size)``: the pools hold packed rows, and the reference attends over
    their dequantized values."""
    v_dim = v_dim or dim
    B = len(key_counts)
    counts = np.array(key_counts, np.int32)
    q_len = np.array(q_lens, np.int32)
    start = np.zeros(B, np.int32) if key_start is None else np.array(key_start, np.int32)
    S, L = int(counts.max()), int(q_len.max())
    rows = rows or int(counts.sum()) + 8
    k = mx.array(rng.standard_normal((kv_heads * rows, dim), dtype=np.float32))
    v = mx.array(rng.standard_normal((kv_heads * rows, v_dim), dtype=np.float32))
    k_pool, v_pool, quant = k, v, {}
    if quantized is not None:
        bits, group_size = quantized
        k_rows = PackedRows(bits, group_size, dim, mx.float32)
        v_rows = PackedRows(bits, group_size, v_dim, mx.float32)
        k_pool, v_pool = k_rows.encode(k), v_rows.encode(v)
        k, v = k_rows.dequantize(k_pool), v_rows.dequantize(v_pool)
        quant = {"bits": bits, "group_size": group_size}
    slots = np.zeros((B, S), np.int32)
    free = rng.permutation(np.arange(1, rows))
    used = 0
    for b, n in enumerate(counts):
        slots[b, :n] = free[used : used + n]
        used += n
    # Query l of row b sits at position start + count - q_len + l (its row's last keys).
    q_start = start + counts - q_len
    meta = native.padded_runs(counts, start, q_start, q_len, L)
    q = mx.array(rng.standard_normal((B, q_heads, L, dim), dtype=np.float32))
    sink = mx.array(rng.standard_normal(q_heads, dtype=np.float32)) if sinks else None
    scale = dim**-0.5
    queries = q
    if packed:
        first = (np.cumsum(q_len) - q_len).astype(np.int32)
        meta = native.padded_runs(counts, start, q_start, q_len, 1, q_first=first)
        owner = np.repeat(np.arange(B), q_len)
        pos = np.arange(int(q_len.sum())) - first[owner]
        queries = q[mx.array(owner), :, mx.array(pos)][:, :, None, :]
    out = native.ragged_attention(
        queries,
        k_pool,
        v_pool,
        mx.array(slots),
        mx.array(meta),
        sink,
        scale=scale,
        window=window,
        kv_heads=kv_heads,
        rows_per_head=rows,
        **quant,
    )
    if packed:
        padded = np.zeros((B, q_heads, L, v_dim), np.float32)
        padded[owner, :, pos] = np.array(out)[:, :, 0]
        out = mx.array(padded)
    flat = mx.array((np.arange(kv_heads)[:, None, None] * rows + slots[None]).astype(np.int32))
    keys, values = k[flat].swapaxes(0, 1), v[flat].swapaxes(0, 1)
    k_pos = start[:, None, None, None] + np.arange(S)[None, None, None, :]
    q_pos = q_start[:, None, None, None] + np.arange(L)[None, None, :, None]
    visible = (k_pos <= q_pos) & (np.arange(S)[None, None, None, :] < counts[:, None, None, None])
    if window:
        visible &= k_pos > q_pos - window
    visible |= ~visible.any(axis=-1, keepdims=True)  # padded queries: no empty mask row
    ref = mx.fast.scaled_dot_product_attention(
        q, keys, values, scale=scale, mask=mx.array(visible), sinks=sink
    )
    real = mx.array(np.arange(L)[None, None, :, None] < q_len[:, None, None, None])
    return mx.where(real, out, 0), mx.where(real, ref, 0)


def _max_diff(out: mx.array, ref: mx.array) -> float:
    return mx.max(mx.abs(out - ref)).item()


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(7)


class TestDecode:
    def test_ragged_rows_gqa(self, rng):
        out, ref = _case(rng, [1, 56, 330, 7, 129], [1] * 5, q_heads=9, kv_heads=3, dim=64)
        assert out.shape == (5, 9, 1, 64), out.shape
        assert _max_diff(out, ref) < TOLERANCE, _max_diff(out, ref)

    def test_mqa_and_multi_head_attention(self, rng):
        for q_heads, kv_heads in [(8, 1), (4, 4)]:
            out, ref = _case(rng, [40, 3, 17], [1] * 3, q_heads=q_heads, kv_heads=kv_heads)
            diff = _max_diff(out, ref)
            assert diff < TOLERANCE, f"{q_heads} heads over {kv_heads}: {diff}"

    def test_long_row_split_over_keys(self, rng):
        """One row of 3,000 keys among short ones: split into pieces and merged."""
        out, ref = _case(rng, [3000, 150, 150, 9], [1] * 4, q_heads=4, kv_heads=2, dim=64)
        assert _max_diff(out, ref) < TOLERANCE, _max_diff(out, ref)

    def test_odd_head_dims(self, rng):
        out, ref = _case(rng, [20, 5], [1, 1], q_heads=2, kv_heads=1, dim=13, v_dim=7)
        assert out.shape[-1] == 7
        assert _max_diff(out, ref) < TOLERANCE, _max_diff(out, ref)

    def test_attention_sinks(self, rng):
        out, ref = _case(rng, [600, 4], [1, 1], q_heads=4, kv_heads=2, sinks=True)
        assert _max_diff(out, ref) < TOLERANCE, _max_diff(out, ref)


class TestPrefill:
    def test_causal_prefill_after_cached_context(self, rng):
        """Queries of a chunk see the cached context and the chunk up to themselves."""
        out, ref = _case(rng, [1500 + 120, 40, 7], [120, 40, 1], q_heads=9, kv_heads=3)
        assert _max_diff(out, ref) < TOLERANCE, _max_diff(out, ref)

    def test_padded_queries_are_zero(self, rng):
        B, L = 2, 5
        q = mx.array(rng.standard_normal((B, 2, L, 8), dtype=np.float32))
        pool = mx.array(rng.standard_normal((2 * 10, 8), dtype=np.float32))
        slots = mx.array(np.array([[1, 2, 3, 4, 5], [6, 7, 0, 0, 0]], np.int32))
        counts = np.array([5, 2])
        meta = mx.array(native.padded_runs(counts, 0 * counts, 0 * counts, counts, L))
        out = native.ragged_attention(
            q, pool, pool, slots, meta, None, scale=1.0, window=0, kv_heads=2, rows_per_head=10
        )
        padded = np.array(out)[1, :, 2:]
        assert np.all(padded == 0), "queries past a row's length must come out as zeros"
        assert np.all(np.isfinite(np.array(out))), "no NaN anywhere"


class TestPackedRuns:
    def test_one_token_rows_sharing_a_slots_row(self, rng):
        """A packed batch: a 5-token chunk after 30 cached tokens as 5 one-token rows over
        one slots row, then a decode row: equal to the same chunk as one padded row."""
        out, ref = _case(rng, [35, 12], [5, 1], q_heads=4, kv_heads=2, packed=True)
        assert _max_diff(out, ref) < TOLERANCE, _max_diff(out, ref)

    def test_long_chunk_packed_with_a_window(self, rng):
        out, ref = _case(rng, [700, 40], [300, 1], q_heads=6, kv_heads=2, window=64, packed=True)
        assert _max_diff(out, ref) < TOLERANCE, _max_diff(out, ref)


class TestSlidingWindow:
    def test_decode_and_prefill_in_a_window(self, rng):
        out, ref = _case(rng, [300, 9, 64], [1, 9, 30], q_heads=4, kv_heads=2, window=8)
        assert _max_diff(out, ref) < TOLERANCE, _max_diff(out, ref)

    def test_keys_read_from_a_later_start(self, rng):
        """The sliding space reads a row from its window's start: key column 0 is at
        position ``key_start``."""
        out, ref = _case(
            rng, [8, 8, 3], [1, 4, 3], q_heads=4, kv_heads=2, window=8, key_start=[50, 13, 0]
        )
        assert _max_diff(out, ref) < TOLERANCE, _max_diff(out, ref)


QUANTIZATIONS = [(8, 32), (8, 64), (4, 32), (4, 64)]
needs_quantized = pytest.mark.skipif(
    not native.native_status().quantized, reason=native.native_status().quantized_reason
)


@needs_quantized
@pytest.mark.parametrize(("bits", "group_size"), QUANTIZATIONS)
class TestQuantizedPools:
    """The op over packed rows against SDPA over the same rows dequantized."""

    def test_ragged_decode_gqa(self, rng, bits, group_size):
        quant = (bits, group_size)
        out, ref = _case(rng, [1, 56, 330, 7], [1] * 4, 9, 3, dim=64, quantized=quant)
        assert out.shape == (4, 9, 1, 64), out.shape
        assert _max_diff(out, ref) < TOLERANCE, f"{quant}: {_max_diff(out, ref)}"

    def test_long_row_split_over_keys_with_sinks(self, rng, bits, group_size):
        quant = (bits, group_size)
        out, ref = _case(rng, [2500, 40, 3], [1] * 3, 4, 2, dim=64, sinks=True, quantized=quant)
        assert _max_diff(out, ref) < TOLERANCE, f"{quant}: {_max_diff(out, ref)}"

    def test_causal_prefill_after_cached_context(self, rng, bits, group_size):
        """A chunk of queries per row (the transposed-K path of the kernel) and a decode row."""
        quant = (bits, group_size)
        out, ref = _case(rng, [300 + 40, 17, 5], [40, 17, 1], 6, 2, dim=64, quantized=quant)
        assert _max_diff(out, ref) < TOLERANCE, f"{quant}: {_max_diff(out, ref)}"

    def test_packed_runs_in_a_sliding_window(self, rng, bits, group_size):
        quant = (bits, group_size)
        out, ref = _case(
            rng, [200, 30], [50, 1], 4, 2, dim=64, window=32, packed=True, quantized=quant
        )
        assert _max_diff(out, ref) < TOLERANCE, f"{quant}: {_max_diff(out, ref)}"

    def test_keys_from_a_later_start_and_other_value_dim(self, rng, bits, group_size):
        """The sliding space's rows start at ``key_start``; V narrower than K (the op reads
        Dv off the packed width)."""
        quant = (bits, group_size)
        out, ref = _case(
            rng, [8, 8, 3], [1, 4, 3], 4, 2, dim=128, v_dim=64, window=8,
            key_start=[50, 13, 0], quantized=quant,
        )  # fmt: skip
        assert out.shape[-1] == 64, out.shape
        assert _max_diff(out, ref) < TOLERANCE, f"{quant}: {_max_diff(out, ref)}"


@needs_quantized
class TestQuantizedRejects:
    def _call(self, k_pool, v_pool, bits=8, group_size=32, dim=64):  # noqa: ANN001
        q = mx.zeros((1, 2, 1, dim))
        one = np.array([1])
        meta = mx.array(native.padded_runs(one, 0 * one, 0 * one, one, 1))
        return native.ragged_attention(
            q, k_pool, v_pool, mx.ones((1, 1), mx.int32), meta, None, scale=1.0, window=0,
            kv_heads=1, rows_per_head=10, bits=bits, group_size=group_size,
        )  # fmt: skip

    def test_wrong_packed_widths_raise_value_error(self):
        rows = PackedRows(8, 32, 64, mx.float32)
        good = mx.zeros((10, rows.words), mx.uint32)
        with pytest.raises(ValueError, match="key pool rows are not packed rows"):
            self._call(mx.zeros((10, rows.words + 1), mx.uint32), good)
        with pytest.raises(ValueError, match="value pool rows are not packed rows"):
            self._call(good, mx.zeros((10, 7), mx.uint32))
        with pytest.raises(ValueError, match="bits must be 8 or 4"):
            self._call(good, good, bits=3)
        with pytest.raises(ValueError, match="group_size must be"):
            self._call(good, good, group_size=16)
        with pytest.raises(ValueError, match="uint32 packed rows"):
            self._call(mx.zeros((10, 64)), mx.zeros((10, 64)))

    def test_a_good_call_runs(self):
        rows = PackedRows(8, 32, 64, mx.float32)
        good = mx.zeros((10, rows.words), mx.uint32)
        out = self._call(good, good)
        assert out.shape == (1, 2, 1, 64), out.shape
        assert np.all(np.array(out) == 0), "zero scales and biases dequantize to zeros"


class TestRejects:
    def test_slot_outside_the_pool_raises_not_crashes(self, rng):
        q = mx.array(rng.standard_normal((1, 2, 1, 8), dtype=np.float32))
        pool = mx.zeros((2 * 10, 8))
        slots = mx.array(np.array([[3, 10]], np.int32))  # 10 is past rows_per_head
        one = np.array([1])
        meta = mx.array(native.padded_runs(2 * one, 0 * one, one, one, 1))
        out = native.ragged_attention(
            q, pool, pool, slots, meta, None, scale=1.0, window=0, kv_heads=2, rows_per_head=10
        )
        with pytest.raises(RuntimeError, match="outside the pool"):
            mx.eval(out)

    def test_bad_shapes_raise_value_error(self, rng):
        q = mx.zeros((1, 3, 1, 8))
        pool = mx.zeros((20, 8))
        slots = mx.zeros((1, 2), mx.int32)
        meta = mx.zeros((1, 6), mx.int32)
        with pytest.raises(ValueError, match="multiple of KV heads"):
            native.ragged_attention(
                q, pool, pool, slots, meta, None, scale=1.0, window=0, kv_heads=2, rows_per_head=10
            )
        with pytest.raises(ValueError, match="float32"):
            native.ragged_attention(
                q.astype(mx.float16),
                pool,
                pool,
                slots,
                meta,
                None,
                scale=1.0,
                window=0,
                kv_heads=1,
                rows_per_head=20,
            )


class TestThreads:
    def test_thread_count_changes_nothing_numerically(self, rng):
        before = native.threads()
        try:
            results = []
            for n in (1, 2, 3):
                native.set_threads(n)
                assert native.threads() == n
                out, _ = _case(np.random.default_rng(3), [2500, 40], [1, 1], 4, 2, dim=64)
                results.append(np.array(out))
            # Different thread counts split long rows differently: equal up to rounding.
            assert np.abs(results[0] - results[2]).max() < TOLERANCE
        finally:
            native.set_threads(before)
