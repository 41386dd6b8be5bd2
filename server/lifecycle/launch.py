"""Starting the server: bind, then load the model behind it, then serve until a signal.

``serve`` (the CLI) answers HTTP while the model loads (``/health`` reports progress) and
drains on SIGTERM/SIGINT; ``serve_in_background`` runs an already-loaded model on a
thread (tests, benchmarks, notebooks).
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.client import EngineClient
from mlxserve.scheduler.config import EngineConfig
from mlxserve.scheduler.engine import Engine
from mlxserve.server.app import VERSION, create_app
from mlxserve.server.config import ModelConfig, ServerConfig
from mlxserve.server.http.auth import is_loopback
from mlxserve.server.http.slow_clients import guarded_h11
from mlxserve.server.lifecycle.engines import build_engine
from mlxserve.server.lifecycle.loading import (
    BackgroundLoader,
    LoadProgress,
    attention_line,
    backend_name,
    blas_line,
    convert_for_backend,
    keep_quantized_note,
    native_ops_line,
)
from mlxserve.server.lifecycle.shutdown import ABORT_FLUSH_S, GracefulServer
from mlxserve.server.lifecycle.state import ServerState
from mlxserve.server.models.declarations import ModelDeclaration

if TYPE_CHECKING:
    from mlxserve.mlx_backend.distributed.group import Group

logger = logging.getLogger(__name__)

# How long uvicorn waits for connections to close once the drain is over.
FLUSH_TIMEOUT_S = ABORT_FLUSH_S + 5


def serve(
    config: ServerConfig,
    model_config: ModelConfig,
    engine_config: EngineConfig,
    declarations: list[ModelDeclaration] | None = None,
    group: Group | None = None,
) -> None:
    """Bind ``config.host:port``, load ``model_config.model`` behind it, serve until a
    signal. With ``declarations`` (several models), serve them instead, loaded on demand
    (``serve_models``). With ``group`` (rank 0 of a tensor-parallel group) the model is
    sharded over the group and its forwards run on every rank.

    Raises:
        mlxserve.mlx_backend.loading.loader.ModelLoadError: the model cannot be loaded.
        RuntimeError: the engine failed to start.
    """
    if not declarations and is_encoder(model_config.model):
        # An encoder only embeds: it is served as a declared embedding model.
        names = (model_config.served_model_name,) if model_config.served_model_name else ()
        source = model_config.model
        declarations = [ModelDeclaration(source, names, keep_quantized=model_config.keep_quantized)]
    if declarations and group is not None:
        raise RuntimeError("tensor parallelism serves one model (one --model)")
    if declarations:
        from mlxserve.server.lifecycle.multi_model import serve_models

        serve_models(config, engine_config, declarations)
        return
    from mlxserve.mlx_backend.loading.loader import (  # heavy: only when serving
        ModelLoadError,
        load_model,
    )

    check_model_path(model_config.model)
    logger.info(
        "mlxserve %s: model %s, backend %s, BLAS %s, attention %s, elementwise %s",
        VERSION,
        model_config.model or "embedded SmolLM2-135M-Instruct",
        backend_name(),
        blas_line(),
        attention_line(),
        native_ops_line(),
    )
    warn_if_exposed(config)
    progress = LoadProgress()
    app = create_app(None, None, config, progress, model_config)
    state: ServerState = app.state.server
    server = graceful_server(app, config)

    def on_ready(loaded: LoadedModel, engine: EngineClient) -> None:
        state.attach(loaded, engine)
        if group is not None:
            from mlxserve.server.lifecycle.group_metrics import GroupCollector

            stats = engine.executor  # the DistributedExecutor of build_engine
            state.metrics.registry.register(GroupCollector(lambda: stats.stats))
        model = state.models.default()
        logger.info(
            "ready: serving %s (context %d tokens) at http://%s:%d/v1",
            model.name,
            model.context_length,
            config.host,
            config.port,
        )

    def on_failed(_: BaseException) -> None:
        server.should_exit = True

    loader = BackgroundLoader(
        lambda: load_model(model_config.model, keep_quantized=model_config.keep_quantized),
        engine_config,
        progress,
        on_ready,
        on_failed,
        convert=keep_quantized_note if model_config.keep_quantized else convert_for_backend,
        build=functools.partial(build_engine, group=group),
    ).start()
    try:
        server.run()
    finally:
        if not loader.join(timeout=0):
            # NOTE: MLX work on a thread alive at interpreter exit aborts the process.
            logger.info("waiting for model loading to finish before exiting")
            loader.join()
        if loader.engine is not None:
            loader.engine.shutdown()
    if server.engine_died is not None:
        raise RuntimeError(f"the engine thread died: {server.engine_died}")
    error = loader.error
    if error is not None and not state.shutdown.draining:
        if isinstance(error, (ModelLoadError, RuntimeError)):
            raise error
        raise RuntimeError(f"loading failed: {error}") from error


def is_encoder(source: str | None) -> bool:
    """Whether ``source`` is an encoder model directory (served for embeddings only)."""
    from mlxserve.mlx_backend.loading.encoders import encoder_model_type

    return encoder_model_type(source) is not None


def graceful_server(app: FastAPI, config: ServerConfig) -> GracefulServer:
    """uvicorn serving ``app`` at ``config``'s address, draining on SIGTERM/SIGINT and
    stopping when an engine dies."""
    state: ServerState = app.state.server
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        **uvicorn_options(config),
    )
    return GracefulServer(uv_config, state.shutdown, state.live_generations, state.engine_failure)


def uvicorn_options(config: ServerConfig) -> dict[str, Any]:
    """uvicorn's settings that bound slow and many clients (``server/http/slow_clients.py``)."""
    return {
        "timeout_graceful_shutdown": FLUSH_TIMEOUT_S,
        "http": guarded_h11(config.header_timeout),
        "limit_concurrency": config.max_connections or None,
    }


def check_model_path(spec: str | None) -> None:
    """Fail at once, before binding, for a local model path that does not exist.

    Raises:
        ModelLoadError: ``spec`` names a missing file or directory.
    """
    from mlxserve.mlx_backend.loading.loader import ModelLoadError

    if spec is None or os.path.exists(os.path.expanduser(spec)):
        return
    # Anything that cannot be a Hugging Face repo id ("org/name") is meant as a path.
    if spec.lower().endswith(".gguf") or spec.startswith((".", "~", os.sep)):
        raise ModelLoadError(f"Model path does not exist: {spec}")


def warn_if_exposed(config: ServerConfig) -> None:
    """Warn when the server is reachable from other machines without an API key."""
    if not is_loopback(config.host) and not config.api_keys():
        logger.warning(
            "binding %s without an API key: anyone who can reach this port can use the "
            "server (set --api-key or MLXSERVE_API_KEY)",
            config.host,
        )


class BackgroundServer:
    """uvicorn serving ``app`` on a background thread (tests, benchmarks, notebooks).

    The socket is bound before the thread starts, so ``port=0`` picks a free port without
    a race; ``url`` says where it landed. Signals stay with the main thread; call
    ``begin_shutdown`` for the drain a signal would start.

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
        # Called by stop() after uvicorn (serve_models_in_background: unload every model).
        self.on_stop: Callable[[], None] | None = None
        state: ServerState = app.state.server
        config = uvicorn.Config(app, log_level=log_level, **uvicorn_options(state.config))
        self._server = GracefulServer(config, state.shutdown, state.live_generations)
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

    def begin_shutdown(self) -> None:
        """Drain as on SIGTERM: refuse new requests, let running ones finish (up to the
        config's shutdown_timeout), abort the rest, then stop uvicorn."""
        self._server.begin_shutdown()

    def wait_stopped(self, timeout: float) -> bool:
        """Wait for uvicorn's thread to end; False if it still runs after ``timeout``."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self, timeout: float = 30.0) -> None:
        """Ask uvicorn to exit, wait for its thread, then shut down the owned engine."""
        self._server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()
        if self.engine is not None:
            self.engine.shutdown()
        if self.on_stop is not None:
            self.on_stop()


def serve_in_background(
    loaded: LoadedModel,
    engine_config: EngineConfig,
    config: ServerConfig | None = None,
    model_config: ModelConfig | None = None,
) -> BackgroundServer:
    """Start an engine for ``loaded`` and serve it on a background thread.

    Args:
        loaded: the model to serve (e.g. ``load_model(None)``).
        engine_config: engine sizes.
        config: server settings; host and port are taken from it (default: 127.0.0.1 on
            a free port).
        model_config: how the model is served (served name, tool parser).

    Returns:
        The started server; ``.url``, ``.engine``; ``stop()`` stops uvicorn and the engine.
    """
    config = config or ServerConfig(port=0)
    engine = build_engine(loaded, engine_config)
    engine.start()
    try:
        app = create_app(loaded, engine, config, model_config=model_config)
        server = BackgroundServer(app, config.host, config.port, log_level="warning")
        server.engine = engine
        return server.start()
    except BaseException:
        engine.shutdown()
        raise
