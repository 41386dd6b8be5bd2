"""Graceful shutdown on SIGTERM/SIGINT: no request is silently cut.

::

    signal --> draining: new generation requests get 503, /health 503 {"status": "draining"}
           --> running requests finish ......................... (up to --shutdown-timeout)
           --> the rest are aborted: a final error chunk (or a 503 JSON answer)
           --> uvicorn closes the listener, flushes the responses, exits; the process exits 0

uvicorn's own handler would close the listener at once (new clients: connection refused)
and re-raise the signal after serving (SIGTERM: exit status 143); ``GracefulServer`` keeps
the listener open to answer 503 while draining and returns normally. A second signal
skips the wait (a second SIGINT also skips flushing, as in uvicorn).
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable, Iterable
from types import FrameType

import uvicorn

from mlxserve.server.serving.generation import Generation, GenerationError

logger = logging.getLogger(__name__)

# After aborting, how long the aborted requests' error chunks get to reach their clients.
ABORT_FLUSH_S = 5.0


class ShutdownState:
    """The drain's clock and decisions; polled on the event loop.

    Args:
        timeout: seconds running requests get to finish once draining begins.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.draining = False
        self._deadline = 0.0
        self._abort_deadline: float | None = None

    def begin(self) -> None:
        """Stop admitting requests and start the clock (idempotent)."""
        if not self.draining:
            self.draining = True
            self._deadline = time.monotonic() + self.timeout
            logger.info(
                "shutting down: no new requests; running ones get up to %g s to finish",
                self.timeout,
            )

    def poll(self, live: Iterable[Generation]) -> bool:
        """Abort what outlived the timeout; True once nothing is left to wait for."""
        pending = [gen for gen in live if not gen.finished]
        if not pending:
            return True
        now = time.monotonic()
        if self._abort_deadline is None and now >= self._deadline:
            logger.warning("shutdown timeout: aborting %d running request(s)", len(pending))
            for gen in pending:
                gen.fail(
                    GenerationError(
                        "The server is shutting down; the request was aborted.",
                        status_code=503,
                        code="server_shutting_down",
                    )
                )
            self._abort_deadline = now + ABORT_FLUSH_S
        return self._abort_deadline is not None and now >= self._abort_deadline


class GracefulServer(uvicorn.Server):
    """uvicorn that drains (see the module docstring) before it exits on a signal.

    Args:
        config: uvicorn's configuration.
        shutdown: the drain state the app's routes also see.
        live: returns the requests in flight (polled every 0.1 s while draining).
    """

    def __init__(
        self,
        config: uvicorn.Config,
        shutdown: ShutdownState,
        live: Callable[[], Iterable[Generation]],
        engine_failure: Callable[[], str | None] | None = None,
    ) -> None:
        super().__init__(config)
        self.shutdown_state = shutdown
        self._live = live
        self._engine_failure = engine_failure
        # Why the engine died while serving (the process then exits non-zero).
        self.engine_died: str | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # NOTE: not recorded in _captured_signals, so uvicorn does not re-raise it at the
        # end: a drained shutdown is a normal exit (status 0).
        if not self.shutdown_state.draining:
            self.shutdown_state.begin()
            return
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True

    def begin_shutdown(self) -> None:
        """Start draining, as a signal would (for embedding and tests)."""
        self.handle_exit(signal.SIGTERM, None)

    async def on_tick(self, counter: int) -> bool:
        if self.shutdown_state.draining and not self.should_exit:
            self.should_exit = self.shutdown_state.poll(self._live())
        if not self.should_exit and self._engine_failure is not None:
            # A dead engine can serve nothing: exit (non-zero) rather than answer 503
            # forever, so a supervisor restarts the process.
            reason = self._engine_failure()
            if reason is not None:
                logger.error("engine thread died (%s); exiting", reason)
                self.engine_died = reason
                self.should_exit = True
        return await super().on_tick(counter)
