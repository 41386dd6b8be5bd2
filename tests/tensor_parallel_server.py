"""Helpers of the tensor-parallel tests: starting and watching an ``mlxserve
--tensor-parallel`` server (its ranks are processes), and a sample ForwardBatch."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from mlxserve.scheduler.batch import ForwardBatch, SamplingArrays

CLI = "import sys; from mlxserve.server.cli import main; sys.exit(main(sys.argv[1:]))"


def require_loopback_ports() -> None:
    """Skip (with the reason) where 127.0.0.1 ports cannot be opened: the ranks need them."""
    try:
        socket.create_server(("127.0.0.1", 0)).close()
    except OSError as e:
        pytest.skip(f"cannot open a TCP port on 127.0.0.1 for the ranks' ring: {e}")


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def mlxserve_command(*args: str) -> list[str]:
    return [sys.executable, "-c", CLI, *args]


class RankedServer:
    """``mlxserve`` with ``args`` as a subprocess (rank 0; it starts the other ranks)."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.log_path = log
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        command = mlxserve_command(*args, "--port", str(self.port), "--log-level", "info")
        self.proc = subprocess.Popen(
            command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 120.0) -> RankedServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"server not ready in {timeout} s:\n{self.log()}")

    def ranks(self) -> list[int]:
        """Pids of the other ranks (children of rank 0)."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        return [int(p) for p in children.read_text().split()] if children.exists() else []

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self) -> int:
        """SIGTERM rank 0 (a drain); returns its exit status. Ranks still alive after
        rank 0 exited are killed."""
        others = self.ranks() if self.proc.poll() is None else []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.leftover = [pid for pid in others if _alive(pid)]
        for pid in self.leftover:
            os.kill(pid, signal.SIGKILL)
        self._log.close()
        return self.proc.returncode


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def sample_batch(embed: bool = False) -> ForwardBatch:
    """A 3-row prefill batch in two row groups (wire format and executor tests)."""
    b = 3
    return ForwardBatch(
        phase="prefill",
        request_ids=["a", "b", "c"],
        input_ids=np.array([[1, 2, 3], [4, 0, 0], [5, 6, 0]], np.int32),
        computed_lens=np.array([0, 7, 2], np.int32),
        extend_lens=np.array([3, 1, 2], np.int32),
        write_slots=np.array([[1, 2, 3], [9, 0, 0], [4, 5, 0]], np.int32),
        read_slots=np.arange(30, dtype=np.int32).reshape(3, 10),
        sliding_write_slots=np.zeros((b, 3), np.int32),
        sliding_read_slots=np.zeros((b, 0), np.int32),
        sliding_read_start=np.zeros(b, np.int32),
        state_slots=np.array([1, 2, 3], np.int32),
        fresh_rows=np.array([True, False, False]),
        sample_rows=np.array([True, True, False]),
        sampling=SamplingArrays(
            temperature=np.ones(b, np.float32),
            top_p=np.ones(b, np.float32),
            top_k=np.zeros(b, np.int32),
            min_p=np.zeros(b, np.float32),
        ),
        state_copies_in=np.array([[1, 2]], np.int32),
        row_groups=(np.array([0, 2]), np.array([1])),
        embed_rows=np.array([False, True, False]) if embed else None,
    )
