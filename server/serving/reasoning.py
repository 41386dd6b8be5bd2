"""Reasoning output: ``<think>...</think>`` split off into ``reasoning_content``.

Models with Qwen3 / DeepSeek-R1-style chat templates think before they answer:

    <think>
    The user greets me; answer briefly.
    </think>

    Hello! How can I help?

The chat API returns the part between the tags as ``message.reasoning_content`` (streamed as
``delta.reasoning_content``) and the rest as ``content``. Some templates open ``<think>`` in
the generation prompt themselves, so the output starts inside the reasoning and only the
closing tag appears; ``prompt_opens_reasoning`` tells which case a prompt is.

The split is made on text as it streams, in any chunking: a tag may arrive split across
tokens or chunks, so text that could still be the start of a tag is held back until it is
certain (the way ``server/serving/stop_strings.py`` holds back stop strings). The whitespace around
the reasoning (the newlines after ``<think>``, before and after ``</think>``) is dropped.
Feeding a text in any split gives the same concatenated result.
"""

from __future__ import annotations

from typing import Any

from mlxserve.server.serving.stop_strings import partial_suffix_len

THINK_START = "<think>"
THINK_END = "</think>"


def is_reasoning_model(tokenizer: Any) -> bool:
    """Whether the model's output may carry ``<think>`` reasoning: its chat template mentions
    the tag, or its vocabulary has both tags as tokens."""
    template = getattr(tokenizer, "chat_template", None)
    if template is not None and THINK_START in str(template):
        return True
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary has no tags
        return False
    return THINK_START in vocab and THINK_END in vocab


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """Whether the rendered prompt ends inside an unclosed ``<think>`` (the template opened
    the reasoning, so the output starts in it)."""
    return prompt_text.rfind(THINK_START) > prompt_text.rfind(THINK_END)


class ReasoningSplitter:
    """Splits streamed output text into ``(reasoning, content)`` deltas.

    Only a ``<think>`` at the very start of the output (after whitespace) opens reasoning;
    once content has begun, tags are plain text. A second ``</think>`` is plain content.

    Args:
        in_reasoning: the prompt already opened ``<think>`` (see ``prompt_opens_reasoning``).

    Attributes:
        saw_reasoning: whether the output had a reasoning part (even an empty one).
    """

    # States: where the next text goes.
    _START = "start"  # nothing but whitespace yet: maybe "<think>", maybe content
    _REASONING_START = "reasoning_start"  # just after <think>: drop leading whitespace
    _REASONING = "reasoning"
    _CONTENT_START = "content_start"  # just after </think>: drop leading whitespace
    _CONTENT = "content"

    def __init__(self, in_reasoning: bool = False) -> None:
        self._state = self._REASONING_START if in_reasoning else self._START
        self.saw_reasoning = in_reasoning
        self._held = ""

    @property
    def in_reasoning_part(self) -> bool:
        """The output opened a reasoning part and its content has not begun yet (the closing
        tag and the whitespace after it still belong to the reasoning)."""
        return self.saw_reasoning and self._state != self._CONTENT

    def feed(self, text: str) -> tuple[str, str]:
        """Add the next piece of output; returns the ``(reasoning, content)`` now certain."""
        reasoning: list[str] = []
        content: list[str] = []
        buf = self._held + text
        self._held = ""
        while buf:
            buf = self._step(buf, reasoning, content)
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        """The held-back text at the end of the output."""
        held, self._held = self._held, ""
        if self._state in (self._REASONING_START, self._REASONING):
            return held.rstrip(), ""
        if self._state == self._START:
            return "", held
        return "", ""

    def _step(self, buf: str, reasoning: list[str], content: list[str]) -> str:
        """Consume a prefix of ``buf`` in the current state; returns what is left to do
        (empty once everything is emitted or held)."""
        state = self._state
        if state == self._START:
            stripped = buf.lstrip()
            if stripped.startswith(THINK_START):
                self._state = self._REASONING_START
                self.saw_reasoning = True
                return stripped[len(THINK_START) :]
            if not stripped or THINK_START.startswith(stripped):
                self._held = buf  # whitespace, or the beginning of "<think>"
                return ""
            self._state = self._CONTENT
            content.append(buf)
            return ""
        if state in (self._REASONING_START, self._CONTENT_START):
            stripped = buf.lstrip()
            if stripped:
                self._state = self._REASONING if state == self._REASONING_START else self._CONTENT
            return stripped
        if state == self._REASONING:
            end = buf.find(THINK_END)
            if end >= 0:
                reasoning.append(buf[:end].rstrip())
                self._state = self._CONTENT_START
                return buf[end + len(THINK_END) :]
            # Hold what may still be "</think>", and the whitespace just before it.
            keep = len(buf) - partial_suffix_len(buf, (THINK_END,))
            keep = len(buf[:keep].rstrip())
            reasoning.append(buf[:keep])
            self._held = buf[keep:]
            return ""
        content.append(buf)
        return ""


def split_reasoning(text: str, in_reasoning: bool = False) -> tuple[str | None, str]:
    """The whole output split at once: ``(reasoning or None if there was none, content)``."""
    splitter = ReasoningSplitter(in_reasoning)
    reasoning, content = splitter.feed(text)
    tail_reasoning, tail_content = splitter.flush()
    reasoning += tail_reasoning
    return (reasoning if splitter.saw_reasoning else None), content + tail_content
