"""The flat head-major K/V pools: what a scatter writes is what a gather of the same slots
reads back, per head, for caches of different head counts and slot spaces; the native
allocation of the CPU pools gives mx.zeros."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from mlxserve.mlx_backend.attention import native
from mlxserve.mlx_backend.kv.kv_pool import FlatRows, KVPool
from mlxserve.mlx_backend.kv.layer_layout import KVShape

EXTENSION, WHY = native.extension()


def _layout(*caches: tuple[str, int, int, int]) -> SimpleNamespace:
    """A stand-in for ``LayerLayout`` with (kind, heads, k_dim, v_dim) attention caches."""
    return SimpleNamespace(
        attention=[
            SimpleNamespace(kind=kind, kv=KVShape(heads, k_dim, v_dim, mx.float32))
            for kind, heads, k_dim, v_dim in caches
        ]
    )


def test_flat_rows_are_head_offsets_of_the_slots():
    slots = np.array([[3, 1], [0, 2]], np.int32)
    rows = np.array(FlatRows(slots).rows(heads=3, size=5))
    assert rows.shape == (3, 2, 2)
    for h in range(3):
        np.testing.assert_array_equal(rows[h], h * 5 + slots)


def test_flat_rows_are_built_once_per_shape():
    flat = FlatRows(np.array([1, 2], np.int32))
    assert flat.rows(2, 9) is flat.rows(2, 9)
    assert flat.rows(2, 9) is not flat.rows(4, 9)


def test_read_returns_what_write_stored_per_head_and_slot():
    rng = np.random.default_rng(0)
    # Two caches of the full space (different head counts and dims) and one sliding one.
    pool = KVPool(_layout(("full", 2, 4, 3), ("full", 4, 8, 8), ("sliding", 3, 5, 5)), 12, 6)
    for index, (heads, size) in enumerate(pool.shapes):
        k_dim, v_dim = pool.k[index].shape[1], pool.v[index].shape[1]
        expect_k = np.zeros((heads, size, k_dim), np.float32)
        expect_v = np.zeros((heads, size, v_dim), np.float32)
        # Two writes, the second overwriting one slot of the first.
        for slots in (np.array([1, 4, size - 1]), np.array([4, 2])):
            keys = rng.standard_normal((heads, len(slots), k_dim)).astype(np.float32)
            values = rng.standard_normal((heads, len(slots), v_dim)).astype(np.float32)
            pool.write(index, FlatRows(slots), mx.array(keys), mx.array(values))
            expect_k[:, slots] = keys
            expect_v[:, slots] = values
        read = np.array([[4, 1, 0], [size - 1, 2, 2]], np.int32)  # [B, S], 0 = padding
        got_k, got_v = pool.read(index, FlatRows(read))
        assert got_k.shape == (2, heads, 3, k_dim)
        np.testing.assert_array_equal(np.array(got_k), expect_k[:, read].swapaxes(0, 1))
        np.testing.assert_array_equal(np.array(got_v), expect_v[:, read].swapaxes(0, 1))


@pytest.mark.skipif(EXTENSION is None, reason=f"native extension: {WHY}")
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16, mx.uint32])
@pytest.mark.parametrize("shape", [(0, 64), (3, 5), (3 * 40_001, 64)])
def test_native_pool_zeros_are_mx_zeros(dtype, shape):
    """The native pool allocation (huge-page advice, zeros written over the thread pool)
    gives what mx.zeros gives, small or spanning many 2 MiB pages, and takes writes."""
    pool = EXTENSION.pool_zeros(list(shape), dtype)
    want = mx.zeros(shape, dtype)
    assert pool.shape == want.shape and pool.dtype == dtype
    assert mx.array_equal(pool, want).item()
    if shape[0] > 3:
        ones = mx.ones((3, shape[1]), dtype)
        pool[mx.array([1, shape[0] // 2, shape[0] - 1])] = ones
        assert mx.sum(pool.astype(mx.float32)).item() == 3 * shape[1]


def test_the_cpu_pools_come_from_the_native_allocation(monkeypatch):
    if EXTENSION is None:
        pytest.skip(f"native extension: {WHY}")
    calls = []
    original = EXTENSION.pool_zeros

    def counting(shape, dtype):
        calls.append((tuple(shape), dtype))
        return original(shape, dtype)

    monkeypatch.setattr(EXTENSION, "pool_zeros", counting)
    pool = KVPool(_layout(("full", 2, 8, 4)), full_tokens=10, sliding_tokens=0)
    assert calls == [((22, 8), mx.float32), ((22, 4), mx.float32)]
    assert not mx.any(pool.k[0]).item() and not mx.any(pool.v[0]).item()
