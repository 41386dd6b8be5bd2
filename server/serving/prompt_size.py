"""Refusing text that cannot fit the context before it is rendered or encoded.

No token's text is longer than the longest string in the vocabulary, so a prompt whose
client text has more than ``context_length * max_token_chars`` characters cannot be
encoded into ``context_length`` tokens: it is refused at once, without paying for its
template rendering and tokenization (seconds for megabytes of text). The bound is safe:
it never refuses a prompt that fits.
"""

from __future__ import annotations

from typing import Any

from mlxserve.server.http.errors import APIError


def max_token_chars(tokenizer: Any) -> int:
    """The most characters any single token stands for (vocabulary strings, added tokens
    included; at least 1)."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary: no bound
        return 0
    return max((len(piece) for piece in vocab), default=1) or 1


def check_text_fits(chars: int, context_length: int, max_chars: int, param: str) -> None:
    """Raises: APIError 400 ``context_length_exceeded`` when ``chars`` characters of client
    text cannot fit in ``context_length`` tokens (``max_chars`` 0: no bound known)."""
    if max_chars and chars > context_length * max_chars:
        raise APIError(
            400,
            f"This model's maximum context length is {context_length} tokens. However, your "
            f"{param} has {chars} characters, more than {context_length} tokens can hold. "
            f"Please reduce the length of the {param}.",
            param=param,
            code="context_length_exceeded",
        )


def text_chars(value: Any) -> int:
    """Characters of every string in ``value`` (strings, dicts, lists; iterative)."""
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return total
