"""Loading declared models on demand: the registry's ``ModelLoader`` (composition root).

Each load runs the same stages as the start-up load (``loading.load_stages``): weights,
conversion, engine (its KV pools sized from what the memory budget leaves once the weights
are in), warm-up. The weights of a source are loaded (and converted) once for every model
served over them (``SharedWeights``): the base model itself, LoRA adapters over it
(``adapter=DIR``: a module tree of their own over the base's arrays). What a loaded model
takes is its ``resident_bytes`` (its own weights, an adapter's, plus its KV pools) and its
``shared_bytes`` (the base's weights, which the budget counts once however many models
hold them). Unloading stops the engine, drops the model's references to its weights and
pools (the base's go with its last holder), and returns MLX's cached buffers to the system.
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
from mlxserve.mlx_backend.loading.shared_weights import SharedWeights
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
from mlxserve.server.models.entry import ModelEntry
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


def with_detected_task(declaration: ModelDeclaration) -> ModelDeclaration:
    """``declaration``, an encoder directory (BERT family: it only embeds) made an
    embedding model even when its declaration does not say ``task=embed``."""
    from mlxserve.mlx_backend.loading.encoders import encoder_model_type

    if declaration.task == "embed" or encoder_model_type(declaration.source) is None:
        return declaration
    return dataclasses.replace(declaration, task="embed")


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
        # Weights loaded once for every model over them (a base and its adapters).
        self.shared = SharedWeights()
        self._keys: dict[ServedModel, tuple] = {}

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
        key = shared_key(declaration)
        held: list[object] = []  # the shared base, once acquired
        own = [0]  # bytes of the model's own weights (an adapter's), beyond the base

        def load_base() -> LoadedModel:
            from mlxserve.mlx_backend.loading.loader import load_model

            base = load_model(
                declaration.source, keep_quantized=declaration.keep_quantized, task=declaration.task
            )
            progress.begin("conversion")
            convert = keep_quantized_note if declaration.keep_quantized else convert_for_backend
            note = convert(base)
            if note:
                logger.info("%s: conversion: %s", name, note)
            return base

        def load() -> LoadedModel:
            from mlxserve.mlx_backend.loading.adapters import with_adapter
            from mlxserve.mlx_backend.loading.shared_weights import array_ids, parameter_bytes

            base, base_bytes = self.shared.acquire(key, load_base)
            held.append(key)
            entry.shared_bytes = {repr(key): base_bytes}
            check_task(base, declaration)
            loaded = base
            if declaration.adapter:
                loaded = with_adapter(base, declaration.adapter, name)
                own[0] = parameter_bytes(loaded.model, exclude=array_ids(base.model))
            context = loaded.context_length
            if declaration.context_length:
                context = min(context, declaration.context_length)
            # A LoadedModel of its own: the base is shared, and stays as it was loaded.
            return dataclasses.replace(loaded, context_length=context)

        def engine_config_for(_: int) -> EngineConfig:
            pool_bytes = room(own[0])
            entry.resident_bytes = own[0]
            return dataclasses.replace(
                self.engine_config,
                max_total_tokens=declaration.max_total_tokens
                or self.engine_config.max_total_tokens,
                kv_memory_bytes=pool_bytes or self.engine_config.kv_memory_bytes,
            )

        embed = declaration.task == "embed"
        try:
            loaded, engine = load_stages(
                load, engine_config_for, progress, None, self.warmup, embed=embed
            )
        except BaseException as e:
            progress.fail(str(e))
            if held:
                self.shared.release(key)
            _release_memory()
            raise
        plan = engine.plan
        entry.resident_bytes += plan.pool_bytes if plan is not None else 0
        info = model_info(loaded, declaration)
        served = ServedModel(info, engine, model_config_of(declaration, name), name=name)
        self._keys[served] = key
        engine.observer = self.metrics.add_model(
            name, served.context_length, engine.stats, served.vision
        )
        self.metrics.model_loaded(name, time.monotonic() - started)
        progress.begin("ready")
        logger.info(
            "model %s ready: %.0f MiB resident (%.0f MiB its own weights and KV pools, "
            "%.0f MiB weights shared with the models of the same base)",
            name,
            (entry.resident_bytes + sum(entry.shared_bytes.values())) / 2**20,
            entry.resident_bytes / 2**20,
            sum(entry.shared_bytes.values()) / 2**20,
        )
        return served

    def unload(self, model: ServedModel) -> None:
        self.metrics.remove_model(model.name)
        self.metrics.model_unloaded(model.name)
        model.engine.shutdown()
        if model.vision is not None:
            model.vision.close()
        key = self._keys.pop(model, None)
        if key is not None:
            self.shared.release(key)
        _release_memory()


def shared_key(declaration: ModelDeclaration) -> tuple:
    """What identifies a base that models can share: where it is loaded from and how."""
    source = declaration.source
    if source is not None and os.path.exists(os.path.expanduser(source)):
        source = os.path.realpath(os.path.expanduser(source))
    return (source or "<embedded>", declaration.keep_quantized, declaration.task)


def check_task(loaded: LoadedModel, declaration: ModelDeclaration) -> None:
    """Raises: ModelLoadError when an encoder is declared to generate text."""
    from mlxserve.mlx_backend.loading.loader import ModelLoadError

    if loaded.kind == "encoder" and declaration.task != "embed":
        raise ModelLoadError(
            f"{declaration.label} is an encoder (embedding) model: declare it with task=embed"
        )
    if loaded.kind == "encoder" and declaration.adapter:
        raise ModelLoadError(f"{declaration.label}: adapters apply to decoder models only")


def model_info(loaded: LoadedModel, declaration: ModelDeclaration) -> ModelInfo:
    """What the routes need to know of a loaded model (its task and embedding sizes)."""
    config = loaded.config
    text = config.get("text_config") or {}
    dims = int(config.get("hidden_size") or text.get("hidden_size") or 0)
    matryoshka: tuple[int, ...] | None = None
    listed = config.get("matryoshka_dimensions")
    if declaration.matryoshka or (declaration.matryoshka is None and listed):
        matryoshka = tuple(int(d) for d in listed or ())
    elif declaration.matryoshka is None and config.get("is_matryoshka"):
        matryoshka = ()
    return ModelInfo(
        loaded.model_id,
        loaded.tokenizer,
        loaded.context_length,
        int(config.get("vocab_size") or text.get("vocab_size") or 0),
        task=declaration.task,
        embedding_dims=dims,
        matryoshka_dims=matryoshka,
        vision=loaded.vision,
    )


def _release_memory() -> None:
    """Give the memory of dropped models back: collect their reference cycles and empty
    MLX's buffer cache."""
    gc.collect()
    import mlx.core as mx

    mx.clear_cache()


__all__ = ["EngineModelLoader", "default_name", "model_config_of", "weight_bytes"]
