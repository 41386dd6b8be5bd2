"""Splitting a prefill step's rows into sub-forwards of similar length.

A batched forward is ``[B, L]``: every row is padded to the longest, and on the CPU backend
a padded position costs as much as a real one (the matmuls are compute-bound). Prompts of
mixed lengths packed into one forward waste most of it: 32 chat prompts of 40-200 tokens
computed 5,305 positions for 3,431 tokens. Rows are independent (each reads and writes only
its own slots and state), so a step may run them as several forwards, one per group of
similar lengths. A forward has a fixed cost too (every weight is read again; on this
machine ~0.15 s, the time of ~16 prefill tokens), so the split minimizes
``sum(rows x width) + groups x FORWARD_OVERHEAD_TOKENS``.
"""

from __future__ import annotations

import numpy as np

# The fixed cost of one more forward, in prefill tokens (SmolLM2-135M float32 on this 2-CPU
# VM: a 1-token forward takes ~150 ms and a prefill token ~9 ms with one OpenBLAS thread,
# ~115 ms and ~6.5 ms with two).
FORWARD_OVERHEAD_TOKENS = 16


def plan_row_groups(
    extend_lens: np.ndarray, overhead: int = FORWARD_OVERHEAD_TOKENS
) -> list[np.ndarray]:
    """Partition row indices into groups, each run as one forward padded to its longest row.

    Rows sorted by length (longest first) are cut into contiguous runs by dynamic
    programming, which is optimal for this cost: some optimal partition is contiguous in
    sorted order.

    Returns:
        int arrays of row indices, longest rows first; together they hold every row once.
    """
    lens = np.asarray(extend_lens, dtype=np.int64)
    order = np.argsort(-lens, kind="stable")
    sorted_lens = lens[order]
    B = len(sorted_lens)
    # best[j]: the cheapest cost of the first j sorted rows; cut[j]: where its last group starts.
    best = [0] * (B + 1)
    cut = [0] * (B + 1)
    for j in range(1, B + 1):
        costs = [best[i] + (j - i) * int(sorted_lens[i]) + overhead for i in range(j)]
        cut[j] = int(np.argmin(costs))
        best[j] = costs[cut[j]]
    groups = []
    j = B
    while j > 0:
        groups.append(order[cut[j] : j])
        j = cut[j]
    return groups[::-1]


def padded_area(extend_lens: np.ndarray, groups: list[np.ndarray]) -> int:
    """Positions the grouped forwards compute (rows x longest row, summed over groups)."""
    lens = np.asarray(extend_lens)
    return int(sum(len(g) * int(lens[g].max()) for g in groups))
