"""Unit tests of the reasoning splitter (server/serving/reasoning.py): any chunking, same split."""

from __future__ import annotations

import itertools

import pytest

from mlxserve.server.serving.reasoning import (
    ReasoningSplitter,
    is_reasoning_model,
    prompt_opens_reasoning,
    split_reasoning,
)

# (output text, prompt opened <think>, expected reasoning, expected content)
CASES = [
    ("<think>\nLet me see.\n</think>\n\nHello!", False, "Let me see.", "Hello!"),
    ("<think>a</think>b", False, "a", "b"),
    ("  <think> a b </think>  c d ", False, "a b", "c d "),
    ("<think></think>Hi", False, "", "Hi"),
    ("<think>\n\n</think>\n\n", False, "", ""),
    ("Hello, no reasoning.", False, None, "Hello, no reasoning."),
    (" Hello", False, None, " Hello"),
    ("Hi <think>x</think>", False, None, "Hi <think>x</think>"),
    ("<thinking>is not the tag", False, None, "<thinking>is not the tag"),
    ("<thi", False, None, "<thi"),
    ("\nI think.\n</think>\n\nAnswer.", True, "I think.", "Answer."),
    ("still thinking when cut off\n", True, "still thinking when cut off", ""),
    ("ends on a partial </thi", True, "ends on a partial </thi", ""),
    ("a < b </ c </think>x</think>y", True, "a < b </ c", "x</think>y"),
    ("<think>one</think>two<think>three</think>", False, "one", "two<think>three</think>"),
]


def run_chunked(text: str, in_reasoning: bool, cuts: tuple[int, ...]) -> tuple[str, str, bool]:
    splitter = ReasoningSplitter(in_reasoning)
    reasoning, content = "", ""
    bounds = [0, *cuts, len(text)]
    for start, end in itertools.pairwise(bounds):
        r, c = splitter.feed(text[start:end])
        reasoning, content = reasoning + r, content + c
    r, c = splitter.flush()
    return reasoning + r, content + c, splitter.saw_reasoning


@pytest.mark.parametrize(("text", "opened", "reasoning", "content"), CASES)
def test_whole_text(text: str, opened: bool, reasoning: str | None, content: str) -> None:
    assert split_reasoning(text, opened) == (reasoning, content)


@pytest.mark.parametrize(("text", "opened", "reasoning", "content"), CASES)
def test_every_two_cut_chunking_gives_the_same_split(
    text: str, opened: bool, reasoning: str | None, content: str
) -> None:
    """Tags and whitespace split anywhere: all splits into up to three chunks agree."""
    for cuts in itertools.combinations_with_replacement(range(len(text) + 1), 2):
        got_r, got_c, saw = run_chunked(text, opened, cuts)
        assert (got_r if saw else None, got_c) == (reasoning, content), cuts


def test_character_by_character_streaming_emits_early() -> None:
    """Text that cannot be a tag is released at once, not held to the end."""
    splitter = ReasoningSplitter(in_reasoning=True)
    assert splitter.feed("abc") == ("abc", "")
    assert splitter.feed(" <") == ("", ""), "' <' may start '</think>'"
    assert splitter.feed("x") == (" <x", "")
    assert splitter.feed("</") == ("", "")
    assert splitter.feed("think>") == ("", "")
    assert splitter.feed("\n\nHi") == ("", "Hi")
    assert splitter.flush() == ("", "")


def test_prompt_opens_reasoning() -> None:
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")
    # An earlier closed turn does not count; the last tag decides.
    assert prompt_opens_reasoning("<think>a</think>b<|im_start|>assistant\n<think>")


class _Tokenizer:
    def __init__(self, template: str | None, vocab: dict[str, int]) -> None:
        self.chat_template = template
        self._vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return self._vocab


def test_is_reasoning_model() -> None:
    assert is_reasoning_model(_Tokenizer("{{ '<think>' }}", {}))
    assert is_reasoning_model(_Tokenizer(None, {"<think>": 1, "</think>": 2}))
    assert not is_reasoning_model(_Tokenizer("{{ messages }}", {"<think>": 1}))
    assert not is_reasoning_model(_Tokenizer(None, {}))
