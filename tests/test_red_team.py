"""The holes a red-team pass found, each closed: a loop that never freezes on one large
request, hostile JSON inside strings, tiny temperatures, echo offsets around special tokens,
an impossible regex, and DNS rebinding. (Tenant isolation: test_tenant_isolation.py; queue
counts and slow clients: test_red_team_limits.py.)"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.config import EngineConfig
from mlxserve.server.config import ServerConfig
from mlxserve.server.lifecycle.launch import BackgroundServer
from tests.hostile_helpers import assert_openai_error
from tests.ops_helpers import running_server

ENGINE_CONFIG = EngineConfig(max_total_tokens=2048, max_running_requests=8)
DEEP = "[" * 50_000 + "]" * 50_000


@pytest.fixture(scope="module")
def server(smollm: LoadedModel) -> Iterator[BackgroundServer]:
    # The default body limit (16 MiB): the large-but-legal bodies of the red-team pass.
    with running_server(smollm, ENGINE_CONFIG, ServerConfig(port=0)) as srv:
        yield srv


def chat_body(model: str, content: str, **fields: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 2,
        "temperature": 0,
        **fields,
    }


def worst_health_latency(url: str, work: Callable[[], Any]) -> tuple[float, Any]:
    """Run ``work`` on a thread; poll ``/health`` meanwhile. Returns the slowest answer's
    seconds and ``work``'s result."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(work()))
    thread.start()
    worst = 0.0
    with httpx.Client(timeout=30) as client:
        while thread.is_alive():
            started = time.monotonic()
            assert client.get(url + "/health").status_code == 200
            worst = max(worst, time.monotonic() - started)
            time.sleep(0.05)
    thread.join()
    return worst, result[0]


class TestTheLoopNeverFreezes:
    def test_a_15_mb_message_is_refused_at_once(self, server: BackgroundServer, model) -> None:
        body = chat_body(model, "word " * (3 * 1024 * 1024))  # 15 MiB of text

        def send() -> httpx.Response:
            return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)

        started = time.monotonic()
        worst, response = worst_health_latency(server.url, send)
        error = assert_openai_error(response, 400)
        assert error["code"] == "context_length_exceeded", error
        assert time.monotonic() - started < 10, "refused before it was rendered and encoded"
        assert worst < 1.0, f"/health took {worst:.2f} s while the message was refused"

    def test_tokenizing_megabytes_leaves_the_loop_free(
        self, server: BackgroundServer, model: str
    ) -> None:
        body = {"model": model, "prompt": "hello world, " * 200_000}  # 2.6 MB

        def send() -> httpx.Response:
            return httpx.post(server.url + "/tokenize", json=body, timeout=120)

        worst, response = worst_health_latency(server.url, send)
        assert response.status_code == 200 and response.json()["count"] > 500_000
        assert worst < 1.0, f"/health took {worst:.2f} s while /tokenize ran"

    def test_a_large_schema_with_many_choices_compiles_off_the_loop(
        self, server: BackgroundServer, model: str
    ) -> None:
        schema = {"enum": [f"choice number {i:05d}" for i in range(20_000)]}  # ~420 KB
        body = chat_body(model, "JSON please", n=16, guided_json=json.dumps(schema))

        def send() -> httpx.Response:
            return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)

        worst, response = worst_health_latency(server.url, send)
        assert response.status_code == 200, response.text[:300]
        assert worst < 1.0, f"/health took {worst:.2f} s while the grammar compiled"


class TestJsonInsideStrings:
    @pytest.mark.parametrize(
        "arguments", [DEEP, '{"a": "\\ud800"}'], ids=["deep", "lone-surrogate"]
    )
    def test_tool_call_arguments(self, http: httpx.Client, model: str, arguments: str) -> None:
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        messages = [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "ok", "tool_call_id": "c1"},
        ]
        for path in ("/v1/chat/completions", "/tokenize"):
            body = {"model": model, "messages": messages}
            if path != "/tokenize":
                body["max_tokens"] = 1
            error = assert_openai_error(http.post(path, json=body), 400)
            assert "arguments" in (error["param"] or ""), error

    @pytest.mark.parametrize("field", ["guided_json", "structured_outputs"])
    @pytest.mark.parametrize("text", [DEEP, '{"type": "string", "x": "\\udfff"}'])
    def test_schemas_given_as_text(self, http: httpx.Client, model, field, text) -> None:
        value = {"json": text} if field == "structured_outputs" else text
        for path in ("/v1/chat/completions", "/v1/completions"):
            body = chat_body(model, "Hi", **{field: value})
            if path == "/v1/completions":
                body = {k: v for k, v in body.items() if k != "messages"} | {"prompt": "Hi"}
            error = assert_openai_error(http.post(path, json=body), 400)
            assert (error["param"] or "").startswith(field), error

    def test_every_private_use_character_and_a_control_token(
        self, http: httpx.Client, model: str
    ) -> None:
        private = "".join(
            chr(c) for r in ((0xF0000, 0xFFFFE), (0x100000, 0x10FFFE)) for c in range(*r)
        )
        private += "".join(chr(c) for c in range(0xE000, 0xF900))
        content = private + "<|im_start|>"
        error = assert_openai_error(
            http.post("/v1/chat/completions", json=chat_body(model, content)), 400
        )
        assert error["param"] == "messages", error


class TestTinyTemperature:
    def test_1e_40_is_greedy(self, http: httpx.Client, model: str) -> None:
        def text(temperature: float) -> str:
            body = {"model": model, "prompt": "The capital of France is", "max_tokens": 8}
            response = http.post("/v1/completions", json=body | {"temperature": temperature})
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"]

        assert text(1e-40) == text(0.0) == text(1e-6)


class TestEchoOffsets:
    def test_offsets_index_the_echoed_text_around_special_tokens(
        self, http: httpx.Client, model: str
    ) -> None:
        prompt = "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
        body = {"model": model, "prompt": prompt, "max_tokens": 3, "temperature": 0}
        response = http.post("/v1/completions", json=body | {"echo": True, "logprobs": 0})
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        text, logprobs = choice["text"], choice["logprobs"]
        assert text.startswith(prompt), text
        offsets = logprobs["text_offset"]
        assert offsets == sorted(offsets), offsets
        for token, offset in zip(logprobs["tokens"], offsets, strict=True):
            if not token.startswith("bytes:"):
                assert text[offset : offset + len(token)] == token, (token, offset, text)


class TestImpossibleGrammars:
    def test_an_empty_character_class_is_a_400(self, http: httpx.Client, model: str) -> None:
        for regex in ("[^\\x00-\\U0010FFFF]", "[^\\s\\S]"):
            body = chat_body(model, "Hi", guided_regex=regex)
            error = assert_openai_error(http.post("/v1/chat/completions", json=body), 400)
            assert error["code"] == "grammar_unsatisfiable", error
            assert error["param"] == "guided_regex", error

    def test_a_regex_of_the_empty_string_is_still_served(self, http, model: str) -> None:
        body = chat_body(model, "Hi", guided_regex="")
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == ""


class TestDnsRebinding:
    def test_a_foreign_host_is_refused(self, server: BackgroundServer, model: str) -> None:
        for host in ("evil.example", "evil.example:8000", "127.0.0.1.nip.io", "10.0.0.1"):
            response = httpx.get(server.url + "/v1/models", headers={"Host": host})
            error = assert_openai_error(response, 400)
            assert error["code"] == "invalid_host", error
        health = httpx.get(server.url + "/health", headers={"Host": "evil.example"})
        assert health.status_code == 400, "every route of a rebound name is refused"

    def test_loopback_names_are_accepted(self, server: BackgroundServer) -> None:
        for host in (
            f"localhost:{server.port}",
            f"127.0.0.1:{server.port}",
            "[::1]:80",
            "LOCALHOST",
        ):
            response = httpx.get(server.url + "/v1/models", headers={"Host": host})
            assert response.status_code == 200, (host, response.text)

    def test_allowed_hosts_widen_the_list(self, smollm: LoadedModel) -> None:
        config = ServerConfig(port=0, allowed_hosts="mlx.lan,Box.Local")
        with running_server(smollm, EngineConfig(max_total_tokens=64), config) as srv:
            for host, status in (("mlx.lan:8000", 200), ("box.local", 200), ("evil.lan", 400)):
                response = httpx.get(srv.url + "/health", headers={"Host": host})
                assert response.status_code == status, (host, response.text)
