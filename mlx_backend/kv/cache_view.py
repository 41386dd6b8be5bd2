"""mlx-lm's cache contract, implemented as views over the slot pools for one batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, CacheList

from mlxserve.mlx_backend.attention.native import padded_runs
from mlxserve.mlx_backend.kv.kv_pool import FlatRows, KVPool, StatePool
from mlxserve.mlx_backend.kv.layer_layout import CacheSpec
from mlxserve.mlx_backend.kv.packed_attention import folded_attention
from mlxserve.mlx_backend.kv.quantization import AttentionPath
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
        # What ragged attention reads instead of the gather: the slots of each row's keys,
        # and where its key column 0 starts (built on first use, see BatchContext.ragged).
        self.read_slots = read
        self.key_start = start
        self.key_count = np.maximum(total - start, 0)
        self.ragged: tuple[mx.array, mx.array] | None = None
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
        self.q_start = cached
        self.q_len = batch.extend_lens[rows].astype(np.int32)
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

    def mask_key(self, mask: object) -> tuple[str, int | None] | None:
        """The ``(space, window)`` this context made ``mask`` for, or None if it did not."""
        for key, made in self._masks.items():
            if made is mask:
                return key
        return None

    def ragged(self, space: str) -> tuple[mx.array, mx.array]:
        """``(slots [B, S], meta [B, 6])`` of one space for the ragged attention op: each
        row's key slots and its run of queries (``attention.native.padded_runs``)."""
        index = self.spaces[space]
        if index.ragged is None:
            L = int(self.input_ids.shape[1])
            meta = padded_runs(index.key_count, index.key_start, self.q_start, self.q_len, L)
            index.ragged = (mx.array(index.read_slots.astype(np.int32)), mx.array(meta))
        return index.ragged


@dataclass(frozen=True)
class RaggedKeys:
    """What the ragged attention op reads for one layer of one batch, in place of the
    gather: the layer's flat pools, and each row's key slots and lengths
    (``BatchContext.ragged``)."""

    k_pool: mx.array
    v_pool: mx.array
    slots: mx.array
    meta: mx.array
    kv_heads: int
    rows_per_head: int
    window: int  # 0: no sliding window
    bits: int = 0  # quantized pools: packed rows of this many bits per value (0: float)
    group_size: int = 0


class PoolKVCacheView:
    """One attention cache for one batch: writes scatter into the pool, reads gather the
    batch's slots from it (dense K/V: dequantized rows when the pool is quantized). It
    holds no K/V of its own.

    With ``ragged`` set, mlx-lm's attention call for this layer may be served from the
    pools in place (``mlx_backend/attention/``; quantized pools are dequantized in the
    kernel); the gather ``update_and_fetch`` returned is then never evaluated (MLX is lazy).

    ``keys`` is this step's new keys (never the pool): mlx-lm's ``pipeline()`` models tie
    their send to the next rank to the last cache's ``keys`` (``mx.depends``).
    """

    def __init__(
        self, pool: KVPool, spec: CacheSpec, ctx: BatchContext, ragged: bool = False
    ) -> None:
        self.keys: mx.array | None = None
        self._pool = pool
        self._index = spec.pool_index
        self._space = "full" if spec.kind == "full" else "sliding"
        self._window = spec.window
        self._ctx = ctx
        self.offset = ctx.offsets
        self.pool_index = spec.pool_index
        self.ragged = ragged
        # The K/V the last update_and_fetch returned: attention over anything else (keys
        # the model changed after fetching them) is not attention over the pools.
        self.fetched: tuple[mx.array, mx.array] | None = None

    def _write(self, keys: mx.array, values: mx.array) -> FlatRows:
        """Scatter this step's K/V; returns the rows to read."""
        B, H, L, _ = keys.shape
        self.keys = keys
        index = self._ctx.spaces[self._space]
        flat_k = keys.transpose(1, 0, 2, 3).reshape(H, B * L, keys.shape[-1])
        flat_v = values.transpose(1, 0, 2, 3).reshape(H, B * L, values.shape[-1])
        self._pool.write(self._index, index.write, flat_k, flat_v)
        return index.read

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.fetched = self._pool.read(self._index, self._write(keys, values))
        return self.fetched

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        # A sliding cache masks to its own window when the model does not name one, as
        # mlx-lm's RotatingKVCache does.
        return self._ctx.mask(self._space, window_size or self._window)

    def ragged_keys(self, mask: object) -> RaggedKeys | None:
        """The pools and row lengths for attention under ``mask``, or None when ``mask``
        is not one this batch made for this view's slot space."""
        key = self._ctx.mask_key(mask)
        if key is None or key[0] != self._space:
            return None
        slots, meta = self._ctx.ragged(self._space)
        heads, size = self._pool.shapes[self._index]
        k_pool, v_pool = self._pool.k[self._index], self._pool.v[self._index]
        quant = self._pool.quantization
        bits, group_size = (0, 0) if quant is None else (quant.bits, quant.group_size)
        window = key[1] or 0
        return RaggedKeys(k_pool, v_pool, slots, meta, heads, size, window, bits, group_size)


class QuantizedPoolKVCacheView(PoolKVCacheView):
    """A view over quantized pools that hands the model mlx-lm's quantized K/V: it has
    ``bits`` and ``group_size``, which is what makes mlx-lm's attention dispatch
    (``models/base.py``) run ``quantized_scaled_dot_product_attention``, and its
    ``update_and_fetch`` returns ``(packed, scales, biases)`` tuples of the gathered rows,
    as ``QuantizedKVCache`` does."""

    def __init__(self, pool: KVPool, spec: CacheSpec, ctx: BatchContext) -> None:
        super().__init__(pool, spec, ctx)
        assert pool.quantization is not None
        self.bits = pool.quantization.bits
        self.group_size = pool.quantization.group_size

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[tuple, tuple]:
        k_rows, v_rows = self._pool.read_rows(self._index, self._write(keys, values))
        k_format, v_format = self._pool.formats[self._index]
        return k_format.mlx_lm_tuple(k_rows), v_format.mlx_lm_tuple(v_rows)


class FoldedPoolKVCacheView(PoolKVCacheView):
    """A view over quantized pools whose attention call mlxserve runs itself
    (``mlx_backend/attention/dispatch.py`` routes mlx-lm's SDPA here): ``update_and_fetch`` returns
    dequantized K/V, which MLX computes only if the model uses them (its attention does
    not go through the dispatch), and keeps the gathered packed rows for ``attention``."""

    def __init__(self, pool: KVPool, spec: CacheSpec, ctx: BatchContext) -> None:
        super().__init__(pool, spec, ctx)
        self._fetched: tuple[mx.array, mx.array, mx.array, mx.array] | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        k_rows, v_rows = self._pool.read_rows(self._index, self._write(keys, values))
        k_format, v_format = self._pool.formats[self._index]
        dense = k_format.dequantize(k_rows), v_format.dequantize(v_rows)
        self._fetched = (*dense, k_rows, v_rows)
        return dense

    def attention(
        self,
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        scale: float,
        mask: mx.array | str | None,
        sinks: mx.array | None,
    ) -> mx.array | None:
        """The attention over the packed rows, or None where it does not apply: K/V
        other than the ones this view returned (a model that transformed them), sinks,
        or a mask that is not an array."""
        if self._fetched is None or sinks is not None or isinstance(mask, str):
            return None
        dense_k, dense_v, k_rows, v_rows = self._fetched
        if keys is not dense_k or values is not dense_v:
            return None
        k_format, v_format = self._pool.formats[self._index]
        return folded_attention(queries, k_rows, v_rows, k_format, v_format, scale, mask)


_VIEWS = {
    "quantized-sdpa": QuantizedPoolKVCacheView,
    "dequantize": PoolKVCacheView,
    "folded": FoldedPoolKVCacheView,
}


class BatchCaches:
    """The per-layer cache objects of one forward, and the write-back of recurrent state.

    Attention layers get pool views: the layers of ``ragged_layers`` may be served by the
    native op in place (over float or quantized pools); the other layers over quantized
    pools get the view ``quantized_attention`` picks (``kv/quantization.py``:
    ``AttentionPath``).
    Recurrent layers get a real mlx-lm ``ArraysCache`` filled with the batch's gathered
    states (or left empty when every row starts fresh, exactly as in single-sequence
    generation); after the forward the states the layers left there are scattered back.
    """

    def __init__(
        self,
        specs: list[CacheSpec],
        kv: KVPool,
        states: StatePool,
        ctx: BatchContext,
        ragged_layers: frozenset[int] = frozenset(),
        quantized_attention: AttentionPath = "dequantize",
    ) -> None:
        self._kv, self._states, self._ctx = kv, states, ctx
        self._ragged_layers = ragged_layers
        self._view = PoolKVCacheView if kv.quantization is None else _VIEWS[quantized_attention]
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
        ragged = spec.pool_index in self._ragged_layers
        if ragged or self._view is PoolKVCacheView:
            return PoolKVCacheView(self._kv, spec, self._ctx, ragged)
        return self._view(self._kv, spec, self._ctx)

    def write_back_states(self) -> None:
        for spec, cache in self._recurrent:
            self._states.scatter(spec.pool_index, self._ctx.state_slots, cache.cache)
