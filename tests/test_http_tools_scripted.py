"""Tool calls the model writes itself (tool_choice auto), over HTTP: parsed into
``message.tool_calls`` / streamed ``delta.tool_calls`` fragments, never raw markup, and
the prompts tools make (the default format injected, or the template's own).

The engine is ``tests/scripted_engine.ScriptedEngine``: it answers the chosen text, so
what a weak model would rarely write can be tested exactly.
"""

from __future__ import annotations

import json
from typing import Any

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from tests.scripted_engine import scripted_client, tokenizer_with_template
from tests.test_http_scripted import answering, chat, stream_payloads

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = f"Let me look.\n{CALL}"
# A template that knows tools (renders them itself).
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t.function.name }}"
    "{% endfor %}<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def reassemble(payloads: list[dict], index: int = 0) -> tuple[str, list[dict], list[str]]:
    """Content, tool calls (OpenAI shape) and finish reasons of one streamed choice."""
    content, calls, reasons = "", {}, []
    for payload in payloads:
        for choice in payload["choices"]:
            if choice["index"] != index:
                continue
            delta = choice["delta"]
            content += delta.get("content") or ""
            for fragment in delta.get("tool_calls") or []:
                call = calls.setdefault(
                    fragment["index"], {"type": "function", "function": {"arguments": ""}}
                )
                if "id" in fragment:
                    call["id"] = fragment["id"]
                    assert fragment["type"] == "function" and fragment["function"]["name"]
                    call["function"]["name"] = fragment["function"]["name"]
                call["function"]["arguments"] += fragment["function"].get("arguments") or ""
            if choice["finish_reason"]:
                reasons.append(choice["finish_reason"])
    return content, [calls[i] for i in sorted(calls)], reasons


def without_ids(calls: list[dict]) -> list[dict]:
    return [{k: v for k, v in call.items() if k != "id"} for call in calls]


def prompt_text(smollm: LoadedModel, engine: Any) -> str:
    return smollm.tokenizer.decode(engine.requests[-1][1])


class TestAuto:
    def test_call_parsed_streamed_and_not(self, smollm: LoadedModel) -> None:
        client, engine = scripted_client(smollm.tokenizer, answering(smollm.tokenizer, ANSWER))
        reply = chat(client, tools=[WEATHER])
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        message = choice["message"]
        assert message["content"] == "Let me look."
        [call] = message["tool_calls"]
        assert call["id"].startswith("call_") and call["type"] == "function"
        assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
        assert engine.grammars == [None], "auto does not constrain"

        payloads = stream_payloads(
            client,
            "/v1/chat/completions",
            {
                "model": "scripted",
                "messages": [{"role": "user", "content": "Hi"}],
                "tools": [WEATHER],
                "max_tokens": 64,
            },
        )
        content, calls, reasons = reassemble(payloads)
        assert content == "Let me look." and reasons == ["tool_calls"]
        assert without_ids(calls) == without_ids(message["tool_calls"])
        for payload in payloads:
            for c in payload["choices"]:
                assert "<tool_call>" not in (c["delta"].get("content") or "")

    def test_tools_go_into_a_template_without_tool_support(self, smollm: LoadedModel) -> None:
        client, engine = scripted_client(smollm.tokenizer, answering(smollm.tokenizer, "Hi"))
        chat(client, tools=[WEATHER])
        text = prompt_text(smollm, engine)
        assert text.startswith("<|im_start|>system\n# Tools\n")
        assert json.dumps(WEATHER) in text

    def test_a_template_with_tool_support_renders_them(self, smollm: LoadedModel) -> None:
        tokenizer = tokenizer_with_template(smollm.tokenizer, TOOLS_TEMPLATE)
        client, engine = scripted_client(tokenizer, answering(tokenizer, ANSWER))
        reply = chat(client, tools=[WEATHER])
        text = prompt_text(smollm, engine)
        assert text.startswith("<|im_start|>system\nTOOLS: get_weather<|im_end|>")
        assert "# Tools" not in text
        assert reply["choices"][0]["finish_reason"] == "tool_calls"

    def test_none_offers_no_tools_and_parses_nothing(self, smollm: LoadedModel) -> None:
        client, engine = scripted_client(smollm.tokenizer, answering(smollm.tokenizer, ANSWER))
        reply = chat(client, tools=[WEATHER], tool_choice="none")
        assert "<tools>" not in prompt_text(smollm, engine)
        assert reply["choices"][0]["message"] == {"role": "assistant", "content": ANSWER}
        assert reply["choices"][0]["finish_reason"] == "stop"

    def test_each_choice_parses_its_own_calls(self, smollm: LoadedModel) -> None:
        client, _ = scripted_client(smollm.tokenizer, answering(smollm.tokenizer, CALL))
        reply = chat(client, tools=[WEATHER], n=2)
        ids = set()
        for choice in reply["choices"]:
            assert choice["message"]["content"] is None
            [call] = choice["message"]["tool_calls"]
            ids.add(call["id"])
        assert len(ids) == 2, "every call has its own id"


class TestConstrained:
    def test_required_sends_a_grammar_and_parses(self, smollm: LoadedModel) -> None:
        client, engine = scripted_client(smollm.tokenizer, answering(smollm.tokenizer, CALL))
        reply = chat(client, tools=[WEATHER], tool_choice="required")
        assert engine.grammars[-1].kind == "lark"
        assert '\\"get_weather\\"' in engine.grammars[-1].value
        assert reply["choices"][0]["finish_reason"] == "tool_calls"

    def test_response_format_with_auto_tools_is_either(self, smollm: LoadedModel) -> None:
        client, engine = scripted_client(smollm.tokenizer, answering(smollm.tokenizer, "{}"))
        fmt = {"type": "json_object"}
        reply = chat(client, tools=[WEATHER], response_format=fmt)
        grammar = engine.grammars[-1]
        assert grammar.kind == "lark" and grammar.value.startswith("start: calls | answer")
        assert reply["choices"][0]["message"]["content"] == "{}"
