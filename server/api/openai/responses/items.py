"""The Responses API's input items, parsed into the item shapes the API itself returns.

``input`` is a string (one user message) or a list of items:

- ``message`` (``type`` may be left out): ``role`` user / system / developer / assistant,
  ``content`` a string or parts: ``input_text``, ``output_text``, ``refusal``,
  ``input_image`` (user messages; ``image_url`` a ``data:`` URL, or an http(s) URL the
  server fetches only with ``--allow-image-urls``; ``input_file``, ``input_audio`` and
  ``file_id`` images are a 400);
- ``function_call`` (``call_id``, ``name``, ``arguments``): a call the model made;
- ``function_call_output`` (``call_id``, ``output`` a string or text parts);
- ``reasoning`` (``summary``, ``content``): the model's earlier reasoning;
- ``item_reference`` (``id``): an item of the stored conversation it continues.

Every item comes out as the API returns items (``{"type": "message", "id", "role",
"content": [{"type": "input_text", "text"}], "status"}``, ...), with an id of its own when
it had none, so that the store keeps, lists and replays one shape.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from mlxserve.server.http.errors import invalid_request
from mlxserve.server.serving.images import ImageSource

Status = Literal["in_progress", "completed", "incomplete"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Model):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None
    prompt_cache_breakpoint: dict[str, Any] | None = None


class RefusalPart(_Model):
    type: Literal["refusal"]
    refusal: str


class ImagePart(_Model):
    type: Literal["input_image"]
    image_url: str
    detail: Literal["auto", "low", "high"] = "auto"


class MessageItem(_Model):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart | RefusalPart | ImagePart]
    id: str | None = None
    status: Status | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(_Model):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Status | None = None
    caller: dict[str, Any] | None = None
    namespace: str | None = None


class FunctionCallOutputItem(_Model):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]
    id: str | None = None
    status: Status | None = None
    caller: dict[str, Any] | None = None
    name: str | None = None
    namespace: str | None = None


class SummaryPart(_Model):
    type: Literal["summary_text"]
    text: str


class ReasoningPart(_Model):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Model):
    type: Literal["reasoning"]
    summary: list[SummaryPart] = []
    content: list[ReasoningPart] | None = None
    id: str | None = None
    encrypted_content: str | None = None
    status: Status | None = None


class ItemReference(_Model):
    type: Literal["item_reference"] = "item_reference"
    id: str


_ITEMS: dict[str, type[_Model]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
    "item_reference": ItemReference,
}
_VISION_PARTS = ("input_file", "input_audio")


def new_item_id(prefix: str) -> str:
    """An item id, ``prefix`` + "_" + 32 random hex digits."""
    return f"{prefix}_{uuid.uuid4().hex}"


def _where(index: int, loc: tuple[Any, ...]) -> str:
    path = f"input[{index}]"
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path


def _check_parts(value: dict[str, Any], index: int) -> None:
    parts = value.get("content") if value.get("type", "message") == "message" else None
    parts = value.get("output") if value.get("type") == "function_call_output" else parts
    for j, part in enumerate(parts if isinstance(parts, list) else []):
        kind = part.get("type") if isinstance(part, dict) else None
        field = "content" if value.get("type", "message") == "message" else "output"
        where = f"input[{index}].{field}[{j}]"
        if kind in _VISION_PARTS:
            raise invalid_request(
                f"{where} is an '{kind}' part: files and audio are not supported.", where
            )
        if kind == "input_image":
            if value.get("role") != "user" or field != "content":
                raise invalid_request(f"{where}: images belong to user messages.", where)
            if not isinstance(part.get("image_url"), str):
                raise invalid_request(
                    f"{where}: an input_image needs an 'image_url' (file_id is not supported).",
                    where,
                )
            try:
                ImageSource.of_url(part["image_url"], where)
            except ValueError as e:
                raise invalid_request(f"{e} (an input_image part)", where) from e


def parse_item(value: Any, index: int) -> _Model:
    """One input item, validated.

    Raises:
        APIError: 400 naming the item (and the field) at fault.
    """
    if not isinstance(value, dict):
        raise invalid_request(f"input[{index}] must be an object.", f"input[{index}]")
    kind = value.get("type")
    if kind is None:
        kind = "message" if "role" in value else "item_reference"
    model = _ITEMS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise invalid_request(
            f"input[{index}] is an item of type {kind!r}, which this server does not take "
            f"(it takes {', '.join(_ITEMS)}).",
            f"input[{index}].type",
        )
    _check_parts(value, index)
    try:
        return model.model_validate(value)
    except ValidationError as e:
        first = e.errors()[0]
        where = _where(index, tuple(first.get("loc", ())))
        message = f"Invalid '{where}': {first.get('msg', 'invalid value')}."
        raise invalid_request(message, where) from None


def _text_parts(parts: str | list[Any], part_type: str) -> list[dict[str, Any]]:
    if isinstance(parts, str):
        parts = [TextPart(type=part_type, text=parts)]  # type: ignore[arg-type]
    out = []
    for part in parts:
        if isinstance(part, RefusalPart):
            out.append({"type": "refusal", "refusal": part.refusal})
        elif isinstance(part, ImagePart):
            out.append({"type": "input_image", "image_url": part.image_url, "detail": part.detail})
        elif part.type == "output_text":
            out.append({"type": "output_text", "text": part.text, "annotations": []})
        else:
            out.append({"type": "input_text", "text": part.text})
    return out


def canonical_item(item: _Model) -> dict[str, Any]:
    """The item as the API returns it (an id given when it had none)."""
    if isinstance(item, MessageItem):
        part_type = "output_text" if item.role == "assistant" else "input_text"
        return {
            "type": "message",
            "id": item.id or new_item_id("msg"),
            "role": item.role,
            "content": _text_parts(item.content, part_type),
            "status": item.status or "completed",
        }
    if isinstance(item, FunctionCallItem):
        return {
            "type": "function_call",
            "id": item.id or new_item_id("fc"),
            "call_id": item.call_id,
            "name": item.name,
            "arguments": item.arguments,
            "status": item.status or "completed",
        }
    if isinstance(item, FunctionCallOutputItem):
        output = item.output
        text = output if isinstance(output, str) else "\n".join(p.text for p in output)
        return {
            "type": "function_call_output",
            "id": item.id or new_item_id("fco"),
            "call_id": item.call_id,
            "output": text,
            "status": item.status or "completed",
        }
    if isinstance(item, ReasoningItem):
        return {
            "type": "reasoning",
            "id": item.id or new_item_id("rs"),
            "summary": [p.model_dump() for p in item.summary],
            "content": [p.model_dump() for p in item.content or []],
        }
    assert isinstance(item, ItemReference)
    return {"type": "item_reference", "id": item.id}


def input_items(value: str | list[Any]) -> list[dict[str, Any]]:
    """The request's ``input`` as items (a string is one user message).

    Raises:
        APIError: 400 naming the first bad item.
    """
    if isinstance(value, str):
        return [canonical_item(MessageItem(role="user", content=value))]
    return [canonical_item(parse_item(item, i)) for i, item in enumerate(value)]
