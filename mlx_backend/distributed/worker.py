"""The loop of every rank but 0: run what rank 0 sends, over this rank's shard and pools.

The reader (the calling thread) blocks in ``recv`` on the control connection, so an idle
worker costs no CPU (no collective is pending), and hands each message to the MLX thread,
which runs the same call rank 0 runs, so both issue the same collectives. The reader keeps
listening while a step runs: when rank 0 goes away it returns at once, even if the MLX
thread is stuck in a collective with the dead rank for good. A worker never samples for
anyone and never binds HTTP.
"""

from __future__ import annotations

import logging
import socket
import threading

from mlxserve.mlx_backend.distributed import wire
from mlxserve.mlx_backend.distributed.mlx_thread import MLXThread
from mlxserve.mlx_backend.executor import MLXExecutor

logger = logging.getLogger(__name__)


class _Worker:
    def __init__(self, executor: MLXExecutor, leader: socket.socket, rank: int) -> None:
        self.executor = executor
        self.leader = leader
        self.rank = rank
        self.failed = threading.Event()
        self.closed = threading.Event()

    def handle(self, msg: wire.Message) -> None:
        """Run one message (on the MLX thread); a failure is told to rank 0 and ends the
        reader (its socket is shut down)."""
        if self.failed.is_set():
            return
        try:
            self._run(msg)
        except Exception as e:  # noqa: BLE001 - reported to rank 0, then the process exits
            logger.exception("rank %d failed", self.rank)
            self.failed.set()
            try:
                text = wire.encode_text(f"{type(e).__name__}: {e}")
                wire.send(self.leader, wire.Kind.FAILED, text)
                self.leader.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _run(self, msg: wire.Message) -> None:
        executor = self.executor
        if msg.kind == wire.Kind.FORWARD:
            executor.forward(wire.decode_batch(msg.arrays))
        elif msg.kind == wire.Kind.PLAN:
            plan = executor.plan(wire.decode_pool_request(msg.arrays))
            wire.send(self.leader, wire.Kind.PLANNED, wire.encode_plan(plan))
        elif msg.kind == wire.Kind.ALLOCATE:
            executor.allocate(wire.decode_plan(msg.arrays))
            wire.send(self.leader, wire.Kind.ALLOCATED)
        elif msg.kind == wire.Kind.CLOSE:
            executor.close()
            self.closed.set()
        else:
            raise wire.WireError(f"rank 0 sent {msg.kind.name}, which a worker never gets")


def run_worker(executor: MLXExecutor, leader: socket.socket, rank: int) -> int:
    """Serve rank 0's commands until it says close (0), goes away or a step fails (1).

    Returns at once when rank 0's connection closes, possibly leaving the MLX thread
    blocked in a collective: the caller ends the process (``os._exit``).
    """
    executor.materialize()
    worker = _Worker(executor, leader, rank)
    mlx = MLXThread(f"mlxserve-rank{rank}-mlx")
    while True:
        try:
            msg = wire.recv(leader)
        except (OSError, wire.WireError) as e:
            if worker.failed.is_set():
                return 1
            logger.error("rank %d: rank 0 went away (%s); exiting", rank, e)
            return 1
        done = mlx.submit(lambda msg=msg: worker.handle(msg))
        if msg.kind == wire.Kind.CLOSE:
            done.result()
            logger.info("rank %d: closed by rank 0", rank)
            return 1 if worker.failed.is_set() else 0
