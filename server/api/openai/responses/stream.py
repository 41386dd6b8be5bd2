"""The streamed response: the Responses API's typed events, numbered by ``sequence_number``.

    response.created, response.in_progress           the response, in progress, no output
    per output item (output_index = its place):
      response.output_item.added                     the item, empty
      message:   response.content_part.added, response.output_text.delta ...,
                 response.output_text.done, response.content_part.done
      reasoning: response.content_part.added, response.reasoning_text.delta ...,
                 response.reasoning_text.done, response.content_part.done
      function_call: response.function_call_arguments.delta (all of them, once the call
                 is complete), response.function_call_arguments.done
      response.output_item.done                      the item, whole
    response.completed | response.incomplete         the whole response, with usage
    response.failed                                  generation failed: the output so far, error

Each event goes as ``event: <type>`` plus ``data: <json>``. When the stream ends, the
whole response is handed to ``on_done`` (the store). A client that closes the stream
aborts the generation (nothing is stored).
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from mlxserve.server.api.openai.responses.answer import final_status
from mlxserve.server.api.openai.responses.objects import (
    ItemIds,
    ResponseShape,
    output_item,
    text_part,
    usage,
)
from mlxserve.server.serving.choices import Choices
from mlxserve.server.serving.generation import GenerationError
from mlxserve.server.serving.output_blocks import (
    Block,
    BlockDelta,
    BlockEvent,
    BlockStart,
    OutputBlocks,
)
from mlxserve.server.serving.pieces import PieceSplitter

logger = logging.getLogger(__name__)

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _part(block: Block, text: str) -> dict[str, Any]:
    return text_part(text) if block.kind == "text" else {"type": "reasoning_text", "text": text}


class _EventWriter:
    """Numbers the events of one stream and keeps its output items."""

    def __init__(self) -> None:
        self._numbers = itertools.count()
        self.ids = ItemIds()
        self.done: list[dict[str, Any]] = []  # output items completed so far

    def sse(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": next(self._numbers), **fields}
        return f"event: {kind}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

    def block_events(self, event: BlockEvent, closing_status: str) -> list[str]:
        block = event.block
        item_id = self.ids.of(block)
        where = {"item_id": item_id, "output_index": block.index}
        if isinstance(event, BlockStart):
            added = output_item(block, item_id, "in_progress", started=True)
            out = [self.sse("response.output_item.added", output_index=block.index, item=added)]
            if block.call is not None:
                arguments = block.call.arguments
                out.append(
                    self.sse("response.function_call_arguments.delta", **where, delta=arguments)
                )
                out.append(
                    self.sse("response.function_call_arguments.done", **where, arguments=arguments)
                )
            else:
                part = _part(block, "")
                out.append(
                    self.sse("response.content_part.added", **where, content_index=0, part=part)
                )
            return out
        if isinstance(event, BlockDelta):
            if block.kind == "text":
                return [
                    self.sse(
                        "response.output_text.delta",
                        **where,
                        content_index=0,
                        delta=event.text,
                        logprobs=[],
                    )
                ]
            return [
                self.sse(
                    "response.reasoning_text.delta", **where, content_index=0, delta=event.text
                )
            ]
        out = []
        if block.kind == "text":
            out.append(
                self.sse(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=block.text,
                    logprobs=[],
                )
            )
        elif block.kind == "reasoning":
            out.append(
                self.sse("response.reasoning_text.done", **where, content_index=0, text=block.text)
            )
        if block.call is None:
            part = _part(block, block.text)
            out.append(self.sse("response.content_part.done", **where, content_index=0, part=part))
        item = output_item(block, item_id, closing_status)
        self.done.append(item)
        out.append(self.sse("response.output_item.done", output_index=block.index, item=item))
        return out


async def _events(
    choices: Choices,
    shape: ResponseShape,
    splitter: PieceSplitter,
    on_done: Callable[[dict[str, Any]], None],
) -> AsyncIterator[str]:
    writer = _EventWriter()
    stream = choices.stream()
    blocks = OutputBlocks()
    try:
        yield writer.sse("response.created", response=shape.response("in_progress", []))
        yield writer.sse("response.in_progress", response=shape.response("in_progress", []))
        async for _, chunk in stream:
            events = blocks.feed(splitter.piece(chunk))
            status = "completed"
            if chunk.finish_reason is not None:
                status = final_status(chunk.finish_reason)
                events += blocks.close()
            for event in events:
                for line in writer.block_events(event, status):
                    yield line
            if chunk.finish_reason is not None:
                counts = usage(choices.usage(), splitter.reasoning_tokens)
                final = shape.response(status, writer.done, counts)
                on_done(final)
                yield writer.sse(f"response.{status}", response=final)
    except GenerationError as e:
        # The status line (200) is already sent: the response fails in-band.
        code = "invalid_prompt" if e.status_code < 500 else "server_error"
        error = {"code": code, "message": e.message}
        counts = usage(choices.usage(), splitter.reasoning_tokens)
        final = shape.response("failed", writer.done, counts, error)
        on_done(final)
        yield writer.sse("response.failed", response=final)
    except Exception:  # noqa: BLE001 - a bug serving this request must end only its stream
        logger.exception("stream %s failed", choices.id)
        error = {"code": "server_error", "message": "Internal error while streaming this request."}
        yield writer.sse(
            "response.failed", response=shape.response("failed", writer.done, None, error)
        )
    finally:
        # Reached also when the client disconnects (the stream is cancelled).
        choices.abort()
        await stream.aclose()


def stream_response(
    choices: Choices,
    shape: ResponseShape,
    splitter: PieceSplitter,
    on_done: Callable[[dict[str, Any]], None],
) -> StreamingResponse:
    """Stream the answer of ``choices`` (one choice) as the Responses API's events."""
    return StreamingResponse(
        _events(choices, shape, splitter, on_done),
        media_type="text/event-stream",
        headers=_SSE_HEADERS,
    )
