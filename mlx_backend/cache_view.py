"""mlx-lm's cache contract, implemented as a view over the slot pools for one batch."""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx
import numpy as np

from mlx_backend.kv_pool import KVPool
from scheduler.batch import ForwardBatch


class AttentionCache(Protocol):
    """What an mlx-lm attention layer asks of its cache."""

    offset: mx.array

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store this step's ``[B, H, L, D]`` K/V; return all visible K/V ``[B, H, S, D]``."""
        ...

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """The attention mask for ``N`` new tokens, broadcastable to ``[B, 1, N, S]``."""
        ...


class BatchContext:
    """The MLX-side index arrays of one batch, shared by every layer's view.

    Mask semantics, for row ``b`` with ``c = cached_lens[b]`` and ``e = extend_lens[b]``:
    query ``l`` sits at position ``c + l`` and sees key ``j`` iff ``j <= c + l`` and
    ``j < c + e`` (and ``j > c + l - window`` for a sliding window). Padded queries
    (``l >= e``) see every real key of their row, so no mask row is empty (no NaN).
    """

    def __init__(self, batch: ForwardBatch) -> None:
        B, L = batch.input_ids.shape
        self.offsets = mx.array(batch.cached_lens.astype(np.int32))
        self.write_slots = mx.array(batch.write_slots.reshape(-1))
        self.read_slots = mx.array(batch.read_slots)
        q_pos = batch.cached_lens[:, None] + np.arange(L, dtype=np.int32)[None, :]  # [B, L]
        self._q_pos = mx.array(q_pos.astype(np.int32))[:, None, :, None]
        total = (batch.cached_lens + batch.extend_lens).astype(np.int32)
        self._total = mx.array(total)[:, None, None, None]
        self._k_pos = mx.arange(batch.read_slots.shape[1], dtype=mx.int32)[None, None, None, :]
        self._masks: dict[int | None, mx.array] = {}

    def mask(self, window_size: int | None = None) -> mx.array:
        if window_size not in self._masks:
            mask = (self._k_pos <= self._q_pos) & (self._k_pos < self._total)
            if window_size is not None:
                mask = mask & (self._k_pos > self._q_pos - window_size)
            self._masks[window_size] = mask
        return self._masks[window_size]


class PoolKVCacheView:
    """One attention layer's cache for one batch: writes scatter into the pool, reads gather
    the batch's slots from it. It holds no K/V of its own."""

    def __init__(self, pool: KVPool, layer: int, ctx: BatchContext) -> None:
        self._pool = pool
        self._layer = layer
        self._ctx = ctx
        self.offset = ctx.offsets

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        B, H, L, _ = keys.shape
        flat_k = keys.transpose(0, 2, 1, 3).reshape(B * L, H, keys.shape[-1])
        flat_v = values.transpose(0, 2, 1, 3).reshape(B * L, H, values.shape[-1])
        self._pool.write(self._layer, self._ctx.write_slots, flat_k, flat_v)
        return self._pool.read(self._layer, self._ctx.read_slots)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return self._ctx.mask(window_size)
