"""The request body size limit (prompt length and queue depth: ``serving/limits.py``).

The body limit is ASGI middleware, so an oversized body is refused before any handler (or
JSON parser) holds it: a ``Content-Length`` over the limit is answered at once, and a body
without one (chunked) is counted as it arrives and cut off at the limit.
"""

from __future__ import annotations

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlxserve.server.http.body_guard import call_answering
from mlxserve.server.http.errors import APIError, ErrorShapes


def _too_large(max_bytes: int) -> APIError:
    return APIError(
        413,
        f"The request body is larger than the limit of {max_bytes} bytes.",
        code="request_too_large",
    )


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` when a body grows past the limit.

    NOTE: an ``HTTPException`` because FastAPI re-raises those from body parsing (any other
    exception becomes a 400 "error parsing the body"); the app's handler answers it as 413.
    """

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, _too_large(max_bytes).message)


class BodySizeLimit:
    """ASGI middleware: 413 for request bodies over ``max_bytes`` (0: no limit), in the
    error shape of the route (``shapes``)."""

    def __init__(self, app: ASGIApp, max_bytes: int, shapes: ErrorShapes) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.shapes = shapes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.max_bytes:
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await self.shapes.response(_too_large(limit), scope["path"])(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        await call_answering(
            self.app,
            scope,
            counting_receive,
            send,
            BodyTooLarge,
            lambda _: _too_large(limit),
            self.shapes,
        )
