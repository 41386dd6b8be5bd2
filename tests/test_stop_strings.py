"""Unit tests of the stop-string matcher (server/serving/stop_strings.py)."""

from __future__ import annotations

import pytest

from mlxserve.server.serving.stop_strings import StopMatcher


def run(stops: list[str], pieces: list[str]) -> tuple[list[str], bool]:
    """Feed ``pieces`` and return what was emitted per piece (plus the flush) and stopped."""
    matcher = StopMatcher(stops)
    out = [matcher.feed(p) for p in pieces]
    out.append(matcher.flush())
    return out, matcher.stopped


class TestNoStop:
    def test_text_passes_through_unchanged(self) -> None:
        out, stopped = run(["STOP"], ["Hello", " world", "!"])
        assert "".join(out) == "Hello world!", out
        assert not stopped

    def test_no_stops_emits_everything_immediately(self) -> None:
        out, stopped = run([], ["a", "b"])
        assert out == ["a", "b", ""], out
        assert not stopped

    def test_unrelated_text_is_not_held(self) -> None:
        matcher = StopMatcher(["</s>"])
        assert matcher.feed("abc") == "abc", "no suffix of 'abc' starts '</s>'"


class TestPartialMatch:
    def test_partial_match_is_held_back_then_released(self) -> None:
        matcher = StopMatcher(["</s>"])
        assert matcher.feed("Hello <") == "Hello ", "the '<' could start the stop"
        assert matcher.feed("/") == "", "'</' could still start the stop"
        assert matcher.feed("b>") == "</b>", "'</b>' can no longer become '</s>'"
        assert not matcher.stopped

    def test_held_text_is_flushed_at_end(self) -> None:
        matcher = StopMatcher(["</s>"])
        assert matcher.feed("x </") == "x "
        assert matcher.flush() == "</", "text held at the end was never a stop"
        assert matcher.flush() == "", "flush releases held text once"

    def test_holds_only_the_longest_possible_prefix(self) -> None:
        matcher = StopMatcher(["abab"])
        assert matcher.feed("xaba") == "x", "'aba' is a prefix of 'abab'"
        assert matcher.feed("a") == "aba", "of 'abaa' only the last 'a' can still match"


class TestStopMatch:
    def test_stop_inside_one_piece(self) -> None:
        out, stopped = run(["STOP"], ["one STOP two"])
        assert stopped
        assert "".join(out) == "one ", out

    def test_stop_spanning_pieces_never_emitted(self) -> None:
        pieces = ["The end", " is ", "<", "|", "end", "|", "> and more"]
        out, stopped = run(["<|end|>"], pieces)
        assert stopped
        assert "".join(out) == "The end is ", out
        assert not any("<" in piece for piece in out), f"stop text leaked: {out}"

    @pytest.mark.parametrize("split", range(1, 12))
    def test_every_split_point_gives_the_same_text(self, split: int) -> None:
        text = "Hi there\n\nUser: more"
        out, stopped = run(["\n\nUser:"], [text[:split], text[split:]])
        assert stopped
        assert "".join(out) == "Hi there", (split, out)

    def test_single_char_pieces(self) -> None:
        text = "abc STOP def"
        out, stopped = run(["STOP"], list(text))
        assert stopped
        assert "".join(out) == "abc ", out

    def test_nothing_after_stop(self) -> None:
        matcher = StopMatcher(["x"])
        assert matcher.feed("ax") == "a"
        assert matcher.feed("more") == "", "after a stop the matcher emits nothing"
        assert matcher.flush() == ""


class TestMultipleStops:
    def test_earliest_stop_wins(self) -> None:
        out, stopped = run(["END", "\n"], ["line one\nline END"])
        assert stopped
        assert "".join(out) == "line one", out

    def test_second_stop_matches_after_first_partial(self) -> None:
        # "<e" is a partial "<end>", then the text turns into the other stop "<eof>".
        out, stopped = run(["<end>", "<eof>"], ["data <e", "o", "f> tail"])
        assert stopped
        assert "".join(out) == "data ", out

    def test_duplicate_stops_are_harmless(self) -> None:
        out, stopped = run(["a", "a"], ["xxa"])
        assert stopped
        assert "".join(out) == "xx", out

    def test_stop_that_is_a_prefix_of_another(self) -> None:
        out, stopped = run(["ab", "abc"], ["xab"])
        assert stopped
        assert "".join(out) == "x", out


class TestValidation:
    def test_empty_stop_string_rejected(self) -> None:
        with pytest.raises(ValueError, match="non-empty"):
            StopMatcher([""])
