"""Limits the red-team pass walked around: the queue counts only requests waiting for a free
batch row, ``n`` choices count as ``n``; slow clients are cut off by header and body
deadlines instead of holding connections open."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.config import EngineConfig
from mlxserve.server.config import ServerConfig
from tests.ops_helpers import completion, running_server


class TestQueueCounts:
    def test_requests_that_run_at_once_are_not_queued(self, smollm: LoadedModel) -> None:
        engine_config = EngineConfig(max_total_tokens=1024, max_running_requests=4)
        config = ServerConfig(port=0, max_queue=2)
        model = smollm.model_id
        with running_server(smollm, engine_config, config) as srv:
            body = completion(model, max_tokens=8)
            with ThreadPoolExecutor(4) as pool:
                statuses = list(
                    pool.map(
                        lambda _: httpx.post(srv.url + "/v1/completions", json=body, timeout=120),
                        range(4),
                    )
                )
            assert [r.status_code for r in statuses] == [200] * 4, [r.text for r in statuses]
            # n choices take n places: 64 choices need 60 waiting places, the queue has 2.
            many = httpx.post(
                srv.url + "/v1/completions", json=completion(model, max_tokens=1, n=64), timeout=60
            )
            error = assert_openai_error_429(many)
            assert "queue" in error["message"], error
            # Six choices: four run, two wait, which the queue of two holds.
            six = httpx.post(
                srv.url + "/v1/completions", json=completion(model, max_tokens=1, n=6), timeout=60
            )
            assert six.status_code == 200 and len(six.json()["choices"]) == 6, six.text


def assert_openai_error_429(response: httpx.Response) -> dict:
    assert response.status_code == 429, (response.status_code, response.text)
    assert response.headers["retry-after"], response.headers
    error = response.json()["error"]
    assert error["code"] == "queue_full", error
    return error


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.settimeout(10)
    return sock


class TestSlowClients:
    def test_trickled_heads_and_bodies_are_cut_off(self, smollm: LoadedModel) -> None:
        config = ServerConfig(port=0, header_timeout=1.0, body_timeout=1.0)
        with running_server(smollm, EngineConfig(max_total_tokens=128), config) as srv:
            port = srv.port
            socks = [connect(port) for _ in range(20)]
            started = time.monotonic()
            for sock in socks:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            time.sleep(0.5)
            for sock in socks:  # still trickling: another header line, no end of the head
                sock.sendall(b"X-Slow: 1\r\n")
            for sock in socks:
                assert sock.recv(65536) == b"", "the server closes a slow head"
            assert time.monotonic() - started < 5, "within the header deadline (plus slack)"
            # A complete head with a body that never finishes: 408 in OpenAI's shape.
            slow_body = connect(port)
            slow_body.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
            )
            started = time.monotonic()
            answer = b""
            while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                chunk = slow_body.recv(65536)
                if not chunk:
                    break
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            assert b'"request_timeout"' in answer, answer
            assert time.monotonic() - started < 5
            for sock in [*socks, slow_body]:
                sock.close()
            # A normal client is unaffected.
            ok = httpx.post(
                srv.url + "/v1/completions", json=completion(smollm.model_id, max_tokens=1)
            )
            assert ok.status_code == 200, ok.text

    def test_connections_beyond_the_cap_get_503(self, smollm: LoadedModel) -> None:
        config = ServerConfig(port=0, max_connections=3)
        with running_server(smollm, EngineConfig(max_total_tokens=128), config) as srv:
            held = [connect(srv.port) for _ in range(3)]
            try:
                response = httpx.get(srv.url + "/health", timeout=10)
                assert response.status_code == 503, response.text
            finally:
                for sock in held:
                    sock.close()
            time.sleep(0.2)
            assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
