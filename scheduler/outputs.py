"""What the engine thread pushes back to a request's consumer, one event per step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

FinishReason = Literal["stop", "length", "abort", "error"]


class ExecutorFailed(RuntimeError):
    """The executor can run no more forwards (e.g. a rank of its group was lost): the
    engine fails every request and stops, so ``/health`` turns 503 and the server exits."""


@dataclass(frozen=True)
class TokenLogprob:
    """The model's raw logprob of one token and its ``top`` alternatives.

    Attributes:
        token_id: the sampled (or prompt) token.
        logprob: its log-softmax under the model, before temperature, penalties, bias or
            any filter (OpenAI's definition).
        top: ``(token_id, logprob)`` of the most likely tokens at that position, most
            likely first; as many as the request asked for (may be empty).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class RequestOutput:
    """New tokens of one request produced in one engine step.

    ``finished`` is True exactly once, on the last event of the request. ``error`` is set
    (with ``finish_reason == "error"``) when serving this request raised; other requests
    are unaffected.

    ``logprobs`` (when the request asked) is aligned with ``new_token_ids``.
    ``prompt_logprobs`` (when asked) comes on the request's first token event only: one entry
    per prompt token, ``None`` for the first (nothing predicts it).

    ``embedding`` is set on the one (finishing) event of an embedding request: the model's
    final hidden state (normed, unpooled further, not normalized) at the prompt's last
    position for a decoder, the pooled output for an encoder; float32 ``[hidden]``.
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    # The error is the request's own fault (e.g. a grammar the vocabulary cannot satisfy):
    # the server answers 400 rather than 500 when the response has not started.
    invalid_request: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Prompt tokens whose K/V came from the prefix cache (usage.prompt_tokens_details).
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    embedding: np.ndarray | None = None
