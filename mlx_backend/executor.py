"""The executor: owns the model and the pools, runs one batched forward + sampling."""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_backend.cache_view import BatchCaches, BatchContext
from mlx_backend.kv_pool import KVPool, StatePool
from mlx_backend.layer_layout import LayerLayout, probe_layout
from mlx_backend.logits import LastTokenLogits
from mlx_backend.sampler import Sampler
from scheduler.batch import ForwardBatch, ForwardOutput
from scheduler.memory_plan import MemoryPlan

logger = logging.getLogger(__name__)


class Executor:
    """Runs unmodified mlx-lm models over the slot pools.

    Args:
        model: an mlx-lm model (``model(inputs, cache=[...]) -> logits``).
        plan: how many slots of each kind to allocate.
        layout: the model's caches (from ``probe_layout``).
        seed: seed of the sampling RNG.
    """

    def __init__(
        self,
        model: nn.Module,
        plan: MemoryPlan,
        layout: LayerLayout | None = None,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.layout = layout if layout is not None else probe_layout(model)
        self.kv = KVPool(self.layout, plan.full_tokens, plan.sliding_tokens)
        self.states = StatePool(self.layout, plan.state_slots)
        self.sampler = Sampler(seed)
        self.logits = LastTokenLogits(model)

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """Feed the batch's new tokens, write their K/V and states, sample one token per row.

        Returns:
            the sampled token of every row (the scheduler keeps those of ``sample_rows``).
        """
        ctx = BatchContext(batch)
        caches = BatchCaches(self.layout.specs, self.kv, self.states, ctx)
        last_pos = mx.array((batch.extend_lens - 1).astype(np.int32))
        last_logits = self.logits(mx.array(batch.input_ids), caches.caches, last_pos)
        caches.write_back_states()
        tokens = self.sampler(last_logits, batch.sampling)
        # NOTE: the pools are evaluated together with the tokens so the scatters are
        # materialized now, not chained lazily into the next step's graph.
        mx.eval(tokens, self.kv.arrays(), self.states.arrays())
        return ForwardOutput(next_token_ids=np.array(tokens, dtype=np.int32))
