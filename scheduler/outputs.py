"""What the engine thread pushes back to a request's consumer, one event per step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True)
class RequestOutput:
    """New tokens of one request produced in one engine step.

    ``finished`` is True exactly once, on the last event of the request. ``error`` is set
    (with ``finish_reason == "error"``) when serving this request raised; other requests
    are unaffected.
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
