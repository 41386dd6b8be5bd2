"""Token slot spaces: where each position of a request keeps its K/V.

A model has up to two spaces. The *full* space serves full-attention layers and keeps a
slot for every position. The *sliding* space serves sliding-window layers and keeps only
the positions some future query can still see, so a request's sliding slots stay bounded
by ``window + chunk`` however long it grows::

    positions      0 ........................ cached_len ... allocated_len
    full slots     [x x x x x x x x x x x x x x x x x x x x x x x x]
    sliding slots                    [x x x x x x x x x x x x x x x]
                                     ^ start = cached_len - window + 1
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvpool import ReqToTokenPool, TokenToKVPoolAllocator
from scheduler.request import Request


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

    def trim_window(self, req: Request) -> None:
        """Free sliding slots that no future query can see (behind ``cached_len - w + 1``)."""
        space = self.sliding
        if space is None:
            return
        keep_from = max(req.cached_len - space.window + 1, 0)
        if keep_from > req.sliding_start:
            row = space.table[req.row]
            space.allocator.free(row[req.sliding_start : keep_from].copy())
            row[req.sliding_start : keep_from] = 0
            req.sliding_start = keep_from

    def release(self, req: Request) -> None:
        """Free every slot the request holds, in every space."""
        for space in self.spaces:
            row = space.table[req.row]
            start = space.start(req)
            space.allocator.free(row[start : req.allocated_len].copy())
            row[:] = 0
        req.sliding_start = 0

    def check_integrity(self, running: list[Request]) -> None:
        """Assert every slot of every space is free or held by exactly one running request."""
        for space in self.spaces:
            owned = [space.table[r.row, space.start(r) : r.allocated_len] for r in running]
            space.allocator.check_integrity(owned)
