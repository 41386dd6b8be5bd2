"""The gate: answers API requests with 503 while the server cannot serve them (a model
loading, a drain), before any route runs."""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from mlxserve.server.http.auth import OPS_PATHS
from mlxserve.server.http.errors import APIError, ErrorShapes


class ServiceGate:
    """ASGI middleware: asks ``refusal(method)`` for every API request (not the operational
    routes) and answers the refusal it gets, in the route's error shape.

    Args:
        app: the wrapped app.
        refusal: why a request with this HTTP method cannot be served now (None: it can).
        shapes: the app's error shapes.
    """

    def __init__(
        self, app: ASGIApp, refusal: Callable[[str], APIError | None], shapes: ErrorShapes
    ) -> None:
        self.app = app
        self.refusal = refusal
        self.shapes = shapes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPS_PATHS:
            error = self.refusal(scope["method"])
            if error is not None:
                await self.shapes.response(error, scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)
