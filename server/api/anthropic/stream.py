"""The streamed Messages answer: Anthropic's server-sent event sequence.

    message_start          the message, empty content, usage so far
    ping                   right away, then after every PING_INTERVAL s of silence
    content_block_start    per block: thinking / text / tool_use (input {})
    content_block_delta    thinking_delta, text_delta; a call's input as one input_json_delta
    content_block_stop
    message_delta          stop_reason, stop_sequence, usage (cumulative: input tokens and
                           cache reads are exact here, once the prompt ran)
    message_stop

Each event goes as ``event: <type>`` plus ``data: <json>``. A failure after the stream
began is an ``error`` event (Anthropic's error object) that ends it. A client that closes
the stream aborts the generation.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from mlxserve.server.api.anthropic import objects
from mlxserve.server.api.anthropic.errors import error_body
from mlxserve.server.http.heartbeat import HEARTBEAT, with_heartbeats
from mlxserve.server.serving.choices import Choices
from mlxserve.server.serving.generation import GenerationError
from mlxserve.server.serving.output_blocks import (
    BlockDelta,
    BlockEvent,
    BlockStart,
    OutputBlocks,
)
from mlxserve.server.serving.pieces import PieceSplitter
from mlxserve.server.serving.usage import UsageCounts

logger = logging.getLogger(__name__)

# Seconds of silence (a long prefill) after which a ping keeps the connection alive.
PING_INTERVAL = 10.0

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(event: dict[str, Any]) -> str:
    """One event, named by its ``type``."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


def _block_events(event: BlockEvent) -> list[dict[str, Any]]:
    block = event.block
    if isinstance(event, BlockStart):
        start = {"type": "content_block_start", "index": block.index}
        out = [start | {"content_block": objects.block_start(block)}]
        if block.call is not None:
            delta = {"type": "input_json_delta", "partial_json": block.call.arguments}
            out.append({"type": "content_block_delta", "index": block.index, "delta": delta})
        return out
    if isinstance(event, BlockDelta):
        if block.kind == "reasoning":
            delta = {"type": "thinking_delta", "thinking": event.text}
        else:
            delta = {"type": "text_delta", "text": event.text}
        return [{"type": "content_block_delta", "index": block.index, "delta": delta}]
    return [{"type": "content_block_stop", "index": block.index}]


async def _events(
    choices: Choices, model: str, splitter: PieceSplitter, ping_interval: float
) -> AsyncIterator[str]:
    gen = choices.generations[0]
    stream = choices.stream()
    beats = with_heartbeats(stream, ping_interval)
    blocks = OutputBlocks()
    try:
        opening = UsageCounts(gen.prompt_tokens, 0)
        yield sse(
            {
                "type": "message_start",
                "message": objects.message(choices.id, model, [], None, None, opening),
            }
        )
        yield sse({"type": "ping"})
        async for item in beats:
            if item is HEARTBEAT:
                yield sse({"type": "ping"})
                continue
            _, chunk = item
            events = blocks.feed(splitter.piece(chunk))
            if chunk.finish_reason is not None:
                events += blocks.close()
            for event in events:
                for payload in _block_events(event):
                    yield sse(payload)
            if chunk.finish_reason is not None:
                made_calls = splitter.calls_made > 0
                reason = objects.stop_reason(chunk.finish_reason, made_calls, chunk.stop_string)
                stop = chunk.stop_string if reason == "stop_sequence" else None
                delta = {"stop_reason": reason, "stop_sequence": stop}
                usage = objects.usage(choices.usage())
                yield sse({"type": "message_delta", "delta": delta, "usage": usage})
                yield sse({"type": "message_stop"})
    except GenerationError as e:
        # The status line (200) is already sent: report in-band, as Anthropic does.
        yield sse(error_body(e.status_code, e.message))
    except Exception:  # noqa: BLE001 - a bug serving this request must end only its stream
        logger.exception("stream %s failed", choices.id)
        yield sse(error_body(500, "Internal error while streaming this request."))
    finally:
        # Reached also when the client disconnects (the stream is cancelled).
        choices.abort()
        await beats.aclose()
        await stream.aclose()


def stream_message(
    choices: Choices, model: str, splitter: PieceSplitter, ping_interval: float = PING_INTERVAL
) -> StreamingResponse:
    """Stream the answer of ``choices`` (one choice) as Anthropic's events."""
    return StreamingResponse(
        _events(choices, model, splitter, ping_interval),
        media_type="text/event-stream",
        headers=_SSE_HEADERS,
    )
