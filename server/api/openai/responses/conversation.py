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
from mlxserve.server.http.errors import invalid_request
from mlxserve.server.serving.images import ImageSource, image_part
from mlxserve.server.serving.tool_parsers import ToolFormat
from mlxserve.server.serving.tool_plan import NamedTool, ToolChoice, ToolPlan, ToolSpec, plan_tools


def _message_text(item: dict[str, Any]) -> str:
    parts = [p.get("text", p.get("refusal", "")) for p in item["content"]]
    return "\n".join(parts)


def _message_content(item: dict[str, Any]) -> str | list[dict[str, Any]]:
    """A user message's text, or (with images) its text and image parts, adjacent texts
    joined with newlines as ``_message_text`` joins them."""
    if not any(p["type"] == "input_image" for p in item["content"]):
        return _message_text(item)
    out: list[dict[str, Any]] = []
    for j, part in enumerate(item["content"]):
        if part["type"] == "input_image":
            where = f"input.{item['id']}.content[{j}]"
            try:
                out.append(image_part(ImageSource.of_url(part["image_url"], where)))
            except ValueError as e:
                raise invalid_request(str(e), where) from e
        elif out and out[-1]["type"] == "text":
            out[-1] = {"type": "text", "text": out[-1]["text"] + "\n" + part.get("text", "")}
        else:
            out.append({"type": "text", "text": part.get("text", part.get("refusal", ""))})
    return out


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
                out.append({"role": role, "content": _message_content(item)})
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
