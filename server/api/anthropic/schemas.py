"""Pydantic models of the Anthropic Messages request bodies (``anthropic`` SDK 2.x types).

Unknown fields are a 400 naming them. Fields the SDK defines that mean nothing locally are
accepted and ignored: ``cache_control`` (the prefix cache is automatic), ``container``,
``diagnostics``, ``inference_geo``, ``service_tier``, ``speed``, ``metadata``. The sampling
fields the 2.x SDK no longer types but clients still send in the body (``temperature``,
``top_p``, ``top_k``) are served.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mlxserve.server.api.anthropic.content import (
    CacheControl,
    ContentBlock,
    TextBlock,
    check_block_types,
    text_blocks,
)

# Anthropic's tool name pattern, with dots allowed too (namespaced tools).
TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_.-]{1,128}$"
MAX_STOP_SEQUENCES = 64


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MessageParam(_Model):
    role: Literal["user", "assistant", "system"]
    content: list[ContentBlock]

    _blocks = field_validator("content", mode="before")(check_block_types)


class CustomTool(_Model):
    """A client tool: the model may call it with an ``input`` following ``input_schema``."""

    name: str = Field(pattern=TOOL_NAME_PATTERN)
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    strict: bool | None = None
    cache_control: CacheControl | None = None
    input_examples: list[dict[str, Any]] | None = None
    defer_loading: bool | None = None
    eager_input_streaming: bool | None = None
    allowed_callers: list[str] | None = None

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        if value.get("type") != "object":
            raise ValueError("'input_schema' must be a JSON schema of type 'object'.")
        return value


def _client_tools_only(value: Any) -> Any:
    if not isinstance(value, list):
        return value
    for i, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(
                f"tools[{i}] is the server tool '{kind}', which runs on Anthropic's servers; "
                "this server has client tools only (no 'type', or 'custom')."
            )
    return value


class ToolChoiceAuto(_Model):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(_Model):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(_Model):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(_Model):
    type: Literal["none"]


ToolChoice = Annotated[
    ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")
]


class ThinkingEnabled(_Model):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1)
    display: Literal["summarized", "omitted"] | None = None


class ThinkingAdaptive(_Model):
    type: Literal["adaptive"]
    display: Literal["summarized", "omitted"] | None = None


class ThinkingDisabled(_Model):
    type: Literal["disabled"]


Thinking = Annotated[
    ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled, Field(discriminator="type")
]


class JSONOutputFormat(_Model):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Model):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JSONOutputFormat | None = None


class Metadata(_Model):
    user_id: str | None = None


class CountTokensRequest(_Model):
    """Body of ``POST /v1/messages/count_tokens``: what shapes the prompt."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: list[TextBlock] | None = None
    tools: list[CustomTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    # Accepted, meaning nothing locally.
    cache_control: CacheControl | None = None
    speed: Literal["standard", "fast"] | None = None

    _tools = field_validator("tools", mode="before")(_client_tools_only)
    _system = field_validator("system", mode="before")(text_blocks)

    def system_text(self) -> str | None:
        """The system prompt (text blocks joined with newlines)."""
        if self.system is None:
            return None
        return "\n".join(block.text for block in self.system)

    def thinking_enabled(self) -> bool | None:
        """The request's thinking switch (None: the model's default)."""
        if self.thinking is None:
            return None
        return self.thinking.type != "disabled"


class MessagesRequest(CountTokensRequest):
    """Body of ``POST /v1/messages``."""

    max_tokens: int = Field(ge=0)
    stream: bool = False
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = Field(
        default=None, max_length=MAX_STOP_SEQUENCES
    )
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    metadata: Metadata | None = None
    # Accepted, meaning nothing locally.
    container: str | dict[str, Any] | None = None
    diagnostics: dict[str, Any] | None = None
    inference_geo: str | None = None
    service_tier: Literal["auto", "standard_only"] | None = None

    @field_validator("max_tokens", "top_k", mode="before")
    @classmethod
    def _no_bool(cls, value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError("must be an integer, not a boolean.")
        return value

    @model_validator(mode="after")
    def _budget_within_max_tokens(self) -> MessagesRequest:
        thinking = self.thinking
        if isinstance(thinking, ThinkingEnabled) and thinking.budget_tokens >= self.max_tokens:
            raise ValueError("'thinking.budget_tokens' must be less than 'max_tokens'.")
        return self
