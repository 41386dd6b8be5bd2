"""``/openapi.json`` for the Responses routes: the response object, its event stream, the
stored responses' routes."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from mlxserve.server.api.openai.openapi import (
    ERROR_MEANINGS,
    GENERATION_ERRORS,
    add_models,
    json_response,
    ref,
    sse_event_schema,
)


class ResponseObject(BaseModel):
    """A response (``object: "response"``) with its output items and usage."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["response"]
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None
    error: dict[str, Any] | None


class ResponseEvent(BaseModel):
    """One streamed event (``response.created``, ``response.output_text.delta``, ...)."""

    model_config = ConfigDict(extra="allow")
    type: str
    sequence_number: int


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"]
    deleted: bool


class InputItemList(BaseModel):
    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


_STORED = (400, 401, 404, 503)
_ROUTES = {
    ("post", "/v1/responses"): ("ResponseObject", GENERATION_ERRORS),
    ("get", "/v1/responses/{response_id}"): ("ResponseObject", _STORED),
    ("delete", "/v1/responses/{response_id}"): ("ResponseDeleted", _STORED),
    ("get", "/v1/responses/{response_id}/input_items"): ("InputItemList", _STORED),
}


def document_responses(schema: dict[str, Any]) -> None:
    """Document the Responses routes in ``schema`` (an ``OpenAPIPatch``)."""
    add_models(schema, ResponseObject, ResponseEvent, ResponseDeleted, InputItemList)
    for (method, path), (answer, errors) in _ROUTES.items():
        operation = schema["paths"].get(path, {}).get(method)
        if operation is None:
            continue
        responses = {"200": json_response(ref(answer), "The response.")}
        for status in errors:
            responses[str(status)] = json_response(ref("ErrorResponse"), ERROR_MEANINGS[status])
        if method == "post":
            event = sse_event_schema(ref("ResponseEvent"))
            responses["200"]["content"]["text/event-stream"] = {"schema": event}
            responses["200"]["description"] += (
                " With `stream: true`, typed server-sent events (`event: <type>`, `data: "
                "<event JSON>`), from `response.created` to `response.completed`."
            )
        operation["responses"] = responses
