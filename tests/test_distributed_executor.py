"""Rank 0's DistributedExecutor against a scripted worker on a socket pair (no MLX group):
the smallest plan wins, every call reaches the worker first, and a lost worker fails the
executor (ExecutorFailed) whether the engine is idle or waiting in a step."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from mlxserve.mlx_backend.distributed import wire
from mlxserve.mlx_backend.distributed.executor import DistributedExecutor
from mlxserve.mlx_backend.distributed.group import Group
from mlxserve.scheduler.batch import ForwardOutput
from mlxserve.scheduler.memory_plan import MemoryPlan, PoolRequest
from mlxserve.scheduler.outputs import ExecutorFailed
from tests.tensor_parallel_server import sample_batch

REQUEST = PoolRequest(0, 4, 64, 0.25, 512, True)


class FakeLocal:
    """Rank 0's own executor: a plan of 512 slots; forward waits for ``release``."""

    model = None

    def __init__(self) -> None:
        self.release = threading.Event()
        self.release.set()
        self.closed = False

    vocab_size = 256

    def materialize(self) -> None: ...

    def plan(self, request: PoolRequest) -> MemoryPlan:
        return MemoryPlan(512)

    def allocate(self, plan: MemoryPlan) -> None:
        self.allocated = plan

    def forward(self, batch) -> ForwardOutput:  # noqa: ANN001
        self.release.wait()
        return ForwardOutput(np.zeros(batch.batch_size, np.int32))

    def close(self) -> None:
        self.closed = True


def _worker(sock: socket.socket, plan_tokens: int, received: list) -> None:
    """Answers plan / allocate like a worker with ``plan_tokens`` slots of room."""
    while True:
        try:
            msg = wire.recv(sock)
        except OSError:  # closed by the test (a dead rank) or by rank 0
            return
        received.append(msg.kind)
        if msg.kind == wire.Kind.PLAN:
            wire.send(sock, wire.Kind.PLANNED, wire.encode_plan(MemoryPlan(plan_tokens)))
        elif msg.kind == wire.Kind.ALLOCATE:
            wire.send(sock, wire.Kind.ALLOCATED)
        elif msg.kind == wire.Kind.CLOSE:
            return


@pytest.fixture
def setup():
    ours, theirs = socket.socketpair()
    received: list = []
    worker = threading.Thread(target=_worker, args=(theirs, 300, received), daemon=True)
    worker.start()
    local = FakeLocal()
    lost: list[str] = []
    executor = DistributedExecutor(
        local, Group(None, 0, 2, [ours], None), collectives_per_forward=4, on_lost=lost.append
    )
    plan = executor.plan(REQUEST)
    executor.allocate(plan)
    yield executor, local, theirs, received, lost, plan
    ours.close()
    theirs.close()


class TestPlanning:
    def test_the_smallest_plan_of_all_ranks_is_allocated(self, setup):
        executor, local, _, received, _, plan = setup
        assert plan.full_tokens == 300, f"rank 1 has room for 300 slots, got {plan}"
        assert local.allocated == plan, "rank 0 allocated another plan than the group"
        assert received[:2] == [wire.Kind.PLAN, wire.Kind.ALLOCATE], received


class TestForward:
    def test_batches_reach_the_worker_and_are_counted(self, setup):
        executor, _, _, received, _, _ = setup
        out = executor.forward(sample_batch())
        assert out.next_token_ids.shape == (3,)
        assert wire.Kind.FORWARD in received or _wait_for(received, wire.Kind.FORWARD)
        assert executor.stats.steps == 1
        assert executor.stats.collectives_per_step == 2 * 2 * 2, "2 layers x 2 x 2 groups"

    def test_close_tells_the_worker(self, setup):
        executor, local, _, received, _, _ = setup
        executor.close()
        assert local.closed, "rank 0's pools were not freed"
        assert _wait_for(received, wire.Kind.CLOSE), received


class TestLostRank:
    def test_idle_loss_calls_on_lost_and_fails_later_calls(self, setup):
        executor, _, theirs, _, lost, _ = setup
        theirs.shutdown(socket.SHUT_RDWR)
        theirs.close()
        _wait(lambda: lost)
        assert "rank 1" in lost[0], lost
        with pytest.raises(ExecutorFailed, match="rank 1"):
            executor.forward(sample_batch())

    def test_a_connection_closed_on_rank_0_breaks_the_group_not_the_monitor(self, setup):
        """The monitor's wait on a socket closed under it (EBADF, or fileno -1 once closed)
        is a lost group, not an exception in the monitor thread."""
        executor, _, _, _, lost, _ = setup
        executor.group.workers[0].close()
        executor._watch()  # what the monitor thread runs, on the closed socket
        assert lost == ["a control connection was closed on rank 0"], lost
        with pytest.raises(ExecutorFailed, match="closed on rank 0"):
            executor.forward(sample_batch())

    def test_a_step_stuck_in_a_collective_gives_up_when_the_rank_dies(self, setup):
        executor, local, theirs, _, _, _ = setup
        local.release.clear()  # rank 0's step never ends, as in a dead peer's collective
        failed: list[BaseException] = []

        def step() -> None:
            try:
                executor.forward(sample_batch())
            except BaseException as e:  # noqa: BLE001
                failed.append(e)

        stepping = threading.Thread(target=step, daemon=True)
        stepping.start()
        theirs.shutdown(socket.SHUT_RDWR)
        theirs.close()
        stepping.join(10)
        assert not stepping.is_alive(), "the engine thread stayed blocked in the step"
        assert failed and isinstance(failed[0], ExecutorFailed), failed
        local.release.set()


def _wait(condition, timeout: float = 10.0) -> bool:  # noqa: ANN001
    event = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if condition():
            return True
        event.wait(0.01)
    return False


def _wait_for(received: list, kind: wire.Kind) -> bool:
    return _wait(lambda: kind in received)
