"""Pydantic models of the OpenAI request bodies we serve (responses: ``response_models.py``).

Requests forbid unknown fields, and fields OpenAI defines that we do not implement yet are
declared only to be rejected (unless they carry their no-op value), so no parameter is ever
silently ignored. Checks that need the model (vocabulary, context) are made when the
request is submitted (``server/serving/sampling.py``, ``server/serving/prompts.py``).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from mlxserve.scheduler.sampling_params import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY
from mlxserve.server.api.openai.messages import ChatMessage
from mlxserve.server.api.openai.openapi_fields import describe_any_fields
from mlxserve.server.api.openai.structured_output import (
    ResponseFormat,
    StructuredOutputs,
    json_schema_value,
)
from mlxserve.server.api.openai.tools import NamedToolChoice, ToolChoice, ToolDefinition
from mlxserve.server.serving.sampling import INT64_MAX, INT64_MIN

# OpenAI's limits.
MAX_STOP_STRINGS = 4
MAX_N = 128
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0


# OpenAI parameters we do not implement, and the values that mean "off" (accepted).
_NOOP_VALUES: dict[str, tuple[Any, ...]] = {
    "suffix": ("",),
    "functions": ([],),
    "function_call": ("none",),
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


def _no_bool(value: Any) -> Any:
    """Integer parameters refuse booleans (which pydantic would read as 0 / 1)."""
    if isinstance(value, bool):
        raise ValueError("must be an integer, not a boolean.")
    return value


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


def _check_logit_bias(value: Any) -> dict[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("'logit_bias' must be an object mapping token ids to biases.")
    bias = {}
    for key, bias_value in value.items():
        # NOTE: int() alone would also take " 5", "1_0" and non-ASCII digits ("٥").
        if isinstance(key, bool) or not (
            isinstance(key, int) or (isinstance(key, str) and _TOKEN_ID.fullmatch(key))
        ):
            raise ValueError(f"'logit_bias' key {key!r} is not a token id.")
        token = int(key)
        if isinstance(bias_value, bool) or not isinstance(bias_value, int | float):
            raise ValueError(f"'logit_bias' value for token {key} must be a number.")
        if not -MAX_LOGIT_BIAS <= bias_value <= MAX_LOGIT_BIAS:
            raise ValueError(
                f"'logit_bias' values must be in [-100, 100], got {bias_value} for token {key}."
            )
        bias[token] = float(bias_value)
    return bias


_TOKEN_ID = re.compile(r"-?[0-9]+")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Model):
    include_usage: bool = False


class GenerationRequest(_Model):
    """Fields shared by chat completions and completions."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra=describe_any_fields(_NOOP_VALUES, MAX_STOP_STRINGS, MAX_LOGIT_BIAS),
    )
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: Any = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: Any = None
    # Extensions (vLLM / SGLang spelling). top_k -1 is vLLM's "off", like 0.
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(
        default=None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY
    )
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    # vLLM's prefix-cache salt: a salted request only reuses cached prefixes of requests
    # with the same salt (server/serving/cache_namespace.py).
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    # Structured output (server/api/openai/structured_output.py): OpenAI's response_format, vLLM's
    # structured_outputs and its older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None  # an object, or its JSON text
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = None
    # Harmless metadata, accepted and unused.
    user: str | None = None
    metadata: dict[str, str] | None = None
    # Defined by OpenAI, not implemented: rejected unless off (see _NOOP_VALUES).
    service_tier: Any = None

    _unsupported_common = field_validator("service_tier")(_reject_unsupported)
    _ints = field_validator("n", "seed", "top_k", "min_tokens", "max_tokens", mode="before")(
        _no_bool
    )

    _guided_json = field_validator("guided_json", mode="before")(json_schema_value)

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: Any) -> list[str]:
        return _check_stop(value)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: Any) -> dict[int, float] | None:
        return _check_logit_bias(value)

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

    def logprobs_count(self) -> int | None:
        """Alternatives per generated token (None: no logprobs)."""
        return None

    def prompt_logprobs_count(self) -> int | None:
        """Alternatives per prompt token (None: no prompt logprobs)."""
        return None


# ---------------------------------------------------------------------------- chat requests


class ChatCompletionRequest(GenerationRequest):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # vLLM's extensions.
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # Tool calling (server/api/openai/tools.py).
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Harmless chat-only metadata.
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # Chat-only OpenAI parameters, not implemented (legacy functions: use tools).
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    store: Any = None

    _unsupported_chat = field_validator(
        "functions",
        "function_call",
        "audio",
        "modalities",
        "prediction",
        "reasoning_effort",
        "verbosity",
        "web_search_options",
        "store",
    )(_reject_unsupported)
    _chat_ints = field_validator("top_logprobs", "max_completion_tokens", mode="before")(_no_bool)

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, value: Any) -> ToolChoice | None:
        if value is None or value in ("none", "auto", "required"):
            return value
        function = value.get("function") if isinstance(value, dict) else None
        if (
            isinstance(function, dict)
            and value.get("type") == "function"
            and set(value) == {"type", "function"}
            and set(function) == {"name"}
            and isinstance(function["name"], str)
        ):
            return NamedToolChoice.model_validate(value)
        raise ValueError(
            "'tool_choice' must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}.'
        )

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("'top_logprobs' requires 'logprobs' to be true.")
        return value

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is the newer name; it wins when both are sent.
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# ---------------------------------------------------------------------- completion requests


class CompletionRequest(GenerationRequest):
    """Body of ``POST /v1/completions``; ``prompt`` is normalized to a string or token ids.

    ``max_tokens: 0`` is allowed with ``echo`` (the prompt and its logprobs only, as
    OpenAI's legacy API and vLLM allow).
    """

    prompt: Any
    max_tokens: int | None = Field(default=None, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = Field(default=False, validate_default=True)
    best_of: int | None = Field(default=None, ge=1)
    suffix: Any = None

    _unsupported_completion = field_validator("suffix")(_reject_unsupported)
    _completion_ints = field_validator("logprobs", "best_of", mode="before")(_no_bool)

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

    @field_validator("echo")
    @classmethod
    def _zero_max_tokens_needs_echo(cls, value: bool, info: ValidationInfo) -> bool:
        if not value and info.data.get("max_tokens") == 0:
            raise ValueError("'max_tokens' may be 0 only when 'echo' is true.")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value not in (1, info.data.get("n")):
            raise ValueError(
                "The 'best_of' parameter is not supported by this server (only best_of == n)."
            )
        return value

    def logprobs_count(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_count(self) -> int | None:
        return self.logprobs if self.echo else None


def _is_int(value: Any) -> bool:
    # 2.0 is an integer to JSON Schema (and to pydantic's int fields): accept it here too.
    if isinstance(value, float):
        return value.is_integer()
    return isinstance(value, int) and not isinstance(value, bool)
