"""Continuous batching on numpy: who runs next, which slots they write, preemption, finish."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import replace

import numpy as np

from mlxserve.kvpool import ReqToTokenPool, StateSlotAllocator
from mlxserve.scheduler.batch import ForwardBatch, ForwardOutput
from mlxserve.scheduler.batch_builder import build_forward_batch
from mlxserve.scheduler.config import EngineConfig
from mlxserve.scheduler.constraints import GrammarDeadEnd, TokenMasks
from mlxserve.scheduler.draft import DraftModel
from mlxserve.scheduler.events import make_event
from mlxserve.scheduler.logprob_events import record_prompt_logprobs, with_logprobs
from mlxserve.scheduler.memory_plan import MemoryPlan
from mlxserve.scheduler.outputs import FinishReason, RequestOutput
from mlxserve.scheduler.prefix_cache import PrefixCache
from mlxserve.scheduler.request import Request, RequestStatus
from mlxserve.scheduler.speculation import speculation_for
from mlxserve.scheduler.step_budget import StepBudget
from mlxserve.scheduler.token_spaces import TokenSpaces

logger = logging.getLogger(__name__)

# Share of a running request's remaining max_tokens kept free when admitting new work.
# Admission is optimistic (most requests stop well before max_tokens); preemption by
# recomputation handles the rest.
DECODE_RESERVE_RATIO = 0.25


class Scheduler:
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
        self._in_flight: list[Request] = []
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

    def observe_step(self, batch: ForwardBatch, seconds: float) -> None:
        """Record how long ``batch``'s forward took (it sizes later prefill steps)."""
        forwards = max(1, len(batch.row_groups))
        self.budget.observe(batch.phase, batch.num_tokens, forwards, seconds)
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
        self._in_flight = [r for r, _ in rows]
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
        )

    # ----------------------------------------------------------------- results
    def process(self, batch: ForwardBatch, out: ForwardOutput) -> list[RequestOutput]:
        """Advance the in-flight requests by the forward's results; finished ones leave and
        free their slots now. Returns one event per request that got a token."""
        events = []
        for i, req in enumerate(self._in_flight):
            draft, req.draft_ids = req.draft_ids, []
            if draft:
                events.append(self._process_verified(req, draft, out, i))
                continue
            before = min(req.computed_len, req.prompt_len)
            req.computed_len += int(batch.extend_lens[i])
            self.prompt_tokens_computed += min(req.computed_len, req.prompt_len) - before
            assert req.computed_len == req.allocated_len, (req.computed_len, req.allocated_len)
            self.spaces.trim_window(req)
            if batch.phase == "prefill" and i >= self._decode_in_flight:
                self.cache.chunk_done(req)
                if req.images is not None:
                    req.images.release_before(req.computed_len)
            record_prompt_logprobs(req, out.prompt_logprobs, i)
            if not batch.sample_rows[i]:
                continue
            if req.embed:
                events.append(self._finish_embedding(req, out.embeddings, i))
                continue
            token = int(out.next_token_ids[i])
            try:
                reason = self._accept(req, token)
            except GrammarDeadEnd as e:
                self._release(req)
                events.append(self.make_event(req, [], "error", error=str(e), invalid=True))
                continue
            except Exception as e:  # noqa: BLE001 - fails this request only
                logger.exception("request %s failed on token %d", req.request_id, token)
                self._release(req)
                events.append(self.make_event(req, [], "error", error=str(e)))
                continue
            if reason is not None:
                self._release(req)
            events.append(with_logprobs(self.make_event(req, [token], reason), req, out, i))
        self._in_flight = []
        return events

    def _process_verified(
        self, req: Request, draft: list[int], out: ForwardOutput, i: int
    ) -> RequestOutput:
        """A decode row that fed ``[last token] + draft``: emit what verification kept, cut
        where plain decoding would have stopped (EOS, a stop token, max_tokens), and give
        back the slots of every position past the last emitted token's predecessor."""
        emitted = self.speculator.verify(req, draft, out.spec_token_ids[i])
        taken: list[int] = []
        reason = None
        for token in emitted:
            taken.append(token)
            reason = self._accept(req, token)
            if reason is not None:
                break
        # K/V are right for the last token and the accepted proposals before the last
        # emitted token (that one is fed next, as after any decode step).
        req.computed_len += len(taken)
        # A draft model fed the proposals: its K/V are right up to the first rejected one.
        req.draft_len = min(req.draft_len, req.computed_len)
        self.spaces.free_tail(req, req.allocated_len - req.computed_len)
        self.spaces.trim_window(req)
        if reason is not None:
            self._release(req)
        return with_logprobs(self.make_event(req, taken, reason), req, out, i, len(taken))

    def _finish_embedding(
        self, req: Request, embeddings: np.ndarray | None, i: int
    ) -> RequestOutput:
        """An embedding request's prompt is in: it leaves (its prompt's K/V go to the
        prefix cache) with the hidden state of its last position."""
        self._release(req)
        if embeddings is None:
            return self.make_event(req, [], "error", error="the forward returned no embedding")
        return replace(self.make_event(req, [], "stop"), embedding=embeddings[i].copy())

    def _accept(self, req: Request, token: int) -> FinishReason | None:
        """Append a sampled token; returns why the request finishes, if it does.

        Raises:
            Exception: this request cannot go on (e.g. its grammar refused the token); the
                caller fails it alone.
        """
        req.output_ids.append(token)
        return self._finish_reason(req, token)

    def _finish_reason(self, req: Request, token: int) -> FinishReason | None:
        if req.constraint is not None:
            req.constraint.accept(token)
            if req.constraint.finished:
                return "stop"
        if token in req.params.stop_token_ids:
            return "stop"
        if not req.params.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if req.remaining_tokens <= 0 or req.seq_len >= self.max_context_len:
            return "length"
        return None

    def fail_in_flight(self) -> list[Request]:
        """Release every request of the batch that just failed; returns them."""
        failed, self._in_flight = self._in_flight, []
        for req in failed:
            req.draft_ids = []
            # Their K/V and state may be half written: nothing of them goes to the cache.
            self._release(req, keep=False)
        return failed

    make_event = staticmethod(make_event)

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
