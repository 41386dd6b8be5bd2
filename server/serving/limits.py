"""Admission limits: prompt length and queue depth (429 with ``Retry-After`` when full)."""

from __future__ import annotations

from mlxserve.server.http.errors import APIError

# Seconds a client is told to wait after a 429 (the queue drains at the engine's pace).
RETRY_AFTER_S = 1


def check_prompt_tokens(prompt_tokens: int, max_prompt_tokens: int, param: str) -> None:
    """Raises: APIError 400 ``prompt_too_long`` over ``max_prompt_tokens`` (0: no limit)."""
    if max_prompt_tokens and prompt_tokens > max_prompt_tokens:
        raise APIError(
            400,
            f"The {param} resulted in {prompt_tokens} tokens, more than this server's limit "
            f"of {max_prompt_tokens} prompt tokens. Please reduce the length of the {param}.",
            param=param,
            code="prompt_too_long",
        )


def check_queue(waiting: int, max_queue: int) -> None:
    """Raises: APIError 429 ``queue_full`` (with Retry-After) when ``waiting`` requests
    already fill the queue of ``max_queue`` (0: no limit)."""
    if max_queue and waiting >= max_queue:
        raise APIError(
            429,
            f"The server is busy: {waiting} requests are already waiting (limit "
            f"{max_queue}). Please retry later.",
            type="rate_limit_exceeded",
            code="queue_full",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
