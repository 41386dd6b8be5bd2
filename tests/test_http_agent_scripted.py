"""What the agent APIs make of chosen engine output, over HTTP: a reasoning model's thinking
as Anthropic ``thinking`` blocks and Responses ``reasoning`` items (streamed and not, with
its token count), the requests' reasoning wishes reaching the chat template's switch, and a
failure after the stream began reported in-band (Anthropic's ``error`` event, the Responses
API's ``response.failed``).

The engine is ``tests/scripted_engine.ScriptedEngine`` (no model runs); the tokenizer is
SmolLM2's, with the chat template each test needs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.outputs import RequestOutput
from mlxserve.scheduler.sampling_params import SamplingParams
from mlxserve.server.app import create_app
from mlxserve.server.config import ServerConfig
from tests.scripted_engine import ScriptedEngine, scripted_client, tokenizer_with_template
from tests.test_http_scripted import OPENING_TEMPLATE, answering

THOUGHT = "Let me think.\n</think>\n\nHello!"
HI = [{"role": "user", "content": "Hi"}]
# Reads both reasoning switches, and shows what it got in the prompt.
SWITCH_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if enable_thinking is defined %}THINK={{ enable_thinking }}{% endif %}"
    "{% if reasoning_effort is defined %}EFFORT={{ reasoning_effort }}{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def events(client: TestClient, path: str, body: dict[str, Any]) -> list[tuple[str, dict]]:
    """``(event name, data)`` of a streamed call."""
    with client.stream("POST", path, json=body | {"stream": True}) as response:
        assert response.status_code == 200, response.read()
        lines = list(response.iter_lines())
    names = [line[7:] for line in lines if line.startswith("event: ")]
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert len(names) == len(data), lines
    return list(zip(names, data, strict=True))


@pytest.fixture
def thinking(smollm: LoadedModel) -> tuple[TestClient, ScriptedEngine]:
    """An app whose model reasons (the template opens ``<think>``) and answers THOUGHT."""
    tokenizer = tokenizer_with_template(smollm.tokenizer, OPENING_TEMPLATE)
    return scripted_client(tokenizer, answering(tokenizer, THOUGHT))


MESSAGES_BODY = {"model": "scripted", "max_tokens": 64, "messages": HI}
RESPONSES_BODY = {"model": "scripted", "max_output_tokens": 64, "input": "Hi"}


class TestAnthropicThinking:
    def test_thinking_then_text_blocks(self, thinking) -> None:
        client, _ = thinking
        message = client.post("/v1/messages", json=MESSAGES_BODY).json()
        assert message["content"] == [
            {"type": "thinking", "thinking": "Let me think.", "signature": ""},
            {"type": "text", "text": "Hello!"},
        ], message
        assert message["stop_reason"] == "end_turn", message

    def test_streamed_blocks(self, thinking) -> None:
        client, _ = thinking
        seen = events(client, "/v1/messages", MESSAGES_BODY)
        starts = [d for n, d in seen if n == "content_block_start"]
        assert [(s["index"], s["content_block"]["type"]) for s in starts] == [
            (0, "thinking"),
            (1, "text"),
        ], starts
        deltas = [d for n, d in seen if n == "content_block_delta"]
        thought = "".join(d["delta"].get("thinking", "") for d in deltas if d["index"] == 0)
        text = "".join(d["delta"].get("text", "") for d in deltas if d["index"] == 1)
        assert (thought, text) == ("Let me think.", "Hello!"), deltas
        stops = [d["index"] for n, d in seen if n == "content_block_stop"]
        assert stops == [0, 1], seen


class TestResponsesReasoning:
    def test_reasoning_item_and_tokens(self, thinking) -> None:
        client, _ = thinking
        response = client.post("/v1/responses", json=RESPONSES_BODY).json()
        reasoning, message = response["output"]
        assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_"), reasoning
        assert reasoning["content"] == [{"type": "reasoning_text", "text": "Let me think."}]
        assert message["content"][0]["text"] == "Hello!", message
        usage = response["usage"]
        reasoning_tokens = usage["output_tokens_details"]["reasoning_tokens"]
        assert 0 < reasoning_tokens < usage["output_tokens"], usage

    def test_streamed_reasoning(self, thinking) -> None:
        client, _ = thinking
        seen = events(client, "/v1/responses", RESPONSES_BODY)
        by_kind: dict[str, list[dict]] = {}
        for name, data in seen:
            by_kind.setdefault(name, []).append(data)
        thought = "".join(d["delta"] for d in by_kind["response.reasoning_text.delta"])
        text = "".join(d["delta"] for d in by_kind["response.output_text.delta"])
        assert (thought, text) == ("Let me think.", "Hello!"), by_kind
        assert {d["output_index"] for d in by_kind["response.reasoning_text.delta"]} == {0}
        assert {d["output_index"] for d in by_kind["response.output_text.delta"]} == {1}
        final = seen[-1][1]["response"]
        assert [item["type"] for item in final["output"]] == ["reasoning", "message"], final


@pytest.fixture
def switch(smollm: LoadedModel) -> tuple[TestClient, ScriptedEngine, Callable[[], str]]:
    """An app whose template shows the reasoning switches it was given; the last prompt."""
    tokenizer = tokenizer_with_template(smollm.tokenizer, SWITCH_TEMPLATE)
    client, engine = scripted_client(tokenizer, answering(tokenizer, "ok"))
    return client, engine, lambda: tokenizer.decode(engine.requests[-1][1])


class TestReasoningSwitch:
    @pytest.mark.parametrize(
        ("fields", "shows", "hides"),
        [
            ({"thinking": {"type": "disabled"}}, "THINK=False", "EFFORT"),
            ({"thinking": {"type": "enabled", "budget_tokens": 16}}, "THINK=True", "EFFORT"),
            ({"thinking": {"type": "adaptive"}}, "THINK=True", "EFFORT"),
            ({"output_config": {"effort": "max"}}, "EFFORT=high", "THINK=True"),
            # No wish: mlx-lm's default (this model has no thinking tokens).
            ({}, "THINK=False", "EFFORT"),
        ],
    )
    def test_anthropic(self, switch, fields, shows: str, hides: str) -> None:
        client, _, prompt = switch
        response = client.post("/v1/messages", json=MESSAGES_BODY | fields)
        assert response.status_code == 200, response.text
        assert shows in prompt() and hides not in prompt(), prompt()

    @pytest.mark.parametrize(
        ("effort", "shows"),
        [("none", "THINK=False"), ("minimal", "EFFORT=low"), ("medium", "EFFORT=medium")],
    )
    def test_responses(self, switch, effort: str, shows: str) -> None:
        client, _, prompt = switch
        body = RESPONSES_BODY | {"reasoning": {"effort": effort}}
        assert client.post("/v1/responses", json=body).status_code == 200
        assert shows in prompt(), prompt()


class FailingEngine(ScriptedEngine):
    """Answers two tokens of the script, then fails the request."""

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        on_output: Callable[[RequestOutput], None],
        grammar: Any = None,
        constraint: Any = None,
        cache_namespace: str = "",
    ) -> None:
        self.requests.append((request_id, list(prompt_ids), params))
        for token in self.script(prompt_ids, params)[:2]:
            on_output(RequestOutput(request_id, [token]))
        on_output(RequestOutput(request_id, [], True, "error", error="the forward raised"))


@pytest.fixture
def failing(smollm: LoadedModel) -> TestClient:
    tokenizer = smollm.tokenizer
    engine = FailingEngine(answering(tokenizer, "Hello there, friend."))
    loaded = LoadedModel(None, tokenizer, "scripted", {"vocab_size": len(tokenizer)}, 4096)
    return TestClient(create_app(loaded, engine, ServerConfig()), base_url="http://localhost")


class TestFailureMidStream:
    def test_anthropic_error_event(self, failing: TestClient) -> None:
        seen = events(failing, "/v1/messages", MESSAGES_BODY)
        names = [name for name, _ in seen]
        assert names[0] == "message_start" and names[-1] == "error", names
        assert "content_block_delta" in names and "message_stop" not in names, names
        error = seen[-1][1]
        assert error["type"] == "error" and error["error"]["type"] == "api_error", error
        assert "the forward raised" in error["error"]["message"], error

    def test_anthropic_plain_is_a_500_in_its_shape(self, failing: TestClient) -> None:
        response = failing.post("/v1/messages", json=MESSAGES_BODY)
        assert response.status_code == 500, response.text
        assert response.json()["error"]["type"] == "api_error", response.text

    def test_responses_failed_event(self, failing: TestClient) -> None:
        seen = events(failing, "/v1/responses", RESPONSES_BODY)
        names = [name for name, _ in seen]
        assert names[-1] == "response.failed", names
        assert "response.output_text.delta" in names, names
        final = seen[-1][1]["response"]
        assert final["status"] == "failed", final
        assert final["error"]["code"] == "server_error", final
        assert "the forward raised" in final["error"]["message"], final
        stored = failing.get(f"/v1/responses/{final['id']}").json()
        assert stored["status"] == "failed", "a failed response is stored as it was sent"
