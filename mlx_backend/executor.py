"""The executor: owns the model and the KV pools, runs one batched forward + sampling."""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_backend.cache_view import BatchContext, PoolKVCacheView
from mlx_backend.kv_pool import AttentionLayerShape, KVPool, probe_layer_shapes
from mlx_backend.logits import LastTokenLogits
from mlx_backend.sampler import Sampler
from scheduler.batch import ForwardBatch, ForwardOutput

logger = logging.getLogger(__name__)


class Executor:
    """Runs unmodified mlx-lm models over the slot pools.

    Args:
        model: an mlx-lm model (``model(inputs, cache=[...]) -> logits``).
        pool_tokens: token slots of the KV pool.
        shapes: the per-layer K/V shapes (from ``probe_layer_shapes``).
        seed: seed of the sampling RNG.
    """

    def __init__(
        self,
        model: nn.Module,
        pool_tokens: int,
        shapes: list[AttentionLayerShape] | None = None,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.shapes = shapes if shapes is not None else probe_layer_shapes(model)
        self.kv = KVPool(pool_tokens, self.shapes)
        self.sampler = Sampler(seed)
        self.logits = LastTokenLogits(model)

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """Feed the batch's new tokens, write their K/V, sample one token per row.

        Returns:
            the sampled token of every row (the scheduler keeps those of ``sample_rows``).
        """
        ctx = BatchContext(batch)
        caches = [PoolKVCacheView(self.kv, i, ctx) for i in range(self.kv.num_layers)]
        last_pos = mx.array((batch.extend_lens - 1).astype(np.int32))
        last_logits = self.logits(mx.array(batch.input_ids), caches, last_pos)
        tokens = self.sampler(last_logits, batch.sampling)
        # NOTE: the pools are evaluated together with the tokens so the scatters are
        # materialized now, not chained lazily into the next step's graph.
        mx.eval(tokens, self.kv.k, self.kv.v)
        return ForwardOutput(next_token_ids=np.array(tokens, dtype=np.int32))
