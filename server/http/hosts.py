"""DNS rebinding: a server bound to loopback answers only requests addressed to loopback.

A web page on ``evil.example`` can make its own name resolve to 127.0.0.1 and then, being
same-origin with it in the browser's eyes, drive a local server without any CORS check. Its
requests still carry ``Host: evil.example``; so while the server is bound to a loopback
address, requests whose Host is not a loopback name (``localhost``, ``127.0.0.1``,
``[::1]``, any port) or one listed in ``--allowed-hosts`` are refused with a 400.
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from mlxserve.server.http.errors import APIError, ErrorShapes

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def host_name(header: str) -> str:
    """The name of a Host header, without its port (``[::1]:8000`` -> ``::1``)."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class LoopbackHostOnly:
    """ASGI middleware: 400 for HTTP requests whose Host is not a loopback name or one of
    ``extra`` (``"*"`` accepts any). A request without a Host header (HTTP/1.0, not a
    browser) passes."""

    def __init__(self, app: ASGIApp, extra: Iterable[str], shapes: ErrorShapes) -> None:
        self.app = app
        self.allowed = LOOPBACK_NAMES | {host_name(h) for h in extra}
        self.shapes = shapes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            header = dict(scope["headers"]).get(b"host")
            if header is not None and host_name(header.decode("latin-1")) not in self.allowed:
                error = APIError(
                    400,
                    "Invalid Host header: this server only answers requests addressed to "
                    "itself on loopback (start it with --allowed-hosts to accept a name).",
                    code="invalid_host",
                )
                await self.shapes.response(error, scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)
