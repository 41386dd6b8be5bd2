"""The OpenBLAS thread policy: fewer threads while other processes are busy, more again
once they stay quiet. The counters and the clock are faked; no BLAS runs here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mlxserve.mlx_backend.cpu.blas_threads import (
    INTERVAL_S,
    QUIET_S_TO_GROW,
    AdaptiveBlasThreads,
    cpu_seconds,
)
from tests.ops_helpers import ROOT


class FakeMachine:
    """CPU counters advanced by hand: ``run(seconds, others, ours)`` in CPUs."""

    def __init__(self) -> None:
        self.now = 0.0
        self.busy = 0.0
        self.ours = 0.0
        self.applied: list[int] = []

    def run(self, seconds: float, others: float, ours: float = 1.0) -> None:
        self.now += seconds
        self.busy += (others + ours) * seconds
        self.ours += ours * seconds

    def policy(self, cpus: int) -> AdaptiveBlasThreads:
        return AdaptiveBlasThreads(
            cpus, self.applied.append, lambda: (self.busy, self.ours), lambda: self.now
        )

    def step(self, policy: AdaptiveBlasThreads, seconds: float, others: float) -> None:
        """``seconds`` of one forward while others use ``others`` CPUs, then a look."""
        self.run(seconds, others)
        policy.update()


class TestAdaptiveBlasThreads:
    def test_idle_machine_keeps_every_cpu(self):
        m = FakeMachine()
        policy = m.policy(2)
        for _ in range(10):
            m.run(INTERVAL_S, others=0.1, ours=1.9)
            policy.update()
        assert policy.threads == 2 and m.applied == []

    def test_a_busy_process_takes_a_thread_at_once(self):
        m = FakeMachine()
        policy = m.policy(2)
        m.step(policy, INTERVAL_S, others=1.0)
        assert policy.threads == 1 and m.applied == [1]

    def test_threads_come_back_only_after_quiet_seconds(self):
        m = FakeMachine()
        policy = m.policy(4)
        m.step(policy, INTERVAL_S, others=2.0)
        assert policy.threads == 2
        quiet = 0.0
        while quiet + INTERVAL_S < QUIET_S_TO_GROW:
            m.step(policy, INTERVAL_S, others=0.0)
            quiet += INTERVAL_S
            assert policy.threads == 2, f"grew after {quiet} quiet second(s)"
        m.step(policy, INTERVAL_S, others=0.0)
        assert policy.threads == 4 and m.applied == [2, 4]

    def test_one_long_quiet_forward_counts_its_seconds(self):
        """The counters are read between forwards: a 17 s prefill with nobody else busy is
        17 quiet seconds, not one look."""
        m = FakeMachine()
        policy = m.policy(2)
        m.step(policy, INTERVAL_S, others=1.0)
        m.step(policy, 17.0, others=0.0)
        assert policy.threads == 2

    def test_a_noisy_second_restarts_the_quiet_count(self):
        m = FakeMachine()
        policy = m.policy(2)
        m.step(policy, INTERVAL_S, others=1.0)
        for others in [0.0, 0.0, 0.9, 0.0, 0.0]:
            m.step(policy, INTERVAL_S, others=others)
        assert policy.threads == 1, "the quiet seconds must be in a row"

    def test_never_below_one_thread(self):
        m = FakeMachine()
        policy = m.policy(2)
        m.step(policy, INTERVAL_S, others=5.0)
        assert policy.threads == 1

    def test_counters_are_read_at_most_once_an_interval(self):
        m = FakeMachine()
        policy = m.policy(2)
        m.step(policy, INTERVAL_S / 10, others=2.0)
        assert policy.threads == 2, "a tenth of a second is not a measurement"

    def test_unreadable_counters_keep_one_cpu_free(self):
        applied: list[int] = []
        policy = AdaptiveBlasThreads(2, applied.append, lambda: None, lambda: 0.0)
        policy.update()
        assert policy.threads == 1 and applied == [1]


class TestOnePolicyPerProcess:
    def test_every_engine_steers_the_same_policy(self, monkeypatch) -> None:
        from mlxserve.mlx_backend.cpu import blas_threads

        monkeypatch.setattr(blas_threads, "_shared", None)
        monkeypatch.setattr(blas_threads, "_shared_made", False)
        asked: list[int] = []

        def control():  # noqa: ANN202
            asked.append(1)
            return 2, lambda n: None

        first = blas_threads.shared_blas_threads(control)
        second = blas_threads.shared_blas_threads(control)
        assert first is not None and first is second, "one policy for the process"
        assert asked == [1], "built once"


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="Linux /proc only")
def test_cpu_seconds_reads_this_machine():
    first = cpu_seconds()
    sum(i * i for i in range(200_000))  # burn a little CPU
    second = cpu_seconds()
    assert first is not None and second is not None
    assert second[1] > first[1], "our own CPU time must grow"
    assert second[0] >= first[0]


_PROBE = """
import json
from mlxserve.mlx_backend.cpu.blas import enable_fast_blas, adaptive_thread_control
status = enable_fast_blas()
import mlx.core as mx
control = adaptive_thread_control()
print(json.dumps({"active": status.active, "adaptive": control is not None,
                  "cpus": control[0] if control else None, "reason": status.reason}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the BLAS shim is Linux-only")
@pytest.mark.parametrize("user_threads", [None, "1"])
def test_thread_control_only_when_the_user_set_no_count(user_threads):
    env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}
    env.pop("MLXSERVE_BLAS", None)
    if user_threads is not None:
        env["OPENBLAS_NUM_THREADS"] = user_threads
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if not result["active"]:
        pytest.skip(f"no fast BLAS here: {result['reason']}")
    assert result["adaptive"] == (user_threads is None), result
    if user_threads is None:
        assert result["cpus"] == len(os.sched_getaffinity(0))
