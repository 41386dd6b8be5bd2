"""The Responses routes: ``POST /v1/responses``, ``GET /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items``, ``DELETE /v1/responses/{id}``.

A request is parsed (``schemas.py``, ``items.py``), continued from the stored
conversation of its ``previous_response_id`` (``store.py``; the prefix cache makes the
shared part of the prompt free), rendered into the neutral spec (``request.py``),
submitted (``Admission.submit``), answered whole (``answer.py``) or streamed
(``stream.py``), and stored unless ``store`` is false. An unknown or evicted id is a 404.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI, Query, Request

from mlxserve.server.api.openai.responses.answer import complete_response
from mlxserve.server.api.openai.responses.objects import ResponseShape
from mlxserve.server.api.openai.responses.request import (
    ResponseInput,
    generation_spec,
    new_response_id,
    prompt_of,
    resolve_input,
)
from mlxserve.server.api.openai.responses.schemas import ResponsesRequest
from mlxserve.server.api.openai.responses.store import ResponseStore, StoredResponse
from mlxserve.server.api.openai.responses.stream import stream_response
from mlxserve.server.http.auth import tenant_of
from mlxserve.server.http.errors import APIError, invalid_request
from mlxserve.server.models.registry import ModelRegistry
from mlxserve.server.serving.admission import Admission
from mlxserve.server.serving.output_constraint import compile_constraint
from mlxserve.server.serving.pieces import PieceSplitter


def _not_found(response_id: str) -> APIError:
    return APIError(
        404,
        f"No response with id '{response_id}' is stored (unknown, deleted, stored with "
        "'store': false, or evicted from the server's store).",
        code="response_not_found",
        param="response_id",
    )


def add_responses_routes(
    app: FastAPI, models: ModelRegistry, admission: Admission, store: ResponseStore
) -> None:
    """Register the Responses routes on ``app``; responses are kept in ``store``."""

    def stored(response_id: str, request: Request) -> StoredResponse:
        found = store.get(response_id, tenant_of(request))
        if found is None:
            raise _not_found(response_id)
        return found

    @app.post("/v1/responses", response_model=None)
    async def create_response(body: ResponsesRequest, request: Request) -> Any:
        models.entry(body.model)  # an unknown model is the first error
        tenant = tenant_of(request)
        previous = None
        if body.previous_response_id is not None:
            previous = store.get(body.previous_response_id, tenant)
            if previous is None:
                raise _not_found(body.previous_response_id)
        given = resolve_input(body.input, previous)
        async with models.use(body.model) as m:
            prompt = await prompt_of(m, body, given, admission.config)
            constraint = prompt.constraint
            compiled = (
                None if constraint is None else await compile_constraint(m.engine, constraint)
            )
            response_id = new_response_id()
            spec = generation_spec(body, prompt, compiled, response_id, tenant)
            choices = admission.submit(m, spec)
        shape = ResponseShape(response_id, m.name, body)
        splitter = PieceSplitter(m.reasoning, prompt.in_reasoning, prompt.tools)

        def keep(response: dict[str, Any]) -> None:
            if body.store:
                store.put(_stored(response, given, tenant))

        if body.stream:
            return stream_response(choices, shape, splitter, keep)
        response = await complete_response(choices, shape, request, splitter)
        if isinstance(response, dict):
            keep(response)
        return response

    @app.get("/v1/responses/{response_id}")
    async def get_response(
        response_id: str, request: Request, stream: bool = False
    ) -> dict[str, Any]:
        if stream:
            raise invalid_request("Replaying a response as a stream is not supported.", "stream")
        return stored(response_id, request).response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
        if not store.delete(response_id, tenant_of(request)):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(
        response_id: str,
        request: Request,
        limit: int = Query(default=20, ge=1, le=100),
        order: Literal["asc", "desc"] = "desc",
        after: str | None = None,
    ) -> dict[str, Any]:
        items = list(stored(response_id, request).input_items)
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise invalid_request(f"No input item with id '{after}' in this list.", "after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }


def _stored(response: dict[str, Any], given: ResponseInput, tenant: str | None) -> StoredResponse:
    output = tuple(response["output"])
    return StoredResponse(response, given.items, given.conversation + output, tenant)
