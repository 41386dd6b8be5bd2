"""OpenAI-shaped errors: every failure answers ``{"error": {message, type, param, code}}``.

Bad input is always a 4xx (400 ``invalid_request_error`` for anything the request body got
wrong, like OpenAI), never a 500; 5xx is kept for failures of the server itself.
"""

from __future__ import annotations

import logging
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
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        """The JSON response (status, body and headers)."""
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


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


async def _api_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def _validation_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    api_error = validation_error(list(exc.errors()))
    return JSONResponse(api_error.body(), status_code=api_error.status_code)


_HTTP_CODES = {404: "not_found", 413: "request_too_large"}


async def _http_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    code = _HTTP_CODES.get(exc.status_code)
    return JSONResponse(
        error_body(str(exc.detail), kind, code=code),
        status_code=exc.status_code,
        headers=getattr(exc, "headers", None),
    )


async def _unexpected_handler(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error while serving a request", exc_info=exc)
    return JSONResponse(
        error_body(f"Internal server error: {type(exc).__name__}", "server_error"),
        status_code=500,
    )


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error of ``app`` in the OpenAI shape."""
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(StarletteHTTPException, _http_handler)
    app.add_exception_handler(Exception, _unexpected_handler)
