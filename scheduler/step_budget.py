"""How many prefill tokens a step may take while other requests decode: a time budget.

Prefill and decode steps alternate (``Scheduler.schedule``), so every prefill step sits in
the gap between two tokens of every decoding stream. A prefill step of ``max_prefill_tokens``
tokens takes seconds on a CPU (SmolLM2-135M float32 on the 2-CPU VM: ~6.5 ms a token plus
~0.1 s a forward) while a batch-32 decode step takes a few hundred milliseconds, so full
chunks made the inter-token latency p99 at concurrency 32 seven times its p50 (1,618 vs
225 ms). Here the chunk is sized so that an interleaved prefill step takes at most
``PREFILL_STEP_RATIO`` decode steps: a decoding stream's gap is then at most
``1 + PREFILL_STEP_RATIO`` of its usual one.

The cost model is the row groups' (``row_groups.py``): a forward costs its tokens plus a
fixed ``FORWARD_OVERHEAD_TOKENS``. When the backend packs rows (``MemoryPlan.packed``), the
decode rows and the chunks share one forward, so the budget is counted in tokens alone:
``D`` decode rows cost ``D + overhead`` and the chunks may add ``PREFILL_STEP_RATIO`` times
that. Otherwise the prefill step is a forward of its own, timed against the decode step:
both times are measured (moving averages, so the budget follows the machine's load). Without
decoding requests a prefill step takes the full ``max_prefill_tokens``.
"""

from __future__ import annotations

from mlxserve.scheduler.row_groups import FORWARD_OVERHEAD_TOKENS

# An interleaved prefill step takes at most this many decode steps' time.
PREFILL_STEP_RATIO = 1.5
# The smallest chunk, so that a prompt always makes progress at a sane cost per token.
MIN_CHUNK_TOKENS = 32
# Weight of the newest measurement in the moving averages.
SMOOTHING = 0.3


class StepBudget:
    """Measured step costs and the prefill token budget they allow.

    Args:
        max_prefill_tokens: the budget when no request is decoding (and the most ever).
    """

    def __init__(self, max_prefill_tokens: int) -> None:
        self.max_prefill_tokens = max_prefill_tokens
        self.decode_s: float | None = None  # seconds of a decode step
        self.token_s: float | None = None  # seconds of a prefill token (overhead included)

    def observe(self, phase: str, tokens: int, forwards: int, seconds: float) -> None:
        """Record one step: ``tokens`` fed in ``forwards`` forwards took ``seconds``."""
        if seconds <= 0:
            return
        if phase == "decode":
            self.decode_s = _average(self.decode_s, seconds)
        else:
            per_token = seconds / (tokens + FORWARD_OVERHEAD_TOKENS * max(1, forwards))
            self.token_s = _average(self.token_s, per_token)

    def prefill_tokens(self, decode_rows: int, packed: bool = False) -> int:
        """Prompt tokens the next prefill step may feed while ``decode_rows`` rows decode
        (beside them in the same forward when ``packed``)."""
        if decode_rows == 0:
            return self.max_prefill_tokens
        if packed:
            fits = int(PREFILL_STEP_RATIO * (decode_rows + FORWARD_OVERHEAD_TOKENS))
        elif self.decode_s is None or self.token_s is None:
            return self.max_prefill_tokens
        else:
            per_step = PREFILL_STEP_RATIO * self.decode_s / self.token_s
            fits = int(per_step) - FORWARD_OVERHEAD_TOKENS
        return min(self.max_prefill_tokens, max(MIN_CHUNK_TOKENS, fits))


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
