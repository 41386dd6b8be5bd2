"""The server's life: loading -> ready -> draining, and what each phase answers.

``ServerState`` is what the routes and the middlewares share (``app.state.server``): the
model registry, the admission of requests, metrics, loading progress and the drain. Until
the model is loaded the registry is empty: ``/health`` reports the loading progress and
every API route answers 503. Once draining, generation is refused with 503.
"""

from __future__ import annotations

import logging
from typing import Any

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.mlx_backend.memory import total_memory_bytes
from mlxserve.scheduler.client import EngineClient
from mlxserve.server.config import ModelConfig, ServerConfig
from mlxserve.server.http.errors import APIError
from mlxserve.server.lifecycle.loading import LoadProgress
from mlxserve.server.lifecycle.metrics import Metrics
from mlxserve.server.lifecycle.model_loader import (
    EngineModelLoader,
    default_name,
    with_detected_task,
)
from mlxserve.server.lifecycle.shutdown import ShutdownState
from mlxserve.server.models.declarations import ModelDeclaration
from mlxserve.server.models.entry import ModelEntry, ModelStatus
from mlxserve.server.models.registry import ModelRegistry
from mlxserve.server.models.served_model import ModelInfo, ServedModel
from mlxserve.server.serving.admission import Admission
from mlxserve.server.serving.generation import Generation

logger = logging.getLogger(__name__)

# Seconds a client is told to wait while the model loads.
LOADING_RETRY_AFTER_S = 5


class ServerState:
    """Loading progress, drain state, the served models and (once loaded) the metrics.

    Args:
        config: the server configuration.
        progress: the loading progress (default: a fresh one, without a progress bar).
        model_config: how the model is served (served name, tool parser).
    """

    def __init__(
        self,
        config: ServerConfig,
        progress: LoadProgress | None = None,
        model_config: ModelConfig | None = None,
    ) -> None:
        self.config = config
        self.model_config = model_config or ModelConfig()
        self.progress = progress or LoadProgress(show_bar=False)
        self.shutdown = ShutdownState(config.shutdown_timeout)
        self.metrics = Metrics()
        # /metrics answers once a model was loaded (before that it says the server loads).
        self.metrics_ready = False
        self.models = ModelRegistry()
        self.admission = Admission(config)
        # Set when models are declared (several models): per-model load progress.
        self.loader: EngineModelLoader | None = None

    def serve_declared(
        self, declarations: list[ModelDeclaration], loader: EngineModelLoader
    ) -> list[ModelEntry]:
        """Serve several declared models, loaded on demand by ``loader`` (the registry's
        limits come from the server config)."""
        config = self.config
        self.loader = loader
        self.models.configure(
            loader,
            max_loaded=config.max_loaded_models,
            memory_budget=config.memory_budget_bytes(total_memory_bytes()),
            default_ttl=config.model_ttl,
        )
        entries = []
        for declaration in map(with_detected_task, declarations):
            names = declaration.names or (default_name(declaration),)
            entries.append(self.models.declare(declaration, names))
        return entries

    def model_loaded(self) -> None:
        """The start-up loads are done: serve."""
        self.metrics_ready = True
        self.progress.finish()

    @property
    def model(self) -> ServedModel | None:
        """The first loaded model (None while none is)."""
        return self.models.all()[0] if len(self.models) else None

    def attach(self, loaded: LoadedModel, engine: EngineClient) -> None:
        """The model is loaded and its engine started: start serving (any thread)."""
        info = ModelInfo(
            loaded.model_id,
            loaded.tokenizer,
            loaded.context_length,
            int(loaded.config.get("vocab_size") or 0),
            vision=loaded.vision,
        )
        model = ServedModel(info, engine, self.model_config)
        engine.observer = self.metrics.add_model(
            model.name, model.context_length, engine.stats, model.vision
        )
        self.metrics_ready = True
        self.models.add(model)  # last: the gate takes a served model to mean "ready"
        self.progress.finish()

    def live_generations(self) -> list[Generation]:
        return self.admission.live_generations()

    def engine_failure(self) -> str | None:
        """Why a loaded model's engine thread is dead (None while they are fine, still
        loading, or stopped by a shutdown)."""
        if self.shutdown.draining:
            return None
        for model in self.models.all():
            if not model.engine.is_alive:
                return str(model.engine.error or "engine thread stopped")
        return None

    def health(self) -> tuple[int, dict[str, Any]]:
        """``/health``'s status code and body."""
        if self.shutdown.draining:
            return 503, {"status": "draining"}
        if not self.progress.ready or self.model is None:
            return 503, self.progress.snapshot()
        if not self.shutdown.draining:
            for model in self.models.all():
                if not model.engine.is_alive:
                    error = model.engine.error
                    detail = f"engine is not running: {error}" if error else "engine is not running"
                    return 503, {"status": "unavailable", "detail": detail}
        body: dict[str, Any] = {"status": "ok"}
        if self.loader is not None:
            body["models"] = {e.name: self._health_of(e) for e in self.models.entries()}
        return 200, body

    def _health_of(self, entry: ModelEntry) -> dict[str, Any]:
        status: dict[str, Any] = {"status": entry.status.value}
        progress = self.loader.progress.get(entry.name) if self.loader is not None else None
        if entry.status is ModelStatus.LOADING and progress is not None:
            snap = progress.snapshot()
            status.update(stage=snap["stage"], progress=snap["progress"])
        if entry.error and entry.status is ModelStatus.UNLOADED:
            status["error"] = entry.error
        return status

    def refusal(self, method: str) -> APIError | None:
        """Why an API request cannot be served now, or None."""
        if not self.progress.ready:
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
