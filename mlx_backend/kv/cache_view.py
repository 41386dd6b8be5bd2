"""mlx-lm's cache contract, implemented as views over the slot pools for one batch."""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, CacheList

from mlxserve.mlx_backend.kv.kv_pool import FlatRows, KVPool, StatePool
from mlxserve.mlx_backend.kv.layer_layout import CacheSpec
from mlxserve.scheduler.batch import ForwardBatch


class AttentionCache(Protocol):
    """What an mlx-lm attention layer asks of its cache."""

    offset: mx.array

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store this step's ``[B, H, L, D]`` K/V; return all visible K/V ``[B, H, S, D]``."""
        ...

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """The attention mask for ``N`` new tokens, broadcastable to ``[B, 1, N, S]``."""
        ...


class _SpaceIndex:
    """One slot space's index arrays for a batch: where to write, what to read, and the
    absolute position of every gathered key (``-1`` for padding columns)."""

    def __init__(self, write: np.ndarray, read: np.ndarray, start: np.ndarray, total: np.ndarray):
        self.write = FlatRows(write.reshape(-1))
        self.read = FlatRows(read)
        cols = np.arange(read.shape[1], dtype=np.int32)[None, :]
        k_pos = start[:, None] + cols
        k_pos = np.where(k_pos < total[:, None], k_pos, -1)
        self.k_pos = mx.array(k_pos.astype(np.int32))[:, None, None, :]


def _space_index(
    write: np.ndarray,
    read: np.ndarray,
    rows: np.ndarray,
    L: int,
    start: np.ndarray,
    total: np.ndarray,
) -> _SpaceIndex:
    """One space's index arrays for ``rows``, trimmed to their own longest read."""
    S = min(read.shape[1], max(1, int((total - start).max())))
    return _SpaceIndex(write[rows, :L], read[rows, :S], start, total)


class BatchContext:
    """The MLX-side index arrays of one forward over ``rows`` of a batch (all rows by
    default), shared by every layer's view.

    Mask semantics, for row ``b`` with ``c = computed_lens[b]``: query ``l`` sits at
    position ``c + l`` and sees a key at position ``j`` iff ``0 <= j <= c + l`` and ``j``
    is a real position of the row (and ``j > c + l - window`` for a sliding window).
    Padded queries see every real key of their row, so no mask row is empty (no NaN).
    """

    def __init__(self, batch: ForwardBatch, rows: np.ndarray | None = None) -> None:
        rows = np.arange(batch.batch_size) if rows is None else rows
        cached = batch.computed_lens[rows].astype(np.int32)
        total = cached + batch.extend_lens[rows].astype(np.int32)
        # A group of rows is padded only to its own longest row and longest context.
        L = int(batch.extend_lens[rows].max())
        self.input_ids = mx.array(batch.input_ids[rows, :L])
        self.offsets = mx.array(cached)
        q_pos = cached[:, None] + np.arange(L, dtype=np.int32)[None, :]
        self._q_pos = mx.array(q_pos.astype(np.int32))[:, None, :, None]
        sliding_start = batch.sliding_read_start[rows].astype(np.int32)
        self.spaces = {
            "full": _space_index(
                batch.write_slots, batch.read_slots, rows, L, np.zeros_like(total), total
            ),
            "sliding": _space_index(
                batch.sliding_write_slots,
                batch.sliding_read_slots,
                rows,
                L,
                sliding_start,
                total,
            ),
        }
        self.state_slots = mx.array(batch.state_slots[rows])
        fresh = batch.fresh_rows[rows]
        self.all_fresh = bool(fresh.all())
        self.fresh = None if not fresh.any() else mx.array(fresh)
        self._masks: dict[tuple[str, int | None], mx.array] = {}

    def mask(self, space: str, window: int | None) -> mx.array:
        key = (space, window)
        if key not in self._masks:
            k_pos = self.spaces[space].k_pos
            mask = (k_pos >= 0) & (k_pos <= self._q_pos)
            if window is not None:
                mask = mask & (k_pos > self._q_pos - window)
            self._masks[key] = mask
        return self._masks[key]


class PoolKVCacheView:
    """One attention cache for one batch: writes scatter into the pool, reads gather the
    batch's slots from it. It holds no K/V of its own.

    ``keys`` is this step's new keys (never the pool): mlx-lm's ``pipeline()`` models tie
    their send to the next rank to the last cache's ``keys`` (``mx.depends``)."""

    def __init__(self, pool: KVPool, spec: CacheSpec, ctx: BatchContext) -> None:
        self.keys: mx.array | None = None
        self._pool = pool
        self._index = spec.pool_index
        self._space = "full" if spec.kind == "full" else "sliding"
        self._window = spec.window
        self._ctx = ctx
        self.offset = ctx.offsets

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        B, H, L, _ = keys.shape
        self.keys = keys
        index = self._ctx.spaces[self._space]
        flat_k = keys.transpose(1, 0, 2, 3).reshape(H, B * L, keys.shape[-1])
        flat_v = values.transpose(1, 0, 2, 3).reshape(H, B * L, values.shape[-1])
        self._pool.write(self._index, index.write, flat_k, flat_v)
        return self._pool.read(self._index, index.read)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        # A sliding cache masks to its own window when the model does not name one, as
        # mlx-lm's RotatingKVCache does.
        return self._ctx.mask(self._space, window_size or self._window)


class BatchCaches:
    """The per-layer cache objects of one forward, and the write-back of recurrent state.

    Recurrent layers get a real mlx-lm ``ArraysCache`` filled with the batch's gathered
    states (or left empty when every row starts fresh, exactly as in single-sequence
    generation); after the forward the states the layers left there are scattered back.
    """

    def __init__(
        self, specs: list[CacheSpec], kv: KVPool, states: StatePool, ctx: BatchContext
    ) -> None:
        self._kv, self._states, self._ctx = kv, states, ctx
        self._recurrent: list[tuple[CacheSpec, ArraysCache]] = []
        self.caches = [self._make(spec) for spec in specs]

    def _make(self, spec: CacheSpec):
        if spec.kind == "list":
            return CacheList(*[self._make(child) for child in spec.children])
        if spec.kind == "recurrent":
            cache = ArraysCache(len(spec.state.entries))
            if not self._ctx.all_fresh:
                cache.cache = self._states.gather(
                    spec.pool_index, self._ctx.state_slots, self._ctx.fresh
                )
            self._recurrent.append((spec, cache))
            return cache
        return PoolKVCacheView(self._kv, spec, self._ctx)

    def write_back_states(self) -> None:
        for spec, cache in self._recurrent:
            self._states.scatter(spec.pool_index, self._ctx.state_slots, cache.cache)
