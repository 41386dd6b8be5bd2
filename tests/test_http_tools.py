"""Tool calling over HTTP with the official ``openai`` client and the embedded SmolLM2, whose
template knows no tools (so the default Hermes format is injected): a named function or
``required`` always gives calls that parse and validate against the function's schema,
even at temperature 0.7; a streamed call reassembles to the non-streamed one; a
conversation with a tool result renders; bad tool fields are 400s."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import pytest

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.config import EngineConfig
from mlxserve.server.lifecycle.launch import BackgroundServer
from tests.ops_helpers import running_server
from tests.test_http_errors import assert_openai_error
from tests.test_http_tools_scripted import reassemble, without_ids

ENGINE_CONFIG = EngineConfig(max_total_tokens=8192, max_running_requests=16)
ASK = [{"role": "user", "content": "What is the weather in Paris? Use the tools."}]


def function(name: str, parameters: dict[str, Any], description: str = "") -> dict[str, Any]:
    spec = {"name": name, "description": description or f"The {name} tool."}
    return {"type": "function", "function": spec | {"parameters": parameters}}


def obj(required: bool = True, **properties: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required else [],
        "additionalProperties": False,
    }


SHORT = {"type": "string", "maxLength": 8}
TOOLS = [
    function("get_weather", obj(city=SHORT, unit={"enum": ["C", "F"]}), "Weather of a city."),
    function("get_time", obj(timezone=SHORT), "Current time in a timezone."),
    function("add", obj(a={"type": "integer", "maximum": 1000}, b={"type": "integer"})),
    function("set_alarm", obj(hour={"type": "integer", "minimum": 0, "maximum": 23})),
    function("search", obj(query=SHORT, limit={"type": "integer", "minimum": 1, "maximum": 9})),
    function("toggle", obj(on={"type": "boolean"})),
    function("tag", obj(tags={"type": "array", "items": SHORT, "maxItems": 3})),
    function("book", obj(guest=obj(name=SHORT, vip={"type": "boolean"}))),
    function("rate", obj(False, stars={"type": "integer", "minimum": 1, "maximum": 5})),
    {"type": "function", "function": {"name": "ping"}},  # no parameters at all
]


# Three short tools (prompts stay short: prefill is what costs most on a small CPU).
THREE = [TOOLS[0], TOOLS[5], TOOLS[9]]


@pytest.fixture(scope="module")
def server(smollm: LoadedModel) -> Iterator[BackgroundServer]:
    with running_server(smollm, ENGINE_CONFIG) as srv:
        yield srv


def schema_of(name: str) -> dict[str, Any]:
    tool = next(t for t in TOOLS if t["function"]["name"] == name)
    return tool["function"].get("parameters") or obj()


def assert_valid_calls(choice: Any, names: set[str], finish: tuple = ("tool_calls",)) -> None:
    assert choice.finish_reason in finish, choice
    assert choice.message.tool_calls, choice
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names, call
        jsonschema.validate(json.loads(call.function.arguments), schema_of(call.function.name))


def test_ten_named_functions_at_temperature_give_valid_calls(client, model: str) -> None:
    def ask(i: int) -> Any:
        # The named one and another (short, to keep the prompts short: prefill is slow here).
        tools = [TOOLS[i], TOOLS[-1] if i != len(TOOLS) - 1 else TOOLS[5]]
        choice = {"type": "function", "function": {"name": TOOLS[i]["function"]["name"]}}
        return client.chat.completions.create(
            model=model,
            messages=ASK,
            tools=tools,
            tool_choice=choice,
            temperature=0.7,
            seed=i,
            max_tokens=120,
        ).choices[0]

    with ThreadPoolExecutor(len(TOOLS)) as pool:
        choices = list(pool.map(ask, range(len(TOOLS))))
    for i, choice in enumerate(choices):
        assert_valid_calls(choice, {TOOLS[i]["function"]["name"]})
        assert len(choice.message.tool_calls) == 1, "a named function is called once"
        assert choice.message.content is None


def test_required_calls_one_of_the_tools(client, model: str) -> None:
    kwargs = {"model": model, "messages": ASK, "tools": THREE, "tool_choice": "required"}
    kwargs |= {"temperature": 0, "max_tokens": 80}
    with ThreadPoolExecutor(2) as pool:
        single = pool.submit(client.chat.completions.create, **kwargs, parallel_tool_calls=False)
        several = pool.submit(client.chat.completions.create, **kwargs)
        single, several = single.result().choices[0], several.result().choices[0]
    names = {t["function"]["name"] for t in THREE}
    assert_valid_calls(single, names)
    assert len(single.message.tool_calls) == 1
    # Parallel calls: one or more, every complete one valid; a weak model may go on
    # calling until max_tokens (then the cut-off call stays in the content).
    assert_valid_calls(several, names, finish=("tool_calls", "length"))


def test_streamed_call_reassembles_to_the_answer(client, http, model: str) -> None:
    kwargs = {"model": model, "messages": ASK, "tools": THREE[:2], "tool_choice": "required"}
    kwargs |= {"temperature": 0.7, "seed": 3, "max_tokens": 150}

    def raw_stream() -> list[str]:
        body = kwargs | {"stream": True}
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]

    def client_stream() -> Any:
        with client.beta.chat.completions.stream(**kwargs) as stream:
            return stream.get_final_completion().choices[0]

    # A seeded request samples the same tokens whatever shares its batch: run all three.
    with ThreadPoolExecutor(3) as pool:
        whole = pool.submit(client.chat.completions.create, **kwargs)
        lines, final = pool.submit(raw_stream), pool.submit(client_stream)
        whole, lines, final = whole.result().choices[0], lines.result(), final.result()
    calls = [c.model_dump() for c in whole.message.tool_calls]
    assert lines[-1] == "[DONE]"
    content, streamed, reasons = reassemble([json.loads(line) for line in lines[:-1]])
    assert content == (whole.message.content or "")
    assert reasons == [whole.finish_reason] and whole.finish_reason in ("tool_calls", "length")
    assert without_ids(streamed) == without_ids(calls)
    # The official client's stream accumulator agrees.
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls
    ]


def test_a_tool_result_renders_into_the_next_turn(client, http, model: str) -> None:
    call = {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}
    messages = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    ]
    reply = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS[:1], temperature=0, max_tokens=8
    )
    assert reply.choices[0].message.content
    rendered = http.post("/tokenize", json={"messages": messages, "tools": TOOLS[:1]}).json()
    assert rendered["count"] == reply.usage.prompt_tokens
    text = http.post("/detokenize", json={"tokens": rendered["tokens"]}).json()["prompt"]
    assert text.startswith("<|im_start|>system\n# Tools\n")
    expected_call = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
    assert f"<|im_start|>assistant\n<tool_call>\n{expected_call}\n</tool_call><|im_end|>" in text
    assert "<|im_start|>tool\n<tool_response>\nSunny, 21 C\n</tool_response><|im_end|>" in text


def test_tool_choice_none_leaves_the_prompt_alone(client, model: str) -> None:
    plain = client.chat.completions.create(model=model, messages=ASK, max_tokens=1)
    none = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=1, tools=TOOLS, tool_choice="none"
    )
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens


NAMED_MISSING = {"type": "function", "function": {"name": "nope"}}
BAD_TOOLS = [
    ({"tools": TOOLS[:1], "tool_choice": NAMED_MISSING}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "tools"),
    ({"tools": TOOLS[:1], "tool_choice": "sometimes"}, "tool_choice", "required"),
    ({"tools": TOOLS[:1] * 2}, "tools", "unique"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type", ""),
    ({"tools": [function("bad name!", obj())]}, "tools[0].function.name", ""),
    (
        {"tools": TOOLS[:1] + [function("f", {"type": "nope"})], "tool_choice": "required"},
        "tools[1].function.parameters",
        "nope",
    ),
    (
        {"tools": TOOLS[:1], "tool_choice": "required", "response_format": {"type": "json_object"}},
        "response_format",
        "Only one",
    ),
    ({"tools": TOOLS[:1], "extra": {"guided_regex": "a+"}}, "guided_regex", "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions", "not supported"),
]


@pytest.mark.parametrize(("fields", "param", "says"), BAD_TOOLS, ids=lambda v: str(v)[:40])
def test_bad_tool_fields_are_400s(http, model: str, fields, param, says) -> None:
    fields = dict(fields)
    fields |= fields.pop("extra", {})
    body = {"model": model, "messages": ASK, "max_tokens": 4} | fields
    error = assert_openai_error(http.post("/v1/chat/completions", json=body), 400, param=param)
    assert says in error["message"], error
