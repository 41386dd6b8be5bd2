"""A request's ``RequestOutput`` event: its new tokens and, when it ends, why."""

from __future__ import annotations

from mlxserve.scheduler.outputs import FinishReason, RequestOutput
from mlxserve.scheduler.request import Request


def make_event(
    req: Request,
    tokens: list[int],
    reason: FinishReason | None,
    error: str | None = None,
    invalid: bool = False,
) -> RequestOutput:
    """The event carrying ``tokens`` (new this step) for ``req``; finished when ``reason``
    is given, a failure when ``error`` is (``invalid``: the request's own fault, a 400)."""
    return RequestOutput(
        request_id=req.request_id,
        new_token_ids=tokens,
        finished=reason is not None,
        finish_reason=reason,
        error=error,
        invalid_request=invalid,
        prompt_tokens=req.prompt_len,
        completion_tokens=req.output_len,
        cached_tokens=req.prefix_hit_len or 0,
    )
