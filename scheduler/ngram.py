"""Prompt lookup: propose the tokens that followed the sequence's own last n tokens before.

Copy-heavy requests (rewrite this text, quote and answer, edit this code) repeat long runs
of their prompt; when the last ``n`` tokens occurred earlier in the prompt or the output, the
tokens that followed that occurrence are a cheap guess at what comes next. The guess costs
no model: the forward that decodes the next token verifies it (``speculation.py``).
"""

from __future__ import annotations

import numpy as np

# Only the most recent tokens are searched: a match far back is rarely the one that
# continues, and the search is numpy work on the engine thread every step of every row.
SEARCH_WINDOW = 4096


def propose_ngram(ids: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the last ``n``
    tokens of ``ids``, for the longest ``n`` in ``[min_n, max_n]`` that occurs; ``[]`` when
    none does.

    Args:
        ids: int ``[L]``, the request's prompt followed by its output so far.
    """
    ids = ids[-SEARCH_WINDOW:]
    L = len(ids)
    # Earlier occurrences end where the last token occurs again (not at L-1 itself): one
    # pass over the ids, then each longer match checked at those few ends only.
    ends = np.flatnonzero(ids[: L - 1] == ids[L - 1])
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        found = ends[ends >= n - 1]
        for j in range(1, n):
            if not found.size:
                break
            found = found[ids[found - j] == ids[L - 1 - j]]
        if found.size:
            start = int(found[-1]) + 1
            return ids[start : start + k].tolist()
    return []
