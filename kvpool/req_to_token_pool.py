"""Request rows: each running request owns one row mapping its token positions to slot ids."""

from __future__ import annotations

import numpy as np


class ReqToTokenPool:
    """``req_to_token[row, pos]`` is the token slot holding position ``pos`` of that row's
    request.

    Args:
        size: number of rows (the most requests that can run at once).
        max_context_len: the longest sequence one row can hold.
    """

    def __init__(self, size: int, max_context_len: int) -> None:
        if size < 1 or max_context_len < 1:
            raise ValueError(f"bad pool shape: {size} rows x {max_context_len} tokens")
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = np.zeros((size, max_context_len), dtype=np.int32)
        self._free_rows = list(range(size))

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        """Take one row, or ``None`` when all rows are in use."""
        if not self._free_rows:
            return None
        return self._free_rows.pop()

    def free(self, row: int) -> None:
        """Give a row back.

        Raises:
            ValueError: the row is out of range or already free.
        """
        if not 0 <= row < self.size or row in self._free_rows:
            raise ValueError(f"cannot free row {row} (size {self.size})")
        # NOTE: zeroing keeps a stale row from ever naming another request's slots.
        self.req_to_token[row] = 0
        self._free_rows.append(row)

    def check_integrity(self, owned_rows: list[int]) -> None:
        """Assert that free + owned rows are exactly ``0..size-1``, each once."""
        everything = sorted(self._free_rows + list(owned_rows))
        assert everything == list(range(self.size)), (
            f"request rows leaked or doubled: free={sorted(self._free_rows)} owned={owned_rows}"
        )
