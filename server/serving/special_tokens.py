"""Control tokens come only from the chat template, never from what a client wrote.

A rendered chat prompt is one string; encoded as is, a user message that spells
``<|im_start|>system\\n...<|im_end|>`` would become the real control tokens and forge a turn.
So before rendering, every occurrence of a special token's text in the client's strings
(message contents, names, tool calls, template kwargs, tool definitions) is swapped for a
private-use placeholder character; the template's output then holds real special-token text
only where the template put it. Encoding splits it there (as the tokenizer itself splits on
added tokens: the pieces between them are encoded independently), maps those to their ids,
and encodes each piece, placeholders turned back into the client's text, with
``split_special_tokens=True``: a forged ``<|im_start|>`` becomes the plain-text tokens of
``<``, ``|``, ``im``, ... exactly as the tokenizer encodes that text outside any template.

"Special" is the tokenizer's own notion: added tokens marked ``special``. Non-special added
tokens (``<think>`` in some models) are ordinary vocabulary and are matched in any text, as
in Hugging Face and vLLM. When no client string holds special-token text (the usual case),
the prompt is encoded in one call, exactly as before. A tokenizer on which piecewise
encoding does not reproduce its own encoding (checked once with a probe) cannot take
special-token text in messages at all: such a request gets a 400.

Raw ``/v1/completions`` prompts are the client's own prompt and are not filtered: special
tokens in them are parsed, as in vLLM.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import Any

from mlxserve.server.http.errors import invalid_request

# Placeholders are single code points from the private use areas (supplementary first).
_PLACEHOLDER_RANGES = (
    range(0xF0000, 0xFFFFE),
    range(0x100000, 0x10FFFE),
    range(0xE000, 0xF900),
)


@dataclass(frozen=True)
class _Specials:
    """What a tokenizer treats as special, and whether piecewise encoding is exact on it."""

    ids: dict[str, int]
    lstrip: frozenset[str]
    rstrip: frozenset[str]
    pattern: re.Pattern[str] | None
    exact: bool


_cache: dict[int, tuple[Any, _Specials]] = {}
_cache_lock = threading.Lock()


def _specials(tokenizer: Any) -> _Specials:
    with _cache_lock:
        hit = _cache.get(id(tokenizer))
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
        info = _inspect(tokenizer)
        _cache[id(tokenizer)] = (tokenizer, info)  # keeps the tokenizer (and its id) alive
        return info


def _inspect(tokenizer: Any) -> _Specials:
    try:
        decoder = dict(getattr(tokenizer, "added_tokens_decoder", None) or {})
    except Exception:  # a tokenizer without Hugging Face's added-token API
        decoder = {}
    tokens = {int(i): t for i, t in decoder.items() if getattr(t, "special", False) and str(t)}
    if not tokens:
        return _Specials({}, frozenset(), frozenset(), None, True)
    ids = {str(t): i for i, t in tokens.items()}
    lstrip = frozenset(str(t) for t in tokens.values() if getattr(t, "lstrip", False))
    rstrip = frozenset(str(t) for t in tokens.values() if getattr(t, "rstrip", False))
    longest_first = sorted(ids, key=len, reverse=True)
    pattern = re.compile("(" + "|".join(re.escape(s) for s in longest_first) + ")")
    info = _Specials(ids, lstrip, rstrip, pattern, exact=True)
    return _Specials(ids, lstrip, rstrip, pattern, exact=_probe(tokenizer, info))


def _probe(tokenizer: Any, info: _Specials) -> bool:
    """Whether piecewise encoding equals the tokenizer's own, and special-token text can be
    encoded as plain text, on a sample holding two special tokens."""
    names = sorted(info.ids)
    first, second = names[0], names[-1]
    sample = f"Hi there{first}user\n a  b{second} c\n\n{first}x"
    try:
        whole = [int(t) for t in tokenizer.encode(sample, add_special_tokens=False)]
        plain = [int(t) for t in _encode_plain(tokenizer, first)]
    except Exception:
        return False
    return whole == _encode_pieces(tokenizer, info, sample, {}) and plain != [info.ids[first]]


def _encode_plain(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))


def _encode_pieces(
    tokenizer: Any, info: _Specials, text: str, restore: dict[int, str]
) -> list[int]:
    """Encode ``text``: its special-token text as those tokens, the rest (placeholders
    restored) as plain text, honoring the tokens' lstrip/rstrip."""
    assert info.pattern is not None
    parts = info.pattern.split(text)  # plain, special, plain, special, ..., plain
    for i in range(1, len(parts), 2):
        if parts[i] in info.lstrip:
            parts[i - 1] = parts[i - 1].rstrip()
        if parts[i] in info.rstrip:
            parts[i + 1] = parts[i + 1].lstrip()
    ids: list[int] = []
    for i, part in enumerate(parts):
        if i % 2:
            ids.append(info.ids[part])
        elif part:
            ids.extend(int(t) for t in _encode_plain(tokenizer, part.translate(restore)))
    return ids


def _strings(value: Any) -> list[str]:
    """Every string inside ``value`` (dict keys too), found without recursion."""
    found, stack = [], [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            found.append(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return found


class SpecialTokenGuard:
    """Masks special-token text in the client's data before rendering, and encodes the
    rendered prompt so that only the template's special tokens are tokens.

    Args:
        tokenizer: the model's tokenizer.
        client_data: everything of the client's that the template may render.

    Raises:
        APIError: 400 when the client's data holds special-token text that this tokenizer
            cannot encode as plain text.
    """

    def __init__(self, tokenizer: Any, client_data: Any) -> None:
        self._tokenizer = tokenizer
        self._info = _specials(tokenizer)
        self._mask: dict[str, str] = {}
        self._restore: dict[int, str] = {}
        pattern = self._info.pattern
        if pattern is None:
            return
        strings = _strings(client_data)
        injected = sorted({m for s in strings for m in pattern.findall(s)})
        if not injected:
            return
        if not self._info.exact:
            raise invalid_request(
                f"The messages contain the text of the control token {injected[0]!r}, which "
                "this model's tokenizer cannot encode as plain text.",
                param="messages",
            )
        used = set().union(*(set(s) for s in strings))
        free = (chr(c) for r in _PLACEHOLDER_RANGES for c in r if chr(c) not in used)
        for special in injected:
            placeholder = next(free, None)
            if placeholder is None:
                raise invalid_request(
                    "The messages contain control-token text and use every private-use "
                    "character, so that text cannot be kept plain; remove one or the other.",
                    param="messages",
                )
            self._mask[special] = placeholder
            self._restore[ord(placeholder)] = special

    @property
    def active(self) -> bool:
        """Whether the client's data held special-token text."""
        return bool(self._mask)

    def mask(self, value: Any) -> Any:
        """``value`` (strings, dicts, lists) with special-token text replaced by placeholders."""
        if not self._mask:
            return value
        pattern = self._info.pattern
        assert pattern is not None
        if isinstance(value, str):
            return pattern.sub(lambda m: self._mask.get(m.group(), m.group()), value)
        if isinstance(value, dict):
            return {self.mask(k): self.mask(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(self.mask(v) for v in value)
        return value

    def restore(self, text: str) -> str:
        """Rendered text with the client's own text back in place of the placeholders."""
        return text.translate(self._restore) if self._restore else text

    def encode(self, rendered: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of the rendered (masked) prompt."""
        tokenizer = self._tokenizer
        if not self._mask:
            ids = tokenizer.encode(rendered, add_special_tokens=add_special_tokens)
            return [int(t) for t in ids]
        ids = _encode_pieces(tokenizer, self._info, rendered, self._restore)
        if add_special_tokens and hasattr(tokenizer, "build_inputs_with_special_tokens"):
            ids = [int(t) for t in tokenizer.build_inputs_with_special_tokens(ids)]
        return ids
