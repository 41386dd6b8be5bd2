"""Continuous batching on numpy: who runs next, which slots they write, preemption, finish."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import replace

import numpy as np

from mlxserve.kvpool import ReqToTokenPool, StateSlotAllocator
from mlxserve.scheduler import lookahead
from mlxserve.scheduler.batch import ForwardBatch
from mlxserve.scheduler.batch_builder import build_forward_batch
from mlxserve.scheduler.config import EngineConfig
from mlxserve.scheduler.constraints import TokenMasks
from mlxserve.scheduler.draft import DraftModel
from mlxserve.scheduler.memory_plan import MemoryPlan
from mlxserve.scheduler.prefix_cache import PrefixCache
from mlxserve.scheduler.request import Request, RequestStatus
from mlxserve.scheduler.speculation import speculation_for
from mlxserve.scheduler.step_budget import StepBudget
from mlxserve.scheduler.step_results import StepResults
from mlxserve.scheduler.token_spaces import TokenSpaces

logger = logging.getLogger(__name__)

# Share of a running request's remaining max_tokens kept free when admitting new work.
# Admission is optimistic (most requests stop well before max_tokens); preemption by
# recomputation handles the rest.
DECODE_RESERVE_RATIO = 0.25


class Scheduler(StepResults):
    """Waiting queue, running set, and the slot bookkeeping behind them.

    A step is a prefill step (new requests and next chunks of long prompts, packed up to
    ``max_prefill_tokens`` real tokens) or a decode step (one token for every running
    request whose prompt is fully in the pool). While both kinds of work exist the two
    alternate, so a long prompt arriving never stalls running streams for more than one
    chunk, and a prefill step that runs between decode steps is sized by a time budget
    (``step_budget.py``) so that it delays the decoding streams by a bounded factor. With
    speculative decoding a decoding row may feed its token plus proposals
    (``speculation.py``); ``process`` keeps what verification accepts.

    For models with recurrent layers every row of a prefill step feeds the same number of
    tokens: a padding token must never enter a recurrent state, and unmodified model code
    cannot be told to skip it, so there is no padding there at all.
    """

    def __init__(
        self,
        config: EngineConfig,
        plan: MemoryPlan,
        max_context_len: int,
        eos_token_ids: set[int],
        draft: DraftModel | None = None,
    ) -> None:
        self.config = config
        # The draft model of --speculative-method draft (its forwards fill the proposals).
        self.draft = draft
        self.plan = plan
        self.req_pool = ReqToTokenPool(config.max_running_requests, max_context_len)
        self.spaces = TokenSpaces(self.req_pool, plan.full_tokens, plan.sliding_tokens, plan.window)
        self.state_allocator = StateSlotAllocator(plan.state_slots) if plan.state_slots else None
        self.max_context_len = max_context_len
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Prompt tokens fed through a forward (the prefix cache saves the rest).
        self.prompt_tokens_computed = 0
        self.cache = PrefixCache(
            self.spaces,
            self.state_allocator,
            self.req_pool,
            plan,
            enabled=not config.disable_prefix_cache,
        )
        # Set by the engine once a request with a grammar constraint arrives.
        self.constraints: TokenMasks | None = None
        # The requests of each batch scheduled and not processed yet, oldest first: one
        # batch, or two while a launched decode step computes and the next one is built
        # (``schedule_ahead``).
        self._in_flight: deque[list[Request]] = deque()
        self._last_phase = "decode"
        self._arrivals = 0
        self.budget = StepBudget(config.max_prefill_tokens)
        self._prefill_tokens = config.max_prefill_tokens
        # Rows at the front of the in-flight batch that are decode rows (a packed prefill
        # step carries them beside its chunks).
        self._decode_in_flight = 0
        # Proposals for decoding rows (speculative decoding), None when off.
        self.speculator = speculation_for(config, max_context_len, plan.recurrent)

    # ----------------------------------------------------------------- queue changes
    def add(self, req: Request) -> None:
        """Queue a request.

        Raises:
            ValueError: the prompt leaves no room to generate within the context (an
                embedding request's prompt may fill it).
        """
        if req.embed and req.prompt_len > self.max_context_len:
            raise ValueError(
                f"input of {req.prompt_len} tokens is longer than the context of "
                f"{self.max_context_len} tokens"
            )
        if not req.embed and req.prompt_len >= self.max_context_len:
            raise ValueError(
                f"prompt of {req.prompt_len} tokens leaves no room to generate within the "
                f"context of {self.max_context_len} tokens"
            )
        self._arrivals += 1
        req.arrival = self._arrivals
        self.waiting.append(req)

    def abort(self, request_id: str) -> Request | None:
        """Remove a request wherever it is and free all its slots; ``None`` if unknown."""
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                req.status = RequestStatus.FINISHED
                return req
        for req in self.running:
            if req.request_id == request_id:
                self._release(req)
                return req
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache."""
        return self.cache.queries

    @property
    def prefix_cache_hits(self) -> int:
        """Prompt tokens found in the prefix cache."""
        return self.cache.hits

    # ----------------------------------------------------------------- scheduling
    def schedule(self) -> ForwardBatch | None:
        """Pick the next step's rows and allocate their slots; ``None`` if nothing can run."""
        assert not self._in_flight, "schedule() needs every batch in flight processed"
        decoding = [r for r in self.running if r.pending_len == 1]
        prefill_pending = self.waiting or any(r.pending_len > 1 for r in self.running)
        batch = None
        if prefill_pending and self.plan.packed:
            # One forward for both: the decoding rows and the prefill chunks beside them
            # (with the pool short, the decode step below preempts first).
            decode_rows = self._decode_rows(decoding)
            if decode_rows or not decoding:
                batch = self._schedule_prefill(decode_rows)
        elif prefill_pending and (not decoding or self._last_phase == "decode"):
            batch = self._schedule_prefill()
        if batch is None and decoding:
            batch = self._schedule_decode()
        if batch is not None:
            self._last_phase = batch.phase
        return batch

    def overlappable(self, batch: ForwardBatch) -> bool:
        """Whether ``batch`` may compute while the engine goes on (``lookahead.py``)."""
        return lookahead.overlappable(self, batch)

    def schedule_ahead(self, batch: ForwardBatch) -> tuple[ForwardBatch, np.ndarray] | None:
        """The decode step after ``batch`` (the newest batch in flight, not processed yet),
        its slots allocated, with the rows of ``batch`` whose sampled tokens its rows feed;
        None when it cannot be known before ``batch``'s results (``lookahead.py``)."""
        in_flight = self._in_flight[-1]
        rows = lookahead.next_rows(self, in_flight, batch)
        if rows is None:
            return None
        chosen = [in_flight[i] for i in rows]
        with lookahead.assumed_next_token(chosen):
            for req in chosen:
                self._alloc_slots(req, 1)
            return self._build_batch("decode", [(r, 1) for r in chosen]), rows

    def observe_step(self, batch: ForwardBatch, seconds: float) -> None:
        """Record how long ``batch``'s forward took (it sizes later prefill steps)."""
        forwards = max(1, len(batch.row_groups))
        decode_tokens = int(batch.extend_lens[: batch.decode_rows].sum())
        self.budget.observe(batch.phase, batch.num_tokens, forwards, seconds, decode_tokens)
        if self.speculator is not None and batch.phase == "decode":
            self.speculator.cost.observe(batch.num_tokens, seconds)

    def _decode_rows(self, decoding: list[Request]) -> list[tuple[Request, int]]:
        """Decode rows to run beside prefill chunks, their slots allocated; empty when the
        pool is short (the decode step then preempts, as ever)."""
        if not decoding or self.cache.available() < len(decoding):
            return []
        for req in decoding:
            self._alloc_slots(req, 1)
        return self._with_drafts(decoding)

    def _with_drafts(self, decoding: list[Request]) -> list[tuple[Request, int]]:
        """Decode rows (one slot each allocated) with the proposals the speculator gives
        them, within the slots free now (proposals never preempt or evict)."""
        draft = self.draft
        if self.speculator is not None and (draft is None or draft.active):
            if draft is not None:
                self.speculator.draft_seconds = draft.seconds_per_forward
            self.speculator.propose(decoding, self.spaces.available(), len(decoding))
            for req in decoding:
                if req.draft_ids:
                    self.spaces.alloc(req, len(req.draft_ids))
            if draft is not None:
                draft.fill(decoding, self.spaces)  # the placeholders become tokens
        return [(r, 1 + len(r.draft_ids)) for r in decoding]

    def _schedule_prefill(
        self, decode_rows: list[tuple[Request, int]] | None = None
    ) -> ForwardBatch | None:
        """A prefill step: chunks of running prompts, then new requests, within the token
        budget; ``decode_rows`` (packed backends) come first and share the forward."""
        rows: list[tuple[Request, int]] = list(decode_rows or [])
        self._decode_in_flight = len(rows)
        decoding = len(rows) or sum(r.pending_len == 1 for r in self.running)
        decode_tokens = sum(n for _, n in rows)
        self._prefill_tokens = (
            self.budget.prefill_tokens(decoding, self.plan.packed) + decode_tokens
        )
        short = int(self.cache.stop_short)
        for req in sorted(self.running, key=lambda r: r.arrival):
            if req.pending_len <= 1:
                continue
            wanted = min(req.pending_len - short, self.cache.available())
            n = self._chunk_len(rows, wanted)
            if n is None:
                break
            if n == 0:
                continue
            self._alloc_slots(req, n)
            rows.append((req, n))
        for req in list(self.waiting):
            if self.req_pool.available_size() == 0:
                break
            found = self.cache.match(req)
            matched = found.length if found is not None else 0
            prefilling = [r for r in self.running if r.pending_len > 1]
            if self.cache.should_defer(req, matched, prefilling):
                continue
            # Stopping short may leave nothing to feed now: the request is admitted and its
            # last token runs in the next decode step.
            n = req.seq_len - matched - short
            if n:
                n = self._chunk_len(rows, n)
                if n is None:
                    break
                if n == 0:
                    continue
            self.cache.lock(found)
            if not self._can_admit(n) or not self._admit(req, found):
                self.cache.unlock(found)
                break
            if n:
                self._alloc_slots(req, n)
                rows.append((req, n))
        if len(rows) == self._decode_in_flight:
            return self._build_batch("decode", rows) if rows else None
        return self._build_batch("prefill", rows)

    def _chunk_len(self, rows: list[tuple[Request, int]], wanted: int) -> int | None:
        """Tokens the next row may feed in this prefill step: 0 to skip the row, None when
        the step is full.

        The budget counts real tokens: the executor runs rows of different lengths as
        separate forwards (``plan_row_groups``), so a short row costs its own length, not
        the longest row's. A row longer than what is left is cut (the rest follows in
        later chunks). With recurrent layers the first row fixes the width and shorter rows
        wait (no padding may enter a state).
        """
        budget = self._prefill_tokens
        if len(rows) == self._decode_in_flight:
            return min(wanted, budget - sum(n for _, n in rows)) or None
        if self.plan.recurrent:
            width = rows[0][1]  # never with decode rows beside: those are packed backends
            if (len(rows) + 1) * width > budget:
                return None
            return width if wanted >= width else 0
        left = budget - sum(n for _, n in rows)
        if left <= 0:
            return None
        return min(wanted, left)

    def _admit(self, req: Request, found) -> bool:
        """Give a waiting request its row (and state slot) and start it from the cached
        prefix ``found``; False (nothing taken) when no state slot can be had."""
        if self.state_allocator is not None:
            state_slot = self.cache.alloc_state()
            if state_slot is None:
                return False
            req.state_slot = state_slot
        self.waiting.remove(req)
        req.row = self.req_pool.alloc()
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self.cache.adopt(req, found)
        return True

    def _can_admit(self, n: int) -> bool:
        free = self.cache.available()
        if not self.running:
            return n <= free
        reserved = sum(
            r.pending_len + int(r.remaining_tokens * DECODE_RESERVE_RATIO) for r in self.running
        )
        return n <= free - reserved

    def _schedule_decode(self) -> ForwardBatch | None:
        decoding = [r for r in self.running if r.pending_len == 1]
        while self.cache.available() < len(decoding):
            victim = max(self.running, key=lambda r: r.arrival)
            self._preempt(victim)
            if victim in decoding:
                decoding.remove(victim)
        if not decoding:
            return None
        for req in decoding:
            self._alloc_slots(req, 1)
        self._decode_in_flight = len(decoding)
        return self._build_batch("decode", self._with_drafts(decoding))

    def _build_batch(self, phase: str, rows: list[tuple[Request, int]]) -> ForwardBatch:
        self._in_flight.append([r for r, _ in rows])
        batch = build_forward_batch(
            phase,
            rows,
            self.spaces,
            self.eos_token_ids,
            self.plan.ragged_attention,
            packed=self.plan.packed,
        )
        snapshots = []
        if phase == "prefill":
            for req, n in rows[self._decode_in_flight :]:
                pair = self.cache.plan_snapshot(req, req.computed_len + n)
                if pair is not None:
                    snapshots.append(pair)
        sampling = batch.sampling
        if self.constraints is not None:
            constraints = [
                r.constraint if sample else None
                for (r, _), sample in zip(rows, batch.sample_rows, strict=True)
            ]
            sampling = replace(sampling, token_bitmask=self.constraints(constraints))
        return replace(
            batch,
            sampling=sampling,
            state_copies_in=self.cache.take_copies_in(),
            state_snapshots=np.array(snapshots, np.int32).reshape(-1, 2),
            decode_rows=len(rows) if phase == "decode" else self._decode_in_flight,
        )

    # ----------------------------------------------------------------- slots
    def _alloc_slots(self, req: Request, n: int) -> None:
        self.cache.make_room(n)
        self.spaces.alloc(req, n)

    def _free_slots(self, req: Request, keep: bool = True) -> None:
        if req.row is None:
            return
        self.cache.release(req, keep)
        self.req_pool.free(req.row)
        if req.state_slot is not None:
            self.state_allocator.free([req.state_slot])
            req.state_slot = None
        req.row = None
        req.allocated_len = 0

    def _release(self, req: Request, keep: bool = True) -> None:
        """A running request leaves for good (finished, aborted or failed); with ``keep``
        its sequence goes to the prefix cache."""
        self._free_slots(req, keep)
        if req in self.running:
            self.running.remove(req)
        req.status = RequestStatus.FINISHED

    def _preempt(self, req: Request) -> None:
        """Free a running request's slots and queue it first; it recomputes on resume."""
        logger.info("preempting %s (%d tokens)", req.request_id, req.seq_len)
        self._free_slots(req)
        self.running.remove(req)
        req.computed_len = 0
        req.draft_len = 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def check_integrity(self) -> None:
        """Assert every token slot, state slot and request row is free or owned exactly
        once (by a running request or by the prefix cache)."""
        self.spaces.check_integrity(self.running, self.cache.owned_slots())
        if self.state_allocator is not None:
            owned = [[r.state_slot] for r in self.running if r.state_slot is not None]
            owned += [[r.pending_snapshot] for r in self.running if r.pending_snapshot]
            owned.append(self.cache.owned_states())
            self.state_allocator.check_integrity(owned)
        self.cache.check_integrity(idle=not self.running)
        self.req_pool.check_integrity([r.row for r in self.running])
        for req in self.waiting:
            assert req.row is None and req.allocated_len == 0, (
                f"waiting {req.request_id} holds slots"
            )
