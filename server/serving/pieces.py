"""One choice's text chunks -> neutral output pieces: reasoning, content, tool calls.

Every protocol renders the same pieces in its own shape (OpenAI chat deltas, Anthropic
content blocks, Responses output items). The same splitter serves a stream (one call per
chunk) and a whole answer (the calls concatenated), so the two always agree.

- Reasoning models' ``<think>`` part is split off the content (``reasoning.py``).
- With tools parsed, calls are split off the content (``tool_stream.py``), and a stop
  after a call is a stop "for tool calls".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxserve.server.serving.generation import Chunk
from mlxserve.server.serving.reasoning import ReasoningSplitter
from mlxserve.server.serving.token_logprobs import TokenEntry
from mlxserve.server.serving.tool_plan import ToolPlan
from mlxserve.server.serving.tool_stream import ParsedCall, ToolCallSplitter


@dataclass
class OutputPiece:
    """What one chunk adds to a choice.

    Attributes:
        reasoning: reasoning text (empty for a model that does not reason).
        content: answer text.
        tokens: the chunk's tokens with their logprobs (only when asked).
        tool_calls: calls completed in this chunk.
        first_call_index: the index of ``tool_calls[0]`` among the choice's calls.
    """

    reasoning: str
    content: str
    tokens: tuple[TokenEntry, ...] = ()
    tool_calls: list[ParsedCall] = field(default_factory=list)
    first_call_index: int = 0


class PieceSplitter:
    """Splits the chunks of one choice into pieces.

    Args:
        reasoning: the model reasons in ``<think>`` tags.
        in_reasoning: the prompt already opened ``<think>``.
        tools: the request's tool plan (calls are parsed when its ``parse`` is set).

    Attributes:
        reasoning_tokens: generated tokens of the reasoning part so far (a chunk's tokens
            count as reasoning when the content had not begun by its end).
    """

    def __init__(self, reasoning: bool, in_reasoning: bool, tools: ToolPlan | None = None) -> None:
        self._splitter = ReasoningSplitter(in_reasoning) if reasoning else None
        self._tools = None
        self.reasoning_tokens = 0
        if tools is not None and tools.parse is not None:
            self._tools = ToolCallSplitter(tools.parse, tools.prompt_tools, tools.parallel)

    @property
    def saw_reasoning(self) -> bool:
        """The output opened a reasoning part (so an answer shows one, even if empty)."""
        return self._splitter is not None and self._splitter.saw_reasoning

    @property
    def calls_made(self) -> int:
        """Tool calls split off so far."""
        return self._tools.calls_made if self._tools is not None else 0

    def piece(self, chunk: Chunk) -> OutputPiece:
        if self._splitter is None:
            reasoning, content = "", chunk.text
        else:
            reasoning, content = self._splitter.feed(chunk.text)
            if self._splitter.in_reasoning_part:
                self.reasoning_tokens += chunk.token_count
            if chunk.finish_reason is not None:
                tail_reasoning, tail_content = self._splitter.flush()
                reasoning, content = reasoning + tail_reasoning, content + tail_content
        calls: list[ParsedCall] = []
        first_call = 0
        if self._tools is not None:
            first_call = self._tools.calls_made
            content, calls = self._tools.feed(content)
            if chunk.finish_reason is not None:
                tail, more = self._tools.flush()
                content, calls = content + tail, calls + more
        return OutputPiece(reasoning, content, chunk.tokens, calls, first_call)

    def stopped_for_tools(self, reason: str) -> bool:
        """The choice stopped after making tool calls (OpenAI's "tool_calls" finish)."""
        return reason == "stop" and self.calls_made > 0
