"""Turn a running ``Generation`` into an OpenAI response: SSE chunks or one JSON body.

A client that goes away (closes a stream, or drops the connection while waiting for a
non-streamed answer) aborts its request in the engine, so its slots are freed at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from server.errors import APIError, error_body
from server.generation import Generation, GenerationError
from server.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    Completion,
    CompletionChoice,
    Usage,
    now,
)

logger = logging.getLogger(__name__)

# 499: nginx's "client closed request"; nobody reads it, but the access log says why.
CLIENT_CLOSED = 499
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

ChunkFactory = Callable[[str, "str | None"], BaseModel]


def _sse(data: BaseModel | dict | str) -> str:
    if isinstance(data, BaseModel):
        data = data.model_dump_json()
    elif isinstance(data, dict):
        data = json.dumps(data)
    return f"data: {data}\n\n"


def usage_of(gen: Generation) -> Usage:
    return Usage.of(gen.prompt_tokens, gen.completion_tokens)


async def _events(
    gen: Generation,
    opening: list[BaseModel],
    make_chunk: ChunkFactory,
    make_usage: Callable[[Usage], BaseModel] | None,
) -> AsyncIterator[str]:
    """SSE lines: opening chunks, one per text chunk, the finish chunk, usage, [DONE]."""
    try:
        for chunk in opening:
            yield _sse(chunk)
        async for piece in gen.chunks():
            if piece.text:
                yield _sse(make_chunk(piece.text, None))
            if piece.finish_reason is not None:
                yield _sse(make_chunk("", piece.finish_reason))
        if make_usage is not None:
            yield _sse(make_usage(usage_of(gen)))
        yield _sse("[DONE]")
    except GenerationError as e:
        # The status line (200) is already sent: report in-band, as OpenAI does.
        yield _sse(error_body(e.message, e.type, code=e.code))
        yield _sse("[DONE]")
    finally:
        # Reached also when the client disconnects (the stream is cancelled).
        gen.abort()


def stream_chat(gen: Generation, model: str, include_usage: bool) -> StreamingResponse:
    """Stream a chat completion as ``chat.completion.chunk`` SSE events."""
    created = now()

    def chunk(text: str, reason: str | None) -> ChatCompletionChunk:
        delta = ChatDelta(content=text) if text else ChatDelta()
        choice = ChatChunkChoice(delta=delta, finish_reason=reason)
        return ChatCompletionChunk(
            id=gen.request_id, created=created, model=model, choices=[choice]
        )

    def usage_chunk(usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=gen.request_id, created=created, model=model, choices=[], usage=usage
        )

    first = ChatCompletionChunk(
        id=gen.request_id,
        created=created,
        model=model,
        choices=[ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))],
    )
    body = _events(gen, [first], chunk, usage_chunk if include_usage else None)
    return StreamingResponse(body, media_type="text/event-stream", headers=_SSE_HEADERS)


def stream_completion(gen: Generation, model: str, include_usage: bool) -> StreamingResponse:
    """Stream a text completion as ``text_completion`` SSE events."""
    created = now()

    def chunk(text: str, reason: str | None) -> Completion:
        choice = CompletionChoice(text=text, finish_reason=reason)
        return Completion(id=gen.request_id, created=created, model=model, choices=[choice])

    def usage_chunk(usage: Usage) -> Completion:
        return Completion(id=gen.request_id, created=created, model=model, choices=[], usage=usage)

    body = _events(gen, [], chunk, usage_chunk if include_usage else None)
    return StreamingResponse(body, media_type="text/event-stream", headers=_SSE_HEADERS)


async def _wait_for_disconnect(request: Request) -> None:
    # The body was read already, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _text_unless_disconnected(gen: Generation, request: Request) -> str | None:
    """The whole completion text, or None if the client left first (request aborted)."""
    text_task = asyncio.ensure_future(gen.text())
    watch_task = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({text_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # Also reached if this handler is cancelled: never leave the request running.
        watch_task.cancel()
        client_gone = not text_task.done()
        if client_gone:
            text_task.cancel()
            gen.abort()
    if client_gone:
        logger.info("client of %s disconnected before the answer", gen.request_id)
        return None
    try:
        return text_task.result()
    except GenerationError as e:
        raise APIError(e.status_code, e.message, type=e.type, code=e.code) from e


async def complete_chat(gen: Generation, model: str, request: Request) -> Response | ChatCompletion:
    """Wait for the whole chat completion (``stream=false``)."""
    text = await _text_unless_disconnected(gen, request)
    if text is None:
        return Response(status_code=CLIENT_CLOSED)
    assert gen.finish_reason in ("stop", "length"), gen.finish_reason
    choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=gen.finish_reason)
    return ChatCompletion(id=gen.request_id, model=model, choices=[choice], usage=usage_of(gen))


async def complete_text(gen: Generation, model: str, request: Request) -> Response | Completion:
    """Wait for the whole text completion (``stream=false``)."""
    text = await _text_unless_disconnected(gen, request)
    if text is None:
        return Response(status_code=CLIENT_CLOSED)
    assert gen.finish_reason in ("stop", "length"), gen.finish_reason
    choice = CompletionChoice(text=text, finish_reason=gen.finish_reason)
    return Completion(id=gen.request_id, model=model, choices=[choice], usage=usage_of(gen))
