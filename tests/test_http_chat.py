"""Chat messages (content parts, tool messages, continuing an assistant message), /tokenize,
/detokenize and /v1/models/{id} over HTTP with the real server and embedded SmolLM2."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.config import EngineConfig
from mlxserve.server.lifecycle.launch import BackgroundServer
from tests.ops_helpers import running_server
from tests.test_http_errors import assert_openai_error

ENGINE_CONFIG = EngineConfig(max_total_tokens=4096, max_running_requests=8)
HI = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
# An assistant answer the model is asked to continue (greedy: " can I help you?").
PARTIAL = HI + [{"role": "assistant", "content": "Hello! How"}]
TOOL_TURN = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
]


@pytest.fixture(scope="module")
def server(smollm: LoadedModel) -> Iterator[BackgroundServer]:
    with running_server(smollm, ENGINE_CONFIG) as srv:
        yield srv


def chat(http: httpx.Client, model: str, **fields: Any) -> dict[str, Any]:
    body = {"model": model, "messages": HI, "temperature": 0, "max_tokens": 2} | fields
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def tokenize(http: httpx.Client, **body: Any) -> dict[str, Any]:
    response = http.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    return response.json()


class TestMessages:
    def test_text_parts_equal_a_string(self, http, model: str, smollm: LoadedModel) -> None:
        parts = [HI[0], {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
        with_parts, plain = chat(http, model, messages=parts), chat(http, model)
        assert with_parts["choices"][0]["message"] == plain["choices"][0]["message"]
        assert with_parts["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]

    def test_non_text_part_is_named(self, http: httpx.Client, model: str) -> None:
        part = {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}
        body = {"model": model, "messages": [{"role": "user", "content": [part]}]}
        error = assert_openai_error(http.post("/v1/chat/completions", json=body), 400)
        assert "input_audio" in error["message"], error

    def test_tool_messages_reach_the_template(self, http, model: str) -> None:
        reply = chat(http, model, messages=TOOL_TURN)
        rendered = tokenize(http, messages=TOOL_TURN)
        assert reply["usage"]["prompt_tokens"] == rendered["count"]
        text = http.post("/detokenize", json={"tokens": rendered["tokens"]}).json()["prompt"]
        # A template without tool support gets them in the default (Hermes) format.
        call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        assert f"<|im_start|>assistant\n{call}<|im_end|>" in text, text
        assert "<|im_start|>tool\n<tool_response>\nSunny, 21 C\n</tool_response><|im_end|>" in text

    @pytest.mark.parametrize(
        ("message", "param"),
        [
            ({"role": "tool", "content": "x"}, "messages[0]"),
            ({"role": "user", "content": "x", "tool_call_id": "c"}, "messages[0]"),
            ({"role": "user", "content": "x", "tool_calls": []}, "messages[0]"),
            ({"role": "function", "content": "x", "name": "f"}, "messages[0].role"),
        ],
        ids=["tool-without-id", "id-on-user", "tool-calls-on-user", "function-role"],
    )
    def test_bad_tool_fields(self, http: httpx.Client, model: str, message, param) -> None:
        body = {"model": model, "messages": [message]}
        assert_openai_error(http.post("/v1/chat/completions", json=body), 400, param=param)

    def test_name_is_accepted(self, http: httpx.Client, model: str) -> None:
        messages = [HI[0], HI[1] | {"name": "alice"}]
        assert chat(http, model, messages=messages, max_tokens=1)["choices"]


class TestContinueFinalMessage:
    def test_continues_the_assistant_message(self, http: httpx.Client, model: str) -> None:
        reply = chat(http, model, messages=PARTIAL, continue_final_message=True, max_tokens=3)
        assert reply["choices"][0]["message"]["content"] == " can I help"
        rendered = tokenize(http, messages=PARTIAL, continue_final_message=True)
        assert reply["usage"]["prompt_tokens"] == rendered["count"]
        text = http.post("/detokenize", json={"tokens": rendered["tokens"]}).json()["prompt"]
        assert text.endswith("<|im_start|>assistant\nHello! How"), "left open"

    def test_add_generation_prompt_false_continues_too(self, http, model: str) -> None:
        reply = chat(http, model, messages=PARTIAL, add_generation_prompt=False, max_tokens=3)
        assert reply["choices"][0]["message"]["content"] == " can I help"

    def test_needs_a_final_assistant_message(self, http: httpx.Client, model: str) -> None:
        body = {"model": model, "messages": HI, "continue_final_message": True}
        error = assert_openai_error(http.post("/v1/chat/completions", json=body), 400)
        assert error["param"] == "continue_final_message" and "assistant" in error["message"]

    def test_not_with_add_generation_prompt(self, http: httpx.Client, model: str) -> None:
        body = {"model": model, "messages": PARTIAL, "continue_final_message": True}
        body["add_generation_prompt"] = True
        response = http.post("/v1/chat/completions", json=body)
        assert_openai_error(response, 400, param="continue_final_message")

    def test_reserved_template_kwargs(self, http: httpx.Client, model: str) -> None:
        body = {"model": model, "messages": HI, "chat_template_kwargs": {"tokenize": True}}
        response = http.post("/v1/chat/completions", json=body)
        assert_openai_error(response, 400, param="chat_template_kwargs")


class TestTokenize:
    def test_round_trip(self, http: httpx.Client, smollm: LoadedModel) -> None:
        text = "The capital of France is Paris. ☕"
        body = tokenize(http, prompt=text, return_token_strs=True)
        assert body["tokens"] == list(smollm.tokenizer.encode(text))
        assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 4096
        assert body["token_strs"][:2] == ["The", "Ġcapital"]
        assert http.post("/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": text}

    def test_messages_count_equals_chat_usage(self, http, model: str) -> None:
        body = tokenize(http, model=model, messages=HI)
        assert body["token_strs"] is None
        assert body["count"] == chat(http, model, max_tokens=1)["usage"]["prompt_tokens"]
        plain = tokenize(http, messages=HI, add_generation_prompt=False)
        assert plain["count"] < body["count"]

    @pytest.mark.parametrize(
        ("path", "body", "param"),
        [
            ("/detokenize", {"tokens": [49152]}, "tokens"),
            ("/detokenize", {"tokens": [-1]}, "tokens"),
            ("/detokenize", {"tokens": [True]}, "tokens"),
            ("/detokenize", {"tokens": "abc"}, "tokens"),
            ("/tokenize", {}, "prompt"),
            ("/tokenize", {"prompt": "a", "messages": HI}, "prompt"),
            ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, None),
            ("/tokenize", {"prompt": 5}, "prompt"),
            ("/tokenize", {"prompt": "a", "frobnicate": 1}, "frobnicate"),
        ],
        ids=lambda v: repr(v)[:30],
    )
    def test_bad_requests(self, http: httpx.Client, path: str, body: dict, param) -> None:
        assert_openai_error(http.post(path, json=body), 400, param=param)

    def test_unknown_model(self, http: httpx.Client) -> None:
        response = http.post("/tokenize", json={"model": "gpt-17", "prompt": "a"})
        assert_openai_error(response, 404, code="model_not_found")


class TestModels:
    def test_retrieve_reports_the_context_length(self, http: httpx.Client, model: str) -> None:
        card = http.get(f"/v1/models/{model}").json()
        assert card["id"] == model and card["object"] == "model"
        assert card["max_model_len"] == 4096

    def test_unknown_id_is_404(self, http: httpx.Client) -> None:
        assert_openai_error(http.get("/v1/models/nope"), 404, code="model_not_found")


def test_engine_idle_and_slots_accounted(server: BackgroundServer) -> None:
    assert server.engine.wait_idle(60), "engine did not go idle"
    server.engine.check_integrity()
