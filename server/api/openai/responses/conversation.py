"""Responses items -> the conversation a chat template renders
(``server/serving/conversation.py``), and the request's tools -> the neutral tool plan.

- ``instructions`` is the first system message (an earlier response's instructions are
  not carried over, as OpenAI does);
- a ``message`` item is a message of its role ("developer" is "system"), its text parts
  joined with newlines;
- ``function_call`` items are the ``tool_calls`` of the assistant turn they follow (a new
  one when none is open); their JSON ``arguments`` go to the template as objects;
- a ``function_call_output`` is a ``tool`` message;
- a ``reasoning`` item is the ``reasoning_content`` of the assistant turn after it.
"""

from __future__ import annotations

import json
from typing import Any

from mlxserve.server.api.openai.responses.schemas import FunctionChoice, ResponsesRequest
from mlxserve.server.serving.tool_parsers import ToolFormat
from mlxserve.server.serving.tool_plan import NamedTool, ToolChoice, ToolPlan, ToolSpec, plan_tools


def _message_text(item: dict[str, Any]) -> str:
    parts = [p.get("text", p.get("refusal", "")) for p in item["content"]]
    return "\n".join(parts)


def _arguments(text: str) -> Any:
    try:
        parsed = json.loads(text)
    except ValueError:
        return text
    return parsed if isinstance(parsed, dict) else text


def conversation_of(instructions: str | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation of ``items`` (canonical item dicts, ``items.py``)."""
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    reasoning: list[str] = []

    def assistant_turn(content: str) -> dict[str, Any]:
        turn: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:
            turn["reasoning_content"] = "\n".join(reasoning)
            reasoning.clear()
        out.append(turn)
        return turn

    for item in items:
        kind = item["type"]
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            if role == "assistant":
                assistant_turn(_message_text(item))
            else:
                out.append({"role": role, "content": _message_text(item)})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": _arguments(item["arguments"])},
            }
            last = out[-1] if out and not reasoning else None
            turn = last if last is not None and last["role"] == "assistant" else None
            turn = turn or assistant_turn("")
            turn.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        elif kind == "reasoning":
            texts = [p["text"] for p in item.get("content") or []]
            reasoning.extend(texts or [p["text"] for p in item.get("summary") or []])
    return out


def tool_plan_of(body: ResponsesRequest, default_format: ToolFormat) -> ToolPlan:
    """The request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` as a tool plan.

    Raises:
        APIError: 400 for duplicate names, or a ``tool_choice`` that needs missing tools.
    """
    specs = [
        ToolSpec(t.name, t.description, t.parameters, t.strict, f"tools[{i}].parameters")
        for i, t in enumerate(body.tools or [])
    ]
    choice: ToolChoice | None = body.tool_choice
    if isinstance(body.tool_choice, FunctionChoice):
        choice = NamedTool(body.tool_choice.name)
    return plan_tools(specs, choice, body.parallel_tool_calls, default_format)
