"""Streaming detokenization: the pieces add up to exactly ``tokenizer.decode(ids)``."""

from __future__ import annotations

import pytest

from mlxserve.server.serving.detokenizer import IncrementalDetokenizer

TEXTS = [
    " Paris is the capital of France.",
    "Hello, world! 12345",
    "naïve café — déjà vu",
    "emoji 🦙🚀 and 漢字 in one line",
    "  two leading spaces and trailing ",
    "\nnew\nlines\n",
]


@pytest.fixture(scope="module")
def tokenizer(smollm):
    return smollm.tokenizer


def stream(tokenizer, prompt: str, ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt))
    pieces = [detok.add(t) for t in ids]
    pieces.append(detok.flush())
    return pieces


class TestIncrementalDetokenizer:
    @pytest.mark.parametrize("text", TEXTS)
    def test_pieces_concatenate_to_the_decoded_text(self, tokenizer, text):
        ids = tokenizer.encode(text, add_special_tokens=False)
        pieces = stream(tokenizer, "The answer:", ids)
        want = tokenizer.decode(ids, skip_special_tokens=True)
        assert "".join(pieces) == want, f"{pieces!r} != {want!r}"

    def test_completion_keeps_the_leading_space(self, tokenizer):
        ids = tokenizer.encode(" Paris", add_special_tokens=False)
        pieces = stream(tokenizer, "The capital of France is", ids)
        assert "".join(pieces) == " Paris", pieces

    def test_split_multibyte_character_is_held_back_not_garbled(self, tokenizer):
        ids = tokenizer.encode("🦙", add_special_tokens=False)
        assert len(ids) > 1, "the test needs a character that spans tokens"
        pieces = stream(tokenizer, "x", ids)
        assert all("\ufffd" not in p for p in pieces), pieces
        assert "".join(pieces) == "🦙"

    def test_special_tokens_are_not_rendered(self, tokenizer):
        ids = tokenizer.encode("hi", add_special_tokens=False) + [2]  # <|im_end|>
        assert "".join(stream(tokenizer, "x", ids)) == "hi"
