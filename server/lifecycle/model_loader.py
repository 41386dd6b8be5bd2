"""Loading declared models on demand: the registry's ``ModelLoader`` (composition root).

Each load runs the same stages as the start-up load (``loading.load_stages``): weights,
conversion, engine (its KV pools sized from what the memory budget leaves once the weights
are in), warm-up. What a loaded model takes, its ``resident_bytes``, is its weights plus its
pools; the budget counts every loaded model's. Unloading stops the engine, drops every
reference to the weights and pools, and returns MLX's cached buffers to the system.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import threading
import time
from pathlib import Path

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.config import EngineConfig
from mlxserve.server.config import ModelConfig
from mlxserve.server.lifecycle.loading import (
    LoadProgress,
    convert_for_backend,
    keep_quantized_note,
    load_stages,
    weight_bytes,
)
from mlxserve.server.lifecycle.metrics import Metrics
from mlxserve.server.models.declarations import ModelDeclaration
from mlxserve.server.models.registry import ModelEntry
from mlxserve.server.models.served_model import ModelInfo, ServedModel

logger = logging.getLogger(__name__)


def default_name(declaration: ModelDeclaration) -> str:
    """The served name of a declaration that gives none: its folder or file name, its repo
    id, or the embedded model's id."""
    from mlxserve.mlx_backend.loading.loader import EMBEDDED_MODEL_ID

    source = declaration.source
    if source is None:
        return EMBEDDED_MODEL_ID
    path = Path(os.path.expanduser(source))
    if source.lower().endswith(".gguf"):
        return path.stem
    if path.exists():
        return path.resolve().name
    return source  # a Hugging Face repo id


def model_config_of(declaration: ModelDeclaration, name: str) -> ModelConfig:
    return ModelConfig(
        model=declaration.source,
        served_model_name=name,
        keep_quantized=declaration.keep_quantized,
        tool_parser=declaration.tool_parser,
    )


class EngineModelLoader:
    """Loads a declared model into an engine of its own, and unloads it.

    Args:
        engine_config: the engine settings every model starts from (its declaration's
            ``max_total_tokens`` and the memory budget's pool bytes replace the sizes).
        metrics: the server's metrics (each loaded model's series, load counts and times).
        warmup: run a warm-up request before the model serves.
    """

    def __init__(self, engine_config: EngineConfig, metrics: Metrics, warmup: bool = True) -> None:
        self.engine_config = engine_config
        self.metrics = metrics
        self.warmup = warmup
        # Each model's loading progress (the latest load), read by /health.
        self.progress: dict[str, LoadProgress] = {}
        self._report_to: dict[str, LoadProgress] = {}
        self._lock = threading.Lock()

    def report_to(self, name: str, progress: LoadProgress) -> None:
        """Report the next load of ``name`` to ``progress`` (the start-up's bar and
        ``/health``); later loads get a progress of their own."""
        self._report_to[name] = progress

    def load(self, entry: ModelEntry, room) -> ServedModel:  # noqa: ANN001 - Callable[[int], int]
        declaration, name = entry.declaration, entry.name
        with self._lock:
            progress = self._report_to.pop(name, None) or LoadProgress(show_bar=False)
            self.progress[name] = progress
        started = time.monotonic()

        def load() -> LoadedModel:
            from mlxserve.mlx_backend.loading.loader import load_model

            loaded = load_model(declaration.source, keep_quantized=declaration.keep_quantized)
            if declaration.context_length:
                loaded.context_length = min(loaded.context_length, declaration.context_length)
            return loaded

        def engine_config_for(weights: int) -> EngineConfig:
            pool_bytes = room(weights)
            entry.resident_bytes = weights
            return dataclasses.replace(
                self.engine_config,
                max_total_tokens=declaration.max_total_tokens
                or self.engine_config.max_total_tokens,
                kv_memory_bytes=pool_bytes or self.engine_config.kv_memory_bytes,
            )

        convert = keep_quantized_note if declaration.keep_quantized else convert_for_backend
        try:
            loaded, engine = load_stages(load, engine_config_for, progress, convert, self.warmup)
        except BaseException as e:
            progress.fail(str(e))
            _release_memory()
            raise
        plan = engine.plan
        entry.resident_bytes += plan.pool_bytes if plan is not None else 0
        info = ModelInfo(
            loaded.model_id,
            loaded.tokenizer,
            loaded.context_length,
            int(loaded.config.get("vocab_size") or 0),
        )
        served = ServedModel(info, engine, model_config_of(declaration, name), name=name)
        engine.observer = self.metrics.add_model(name, served.context_length, engine.stats)
        self.metrics.model_loaded(name, time.monotonic() - started)
        progress.begin("ready")
        logger.info(
            "model %s ready: %.0f MiB resident (weights and KV pools)",
            name,
            entry.resident_bytes / 2**20,
        )
        return served

    def unload(self, model: ServedModel) -> None:
        self.metrics.remove_model(model.name)
        self.metrics.model_unloaded(model.name)
        model.engine.shutdown()
        _release_memory()


def _release_memory() -> None:
    """Give the memory of dropped models back: collect their reference cycles and empty
    MLX's buffer cache."""
    gc.collect()
    import mlx.core as mx

    mx.clear_cache()


__all__ = ["EngineModelLoader", "default_name", "model_config_of", "weight_bytes"]
