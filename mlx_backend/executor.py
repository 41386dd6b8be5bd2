"""The MLX executor: owns the model and the pools, runs one batched forward + sampling.

It implements the engine's ``Executor`` protocol (``scheduler/executor.py``): numpy
batches in, numpy tokens out; MLX arrays never leave this package.
"""

from __future__ import annotations

import dataclasses
import logging

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from mlxserve.mlx_backend.attention.dispatch import AttentionPlan, install_dispatch, plan_attention
from mlxserve.mlx_backend.cpu.blas_threads import AdaptiveBlasThreads
from mlxserve.mlx_backend.cpu.thread_policy import cpu_thread_policy
from mlxserve.mlx_backend.kv.cache_view import BatchCaches, BatchContext
from mlxserve.mlx_backend.kv.kv_pool import KVPool, StatePool
from mlxserve.mlx_backend.kv.layer_layout import LayerLayout, probe_layout, probe_quantized_sdpa
from mlxserve.mlx_backend.kv.packed_context import PackedBatchContext
from mlxserve.mlx_backend.kv.quantization import (
    ATTENTION_PATHS,
    AttentionPath,
    KVQuantization,
    default_attention_path,
)
from mlxserve.mlx_backend.logits import LastTokenLogits, vocab_size
from mlxserve.mlx_backend.logprobs import prompt_logprobs, prompt_positions, sampled_logprobs
from mlxserve.mlx_backend.memory import plan_memory
from mlxserve.mlx_backend.native_ops import NativeOpsPlan, plan_native_ops
from mlxserve.mlx_backend.sampler import Sampler
from mlxserve.mlx_backend.spec_verify import VerifyEntries
from mlxserve.mlx_backend.step_output import GroupOutput, LaunchedStep, in_order
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
        self.quantized_attention: AttentionPath = "dequantize"
        self.layout: LayerLayout | None = None
        self.kv: KVPool | None = None
        self.states: StatePool | None = None
        self.sampler: Sampler | None = None
        self.logits: LastTokenLogits | None = None
        self.blas_threads: AdaptiveBlasThreads | None = None
        self.attention: AttentionPlan | None = None
        self.native_ops: NativeOpsPlan | None = None
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
        """Probe the model's caches (one token through mlx-lm's own), decide each attention
        layer's path and size the pools.

        Raises:
            ValueError: ``kv_group_size`` does not divide the model's K/V head dims.
        """
        self.layout = probe_layout(self.model)
        self.quantization = None
        if request.kv_bits is None:
            self.attention = plan_attention(self.model, self.layout)
        else:
            self.quantization = KVQuantization(request.kv_bits, request.kv_group_size)
            self.layout.check_quantization(self.quantization)
            self.quantized_attention = self._quantized_path(self.quantization)
            self.attention = self._quantized_plan(self.quantization)
        ragged = self._all_ragged()
        plan = plan_memory(
            self.layout,
            request.max_total_tokens,
            request.max_running_requests,
            request.max_prefill_tokens,
            request.mem_fraction,
            request.context_length,
            prefix_cache=request.prefix_cache,
            memory_bytes=request.memory_bytes,
            quantization=self.quantization,
            extra_bytes_per_token=request.extra_bytes_per_token,
        )
        return dataclasses.replace(plan, ragged_attention=ragged)

    def _quantized_path(self, quantization: KVQuantization) -> AttentionPath:
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
        if path == "folded" and not install_dispatch(self.model):
            logger.warning(
                "this model's attention does not call mlx-lm's scaled_dot_product_attention; "
                "quantized K/V is dequantized for it"
            )
            path = "dequantize"
        return path

    def _quantized_plan(self, quantization: KVQuantization) -> AttentionPlan:
        """Quantized pools on the CPU's "folded" path: the native op (in-kernel
        dequantization) serves the layers it can, so with every layer on it steps run packed
        and unsplit as over float pools; the other layers, and every layer on another path
        (Metal's quantized SDPA, a path asked for by name), keep ``quantized_attention``."""
        described = _ATTENTION_LOG[self.quantized_attention]
        if self.quantized_attention != "folded":
            return AttentionPlan(frozenset(), f"quantized K/V pools: {described}")
        plan = plan_attention(self.model, self.layout, quantization)
        if not plan.ragged_layers:
            path = f"quantized K/V pools: {described} ({plan.path})"
            return AttentionPlan(frozenset(), path, plan.fallbacks)
        path = f"quantized K/V pools: {plan.path}"
        if plan.fallbacks:
            path += f"; the other layers: {described}"
        return dataclasses.replace(plan, path=path)

    def allocate(self, plan: MemoryPlan) -> None:
        if self.layout is None:
            self.layout = probe_layout(self.model)
        layout = self.layout
        quant = self.quantization
        self.kv = KVPool(layout, plan.full_tokens, plan.sliding_tokens, quant)
        self.states = StatePool(layout, plan.state_slots)
        self.sampler = Sampler(self.seed)
        self.native_ops = plan_native_ops(self.model)
        self.logits = LastTokenLogits(self.model, self.native_ops.active)
        self._vocab_size = vocab_size(self.model, self.native_ops.active)
        if self.attention is None:
            self.attention = plan_attention(self.model, layout)
        self.blas_threads = cpu_thread_policy()
        logger.info("attention: %s; elementwise: %s", self.attention.path, self.native_ops.path)
        for index, why in sorted(self.attention.fallbacks.items()):
            logger.info("attention layer %d does not take the native op: %s", index, why)
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

    def _all_ragged(self) -> bool:
        specs = self.layout.attention
        if hasattr(self.model, "image_inputs"):
            # A vision model's image features and M-RoPE positions are laid out per batch
            # row (``_model_inputs``), so its rows are never packed. (mlx-vlm's models call
            # mlx-vlm's own SDPA, which the dispatch does not rebind: no layer is ragged.)
            return False
        return bool(specs) and self.attention.ragged_layers == {s.pool_index for s in specs}

    @property
    def packs_prefill(self) -> bool:
        """Prefill batches run packed into one-token rows (``kv/packed_context.py``): every
        attention layer is ragged and no layer is recurrent."""
        return self.layout is not None and not self.layout.recurrent and self._all_ragged()

    def memory(self) -> MemoryStats:
        return MemoryStats(mx.get_active_memory(), mx.get_peak_memory(), mx.get_cache_memory())

    def close(self) -> None:
        """Drop the pools and the model (freed here, on the engine thread, unless someone
        else still holds the model) and wait for MLX to finish."""
        self.kv = None
        self.states = None
        self.logits = None
        self.model = None
        mx.synchronize()

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """Feed the batch's new tokens, write their K/V and states, sample one token per row.

        The rows run as one forward per row group (``batch.row_groups``), each padded only
        to its own longest row; their logits are put back in row order and sampled together.
        Rows of ``batch.embed_rows`` also return their last position's final hidden state;
        a batch of such rows only (an embedding model's) projects and samples nothing.

        Returns:
            the sampled token of every row (the scheduler keeps those of ``sample_rows``),
            the logprobs the batch's rows asked for, and the embedding rows' hidden states.
        """
        step = self._step_graph(batch)
        mx.eval(step.arrays(), self.kv.arrays(), self.states.arrays())
        return step.output()

    @property
    def overlaps_by_default(self) -> bool:
        """Whether the engine should overlap decode steps (``launch``) when not told: on a
        GPU the next step's graph is built while the GPU computes; on the CPU backend the
        building and the forward share the cores (measured on 2 CPUs: no faster, 3% slower
        at concurrency 32 through the server)."""
        return mx.default_device().type != mx.cpu

    def launch(
        self,
        batch: ForwardBatch,
        after: LaunchedStep | None = None,
        after_rows: np.ndarray | None = None,
    ) -> LaunchedStep:
        """Start a decode step without waiting for it: its graph is built and handed to
        MLX (``mx.async_eval``) and ``result()`` waits. Given ``after``, a step launched
        before and not yet collected, row ``i`` feeds the token that step samples for its
        row ``after_rows[i]`` (all its rows in order by default) instead of
        ``batch.input_ids``: the next step is built while this one computes, as mlx-lm's
        generation loop overlaps its graph building with the evaluation."""
        assert batch.phase == "decode" and batch.spec_lens is None and batch.embed_rows is None
        fed = None
        if after is not None:
            fed = after.tokens if after_rows is None else after.tokens[mx.array(after_rows)]
            fed = fed[:, None]
        step = self._step_graph(batch, fed)
        mx.async_eval(step.arrays(), self.kv.arrays(), self.states.arrays())
        return step

    def _step_graph(self, batch: ForwardBatch, input_ids: mx.array | None = None) -> LaunchedStep:
        """The lazy graph of ``forward``: every row group's forward and the sampling
        (``input_ids``, ``[B, 1]``, replaces the batch's own tokens)."""
        if self.blas_threads is not None:
            self.blas_threads.update()
        self.states.copy(batch.state_copies_in)
        embed_rows = batch.embed_rows
        sample = embed_rows is None or not bool(embed_rows.all())
        # Rows that asked for prompt logprobs also project their prompt positions, in the
        # same head call as their group's last positions.
        prompt_at = prompt_positions(batch) if sample else None
        # Rows with proposals feed several tokens: they pack like prefill chunks.
        entries = VerifyEntries(batch) if batch.spec_lens is not None else None
        packed = (batch.phase == "prefill" or entries is not None) and self.packs_prefill
        groups = (np.arange(batch.batch_size),) if packed else batch.row_groups
        groups = groups or (np.arange(batch.batch_size),)
        parts = []
        for rows in groups:
            fed = None
            if input_ids is not None:
                fed = input_ids if len(groups) == 1 else input_ids[mx.array(rows)]
            part = self._forward_rows(
                batch, rows, prompt_at, sample, embed_rows is not None, packed, entries, fed
            )
            if len(groups) > 1:
                # NOTE: one graph holding every group's forward evaluates slower than the
                # forwards one after another (measured: a decode step of a 2,000-token row
                # and 31 short ones, 890 ms vs 740 ms): each forward's K/V gathers and
                # activations stay hot and are freed before the next one starts.
                mx.eval(part.arrays())
            parts.append(part)
        self.states.copy(batch.state_snapshots)
        hidden = None
        if embed_rows is not None:
            hidden = in_order([p.hidden for p in parts], groups).astype(mx.float32)
        if not sample:
            return LaunchedStep(batch.batch_size, None, (None, None), hidden, None)
        # One logits row per row (its last position), or per entry with proposals.
        picked = groups if entries is None else [entries.of_rows(g) for g in groups]
        last_logits = in_order([p.logits for p in parts], picked)
        sampling = batch.sampling if entries is None else entries.expand(batch.sampling)
        tokens = self.sampler(last_logits, sampling)
        pending = [sampled_logprobs(last_logits, tokens, sampling.logprobs), None]
        if prompt_at is not None:
            asked = [p for p in parts if p.prompt_entries is not None]
            logits = in_order([p.prompt_logits for p in asked], [p.prompt_entries for p in asked])
            pending[1] = prompt_logprobs(logits, batch, *prompt_at)
        return LaunchedStep(batch.batch_size, tokens, tuple(pending), hidden, entries)

    def _forward_rows(
        self,
        batch: ForwardBatch,
        rows: np.ndarray,
        prompt_at: tuple[np.ndarray, np.ndarray] | None,
        sample: bool = True,
        embed: bool = False,
        packed: bool = False,
        entries: VerifyEntries | None = None,
        input_ids: mx.array | None = None,
    ) -> GroupOutput:
        """One forward of ``rows`` (padded, or packed into one-token rows): the logits of
        their last positions (with ``sample``; of every verified position of rows with
        proposals, given ``entries``) and, when some of them asked, of their prompt
        positions (with the indices of those entries in ``prompt_at``); with ``embed`` the
        last positions' hidden states too. ``input_ids`` (lazy, ``[len(rows), 1]``)
        replaces the rows' tokens of the batch."""
        ctx = PackedBatchContext(batch, rows) if packed else BatchContext(batch, rows)
        if input_ids is not None:
            ctx.input_ids = input_ids
        caches = BatchCaches(
            self.layout.specs,
            self.kv,
            self.states,
            ctx,
            self.attention.ragged_layers,
            self.quantized_attention,
        )
        n = len(rows)
        pick_rows = np.arange(n)
        pick_positions = batch.extend_lens[rows] - 1
        last = pick_rows
        if entries is not None:
            mine = entries.of_rows(rows)
            pick_rows = np.repeat(pick_rows, entries.count[rows])
            pick_positions = entries.position[mine]
            last = np.cumsum(entries.count[rows]) - 1
            n = len(mine)
        asked = None
        if prompt_at is not None:
            local = np.full(batch.batch_size, -1)
            local[rows] = np.arange(len(rows))
            asked = np.nonzero(local[prompt_at[0]] >= 0)[0]
            pick_rows = np.concatenate([pick_rows, local[prompt_at[0][asked]]])
            pick_positions = np.concatenate([pick_positions, prompt_at[1][asked]])
        if packed:
            # Row b's position i is packed row first[b] + i, of width 1.
            pick_rows = ctx.packed_index(pick_rows, pick_positions)
            pick_positions = np.zeros_like(pick_rows)
        picks = (
            ctx.input_ids,
            caches.caches,
            mx.array(pick_rows.astype(np.int32)),
            mx.array(pick_positions.astype(np.int32)),
        )
        extra = self._model_inputs(batch, rows, ctx)
        hidden = None
        if embed:
            hidden, logits = self.logits.hidden_and_logits(*picks, logits=sample, **extra)
            hidden = hidden[:n] if entries is None else hidden[mx.array(last.astype(np.int32))]
        else:
            logits = self.logits.at(*picks, **extra)
        caches.write_back_states()
        if logits is None or asked is None:
            return GroupOutput(logits, None, None, hidden)
        return GroupOutput(logits[:n], logits[n:], asked, hidden)

    def _model_inputs(
        self, batch: ForwardBatch, rows: np.ndarray, ctx: BatchContext
    ) -> dict[str, mx.array]:
        """A vision model's extra inputs for ``rows``: the token embeddings with the image
        placeholders' features written over them (only when a chunk feeds an image), and
        explicit positions for an M-RoPE model. Nothing for an mlx-lm model."""
        extra: dict[str, mx.array] = {}
        if not getattr(self.model, "explicit_positions", False) and (
            batch.image_embeddings is None
        ):
            return extra
        L = ctx.input_ids.shape[1]
        if getattr(self.model, "explicit_positions", False):
            if batch.position_ids is not None:
                positions = batch.position_ids[:, rows, :L]
            else:
                index = batch.computed_lens[rows, None] + np.arange(L, dtype=np.int32)
                positions = np.broadcast_to(index[None], (3, len(rows), L))
            extra["position_ids"] = mx.array(np.ascontiguousarray(positions, np.int32))
        images = batch.image_embeddings
        if images is not None:
            local = np.full(batch.batch_size, -1, np.int64)
            local[rows] = np.arange(len(rows))
            mine = np.nonzero(local[images.rows] >= 0)[0]
            if len(mine):
                at_rows, at_cols = local[images.rows[mine]], images.columns[mine]
                # Row-major order: deepstack models add their vectors in mask order.
                order = np.lexsort((at_cols, at_rows))
                extra |= self.model.image_inputs(
                    ctx.input_ids,
                    mx.array(at_rows[order].astype(np.int32)),
                    mx.array(at_cols[order].astype(np.int32)),
                    mx.array(images.features[mine[order]]),
                )
        return extra
