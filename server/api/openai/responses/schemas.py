"""Pydantic models of the ``POST /v1/responses`` body (``openai`` SDK types).

Unknown fields are a 400 naming them. Fields OpenAI defines that mean nothing locally are
accepted and ignored: ``include``, ``prompt_cache_key``, ``prompt_cache_retention``,
``prompt_cache_options`` (the prefix cache is automatic), ``safety_identifier``,
``service_tier``, ``stream_options``, ``text.verbosity``, ``reasoning.summary``, ``user``,
``metadata`` (echoed). Fields with a meaning this server does not implement are a 400
unless they carry their "off" value: ``background``, ``conversation``, ``prompt``,
``context_management``, ``max_tool_calls``, ``top_logprobs``, ``truncation: "auto"``, and
every built-in tool (``web_search``, ``file_search``, ``computer_use_preview``, ...).
Input items: ``items.py``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mlxserve.server.api.openai.tools import FUNCTION_NAME_PATTERN

MAX_METADATA_KEYS = 16


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionTool(_Model):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    # Accepted, meaning nothing locally.
    defer_loading: bool | None = None
    allowed_callers: list[str] | None = None
    output_schema: dict[str, Any] | None = None

    def echo(self) -> dict[str, Any]:
        """The tool as the response object lists it."""
        return {
            "type": "function",
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters,
            "strict": self.strict if self.strict is not None else True,
        }


def _function_tools_only(value: Any) -> Any:
    if not isinstance(value, list):
        return value
    for i, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise ValueError(
                f"tools[{i}] is the built-in tool '{kind}', which this server does not run; "
                "only 'function' tools are supported."
            )
    return value


class FunctionChoice(_Model):
    type: Literal["function"]
    name: str


def _check_tool_choice(value: Any) -> Any:
    if value is None or value in ("none", "auto", "required"):
        return value
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "function":
        return FunctionChoice.model_validate(value)
    if isinstance(kind, str):
        raise ValueError(
            f"tool_choice of type '{kind}' is not supported; use 'none', 'auto', 'required' "
            "or {'type': 'function', 'name': ...}."
        )
    raise ValueError(
        "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}."
    )


class TextFormatText(_Model):
    type: Literal["text"]


class TextFormatJsonObject(_Model):
    type: Literal["json_object"]


class TextFormatJsonSchema(_Model):
    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[
    TextFormatText | TextFormatJsonObject | TextFormatJsonSchema, Field(discriminator="type")
]


class TextConfig(_Model):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Model):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(_Model):
    include_obfuscation: bool | None = None


def _off(value: Any, off: tuple[Any, ...], name: str) -> Any:
    if value is None or any(value == ok and type(value) is type(ok) for ok in off):
        return value
    raise ValueError(f"The '{name}' parameter is not supported by this server.")


# The type of a field declared only to be refused by name.
_Unsupported = dict[str, Any] | list[Any] | str | None


class ResponsesRequest(_Model):
    """Body of ``POST /v1/responses``."""

    model: str
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=MAX_METADATA_KEYS)
    user: str | None = None
    # Accepted, meaning nothing locally.
    include: list[str] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    # Defined by OpenAI, not implemented: a 400 unless off.
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    conversation: _Unsupported = None
    prompt: _Unsupported = None
    context_management: _Unsupported = None
    moderation: _Unsupported = None
    image: _Unsupported = None
    access_programs: _Unsupported = None
    background_options: _Unsupported = None

    _tools = field_validator("tools", mode="before")(_function_tools_only)
    _choice = field_validator("tool_choice", mode="before")(_check_tool_choice)

    @field_validator("max_output_tokens", mode="before")
    @classmethod
    def _no_bool(cls, value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError("must be an integer, not a boolean.")
        return value

    @field_validator(
        "truncation",
        "background",
        "top_logprobs",
        "max_tool_calls",
        "conversation",
        "prompt",
        "context_management",
        "moderation",
        "image",
        "access_programs",
        "background_options",
    )
    @classmethod
    def _unsupported(cls, value: Any, info: Any) -> Any:
        off = {"truncation": ("disabled",), "background": (False,), "top_logprobs": (0,)}
        return _off(value, off.get(info.field_name, ()), info.field_name)

    @property
    def text_format(self) -> TextFormatText | TextFormatJsonObject | TextFormatJsonSchema:
        if self.text is None or self.text.format is None:
            return TextFormatText(type="text")
        return self.text.format
