"""Waiting for a whole answer (``stream=false``) while watching the client.

A client that drops the connection while it waits aborts every choice in the engine, so
their slots are freed at once; every protocol's non-streamed route waits through here.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import Request

from mlxserve.server.http.errors import APIError
from mlxserve.server.serving.choices import ChoiceChunks, Choices
from mlxserve.server.serving.generation import GenerationError
from mlxserve.server.serving.output_blocks import OutputBlocks
from mlxserve.server.serving.pieces import PieceSplitter

logger = logging.getLogger(__name__)

# 499: nginx's "client closed request"; nobody reads it, but the access log says why.
CLIENT_CLOSED = 499


async def _wait_for_disconnect(request: Request) -> None:
    # The body was read already, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect_unless_disconnected(
    choices: Choices, request: Request
) -> list[ChoiceChunks] | None:
    """Every choice's chunks, or None if the client left first (all choices aborted).

    Raises:
        APIError: the generation failed (its status, type and code).
    """
    collect_task = asyncio.ensure_future(choices.collect())
    watch_task = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({collect_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # Also reached if this handler is cancelled: never leave a choice running.
        watch_task.cancel()
        client_gone = not collect_task.done()
        if client_gone:
            collect_task.cancel()
            choices.abort()
    if client_gone:
        logger.info("client of %s disconnected before the answer", choices.id)
        return None
    try:
        return collect_task.result()
    except GenerationError as e:
        raise APIError(e.status_code, e.message, type=e.type, code=e.code) from e


async def one_answer_blocks(
    choices: Choices, request: Request, splitter: PieceSplitter
) -> tuple[ChoiceChunks, OutputBlocks] | None:
    """The one choice of a non-streamed answer and its output split into blocks (text,
    reasoning, tool calls), or None if the client left first (Anthropic Messages and
    Responses: one choice per request)."""
    results = await collect_unless_disconnected(choices, request)
    if results is None:
        return None
    (result,) = results
    blocks = OutputBlocks()
    for chunk in result.chunks:
        blocks.feed(splitter.piece(chunk))
    blocks.close()
    return result, blocks
