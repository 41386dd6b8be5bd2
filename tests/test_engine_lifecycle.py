"""Engine start/stop: a process that served requests exits cleanly, shut down or not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import sys, threading
from mlxserve.mlx_backend.loading.loader import load_model
from mlxserve.scheduler.config import EngineConfig
from mlxserve.server.lifecycle.engines import build_engine
from mlxserve.scheduler.sampling_params import SamplingParams

engine = build_engine(load_model(None), EngineConfig(max_total_tokens=256))
engine.start()
done = threading.Event()
engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0),
                   lambda ev: ev.finished and done.set())
assert done.wait(60), "request did not finish"
if sys.argv[1] == "shutdown":
    engine.shutdown()
print("served")
"""


class TestProcessExit:
    @pytest.mark.parametrize("how", ["shutdown", "forgotten"])
    def test_exit_status_is_zero(self, how):
        # NOTE: MLX's per-thread compile cache used to abort the process (status 134) when
        # the engine thread's C++ thread-locals were destroyed during interpreter exit.
        root = Path(__file__).resolve().parents[1]
        proc = subprocess.run(
            [sys.executable, "-c", SCRIPT, how],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-2000:]}"
        assert "served" in proc.stdout
