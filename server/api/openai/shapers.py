"""One choice's chunks -> what an OpenAI client sees: chat deltas or completion text +
logprobs.

- Chat: the neutral pieces (``server/serving/pieces.py``: reasoning, content, tool calls)
  with logprobs in the chat shape; a stop after a call finishes with "tool_calls".
- Completions: ``echo`` puts the prompt (and with ``logprobs`` its logprobs, the first one
  null) before the completion; logprobs in the completions shape, ``text_offset`` counted
  from the start of the returned text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlxserve.server.api.openai.logprobs import (
    ChatTokenLogprob,
    CompletionLogprobs,
    chat_logprobs,
    completion_logprobs,
)
from mlxserve.server.serving.generation import Chunk, Generation
from mlxserve.server.serving.pieces import PieceSplitter
from mlxserve.server.serving.token_logprobs import TokenTexts, prompt_entries
from mlxserve.server.serving.tool_plan import ToolPlan
from mlxserve.server.serving.tool_stream import ParsedCall


@dataclass
class ChatPiece:
    """What one chunk adds to a chat choice."""

    reasoning: str
    content: str
    logprobs: list[ChatTokenLogprob] | None
    tool_calls: list[ParsedCall] = field(default_factory=list)
    first_call_index: int = 0  # the index of tool_calls[0] among the choice's calls


class ChatShaper:
    """Shapes the chunks of one chat choice.

    Args:
        texts: token texts, or None when logprobs were not asked.
        top_logprobs: alternatives to show per token.
        reasoning: the model reasons in ``<think>`` tags.
        in_reasoning: the prompt already opened ``<think>``.
        tools: the request's tool plan (parsed when its ``parse`` is set).
    """

    def __init__(
        self,
        texts: TokenTexts | None,
        top_logprobs: int,
        reasoning: bool,
        in_reasoning: bool,
        tools: ToolPlan | None = None,
    ) -> None:
        self._texts = texts
        self._top = top_logprobs
        self._pieces = PieceSplitter(reasoning, in_reasoning, tools)

    @property
    def saw_reasoning(self) -> bool:
        return self._pieces.saw_reasoning

    def piece(self, chunk: Chunk) -> ChatPiece:
        piece = self._pieces.piece(chunk)
        logprobs = None
        if self._texts is not None:
            logprobs = chat_logprobs(piece.tokens, self._texts, self._top)
        return ChatPiece(
            piece.reasoning, piece.content, logprobs, piece.tool_calls, piece.first_call_index
        )

    def finish_reason(self, reason: str) -> str:
        """The choice's finish reason: "tool_calls" for a stop after a call."""
        return "tool_calls" if self._pieces.stopped_for_tools(reason) else reason


class CompletionShaper:
    """Shapes the chunks of one completion choice.

    Args:
        tokenizer: the model's tokenizer (prompt offsets for ``echo`` + ``logprobs``).
        texts: token texts, or None when logprobs were not asked.
        logprobs: alternatives to show per token.
        echo_text: the prompt to put first, or None.
    """

    def __init__(
        self, tokenizer: Any, texts: TokenTexts | None, logprobs: int, echo_text: str | None
    ) -> None:
        self._tokenizer = tokenizer
        self._texts = texts
        self._top = logprobs
        self._echo = echo_text
        self._first = True

    def piece(self, gen: Generation, chunk: Chunk) -> tuple[str, CompletionLogprobs | None]:
        """The text (and logprobs) of ``chunk``; the first one carries the echoed prompt."""
        first, self._first = self._first, False
        echo = self._echo if first else None
        text = (echo or "") + chunk.text
        if self._texts is None:
            return text, None
        offset = len(self._echo or "")
        logprobs = completion_logprobs(chunk.tokens, self._texts, self._top, offset)
        if echo is not None:
            prompt = prompt_entries(self._tokenizer, gen.prompt_ids, gen.prompt_logprobs)
            head = completion_logprobs(prompt, self._texts, self._top)
            logprobs = CompletionLogprobs(
                tokens=head.tokens + logprobs.tokens,
                token_logprobs=head.token_logprobs + logprobs.token_logprobs,
                top_logprobs=head.top_logprobs + logprobs.top_logprobs,
                text_offset=head.text_offset + logprobs.text_offset,
            )
        return text, logprobs


def merge_completion_logprobs(parts: list[CompletionLogprobs | None]) -> CompletionLogprobs | None:
    """The logprobs of a whole completion from those of its chunks."""
    present = [p for p in parts if p is not None]
    if not present:
        return None
    return CompletionLogprobs(
        tokens=[t for p in present for t in p.tokens],
        token_logprobs=[t for p in present for t in p.token_logprobs],
        top_logprobs=[t for p in present for t in p.top_logprobs],
        text_offset=[t for p in present for t in p.text_offset],
    )
