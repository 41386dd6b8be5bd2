"""What the scheduler does with a step's results: tokens appended (or verified), requests
finished and released, a failed step's requests failed. A mixin of ``Scheduler``, whose
state (``running``, ``_in_flight``, the slot spaces and the prefix cache) it works on."""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np

from mlxserve.scheduler.batch import ForwardBatch, ForwardOutput
from mlxserve.scheduler.constraints import GrammarDeadEnd
from mlxserve.scheduler.events import make_event
from mlxserve.scheduler.logprob_events import record_prompt_logprobs, with_logprobs
from mlxserve.scheduler.outputs import FinishReason, RequestOutput
from mlxserve.scheduler.request import Request, RequestStatus

logger = logging.getLogger("mlxserve.scheduler.scheduler")


class StepResults:
    """``process`` and ``fail_in_flight`` of ``Scheduler``."""

    def process(self, batch: ForwardBatch, out: ForwardOutput) -> list[RequestOutput]:
        """Advance the in-flight requests by the forward's results; finished ones leave and
        free their slots now. Returns one event per request that got a token."""
        events = []
        in_flight = self._in_flight.popleft()
        # Requests in the batch scheduled after this one hold that batch's slot too.
        ahead = {id(r) for rows in self._in_flight for r in rows}
        for i, req in enumerate(in_flight):
            if req.status is RequestStatus.FINISHED:
                continue  # aborted while its batch computed (only a launched batch's rows)
            draft, req.draft_ids = req.draft_ids, []
            if draft:
                events.append(self._process_verified(req, draft, out, i))
                continue
            before = min(req.computed_len, req.prompt_len)
            req.computed_len += int(batch.extend_lens[i])
            self.prompt_tokens_computed += min(req.computed_len, req.prompt_len) - before
            held = req.allocated_len - int(id(req) in ahead)
            assert req.computed_len == held, (req.computed_len, req.allocated_len)
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
        """Release every request of the batches in flight (one failed); returns them."""
        failed = list({id(r): r for rows in self._in_flight for r in rows}.values())
        self._in_flight.clear()
        failed = [r for r in failed if r.status is not RequestStatus.FINISHED]
        for req in failed:
            req.draft_ids = []
            # Their K/V and state may be half written: nothing of them goes to the cache.
            self._release(req, keep=False)
        return failed

    make_event = staticmethod(make_event)
