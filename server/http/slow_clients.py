"""Slow clients cannot hold connections open: deadlines for request heads and bodies.

A client that trickles its headers (or its body) a byte at a time holds a connection and a
file descriptor for as long as it likes; a few thousand such clients exhaust the
descriptor limit (slowloris). uvicorn bounds idle keep-alive connections only, so:

- ``GuardedH11Protocol`` (uvicorn's h11 protocol) closes a connection whose request head
  is not complete ``header_timeout`` seconds after the connection opened or the previous
  response ended (no response can be sent before a request is parsed);
- ``BodyReadTimeout`` (ASGI middleware) answers 408 when a request body is not complete
  ``body_timeout`` seconds after its first read;
- uvicorn's ``limit_concurrency`` (``--max-connections``) answers 503 to requests beyond
  that many open connections.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import h11
from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from mlxserve.server.http.body_guard import call_answering
from mlxserve.server.http.errors import APIError, ErrorShapes


def guarded_h11(header_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline of ``header_timeout`` seconds (0: none) for
    each request head."""

    class GuardedH11Protocol(H11Protocol):
        _head_since = 0.0
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:  # noqa: ANN401
            super().connection_made(transport)
            self._arm_head_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_head_deadline()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

        def _arm_head_deadline(self) -> None:
            if not header_timeout or self.transport.is_closing():
                return
            self._head_since = time.monotonic()
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(header_timeout, self._check_head)

        def _check_head(self) -> None:
            self._head_timer = None
            waiting = self.conn.their_state is h11.IDLE
            late = time.monotonic() - self._head_since >= header_timeout
            if waiting and late and not self.transport.is_closing():
                self.logger.info("closing a connection whose request head took too long")
                self.transport.close()

    return GuardedH11Protocol


class BodyTimeout(HTTPException):
    """Raised from ``receive`` when a body is not complete in time (an ``HTTPException`` so
    that FastAPI's body parsing lets it through; the app answers it as 408)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(408, f"The request body did not arrive within {seconds:g} s.")


class BodyReadTimeout:
    """ASGI middleware: 408 when a request body is still incomplete ``seconds`` after its
    first read (0: no limit). Reads after the body (waiting for a disconnect) are not
    bounded."""

    def __init__(self, app: ASGIApp, seconds: float, shapes: ErrorShapes) -> None:
        self.app = app
        self.seconds = seconds
        self.shapes = shapes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.seconds:
            await self.app(scope, receive, send)
            return
        deadline: float | None = None
        body_done = False

        async def timed_receive() -> Message:
            nonlocal deadline, body_done
            if body_done:
                return await receive()
            loop = asyncio.get_running_loop()
            if deadline is None:
                deadline = loop.time() + self.seconds
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except asyncio.TimeoutError:
                raise BodyTimeout(self.seconds) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        def timeout_error(e: HTTPException) -> APIError:
            return APIError(408, str(e.detail), type="timeout_error", code="request_timeout")

        await call_answering(
            self.app, scope, timed_receive, send, BodyTimeout, timeout_error, self.shapes
        )
