"""Starting the server: load the model, start the engine, run uvicorn (or run it in a thread)."""

from __future__ import annotations

import logging
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI

from mlx_backend.loaded_model import LoadedModel
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from server.app import create_app
from server.config import ServerConfig

logger = logging.getLogger(__name__)


def serve(config: ServerConfig, engine_config: EngineConfig) -> None:
    """Load ``config.model``, start the engine and serve until interrupted.

    Raises:
        mlx_backend.loader.ModelLoadError: the model cannot be loaded.
        RuntimeError: the engine failed to start.
    """
    from mlx_backend.loader import load_model  # heavy: only when actually serving

    _serve_loaded(load_model(config.model), config, engine_config)


def _serve_loaded(loaded: LoadedModel, config: ServerConfig, engine_config: EngineConfig) -> None:
    engine = Engine(loaded, engine_config)
    engine.start()
    try:
        app = create_app(loaded, engine, config)
        logger.info(
            "serving %s (context %d tokens) at http://%s:%d/v1",
            app.state.ctx.model_name,
            app.state.ctx.context_length,
            config.host,
            config.port,
        )
        uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level)
    finally:
        engine.shutdown()


class BackgroundServer:
    """uvicorn serving ``app`` on a background thread (tests, benchmarks, notebooks).

    The socket is bound before the thread starts, so ``port=0`` picks a free port without
    a race; ``url`` says where it landed.

    Args:
        app: the ASGI app (``create_app(...)``).
        host: address to bind.
        port: port to bind (0: any free port).
        log_level: uvicorn's log level.
    """

    def __init__(
        self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"
    ) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = self._sock.getsockname()[:2]
        self.app = app
        # The engine this server owns (set by serve_in_background); stop() shuts it down.
        self.engine: Engine | None = None
        self._server = uvicorn.Server(uvicorn.Config(app, log_level=log_level))
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:54321``."""
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        """Start serving; returns once uvicorn accepts connections.

        Raises:
            RuntimeError: uvicorn did not start within ``timeout`` seconds.
        """
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Ask uvicorn to exit, wait for its thread, then shut down the owned engine."""
        self._server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()
        if self.engine is not None:
            self.engine.shutdown()


def serve_in_background(
    loaded: LoadedModel, engine_config: EngineConfig, config: ServerConfig | None = None
) -> BackgroundServer:
    """Start an engine for ``loaded`` and serve it on a background thread.

    Args:
        loaded: the model to serve (e.g. ``load_model(None)``).
        engine_config: engine sizes.
        config: server settings; host and port are taken from it (default: 127.0.0.1 on
            a free port).

    Returns:
        The started server; ``.url``, ``.engine``; ``stop()`` stops uvicorn and the engine.
    """
    config = config or ServerConfig(port=0)
    engine = Engine(loaded, engine_config)
    engine.start()
    try:
        app = create_app(loaded, engine, config)
        server = BackgroundServer(app, config.host, config.port, log_level="warning")
        server.engine = engine
        return server.start()
    except BaseException:
        engine.shutdown()
        raise
