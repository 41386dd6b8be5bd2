"""The composition root of an engine: an MLX executor for a loaded model, handed to the
numpy-only engine (``scheduler/engine.py``), or for an encoder model to the encoder engine
(``scheduler/encoder_engine.py``). In a tensor- or pipeline-parallel group, the model is split first
and rank 0's executor drives the other ranks (``mlx_backend/distributed/``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlxserve.mlx_backend.encoder_executor import MLXEncoderExecutor
from mlxserve.mlx_backend.executor import MLXExecutor
from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.config import EngineConfig
from mlxserve.scheduler.encoder_engine import EncoderEngine
from mlxserve.scheduler.engine import Engine
from mlxserve.server.lifecycle.draft_model import draft_model_for

if TYPE_CHECKING:
    from mlxserve.mlx_backend.distributed.group import Group


def build_engine(
    loaded: LoadedModel,
    config: EngineConfig,
    group: Group | None = None,
    draft: LoadedModel | None = None,
) -> Engine | EncoderEngine:
    """An engine (not started) serving ``loaded`` with ``config``'s sizes; with ``group``
    (rank 0 of a tensor-parallel group) over this rank's shard, in lock step with the
    other ranks. With ``--speculative-method draft`` the draft model (``draft``, else
    loaded from ``config.draft_model``) runs beside it.

    Raises:
        ValueError: ``group`` is given for a model that cannot be sharded over it, or
            the draft model does not fit the served model.
    """
    if loaded.kind == "encoder":
        if group is not None:
            raise ValueError("encoder models are not served tensor-parallel")
        executor = MLXEncoderExecutor(loaded.model, loaded.pooling or "model")
        return EncoderEngine(executor, config, context_length=loaded.context_length)
    if group is not None and config.speculative_method == "draft":
        raise ValueError("--speculative-method draft is not served tensor-parallel")
    tokenizer = loaded.tokenizer
    drafter = draft_model_for(loaded, config, draft)
    executor = MLXExecutor(loaded.model, seed=config.seed)
    if group is not None:
        from mlxserve.mlx_backend.distributed.executor import DistributedExecutor
        from mlxserve.mlx_backend.distributed.sharding import split_model

        collectives = split_model(loaded.model, group.group, group.split)
        executor = DistributedExecutor(executor, group, collectives, group.all_sum_seconds)
    engine = Engine(
        executor,
        config,
        context_length=loaded.context_length,
        eos_token_ids=getattr(tokenizer, "eos_token_ids", None) or (),
        tokenizer=tokenizer,
        draft=drafter,
    )
    if group is not None:
        executor.on_lost = engine.fail
    return engine
