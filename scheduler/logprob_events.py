"""Attaching the forward's logprob arrays to requests and their token events (numpy only)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from mlxserve.scheduler.batch import ForwardOutput, LogprobArrays
from mlxserve.scheduler.outputs import RequestOutput
from mlxserve.scheduler.request import Request


def record_prompt_logprobs(req: Request, arrays: LogprobArrays | None, row: int) -> None:
    """Keep the prompt logprobs batch row ``row`` computed for ``req`` in this chunk.

    Entries are stored by prompt position, so a chunk recomputed after a preemption
    overwrites what the first attempt left instead of appending twice.
    """
    if arrays is None or req.params.prompt_logprobs is None:
        return
    entries = np.flatnonzero(arrays.rows == row).tolist()
    if not entries:
        return
    acc = req.prompt_logprob_entries
    first = int(arrays.positions[entries[0]])
    del acc[first:]
    # Position 0 has no logprob; positions before ``first`` came in earlier chunks.
    acc.extend([None] * (first - len(acc)))
    k = req.params.prompt_logprobs
    acc.extend(arrays.entry(n, k) for n in entries)


def with_logprobs(
    event: RequestOutput, req: Request, out: ForwardOutput, row: int, count: int = 1
) -> RequestOutput:
    """``event`` (the ``count`` tokens batch row ``row`` emitted: more than one when it
    verified proposals) with the logprobs ``req`` asked for: each token's own, and the
    prompt's on the request's first token."""
    p = req.params
    fields = {}
    if p.logprobs is not None and out.logprobs is not None:
        arrays = out.logprobs
        # A row's entries ascend by fed position: the first ``count`` are the emitted ones.
        n = np.flatnonzero(arrays.rows == row)[:count]
        if n.size:
            fields["logprobs"] = [arrays.entry(int(e), p.logprobs) for e in n]
    if p.prompt_logprobs is not None and req.output_len == 1:
        acc = req.prompt_logprob_entries
        acc.extend([None] * (req.prompt_len - len(acc)))
        fields["prompt_logprobs"] = acc[: req.prompt_len]
        req.prompt_logprob_entries = []
    return replace(event, **fields) if fields else event
