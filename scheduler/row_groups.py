"""Splitting a step's rows into sub-forwards of similar width.

A batched forward is ``[B, L]`` queries over ``S`` keys: every row is padded to the longest,
and on the CPU backend a padded position costs as much as a real one. Rows are independent
(each reads and writes only its own slots and state), so a step may run them as several
forwards, one per group of similar widths. A forward has a fixed cost too (every weight is
read again; on this machine ~0.1 s), so the split minimizes
``sum(rows x width) + groups x overhead``, with two notions of width:

- prefill: the tokens fed (32 chat prompts of 40-200 tokens computed 5,305 positions for
  3,431 tokens in one forward);
- decode: the context each row attends over. One long conversation among short ones made
  every row of a decode step gather and attend over the long one's context.
"""

from __future__ import annotations

import numpy as np

# The fixed cost of one more forward, in prefill tokens (SmolLM2-135M float32 on this 2-CPU
# VM: a 1-token forward takes ~150 ms and a prefill token ~9 ms with one OpenBLAS thread,
# ~115 ms and ~6.5 ms with two).
FORWARD_OVERHEAD_TOKENS = 16

# The same fixed cost in decode key columns (rows x context): at batch 32, a padded context
# column of a decode row costs ~38 us (its K/V gather and its attention, over 30 layers),
# and two batch-16 forwards take ~100 ms more than one batch-32 forward.
DECODE_OVERHEAD_KEYS = 2600


def plan_row_groups(
    extend_lens: np.ndarray, overhead: int = FORWARD_OVERHEAD_TOKENS
) -> list[np.ndarray]:
    """Partition row indices into groups, each run as one forward padded to its widest row.

    Rows sorted by width (widest first) are cut into contiguous runs by dynamic
    programming, which is optimal for this cost: some optimal partition is contiguous in
    sorted order.

    Returns:
        int arrays of row indices, widest rows first; together they hold every row once.
    """
    lens = np.asarray(extend_lens, dtype=np.int64)
    order = np.argsort(-lens, kind="stable")
    sorted_lens = lens[order]
    B = len(sorted_lens)
    # A split saves at most the padding of one forward: when that is below the cost of a
    # second forward, there is nothing to plan (the common case, checked in O(B)).
    if B == 0 or int(sorted_lens[0]) * B - int(sorted_lens.sum()) <= overhead:
        return [order]
    # best[j]: the cheapest cost of the first j sorted rows; cut[j]: where its last group
    # starts (a group starting at i is as wide as sorted row i).
    best = np.zeros(B + 1, np.int64)
    cut = np.zeros(B + 1, np.int64)
    starts = np.arange(B, dtype=np.int64)
    for j in range(1, B + 1):
        costs = best[:j] + (j - starts[:j]) * sorted_lens[:j] + overhead
        cut[j] = int(np.argmin(costs))
        best[j] = costs[cut[j]]
    groups = []
    j = B
    while j > 0:
        groups.append(order[cut[j] : j])
        j = int(cut[j])
    return groups[::-1]


def plan_decode_groups(context_lens: np.ndarray) -> list[np.ndarray]:
    """Groups of decode rows by the context they attend over (``DECODE_OVERHEAD_KEYS`` per
    extra forward)."""
    return plan_row_groups(context_lens, DECODE_OVERHEAD_KEYS)


def padded_area(extend_lens: np.ndarray, groups: list[np.ndarray]) -> int:
    """Positions the grouped forwards compute (rows x longest row, summed over groups)."""
    lens = np.asarray(extend_lens)
    return int(sum(len(g) * int(lens[g].max()) for g in groups))
