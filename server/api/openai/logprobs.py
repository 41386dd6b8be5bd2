"""Token log-probabilities in OpenAI's two shapes, from the engine's ``TokenLogprob``s.

Chat (``choices[i].logprobs``)::

    {"content": [{"token": " Paris", "logprob": -0.1, "bytes": [32, 80, ...],
                  "top_logprobs": [{"token": " Paris", "logprob": -0.1, "bytes": [...]}, ...]}]}

Completions (``choices[i].logprobs``), the prompt's tokens first when ``echo`` is set (the
first prompt token has no logprob)::

    {"tokens": [...], "token_logprobs": [None, -2.3, ...],
     "top_logprobs": [None, {" Paris": -0.1, ...}, ...], "text_offset": [0, 3, ...]}

Token texts, bytes and clamping come from ``server/serving/token_logprobs.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pydantic import BaseModel

from mlxserve.server.serving.token_logprobs import MIN_LOGPROB, TokenEntry, TokenTexts, clamp

# ------------------------------------------------------------------------------ chat shape


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


def chat_logprobs(
    entries: Iterable[TokenEntry], texts: TokenTexts, top_n: int
) -> list[ChatTokenLogprob]:
    """The chat ``logprobs.content`` items of ``entries`` with ``top_n`` alternatives."""
    items = []
    for entry in entries:
        text, raw = texts.of(entry.token_id)
        top = []
        for token_id, logprob in entry.top[:top_n]:
            top_text, top_raw = texts.of(token_id)
            top.append(ChatTopLogprob(token=top_text, logprob=clamp(logprob), bytes=top_raw))
        logprob = clamp(entry.logprob if entry.logprob is not None else MIN_LOGPROB)
        items.append(ChatTokenLogprob(token=text, logprob=logprob, bytes=raw, top_logprobs=top))
    return items


# ------------------------------------------------------------------------ completions shape


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


def completion_logprobs(
    entries: Sequence[TokenEntry], texts: TokenTexts, top_n: int, offset: int = 0
) -> CompletionLogprobs:
    """The completions ``logprobs`` object of ``entries``.

    Args:
        entries: the tokens, in order.
        texts: token id -> text.
        top_n: alternatives per token (the sampled token is added when it is not among them,
            as vLLM does).
        offset: added to every ``text_offset`` (the echoed prompt's length).
    """
    result = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for entry in entries:
        result.tokens.append(texts.of(entry.token_id)[0])
        result.text_offset.append(entry.text_offset + offset)
        if entry.logprob is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(clamp(entry.logprob))
        top: dict[str, float] = {}
        for token_id, logprob in entry.top[:top_n]:
            top.setdefault(texts.of(token_id)[0], clamp(logprob))
        top.setdefault(texts.of(entry.token_id)[0], clamp(entry.logprob))
        result.top_logprobs.append(top)
    return result
