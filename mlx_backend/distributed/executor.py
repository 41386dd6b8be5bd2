"""Rank 0's executor: the engine's ``Executor`` over a group of ranks.

Each call is sent to every other rank first (``wire``), then run here; every rank runs the
same plan (layout probe), allocation and forwards over its own shard and pools, so they
issue the same collectives in the same order. Only rank 0 samples. A lost rank (its
control connection closes, or a collective fails) makes every later call raise
``ExecutorFailed``, which stops the engine.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import NoReturn

from mlxserve.mlx_backend.distributed import wire
from mlxserve.mlx_backend.distributed.group import Group
from mlxserve.mlx_backend.distributed.mlx_thread import MLXThread, result_unless
from mlxserve.mlx_backend.executor import MLXExecutor
from mlxserve.scheduler.batch import ForwardBatch, ForwardOutput
from mlxserve.scheduler.memory_plan import MemoryPlan, MemoryStats, PoolRequest
from mlxserve.scheduler.outputs import ExecutorFailed

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistributedStats:
    """Counters of the group (read by ``/metrics`` from any thread).

    Attributes:
        ranks: processes in the group.
        steps: forwards run.
        forward_seconds: time rank 0 spent in forwards (model, collectives, sampling).
        send_seconds: time spent sending batches to the other ranks.
        collectives_per_step: collectives of the last forward (tensor parallel: two
            all_sums per layer per row group).
        collective_seconds: estimated time of those collectives, summed over the steps
            (count x the all_sum latency measured at start-up for the step's activations).
    """

    ranks: int
    steps: int = 0
    forward_seconds: float = 0.0
    send_seconds: float = 0.0
    collectives_per_step: int = 0
    collective_seconds: float = 0.0


class DistributedExecutor:
    """Runs ``local`` (this rank's shard) in lock step with the other ranks' workers.

    Args:
        local: rank 0's own executor over its shard.
        group: the formed group (its ``workers`` sockets).
        collectives_per_forward: collectives one forward of one row group issues
            (``split_model``: 2 per layer when sharded).
        all_sum_seconds: ``f(bytes) -> seconds`` of one all_sum (start-up measurement), for
            the collective-time estimate; None: not estimated.
        on_lost: called once, from a monitor thread, when a rank is lost while idle
            (``Engine.fail``).
    """

    def __init__(
        self,
        local: MLXExecutor,
        group: Group,
        collectives_per_forward: int = 0,
        all_sum_seconds: Callable[[int], float] | None = None,
        on_lost: Callable[[str], None] | None = None,
    ) -> None:
        self.local = local
        self.group = group
        self.on_lost = on_lost
        self.collectives_per_forward = collectives_per_forward
        self.hidden_bytes = 0
        self._all_sum_seconds = all_sum_seconds
        self._lost: str | None = None
        self._lock = threading.Lock()
        self._stats = DistributedStats(group.size)
        self._closing = False
        self._mlx = MLXThread("mlxserve-rank0-mlx")
        # Fails (ExecutorFailed) when the group breaks: a call waiting on the MLX thread
        # stops waiting then.
        self._broken: Future = Future()
        # Started once the set-up replies are read: from then on a worker only ever
        # writes to report its own failure, and a closed connection means a lost rank.
        self._monitor = threading.Thread(
            target=self._watch, name="mlxserve-rank-monitor", daemon=True
        )

    # ------------------------------------------------------------ Executor protocol
    @property
    def vocab_size(self) -> int:
        return self.local.vocab_size

    @property
    def stats(self) -> DistributedStats:
        return self._stats

    @property
    def lost(self) -> str | None:
        """Why the group is broken (None while every rank is there)."""
        return self._lost

    def materialize(self) -> None:
        self.local.materialize()

    def plan(self, request: PoolRequest) -> MemoryPlan:
        """Every rank probes its layout and sizes its pools; all take the smallest plan
        (``smallest_plan``: the rank with the least free memory decides)."""
        self._broadcast(wire.Kind.PLAN, wire.encode_pool_request(request))
        mine = self._mlx.submit(lambda: self.local.plan(request))
        plans = [wire.decode_plan(self._reply(r, wire.Kind.PLANNED)) for r in self._ranks()]
        plans.insert(0, self._wait(mine, "plan"))
        chosen = smallest_plan(plans)
        logger.info("memory plan of %d ranks: %s", self.group.size, [p.full_tokens for p in plans])
        return chosen

    def allocate(self, plan: MemoryPlan) -> None:
        self._broadcast(wire.Kind.ALLOCATE, wire.encode_plan(plan))
        mine = self._mlx.submit(lambda: self.local.allocate(plan))
        for r in self._ranks():
            self._reply(r, wire.Kind.ALLOCATED)
        self._wait(mine, "allocation")
        self.hidden_bytes = _hidden_bytes(self.local)
        self._monitor.start()

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        started = time.perf_counter()
        self._broadcast(wire.Kind.FORWARD, wire.encode_batch(batch))
        sent = time.perf_counter()
        out = self._local(lambda: self.local.forward(batch), "forward")
        self._count(batch, sent - started, time.perf_counter() - started)
        return out

    def memory(self) -> MemoryStats:
        return self.local.memory()

    def close(self) -> None:
        """Tell the workers to exit, then free this rank's pools (unless the group broke:
        the MLX thread may then be stuck in a collective for good)."""
        self._closing = True
        if self._lost is None:
            for sock in self.group.workers:
                try:
                    wire.send(sock, wire.Kind.CLOSE)
                except OSError:
                    pass
        for sock in self.group.workers:
            try:
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        if self._lost is None:
            self._local(self.local.close, "close")

    # ------------------------------------------------------------ internals
    def _ranks(self) -> range:
        return range(1, self.group.size)

    def _broadcast(self, kind: wire.Kind, arrays: list) -> None:
        if self._lost is not None:
            raise ExecutorFailed(self._lost)
        data = wire.encode(kind, arrays)
        for rank, sock in zip(self._ranks(), self.group.workers, strict=True):
            try:
                sock.sendall(data)
            except OSError as e:
                self._fail(f"rank {rank} is gone ({e})")

    def _reply(self, rank: int, kind: wire.Kind) -> tuple:
        sock = self.group.workers[rank - 1]
        try:
            msg = wire.recv(sock)
        except (OSError, wire.WireError) as e:
            self._fail(f"rank {rank} is gone ({e})")
        if msg.kind == wire.Kind.FAILED:
            self._fail(f"rank {rank} failed: {wire.decode_text(msg.arrays)}")
        if msg.kind != kind:
            self._fail(f"rank {rank} answered {msg.kind.name}, expected {kind.name}")
        return msg.arrays

    def _local(self, call: Callable, what: str):  # noqa: ANN202 - returns what call returns
        """Run ``call`` on the MLX thread (see ``_wait``)."""
        return self._wait(self._mlx.submit(call), what)

    def _wait(self, future: Future, what: str):  # noqa: ANN202 - the future's result
        """The MLX thread's result, giving up as soon as a rank is known lost.

        NOTE: any failure of rank 0's own step is fatal: the other ranks ran (or are
        running) the same step, and a rank that skips a collective leaves the others
        waiting in it forever.
        """
        try:
            return result_unless(future, self._broken)
        except ExecutorFailed:
            raise
        except Exception as e:
            self._fail(f"rank 0's {what} failed (the group stops: ranks out of step): {e}")

    def _mark_lost(self, reason: str) -> bool:
        """Record the first loss; True if this call recorded it."""
        with self._lock:
            if self._lost is not None:
                return False
            self._lost = reason
        logger.error("tensor-parallel group broken: %s", reason)
        self._broken.set_exception(ExecutorFailed(reason))
        return True

    def _fail(self, reason: str) -> NoReturn:
        self._mark_lost(reason)
        raise ExecutorFailed(self._lost)

    def _count(self, batch: ForwardBatch, send_s: float, total_s: float) -> None:
        groups = max(len(batch.row_groups), 1)
        count = self.collectives_per_forward * groups
        estimate = 0.0
        if self._all_sum_seconds is not None and self.hidden_bytes:
            # An all_sum per group carries that group's [rows, width, hidden] activations.
            widths = [len(g) for g in batch.row_groups] or [batch.batch_size]
            tokens = batch.input_ids.shape[1]
            estimate = sum(
                self.collectives_per_forward * self._all_sum_seconds(n * tokens * self.hidden_bytes)
                for n in widths
            )
        s = self._stats
        self._stats = DistributedStats(
            s.ranks,
            s.steps + 1,
            s.forward_seconds + total_s,
            s.send_seconds + send_s,
            count,
            s.collective_seconds + estimate,
        )

    def _watch(self) -> None:
        """Wait (no spinning: ``select``) for a worker's connection to close or report a
        failure; that ends the group, also while the engine is idle or stuck in a
        collective with the dead rank."""
        socks = list(self.group.workers)
        try:
            readable, _, _ = select.select(socks, [], [], None)
        except (OSError, ValueError):  # a connection was closed under the wait (EBADF, -1)
            readable = []
        if self._closing:
            return
        if readable:
            rank = self.group.workers.index(readable[0]) + 1
            try:
                data = readable[0].recv(1, socket.MSG_PEEK)
            except OSError:
                data = b""
            reason = f"rank {rank} reported a failure" if data else f"rank {rank} is gone"
            detail = reason + " (its control connection closed)" * (not data)
        else:
            reason = detail = "a control connection was closed on rank 0"
        if self._mark_lost(detail):
            if self.on_lost is not None:
                self.on_lost(reason)


def smallest_plan(plans: list[MemoryPlan]) -> MemoryPlan:
    """The plan every rank can hold: per kind of slot, the fewest any rank that has that
    kind can hold (with pipeline parallelism a rank may hold no layer of a kind)."""

    def fewest(values: list[int]) -> int:
        held = [v for v in values if v > 0]
        return min(held) if held else 0

    windows = [p.window for p in plans if p.window is not None]
    return MemoryPlan(
        full_tokens=fewest([p.full_tokens for p in plans]),
        sliding_tokens=fewest([p.sliding_tokens for p in plans]),
        window=max(windows) if windows else None,
        state_slots=fewest([p.state_slots for p in plans]),
        pool_bytes=max(p.pool_bytes for p in plans),
        # Packed steps only when every rank packs (each executor decides the same way
        # from the same model, so they agree; the scheduler must know).
        ragged_attention=all(p.ragged_attention for p in plans),
    )


def _hidden_bytes(local: MLXExecutor) -> int:
    """Bytes of one token's hidden state (what each all_sum carries per token)."""
    args = getattr(local.model, "args", None)
    hidden = getattr(args, "hidden_size", None) or getattr(args, "dim", None)
    return int(hidden) * 4 if isinstance(hidden, int) else 0
