"""The draft model of ``--speculative-method draft``: a smaller model with the served
model's vocabulary whose greedy continuation is a row's proposal (``speculation.py``
verifies it).

The draft runs through the same executor code as the served model (an ``Executor``), over
K/V pools of its own that use the served model's slot ids: a token's draft K/V sit in the
slot its target K/V sit in, so a slot the scheduler allocates, rolls back, preempts or hands
to the prefix cache means the same for both models. The draft is fed lazily: a row's
``draft_len`` says how many of its positions have draft K/V, and only when the policy picks
a row for a proposal does the draft catch up on the row's tokens since then (its prompt,
the tokens decoded while it was not proposing, the last token), at most ``CATCH_UP_TOKENS``
a step; then ``k - 1`` one-token greedy forwards extend the proposal, at the positions whose
slots the scheduler allocated for the step's verification. A step without proposals costs
the draft nothing. After verification the row's ``draft_len`` drops to the first rejected
position (``Scheduler._process_verified``), and preemption resets it.

The draft cannot change the output: its tokens are only proposals, and what the served
model samples at each fed position decides. Wrong draft K/V (a draft forward that failed
half way) cost acceptance, never exactness; a draft forward that raises turns the method
off for the rest of the engine's life (logged once), and requests go on without proposals.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import numpy as np

from mlxserve.scheduler.batch import ForwardBatch, SamplingArrays
from mlxserve.scheduler.executor import Executor
from mlxserve.scheduler.memory_plan import MemoryPlan, PoolRequest
from mlxserve.scheduler.request import Request
from mlxserve.scheduler.token_spaces import TokenSpace, TokenSpaces

logger = logging.getLogger(__name__)

# Weight of the newest measurement in the mean seconds of a proposal forward.
TIMING_WEIGHT = 0.3
# Slots of the probe plan that measures the draft's bytes per token.
PROBE_TOKENS = 1024
# The most of a row's tokens the draft catches up on in one step (its prompt arrives in
# chunks of this, so a long prompt does not stall a decode step).
CATCH_UP_TOKENS = 256


class DraftModel:
    """The draft model's executor, and the forwards that keep it in step and propose.

    Args:
        executor: the draft model's executor (not yet planned or allocated).
        name: the draft's model spec, for the log.
    """

    def __init__(self, executor: Executor, name: str = "draft") -> None:
        self.executor = executor
        self.name = name
        self.active = True
        # Proposals with a token id at or past this are cut there (the served model's
        # logits width; set by ``allocate``).
        self.vocab_limit = 0
        # The draft's own logits width: a token id past it is fed to the draft as 0 (MLX
        # does not bounds-check an embedding lookup).
        self.draft_vocab = 0
        # Mean seconds of one proposal forward (0: none measured yet).
        self.seconds_per_forward = 0.0
        self.forwards = 0

    # ----------------------------------------------------------------- set-up
    def bytes_per_token(self, request: PoolRequest) -> int:
        """Bytes the draft's pools take per full-attention slot (the served model's memory
        plan leaves room for them).

        Raises:
            ValueError: the draft has layers that cannot share the served model's slots.
        """
        plan = self._checked(self.executor.plan(replace(request, max_total_tokens=PROBE_TOKENS)))
        return plan.pool_bytes // plan.full_tokens

    def allocate(self, request: PoolRequest, target: MemoryPlan, vocab_limit: int) -> None:
        """Allocate the draft's pools with exactly the served model's full-attention slots.

        Raises:
            ValueError: the served model has no full-attention slots to share, or the draft
                has layers that cannot share them.
        """
        if not target.full_tokens:
            raise ValueError(
                "the served model has no full-attention layer whose slots a draft model "
                "could share; use --speculative-method ngram"
            )
        plan = self._checked(
            self.executor.plan(replace(request, max_total_tokens=target.full_tokens))
        )
        self.executor.allocate(plan)
        self.vocab_limit = vocab_limit
        self.draft_vocab = self.executor.vocab_size
        logger.info(
            "draft model %s: %d slots beside the served model's (%.1f MiB)",
            self.name,
            plan.full_tokens,
            plan.pool_bytes / 2**20,
        )

    @staticmethod
    def _checked(plan: MemoryPlan) -> MemoryPlan:
        if plan.sliding_tokens or plan.state_slots or not plan.full_tokens:
            raise ValueError(
                "the draft model must have full-attention layers only (its K/V share the "
                "served model's slots; sliding-window and recurrent layers would need slot "
                "spaces of their own)"
            )
        return plan

    # ----------------------------------------------------------------- forwards
    def fill(self, rows: list[Request], spaces: TokenSpaces) -> None:
        """Propose for the ``rows`` that hold placeholders, then give back the slots of
        every placeholder the draft left unfilled."""
        rows = [r for r in rows if r.draft_ids]
        if not rows:
            return
        wanted = [len(r.draft_ids) for r in rows]
        self.propose(rows, spaces.full)
        for req, n in zip(rows, wanted, strict=True):
            if n > len(req.draft_ids):
                spaces.free_tail(req, n - len(req.draft_ids))

    def propose(self, rows: list[Request], full: TokenSpace) -> None:
        """Replace each row's placeholder proposal (``draft_ids``: as many entries as the
        scheduler allocated slots for) with the draft's greedy tokens; a row whose draft
        reaches a token id the served model does not have is cut there, and a row still
        catching up gets none this step. On failure every row is left without a proposal
        and the method turns off.

        Forward 0 feeds each row's tokens from ``draft_len`` through its last token (or the
        next ``CATCH_UP_TOKENS`` of them); forward ``j > 0`` feeds the ``j``-th proposed
        token at position ``computed_len + j``, in the slot verification writes there too.
        """
        wanted = [len(r.draft_ids) for r in rows]
        drafts: list[list[int]] = [[] for _ in rows]
        try:
            starts = [r.draft_len for r in rows]
            ends = [min(r.computed_len + 1, r.draft_len + CATCH_UP_TOKENS) for r in rows]
            feeds = [
                self._in_vocab(np.array(r.token_ids(a, b), np.int32))
                for r, a, b in zip(rows, starts, ends, strict=True)
            ]
            batch = fed_batch(rows, starts, feeds, full)
            # A catching-up forward costs what its tokens cost, not what a proposal's does.
            tokens = self._forward(batch, timed=max(map(len, feeds)) <= 2)
            for i, req in enumerate(rows):
                req.draft_len = ends[i]
                if ends[i] == req.computed_len + 1:  # caught up: the first proposal
                    drafts[i].append(int(tokens[i]))
            for j in range(1, max(wanted)):
                live = [i for i, n in enumerate(wanted) if n > j and len(drafts[i]) == j]
                if not live:
                    break
                batch = fed_batch(
                    [rows[i] for i in live],
                    [rows[i].computed_len + j for i in live],
                    [self._in_vocab(np.array(drafts[i][-1:], np.int32)) for i in live],
                    full,
                )
                tokens = self._forward(batch, timed=True)
                for i, token in zip(live, tokens.tolist(), strict=True):
                    rows[i].draft_len += 1
                    drafts[i].append(int(token))
        except Exception:  # noqa: BLE001 - the draft is an optimisation: never fail a request
            self._fail("a proposal forward")
            drafts = [[] for _ in rows]
            for req in rows:
                req.draft_len = 0  # what it wrote is unknown
        for req, draft in zip(rows, drafts, strict=True):
            cut = next((j for j, t in enumerate(draft) if not 0 <= t < self.vocab_limit), None)
            req.draft_ids = draft if cut is None else draft[:cut]

    def _in_vocab(self, ids: np.ndarray) -> np.ndarray:
        return np.where((ids >= 0) & (ids < self.draft_vocab), ids, 0).astype(np.int32)

    def _forward(self, batch: ForwardBatch, timed: bool) -> np.ndarray:
        """The draft's greedy tokens for ``batch``; with ``timed`` its seconds go into the
        mean seconds of a proposal forward (what the policy weighs)."""
        started = time.monotonic()
        tokens = self.executor.forward(batch).next_token_ids
        if timed:
            seconds = time.monotonic() - started
            w = TIMING_WEIGHT if self.forwards else 1.0
            self.seconds_per_forward += w * (seconds - self.seconds_per_forward)
            self.forwards += 1
        return tokens

    def _fail(self, what: str) -> None:
        logger.exception(
            "draft model %s failed in %s; speculative decoding is off from now on", self.name, what
        )
        self.active = False

    def close(self) -> None:
        self.executor.close()


def greedy(batch_size: int) -> SamplingArrays:
    """Sampling arrays of ``batch_size`` greedy rows (the draft's proposals are its argmax)."""
    return SamplingArrays(
        temperature=np.zeros(batch_size, np.float32),
        top_p=np.ones(batch_size, np.float32),
        top_k=np.zeros(batch_size, np.int32),
        min_p=np.zeros(batch_size, np.float32),
    )


def fed_batch(
    rows: list[Request], starts: list[int], feeds: list[np.ndarray], full: TokenSpace
) -> ForwardBatch:
    """A batch feeding ``feeds[i]`` to ``rows[i]`` from position ``starts[i]``, into the
    full space's slots of those positions (the row holds them already), each row's last
    position sampled greedily."""
    B = len(rows)
    lens = np.array([len(f) for f in feeds], np.int32)
    start = np.array(starts, np.int32)
    ends = start + lens
    L, S = int(lens.max()), int(ends.max())
    input_ids = np.zeros((B, L), np.int32)
    write = np.zeros((B, L), np.int32)
    read = np.zeros((B, S), np.int32)
    for i, req in enumerate(rows):
        table = full.table[req.row]
        input_ids[i, : lens[i]] = feeds[i]
        write[i, : lens[i]] = table[start[i] : ends[i]]
        read[i, : ends[i]] = table[: ends[i]]
    zeros = np.zeros(B, np.int32)
    return ForwardBatch(
        phase="prefill" if L > 1 else "decode",
        request_ids=[r.request_id for r in rows],
        input_ids=input_ids,
        computed_lens=start,
        extend_lens=lens,
        write_slots=write,
        read_slots=read,
        sliding_write_slots=np.zeros((B, L), np.int32),
        sliding_read_slots=np.zeros((B, 1), np.int32),
        sliding_read_start=zeros,
        state_slots=zeros,
        fresh_rows=start == 0,
        sample_rows=np.ones(B, bool),
        sampling=greedy(B),
    )
