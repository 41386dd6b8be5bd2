"""Token log-probabilities in OpenAI's two shapes, from the engine's ``TokenLogprob``s.

Chat (``choices[i].logprobs``)::

    {"content": [{"token": " Paris", "logprob": -0.1, "bytes": [32, 80, ...],
                  "top_logprobs": [{"token": " Paris", "logprob": -0.1, "bytes": [...]}, ...]}]}

Completions (``choices[i].logprobs``), the prompt's tokens first when ``echo`` is set (the
first prompt token has no logprob)::

    {"tokens": [...], "token_logprobs": [None, -2.3, ...],
     "top_logprobs": [None, {" Paris": -0.1, ...}, ...], "text_offset": [0, 3, ...]}

A token's text is its exact bytes (byte-level BPE pieces and ``<0xNN>`` byte tokens are
mapped back to bytes); a token that is not valid UTF-8 on its own (part of a character) is
written ``bytes:\\xe2\\x80`` as OpenAI does, with its ``bytes`` still exact. ``-inf``
(and NaN) log-probabilities become ``-9999.0``, since JSON has no infinity.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from mlxserve.server.serving.detokenizer import IncrementalDetokenizer

MIN_LOGPROB = -9999.0
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass(frozen=True)
class TokenEntry:
    """One generated (or prompt) token with its log-probabilities.

    Attributes:
        token_id: the token.
        logprob: its log-probability (None: the first prompt token, which has none).
        top: the most likely alternatives, ``(token_id, logprob)``, most likely first.
        text_offset: characters of text before this token's text.
    """

    token_id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...]
    text_offset: int


def clamp(logprob: float) -> float:
    """A JSON-safe log-probability."""
    return MIN_LOGPROB if math.isnan(logprob) or logprob < MIN_LOGPROB else float(logprob)


def bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte -> printable character map used by byte-level BPE.
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


_BYTE_DECODER = {c: b for b, c in bytes_to_unicode().items()}


def _is_byte_level(tokenizer: Any) -> bool:
    try:
        from tokenizers import decoders

        return isinstance(tokenizer.backend_tokenizer.decoder, decoders.ByteLevel)
    except Exception:  # noqa: BLE001 - not a fast HF tokenizer: decode tokens one by one
        return False


class TokenTexts:
    """Token id -> ``(text, bytes)`` as the logprobs shapes show it (cached).

    Args:
        tokenizer: the model's tokenizer (``convert_ids_to_tokens``, ``decode``).
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._byte_level = _is_byte_level(tokenizer)
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def _raw_bytes(self, token_id: int) -> bytes:
        piece = None
        try:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
        except Exception:  # noqa: BLE001
            piece = None
        if isinstance(piece, str) and piece:
            if self._byte_level and all(c in _BYTE_DECODER for c in piece):
                return bytes(_BYTE_DECODER[c] for c in piece)
            match = _BYTE_TOKEN.fullmatch(piece)
            if match:
                return bytes([int(match.group(1), 16)])
            if not self._byte_level and "▁" in piece:
                return piece.replace("▁", " ").encode()
        return self._tokenizer.decode([token_id]).encode()

    def of(self, token_id: int) -> tuple[str, list[int]]:
        """The token's display text and its UTF-8 bytes."""
        cached = self._cache.get(token_id)
        if cached is None:
            raw = self._raw_bytes(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            cached = self._cache[token_id] = (text, list(raw))
        return cached


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


def prompt_entries(
    tokenizer: Any, prompt_ids: Sequence[int], prompt_logprobs: Sequence[Any] | None
) -> list[TokenEntry]:
    """The prompt's tokens as entries with their offsets in the prompt's text.

    Args:
        tokenizer: the model's tokenizer.
        prompt_ids: the prompt.
        prompt_logprobs: the engine's ``TokenLogprob | None`` per prompt token (the first is
            None), or None when they were not computed (every logprob is then None).
    """
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    entries = []
    offset = 0
    for i, token_id in enumerate(prompt_ids):
        lp = None
        if prompt_logprobs is not None and i < len(prompt_logprobs):
            lp = prompt_logprobs[i]
        logprob = None if lp is None else float(lp.logprob)
        top = () if lp is None else tuple(lp.top)
        entries.append(TokenEntry(token_id, logprob, top, offset))
        offset += len(detokenizer.add(token_id))
    return entries
