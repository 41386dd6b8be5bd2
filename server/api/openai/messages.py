"""Chat messages as OpenAI sends them, and the prompt the model's chat template makes of them.

Roles: system (and "developer", its newer name), user, assistant and tool. ``content`` is a
string or a list of text parts (``{"type": "text", "text": ...}``, joined with newlines);
other part types are refused by name. Assistant messages may carry ``tool_calls`` (their
JSON ``arguments`` are handed to the template as objects, as vLLM does, since most
templates ``tojson`` them) and ``reasoning_content``; tool messages need ``tool_call_id``.

Rendering follows vLLM's extensions: ``add_generation_prompt`` (default true) opens the
assistant's turn; ``continue_final_message`` (or ``add_generation_prompt: false`` after an
assistant message) leaves the final assistant message open so that the model continues it;
``chat_template_kwargs`` are extra template variables (e.g. ``enable_thinking``).
"""

from __future__ import annotations

import json
from typing import Any, Literal

import jinja2
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from mlxserve.server.http.errors import APIError, invalid_request
from mlxserve.server.serving.special_tokens import SpecialTokenGuard
from mlxserve.server.serving.tool_prompt import (
    hermes_messages,
    template_supports_tools,
    tool_results_as_user,
)

# Template variables a request may not set through chat_template_kwargs.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "return_dict",
        "return_tensors",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
    }
)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ToolCallFunction(_Model):
    name: str
    arguments: str = ""


class ToolCall(_Model):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction

    def template_dict(self) -> dict[str, Any]:
        arguments: Any = self.function.arguments
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            arguments = parsed
        return {
            "id": self.id,
            "type": self.type,
            "function": {"name": self.function.name, "arguments": arguments},
        }


def _text_of_parts(value: list[Any]) -> str:
    texts = []
    for part in value:
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise ValueError("each content part must be an object with a 'type'.")
        if part["type"] != "text":
            raise ValueError(
                f"content parts of type '{part['type']}' are not supported; only 'text'."
            )
        if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
            raise ValueError("a text content part is {'type': 'text', 'text': string}.")
        texts.append(part["text"])
    return "\n".join(texts)


# /openapi.json's description of ``content`` (typed Any: ``_content_text`` checks it).
_CONTENT_SCHEMAS = [
    {"type": "string"},
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
            "required": ["type", "text"],
            "additionalProperties": False,
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
    def _content_text(cls, value: Any, info: ValidationInfo) -> str:
        if value is None:
            if info.data.get("role") == "assistant":
                return ""  # e.g. a message with only tool_calls
            raise ValueError("'content' is required.")
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("'content' must be a string or a list of content parts.")
        return _text_of_parts(value)

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


def continuation_mode(
    messages: list[ChatMessage],
    add_generation_prompt: bool | None,
    continue_final_message: bool,
) -> tuple[bool, bool]:
    """Resolve ``(add_generation_prompt, continue_final_message)`` as vLLM does, with
    ``add_generation_prompt: false`` after a final assistant message meaning "continue it".

    Raises:
        APIError: 400 when both are asked, or a continuation without a final assistant
            message.
    """
    last_is_assistant = messages[-1].role == "assistant"
    if continue_final_message:
        if add_generation_prompt:
            raise invalid_request(
                "'continue_final_message' and 'add_generation_prompt' cannot both be true.",
                param="continue_final_message",
            )
        if not last_is_assistant:
            raise invalid_request(
                "'continue_final_message' needs the last message to be an assistant message.",
                param="continue_final_message",
            )
        return False, True
    if add_generation_prompt is None:
        return True, False
    return add_generation_prompt, (not add_generation_prompt and last_is_assistant)


def check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """Raises: APIError 400 for a ``chat_template_kwargs`` key the server sets itself."""
    kwargs = dict(kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise invalid_request(
            f"'chat_template_kwargs' may not set {reserved[0]!r}.", param="chat_template_kwargs"
        )
    return kwargs


def render_chat(
    tokenizer: Any,
    messages: list[ChatMessage],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    add_special_tokens: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[str, list[int]]:
    """Render ``messages`` with the model's chat template.

    ``tools`` (OpenAI tool dicts) go to a template that knows tools; for one that does not,
    the tools, the assistant's tool calls and the tool results are written into the
    messages in the default format (``server/serving/tool_prompt.py``), and a template refusing the
    ``tool`` role gets tool results as user messages.

    Returns:
        ``(prompt text, prompt token ids)``; the ids are the text encoded without added
        special tokens unless ``add_special_tokens`` (what HF's ``tokenize=True`` does).

    Raises:
        APIError: 400 if the model has no chat template or the template rejects the
            conversation (e.g. roles that do not alternate).
    """
    if not getattr(tokenizer, "has_chat_template", True):
        raise invalid_request(
            "This model has no chat template; use /v1/completions instead.",
            param="messages",
            code="no_chat_template",
        )
    kwargs = check_template_kwargs(template_kwargs)
    if continue_final_message:
        # Only when asked: custom renderers (mlx-lm's chat_template callables) may not take it.
        kwargs["continue_final_message"] = True
    conversation = [m.template_dict() for m in messages]
    attempts = [conversation]
    if template_supports_tools(tokenizer):
        if tools:
            kwargs["tools"] = tools
    else:
        conversation = hermes_messages(conversation, tools)
        attempts = [conversation, tool_results_as_user(conversation)]
        if attempts[1] == conversation:
            attempts.pop()
    # Special-token text of the client's becomes plain text (server/serving/special_tokens.py).
    guard = SpecialTokenGuard(tokenizer, [attempts, kwargs])
    for attempt, conversation in enumerate(attempts):
        try:
            text = tokenizer.apply_chat_template(
                guard.mask(conversation),
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **guard.mask(kwargs),
            )
            break
        except APIError:
            raise
        except (
            jinja2.TemplateError,
            ValueError,
            TypeError,
            KeyError,
            IndexError,
            RecursionError,
        ) as e:
            if attempt + 1 < len(attempts):
                continue
            message = f"The chat template rejected the messages: {e}"
            raise invalid_request(message, "messages") from e
    if not isinstance(text, str):
        raise invalid_request("The chat template did not render one prompt.", "messages")
    ids = guard.encode(text, add_special_tokens=add_special_tokens)
    return guard.restore(text), ids
