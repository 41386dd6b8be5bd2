"""``/openapi.json`` for the Anthropic routes: their answers as sent, errors in Anthropic's
shape (``AnthropicErrorResponse``), Anthropic's event stream beside the JSON message."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from mlxserve.server.api.anthropic.errors import MESSAGES_PREFIX
from mlxserve.server.api.openai.openapi import (
    ERROR_MEANINGS,
    GENERATION_ERRORS,
    add_models,
    json_response,
    ref,
    sse_event_schema,
)


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Every error body of the Anthropic routes."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int | None = None
    cache_read_input_tokens: int | None = None


class AnthropicMessage(BaseModel):
    """The answer of ``POST /v1/messages`` (content blocks: text, thinking, tool_use)."""

    model_config = ConfigDict(extra="allow")
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None
    stop_sequence: str | None
    usage: AnthropicUsage


class AnthropicEvent(BaseModel):
    """One streamed event (``message_start``, ``content_block_delta``, ``error``, ...)."""

    model_config = ConfigDict(extra="allow")
    type: str


class TokenCount(BaseModel):
    input_tokens: int


_ROUTES = {
    f"{MESSAGES_PREFIX}": ("AnthropicMessage", GENERATION_ERRORS),
    f"{MESSAGES_PREFIX}/count_tokens": ("TokenCount", (400, 401, 404, 413, 503)),
}


def document_anthropic(schema: dict[str, Any]) -> None:
    """Document the Anthropic routes in ``schema`` (an ``OpenAPIPatch``)."""
    add_models(schema, AnthropicErrorResponse, AnthropicMessage, AnthropicEvent, TokenCount)
    for path, (answer, errors) in _ROUTES.items():
        operation = schema["paths"].get(path, {}).get("post")
        if operation is None:
            continue
        responses = {"200": json_response(ref(answer), "The answer.")}
        for status in errors:
            responses[str(status)] = json_response(
                ref("AnthropicErrorResponse"), ERROR_MEANINGS[status]
            )
        if path == MESSAGES_PREFIX:
            event = sse_event_schema(ref("AnthropicEvent"))
            responses["200"]["content"]["text/event-stream"] = {"schema": event}
            responses["200"]["description"] += (
                " With `stream: true`, Anthropic's server-sent events (`event: <type>`, "
                "`data: <event JSON>`), from `message_start` to `message_stop`."
            )
        operation["responses"] = responses
