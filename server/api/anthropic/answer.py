"""The non-streamed Messages answer: wait for the whole output, then one ``message`` body
(streams: ``stream.py``)."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from mlxserve.server.api.anthropic import objects
from mlxserve.server.serving.choices import Choices
from mlxserve.server.serving.collect import CLIENT_CLOSED, one_answer_blocks
from mlxserve.server.serving.pieces import PieceSplitter


async def complete_message(
    choices: Choices, model: str, request: Request, splitter: PieceSplitter
) -> dict[str, Any] | Response:
    """Wait for the answer (``stream: false``) and shape it as a ``message``."""
    answer = await one_answer_blocks(choices, request, splitter)
    if answer is None:
        return Response(status_code=CLIENT_CLOSED)
    result, blocks = answer
    last = result.chunks[-1]
    assert last.finish_reason in ("stop", "length"), last.finish_reason
    reason = objects.stop_reason(last.finish_reason, splitter.calls_made > 0, last.stop_string)
    content = [objects.content_block(block) for block in blocks.blocks]
    return objects.message(choices.id, model, content, reason, last.stop_string, choices.usage())
