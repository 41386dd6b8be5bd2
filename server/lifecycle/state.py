"""The server's life: loading -> ready -> draining, and what each phase answers.

``ServerState`` is what the routes and the middlewares share (``app.state.server``). Until
the model is loaded there is no ``ServingContext``: ``/health`` reports the loading
progress and every API route answers 503. Once draining, generation is refused with 503.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.engine import Engine
from mlxserve.server.config import ServerConfig
from mlxserve.server.http.auth import OPS_PATHS
from mlxserve.server.http.errors import APIError
from mlxserve.server.lifecycle.loading import LoadProgress
from mlxserve.server.lifecycle.metrics import Metrics
from mlxserve.server.lifecycle.shutdown import ShutdownState
from mlxserve.server.serving.context import ServingContext
from mlxserve.server.serving.generation import Generation

logger = logging.getLogger(__name__)

# Seconds a client is told to wait while the model loads.
LOADING_RETRY_AFTER_S = 5


class ServerState:
    """Loading progress, drain state, and (once loaded) the serving context and metrics.

    Args:
        config: the server configuration.
        progress: the loading progress (default: a fresh one, without a progress bar).
    """

    def __init__(self, config: ServerConfig, progress: LoadProgress | None = None) -> None:
        self.config = config
        self.progress = progress or LoadProgress(show_bar=False)
        self.shutdown = ShutdownState(config.shutdown_timeout)
        self.metrics: Metrics | None = None
        self.ctx: ServingContext | None = None

    def attach(self, loaded: LoadedModel, engine: Engine) -> None:
        """The model is loaded and its engine started: start serving (any thread)."""
        ctx = ServingContext(loaded, engine, self.config)
        metrics = Metrics(ctx.model_name, ctx.context_length, engine.stats)
        engine.observer = metrics
        self.metrics = metrics
        self.ctx = ctx  # last: routes take a non-None ctx to mean "ready"
        self.progress.finish()

    def live_generations(self) -> list[Generation]:
        return self.ctx.live_generations() if self.ctx is not None else []

    def engine_failure(self) -> str | None:
        """Why the engine thread is dead, once it was serving (None while it is fine,
        still loading, or stopped by a shutdown)."""
        if self.ctx is None or self.shutdown.draining or self.ctx.engine.is_alive:
            return None
        return str(getattr(self.ctx.engine, "error", None) or "engine thread stopped")

    def health(self) -> tuple[int, dict[str, Any]]:
        """``/health``'s status code and body."""
        if self.shutdown.draining:
            return 503, {"status": "draining"}
        if self.ctx is None:
            return 503, self.progress.snapshot()
        engine = self.ctx.engine
        if engine.is_alive:
            return 200, {"status": "ok"}
        error = getattr(engine, "error", None)
        detail = f"engine is not running: {error}" if error else "engine is not running"
        return 503, {"status": "unavailable", "detail": detail}

    def refusal(self, method: str) -> APIError | None:
        """Why an API request cannot be served now, or None."""
        if self.ctx is None:
            snap = self.progress.snapshot()
            if snap["status"] == "failed":
                return APIError(
                    503,
                    f"The model failed to load: {snap.get('detail')}",
                    type="server_error",
                    code="model_load_failed",
                )
            return APIError(
                503,
                f"The model is loading ({snap['stage']}, {snap['progress']:.0%} done). "
                "Please retry shortly.",
                type="server_error",
                code="model_loading",
                headers={"Retry-After": str(LOADING_RETRY_AFTER_S)},
            )
        if self.shutdown.draining and method == "POST":
            return APIError(
                503,
                "The server is shutting down and accepts no new requests.",
                type="server_error",
                code="server_shutting_down",
            )
        return None


class ServiceGate:
    """ASGI middleware: answers API requests with 503 while loading or shutting down."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPS_PATHS:
            error = self.state.refusal(scope["method"])
            if error is not None:
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
