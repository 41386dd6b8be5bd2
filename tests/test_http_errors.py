"""Bad requests get OpenAI-shaped 4xx errors, and the server keeps serving afterwards.

The real server, engine and embedded SmolLM2 (one server for the module); raw HTTP through
httpx so that malformed bodies can be sent.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.config import EngineConfig
from mlxserve.server.app import create_app
from mlxserve.server.config import ServerConfig
from mlxserve.server.http.errors import APIError
from mlxserve.server.lifecycle.engines import build_engine
from mlxserve.server.lifecycle.launch import BackgroundServer
from mlxserve.server.serving.prompts import resolve_max_tokens
from tests.ops_helpers import running_server

ENGINE_CONFIG = EngineConfig(max_total_tokens=4096, max_running_requests=8)
CONTEXT = 4096  # the pool caps the model's 8192-token context
# A short system prompt keeps the prompt short (the default one is 31 tokens): prefill is slow.
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(smollm: LoadedModel) -> Iterator[BackgroundServer]:
    with running_server(smollm, ENGINE_CONFIG) as srv:
        yield srv


def assert_openai_error(
    response: httpx.Response, status: int, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The response is ``status`` with ``{"error": {message, type, param, code}}``."""
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    expected_type = "invalid_request_error" if status < 500 else "server_error"
    assert error["type"] == expected_type, error
    if param is not None:
        assert error["param"] == param, error
        assert param.split(".")[0].split("[")[0] in error["message"], "message names the param"
    if code is not None:
        assert error["code"] == code, error
    return error


def assert_still_serving(http: httpx.Client, model: str) -> None:
    body = {"model": model, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")


def chat(model: str, **fields: Any) -> dict[str, Any]:
    return {"model": model, "messages": MESSAGES, "max_tokens": 4} | fields


class TestMalformedBodies:
    @pytest.mark.parametrize(
        "raw", [b"{not json", b"", b"[1, 2]", b'"a string"', b'{"model": "m",}'], ids=repr
    )
    def test_not_a_json_object(self, http: httpx.Client, raw: bytes) -> None:
        response = http.post(
            "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
        )
        assert_openai_error(response, 400)

    def test_server_serves_after_malformed_json(self, http: httpx.Client, model: str) -> None:
        http.post("/v1/completions", content=b"{", headers={"content-type": "application/json"})
        assert_still_serving(http, model)


class TestChatValidation:
    @pytest.mark.parametrize(
        ("fields", "param"),
        [
            ({"messages": None}, "messages"),
            ({"messages": "Hi"}, "messages"),
            ({"messages": []}, "messages"),
            ({"messages": [{"content": "Hi"}]}, "messages[0].role"),
            ({"messages": [{"role": "wizard", "content": "Hi"}]}, "messages[0].role"),
            ({"messages": [{"role": "user"}]}, "messages[0].content"),
            ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
            (
                {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                "messages[0].content",
            ),
            ({"max_tokens": 0}, "max_tokens"),
            ({"max_tokens": -5}, "max_tokens"),
            ({"max_completion_tokens": 0}, "max_completion_tokens"),
            ({"temperature": 2.5}, "temperature"),
            ({"temperature": -0.1}, "temperature"),
            ({"top_p": 0}, "top_p"),
            ({"top_p": 1.5}, "top_p"),
            ({"top_k": -2}, "top_k"),
            ({"min_p": 1.5}, "min_p"),
            ({"stop": 7}, "stop"),
            ({"stop": [""]}, "stop"),
            ({"stop": ["s"] * 5}, "stop"),
            ({"stream": "sometimes"}, "stream"),
            ({"stream_options": {"include_usage": True}}, "stream_options"),
        ],
        ids=lambda v: repr(v)[:40],
    )
    def test_invalid_field(self, http: httpx.Client, model: str, fields: dict, param) -> None:
        response = http.post("/v1/chat/completions", json=chat(model, **fields))
        assert_openai_error(response, 400, param=param)

    def test_missing_messages(self, http: httpx.Client, model: str) -> None:
        response = http.post("/v1/chat/completions", json={"model": model})
        error = assert_openai_error(response, 400, param="messages")
        assert "Missing required parameter" in error["message"], error

    def test_missing_model(self, http: httpx.Client) -> None:
        response = http.post("/v1/chat/completions", json={"messages": MESSAGES})
        assert_openai_error(response, 400, param="model")

    def test_unknown_model(self, http: httpx.Client, model: str) -> None:
        body = chat(model) | {"model": "gpt-17"}
        error = assert_openai_error(
            http.post("/v1/chat/completions", json=body), 404, param="model", code="model_not_found"
        )
        assert "gpt-17" in error["message"], error
        response = http.get("/v1/models/gpt-17")
        assert_openai_error(response, 404, code="model_not_found")


class TestUnsupportedParameters:
    @pytest.mark.parametrize(
        ("param", "value"),
        [
            ("functions", [{"name": "f"}]),
            ("function_call", "auto"),
            ("reasoning_effort", "low"),
            ("prediction", {"type": "content", "content": "x"}),
            ("store", True),
            ("service_tier", "flex"),
        ],
    )
    def test_rejected_by_name(self, http: httpx.Client, model: str, param: str, value) -> None:
        response = http.post("/v1/chat/completions", json=chat(model, **{param: value}))
        error = assert_openai_error(response, 400, param=param)
        assert "not supported" in error["message"], error

    def test_unknown_field_rejected_by_name(self, http: httpx.Client, model: str) -> None:
        response = http.post("/v1/chat/completions", json=chat(model, frobnicate=1))
        error = assert_openai_error(response, 400, param="frobnicate")
        assert "Unrecognized request argument" in error["message"], error

    def test_no_op_values_and_metadata_accepted(self, http: httpx.Client, model: str) -> None:
        body = {"model": model, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
        body |= {"n": 1, "logprobs": None, "presence_penalty": 0, "logit_bias": {}, "user": "u"}
        body |= {"suffix": "", "best_of": 1, "top_k": -1}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text

    def test_completions_reject_their_own_unsupported(self, http: httpx.Client, model) -> None:
        for param, value in [("best_of", 3), ("suffix", "x")]:
            body = {"model": model, "prompt": "Hi", param: value}
            assert_openai_error(http.post("/v1/completions", json=body), 400, param=param)


class TestContextLength:
    def test_prompt_plus_max_tokens_over_context(self, http: httpx.Client, model: str) -> None:
        response = http.post("/v1/chat/completions", json=chat(model, max_tokens=CONTEXT))
        error = assert_openai_error(response, 400, code="context_length_exceeded")
        assert str(CONTEXT) in error["message"], "the message gives the numbers"

    def test_prompt_alone_over_context(self, http: httpx.Client, model: str) -> None:
        body = {"model": model, "prompt": [42] * (CONTEXT + 10)}
        response = http.post("/v1/completions", json=body)
        error = assert_openai_error(response, 400, code="context_length_exceeded")
        assert str(CONTEXT + 10) in error["message"], error

    def test_omitted_max_tokens_runs_to_eos(self, http: httpx.Client, model: str) -> None:
        body = {"model": model, "messages": MESSAGES, "temperature": 0}
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["finish_reason"] == "stop", response.text


class TestResolveMaxTokens:
    """The budget arithmetic behind the context errors (no server needed)."""

    def test_omitted_takes_the_rest_of_the_context(self) -> None:
        assert resolve_max_tokens(100, None, 4096, "prompt") == 3996

    def test_requested_that_fits_is_kept(self) -> None:
        assert resolve_max_tokens(100, 3996, 4096, "prompt") == 3996

    def test_one_token_over_is_rejected(self) -> None:
        with pytest.raises(APIError) as info:
            resolve_max_tokens(100, 3997, 4096, "messages")
        assert info.value.code == "context_length_exceeded"
        assert "4097 tokens (100 in the messages, 3997 in the completion)" in info.value.message

    def test_full_prompt_leaves_no_room(self) -> None:
        with pytest.raises(APIError) as info:
            resolve_max_tokens(4096, None, 4096, "prompt")
        assert info.value.status_code == 400 and info.value.param == "prompt"


class TestCompletionValidation:
    @pytest.mark.parametrize(
        "prompt", [None, "", [], ["a", "b"], [-1], [10**9], [1.5], {"text": "x"}], ids=repr
    )
    def test_bad_prompt(self, http: httpx.Client, model: str, prompt) -> None:
        response = http.post("/v1/completions", json={"model": model, "prompt": prompt})
        assert_openai_error(response, 400, param="prompt")


class TestRoutes:
    def test_unknown_route_is_openai_shaped_404(self, http: httpx.Client) -> None:
        assert_openai_error(http.get("/v1/nothing"), 404)

    def test_wrong_method(self, http: httpx.Client) -> None:
        assert_openai_error(http.get("/v1/chat/completions"), 405)


class TestDeadEngine:
    """With its engine stopped, /health says 503 and generation is refused with JSON."""

    def test_health_and_requests_503(self, smollm: LoadedModel, model: str) -> None:
        engine = build_engine(smollm, EngineConfig(max_total_tokens=256, max_running_requests=1))
        engine.start()
        engine.shutdown()
        with TestClient(
            create_app(smollm, engine, ServerConfig()), base_url="http://localhost"
        ) as client:
            health = client.get("/health")
            assert health.status_code == 503 and health.json()["status"] != "ok", health.text
            response = client.post("/v1/chat/completions", json=chat(model))
            assert_openai_error(response, 503)


class TestCommandLine:
    def test_bad_model_is_one_line_and_nonzero(self) -> None:
        result = subprocess.run(
            [sys.executable, "-m", "mlxserve.server.cli", "--model", "/nonexistent/model.gguf"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode != 0
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "/nonexistent/model.gguf" in lines[0], result.stderr
        assert "Traceback" not in result.stderr

    def test_convert_subcommand(self, tmp_path, capsys) -> None:
        from mlxserve.mlx_backend.loading.loader import embedded_gguf_path
        from mlxserve.server.cli import main

        assert main(["convert", embedded_gguf_path(), str(tmp_path / "out")]) == 0
        assert (tmp_path / "out" / "config.json").is_file(), "the model directory was written"
        assert main(["convert", str(tmp_path / "missing.gguf"), str(tmp_path / "x")]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "missing.gguf" in err[0], err

    def test_help_documents_engine_options(self) -> None:
        from mlxserve.server.cli import build_parser

        text = build_parser().format_help()
        for option in (
            "--model",
            "--host",
            "--port",
            "--max-total-tokens",
            "--max-running-requests",
            "--max-prefill-tokens",
            "--mem-fraction",
            "--seed",
            "convert",
        ):
            assert option in text, f"{option} missing from --help"


class TestStillServing:
    def test_valid_chat_after_all_errors(self, http: httpx.Client, model: str) -> None:
        body = {"model": model, "messages": MESSAGES, "max_tokens": 2, "temperature": 0}
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"], response.text
        health = http.get("/health")
        assert health.status_code == 200 and health.json() == {"status": "ok"}

    def test_engine_idle_and_slots_accounted(self, server: BackgroundServer) -> None:
        assert server.engine.wait_idle(60), "engine did not go idle"
        server.engine.check_integrity()
