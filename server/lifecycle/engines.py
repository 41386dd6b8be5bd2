"""The composition root of an engine: an MLX executor for a loaded model, handed to the
numpy-only engine (``scheduler/engine.py``), or for an encoder model to the encoder engine
(``scheduler/encoder_engine.py``)."""

from __future__ import annotations

from mlxserve.mlx_backend.encoder_executor import MLXEncoderExecutor
from mlxserve.mlx_backend.executor import MLXExecutor
from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.config import EngineConfig
from mlxserve.scheduler.encoder_engine import EncoderEngine
from mlxserve.scheduler.engine import Engine


def build_engine(loaded: LoadedModel, config: EngineConfig) -> Engine | EncoderEngine:
    """An engine (not started) serving ``loaded`` with ``config``'s sizes."""
    if loaded.kind == "encoder":
        executor = MLXEncoderExecutor(loaded.model, loaded.pooling or "model")
        return EncoderEngine(executor, config, context_length=loaded.context_length)
    tokenizer = loaded.tokenizer
    return Engine(
        MLXExecutor(loaded.model, seed=config.seed),
        config,
        context_length=loaded.context_length,
        eos_token_ids=getattr(tokenizer, "eos_token_ids", None) or (),
        tokenizer=tokenizer,
    )
