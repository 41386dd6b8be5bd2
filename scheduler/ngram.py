"""Prompt lookup: propose the tokens that followed the sequence's own last n tokens before.

Copy-heavy requests (rewrite this text, quote and answer, edit this code) repeat long runs
of their prompt; when the last ``n`` tokens occurred earlier in the prompt or the output, the
tokens that followed that occurrence are a cheap guess at what comes next. The guess costs
no model: the forward that decodes the next token verifies it (``speculation.py``).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

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
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = ids[L - n :]
        # Windows starting at 0 .. L-n-1: each has at least one token after it, and the
        # suffix itself (starting at L-n) is not among them.
        windows = sliding_window_view(ids[: L - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return ids[start : start + k].tolist()
    return []
