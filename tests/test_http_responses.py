"""The OpenAI Responses API over HTTP with the official ``openai`` SDK and the embedded
SmolLM2, greedy and few tokens: plain and streamed answers agree (the typed event sequence,
deltas concatenating to the final text), ``instructions``, ``max_output_tokens`` ->
``incomplete``, ``text.format`` json_schema always valid, a function call and its
``function_call_output`` continuation, ``previous_response_id`` (the second turn sees the
first, its shared prefix cached), the stored responses' routes, ``store: false``, the store's
bound, and 400s naming what is not supported."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.config import EngineConfig
from mlxserve.server.config import ServerConfig
from mlxserve.server.lifecycle.launch import BackgroundServer
from tests.ops_helpers import running_server
from tests.test_http_errors import assert_openai_error

ENGINE_CONFIG = EngineConfig(max_total_tokens=8192, max_running_requests=8)
STORE_SIZE = 12
HELLO = "Say hello."
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


@pytest.fixture(scope="module")
def server(smollm: LoadedModel) -> Iterator[BackgroundServer]:
    config = ServerConfig(port=0, responses_store_size=STORE_SIZE)
    with running_server(smollm, ENGINE_CONFIG, config) as srv:
        yield srv


def create(client: openai.OpenAI, model: str, **fields: Any) -> Any:
    """A greedy Responses call."""
    fields = {"input": HELLO, "max_output_tokens": 12, "temperature": 0} | fields
    return client.responses.create(model=model, **fields)


def events_of(http: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The data of every event of a streamed call (each checked against its event name)."""
    with http.stream("POST", "/v1/responses", json=body | {"stream": True}) as response:
        assert response.status_code == 200, response.read()
        lines = list(response.iter_lines())
    names = [line[7:] for line in lines if line.startswith("event: ")]
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert [d["type"] for d in data] == names, lines
    return data


class TestPlain:
    def test_response_shape(self, client, model: str) -> None:
        r = create(client, model, max_output_tokens=200, input="Hi")
        assert r.id.startswith("resp_") and r.object == "response", r
        assert r.status == "completed" and r.error is None and r.incomplete_details is None, r
        assert [item.type for item in r.output] == ["message"], r
        assert r.output[0].id.startswith("msg_") and r.output[0].status == "completed", r
        assert r.output_text.strip(), r
        usage = r.usage
        assert usage.input_tokens > 10 and 0 < usage.output_tokens < 200, usage
        assert usage.total_tokens == usage.input_tokens + usage.output_tokens, usage
        assert usage.output_tokens_details.reasoning_tokens == 0, usage
        assert r.model == model and r.store is True and r.temperature == 0, r

    def test_max_output_tokens_is_incomplete(self, client, model: str) -> None:
        r = create(client, model)
        assert r.status == "incomplete", r
        assert r.incomplete_details.reason == "max_output_tokens", r
        assert r.usage.output_tokens == 12 and r.output[0].status == "incomplete", r

    def test_instructions_are_the_system_prompt(self, client, model: str) -> None:
        plain = create(client, model)
        told = create(client, model, instructions="You answer in French.")
        # (They replace the template's default system prompt: the count changes, either way.)
        assert told.usage.input_tokens != plain.usage.input_tokens, (told.usage, plain.usage)
        assert told.instructions == "You answer in French.", told
        assert told.output_text != plain.output_text, "the instructions change the answer"


class TestStreaming:
    def test_event_sequence_and_deltas(self, client, http, model: str) -> None:
        plain = create(client, model)
        body = {"model": model, "input": HELLO, "max_output_tokens": 12, "temperature": 0}
        events = events_of(http, body)
        kinds = [e["type"] for e in events]
        assert kinds[:4] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
        ], kinds
        assert kinds[-4:] == [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.incomplete",
        ], kinds
        assert set(kinds[4:-4]) == {"response.output_text.delta"}, kinds
        assert [e["sequence_number"] for e in events] == list(range(len(events))), events
        deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        final = events[-1]["response"]
        assert deltas == plain.output_text == final["output"][0]["content"][0]["text"], deltas
        assert events[-4]["text"] == deltas, events[-4]
        assert final["usage"]["output_tokens"] == 12, final["usage"]
        assert events[0]["response"]["status"] == "in_progress", events[0]
        item_ids = {e.get("item_id") for e in events[3:-2]}
        assert item_ids == {final["output"][0]["id"]}, item_ids

    def test_sdk_stream_final_response(self, client, model: str) -> None:
        fields = {"input": "Hi", "max_output_tokens": 200, "temperature": 0}
        plain = client.responses.create(model=model, **fields)
        with client.responses.stream(model=model, **fields) as stream:
            text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
            final = stream.get_final_response()
        assert text == final.output_text == plain.output_text, (text, plain.output_text)
        assert final.status == "completed", final


class TestTextFormat:
    SCHEMA = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"],
        "additionalProperties": False,
    }

    def test_json_schema_always_valid(self, client, model: str) -> None:
        fmt = {"format": {"type": "json_schema", "name": "person", "schema": self.SCHEMA}}
        for _ in range(2):
            r = create(
                client, model, input="A person?", text=fmt, temperature=1.0, max_output_tokens=60
            )
            assert r.status == "completed", ("the schema's objects fit the budget", r)
            jsonschema.validate(json.loads(r.output_text), self.SCHEMA)
            assert r.text.format.type == "json_schema", r.text

    def test_json_object(self, client, model: str) -> None:
        fmt = {"format": {"type": "json_object"}}
        r = create(client, model, input="A person as JSON?", text=fmt, max_output_tokens=30)
        if r.status == "completed":
            assert isinstance(json.loads(r.output_text), dict), r.output_text
        else:
            assert r.output_text.startswith("{"), r.output_text


class TestFunctionCalls:
    def test_call_and_output_continuation(self, client, model: str) -> None:
        first = create(
            client,
            model,
            input="Weather in Paris?",
            tools=[WEATHER],
            tool_choice="required",
            parallel_tool_calls=False,
            max_output_tokens=40,
        )
        calls = [item for item in first.output if item.type == "function_call"]
        assert first.status == "completed" and len(calls) == 1, first.output
        call = calls[0]
        assert call.call_id.startswith("call_") and call.id.startswith("fc_"), call
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
        output = {"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}
        chained = create(
            client, model, previous_response_id=first.id, input=[output], tools=[WEATHER]
        )
        replayed = create(
            client,
            model,
            input=[
                {"role": "user", "content": "Weather in Paris?"},
                call.model_dump(exclude_none=True),
                output,
            ],
            tools=[WEATHER],
        )
        assert chained.output_text, chained
        assert chained.usage.input_tokens > first.usage.input_tokens, "the call is in the prompt"
        cached = chained.usage.input_tokens_details.cached_tokens
        assert cached >= first.usage.input_tokens, ("the first turn is cached", chained.usage)
        # The stored conversation is the one the client would replay: the same prompt.
        assert replayed.usage.input_tokens == chained.usage.input_tokens, replayed.usage
        assert replayed.output_text == chained.output_text, replayed

    def test_named_function_streams_its_arguments(self, http, model: str) -> None:
        body = {
            "model": model,
            "input": "Weather in Paris?",
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "max_output_tokens": 40,
            "temperature": 0,
        }
        events = events_of(http, body)
        kinds = [e["type"] for e in events]
        assert "response.function_call_arguments.delta" in kinds, kinds
        done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
        jsonschema.validate(json.loads(done["arguments"]), WEATHER["parameters"])
        item = events[-1]["response"]["output"][0]
        assert item["type"] == "function_call" and item["arguments"] == done["arguments"], item


class TestConversationState:
    def test_second_turn_sees_the_first(self, client, model: str) -> None:
        first = create(client, model, input="My name is Ada.", max_output_tokens=8)
        second = create(client, model, input="What is my name?", previous_response_id=first.id)
        seen = first.usage.input_tokens + first.usage.output_tokens
        assert second.usage.input_tokens > seen, (first.usage, second.usage)
        assert second.usage.input_tokens_details.cached_tokens > 0, second.usage
        assert second.previous_response_id == first.id, second
        items = client.responses.input_items.list(second.id, order="asc")
        assert [i.type for i in items.data] == ["message"], items
        assert items.data[0].content[0].text == "What is my name?", items

    def test_get_and_delete(self, client, http, model: str) -> None:
        r = create(client, model, max_output_tokens=2)
        got = client.responses.retrieve(r.id)
        assert got.model_dump() == r.model_dump(), "GET returns the stored response"
        assert http.delete(f"/v1/responses/{r.id}").json() == {
            "id": r.id,
            "object": "response",
            "deleted": True,
        }
        assert_openai_error(http.get(f"/v1/responses/{r.id}"), 404)
        assert_openai_error(http.delete(f"/v1/responses/{r.id}"), 404)
        with pytest.raises(openai.NotFoundError):
            create(client, model, previous_response_id=r.id)

    def test_store_false_keeps_nothing(self, client, http, model: str) -> None:
        r = create(client, model, max_output_tokens=2, store=False)
        assert r.store is False, r
        assert_openai_error(http.get(f"/v1/responses/{r.id}"), 404)
        assert_openai_error(http.get(f"/v1/responses/{r.id}/input_items"), 404)

    def test_input_items_pages(self, client, http, model: str) -> None:
        turns = [{"role": "user", "content": f"Line {i}."} for i in range(5)]
        r = create(client, model, input=turns, max_output_tokens=1)
        page = http.get(f"/v1/responses/{r.id}/input_items", params={"limit": 2}).json()
        texts = [item["content"][0]["text"] for item in page["data"]]
        assert texts == ["Line 4.", "Line 3."] and page["has_more"], page
        after = {"limit": 10, "after": page["last_id"]}
        rest = http.get(f"/v1/responses/{r.id}/input_items", params=after).json()
        assert [i["content"][0]["text"] for i in rest["data"]] == ["Line 2.", "Line 1.", "Line 0."]
        assert not rest["has_more"], rest

    def test_the_store_is_bounded(self, client, http, model: str) -> None:
        ids = [create(client, model, max_output_tokens=1).id for _ in range(STORE_SIZE + 1)]
        assert_openai_error(http.get(f"/v1/responses/{ids[0]}"), 404)
        assert http.get(f"/v1/responses/{ids[-1]}").status_code == 200


BAD = [
    ({"tools": [{"type": "web_search"}]}, "web_search", "tools"),
    ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "file_search", "tools"),
    (
        {"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}},
        "allowed_tools",
        None,
    ),
    ({"tool_choice": "required"}, "tools", "tool_choice"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input_image",
        "input[0].content[0]",
    ),
    ({"input": [{"type": "computer_call"}]}, "computer_call", "input[0].type"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "call_id", None),
    ({"input": [{"role": "robot", "content": "x"}]}, "role", None),
    ({"input": [{"type": "item_reference", "id": "msg_nope"}]}, "msg_nope", "input[0].id"),
    ({"input": []}, "at least one", "input"),
    ({"truncation": "auto"}, "truncation", None),
    ({"background": True}, "background", None),
    ({"top_logprobs": 3}, "top_logprobs", None),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", None),
    ({"conversation": "conv_1"}, "conversation", None),
    ({"max_output_tokens": 0}, "max_output_tokens", None),
    ({"temperature": 3}, "temperature", None),
    ({"seed": 1}, "seed", None),
    (
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"$ref": "#/no"}}}},
        "",
        None,
    ),
]


class TestRefused:
    @pytest.mark.parametrize(("fields", "says", "param"), BAD, ids=lambda v: str(v)[:40])
    def test_400_naming_what(self, http, model: str, fields, says, param) -> None:
        body = {"model": model, "input": HELLO, "max_output_tokens": 2} | fields
        error = assert_openai_error(http.post("/v1/responses", json=body), 400)
        assert says in error["message"], error
        if param is not None:
            assert error["param"] == param, error

    def test_unknown_previous_response_is_404(self, http, model: str) -> None:
        body = {"model": model, "input": HELLO, "previous_response_id": "resp_nope"}
        error = assert_openai_error(http.post("/v1/responses", json=body), 404)
        assert "resp_nope" in error["message"], error

    def test_accepted_and_ignored(self, client, model: str) -> None:
        r = create(
            client,
            model,
            max_output_tokens=2,
            include=["reasoning.encrypted_content"],
            prompt_cache_key="k",
            safety_identifier="s",
            service_tier="auto",
            metadata={"run": "1"},
            user="u",
            truncation="disabled",
            text={"verbosity": "low"},
            reasoning={"effort": "low", "summary": "auto"},
        )
        assert r.metadata == {"run": "1"} and r.output_text, r
