"""Tools in the prompt: the model's own chat template when it knows tools, else the default
(Hermes) format written into the messages.

A template knows tools when its source mentions ``tools`` (or it is a custom mlx-lm
renderer): it gets ``tools=[...]`` and renders tool calls and results itself. For any
other template (the embedded SmolLM2's, for one) the conversation is rewritten before it is
rendered:

- the tool definitions go into the system message (appended to the first system message,
  or a new one at the front)::

      # Tools

      You may call one or more functions to assist with the user query.

      You are provided with function signatures within <tools></tools> XML tags:
      <tools>
      {"type": "function", "function": {"name": "get_weather", ...}}
      </tools>

      For each function call, return a json object with function name and arguments
      within <tool_call></tool_call> XML tags:
      <tool_call>
      {"name": <function-name>, "arguments": <args-json-object>}
      </tool_call>

- an assistant message's ``tool_calls`` become text after its content, one
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` block per call;
- a tool result stays a ``tool`` message whose content is wrapped in
  ``<tool_response>\\n...\\n</tool_response>``; a template that refuses the ``tool`` role
  gets it as a ``user`` message instead (``tool_results_as_user``).
"""

from __future__ import annotations

import json
from typing import Any

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_START, TOOL_RESPONSE_END = "<tool_response>", "</tool_response>"

_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{signatures}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether the model's chat template renders tools itself (it mentions ``tools``, or
    it is one of mlx-lm's custom renderers)."""
    if getattr(tokenizer, "_chat_template", None) is not None:
        return True
    return "tools" in str(getattr(tokenizer, "chat_template", None) or "")


def tools_section(tools: list[dict[str, Any]]) -> str:
    """The system prompt section offering ``tools`` (OpenAI tool dicts)."""
    signatures = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return _INSTRUCTIONS.format(signatures=signatures)


def tool_call_text(call: dict[str, Any]) -> str:
    """One call of an assistant message (``template_dict`` shape) in the default format."""
    function = call["function"]
    body = {"name": function["name"], "arguments": function["arguments"]}
    return f"{TOOL_CALL_START}\n{json.dumps(body, ensure_ascii=False)}\n{TOOL_CALL_END}"


def hermes_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """``messages`` (template dicts) rewritten for a template that does not know tools."""
    out = []
    for message in messages:
        message = dict(message)
        calls = message.pop("tool_calls", None)
        if calls:
            parts = [message.get("content") or ""] + [tool_call_text(c) for c in calls]
            message["content"] = "\n".join(p for p in parts if p)
        if message["role"] == "tool":
            message.pop("tool_call_id", None)
            message["content"] = f"{TOOL_RESPONSE_START}\n{message['content']}\n{TOOL_RESPONSE_END}"
        out.append(message)
    if tools:
        section = tools_section(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{section}".lstrip()
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def tool_results_as_user(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``tool`` messages turned into ``user`` ones (for templates that refuse the role)."""
    return [m | {"role": "user"} if m["role"] == "tool" else m for m in messages]
