"""One request in flight: engine-thread events -> text chunks on the asyncio side.

    engine thread                         event loop (this module)
    on_output(RequestOutput) --call_soon_threadsafe--> asyncio.Queue
                                          -> detokenize token by token
                                          -> StopMatcher (hold back possible stop text)
                                          -> Chunk(text, finish_reason)

The engine never sees text: stop strings are matched here, and a match aborts the request
in the engine (which frees its slots) while the client gets ``finish_reason="stop"``. Stop
strings apply from the ``min_tokens``-th token on, as in vLLM.

With logprobs asked, each chunk also carries the ``TokenEntry`` of every token consumed for
it (the text may lag a token behind: held-back stop-string prefixes, partial characters).
The prompt's logprobs (first event) and the count of prompt tokens served from the prefix
cache are kept on the ``Generation``.

The engine must never wait for a client, so events are always accepted; what bounds them is
this side: a request whose client leaves more than ``max_buffered_tokens`` unread is failed,
as is one running past its ``timeout``. A failure aborts the engine request and reaches the
consumer as a ``GenerationError`` after the text it already had.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from mlxserve.scheduler.client import EngineClient
from mlxserve.scheduler.constraints import Constraint
from mlxserve.scheduler.multimodal import MultimodalPrompt
from mlxserve.scheduler.outputs import RequestOutput
from mlxserve.scheduler.sampling_params import SamplingParams
from mlxserve.server.serving.detokenizer import IncrementalDetokenizer
from mlxserve.server.serving.stop_strings import StopMatcher
from mlxserve.server.serving.token_logprobs import TokenEntry

logger = logging.getLogger(__name__)


class GenerationError(Exception):
    """The request failed: the engine failed or ended it unasked, or the server gave up on it
    (timeout, unread output, shutdown).

    Args:
        message: what happened, for the client.
        status_code: the HTTP status when the response has not started yet.
        type: OpenAI error type.
        code: machine-readable code (``request_timeout``, ``stream_buffer_overflow``, ...).
    """

    def __init__(
        self,
        message: str,
        status_code: int = 500,
        type: str = "server_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.code = code


@dataclass(frozen=True)
class Chunk:
    """New completion text; ``finish_reason`` ("stop" or "length") is set on the last one.

    Attributes:
        text: the new text.
        finish_reason: "stop" or "length" on the last chunk, else None.
        tokens: the tokens consumed for it, with their logprobs (only when asked).
        token_count: how many generated tokens were consumed for it (end-of-sequence
            tokens included), so that a protocol can count the tokens of a part.
        stop_string: on the last chunk, the stop string that ended the output (None: it
            ended otherwise).
    """

    text: str
    finish_reason: str | None = None
    tokens: tuple[TokenEntry, ...] = ()
    token_count: int = 0
    stop_string: str | None = None


class Generation:
    """Submits one request to the engine and turns its events into text chunks.

    Create and consume it on the event loop. ``chunks()`` may be iterated once.

    Args:
        engine: the running engine.
        tokenizer: the model's mlx-lm ``TokenizerWrapper``.
        request_id: unique id of the request.
        prompt_ids: the prompt's token ids.
        params: sampling parameters.
        stop: stop strings (matched on the detokenized text).
        timeout: seconds from ``start`` after which the request is failed (None: never).
        max_buffered_tokens: tokens the consumer may leave unread before the request is
            failed (None: unbounded).
        keep_output: False to run the request for its prompt only (``echo`` with
            ``max_tokens`` 0): the generated token is dropped, the finish reason is "length".
        constraint: the compiled grammar the output follows (structured output, tool
            calls), this request's own matcher.
        cache_namespace: the prefix-cache namespace the request runs in.

    Attributes:
        prompt_logprobs: the engine's prompt logprobs (when asked), once the first token came.
        cached_tokens: prompt tokens whose K/V the engine took from its prefix cache.
    """

    def __init__(
        self,
        engine: EngineClient,
        tokenizer: Any,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        stop: list[str],
        timeout: float | None = None,
        max_buffered_tokens: int | None = None,
        *,
        keep_output: bool = True,
        constraint: Constraint | None = None,
        cache_namespace: str = "",
        images: MultimodalPrompt | None = None,
    ) -> None:
        self.engine = engine
        self.images = images
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.prompt_tokens = len(prompt_ids)
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.finished = False
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[RequestOutput | GenerationError] = asyncio.Queue()
        self._timeout = timeout
        self._timer: asyncio.TimerHandle | None = None
        self._max_buffered = max_buffered_tokens
        self._buffered = 0  # tokens queued and not consumed yet
        self._failure: GenerationError | None = None
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
        # End-of-generation tokens finish the request; they are not part of its text.
        self._hidden_ids = set(tokenizer.eos_token_ids) | set(params.stop_token_ids)
        self._stop = StopMatcher(stop)
        self._min_tokens = params.min_tokens
        self._want_logprobs = params.logprobs is not None
        self._keep_output = keep_output
        self.constraint = constraint
        self.cache_namespace = cache_namespace
        self._text_len = 0  # characters detokenized so far (before stop matching)
        self.prompt_logprobs: list[Any] | None = None
        self.cached_tokens = 0
        self._started_at = 0.0

    def start(self) -> None:
        """Hand the request to the engine."""
        self._started_at = time.monotonic()
        self.engine.add_request(
            self.request_id,
            self.prompt_ids,
            self.params,
            self._on_output,
            constraint=self.constraint,
            cache_namespace=self.cache_namespace,
            # Only a vision request names its images (other engines need not know them).
            **({} if self.images is None else {"images": self.images}),
        )
        if self._timeout:
            self._timer = self._loop.call_later(self._timeout, self._on_timeout)

    def abort(self) -> None:
        """Stop the request in the engine unless it already finished (idempotent)."""
        if not self.finished:
            self.finished = True
            self._cancel_timer()
            self.engine.abort(self.request_id)
            logger.info("request %s aborted", self.request_id)

    def fail(self, error: GenerationError) -> None:
        """Abort the request in the engine; the consumer gets the text it already had, then
        ``error`` is raised from ``chunks()``. No-op once finished or failed. Call on the
        event loop."""
        if self.finished or self._failure is not None:
            return
        self._failure = error
        self._cancel_timer()
        self.engine.abort(self.request_id)
        self._queue.put_nowait(error)
        logger.info("request %s failed: %s", self.request_id, error)

    async def chunks(self) -> AsyncIterator[Chunk]:
        """Text as it is generated; the last chunk carries the finish reason.

        Raises:
            GenerationError: the engine failed or aborted the request.
        """
        unreported = 0  # tokens consumed since the last chunk
        while not self.finished:
            out = await self._queue.get()
            if isinstance(out, GenerationError):
                self._finish("error")
                raise out
            self._buffered -= len(out.new_token_ids)
            before = self.completion_tokens
            text, tokens = self._consume(out)
            unreported += self.completion_tokens - before
            if text or tokens or self.finished:
                reason = self.finish_reason if self.finished else None
                stop = self._stop.matched if self.finished else None
                yield Chunk(text, reason, tuple(tokens), unreported, stop)
                unreported = 0

    async def text(self) -> str:
        """The whole completion text (waits for the end)."""
        return "".join([chunk.text async for chunk in self.chunks()])

    # ----------------------------------------------------------------- internals
    def _on_output(self, out: RequestOutput) -> None:
        # Runs on the engine thread: only hand the event over to the loop, never wait.
        try:
            self._loop.call_soon_threadsafe(self._push, out)
        except RuntimeError:
            pass  # the loop is closed (server shut down): nobody is listening any more

    def _push(self, out: RequestOutput) -> None:
        if self.finished or self._failure is not None:
            return  # nobody will read it: the request was ended on this side
        self._buffered += len(out.new_token_ids)
        if self._max_buffered is not None and self._buffered > self._max_buffered:
            self.fail(
                GenerationError(
                    f"The client did not read its stream: more than {self._max_buffered} "
                    "tokens were waiting to be sent, so the request was aborted.",
                    code="stream_buffer_overflow",
                )
            )
            return
        self._queue.put_nowait(out)

    def _on_timeout(self) -> None:
        self._timer = None
        self.fail(
            GenerationError(
                f"The request timed out after {self._timeout:g} s and was aborted.",
                status_code=408,
                type="timeout_error",
                code="request_timeout",
            )
        )

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _consume(self, out: RequestOutput) -> tuple[str, list[TokenEntry]]:
        if self.prompt_logprobs is None and out.prompt_logprobs is not None:
            self.prompt_logprobs = list(out.prompt_logprobs)
        self.cached_tokens = max(self.cached_tokens, out.cached_tokens)
        if out.finished and out.finish_reason not in ("stop", "length"):
            self._finish(out.finish_reason or "error")
            message = out.error or f"request ended with '{out.finish_reason}'"
            if out.invalid_request:
                raise GenerationError(
                    f"Generation failed: {message}",
                    status_code=400,
                    type="invalid_request_error",
                    code="grammar_unsatisfiable",
                )
            raise GenerationError(f"Generation failed: {message}")
        if not self._keep_output:
            if not out.finished:
                self.engine.abort(self.request_id)
            self._finish("length")
            return "", []
        logprobs = out.logprobs if self._want_logprobs else None
        pieces: list[str] = []
        entries: list[TokenEntry] = []
        for i, token in enumerate(out.new_token_ids):
            self.completion_tokens += 1
            if token in self._hidden_ids:
                continue
            if logprobs is not None and i < len(logprobs):
                lp = logprobs[i]
                entries.append(TokenEntry(token, float(lp.logprob), tuple(lp.top), self._text_len))
            text = self._detokenizer.add(token)
            self._text_len += len(text)
            if self.completion_tokens <= self._min_tokens:
                pieces.append(text)  # stop strings do not apply before min_tokens
                continue
            pieces.append(self._stop.feed(text))
            if self._stop.stopped:
                # The engine may already be a token or two further; those are dropped.
                self.engine.abort(self.request_id, reason="stop")
                self._finish("stop")
                return "".join(pieces), entries
        if out.finished:
            pieces.append(self._stop.feed(self._detokenizer.flush()))
            pieces.append(self._stop.flush())
            self._finish("stop" if self._stop.stopped else out.finish_reason)
        return "".join(pieces), entries

    def _finish(self, reason: str) -> None:
        self.finished = True
        self.finish_reason = reason
        self._cancel_timer()
        logger.debug(
            "request %s finished (%s): %d prompt + %d completion tokens in %.2fs",
            self.request_id,
            reason,
            self.prompt_tokens,
            self.completion_tokens,
            time.monotonic() - self._started_at,
        )
