"""Pydantic models of the OpenAI response bodies we send (requests: ``schemas.py``)."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, model_serializer

from mlxserve.server.api.openai.logprobs import ChatLogprobs, CompletionLogprobs
from mlxserve.server.serving.usage import UsageCounts

FinishReason = Literal["stop", "length", "tool_calls"]


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @classmethod
    def of(cls, counts: UsageCounts) -> Usage:
        return cls(
            prompt_tokens=counts.prompt_tokens,
            completion_tokens=counts.completion_tokens,
            total_tokens=counts.total_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=counts.cached_tokens),
        )


class _DropNone(BaseModel):
    """Leaves out the fields listed in ``_optional`` when they are None."""

    _optional: tuple[str, ...] = ()

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        return {k: v for k, v in data.items() if v is not None or k not in self._optional}


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object's text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(_DropNone):
    """The answer; ``reasoning_content`` is sent only by reasoning models, ``tool_calls``
    only when the model called tools (``content`` is then null unless it wrote text too)."""

    _optional = ("reasoning_content", "tool_calls")
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(_DropNone):
    _optional = ("name", "arguments")
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_DropNone):
    """A fragment of a streamed tool call: the first has ``id``, ``type`` and the function's
    name, the next ones pieces of its ``arguments``."""

    _optional = ("id", "type")
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(_DropNone):
    """A streamed message delta; absent fields are left out, as OpenAI does."""

    _optional = ("role", "content", "reasoning_content", "tool_calls")
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class Completion(BaseModel):
    """A text completion, whole (``usage`` set) or one streamed chunk of it."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(_DropNone):
    """One model of ``/v1/models``: OpenAI's fields, vLLM's ``max_model_len`` (once it is
    loaded) and its ``status`` (loaded, loading, unloaded)."""

    _optional = ("max_model_len",)
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "mlxserve"
    max_model_len: int | None = None
    status: Literal["loaded", "loading", "unloaded"] = "loaded"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
