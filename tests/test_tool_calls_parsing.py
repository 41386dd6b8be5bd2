"""Tool calls out of model text (``server/serving/tool_stream.py``), the parsers behind
``--tool-parser`` (``server/serving/tool_parsers.py``), the default format written into prompts
(``server/serving/tool_prompt.py``) and the call grammar (``server/api/openai/tools.py``).
No model runs."""

from __future__ import annotations

import json
import random

import pytest

from mlxserve.server.api.openai.tools import NamedToolChoice, ToolDefinition, plan_tools
from mlxserve.server.cli import main
from mlxserve.server.config import ModelConfig
from mlxserve.server.serving.tool_parsers import (
    check_tool_parser_name,
    hermes_format,
    resolve_tool_format,
    tool_parser_names,
)
from mlxserve.server.serving.tool_plan import tool_calls_rules
from mlxserve.server.serving.tool_prompt import (
    hermes_messages,
    template_supports_tools,
    tool_results_as_user,
)
from mlxserve.server.serving.tool_stream import ParsedCall, ToolCallSplitter, split_tool_calls

HERMES = hermes_format()
CALL_A = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_B = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
TEXT_THEN_TWO_CALLS = f"Let me check both.\n{CALL_A}\n{CALL_B}\n"


def calls_of(calls: list[ParsedCall]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def feed_in_pieces(text: str, cuts: list[int], parallel: bool = True):
    """Feed ``text`` cut at ``cuts``; returns (content, calls) concatenated."""
    splitter = ToolCallSplitter(HERMES, None, parallel)
    content, calls = "", []
    bounds = [0, *sorted(cuts), len(text)]
    for start, end in zip(bounds, bounds[1:], strict=False):
        piece, more = splitter.feed(text[start:end])
        content, calls = content + piece, calls + more
    piece, more = splitter.flush()
    return content + piece, calls + more


class TestHermesSplitter:
    def test_text_before_two_calls(self) -> None:
        content, calls = split_tool_calls(HERMES, TEXT_THEN_TWO_CALLS, None)
        assert content == "Let me check both."
        assert calls_of(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]
        assert all(c.id.startswith("call_") and len(c.id) == 29 for c in calls)
        assert calls[0].arguments == '{"city": "Paris"}'

    def test_any_chunking_gives_the_same_split(self) -> None:
        whole = split_tool_calls(HERMES, TEXT_THEN_TWO_CALLS, None)
        expected = (whole[0], calls_of(whole[1]))
        text = TEXT_THEN_TWO_CALLS
        for cut in range(len(text) + 1):  # every single boundary
            content, calls = feed_in_pieces(text, [cut])
            assert (content, calls_of(calls)) == expected, cut
        rng = random.Random(0)
        for _ in range(200):  # and many random chunkings, one character pieces included
            cuts = rng.sample(range(1, len(text)), rng.randint(1, len(text) - 1))
            content, calls = feed_in_pieces(text, cuts)
            assert (content, calls_of(calls)) == expected, cuts

    def test_no_markup_leaks_while_streaming(self) -> None:
        splitter = ToolCallSplitter(HERMES, None)
        emitted = "".join(splitter.feed(ch)[0] for ch in TEXT_THEN_TWO_CALLS)
        emitted += splitter.flush()[0]
        assert "<" not in emitted and emitted == "Let me check both."

    def test_plain_text_is_untouched(self) -> None:
        text = "No tools needed: 2 < 3 and <tool is not a tag.\n\n"
        assert feed_in_pieces(text, [10, 23, 24, 30]) == (text, [])

    def test_text_after_a_call_is_content(self) -> None:
        content, calls = split_tool_calls(HERMES, f"{CALL_A}\n\nDone.", None)
        assert content == "Done." and calls_of(calls) == [("get_weather", {"city": "Paris"})]

    def test_a_call_that_does_not_parse_stays_text(self) -> None:
        bad = "<tool_call>\nnot json\n</tool_call>"
        content, calls = split_tool_calls(HERMES, f"Hi {bad}", None)
        assert content == f"Hi{bad}" and calls == []

    def test_unclosed_call_at_the_end(self) -> None:
        # Complete JSON but no end marker (e.g. a stop string ate it): still a call.
        content, calls = split_tool_calls(HERMES, CALL_A.removesuffix("\n</tool_call>"), None)
        assert content == "" and calls_of(calls) == [("get_weather", {"city": "Paris"})]
        # Cut off mid-JSON (max_tokens): the text is kept as it was written.
        content, calls = split_tool_calls(HERMES, CALL_A[:30], None)
        assert content == CALL_A[:30] and calls == []

    def test_parallel_false_keeps_the_first_call(self) -> None:
        content, calls = split_tool_calls(HERMES, TEXT_THEN_TWO_CALLS, None, parallel=False)
        assert calls_of(calls) == [("get_weather", {"city": "Paris"})]

    def test_arguments_as_a_json_string_and_parameters_key(self) -> None:
        text = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
        assert calls_of(split_tool_calls(HERMES, text, None)[1]) == [("f", {"x": 1})]
        text = '<tool_call>{"name": "f", "parameters": {"x": 2}}</tool_call>'
        assert calls_of(split_tool_calls(HERMES, text, None)[1]) == [("f", {"x": 2})]


class TestParsers:
    def test_names_and_start_up_check(self) -> None:
        names = tool_parser_names()
        assert {"auto", "hermes", "json_tools", "mistral", "pythonic", "qwen3_coder"} <= set(names)
        check_tool_parser_name("mistral")
        with pytest.raises(ValueError, match="unknown tool parser 'nope'"):
            ModelConfig(tool_parser="nope")

    def test_cli_refuses_an_unknown_parser(self, capsys: pytest.CaptureFixture) -> None:
        with pytest.raises(SystemExit) as exit_info:
            main(["--tool-parser", "nope"])
        assert exit_info.value.code != 0
        assert "unknown tool parser 'nope'" in capsys.readouterr().err

    def test_auto_takes_the_tokenizers_parser_else_hermes(self, smollm) -> None:
        from mlx_lm.tokenizer_utils import TokenizerWrapper
        from mlx_lm.tool_parsers import mistral

        assert resolve_tool_format("auto", smollm.tokenizer).name == "hermes"
        tokenizer = TokenizerWrapper(
            smollm.tokenizer._tokenizer,
            tool_parser=mistral.parse_tool_call,
            tool_call_start=mistral.tool_call_start,
            tool_call_end=mistral.tool_call_end,
        )
        fmt = resolve_tool_format("auto", tokenizer)
        assert (fmt.name, fmt.start, fmt.end) == ("mistral", "[TOOL_CALLS]", "")
        assert resolve_tool_format("pythonic", smollm.tokenizer).name == "pythonic"

    def test_mistral_calls_run_to_the_end(self) -> None:
        fmt = resolve_tool_format("mistral", None)
        text = 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
        for cut in range(len(text) + 1):
            splitter = ToolCallSplitter(fmt, None)
            first, second, tail = (
                splitter.feed(text[:cut]),
                splitter.feed(text[cut:]),
                splitter.flush(),
            )
            assert first[0] + second[0] + tail[0] == "Sure."
            assert calls_of(first[1] + second[1] + tail[1]) == [("get_weather", {"city": "Paris"})]


WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object"}},
}


class TestPrompt:
    def test_tools_join_the_system_message(self) -> None:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        out = hermes_messages(messages, [WEATHER])
        assert out[0]["content"].startswith("Be brief.\n\n# Tools\n")
        assert json.dumps(WEATHER) in out[0]["content"] and "<tool_call>" in out[0]["content"]
        assert messages[0]["content"] == "Be brief.", "the caller's dicts are not changed"
        alone = hermes_messages(messages[1:], [WEATHER])
        assert alone[0]["role"] == "system" and alone[1] == messages[1]

    def test_calls_and_results_become_text(self) -> None:
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
        messages = [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
        ]
        out = hermes_messages(messages, None)
        assert out[0] == {
            "role": "assistant",
            "content": '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>',
        }
        assert out[1] == {"role": "tool", "content": "<tool_response>\n42\n</tool_response>"}
        assert tool_results_as_user(out)[1]["role"] == "user"

    def test_template_detection(self, smollm) -> None:
        assert not template_supports_tools(smollm.tokenizer)

        class WithTools:
            chat_template = "{% if tools %}{{ tools | tojson }}{% endif %}"

        assert template_supports_tools(WithTools())


class TestPlan:
    def tools(self, *names: str) -> list[ToolDefinition]:
        return [ToolDefinition.model_validate(WEATHER | {"function": {"name": n}}) for n in names]

    def test_choices(self) -> None:
        tools = self.tools("a", "b")
        assert plan_tools(tools, "none", None, HERMES).prompt_tools is None
        auto = plan_tools(tools, None, None, HERMES)
        assert auto.parse is HERMES and auto.grammar() is None and len(auto.prompt_tools) == 2
        required = plan_tools(tools, "required", None, HERMES).grammar()
        assert required is not None and "call_0 | call_1" in required.value
        assert 'calls: call ("\\n" call)*' in required.value
        choice = NamedToolChoice.model_validate({"type": "function", "function": {"name": "b"}})
        named = plan_tools(tools, choice, None, HERMES)
        assert named.grammar() is not None and not named.parallel
        assert '\\"b\\"' in named.grammar().value and '\\"a\\"' not in named.grammar().value

    def test_rules_use_compact_json_and_no_parameters_means_none(self) -> None:
        rules = tool_calls_rules([t.spec() for t in self.tools("a")], parallel=False)
        assert '"x-guidance": {"whitespace_flexible": false' in rules
        bare = ToolDefinition.model_validate({"type": "function", "function": {"name": "n"}})
        assert '"additionalProperties": false' in tool_calls_rules([bare.spec()], parallel=False)
