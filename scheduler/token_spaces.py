"""Token slot spaces: where each position of a request keeps its K/V.

A model has up to two spaces. The *full* space serves full-attention layers and keeps a
slot for every position. The *sliding* space serves sliding-window layers and keeps only
the positions some future query can still see, so a request's sliding slots stay bounded
by ``window + chunk`` however long it grows::

    positions      0 ........................ computed_len ... allocated_len
    full slots     [x x x x x x x x x x x x x x x x x x x x x x x x]
    sliding slots                    [x x x x x x x x x x x x x x x]
                                     ^ start = computed_len - window + 1
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mlxserve.kvpool import ReqToTokenPool, TokenToKVPoolAllocator
from mlxserve.scheduler.request import Request


@dataclass
class TokenSpace:
    """One slot space: its allocator and its ``[row, position] -> slot`` table."""

    name: str  # "full" | "sliding"
    allocator: TokenToKVPoolAllocator
    table: np.ndarray
    window: int | None = None

    def start(self, req: Request) -> int:
        """First position whose slot this request still holds in this space."""
        return req.sliding_start if self.window is not None else 0


class TokenSpaces:
    """The model's token slot spaces, handled together for each request.

    Args:
        req_pool: the request rows; its ``req_to_token`` is the full space's table.
        full_size: slots of the full space (0: the model has no full-attention layer).
        sliding_size: slots of the sliding space (0: the model has no sliding layer).
        window: the widest sliding window (with ``sliding_size``).
    """

    def __init__(
        self, req_pool: ReqToTokenPool, full_size: int, sliding_size: int, window: int | None
    ) -> None:
        self.spaces: list[TokenSpace] = []
        self.full: TokenSpace | None = None
        self.sliding: TokenSpace | None = None
        if full_size:
            allocator = TokenToKVPoolAllocator(full_size)
            self.full = TokenSpace("full", allocator, req_pool.req_to_token)
            self.spaces.append(self.full)
        if sliding_size:
            assert window is not None, "a sliding space needs its window"
            allocator = TokenToKVPoolAllocator(sliding_size)
            table = np.zeros_like(req_pool.req_to_token)
            self.sliding = TokenSpace("sliding", allocator, table, window)
            self.spaces.append(self.sliding)

    def available(self) -> int:
        """Positions that can still be added (the tightest space decides; a model with no
        attention layer at all is never short)."""
        if not self.spaces:
            return np.iinfo(np.int32).max
        return min(s.allocator.available_size() for s in self.spaces)

    def alloc(self, req: Request, n: int) -> None:
        """Give positions ``allocated_len .. allocated_len + n`` a slot in every space."""
        start = req.allocated_len
        for space in self.spaces:
            ids = space.allocator.alloc(n)
            assert ids is not None, f"caller checked that {n} {space.name} slots are free"
            space.table[req.row, start : start + n] = ids
        req.allocated_len += n

    def free_tail(self, req: Request, n: int) -> None:
        """Give back the slots of the row's last ``n`` allocated positions (proposed tokens
        the forward rejected: their K/V are never read)."""
        if n <= 0:
            return
        end = req.allocated_len
        for space in self.spaces:
            row = space.table[req.row]
            space.allocator.free(row[end - n : end].copy())
            row[end - n : end] = 0
        req.allocated_len = end - n

    def trim_window(self, req: Request) -> None:
        """Free sliding slots that no future query can see (behind ``computed_len - w + 1``).

        Positions below ``req.tree_len`` belong to the prefix cache: they leave the row
        but are not freed.
        """
        space = self.sliding
        if space is None:
            return
        keep_from = max(req.computed_len - space.window + 1, 0)
        if keep_from > req.sliding_start:
            row = space.table[req.row]
            own_from = max(req.sliding_start, req.tree_len)
            if keep_from > own_from:
                space.allocator.free(row[own_from:keep_from].copy())
            row[req.sliding_start : keep_from] = 0
            req.sliding_start = keep_from

    def owned(self, space: TokenSpace, req: Request) -> np.ndarray:
        """The slots of ``space`` the request itself owns (not the prefix cache's)."""
        start = max(space.start(req), req.tree_len)
        return space.table[req.row, start : req.allocated_len]

    def adopt_prefix(self, req: Request, length: int, slots: dict[str, np.ndarray]) -> None:
        """Point a newly admitted request's row at ``length`` cached positions."""
        for space in self.spaces:
            row = space.table[req.row]
            start = 0 if space.window is None else max(length - space.window + 1, 0)
            row[start:length] = slots[space.name][start:length]
        if self.sliding is not None:
            req.sliding_start = max(length - self.sliding.window + 1, 0)
        req.computed_len = req.allocated_len = req.tree_len = length

    def adopt_tree_slots(self, req: Request, slots: dict[str, np.ndarray]) -> None:
        """After an insert, the row's positions ``0..tree_len-1`` name the tree's slots."""
        n = req.tree_len
        for space in self.spaces:
            start = space.start(req)
            if start < n:
                space.table[req.row, start:n] = slots[space.name][start:n]

    def release(self, req: Request) -> None:
        """Free every slot the request owns, in every space (the cache keeps its own)."""
        for space in self.spaces:
            space.allocator.free(self.owned(space, req).copy())
            space.table[req.row] = 0
        req.sliding_start = 0

    def check_integrity(self, running: list[Request], cache_owned: dict | None = None) -> None:
        """Assert every slot is free, owned by exactly one running request, or owned by the
        prefix cache (``cache_owned[space_name]``, a list of slot arrays)."""
        for space in self.spaces:
            owned = [self.owned(space, r) for r in running]
            owned += (cache_owned or {}).get(space.name, [])
            space.allocator.check_integrity(owned)
