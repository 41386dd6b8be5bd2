"""Middlewares that bound how a request body is read (size, time) raise from ``receive``;
this runs the app so that such a refusal is answered in the route's error shape when it
escapes FastAPI's own body parsing (e.g. a body read by a middleware)."""

from __future__ import annotations

from collections.abc import Callable

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlxserve.server.http.errors import APIError, ErrorShapes


async def call_answering(
    app: ASGIApp,
    scope: Scope,
    guarded_receive: Receive,
    send: Send,
    raised: type[HTTPException],
    error_of: Callable[[HTTPException], APIError],
    shapes: ErrorShapes,
) -> None:
    """Run ``app`` with ``guarded_receive``; when it raises ``raised`` before the response
    started, answer ``error_of(exception)`` instead (after that, let it propagate)."""
    started = False

    async def watching_send(message: Message) -> None:
        nonlocal started
        started = started or message["type"] == "http.response.start"
        await send(message)

    try:
        await app(scope, guarded_receive, watching_send)
    except raised as e:
        if started:
            raise
        await shapes.response(error_of(e), scope["path"])(scope, guarded_receive, send)
