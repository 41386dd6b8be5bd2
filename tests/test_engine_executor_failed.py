"""An executor that can run no more (``ExecutorFailed``: a lost tensor-parallel rank) stops
the engine: every request gets an error, ``is_alive`` turns False (so /health says 503
and the server exits), whether the failure comes from a forward or from ``Engine.fail``
while the engine is idle."""

from __future__ import annotations

import threading

from mlxserve.scheduler.batch import ForwardBatch, ForwardOutput
from mlxserve.scheduler.config import EngineConfig
from mlxserve.scheduler.engine import Engine
from mlxserve.scheduler.outputs import ExecutorFailed, RequestOutput
from mlxserve.scheduler.sampling_params import SamplingParams
from tests.test_engine_fake_executor import SumModelExecutor

CONFIG = EngineConfig(max_total_tokens=256, max_running_requests=4, max_prefill_tokens=8)


class LosingExecutor(SumModelExecutor):
    """Fails for good on its ``fail_at``-th forward."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        if self.forwards + 1 >= self.fail_at:
            self.forwards += 1
            raise ExecutorFailed("rank 1 is gone")
        return super().forward(batch)


def _submit(engine: Engine, rid: str, max_tokens: int) -> tuple[list, threading.Event]:
    events: list[RequestOutput] = []
    done = threading.Event()

    def on_output(event: RequestOutput) -> None:
        events.append(event)
        if event.finished:
            done.set()

    engine.add_request(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens), on_output)
    return events, done


def _wait_dead(engine: Engine) -> bool:
    for _ in range(500):
        if not engine.is_alive:
            return True
        threading.Event().wait(0.01)
    return False


class TestExecutorFailedInAForward:
    def test_every_request_errors_and_the_engine_dies(self) -> None:
        executor = LosingExecutor(fail_at=3)
        engine = Engine(executor, CONFIG, context_length=128)
        engine.start()
        try:
            streams = [_submit(engine, f"r{i}", 50) for i in range(3)]
            for events, done in streams:
                assert done.wait(10), "a request never finished"
                assert events[-1].finish_reason == "error", events[-1]
                assert "rank 1 is gone" in (events[-1].error or ""), events[-1]
            assert _wait_dead(engine), "the engine kept running after ExecutorFailed"
            assert isinstance(engine.error, ExecutorFailed), engine.error
        finally:
            engine.shutdown()
        assert executor.closed, "the executor was not closed"


class TestFailWhileIdle:
    def test_fail_stops_an_idle_engine(self) -> None:
        executor = SumModelExecutor()
        engine = Engine(executor, CONFIG, context_length=128)
        engine.start()
        try:
            events, done = _submit(engine, "before", 3)
            assert done.wait(10) and events[-1].finish_reason == "length", events
            engine.fail("rank 1 is gone")
            assert _wait_dead(engine), "an idle engine ignored fail()"
            assert "rank 1 is gone" in str(engine.error), engine.error
        finally:
            engine.shutdown()
