"""Tensor-parallel faults end the group with an error, never a hang: a rank killed
mid-stream fails the stream, turns /health 503 and exits rank 0 non-zero; a group that
never forms times out on every rank."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import httpx
import pytest

from tests.tensor_parallel_server import (
    RankedServer,
    free_port,
    mlxserve_command,
    require_loopback_ports,
)
from tests.tiny_models import build_tiny_model_dir


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    require_loopback_ports()
    return build_tiny_model_dir("llama", tmp_path_factory.mktemp("llama"))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class TestRankKilledMidStream:
    def test_stream_errors_health_503_and_rank0_exits_nonzero(self, llama_dir, tmp_path):
        args = ["--model", str(llama_dir), "--tensor-parallel", "2"]
        args += ["--max-total-tokens", "2048", "--distributed-timeout", "60"]
        server = RankedServer(args, tmp_path / "server.log").wait_ready()
        try:
            (rank1,) = server.ranks()
            body = {"model": llama_dir.name, "prompt": [5, 6, 7], "max_tokens": 1800}
            body |= {"temperature": 0, "stream": True, "ignore_eos": True}
            events = []
            with httpx.stream(
                "POST", server.url + "/v1/completions", json=body, timeout=60
            ) as response:
                assert response.status_code == 200, response.read()
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    events.append(line[6:])
                    if len(events) == 5:
                        os.kill(rank1, signal.SIGKILL)
            assert len(events) < 1800, "the stream finished before rank 1 was killed"
            errors = [json.loads(e) for e in events if e != "[DONE]" and '"error"' in e]
            assert errors, f"the stream ended without an error event: {events[-3:]}"
            statuses = []
            deadline = time.monotonic() + 30
            while server.proc.poll() is None and time.monotonic() < deadline:
                try:
                    statuses.append(httpx.get(server.url + "/health", timeout=2).status_code)
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
            assert server.proc.poll() is not None, f"rank 0 did not exit:\n{server.log()}"
            assert server.proc.returncode != 0, "rank 0 exited 0 after losing rank 1"
            assert 200 not in statuses, f"/health said 200 after rank 1 died: {statuses}"
            assert "rank 1" in server.log(), server.log()
        finally:
            server.stop()


class TestGroupNeverForms:
    @pytest.mark.parametrize("rank", [0, 1])
    def test_lone_rank_times_out_cleanly(self, llama_dir, tmp_path, rank):
        hostfile = tmp_path / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(2)]))
        port = free_port()
        command = mlxserve_command(
            "--model", str(llama_dir), "--distributed", "--distributed-timeout", "2",
            "--max-total-tokens", "64", "--port", str(port),
        )  # fmt: skip
        env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
        started = time.monotonic()
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
        took = time.monotonic() - started
        assert proc.returncode != 0, f"rank {rank} exited 0 alone: {proc.stderr}"
        assert "giving up after 2 s" in proc.stderr, proc.stderr
        assert "Timeout" in proc.stderr, proc.stderr
        assert took < 30, f"rank {rank} took {took:.1f} s to give up"


class TestRank0Killed:
    def test_the_other_rank_exits(self, llama_dir, tmp_path):
        args = ["--model", str(llama_dir), "--tensor-parallel", "2", "--max-total-tokens", "64"]
        server = RankedServer(args, tmp_path / "server.log").wait_ready()
        try:
            (rank1,) = server.ranks()
            server.proc.kill()
            server.proc.wait(10)
            deadline = time.monotonic() + 15
            while _alive(rank1) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not _alive(rank1), "rank 1 outlived rank 0 by 15 s"
        finally:
            server.stop()
