"""Pydantic models of the OpenAI request and response bodies we serve.

Requests forbid unknown fields, and fields OpenAI defines that we do not implement yet are
declared only to be rejected (unless they carry their no-op value), so no parameter is ever
silently ignored.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_serializer,
)

from scheduler.sampling_params import SamplingParams

MAX_STOP_STRINGS = 16
FinishReason = Literal["stop", "length"]

# OpenAI parameters we do not implement, and the values that mean "off" (accepted).
_NOOP_VALUES: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "logit_bias": ({},),
    "seed": (),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "response_format": ({"type": "text"},),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "reasoning_effort": (),
    "verbosity": (),
    "web_search_options": (),
    "store": (False,),
    "service_tier": ("auto", "default"),
}


def _reject_unsupported(value: Any, info: ValidationInfo) -> Any:
    name = info.field_name or "?"
    # NOTE: bool is an int in Python; n=True must not pass as n=1.
    if value is None or any(
        value == ok and isinstance(value, bool) == isinstance(ok, bool) for ok in _NOOP_VALUES[name]
    ):
        return value
    raise ValueError(f"The '{name}' parameter is not supported by this server.")


def _check_stop(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ValueError("'stop' must be a string or a list of strings.")
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}.")
    if any(not s for s in stops):
        raise ValueError("'stop' strings must be non-empty.")
    return stops


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Model):
    include_usage: bool = False


class GenerationRequest(_Model):
    """Fields shared by chat completions and completions."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: Any = None
    # Extensions (vLLM / SGLang spelling).
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0, le=1)
    ignore_eos: bool = False
    # Harmless metadata, accepted and unused.
    user: str | None = None
    metadata: dict[str, str] | None = None
    # Defined by OpenAI, not implemented: rejected unless off (see _NOOP_VALUES).
    n: Any = None
    logprobs: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    seed: Any = None
    service_tier: Any = None

    _unsupported_common = field_validator(
        "n",
        "logprobs",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "seed",
        "service_tier",
    )(_reject_unsupported)

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: Any) -> list[str]:
        return _check_stop(value)

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(
        cls, value: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError(
                "The 'stream_options' parameter is only allowed when 'stream' is true."
            )
        return value

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> int | None:
        """The completion budget the client asked for (None: as much as the context allows)."""
        return self.max_tokens

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """Engine sampling parameters for this request with the resolved token budget."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            ignore_eos=self.ignore_eos,
        )


# ---------------------------------------------------------------------------- chat requests


class ChatMessage(_Model):
    """One chat message; ``content`` is normalized to a string (text parts joined)."""

    role: Literal["system", "developer", "user", "assistant"]
    content: Any = Field(default=None, validate_default=True)
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content_text(cls, value: Any, info: ValidationInfo) -> str:
        if value is None:
            if info.data.get("role") == "assistant":
                return ""
            raise ValueError("'content' is required.")
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("'content' must be a string or a list of content parts.")
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

    def template_dict(self) -> dict[str, str]:
        """The message as chat templates expect it ("developer" is the newer "system")."""
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.content}


class ChatCompletionRequest(GenerationRequest):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    # Harmless chat-only metadata.
    parallel_tool_calls: bool | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # Chat-only OpenAI parameters, not implemented.
    top_logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    store: Any = None

    _unsupported_chat = field_validator(
        "top_logprobs",
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "response_format",
        "audio",
        "modalities",
        "prediction",
        "reasoning_effort",
        "verbosity",
        "web_search_options",
        "store",
    )(_reject_unsupported)

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is the newer name; it wins when both are sent.
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


# ---------------------------------------------------------------------- completion requests


class CompletionRequest(GenerationRequest):
    """Body of ``POST /v1/completions``; ``prompt`` is normalized to a string or token ids."""

    prompt: Any
    best_of: Any = None
    echo: Any = None
    suffix: Any = None

    _unsupported_completion = field_validator("best_of", "echo", "suffix")(_reject_unsupported)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any) -> str | list[int]:
        # A batch of one prompt is unwrapped; real batches (n prompts) are not supported.
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
            value = value[0]
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value and all(_is_int(t) for t in value):
            return [int(t) for t in value]
        if isinstance(value, list) and len(value) > 1 and all(isinstance(p, str) for p in value):
            raise ValueError("'prompt' with several prompts is not supported; send one.")
        raise ValueError("'prompt' must be a string or a non-empty list of token ids.")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -------------------------------------------------------------------------------- responses


def now() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    """A streamed message delta; absent fields are left out, as OpenAI does."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
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
    logprobs: None = None
    finish_reason: FinishReason | None = None


class Completion(BaseModel):
    """A text completion, whole (``usage`` set) or one streamed chunk of it."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "mlxserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
