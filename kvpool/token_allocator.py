"""Free lists of slot ids: token slots (K/V of one position) and state slots (the
recurrent state of one request).

Slot ids run ``1..size``. Slot 0 is the padding slot: padded positions of a batch write
their (garbage) K/V there and masked reads gather it, so it is never handed out.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class SlotAllocator:
    """Hands out and takes back slot ids.

    Args:
        size: number of usable slots (the pools have ``size + 1`` rows).
    """

    kind = "slot"

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size = size
        self._free = np.arange(1, size + 1, dtype=np.int32)
        # NOTE: a bool mirror of the free list makes double frees and foreign ids cheap to
        # detect; MLX does not bounds-check slot ids, so a bad id must never reach it.
        self._is_free = np.ones(size + 1, dtype=bool)
        self._is_free[0] = False

    def available_size(self) -> int:
        return int(self._free.size)

    def alloc(self, n: int) -> np.ndarray | None:
        """Take ``n`` slots.

        Returns:
            int32 slot ids, or ``None`` when fewer than ``n`` are free (nothing is taken).
        Raises:
            ValueError: ``n`` is negative.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        if n > self._free.size:
            return None
        ids, self._free = self._free[:n], self._free[n:]
        self._is_free[ids] = False
        return ids

    def free(self, ids: np.ndarray | Iterable[int]) -> None:
        """Give slots back.

        Raises:
            ValueError: an id is out of range, the padding slot, or already free.
        """
        ids = np.asarray(ids, dtype=np.int32).reshape(-1)
        if ids.size == 0:
            return
        if ids.min() < 1 or ids.max() > self.size:
            raise ValueError(f"slot ids out of range 1..{self.size}: {ids.min()}..{ids.max()}")
        if self._is_free[ids].any() or np.unique(ids).size != ids.size:
            raise ValueError(f"double free of slot ids {ids[self._is_free[ids]][:8].tolist()}")
        self._is_free[ids] = True
        self._free = np.concatenate([self._free, ids])

    def check_integrity(self, owned: Iterable[np.ndarray]) -> None:
        """Assert that free + owned slots are exactly ``1..size``, each once.

        Args:
            owned: the slot ids held by every owner (running requests, prefix cache).
        Raises:
            AssertionError: a slot is leaked, owned twice, or both owned and free.
        """
        parts = [self._free, *[np.asarray(o, dtype=np.int32).reshape(-1) for o in owned]]
        everything = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        counts = np.bincount(everything, minlength=self.size + 1)
        leaked = np.flatnonzero(counts[1:] == 0) + 1
        doubled = np.flatnonzero(counts > 1)
        assert leaked.size == 0, (
            f"{leaked.size} {self.kind} slots leaked, e.g. {leaked[:8].tolist()}"
        )
        assert doubled.size == 0, f"{self.kind} slots held twice: {doubled[:8].tolist()}"
        assert counts[0] == 0, "the padding slot 0 was handed out"
        assert np.array_equal(np.flatnonzero(self._is_free), np.sort(self._free)), (
            "free list and free mask disagree"
        )


class TokenToKVPoolAllocator(SlotAllocator):
    """Token slots: one per position of a request in one K/V slot space."""

    kind = "token"


class StateSlotAllocator(SlotAllocator):
    """State slots: one per running request of a model with recurrent layers."""

    kind = "state"
