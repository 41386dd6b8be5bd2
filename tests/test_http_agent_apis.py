"""One engine, three shapes: the same conversation through OpenAI chat, Anthropic Messages
and OpenAI Responses renders the same prompt and gives the same greedy text (tool calls and
results included); and a real agent loop, the OpenAI Agents SDK running an agent with one
function tool over ``/v1/responses``, calls the tool and finishes (plain and streamed)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import anthropic
import pytest

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.config import EngineConfig
from mlxserve.server.lifecycle.launch import BackgroundServer
from tests.ops_helpers import running_server

ENGINE_CONFIG = EngineConfig(max_total_tokens=8192, max_running_requests=8)
SYSTEM = "You are a terse assistant."
QUESTION = "Name a color."
PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
CALL_ID = "call_abc123"
ARGUMENTS = '{"city": "Paris"}'
RESULT = "21 C and sunny."


@pytest.fixture(scope="module")
def server(smollm: LoadedModel) -> Iterator[BackgroundServer]:
    with running_server(smollm, ENGINE_CONFIG) as srv:
        yield srv


@pytest.fixture(scope="module")
def claude(server: BackgroundServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=300)


def three_answers(client, claude, model: str, tools: bool) -> dict[str, tuple[str, int]]:
    """(text, prompt tokens) of the conversation through each API, greedy, 16 tokens."""
    chat_messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTION},
    ]
    anthropic_messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    items: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    extra: dict[str, dict[str, Any]] = {"chat": {}, "anthropic": {}, "responses": {}}
    if tools:
        function = {"name": "get_weather", "description": "Weather.", "parameters": PARAMETERS}
        call = {"id": CALL_ID, "type": "function", "function": function | {"arguments": ARGUMENTS}}
        del call["function"]["description"], call["function"]["parameters"]
        chat_messages += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": CALL_ID, "content": RESULT},
        ]
        anthropic_messages += [
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": CALL_ID,
                        "name": "get_weather",
                        "input": {"city": "Paris"},
                    }
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": CALL_ID, "content": RESULT}],
            },
        ]
        items += [
            {
                "type": "function_call",
                "call_id": CALL_ID,
                "name": "get_weather",
                "arguments": ARGUMENTS,
            },
            {"type": "function_call_output", "call_id": CALL_ID, "output": RESULT},
        ]
        extra["chat"] = {"tools": [{"type": "function", "function": function}]}
        extra["anthropic"] = {
            "tools": [
                {"name": "get_weather", "description": "Weather.", "input_schema": PARAMETERS}
            ]
        }
        extra["responses"] = {"tools": [{"type": "function", **function}]}
    chat = client.chat.completions.create(
        model=model, messages=chat_messages, max_tokens=16, temperature=0, **extra["chat"]
    )
    message = claude.messages.create(
        model=model,
        system=SYSTEM,
        messages=anthropic_messages,
        max_tokens=16,
        extra_body={"temperature": 0},
        **extra["anthropic"],
    )
    response = client.responses.create(
        model=model,
        instructions=SYSTEM,
        input=items,
        max_output_tokens=16,
        temperature=0,
        **extra["responses"],
    )
    usage = message.usage
    return {
        "chat": (chat.choices[0].message.content, chat.usage.prompt_tokens),
        "anthropic": (
            "".join(b.text for b in message.content if b.type == "text"),
            usage.input_tokens + usage.cache_read_input_tokens,
        ),
        "responses": (response.output_text, response.usage.input_tokens),
    }


class TestOneEngineThreeShapes:
    @pytest.mark.parametrize("tools", [False, True], ids=["plain", "tool-round-trip"])
    def test_same_prompt_same_greedy_text(self, client, claude, model: str, tools: bool) -> None:
        answers = three_answers(client, claude, model, tools)
        texts = {api: text for api, (text, _) in answers.items()}
        counts = {api: count for api, (_, count) in answers.items()}
        assert len(set(counts.values())) == 1, f"one prompt: {counts}"
        assert len(set(texts.values())) == 1, f"one greedy text: {texts}"
        assert texts["chat"], texts


@pytest.fixture
def agents_sdk(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The OpenAI Agents SDK, offline: a dummy key, no tracing export."""
    monkeypatch.setenv("OPENAI_API_KEY", "dummy")
    import agents

    agents.set_tracing_disabled(True)
    return agents


def weather_agent(agents: Any, server: BackgroundServer, model: str, calls: list[str]) -> Any:
    """An agent with one function tool, on our /v1/responses; the first turn must call."""
    import openai

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        calls.append(city)
        return f"It is sunny in {city}."

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="dummy", max_retries=0)
    settings = agents.ModelSettings(
        tool_choice="required", temperature=0, max_tokens=40, parallel_tool_calls=False
    )
    return agents.Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[get_weather],
        model=agents.OpenAIResponsesModel(model=model, openai_client=client),
        model_settings=settings,
    )


class TestAgentsSDK:
    def test_agent_calls_the_tool_and_finishes(self, agents_sdk, server, model: str) -> None:
        calls: list[str] = []
        agent = weather_agent(agents_sdk, server, model, calls)
        result = asyncio.run(agents_sdk.Runner.run(agent, "Weather in Paris?", max_turns=4))
        assert len(calls) == 1 and calls[0], calls
        kinds = [type(item).__name__ for item in result.new_items]
        assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"], kinds
        assert kinds[-1] == "MessageOutputItem", kinds
        assert isinstance(result.final_output, str) and result.final_output, result
        assert len(result.raw_responses) == 2, "two model calls: the tool call, the answer"

    def test_streamed_agent_run(self, agents_sdk, server, model: str) -> None:
        calls: list[str] = []
        agent = weather_agent(agents_sdk, server, model, calls)

        async def run() -> tuple[Any, list[str]]:
            result = agents_sdk.Runner.run_streamed(agent, "Weather in Tokyo?", max_turns=4)
            kinds = [event.type async for event in result.stream_events()]
            return result, kinds

        result, kinds = asyncio.run(run())
        assert len(calls) == 1, calls
        assert "raw_response_event" in kinds and "run_item_stream_event" in kinds, kinds
        assert isinstance(result.final_output, str) and result.final_output, result
