"""The non-streamed response: wait for the whole output, then one ``response`` object
(streams: ``stream.py``)."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from mlxserve.server.api.openai.responses.objects import (
    ItemIds,
    ResponseShape,
    output_item,
    usage,
)
from mlxserve.server.serving.choices import Choices
from mlxserve.server.serving.collect import CLIENT_CLOSED, one_answer_blocks
from mlxserve.server.serving.pieces import PieceSplitter


def final_status(finish_reason: str) -> str:
    """The response's status after the output finished with ``finish_reason``."""
    return "incomplete" if finish_reason == "length" else "completed"


async def complete_response(
    choices: Choices, shape: ResponseShape, request: Request, splitter: PieceSplitter
) -> dict[str, Any] | Response:
    """Wait for the answer (``stream: false``) and shape it as a ``response``."""
    answer = await one_answer_blocks(choices, request, splitter)
    if answer is None:
        return Response(status_code=CLIENT_CLOSED)
    result, blocks = answer
    finish = result.finish_reason
    assert finish in ("stop", "length"), finish
    status = final_status(finish)
    ids = ItemIds()
    output = []
    for block in blocks.blocks:
        last = block is blocks.blocks[-1]
        item_status = "incomplete" if status == "incomplete" and last else "completed"
        output.append(output_item(block, ids.of(block), item_status))
    return shape.response(status, output, usage(choices.usage(), splitter.reasoning_tokens))
