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
decode rows and the chunks share one forward: the step is a decode step plus its prompt
tokens, so the chunks may take ``PREFILL_STEP_RATIO`` decode steps' time at the measured
cost of a prompt token in a packed step (its time less a decode step's, per prompt token).
A decode step of ``D`` rows is taken to cost ``D + FORWARD_OVERHEAD_TOKENS`` units of a
measured unit time (within 40% from batch 1 to 32 on the CPU), so that a burst of packed
steps, where no decode step of that size is ever timed, is not measured against the batch-1
decode steps of the request before it.

Counting a prompt token as one more decode row, as this did before it was timed, made the
packed steps 3x a decode step on the CPU (a decode row reads weights that are read anyway;
a prompt token also pays its activations and its causal attention), and the inter-token
latency p99 at concurrency 32 3.05x its p50. Until both are measured, the packed budget is
counted in tokens (``D`` decode rows cost ``D + overhead``). Without packing, the prefill
step is a forward of its own, timed against the decode step. Times are moving averages, so the
budget follows the machine's load. Without decoding requests a prefill step takes the full
``max_prefill_tokens``.
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
        self.decode_unit_s: float | None = None  # a decode step / (its rows + overhead)
        self.packed_token_s: float | None = None  # a prompt token's share of a packed step

    def observe(
        self, phase: str, tokens: int, forwards: int, seconds: float, decode_tokens: int = 0
    ) -> None:
        """Record one step: ``tokens`` fed in ``forwards`` forwards took ``seconds``, of
        which ``decode_tokens`` were decode rows packed beside the prompt chunks."""
        if seconds <= 0:
            return
        if phase == "decode":
            self.decode_s = _average(self.decode_s, seconds)
            unit = seconds / (tokens + FORWARD_OVERHEAD_TOKENS)
            self.decode_unit_s = _average(self.decode_unit_s, unit)
        elif decode_tokens and tokens > decode_tokens:
            if self.decode_unit_s is None:
                return
            # The step less a decode step; at least a tenth of the step, so that noise (a
            # decode step measured under load) never makes prompt tokens look free.
            extra = max(seconds - self._decode_step_s(decode_tokens), 0.1 * seconds)
            self.packed_token_s = _average(self.packed_token_s, extra / (tokens - decode_tokens))
        else:
            per_token = seconds / (tokens + FORWARD_OVERHEAD_TOKENS * max(1, forwards))
            self.token_s = _average(self.token_s, per_token)

    def prefill_tokens(self, decode_rows: int, packed: bool = False) -> int:
        """Prompt tokens the next prefill step may feed while ``decode_rows`` rows decode
        (beside them in the same forward when ``packed``)."""
        if decode_rows == 0:
            return self.max_prefill_tokens
        if packed and self.decode_unit_s is not None and self.packed_token_s is not None:
            fits = int(PREFILL_STEP_RATIO * self._decode_step_s(decode_rows) / self.packed_token_s)
        elif packed:
            fits = int(PREFILL_STEP_RATIO * (decode_rows + FORWARD_OVERHEAD_TOKENS))
        elif self.decode_s is None or self.token_s is None:
            return self.max_prefill_tokens
        else:
            per_step = PREFILL_STEP_RATIO * self.decode_s / self.token_s
            fits = int(per_step) - FORWARD_OVERHEAD_TOKENS
        return min(self.max_prefill_tokens, max(MIN_CHUNK_TOKENS, fits))

    def _decode_step_s(self, rows: int) -> float:
        """The estimated time of a decode step of ``rows`` rows (``decode_unit_s`` known)."""
        assert self.decode_unit_s is not None
        return self.decode_unit_s * (rows + FORWARD_OVERHEAD_TOKENS)


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
