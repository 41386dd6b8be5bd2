"""The flat head-major K/V pools: what a scatter writes is what a gather of the same slots
reads back, per head, for caches of different head counts and slot spaces."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np

from mlxserve.mlx_backend.kv.kv_pool import FlatRows, KVPool
from mlxserve.mlx_backend.kv.layer_layout import KVShape


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
