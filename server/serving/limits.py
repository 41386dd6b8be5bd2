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


def check_queue(unfinished: int, n: int, max_running: int, max_queue: int) -> None:
    """Admit ``n`` more engine requests (a request's choices) only while those that would
    wait for a free batch row fit the queue.

    Args:
        unfinished: engine requests running or waiting now.
        n: engine requests the new request adds (its ``n``).
        max_running: batch rows: requests beyond them wait.
        max_queue: requests that may wait (0: no limit).

    Raises:
        APIError: 429 ``queue_full`` (with Retry-After) when the queue would overflow.
    """
    waiting = max(unfinished - max_running, 0)
    if max_queue and unfinished + n - max_running > max_queue:
        raise APIError(
            429,
            f"The server is busy: {waiting} requests are already waiting for a free slot "
            f"and this one would add {min(n, unfinished + n - max_running)} to the queue "
            f"(limit {max_queue}). Please retry later.",
            type="rate_limit_exceeded",
            code="queue_full",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
