"""Streaming detokenization whose concatenated output is exactly ``tokenizer.decode(ids)``.

mlx-lm's streaming detokenizers trim the leading space of the first token (right for chat
display, wrong for a completion: "The capital of France is" must continue with " Paris").
This one decodes a short window of ids and emits the difference, the way vLLM does: the
last few prompt tokens seed the window so that tokenizers which render a token's leading
space only after another token (SentencePiece) still produce it, and text ending in an
incomplete UTF-8 sequence is held back until the next token completes it.
"""

from __future__ import annotations

from typing import Any

# Prompt tokens kept as decoding context: enough to settle any merge across the boundary.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Feed generated token ids one at a time; get the new text of each.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=...)``.
        prompt_ids: the prompt (only its last few ids are used, as context).
        skip_special_tokens: leave special tokens' text out (generated text), or keep it
            (an echoed prompt, whose text keeps them).
    """

    def __init__(
        self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def add(self, token: int) -> str:
        """Returns the text this token completes (may be empty)."""
        self._ids.append(token)
        return self._emit(final=False)

    def flush(self) -> str:
        """Text still held back (an incomplete character at the very end)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        before = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return ""
        new = text[len(before) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new
