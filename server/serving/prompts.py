"""Completion prompt -> token ids, and the completion budget that fits the context.

Chat prompts are rendered in ``server/api/openai/messages.py``.
"""

from __future__ import annotations

from typing import Any

from mlxserve.server.http.errors import APIError, invalid_request


def completion_prompt_ids(tokenizer: Any, prompt: str | list[int], vocab_size: int) -> list[int]:
    """Tokenize a completion prompt, or check the token ids the client sent.

    Raises:
        APIError: 400 for an empty prompt or a token id outside the vocabulary.
    """
    if isinstance(prompt, str):
        ids = list(tokenizer.encode(prompt))
    else:
        # NOTE: MLX does not bounds-check embedding lookups; a bad id would crash the engine.
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise invalid_request(
                f"Token id {bad[0]} in 'prompt' is outside the vocabulary [0, {vocab_size}).",
                param="prompt",
            )
        ids = list(prompt)
    if not ids:
        raise invalid_request("'prompt' must not be empty.", param="prompt")
    return ids


def resolve_max_tokens(
    prompt_len: int, requested: int | None, context_length: int, param: str
) -> int:
    """The completion budget: what was requested, or all the context the prompt leaves.

    Args:
        prompt_len: prompt tokens.
        requested: ``max_tokens`` from the request, or None.
        context_length: the longest prompt + completion served.
        param: the parameter holding the prompt ("messages" or "prompt"), for the error.

    Raises:
        APIError: 400 ``context_length_exceeded`` when the prompt plus the requested
            completion (at least one token) do not fit.
    """
    if requested is None:
        if prompt_len < context_length:
            return context_length - prompt_len
        raise APIError(
            400,
            f"This model's maximum context length is {context_length} tokens. However, your "
            f"{param} resulted in {prompt_len} tokens, which leaves no room for a completion. "
            f"Please reduce the length of the {param}.",
            param=param,
            code="context_length_exceeded",
        )
    if prompt_len + requested > context_length:
        raise APIError(
            400,
            f"This model's maximum context length is {context_length} tokens. However, you "
            f"requested {prompt_len + requested} tokens ({prompt_len} in the {param}, "
            f"{requested} in the completion). Please reduce the length of the {param} or "
            "completion.",
            param=param,
            code="context_length_exceeded",
        )
    return requested
