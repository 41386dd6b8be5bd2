"""Serving several declared models: start-up loads, the idle time-out, and shutdown.

At start-up the first declared model and every pinned one load (the server answers
``/health`` 503 with the first one's progress until then, as with one model); the others
load when a request names them. A thread unloads models idle past their time-out, and at
exit every engine is stopped.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from mlxserve.scheduler.config import EngineConfig
from mlxserve.server.app import VERSION, create_app
from mlxserve.server.config import ServerConfig
from mlxserve.server.lifecycle.loading import LoadProgress, backend_name, blas_line
from mlxserve.server.lifecycle.model_loader import EngineModelLoader
from mlxserve.server.lifecycle.state import ServerState
from mlxserve.server.models.declarations import ModelDeclaration
from mlxserve.server.models.entry import ModelEntry
from mlxserve.server.models.registry import ModelRegistry

if TYPE_CHECKING:
    from mlxserve.server.lifecycle.launch import BackgroundServer

logger = logging.getLogger(__name__)

# How often the idle time-out is checked.
REAP_INTERVAL_S = 1.0


class ModelKeeper:
    """The start-up loads and the idle time-out of a registry, on threads of their own.

    Args:
        registry: the declared models.
        startup: the entries to load at start-up (the first is the default model).
        on_ready: called once the start-up loads are done.
        on_failed: called with the error when the default model fails to load.
    """

    def __init__(
        self,
        registry: ModelRegistry,
        startup: list[ModelEntry],
        on_ready,  # noqa: ANN001 - Callable[[], None]
        on_failed,  # noqa: ANN001 - Callable[[BaseException], None]
    ) -> None:
        self.registry = registry
        self.startup = startup
        self.on_ready = on_ready
        self.on_failed = on_failed
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._loading = threading.Thread(target=self._load, name="mlxserve-startup", daemon=True)
        self._reaper = threading.Thread(target=self._reap, name="mlxserve-ttl", daemon=True)

    def start(self) -> ModelKeeper:
        self._loading.start()
        self._reaper.start()
        return self

    def _load(self) -> None:
        for index, entry in enumerate(self.startup):
            try:
                self.registry.load(entry)
            except BaseException as e:  # noqa: BLE001 - reported to the caller
                logger.error("loading %s failed: %s", entry.name, entry.error or e)
                if index == 0:
                    self.error = e
                    self.on_failed(e)
                    return
        self.on_ready()

    def _reap(self) -> None:
        while not self._stop.wait(REAP_INTERVAL_S):
            try:
                self.registry.unload_idle()
            except Exception:  # noqa: BLE001 - the time-out must keep running
                logger.exception("the idle time-out failed")

    def stop(self) -> None:
        """Stop the time-out, wait for start-up loading, unload every model."""
        self._stop.set()
        self._reaper.join(timeout=5)
        if self._loading.is_alive():
            logger.info("waiting for model loading to finish before exiting")
            self._loading.join()
        for entry in self.registry.entries():
            self.registry.unload(entry)


def serve_models(
    config: ServerConfig, engine_config: EngineConfig, declarations: list[ModelDeclaration]
) -> None:
    """Bind, load the start-up models behind the bound server, serve until a signal.

    Raises:
        RuntimeError: the default model failed to load, or an engine died.
    """
    from mlxserve.server.lifecycle.launch import graceful_server, warn_if_exposed

    logger.info(
        "mlxserve %s: %d models declared, backend %s, BLAS %s",
        VERSION,
        len(declarations),
        backend_name(),
        blas_line(),
    )
    warn_if_exposed(config)
    progress = LoadProgress()
    app = create_app(None, None, config, progress)
    state: ServerState = app.state.server
    loader = EngineModelLoader(engine_config, state.metrics)
    entries = state.serve_declared(declarations, loader)
    startup = [entries[0]] + [e for e in entries[1:] if e.declaration.pinned]
    loader.report_to(entries[0].name, progress)
    server = graceful_server(app, config)

    def on_ready() -> None:
        state.model_loaded()
        names = ", ".join(f"{e.name} ({e.status.value})" for e in entries)
        logger.info("ready: serving %s at http://%s:%d/v1", names, config.host, config.port)

    def on_failed(_: BaseException) -> None:
        server.should_exit = True

    keeper = ModelKeeper(state.models, startup, on_ready, on_failed).start()
    try:
        server.run()
    finally:
        keeper.stop()
    if server.engine_died is not None:
        raise RuntimeError(f"the engine thread died: {server.engine_died}")
    if keeper.error is not None and not state.shutdown.draining:
        raise RuntimeError(f"loading failed: {startup[0].error or keeper.error}")


def serve_models_in_background(
    declarations: list[ModelDeclaration],
    engine_config: EngineConfig,
    config: ServerConfig | None = None,
    loader_class: type[EngineModelLoader] = EngineModelLoader,
) -> BackgroundServer:
    """Serve several declared models on a background thread (tests, benchmarks): the
    start-up models are loaded before it returns.

    Args:
        declarations: the models.
        engine_config: every model's engine settings (declarations may size the pools).
        config: server settings (default: 127.0.0.1 on a free port).
        loader_class: the loader (an ``EngineModelLoader``), built with the engine config
            and the server's metrics; ``app.state.server.loader`` is it.

    Returns:
        The started server; ``stop()`` also unloads every model.

    Raises:
        RuntimeError: the default model failed to load.
    """
    from mlxserve.server.lifecycle.launch import BackgroundServer

    config = config or ServerConfig(port=0)
    app = create_app(None, None, config)
    state: ServerState = app.state.server
    loader = loader_class(engine_config, state.metrics)
    entries = state.serve_declared(declarations, loader)
    done = threading.Event()
    keeper = ModelKeeper(
        state.models,
        [entries[0]] + [e for e in entries[1:] if e.declaration.pinned],
        on_ready=lambda: (state.model_loaded(), done.set()),
        on_failed=lambda _: done.set(),
    ).start()
    done.wait()
    if keeper.error is not None:
        keeper.stop()
        raise RuntimeError(f"loading failed: {entries[0].error or keeper.error}")
    server = BackgroundServer(app, config.host, config.port, log_level="warning")
    server.on_stop = keeper.stop
    return server.start()
