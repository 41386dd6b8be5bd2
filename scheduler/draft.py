"""The draft model of ``--speculative-method draft``: a smaller model with the served
model's vocabulary whose greedy continuation is a row's proposal (``speculation.py``
verifies it).

The draft runs through the same executor code as the served model (an ``Executor``), over
K/V pools of its own that use the served model's slot ids: a token's draft K/V sit in the
slot its target K/V sit in. That keeps the draft in step for free -- a slot the scheduler
allocates, rolls back, preempts, trims or hands to the prefix cache means the same for both
models -- as long as the draft sees every token the target does: after each forward of the
served model the draft runs over the same batch (``sync``: prompt chunks, decoded tokens,
the verified proposals). A proposal (``propose``) is then ``k`` one-token greedy forwards of
the draft over the proposing rows, at the positions whose slots the scheduler allocated for
the step's verification.

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
        reaches a token id the served model does not have is cut there. On failure every
        row is left without a proposal and the method turns off.

        Each row's K/V up to its last token are in the draft's pools (``sync``), so forward
        ``j`` feeds the row's last token (``j = 0``) or its ``j``-th proposal at position
        ``computed_len + j``, in the slot verification will write there too.
        """
        wanted = [len(r.draft_ids) for r in rows]
        drafts: list[list[int]] = [[] for _ in rows]
        fed = [r.token_ids(r.computed_len, r.computed_len + 1)[0] for r in rows]
        started = time.monotonic()
        try:
            for j in range(max(wanted)):
                live = [i for i, n in enumerate(wanted) if n > j]
                tokens = self._in_vocab(np.array([fed[i] for i in live], np.int32))
                batch = one_token_batch([rows[i] for i in live], j, tokens, full)
                tokens = self.executor.forward(batch).next_token_ids
                for i, token in zip(live, tokens.tolist(), strict=True):
                    drafts[i].append(int(token))
                    fed[i] = int(token)
        except Exception:  # noqa: BLE001 - the draft is an optimisation: never fail a request
            self._fail("a proposal forward")
            drafts = [[] for _ in rows]
        else:
            self._time(time.monotonic() - started, max(wanted))
        for req, draft in zip(rows, drafts, strict=True):
            cut = next((j for j, t in enumerate(draft) if not 0 <= t < self.vocab_limit), None)
            req.draft_ids = draft if cut is None else draft[:cut]

    def sync(self, batch: ForwardBatch) -> None:
        """Feed the draft what the served model's ``batch`` fed, into the same slots (the
        sampled tokens are dropped: only the K/V matter)."""
        if not self.active:
            return
        try:
            view = draft_view(batch)
            self.executor.forward(replace(view, input_ids=self._in_vocab(view.input_ids)))
        except Exception:  # noqa: BLE001 - see propose
            self._fail("a forward keeping its K/V in step")

    def _in_vocab(self, ids: np.ndarray) -> np.ndarray:
        return np.where((ids >= 0) & (ids < self.draft_vocab), ids, 0).astype(np.int32)

    def _time(self, seconds: float, forwards: int) -> None:
        per = seconds / max(1, forwards)
        w = TIMING_WEIGHT if self.forwards else 1.0
        self.seconds_per_forward += w * (per - self.seconds_per_forward)
        self.forwards += forwards

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


def draft_view(batch: ForwardBatch) -> ForwardBatch:
    """The served model's batch as the draft runs it: the same tokens and slots, greedy
    sampling of each row's last position only, no vision inputs (the draft is a text
    model: image placeholders are plain tokens to it) and no recurrent-state copies."""
    empty = np.zeros((0, 2), np.int32)
    return replace(
        batch,
        sampling=greedy(batch.batch_size),
        state_copies_in=empty,
        state_snapshots=empty,
        embed_rows=None,
        image_embeddings=None,
        position_ids=None,
        spec_lens=None,
    )


def one_token_batch(
    rows: list[Request], offset: int, tokens: np.ndarray, full: TokenSpace
) -> ForwardBatch:
    """A decode batch feeding ``tokens[i]`` at position ``computed_len + offset`` of
    ``rows[i]``, into the full space's slot of that position (allocated already)."""
    B = len(rows)
    positions = np.array([r.computed_len + offset for r in rows], np.int32)
    S = int(positions.max()) + 1
    write = np.zeros((B, 1), np.int32)
    read = np.zeros((B, S), np.int32)
    for i, req in enumerate(rows):
        table = full.table[req.row]
        read[i, : positions[i] + 1] = table[: positions[i] + 1]
        write[i, 0] = table[positions[i]]
    zeros = np.zeros(B, np.int32)
    return ForwardBatch(
        phase="decode",
        request_ids=[r.request_id for r in rows],
        input_ids=np.asarray(tokens, np.int32)[:, None],
        computed_lens=positions,
        extend_lens=np.ones(B, np.int32),
        write_slots=write,
        read_slots=read,
        sliding_write_slots=np.zeros((B, 1), np.int32),
        sliding_read_slots=np.zeros((B, 1), np.int32),
        sliding_read_start=zeros,
        state_slots=zeros,
        fresh_rows=np.zeros(B, bool),
        sample_rows=np.ones(B, bool),
        sampling=greedy(B),
    )
