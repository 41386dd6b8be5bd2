"""``/openapi.json`` as the server really answers: request bodies from the pydantic models
(``server/api/openai/schemas.py``), responses as sent.

FastAPI documents a 422 ``HTTPValidationError`` for every route with a body or parameter;
this server answers bad input with OpenAI's 400 ``{"error": {...}}`` instead
(``server/http/errors.py``). ``openapi_schema`` replaces those with the error statuses each route
can give, all with the ``ErrorResponse`` body, and adds what FastAPI cannot see: SSE streams
beside the JSON answers of the generation routes, ``/metrics`` as Prometheus text, and
``/health``'s 503. Schema fuzzing (``bench/fuzz.py``) generates requests from this document.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, TypeAdapter

from mlxserve.server.api.openai.response_models import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error body: OpenAI's shape."""

    error: ErrorDetail


class HealthStatus(BaseModel):
    """``/health``: ``{"status": "ok"}``; while loading also ``stage`` and ``progress``; when
    the engine stopped, ``detail``."""

    status: str
    stage: str | None = None
    progress: float | None = None
    detail: str | None = None


ERROR_MEANINGS = {
    400: "Invalid request (body, parameter, or prompt/context length).",
    401: "Missing or wrong API key (only when the server has keys).",
    404: "Unknown model (a request's model only ever names a declared one) or stored response.",
    408: "The request ran past --request-timeout.",
    413: "The request body is larger than --max-body-bytes.",
    429: "The queue is full (--max-queue); see Retry-After.",
    500: "The engine failed while serving the request.",
    503: "The model is loading or cannot be loaded now, the server is shutting down, or the "
    "engine stopped.",
}
GENERATION_ERRORS = (400, 401, 404, 408, 413, 429, 500, 503)
_TOKENIZE = (400, 401, 404, 413, 503)
# (method, path) -> error statuses; routes not listed may answer 401 and 503. (401 only with
# API keys, and on /health, /metrics, /version only with --protect-metrics.)
_ERRORS = {
    ("post", "/v1/chat/completions"): GENERATION_ERRORS,
    ("post", "/v1/completions"): GENERATION_ERRORS,
    ("post", "/v1/embeddings"): GENERATION_ERRORS,
    ("post", "/tokenize"): _TOKENIZE,
    ("post", "/detokenize"): _TOKENIZE,
    ("get", "/v1/models/{model}"): (401, 404, 503),
    ("post", "/v1/models/{model}/load"): (400, 401, 404, 503),
    ("post", "/v1/models/{model}/unload"): (400, 401, 404, 503),
    ("get", "/health"): (401,),
    ("get", "/version"): (401,),
}
_STREAMS = {
    "/v1/chat/completions": ChatCompletion,
    "/v1/completions": Completion,
}
_SSE_DESCRIPTION = (
    "With `stream: true`, server-sent events: `data: <chunk JSON>` lines ({chunk}), "
    "then `data: [DONE]`."
)


def ref(name: str) -> dict[str, str]:
    """A reference to the component schema ``name``."""
    return {"$ref": f"#/components/schemas/{name}"}


def add_models(schema: dict[str, Any], *models: type[BaseModel]) -> None:
    """Add the JSON schemas of ``models`` (and the models they use) to the components."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in models:
        adapter = TypeAdapter(model)
        found = adapter.json_schema(
            mode="serialization", ref_template="#/components/schemas/{model}"
        )
        for name, definition in found.pop("$defs", {}).items():
            components.setdefault(name, definition)
        components.setdefault(model.__name__, found)


def _sse_event(chunk: str) -> dict[str, Any]:
    """One event of a stream (Open API 3.1: ``schema`` of text/event-stream is per event)."""
    payload = {"anyOf": [ref(chunk), ref("ErrorResponse")]}
    return sse_event_schema(payload, done=True)


def sse_event_schema(payload: dict[str, Any], done: bool = False) -> dict[str, Any]:
    """The schema of one event whose ``data`` is JSON of ``payload`` (or ``[DONE]``)."""
    data: dict[str, Any] = {
        "anyOf": [
            {"const": "[DONE]"},
            {
                "type": "string",
                "contentMediaType": "application/json",
                "contentSchema": payload,
            },
        ]
    }
    if not done:
        data = data["anyOf"][1]
    return {"type": "object", "required": ["data"], "properties": {"data": data}}


def json_response(schema: dict[str, Any], description: str) -> dict[str, Any]:
    """A documented response with a JSON body of ``schema``."""
    return {"description": description, "content": {"application/json": {"schema": schema}}}


# A change to the document made by another protocol adapter (its routes' responses).
OpenAPIPatch = Callable[[dict[str, Any]], None]


def openapi_schema(app: FastAPI, patches: Sequence[OpenAPIPatch] = ()) -> dict[str, Any]:
    """The OpenAPI document of ``app`` (cached on it), with ``patches`` applied."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(
        title=app.title, version=app.version, description=app.description, routes=app.routes
    )
    add_models(schema, ErrorResponse, HealthStatus, ChatCompletion, Completion)
    add_models(schema, ChatCompletionChunk)
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            for status in _ERRORS.get((method, path), (401, 503)):
                meaning = ERROR_MEANINGS[status]
                responses[str(status)] = json_response(ref("ErrorResponse"), meaning)
            if path in _STREAMS:
                model = _STREAMS[path]
                chunk = "ChatCompletionChunk" if model is ChatCompletion else "Completion"
                ok = json_response(ref(model.__name__), "The completion (`stream: false`).")
                ok["content"]["text/event-stream"] = {"schema": _sse_event(chunk)}
                ok["description"] += " " + _SSE_DESCRIPTION.format(chunk=chunk)
                responses["200"] = ok
    health = schema["paths"].get("/health", {}).get("get")
    if health is not None:
        health["responses"]["200"] = json_response(ref("HealthStatus"), "Ready.")
        health["responses"]["503"] = json_response(
            ref("HealthStatus"), "Loading, draining, or the engine stopped."
        )
    metrics = schema["paths"].get("/metrics", {}).get("get")
    if metrics is not None:
        metrics["responses"]["200"] = {
            "description": "Prometheus text exposition.",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
    components = schema.get("components", {}).get("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    for patch in patches:
        patch(schema)
    app.openapi_schema = schema
    return schema


def install_openapi(app: FastAPI, patches: Sequence[OpenAPIPatch] = ()) -> None:
    """Serve ``openapi_schema(app, patches)`` at ``/openapi.json``."""
    app.openapi = lambda: openapi_schema(app, patches)  # type: ignore[method-assign]
