"""The executor: owns the model and the pools, runs one batched forward + sampling."""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_backend.cache_view import BatchCaches, BatchContext
from mlx_backend.kv_pool import KVPool, StatePool
from mlx_backend.layer_layout import LayerLayout, probe_layout
from mlx_backend.logits import LastTokenLogits, vocab_size
from mlx_backend.logprobs import prompt_logprobs, prompt_positions, sampled_logprobs
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
        self.vocab_size = vocab_size(model)

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """Feed the batch's new tokens, write their K/V and states, sample one token per row.

        Returns:
            the sampled token of every row (the scheduler keeps those of ``sample_rows``),
            and the logprobs the batch's rows asked for.
        """
        self.states.copy(batch.state_copies_in)
        ctx = BatchContext(batch)
        caches = BatchCaches(self.layout.specs, self.kv, self.states, ctx)
        B = batch.batch_size
        rows = np.arange(B)
        positions = batch.extend_lens - 1
        # Rows that asked for prompt logprobs also project their prompt positions, in the
        # same head call as everyone's last position.
        prompt_at = prompt_positions(batch)
        if prompt_at is not None:
            rows = np.concatenate([rows, prompt_at[0]])
            positions = np.concatenate([positions, prompt_at[1]])
        logits = self.logits.at(
            mx.array(batch.input_ids),
            caches.caches,
            mx.array(rows.astype(np.int32)),
            mx.array(positions.astype(np.int32)),
        )
        caches.write_back_states()
        self.states.copy(batch.state_snapshots)
        last_logits = logits[:B] if prompt_at is not None else logits
        tokens = self.sampler(last_logits, batch.sampling)
        pending = [sampled_logprobs(last_logits, tokens, batch.sampling.logprobs), None]
        if prompt_at is not None:
            pending[1] = prompt_logprobs(logits[B:], batch, *prompt_at)
        # NOTE: the pools are evaluated together with the tokens so the scatters are
        # materialized now, not chained lazily into the next step's graph.
        extra = [a for p in pending if p is not None for a in p.arrays()]
        mx.eval(tokens, extra, self.kv.arrays(), self.states.arrays())
        return ForwardOutput(
            next_token_ids=np.array(tokens, dtype=np.int32),
            logprobs=None if pending[0] is None else pending[0].to_numpy(),
            prompt_logprobs=None if pending[1] is None else pending[1].to_numpy(),
        )
