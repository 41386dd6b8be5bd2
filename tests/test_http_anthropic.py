"""The Anthropic Messages API over HTTP with the official ``anthropic`` SDK (2.x) and the
embedded SmolLM2, greedy and few tokens: plain and streamed answers agree, the system prompt,
stop sequences and ``max_tokens`` are honoured, forced tool use gives an ``input`` that
validates, a tool result round trip renders, ``output_config.format`` is always valid JSON of
its schema, ``count_tokens`` counts the prompt a real call runs, the key comes as
``x-api-key`` (or Bearer), and every malformed body is a 4xx in Anthropic's error shape."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.config import EngineConfig
from mlxserve.server.config import ServerConfig
from mlxserve.server.lifecycle.launch import BackgroundServer
from tests.anthropic_cases import BAD_BODIES, HELLO, WEATHER
from tests.ops_helpers import running_server

KEY = "anthropic-test-key"
ENGINE_CONFIG = EngineConfig(max_total_tokens=8192, max_running_requests=8)
MAX_BODY = 64 * 1024
GREEDY = {"temperature": 0}
TIME = {
    "name": "get_time",
    "input_schema": {
        "type": "object",
        "properties": {"zone": {"type": "string", "maxLength": 6}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def server(smollm: LoadedModel) -> Iterator[BackgroundServer]:
    config = ServerConfig(port=0, api_key=KEY, max_body_bytes=MAX_BODY)
    with running_server(smollm, ENGINE_CONFIG, config) as srv:
        yield srv


@pytest.fixture(scope="module")
def claude(server: BackgroundServer) -> anthropic.Anthropic:
    """The official client; it sends the key as ``x-api-key``."""
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def raw(server: BackgroundServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120, headers={"x-api-key": KEY}) as c:
        yield c


def create(claude: anthropic.Anthropic, model: str, **fields: Any) -> Any:
    """A greedy Messages call (``temperature`` goes in the body, as 2.x clients send it)."""
    fields = {"max_tokens": 12, "messages": HELLO} | fields
    return claude.messages.create(model=model, extra_body=GREEDY, **fields)


def text_of(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def assert_anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    """The response is Anthropic's error object with ``status`` and ``kind``; its message."""
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind, body
    assert body["error"]["message"], body
    return body["error"]["message"]


class TestPlain:
    def test_message_shape(self, claude, model: str) -> None:
        message = create(claude, model)
        assert message.id.startswith("msg_") and message.type == "message", message
        assert message.role == "assistant" and message.model == model, message
        assert [block.type for block in message.content] == ["text"], message
        assert text_of(message).strip(), message
        assert message.stop_reason == "max_tokens" and message.stop_sequence is None, message
        assert message.usage.output_tokens == 12, message.usage
        assert message.usage.cache_creation_input_tokens == 0, message.usage

    def test_end_turn(self, claude, model: str) -> None:
        message = create(
            claude, model, max_tokens=200, messages=[{"role": "user", "content": "Hi"}]
        )
        assert message.stop_reason == "end_turn", message
        assert message.usage.output_tokens < 200, message.usage

    def test_max_tokens_zero_runs_the_prompt_only(self, claude, model: str) -> None:
        message = create(claude, model, max_tokens=0)
        assert message.content == [] and message.stop_reason == "max_tokens", message


class TestStreaming:
    def test_sdk_stream_text_equals_the_plain_text(self, claude, model: str) -> None:
        plain = create(claude, model)
        with claude.messages.stream(
            model=model, max_tokens=12, messages=HELLO, extra_body=GREEDY
        ) as s:
            streamed = "".join(s.text_stream)
            final = s.get_final_message()
        assert streamed == text_of(plain) == text_of(final), (streamed, plain)
        assert final.stop_reason == plain.stop_reason == "max_tokens", final
        total = final.usage.input_tokens + final.usage.cache_read_input_tokens
        assert total == plain.usage.input_tokens + plain.usage.cache_read_input_tokens, final

    def test_event_sequence(self, raw: httpx.Client, model: str) -> None:
        body = {"model": model, "max_tokens": 6, "messages": HELLO, "stream": True} | GREEDY
        events = stream_events(raw, body)
        names = [name for name, _ in events]
        assert names[:2] == ["message_start", "ping"], names
        assert names[-2:] == ["message_delta", "message_stop"], names
        blocks = [n for n in names if n.startswith("content_block")]
        assert blocks[0] == "content_block_start" and blocks[-1] == "content_block_stop", names
        assert set(blocks[1:-1]) == {"content_block_delta"}, names
        start = events[0][1]["message"]
        assert start["content"] == [] and start["stop_reason"] is None, start
        delta = events[-2][1]
        assert delta["delta"]["stop_reason"] == "max_tokens", delta
        assert delta["usage"]["output_tokens"] == 6, delta
        for name, payload in events:
            assert payload["type"] == name, (name, payload)


def stream_events(raw: httpx.Client, body: dict[str, Any]) -> list[tuple[str, dict]]:
    """``(event name, data)`` of a streamed Messages call."""
    import json

    with raw.stream("POST", "/v1/messages", json=body) as response:
        assert response.status_code == 200, response.read()
        lines = list(response.iter_lines())
    names = [line[7:] for line in lines if line.startswith("event: ")]
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert len(names) == len(data), lines
    return list(zip(names, data, strict=True))


class TestSystemPrompt:
    def test_string_and_blocks_are_one_prompt(self, claude, model: str) -> None:
        system = "You answer in French."
        as_string = create(claude, model, system=system)
        as_blocks = create(claude, model, system=[{"type": "text", "text": system}])
        without = create(claude, model)
        assert text_of(as_string) == text_of(as_blocks), (as_string, as_blocks)
        count = claude.messages.count_tokens(model=model, messages=HELLO, system=system)
        bare = claude.messages.count_tokens(model=model, messages=HELLO)
        assert count.input_tokens != bare.input_tokens, "the system prompt is rendered"
        assert text_of(as_string) != text_of(without), "the system prompt changes the answer"


class TestStopSequences:
    def test_stop_sequence_reason_and_value(self, claude, model: str) -> None:
        text = text_of(create(claude, model))
        word = text.split()[2]
        message = create(claude, model, stop_sequences=["zzz-never", word])
        assert message.stop_reason == "stop_sequence", message
        assert message.stop_sequence == word, message
        assert text_of(message) == text[: text.index(word)], (text, message)


class TestToolUse:
    def test_forced_tool_input_validates(self, claude, model: str) -> None:
        message = create(
            claude,
            model,
            max_tokens=40,
            messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=[WEATHER, TIME],
            tool_choice={"type": "tool", "name": "get_weather"},
        )
        uses = [b for b in message.content if b.type == "tool_use"]
        assert message.stop_reason == "tool_use" and len(uses) == 1, message
        assert uses[0].id.startswith("toolu_") and uses[0].name == "get_weather", uses
        jsonschema.validate(uses[0].input, WEATHER["input_schema"])

    def test_any_tool_at_temperature(self, claude, model: str) -> None:
        message = claude.messages.create(
            model=model,
            max_tokens=40,
            messages=[{"role": "user", "content": "What time is it in Tokyo?"}],
            tools=[WEATHER, TIME],
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            extra_body={"temperature": 1.0},
        )
        uses = [b for b in message.content if b.type == "tool_use"]
        assert message.stop_reason == "tool_use" and len(uses) == 1, message
        schema = {"get_weather": WEATHER, "get_time": TIME}[uses[0].name]["input_schema"]
        jsonschema.validate(uses[0].input, schema)

    def test_streamed_tool_use_equals_the_plain_one(self, claude, model: str) -> None:
        fields = {
            "max_tokens": 40,
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [WEATHER],
            "tool_choice": {"type": "tool", "name": "get_weather"},
        }
        plain = create(claude, model, **fields)
        with claude.messages.stream(model=model, extra_body=GREEDY, **fields) as s:
            final = s.get_final_message()
        assert [b.input for b in final.content] == [b.input for b in plain.content], final
        assert final.stop_reason == "tool_use", final

    def test_tool_result_round_trip(self, claude, model: str) -> None:
        turns = [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me check."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "get_weather",
                        "input": {"city": "Paris", "unit": "C"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 C, sunny"}
                ],
            },
        ]
        message = create(claude, model, messages=turns, tools=[WEATHER])
        assert message.stop_reason in ("max_tokens", "end_turn", "tool_use"), message
        with_result = claude.messages.count_tokens(model=model, messages=turns, tools=[WEATHER])
        blocks = [{"type": "text", "text": "21 C, sunny"}]
        as_blocks = [
            *turns[:2],
            {"role": "user", "content": [turns[2]["content"][0] | {"content": blocks}]},
        ]
        same = claude.messages.count_tokens(model=model, messages=as_blocks, tools=[WEATHER])
        assert same.input_tokens == with_result.input_tokens, "text blocks are the string"
        shorter = [
            *turns[:2],
            {"role": "user", "content": [turns[2]["content"][0] | {"content": ""}]},
        ]
        empty = claude.messages.count_tokens(model=model, messages=shorter, tools=[WEATHER])
        assert empty.input_tokens < with_result.input_tokens, "the result is rendered"


class TestOutputFormat:
    SCHEMA = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }

    def test_always_valid_json(self, claude, model: str) -> None:
        import json

        fmt = {"format": {"type": "json_schema", "schema": self.SCHEMA}}
        for _ in range(2):
            message = claude.messages.create(
                model=model,
                max_tokens=40,
                messages=[{"role": "user", "content": "Describe a person."}],
                output_config=fmt,
                extra_body={"temperature": 1.0},
            )
            assert message.stop_reason == "end_turn", message
            jsonschema.validate(json.loads(text_of(message)), self.SCHEMA)


class TestCountTokens:
    def test_equals_the_prompt_of_a_real_call(self, claude, model: str, smollm) -> None:
        counted = claude.messages.count_tokens(model=model, messages=HELLO).input_tokens
        usage = create(claude, model).usage
        assert counted == usage.input_tokens + usage.cache_read_input_tokens, (counted, usage)
        bare = len(smollm.tokenizer.encode("Say hello.", add_special_tokens=False))
        assert counted > bare + 10, "the chat template is counted"

    def test_repeat_reads_the_cache(self, claude, model: str) -> None:
        messages = [{"role": "user", "content": "Name three rivers of Europe."}]
        create(claude, model, messages=messages, max_tokens=1)
        usage = create(claude, model, messages=messages, max_tokens=1).usage
        assert usage.cache_read_input_tokens > 0, usage
        counted = claude.messages.count_tokens(model=model, messages=messages).input_tokens
        assert usage.input_tokens + usage.cache_read_input_tokens == counted, usage

    def test_tools_are_counted(self, claude, model: str) -> None:
        bare = claude.messages.count_tokens(model=model, messages=HELLO).input_tokens
        tools = claude.messages.count_tokens(model=model, messages=HELLO, tools=[WEATHER])
        assert tools.input_tokens > bare + 20, (tools, bare)


class TestAuth:
    def test_bearer_is_accepted_too(self, server, model: str) -> None:
        client = anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0)
        assert text_of(create(client, model, max_tokens=2)), "Bearer works on /v1/messages"

    @pytest.mark.parametrize(
        "headers", [{}, {"x-api-key": "wrong"}, {"authorization": "Bearer no"}]
    )
    def test_wrong_or_missing_key_is_anthropic_401(self, server, model: str, headers) -> None:
        body = {"model": model, "max_tokens": 2, "messages": HELLO}
        response = httpx.post(server.url + "/v1/messages", json=body, headers=headers)
        assert_anthropic_error(response, 401, "authentication_error")

    def test_sdk_raises_authentication_error(self, server, model: str) -> None:
        client = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError):
            client.messages.count_tokens(model=model, messages=HELLO)

    def test_openai_routes_keep_bearer_and_their_shape(self, server, model: str) -> None:
        body = {"model": model, "max_tokens": 2, "messages": HELLO}
        response = httpx.post(
            server.url + "/v1/chat/completions", json=body, headers={"x-api-key": KEY}
        )
        assert response.status_code == 401 and "error" in response.json(), response.text
        assert response.json()["error"]["code"] == "invalid_api_key", response.text


class TestMalformedBodies:
    @pytest.mark.parametrize(("fields", "says"), BAD_BODIES, ids=lambda v: str(v)[:48])
    def test_400_in_anthropic_shape(self, raw: httpx.Client, model: str, fields, says) -> None:
        response = raw.post("/v1/messages", json={"model": model} | fields)
        message = assert_anthropic_error(response, 400, "invalid_request_error")
        assert says in message, message

    @pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b'"text"'])
    def test_not_a_json_object(self, raw: httpx.Client, content: bytes) -> None:
        response = raw.post(
            "/v1/messages", content=content, headers={"content-type": "application/json"}
        )
        assert_anthropic_error(response, 400, "invalid_request_error")

    def test_unknown_model_is_not_found_error(self, raw: httpx.Client) -> None:
        body = {"model": "claude-opus-9", "max_tokens": 4, "messages": HELLO}
        assert_anthropic_error(raw.post("/v1/messages", json=body), 404, "not_found_error")
        body.pop("max_tokens")
        response = raw.post("/v1/messages/count_tokens", json=body)
        assert_anthropic_error(response, 404, "not_found_error")

    def test_body_too_large_is_413(self, raw: httpx.Client, model: str) -> None:
        body = {
            "model": model,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "x" * MAX_BODY}],
        }
        assert_anthropic_error(raw.post("/v1/messages", json=body), 413, "invalid_request_error")

    def test_accepted_and_ignored_fields(self, claude, model: str) -> None:
        message = create(
            claude,
            model,
            max_tokens=2,
            system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
            metadata={"user_id": "u1"},
            service_tier="auto",
            extra_headers={"anthropic-beta": "prompt-caching-2024-07-31"},
        )
        assert message.usage.output_tokens == 2, message

    def test_sdk_raises_bad_request(self, claude, model: str) -> None:
        with pytest.raises(anthropic.BadRequestError) as caught:
            create(claude, model, messages=[{"role": "user", "content": [{"type": "image"}]}])
        assert "image" in str(caught.value), caught.value

    def test_still_serving(self, claude, model: str) -> None:
        assert text_of(create(claude, model, max_tokens=2)), "the server still answers"
