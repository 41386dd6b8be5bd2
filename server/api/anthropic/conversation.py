"""Anthropic messages -> the conversation a chat template renders
(``server/serving/conversation.py``), and Anthropic's tools -> the neutral tool plan.

- ``system`` (a string or text blocks) is the first system message.
- A user message's text and image blocks are one user message (images as image parts,
  ``server/serving/images.py``); each ``tool_result`` block is a
  ``tool`` message (``tool_call_id`` its ``tool_use_id``), in the order of the blocks.
- An assistant message's text is its content, its ``tool_use`` blocks its ``tool_calls``
  (``input`` as the arguments object), its ``thinking`` blocks its ``reasoning_content``.
- Consecutive messages of one role are one turn, as Anthropic combines them.
- A final assistant message is a prefill: the model continues it.
"""

from __future__ import annotations

from typing import Any

from mlxserve.server.api.anthropic.content import (
    ImageBlock,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from mlxserve.server.api.anthropic.schemas import (
    CountTokensRequest,
    CustomTool,
    MessageParam,
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceTool,
)
from mlxserve.server.http.errors import invalid_request
from mlxserve.server.serving.images import ImageSource, image_part
from mlxserve.server.serving.tool_parsers import ToolFormat
from mlxserve.server.serving.tool_plan import NamedTool, ToolChoice, ToolPlan, ToolSpec, plan_tools


def _assistant(message: MessageParam, index: int) -> dict[str, Any]:
    texts, reasoning, calls = [], [], []
    for j, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            function = {"name": block.name, "arguments": block.input}
            calls.append({"id": block.id, "type": "function", "function": function})
        elif not isinstance(block, RedactedThinkingBlock):
            raise invalid_request(
                f"messages[{index}].content[{j}]: '{block.type}' blocks belong to user messages.",
                f"messages[{index}].content[{j}]",
            )
    out: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}  # [] -> ""
    if calls:
        out["tool_calls"] = calls
    if reasoning:
        out["reasoning_content"] = "\n".join(reasoning)
    return out


def _image_source(block: ImageBlock, where: str) -> ImageSource:
    source = block.source
    if source.type == "base64":
        return ImageSource(where, data=source.data)
    try:
        return ImageSource.of_url(source.url, where)
    except ValueError as e:
        raise invalid_request(str(e), where) from e


def _content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Text parts joined with newlines, or (with an image among them) the parts, adjacent
    text parts joined the same way."""
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    out: list[dict[str, Any]] = []
    for part in parts:
        if part["type"] == "text" and out and out[-1]["type"] == "text":
            out[-1] = {"type": "text", "text": out[-1]["text"] + "\n" + part["text"]}
        else:
            out.append(part)
    return out


def _user_or_system(message: MessageParam, index: int) -> list[dict[str, Any]]:
    role = message.role
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []

    def flush_text() -> None:
        if parts:
            out.append({"role": role, "content": _content(parts)})
            parts.clear()

    for j, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock) and role == "user":
            where = f"messages[{index}].content[{j}]"
            parts.append(image_part(_image_source(block, where)))
        elif isinstance(block, ToolResultBlock) and role == "user":
            flush_text()
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
        else:
            raise invalid_request(
                f"messages[{index}].content[{j}]: '{block.type}' blocks are not allowed in "
                f"{role} messages.",
                f"messages[{index}].content[{j}]",
            )
    flush_text()
    return out


def _parts(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(content, list):
        return content
    return [{"type": "text", "text": content}] if content else []


def _joined(
    first: str | list[dict[str, Any]], second: str | list[dict[str, Any]]
) -> str | list[dict[str, Any]]:
    """Two turns' contents as one, a blank line between their texts."""
    if isinstance(first, str) and isinstance(second, str):
        return "\n\n".join(c for c in (first, second) if c)
    a, b = _parts(first), _parts(second)
    if a and b:
        a = [*a, {"type": "text", "text": "\n\n"}]
    return a + b


def _merge(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive user, system or assistant messages as one (tool results stay apart)."""
    merged: list[dict[str, Any]] = []
    for turn in turns:
        last = merged[-1] if merged else None
        if last is None or last["role"] != turn["role"] or turn["role"] == "tool":
            merged.append(dict(turn))
            continue
        last["content"] = _joined(last["content"], turn["content"])
        if "tool_calls" in turn:
            last["tool_calls"] = [*last.get("tool_calls", []), *turn["tool_calls"]]
        if "reasoning_content" in turn:
            parts = (last.get("reasoning_content"), turn["reasoning_content"])
            last["reasoning_content"] = "\n".join(p for p in parts if p)
    return merged


def conversation_of(body: CountTokensRequest) -> tuple[list[dict[str, Any]], bool]:
    """The request's conversation, and whether its final assistant message is continued.

    Raises:
        APIError: 400 for blocks in the wrong role, or a final assistant message that
            calls tools (its results must come first).
    """
    turns: list[dict[str, Any]] = []
    system = body.system_text()
    if system:
        turns.append({"role": "system", "content": system})
    last = len(body.messages) - 1
    for i, message in enumerate(body.messages):
        if not message.content and not (i == last and message.role == "assistant"):
            # As Anthropic: only a final assistant message (a prefill) may be empty.
            raise invalid_request(
                f"messages[{i}]: content must not be empty (only the final assistant "
                "message may be).",
                f"messages[{i}].content",
            )
        if message.role == "assistant":
            turns.append(_assistant(message, i))
        else:
            turns.extend(_user_or_system(message, i))
    conversation = _merge(turns)
    prefill = conversation[-1]["role"] == "assistant"
    if prefill and conversation[-1].get("tool_calls"):
        raise invalid_request(
            "The last message calls tools: send their 'tool_result' blocks in a user message.",
            "messages",
        )
    return conversation, prefill


def tool_plan_of(body: CountTokensRequest, default_format: ToolFormat) -> ToolPlan:
    """The request's tools and ``tool_choice`` as the neutral tool plan.

    Raises:
        APIError: 400 for duplicate names, or a ``tool_choice`` that needs missing tools.
    """
    specs = [_spec(tool, i) for i, tool in enumerate(body.tools or [])]
    choice: ToolChoice | None = None
    parallel: bool | None = None
    tc = body.tool_choice
    if tc is not None:
        choice = tc.type if tc.type in ("auto", "none") else "required"
        if isinstance(tc, ToolChoiceTool):
            choice = NamedTool(tc.name)
        if isinstance(tc, ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool):
            parallel = not tc.disable_parallel_tool_use
    return plan_tools(specs, choice, parallel, default_format)


def _spec(tool: CustomTool, index: int) -> ToolSpec:
    param = f"tools[{index}].input_schema"
    return ToolSpec(tool.name, tool.description, tool.input_schema, tool.strict, param)
