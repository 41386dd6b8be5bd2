"""The gate: answers API requests with 503 while the server cannot serve them (a model
loading, a drain), before any route runs."""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from mlxserve.server.http.auth import OPS_PATHS
from mlxserve.server.http.errors import APIError, ErrorShapes


class ServiceGate:
    """ASGI middleware: asks ``refusal(method)`` for every API request (not the operational
    routes, nor the paths ``is_open`` names) and answers the refusal it gets, in the
    route's error shape.

    Args:
        app: the wrapped app.
        refusal: why a request with this HTTP method cannot be served now (None: it can).
        shapes: the app's error shapes.
        is_open: paths served whatever the state (the web UI: it shows the loading itself).
    """

    def __init__(
        self,
        app: ASGIApp,
        refusal: Callable[[str], APIError | None],
        shapes: ErrorShapes,
        is_open: Callable[[str], bool] = lambda path: False,
    ) -> None:
        self.app = app
        self.refusal = refusal
        self.shapes = shapes
        self.is_open = is_open

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["type"] == "http" and scope["path"]
        if path and path not in OPS_PATHS and not self.is_open(path):
            error = self.refusal(scope["method"])
            if error is not None:
                await self.shapes.response(error, scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)
