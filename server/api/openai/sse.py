"""Streamed answers: ``chat.completion.chunk`` / ``text_completion`` SSE events.

Order: the opening chunks (chat: one role chunk per choice), then each choice's chunks as
they come (tagged with its ``index``; a choice's last is an empty chunk with its
``finish_reason``; a tool call comes as two ``delta.tool_calls`` fragments once the call is
complete, the first with its ``id``, ``type`` and function name, the second with all of
its ``arguments``), then with ``stream_options.include_usage`` one chunk with ``usage`` and
no choices, then ``[DONE]``. A failure after the status line went out is reported in-band
as an error object, as OpenAI does. A client that closes the stream aborts every choice.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from mlxserve.server.api.openai.logprobs import ChatLogprobs
from mlxserve.server.api.openai.response_models import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    Completion,
    CompletionChoice,
    FunctionCallDelta,
    ToolCallDelta,
    Usage,
    now,
)
from mlxserve.server.api.openai.shapers import ChatShaper, CompletionShaper
from mlxserve.server.http.errors import error_body
from mlxserve.server.serving.choices import Choices
from mlxserve.server.serving.generation import Chunk, GenerationError
from mlxserve.server.serving.tool_stream import ParsedCall

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

logger = logging.getLogger(__name__)


def _sse(data: BaseModel | dict | str) -> str:
    if isinstance(data, BaseModel):
        data = data.model_dump_json()
    elif isinstance(data, dict):
        data = json.dumps(data)
    return f"data: {data}\n\n"


async def _events(
    choices: Choices,
    opening: list[BaseModel],
    on_chunk: Callable[[int, Chunk], list[BaseModel]],
    make_usage: Callable[[Usage], BaseModel] | None,
) -> AsyncIterator[str]:
    stream = choices.stream()
    try:
        for event in opening:
            yield _sse(event)
        async for index, chunk in stream:
            for event in on_chunk(index, chunk):
                yield _sse(event)
        if make_usage is not None:
            yield _sse(make_usage(Usage.of(choices.usage())))
        yield _sse("[DONE]")
    except GenerationError as e:
        # The status line (200) is already sent: report in-band, as OpenAI does.
        yield _sse(error_body(e.message, e.type, code=e.code))
        yield _sse("[DONE]")
    except Exception:  # noqa: BLE001 - a bug serving this request must end only its stream
        logger.exception("stream %s failed", choices.id)
        yield _sse(error_body("Internal error while streaming this request.", "server_error"))
        yield _sse("[DONE]")
    finally:
        # Reached also when the client disconnects (the stream is cancelled).
        choices.abort()
        await stream.aclose()


def _response(body: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream", headers=_SSE_HEADERS)


def stream_chat(
    choices: Choices, model: str, include_usage: bool, make_shaper: Callable[[], ChatShaper]
) -> StreamingResponse:
    """Stream a chat completion."""
    created = now()
    shapers = [make_shaper() for _ in choices.generations]

    def event(choice: ChatChunkChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=choices.id, created=created, model=model, choices=[choice])

    def on_chunk(index: int, chunk: Chunk) -> list[BaseModel]:
        shaper = shapers[index]
        piece = shaper.piece(chunk)
        events: list[BaseModel] = []
        if piece.reasoning or piece.content or piece.logprobs:
            delta = ChatDelta(
                content=piece.content or None, reasoning_content=piece.reasoning or None
            )
            logprobs = ChatLogprobs(content=piece.logprobs) if piece.logprobs else None
            events.append(event(ChatChunkChoice(index=index, delta=delta, logprobs=logprobs)))
        for i, call in enumerate(piece.tool_calls, start=piece.first_call_index):
            for fragment in _call_fragments(i, call):
                delta = ChatDelta(tool_calls=[fragment])
                events.append(event(ChatChunkChoice(index=index, delta=delta)))
        if chunk.finish_reason is not None:
            reason = shaper.finish_reason(chunk.finish_reason)
            finish = ChatChunkChoice(index=index, delta=ChatDelta(), finish_reason=reason)
            events.append(event(finish))
        return events

    def usage_event(usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=choices.id, created=created, model=model, choices=[], usage=usage
        )

    opening: list[BaseModel] = [
        event(ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content="")))
        for i in range(len(choices.generations))
    ]
    return _response(_events(choices, opening, on_chunk, usage_event if include_usage else None))


def _call_fragments(index: int, call: ParsedCall) -> list[ToolCallDelta]:
    """A call as OpenAI streams one: id, type and name first, then the arguments."""
    return [
        ToolCallDelta(
            index=index,
            id=call.id,
            type="function",
            function=FunctionCallDelta(name=call.name, arguments=""),
        ),
        ToolCallDelta(index=index, function=FunctionCallDelta(arguments=call.arguments)),
    ]


def stream_completion(
    choices: Choices,
    model: str,
    include_usage: bool,
    make_shaper: Callable[[], CompletionShaper],
) -> StreamingResponse:
    """Stream a text completion."""
    created = now()
    shapers = [make_shaper() for _ in choices.generations]

    def event(choice: CompletionChoice) -> Completion:
        return Completion(id=choices.id, created=created, model=model, choices=[choice])

    def on_chunk(index: int, chunk: Chunk) -> list[BaseModel]:
        text, logprobs = shapers[index].piece(choices.generations[index], chunk)
        events: list[BaseModel] = []
        if text or (logprobs is not None and logprobs.tokens):
            events.append(event(CompletionChoice(index=index, text=text, logprobs=logprobs)))
        if chunk.finish_reason is not None:
            events.append(
                event(CompletionChoice(index=index, text="", finish_reason=chunk.finish_reason))
            )
        return events

    def usage_event(usage: Usage) -> Completion:
        return Completion(id=choices.id, created=created, model=model, choices=[], usage=usage)

    return _response(_events(choices, [], on_chunk, usage_event if include_usage else None))
