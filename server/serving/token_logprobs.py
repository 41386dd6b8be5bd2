"""Tokens with their log-probabilities, before any protocol shapes them.

``TokenEntry`` is one generated (or prompt) token with its logprob, alternatives and offset
in the text; ``TokenTexts`` gives a token's exact text and bytes (byte-level BPE pieces and
``<0xNN>`` byte tokens mapped back to bytes; a token that is not valid UTF-8 on its own is
written ``bytes:\\xe2\\x80``, as OpenAI does). ``-inf`` (and NaN) log-probabilities clamp to
``-9999.0``, since JSON has no infinity.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

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
    # The echoed prompt keeps its special tokens' text, so its offsets must count it too.
    detokenizer = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
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
