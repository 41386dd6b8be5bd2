"""One answer's output pieces as an ordered list of blocks: reasoning, text, tool calls.

The agent protocols show an answer as a sequence of typed parts (Anthropic's content
blocks: ``thinking``, ``text``, ``tool_use``; the Responses API's output items:
``reasoning``, ``message``, ``function_call``), opened, filled and closed in order as the
answer streams. ``OutputBlocks`` turns the neutral pieces of a choice
(``server/serving/pieces.py``) into that sequence once, for every such protocol::

    pieces:  reasoning "Let me" | reasoning " see" | content "Sure." | call f({...})
    events:  start 0 reasoning, delta 0 "Let me", delta 0 " see", stop 0,
             start 1 text, delta 1 "Sure.", stop 1, start 2 tool_call f, stop 2

A block of text opens at its first non-empty text and closes when a block of another kind
begins or the answer ends; a tool call is one block, complete when it starts (calls are
split off whole). ``blocks`` holds the whole answer, so that a non-streamed answer and a
stream agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mlxserve.server.serving.pieces import OutputPiece
from mlxserve.server.serving.tool_stream import ParsedCall

BlockKind = Literal["reasoning", "text", "tool_call"]


@dataclass
class Block:
    """One part of an answer.

    Attributes:
        index: its place among the answer's blocks.
        kind: reasoning, text or a tool call.
        text: the reasoning or text (empty for a call).
        call: the call (tool_call blocks only).
    """

    index: int
    kind: BlockKind
    text: str = ""
    call: ParsedCall | None = None


@dataclass(frozen=True)
class BlockStart:
    """A block begins (a tool call's block carries the whole call)."""

    block: Block


@dataclass(frozen=True)
class BlockDelta:
    """Text added to the open reasoning or text block."""

    block: Block
    text: str


@dataclass(frozen=True)
class BlockStop:
    """A block is complete."""

    block: Block


BlockEvent = BlockStart | BlockDelta | BlockStop


@dataclass
class OutputBlocks:
    """Assembles one choice's pieces into blocks.

    Attributes:
        blocks: every block so far, in order.
    """

    blocks: list[Block] = field(default_factory=list)
    _open: Block | None = None

    def feed(self, piece: OutputPiece) -> list[BlockEvent]:
        """The events that ``piece`` makes."""
        events: list[BlockEvent] = []
        if piece.reasoning:
            events += self._text("reasoning", piece.reasoning)
        if piece.content:
            events += self._text("text", piece.content)
        for call in piece.tool_calls:
            events += self._close()
            block = self._new("tool_call", call=call)
            events += [BlockStart(block), BlockStop(block)]
        return events

    def close(self) -> list[BlockEvent]:
        """The end of the answer: the open block, if any, stops."""
        return self._close()

    def text_of(self, kind: BlockKind) -> str:
        """All the text of the blocks of ``kind``, joined."""
        return "".join(b.text for b in self.blocks if b.kind == kind)

    @property
    def calls(self) -> list[ParsedCall]:
        return [b.call for b in self.blocks if b.call is not None]

    def _text(self, kind: BlockKind, text: str) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        if self._open is None or self._open.kind != kind:
            events += self._close()
            self._open = self._new(kind)
            events.append(BlockStart(self._open))
        self._open.text += text
        events.append(BlockDelta(self._open, text))
        return events

    def _close(self) -> list[BlockEvent]:
        if self._open is None:
            return []
        block, self._open = self._open, None
        return [BlockStop(block)]

    def _new(self, kind: BlockKind, call: ParsedCall | None = None) -> Block:
        block = Block(len(self.blocks), kind, call=call)
        self.blocks.append(block)
        return block
