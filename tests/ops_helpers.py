"""Helpers of the operations tests (tests/test_ops_*.py): servers, SSE, Prometheus scrapes."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.config import EngineConfig
from mlxserve.server.config import ServerConfig
from mlxserve.server.lifecycle.launch import BackgroundServer, serve_in_background

ROOT = Path(__file__).resolve().parents[1]

# Greedy SmolLM2 continues this with " 5, 6, 7, ..." and no end-of-sequence token.
COUNTING = "1, 2, 3, 4,"


@contextmanager
def running_server(
    loaded: LoadedModel, engine_config: EngineConfig, config: ServerConfig | None = None
) -> Iterator[BackgroundServer]:
    """A server on a free loopback port; on exit its engine must be idle and leak-free."""
    srv = serve_in_background(loaded, engine_config, config or ServerConfig(port=0))
    try:
        yield srv
        assert srv.engine is not None
        assert srv.engine.wait_idle(60), "engine still busy after the tests"
        srv.engine.check_integrity()
    finally:
        srv.stop()


def completion(model: str, prompt: str = COUNTING, **fields: Any) -> dict[str, Any]:
    """A greedy /v1/completions body."""
    return {"model": model, "prompt": prompt, "temperature": 0, **fields}


def sse_payloads(lines: Iterator[str]) -> Iterator[dict[str, Any] | str]:
    """The ``data:`` payloads of an SSE stream: parsed JSON, or the string "[DONE]"."""
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            yield data if data == "[DONE]" else json.loads(data)


def scrape(url: str, **kwargs: Any) -> dict[tuple[str, frozenset], float]:
    """``/metrics`` as ``{(sample name, frozenset of label items): value}``."""
    response = httpx.get(url + "/metrics", timeout=30, **kwargs)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain"), response.headers
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def metric(samples: dict, name: str, **labels: str) -> float:
    """The value of one sample; labels not given are ignored only for ``model_name``."""
    for (sample_name, sample_labels), value in samples.items():
        found = {k: v for k, v in sample_labels if k != "model_name"}
        if sample_name == name and found == labels:
            return value
    raise AssertionError(f"no sample {name}{labels or ''} in the scrape")


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``predicate`` every 20 ms until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.02)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def cli_server(
    args: list[str], script: str | None = None
) -> Iterator[tuple[subprocess.Popen, str]]:
    """The real ``mlxserve`` CLI in a subprocess on a free loopback port, waited for until
    ``/health`` is 200; yields the process (stdout and stderr merged, text) and its URL,
    and kills it on exit if it still runs.

    Args:
        args: CLI options (``--port`` is added).
        script: Python source to run instead of ``-m mlxserve.server.cli`` (for test hooks); it
            must end by calling ``mlxserve.server.cli.main``.
    """
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, *(["-c", script] if script else ["-m", "mlxserve.server.cli"])]
    cmd += ["--port", str(port), *args]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:

        def healthy() -> bool:
            assert proc.poll() is None, f"the server exited early: {proc.stdout.read()}"
            try:
                return httpx.get(url + "/health", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(healthy, 180, "the server to load and warm up")
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
