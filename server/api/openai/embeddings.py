"""``POST /v1/embeddings``, OpenAI's embeddings API, over the neutral embedding pipeline
(``server/serving/embedding.py``).

The route parses the body (``embedding_schemas.py``), takes its model for the ``embed``
task (a chat model is a 400 that says so), tokenizes string inputs with the model's
tokenizer (special tokens added, as the model was trained: ``[CLS] ... [SEP]`` for BERT,
a closing ``<|endoftext|>`` for Qwen3-Embedding) off the event loop, and answers each
vector as floats or as base64 of its little-endian float32 bytes. A client that leaves
before the answer aborts its inputs.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from typing import Any

import numpy as np
from fastapi import FastAPI, Request

from mlxserve.server.api.openai.embedding_schemas import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from mlxserve.server.http.auth import tenant_of
from mlxserve.server.http.errors import APIError, invalid_request
from mlxserve.server.models.registry import ModelRegistry
from mlxserve.server.models.served_model import ServedModel
from mlxserve.server.serving.admission import Admission
from mlxserve.server.serving.cache_namespace import cache_namespace
from mlxserve.server.serving.embedding import EmbeddingSpec, submit_embedding
from mlxserve.server.serving.generation import GenerationError
from mlxserve.server.serving.offload import offload

logger = logging.getLogger(__name__)


def add_embedding_routes(app: FastAPI, models: ModelRegistry, admission: Admission) -> None:
    """Register ``POST /v1/embeddings`` on ``app``."""

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> EmbeddingResponse:
        async with models.use(body.model, task="embed") as m:
            inputs = await offload(input_ids, m, body.input)
            spec = EmbeddingSpec(
                inputs,
                dimensions=body.dimensions,
                cache_namespace=cache_namespace(tenant_of(request), body.cache_salt),
            )
            job = submit_embedding(admission, m, spec)
        work = asyncio.ensure_future(job.embeddings(body.dimensions))
        result = await _unless_disconnected(work, request)
        data = [
            EmbeddingData(index=i, embedding=encode(v, body.encoding_format))
            for i, v in enumerate(result.vectors)
        ]
        usage = EmbeddingUsage(
            prompt_tokens=result.prompt_tokens, total_tokens=result.prompt_tokens
        )
        return EmbeddingResponse(data=data, model=m.name, usage=usage)


def input_ids(model: ServedModel, value: Any) -> list[list[int]]:
    """Each input of ``value`` (the request's ``input``) as token ids."""
    if isinstance(value, str):
        return [_encode_text(model, value)]
    if value and all(isinstance(v, int) for v in value):
        return [list(value)]
    return [_encode_text(model, v) if isinstance(v, str) else list(v) for v in value]


def _encode_text(model: ServedModel, text: str) -> list[int]:
    if not text:
        raise invalid_request("'input' must not contain empty strings.", param="input")
    model.check_text_fits(text, "input")
    return [int(t) for t in model.tokenizer.encode(text)]


def encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """A vector in the answer's ``encoding_format``."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii")
    return vector.tolist()


async def _disconnect(request: Request) -> None:
    # The body was read already, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(work: asyncio.Future, request: Request) -> Any:
    """``work``'s result; cancelled (its inputs aborted) if the client leaves first.

    Raises:
        APIError: the embedding failed (its status), or 499 when the client left.
    """
    watch = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
    if work.cancelled():
        logger.info("embedding client disconnected before the answer")
        raise APIError(499, "The client closed the request.", type="client_closed")
    try:
        return work.result()
    except GenerationError as e:
        raise APIError(e.status_code, e.message, type=e.type, code=e.code) from e
