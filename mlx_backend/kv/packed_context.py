"""A batch packed into one-token rows: no padding in the dense layers, prefill and decode in
one forward.

A ``ForwardBatch`` row feeds ``n`` tokens; padded, a step costs ``rows x longest`` positions
in every dense layer. Packed, token ``i`` of row ``b`` becomes a row of its own (a *virtual
row*) at position ``computed_lens[b] + i``, so the forward is ``[sum(n), 1]``: every
position computed is a real token. Within each layer the view writes every virtual row's
K/V into the pools before attention reads them, so a virtual row sees the earlier tokens of
its own chunk as cached keys: attention stays causal. The ragged op reads each sequence's
slots once for all its tokens (one run per batch row, ``attention.native.padded_runs``); the
gather path, for layers that fall back, gathers each sequence's slots and repeats them per
virtual row lazily (only evaluated if a layer uses it).

Only for models without recurrent layers (a recurrent state must see a sequence's tokens in
order, within one row); the executor decides.

::

    batch rows     b0: t t t   b1: t          packed rows   t(b0,0) t(b0,1) t(b0,2) t(b1,0)
    owner                                                   0       0       0       1
    position                                                c0      c0+1    c0+2    c1
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxserve.mlx_backend.attention.native import padded_runs
from mlxserve.mlx_backend.kv.cache_view import BatchContext
from mlxserve.mlx_backend.kv.kv_pool import FlatRows
from mlxserve.scheduler.batch import ForwardBatch


class _RepeatedRows(FlatRows):
    """Row ids of each sequence's slots, repeated for each of its virtual rows (lazily)."""

    def __init__(self, slots: np.ndarray, owner: mx.array) -> None:
        super().__init__(slots)
        self._owner = owner

    def rows(self, heads: int, size: int) -> mx.array:
        return super().rows(heads, size)[:, self._owner]


class _PackedSpace:
    """One slot space's index arrays for a packed batch (the ``_SpaceIndex`` interface)."""

    def __init__(
        self,
        write: np.ndarray,
        read: np.ndarray,
        start: np.ndarray,
        total: np.ndarray,
        owner_np: np.ndarray,
        owner: mx.array,
    ) -> None:
        S = min(read.shape[1], max(1, int((total - start).max())))
        read = read[:, :S]
        self.write = FlatRows(write)
        self.read = _RepeatedRows(read, owner)
        self.read_slots = read
        self.key_start = start
        self.key_count = np.maximum(total - start, 0)
        self.ragged: tuple[mx.array, mx.array] | None = None
        k_pos = start[:, None] + np.arange(S, dtype=np.int32)[None, :]
        k_pos = np.where(k_pos < total[:, None], k_pos, -1).astype(np.int32)
        self.k_pos = mx.array(k_pos)[owner][:, None, None, :]


class PackedBatchContext(BatchContext):
    """``BatchContext`` for ``rows`` of ``batch`` packed into one-token rows.

    Attributes:
        first: int ``[B]``: the packed row of each batch row's first token.
        size: packed rows (the batch's tokens).
    """

    def __init__(self, batch: ForwardBatch, rows: np.ndarray | None = None) -> None:
        rows = np.arange(batch.batch_size) if rows is None else rows
        lens = batch.extend_lens[rows].astype(np.int32)
        cached = batch.computed_lens[rows].astype(np.int32)
        total = cached + lens
        self.first = (np.cumsum(lens) - lens).astype(np.int32)
        self.size = int(lens.sum())
        owner_np = np.repeat(np.arange(len(rows), dtype=np.int32), lens)
        pos = np.arange(self.size, dtype=np.int32) - self.first[owner_np]
        owner = mx.array(owner_np)
        positions = cached[owner_np] + pos
        self.input_ids = mx.array(batch.input_ids[rows][owner_np, pos][:, None])
        self.offsets = mx.array(positions)
        self.q_start = cached
        self.q_len = lens
        self._q_pos = mx.array(positions)[:, None, None, None]
        self.spaces = {
            "full": _PackedSpace(
                batch.write_slots[rows][owner_np, pos],
                batch.read_slots[rows],
                np.zeros_like(total),
                total,
                owner_np,
                owner,
            ),
            "sliding": _PackedSpace(
                batch.sliding_write_slots[rows][owner_np, pos],
                batch.sliding_read_slots[rows],
                batch.sliding_read_start[rows].astype(np.int32),
                total,
                owner_np,
                owner,
            ),
        }
        # No recurrent layer runs packed: their state slots are never read.
        self.state_slots = mx.zeros((self.size,), mx.int32)
        self.all_fresh = True
        self.fresh = None
        self._masks: dict[tuple[str, int | None], mx.array] = {}

    def ragged(self, space: str) -> tuple[mx.array, mx.array]:
        """``(slots [B, S], meta [B, 6])``: one run per batch row over its own slots, whose
        queries are its consecutive packed rows."""
        index = self.spaces[space]
        if index.ragged is None:
            meta = padded_runs(
                index.key_count,
                index.key_start,
                self.q_start,
                self.q_len,
                1,
                q_first=self.first,
            )
            index.ragged = (mx.array(index.read_slots.astype(np.int32)), mx.array(meta))
        return index.ragged

    def packed_index(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The packed rows of ``(batch row, chunk position)`` pairs (local row indices)."""
        return self.first[rows] + positions
