"""Errors: one ``APIError`` for every protocol, rendered in the shape of the route it hit.

Bad input is always a 4xx (400 ``invalid_request_error`` for anything the request body got
wrong, like OpenAI), never a 500; 5xx is kept for failures of the server itself. The body's
shape is the protocol's: ``ErrorShapes`` maps route prefixes to a renderer, and every route
without one (the OpenAI API, ``/tokenize``, the operational routes) answers OpenAI's
``{"error": {message, type, param, code}}``. Handlers and middlewares render through the
app's ``ErrorShapes``, so a protocol adapter registers its shape once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error answered to the client in the OpenAI error shape.

    Args:
        status_code: HTTP status.
        message: human-readable explanation.
        type: OpenAI error type (``invalid_request_error``, ``server_error``, ...).
        param: the request parameter at fault, if any.
        code: machine-readable code (``model_not_found``, ``context_length_exceeded``...).
        headers: extra response headers (``Retry-After``, ``WWW-Authenticate``).
    """

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        """The default (OpenAI) body: ``{"error": {"message", "type", "param", "code"}}``."""
        return error_body(self.message, self.type, self.param, self.code)

    def response(self, shape: ErrorShape | None = None) -> JSONResponse:
        """The JSON response (status, body in ``shape``, default OpenAI's, and headers)."""
        body = shape(self) if shape is not None else self.body()
        return JSONResponse(body, status_code=self.status_code, headers=self.headers)


# A protocol's error body for an APIError.
ErrorShape = Callable[[APIError], dict[str, Any]]


class ErrorShapes:
    """Which error shape each route answers: the longest registered prefix wins, the
    default (OpenAI's) covers the rest."""

    def __init__(self) -> None:
        self._shapes: list[tuple[str, ErrorShape]] = []

    def register(self, prefix: str, shape: ErrorShape) -> None:
        """Answer errors of ``prefix`` and the routes under it in ``shape``."""
        self._shapes.append((prefix, shape))
        self._shapes.sort(key=lambda item: -len(item[0]))

    def shape_for(self, path: str) -> ErrorShape | None:
        """The shape of ``path`` (None: the default)."""
        for prefix, shape in self._shapes:
            if path == prefix or path.startswith(prefix + "/"):
                return shape
        return None

    def response(self, error: APIError, path: str) -> JSONResponse:
        """``error`` as the route at ``path`` answers it."""
        return error.response(self.shape_for(path))


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """Build the OpenAI error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 ``invalid_request_error``."""
    return APIError(400, message, param=param, code=code)


def _param_name(loc: tuple[Any, ...]) -> str | None:
    """Dotted parameter path of a pydantic error location, without FastAPI's "body"."""
    parts = [str(p) for p in loc if p != "body"]
    if not parts:
        return None
    name = parts[0]
    for part in parts[1:]:
        name += f"[{part}]" if part.isdigit() else f".{part}"
    return name


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """Turn pydantic/FastAPI validation errors into one 400 naming the first bad parameter."""
    if not errors:
        return invalid_request("Invalid request body.")
    err = errors[0]
    kind = err.get("type", "")
    loc = tuple(err.get("loc", ()))
    param = _param_name(loc)
    if kind == "json_invalid":
        detail = err.get("ctx", {}).get("error", "")
        return invalid_request(
            f"We could not parse the JSON body of your request: {detail}".rstrip(": "),
            code="invalid_json",
        )
    if kind == "extra_forbidden":
        return invalid_request(f"Unrecognized request argument supplied: {param}", param=param)
    if kind == "missing":
        if param is None:
            return invalid_request("The request body must be a JSON object.")
        return invalid_request(f"Missing required parameter: '{param}'.", param=param)
    if param is None and kind in ("model_type", "dict_type", "model_attributes_type"):
        return invalid_request("The request body must be a JSON object.")
    msg = err.get("msg", "invalid value")
    if kind == "value_error" and "error" in err.get("ctx", {}):
        # Our own validators: their message is a sentence, which may name the field already.
        msg = str(err["ctx"]["error"])
        if param is not None and f"'{param}'" not in msg:
            msg = f"Invalid value for '{param}': {msg}"
        return invalid_request(msg, param=param)
    return invalid_request(f"Invalid value for '{param}': {msg}.", param=param)


_HTTP_CODES = {404: "not_found", 408: "request_timeout", 413: "request_too_large"}


def install_error_handlers(app: FastAPI, shapes: ErrorShapes) -> None:
    """Answer every error of ``app`` in the shape of its route (``shapes``)."""

    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return shapes.response(exc, request.url.path)

    async def validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return shapes.response(validation_error(list(exc.errors())), request.url.path)

    async def http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        error = APIError(
            exc.status_code,
            str(exc.detail),
            type=kind,
            code=_HTTP_CODES.get(exc.status_code),
            headers=getattr(exc, "headers", None),
        )
        return shapes.response(error, request.url.path)

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving a request", exc_info=exc)
        error = APIError(500, f"Internal server error: {type(exc).__name__}", type="server_error")
        return shapes.response(error, request.url.path)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(StarletteHTTPException, http)
    app.add_exception_handler(Exception, unexpected)
