"""Stop strings over streamed text: emit only what can no longer become a stop string.

The matcher sees the completion as a sequence of text pieces (one per detokenized token, in
any split). It releases text as soon as it is certain that no stop string starts inside
it, and holds back the shortest tail that could still grow into one:

    stops = ["</s>"]     feed("Hello <")  -> emits "Hello ", holds "<"
                         feed("/s")       -> emits "",       holds "</s" (still a prefix)
                         feed(">!")       -> emits "",       stopped (the stop is never emitted)

so no stop text ever reaches the client, whichever token or chunk boundaries it spans.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Incremental matcher of a fixed set of stop strings.

    Args:
        stops: the stop strings; each must be non-empty.

    Raises:
        ValueError: if a stop string is empty.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(stops))
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that matched, once stopped

    def feed(self, text: str) -> str:
        """Add the next piece of generated text.

        Args:
            text: new text, in generation order.

        Returns:
            The text that is now safe to emit (possibly ""). Once a stop string has matched,
            ``stopped`` is True, the returned text is everything before the match, and later
            calls return "".
        """
        if self.stopped:
            return ""
        buf = self._held + text
        match = self._earliest_match(buf)
        if match is not None:
            at, self.matched = match
            self.stopped = True
            self._held = ""
            return buf[:at]
        hold = partial_suffix_len(buf, self.stops)
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        """Release the held-back text at the end of generation (it never became a stop)."""
        if self.stopped:
            return ""
        held, self._held = self._held, ""
        return held

    def _earliest_match(self, buf: str) -> tuple[int, str] | None:
        """Where the first stop string in ``buf`` starts, and which one (the earliest
        start wins; at equal starts, the first listed)."""
        hits = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        return min(hits, key=lambda hit: hit[0]) if hits else None


def partial_suffix_len(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` (shorter than the longest marker) that a
    marker starts with: the text to hold back while streaming, because the next chunk may
    complete the marker."""
    for n in range(min(max((len(m) for m in markers), default=1) - 1, len(text)), 0, -1):
        tail = text[-n:]
        if any(m.startswith(tail) for m in markers):
            return n
    return 0
