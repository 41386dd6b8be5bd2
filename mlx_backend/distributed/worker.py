"""The loop of every rank but 0: run what rank 0 sends, over this rank's shard and pools.

The worker blocks in ``recv`` on its control connection between steps (an idle worker
costs no CPU: no collective is pending), then runs the same call rank 0 runs, so both
issue the same collectives. It never samples for anyone and never binds HTTP.
"""

from __future__ import annotations

import logging
import socket

from mlxserve.mlx_backend.distributed import wire
from mlxserve.mlx_backend.executor import MLXExecutor

logger = logging.getLogger(__name__)


def run_worker(executor: MLXExecutor, leader: socket.socket, rank: int) -> int:
    """Serve rank 0's commands until it says close (0) or goes away or a call fails (1).

    Everything runs on the calling thread (MLX streams are per thread).
    """
    executor.materialize()
    try:
        while True:
            msg = wire.recv(leader)
            if msg.kind == wire.Kind.FORWARD:
                executor.forward(wire.decode_batch(msg.arrays))
            elif msg.kind == wire.Kind.PLAN:
                plan = executor.plan(wire.decode_pool_request(msg.arrays))
                wire.send(leader, wire.Kind.PLANNED, wire.encode_plan(plan))
            elif msg.kind == wire.Kind.ALLOCATE:
                executor.allocate(wire.decode_plan(msg.arrays))
                wire.send(leader, wire.Kind.ALLOCATED)
            elif msg.kind == wire.Kind.CLOSE:
                logger.info("rank %d: closing", rank)
                executor.close()
                return 0
            else:
                raise wire.WireError(f"rank 0 sent {msg.kind.name}, which a worker never gets")
    except wire.PeerClosed:
        logger.error("rank %d: rank 0 went away; exiting", rank)
        return 1
    except Exception as e:  # noqa: BLE001 - reported to rank 0, then the process exits
        logger.exception("rank %d failed", rank)
        try:
            wire.send(leader, wire.Kind.FAILED, wire.encode_text(f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        return 1
