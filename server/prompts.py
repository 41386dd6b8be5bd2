"""Request -> prompt token ids, and the completion budget that fits the context."""

from __future__ import annotations

from typing import Any

import jinja2

from server.errors import APIError, invalid_request
from server.schemas import ChatMessage


def chat_prompt_ids(tokenizer: Any, messages: list[ChatMessage]) -> list[int]:
    """Render ``messages`` with the model's chat template (generation prompt added).

    Raises:
        APIError: 400 if the model has no chat template or the template rejects the
            conversation (e.g. roles that do not alternate).
    """
    if not getattr(tokenizer, "has_chat_template", True):
        raise invalid_request(
            "This model has no chat template; use /v1/completions instead.", param="messages"
        )
    try:
        ids = tokenizer.apply_chat_template(
            [m.template_dict() for m in messages], add_generation_prompt=True, tokenize=True
        )
    except jinja2.TemplateError as e:
        raise invalid_request(f"The chat template rejected the messages: {e}", "messages") from e
    # transformers may answer a BatchEncoding instead of a list, depending on its version.
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


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
