"""Helpers of the hostile-input tests: one small-context server, raw requests, and the
"4xx with OpenAI's error JSON, or a correct answer" assertion."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.config import EngineConfig
from mlxserve.server.config import ServerConfig
from tests.ops_helpers import running_server

# A small context, so that the context limit is cheap to reach (256 prompt tokens).
CONTEXT = 256
ENGINE_CONFIG = EngineConfig(max_total_tokens=CONTEXT, max_running_requests=4)
# Timeouts bound any hang; the body limit is small enough to reach cheaply.
SERVER_CONFIG = ServerConfig(port=0, max_body_bytes=1024 * 1024, request_timeout=60)
ERROR_KEYS = {"message", "type", "param", "code"}


def post_raw(http: httpx.Client, path: str, body: bytes | str) -> httpx.Response:
    """POST ``body`` as it is (no JSON encoding by httpx)."""
    data = body.encode() if isinstance(body, str) else body
    return http.post(path, content=data, headers={"content-type": "application/json"})


def post_all(http: httpx.Client, path: str, bodies: list[str]) -> list[httpx.Response]:
    """POST each raw body, four at a time (the engine batches them)."""
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda body: post_raw(http, path, body), bodies))


def assert_openai_error(response: httpx.Response, status: int | None = None) -> dict[str, Any]:
    """A 4xx (``status`` if given) with exactly ``{"error": {message, type, param, code}}``."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
    if status is not None:
        assert response.status_code == status, (response.status_code, response.text[:500])
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"], error
    assert error["type"] == "invalid_request_error", error
    return error


def assert_error_or_answer(response: httpx.Response) -> None:
    """A 4xx with OpenAI's error JSON, or a 200 whose body is a whole completion."""
    if response.status_code != 200:
        assert_openai_error(response)
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        payloads = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert payloads and payloads[-1] == "[DONE]", response.text[-300:]
        assert all("error" not in json.loads(p) for p in payloads[:-1]), response.text[-300:]
        return
    body = response.json()
    if body.get("object") in ("chat.completion", "text_completion"):
        assert body["choices"] and body["usage"]["completion_tokens"] >= 0, body
        for choice in body["choices"]:
            assert choice["finish_reason"] in ("stop", "length", "tool_calls"), choice


def assert_healthy(http: httpx.Client) -> None:
    """``/health`` is 200 and a small completion still works."""
    health = http.get("/health")
    assert health.status_code == 200, health.text
    body = {"model": model_of(http), "prompt": "Hi", "max_tokens": 1, "temperature": 0}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text


def model_of(http: httpx.Client) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


def chat_body(model: str, **fields: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "Hi"}]
    return {"model": model, "messages": messages, "max_tokens": 1, "temperature": 0} | fields


def completion_body(model: str, **fields: Any) -> dict[str, Any]:
    return {"model": model, "prompt": "Hi", "max_tokens": 1, "temperature": 0} | fields


def with_raw_value(body: dict[str, Any], field: str, raw_value: str) -> str:
    """``body`` as JSON text with ``field`` set to ``raw_value`` written verbatim (``NaN``,
    huge integers, broken escapes...)."""
    marker = "__RAW_VALUE__"
    text = json.dumps(body | {field: marker})
    return text.replace(json.dumps(marker), raw_value)


def hostile_server_client(smollm: LoadedModel) -> Iterator[httpx.Client]:
    """A client on a server with the hostile suites' sizes (for a module fixture to yield
    from); afterwards the server must still be healthy and generating, and leak-free."""
    with running_server(smollm, ENGINE_CONFIG, SERVER_CONFIG) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            yield client
            assert_healthy(client)
