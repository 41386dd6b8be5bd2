"""Chat messages as OpenAI sends them, turned into the conversation a chat template renders
(``server/serving/conversation.py``).

Roles: system (and "developer", its newer name), user, assistant and tool. ``content`` is a
string or a list of text parts (``{"type": "text", "text": ...}``, joined with newlines);
a user message may also hold ``image_url`` parts (``data:`` URLs, or http(s) URLs the
server fetches only with ``--allow-image-urls``), kept as a list of text and image parts
(``server/serving/images.py``); other part types are refused by name. Assistant messages
may carry ``tool_calls`` (their JSON ``arguments`` are handed to the template as objects,
as vLLM does, since most templates ``tojson`` them) and ``reasoning_content``; tool
messages need ``tool_call_id``.

"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from mlxserve.server.http.json_body import JSONHazard, strict_json_text
from mlxserve.server.serving.images import ImageSource, image_part


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ToolCallFunction(_Model):
    name: str
    arguments: str = ""

    @field_validator("arguments")
    @classmethod
    def _safe_json(cls, value: str) -> str:
        # Arguments that are not JSON stay a string for the template; JSON that breaks the
        # body's rules (too deep, a lone surrogate) would break the template or tokenizer.
        try:
            strict_json_text(value)
        except JSONHazard as e:
            raise ValueError(f"'arguments' is unsafe JSON: {e.msg}.") from None
        except ValueError:
            pass
        return value


class ToolCall(_Model):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction

    def template_dict(self) -> dict[str, Any]:
        arguments: Any = self.function.arguments
        try:
            parsed = strict_json_text(arguments)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            arguments = parsed
        return {
            "id": self.id,
            "type": self.type,
            "function": {"name": self.function.name, "arguments": arguments},
        }


def _image_of_part(part: dict[str, Any], index: int) -> dict[str, Any]:
    image_url = part.get("image_url")
    if isinstance(image_url, str):  # some clients send the URL itself
        image_url = {"url": image_url}
    if (
        set(part) - {"type", "image_url"}
        or not isinstance(image_url, dict)
        or not isinstance(image_url.get("url"), str)
        or set(image_url) - {"url", "detail"}
    ):
        raise ValueError(
            "an image_url content part is {'type': 'image_url', 'image_url': {'url': "
            "string, 'detail': 'auto' | 'low' | 'high'}}."
        )
    return image_part(ImageSource.of_url(image_url["url"], f"messages.content[{index}]"))


def _content_of_parts(value: list[Any], images: bool) -> str | list[dict[str, Any]]:
    """Text parts joined with newlines, or (with an image among them) the list of text and
    image parts."""
    parts: list[dict[str, Any]] = []
    for index, part in enumerate(value):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise ValueError("each content part must be an object with a 'type'.")
        if part["type"] == "image_url" and images:
            parts.append(_image_of_part(part, index))
            continue
        if part["type"] != "text":
            allowed = "'text' and 'image_url'" if images else "'text'"
            raise ValueError(
                f"content parts of type '{part['type']}' are not supported here; only {allowed}."
            )
        if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
            raise ValueError("a text content part is {'type': 'text', 'text': string}.")
        parts.append({"type": "text", "text": part["text"]})
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


# /openapi.json's description of ``content`` (typed Any: ``_content_text`` checks it).
_CONTENT_SCHEMAS = [
    {"type": "string"},
    {
        "type": "array",
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                    "required": ["type", "text"],
                    "additionalProperties": False,
                },
                {
                    "type": "object",
                    "properties": {
                        "type": {"const": "image_url"},
                        "image_url": {
                            "type": "object",
                            "properties": {
                                "url": {"type": "string"},
                                "detail": {"enum": ["auto", "low", "high"]},
                            },
                            "required": ["url"],
                            "additionalProperties": False,
                        },
                    },
                    "required": ["type", "image_url"],
                    "additionalProperties": False,
                },
            ]
        },
    },
    {"type": "null"},
]


def _role_rules(schema: dict[str, Any]) -> None:
    """/openapi.json: what ``_content_text`` and ``_role_fields`` ask of each role."""
    text = {"anyOf": _CONTENT_SCHEMAS[:2]}
    forbid = [{"required": [name]} for name in ("tool_calls", "reasoning_content")]
    schema["oneOf"] = [
        {
            "properties": {"role": {"enum": ["system", "developer", "user"]}, "content": text},
            "required": ["content"],
            "not": {"anyOf": [*forbid, {"required": ["tool_call_id"]}]},
        },
        {"properties": {"role": {"const": "assistant"}}, "not": {"required": ["tool_call_id"]}},
        {
            "properties": {
                "role": {"const": "tool"},
                "content": text,
                "tool_call_id": {"type": "string"},
            },
            "required": ["content", "tool_call_id"],
            "not": {"anyOf": forbid},
        },
    ]


class ChatMessage(_Model):
    """One chat message; ``content`` is normalized to a string (text parts joined)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_role_rules)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = Field(
        default=None, validate_default=True, json_schema_extra={"anyOf": _CONTENT_SCHEMAS}
    )
    name: str | None = None
    # Assistant messages (as a client replays them from a previous answer).
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None
    refusal: None = None
    function_call: None = None
    audio: None = None
    annotations: list[Any] | None = None
    # Tool messages.
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _content_text(cls, value: Any, info: ValidationInfo) -> str | list[dict[str, Any]]:
        if value is None:
            if info.data.get("role") == "assistant":
                return ""  # e.g. a message with only tool_calls
            raise ValueError("'content' is required.")
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("'content' must be a string or a list of content parts.")
        return _content_of_parts(value, images=info.data.get("role") == "user")

    @model_validator(mode="after")
    def _role_fields(self) -> ChatMessage:
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("Missing required parameter: 'tool_call_id' (tool messages).")
        if self.role != "tool" and self.tool_call_id is not None:
            raise ValueError("'tool_call_id' is only allowed in tool messages.")
        if self.role != "assistant":
            for name in ("tool_calls", "reasoning_content"):
                if getattr(self, name) is not None:
                    raise ValueError(f"'{name}' is only allowed in assistant messages.")
        return self

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it ("developer" is the newer "system")."""
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": self.content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.template_dict() for call in self.tool_calls]
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def conversation_of(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as a chat template takes them."""
    return [m.template_dict() for m in messages]
