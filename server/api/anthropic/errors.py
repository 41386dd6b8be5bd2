"""Anthropic's error shape for its routes: ``{"type": "error", "error": {"type", "message"}}``.

The error's ``type`` follows its HTTP status, as Anthropic's API sets it: 400 (and 413,
422) ``invalid_request_error``, 401 ``authentication_error``, 403 ``permission_error``, 404
``not_found_error``, 408 / 504 ``timeout_error``, 429 ``rate_limit_error``, 503 / 529
``overloaded_error``, any other 5xx ``api_error``. Registered with the app's
``ErrorShapes`` for ``/v1/messages``, so that validation errors, 401s from the API key
check, 413s from the body limit and 503s from the gate all come in this shape.
"""

from __future__ import annotations

from typing import Any

from mlxserve.server.http.errors import APIError

# The route prefix whose errors take this shape.
MESSAGES_PREFIX = "/v1/messages"

_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def error_type(status_code: int) -> str:
    """Anthropic's error type for an HTTP status."""
    if status_code in _TYPES:
        return _TYPES[status_code]
    return "api_error" if status_code >= 500 else "invalid_request_error"


def error_body(status_code: int, message: str) -> dict[str, Any]:
    """The error object, in an HTTP body or an SSE ``error`` event."""
    return {"type": "error", "error": {"type": error_type(status_code), "message": message}}


def anthropic_error_shape(error: APIError) -> dict[str, Any]:
    """``ErrorShape`` of the Anthropic routes."""
    return error_body(error.status_code, error.message)
