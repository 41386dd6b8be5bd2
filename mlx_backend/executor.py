"""The MLX executor: owns the model and the pools, runs one batched forward + sampling.

It implements the engine's ``Executor`` protocol (``scheduler/executor.py``): numpy
batches in, numpy tokens out; MLX arrays never leave this package.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from mlxserve.mlx_backend.cpu.blas import adaptive_thread_control
from mlxserve.mlx_backend.cpu.blas_threads import AdaptiveBlasThreads
from mlxserve.mlx_backend.kv import attention_dispatch
from mlxserve.mlx_backend.kv.cache_view import BatchCaches, BatchContext
from mlxserve.mlx_backend.kv.kv_pool import KVPool, StatePool
from mlxserve.mlx_backend.kv.layer_layout import LayerLayout, probe_layout, probe_quantized_sdpa
from mlxserve.mlx_backend.kv.quantization import (
    ATTENTION_PATHS,
    AttentionPath,
    KVQuantization,
    default_attention_path,
)
from mlxserve.mlx_backend.logits import LastTokenLogits, vocab_size
from mlxserve.mlx_backend.logprobs import prompt_logprobs, prompt_positions, sampled_logprobs
from mlxserve.mlx_backend.memory import plan_memory
from mlxserve.mlx_backend.sampler import Sampler
from mlxserve.scheduler.batch import ForwardBatch, ForwardOutput
from mlxserve.scheduler.memory_plan import MemoryPlan, MemoryStats, PoolRequest

logger = logging.getLogger(__name__)

_ATTENTION_LOG = {
    "quantized-sdpa": "mlx-lm's quantized SDPA on the packed K/V",
    "dequantize": "gathered K/V dequantized, then the model's dense SDPA",
    "folded": "mlxserve's attention on the packed K/V, scales and biases folded into "
    "the scores (calls it does not cover dequantize)",
}


class MLXExecutor:
    """Runs unmodified mlx-lm models over the slot pools.

    Built on any thread; ``plan``, ``allocate``, ``forward`` and ``close`` run on the
    engine thread (MLX streams are per thread, and the pools must live on the thread that
    writes them).

    Args:
        model: an mlx-lm model (``model(inputs, cache=[...]) -> logits``).
        seed: seed of the sampling RNG.
        kv_attention: how attention reads quantized K/V pools (None: the faster path of
            this backend, ``default_attention_path``); a model that cannot run mlx-lm's
            quantized SDPA (attention sinks, its own attention code) dequantizes instead.
    """

    def __init__(
        self, model: nn.Module, seed: int = 0, kv_attention: AttentionPath | None = None
    ) -> None:
        if kv_attention is not None and kv_attention not in ATTENTION_PATHS:
            raise ValueError(f"kv_attention must be one of {ATTENTION_PATHS}, got {kv_attention!r}")
        self.model = model
        self.seed = seed
        self.kv_attention = kv_attention
        self.quantization: KVQuantization | None = None
        self.attention: AttentionPath = "dequantize"
        self.layout: LayerLayout | None = None
        self.kv: KVPool | None = None
        self.states: StatePool | None = None
        self.sampler: Sampler | None = None
        self.logits: LastTokenLogits | None = None
        self.blas_threads: AdaptiveBlasThreads | None = None
        self._vocab_size = 0

    @property
    def vocab_size(self) -> int:
        """The width of the model's logits (known once the pools are allocated)."""
        if not self._vocab_size:
            raise RuntimeError("the executor has not been allocated yet")
        return self._vocab_size

    def materialize(self) -> None:
        # NOTE: MLX streams are per thread. A lazy array the model built at load time (e.g.
        # a slope table kept in a private attribute) evaluated on the engine thread fails
        # with "There is no Stream(cpu, 0) in current thread", so materialize every array
        # reachable from the model here, on the thread that built it.
        mx.eval([a for _, a in tree_flatten(self.model) if isinstance(a, mx.array)])

    def plan(self, request: PoolRequest) -> MemoryPlan:
        """Probe the model's caches (one token through mlx-lm's own) and size the pools.

        Raises:
            ValueError: ``kv_group_size`` does not divide the model's K/V head dims.
        """
        self.layout = probe_layout(self.model)
        self.quantization = None
        if request.kv_bits is not None:
            self.quantization = KVQuantization(request.kv_bits, request.kv_group_size)
            self.layout.check_quantization(self.quantization)
            self.attention = self._attention_path(self.quantization)
        return plan_memory(
            self.layout,
            request.max_total_tokens,
            request.max_running_requests,
            request.max_prefill_tokens,
            request.mem_fraction,
            request.context_length,
            prefix_cache=request.prefix_cache,
            quantization=self.quantization,
        )

    def _attention_path(self, quantization: KVQuantization) -> AttentionPath:
        path = self.kv_attention or default_attention_path()
        if path == "quantized-sdpa":
            failure = probe_quantized_sdpa(self.model, quantization)
            if failure is not None:
                logger.warning(
                    "this model cannot run mlx-lm's quantized attention (%s); "
                    "quantized K/V is dequantized for a dense attention instead",
                    failure,
                )
                path = "dequantize"
        if path == "folded" and not attention_dispatch.install(self.model):
            logger.warning(
                "this model's attention does not call mlx-lm's scaled_dot_product_attention; "
                "quantized K/V is dequantized for it"
            )
            path = "dequantize"
        return path

    def allocate(self, plan: MemoryPlan) -> None:
        if self.layout is None:
            self.layout = probe_layout(self.model)
        layout = self.layout
        quant = self.quantization
        self.kv = KVPool(layout, plan.full_tokens, plan.sliding_tokens, quant)
        self.states = StatePool(layout, plan.state_slots)
        self.sampler = Sampler(self.seed)
        self.logits = LastTokenLogits(self.model)
        self._vocab_size = vocab_size(self.model)
        control = adaptive_thread_control()
        self.blas_threads = None if control is None else AdaptiveBlasThreads(*control)
        if self.blas_threads is not None:
            logger.info(
                "OpenBLAS threads: %d, fewer while other processes keep CPUs busy",
                self.blas_threads.threads,
            )
        mib = 2**-20
        logger.info(
            "KV pools (%s): %d full-attention slots (%.1f MiB), %d sliding-window slots "
            "(window %s, %.1f MiB), %d recurrent-state slots (%.1f MiB)",
            "float" if quant is None else quant.describe(),
            plan.full_tokens,
            plan.full_tokens * layout.bytes_per_token("full", quant) * mib,
            plan.sliding_tokens,
            plan.window,
            plan.sliding_tokens * layout.bytes_per_token("sliding", quant) * mib,
            plan.state_slots,
            plan.state_slots * layout.bytes_per_state_slot * mib,
        )
        if quant is not None:
            logger.info("quantized K/V attention: %s", _ATTENTION_LOG[self.attention])

    def memory(self) -> MemoryStats:
        return MemoryStats(mx.get_active_memory(), mx.get_peak_memory(), mx.get_cache_memory())

    def close(self) -> None:
        """Drop the pools (freed here, on the engine thread) and wait for MLX to finish."""
        self.kv = None
        self.states = None
        mx.synchronize()

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """Feed the batch's new tokens, write their K/V and states, sample one token per row.

        The rows run as one forward per row group (``batch.row_groups``), each padded only
        to its own longest row; their logits are put back in row order and sampled together.

        Returns:
            the sampled token of every row (the scheduler keeps those of ``sample_rows``),
            and the logprobs the batch's rows asked for.
        """
        if self.blas_threads is not None:
            self.blas_threads.update()
        self.states.copy(batch.state_copies_in)
        # Rows that asked for prompt logprobs also project their prompt positions, in the
        # same head call as their group's last positions.
        prompt_at = prompt_positions(batch)
        groups = batch.row_groups or (np.arange(batch.batch_size),)
        last, prompt, prompt_entries = [], [], []
        for rows in groups:
            group_last, group_prompt, entries = self._forward_rows(batch, rows, prompt_at)
            if len(groups) > 1:
                # NOTE: one graph holding every group's forward evaluates slower than the
                # forwards one after another (measured: a decode step of a 2,000-token row
                # and 31 short ones, 890 ms vs 740 ms): each forward's K/V gathers and
                # activations stay hot and are freed before the next one starts.
                mx.eval(group_last, [] if group_prompt is None else group_prompt)
            last.append(group_last)
            if entries is not None:
                prompt.append(group_prompt)
                prompt_entries.append(entries)
        last_logits = _in_order(last, groups)
        self.states.copy(batch.state_snapshots)
        tokens = self.sampler(last_logits, batch.sampling)
        pending = [sampled_logprobs(last_logits, tokens, batch.sampling.logprobs), None]
        if prompt_at is not None:
            pending[1] = prompt_logprobs(_in_order(prompt, prompt_entries), batch, *prompt_at)
        # NOTE: the pools are evaluated together with the tokens so the scatters are
        # materialized now, not chained lazily into the next step's graph.
        extra = [a for p in pending if p is not None for a in p.arrays()]
        mx.eval(tokens, extra, self.kv.arrays(), self.states.arrays())
        return ForwardOutput(
            next_token_ids=np.array(tokens, dtype=np.int32),
            logprobs=None if pending[0] is None else pending[0].to_numpy(),
            prompt_logprobs=None if pending[1] is None else pending[1].to_numpy(),
        )

    def _forward_rows(
        self,
        batch: ForwardBatch,
        rows: np.ndarray,
        prompt_at: tuple[np.ndarray, np.ndarray] | None,
    ) -> tuple[mx.array, mx.array | None, np.ndarray | None]:
        """One forward of ``rows``: the logits of their last positions and, when some of
        them asked, of their prompt positions (with the indices of those entries in
        ``prompt_at``)."""
        ctx = BatchContext(batch, rows)
        caches = BatchCaches(self.layout.specs, self.kv, self.states, ctx, self.attention)
        n = len(rows)
        pick_rows = np.arange(n)
        pick_positions = batch.extend_lens[rows] - 1
        entries = None
        if prompt_at is not None:
            local = np.full(batch.batch_size, -1)
            local[rows] = np.arange(n)
            entries = np.nonzero(local[prompt_at[0]] >= 0)[0]
            pick_rows = np.concatenate([pick_rows, local[prompt_at[0][entries]]])
            pick_positions = np.concatenate([pick_positions, prompt_at[1][entries]])
        logits = self.logits.at(
            ctx.input_ids,
            caches.caches,
            mx.array(pick_rows.astype(np.int32)),
            mx.array(pick_positions.astype(np.int32)),
        )
        caches.write_back_states()
        if entries is None:
            return logits, None, None
        return logits[:n], logits[n:], entries


def _in_order(parts: list[mx.array], indices) -> mx.array:  # noqa: ANN001
    """Concatenate ``parts`` (part ``k`` holds the entries ``indices[k]``) in entry order."""
    if len(parts) == 1:
        # One part holds every entry; it is in order unless a single group was reordered.
        order = np.asarray(indices[0])
        if np.array_equal(order, np.arange(len(order))):
            return parts[0]
    order = np.concatenate([np.asarray(i) for i in indices])
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    return mx.concatenate(parts)[mx.array(inverse.astype(np.int32))]
