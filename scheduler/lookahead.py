"""Looking one decode step ahead: the next step is built while the current one computes.

mlx-lm's generation loop builds step t+1's graph on step t's lazy tokens and lets MLX
evaluate it while Python turns step t's token into text; building a SmolLM2 step's graph
is ~8 ms of Python, time that a synchronous loop adds to every step. The engine does the
same for decode steps (``Engine._collect_launched``): while step t computes, the scheduler
allocates step t+1's slots and builds its batch for the rows that decode once more whatever
token t turns out to be, the executor launches it fed by step t's tokens, and only then does
the engine wait for step t and process it.

A row's step t+1 is known before its token t only when nothing about it depends on that
token: no grammar (its mask does), no penalties (their window holds it), no speculation
(proposals extend it), no recurrent state (a state snapshot taken when a request leaves
would already hold step t+1), nothing else waiting or prefilling (that work would go into
the next step). Rows that finish on token t (EOS, a stop token) computed one wasted step;
their slot is freed with the rest of theirs, and process() skips their row. Rows that
surely finish on token t (max_tokens, the context's end) are left out.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np

from mlxserve.scheduler.batch import ForwardBatch
from mlxserve.scheduler.request import Request, RequestStatus

if TYPE_CHECKING:
    from mlxserve.scheduler.scheduler import Scheduler


def overlappable(sched: Scheduler, batch: ForwardBatch) -> bool:
    """Whether ``batch`` may compute while the engine goes on (drains its inbox, builds the
    next step): a decode step without proposals, of a model without recurrent state."""
    return (
        batch.phase == "decode"
        and batch.spec_lens is None
        and sched.speculator is None
        and not sched.plan.recurrent
    )


def next_rows(sched: Scheduler, in_flight: list[Request], batch: ForwardBatch) -> np.ndarray | None:
    """The rows of ``batch`` (in flight, its requests ``in_flight``) whose next decode step
    can be built now; None when no step can be (see the module's docstring)."""
    if not overlappable(sched, batch) or sched.waiting:
        return None
    if len(sched.running) != len(in_flight):
        return None  # someone prefills, or a row left (aborted) since
    for req in in_flight:
        if req.status is not RequestStatus.RUNNING or req.constraint is not None:
            return None
        if req.params.uses_penalties or req.embed or req.images is not None:
            return None
    rows = [
        i
        for i, req in enumerate(in_flight)
        if req.remaining_tokens >= 2 and req.seq_len + 1 < sched.max_context_len
    ]
    if not rows or sched.cache.available() < len(rows):
        return None
    return np.array(rows, np.int32)


@contextmanager
def assumed_next_token(reqs: list[Request]) -> Iterator[None]:
    """Within the block each request looks as if its token in flight had been sampled and
    fed (a placeholder ``0`` appended, ``computed_len`` one further): the state in which
    the scheduler builds its next decode step. Undone on the way out."""
    for req in reqs:
        req.output_ids.append(0)
        req.computed_len += 1
    try:
        yield
    finally:
        for req in reqs:
            req.output_ids.pop()
            req.computed_len -= 1
            # all_ids() caches by length: the placeholder must not outlive the block.
            req.forget_cached_ids()
