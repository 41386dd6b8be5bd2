"""Graceful shutdown: on SIGTERM new requests get 503, a running stream completes, and the
process exits 0; requests still running at --shutdown-timeout end with an error chunk."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import httpx

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.config import EngineConfig
from mlxserve.server.config import ServerConfig
from tests.ops_helpers import cli_server, completion, running_server, sse_payloads, wait_for


def stream_in_thread(
    url: str, body: dict[str, Any]
) -> tuple[threading.Thread, list, threading.Event]:
    """POST a streamed completion on a thread; returns it, its payloads and a first-token
    event."""
    payloads: list = []
    first = threading.Event()

    def run() -> None:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
            assert response.status_code == 200, response.read()
            for payload in sse_payloads(response.iter_lines()):
                payloads.append(payload)
                first.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, payloads, first


class TestSigterm:
    def test_running_stream_completes_and_exit_status_is_zero(self) -> None:
        args = ["--max-total-tokens", "256", "--max-running-requests", "2"]
        args += ["--shutdown-timeout", "60", "--log-level", "warning"]
        with cli_server(args) as (proc, url):
            model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
            body = completion(
                model, max_tokens=8, stream=True, stream_options={"include_usage": True}
            )
            thread, payloads, first = stream_in_thread(url, body)
            assert first.wait(60), "the stream produced nothing"
            proc.send_signal(signal.SIGTERM)

            wait_for(
                lambda: httpx.get(url + "/health", timeout=5).status_code == 503,
                10,
                "/health to report draining",
            )
            assert httpx.get(url + "/health", timeout=5).json() == {"status": "draining"}
            refused = httpx.post(url + "/v1/completions", json=completion(model), timeout=10)
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "server_shutting_down", refused.text

            thread.join(120)
            assert payloads[-1] == "[DONE]", payloads[-3:]
            assert payloads[-2]["usage"]["completion_tokens"] == 8, "every token was sent"
            assert payloads[-3]["choices"][0]["finish_reason"] == "length", payloads[-3]
            assert proc.wait(60) == 0, proc.stdout.read()


class TestShutdownTimeout:
    def test_requests_past_the_timeout_get_an_error_chunk(self, smollm: LoadedModel) -> None:
        engine_config = EngineConfig(max_total_tokens=256, max_running_requests=2)
        config = ServerConfig(port=0, shutdown_timeout=0.5)
        with running_server(smollm, engine_config, config) as srv:
            thread, payloads, first = stream_in_thread(
                srv.url, completion(smollm.model_id, max_tokens=100, stream=True)
            )
            assert first.wait(60), "the stream produced nothing"
            started = time.monotonic()
            srv.begin_shutdown()
            thread.join(60)
            assert payloads[-1] == "[DONE]", payloads[-3:]
            error = payloads[-2]["error"]
            assert error["code"] == "server_shutting_down", error
            assert srv.wait_stopped(30), "uvicorn did not exit after the drain"
            assert time.monotonic() - started < 20
