"""The protocol-neutral parts the agent APIs stand on, without a server: the answer's blocks,
stream heartbeats, the matched stop string, reasoning token counts, the reasoning template
switch, and the Responses store's bound."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest

from mlxserve.server.api.openai.responses.store import ResponseStore, StoredResponse
from mlxserve.server.http.heartbeat import HEARTBEAT, with_heartbeats
from mlxserve.server.serving.generation import Chunk
from mlxserve.server.serving.output_blocks import BlockDelta, BlockStart, BlockStop, OutputBlocks
from mlxserve.server.serving.pieces import OutputPiece, PieceSplitter
from mlxserve.server.serving.reasoning_switch import reasoning_template_kwargs
from mlxserve.server.serving.stop_strings import StopMatcher
from mlxserve.server.serving.tool_stream import ParsedCall


class TestOutputBlocks:
    def test_kinds_open_and_close_in_order(self) -> None:
        blocks = OutputBlocks()
        call = ParsedCall("f", '{"x": 1}')
        pieces = [
            OutputPiece("Let me", ""),
            OutputPiece(" see", ""),
            OutputPiece("", "Sure."),
            OutputPiece("", "", tool_calls=[call]),
            OutputPiece("", "Done"),
        ]
        events = [e for p in pieces for e in blocks.feed(p)] + blocks.close()
        shown = [(type(e).__name__, e.block.index, getattr(e, "text", "")) for e in events]
        assert shown == [
            ("BlockStart", 0, ""),
            ("BlockDelta", 0, "Let me"),
            ("BlockDelta", 0, " see"),
            ("BlockStop", 0, ""),
            ("BlockStart", 1, ""),
            ("BlockDelta", 1, "Sure."),
            ("BlockStop", 1, ""),
            ("BlockStart", 2, ""),
            ("BlockStop", 2, ""),
            ("BlockStart", 3, ""),
            ("BlockDelta", 3, "Done"),
            ("BlockStop", 3, ""),
        ], shown
        assert [b.kind for b in blocks.blocks] == ["reasoning", "text", "tool_call", "text"]
        assert blocks.text_of("text") == "Sure.Done" and blocks.calls == [call]

    def test_empty_pieces_make_no_block(self) -> None:
        blocks = OutputBlocks()
        assert blocks.feed(OutputPiece("", "")) == [] and blocks.close() == []
        assert blocks.blocks == []

    def test_event_types(self) -> None:
        blocks = OutputBlocks()
        start, delta = blocks.feed(OutputPiece("", "a"))
        (stop,) = blocks.close()
        assert isinstance(start, BlockStart) and isinstance(delta, BlockDelta)
        assert isinstance(stop, BlockStop) and stop.block is start.block


async def _slow(items: list[object], delay: float) -> AsyncIterator[object]:
    for item in items:
        await asyncio.sleep(delay)
        yield item


class TestHeartbeats:
    def test_heartbeats_fill_the_silences(self) -> None:
        async def run() -> list[object]:
            return [x async for x in with_heartbeats(_slow([1, 2], 0.25), interval=0.1)]

        out = asyncio.run(run())
        assert [x for x in out if x is not HEARTBEAT] == [1, 2], out
        assert out.index(1) >= 1 and out.count(HEARTBEAT) >= 2, out

    def test_no_heartbeat_when_items_flow(self) -> None:
        async def run() -> list[object]:
            return [x async for x in with_heartbeats(_slow([1, 2, 3], 0.0), interval=5)]

        assert asyncio.run(run()) == [1, 2, 3]

    def test_source_errors_reach_the_consumer(self) -> None:
        async def failing() -> AsyncIterator[int]:
            yield 1
            raise RuntimeError("boom")

        async def run() -> list[object]:
            return [x async for x in with_heartbeats(failing(), interval=5)]

        with pytest.raises(RuntimeError, match="boom"):
            asyncio.run(run())

    def test_closing_stops_the_source(self) -> None:
        closed = []

        async def endless() -> AsyncIterator[int]:
            try:
                while True:
                    await asyncio.sleep(0.01)
                    yield 1
            finally:
                closed.append(True)

        async def run() -> None:
            beats = with_heartbeats(endless(), interval=5)
            assert await beats.__anext__() == 1
            await beats.aclose()

        asyncio.run(run())
        assert closed == [True], "the source was closed with the heartbeats"


class TestMatchedStop:
    def test_earliest_stop_is_named(self) -> None:
        matcher = StopMatcher(["world", "lo"])
        assert matcher.feed("Hello world") == "Hel"
        assert matcher.stopped and matcher.matched == "lo"

    def test_none_until_stopped(self) -> None:
        matcher = StopMatcher(["x"])
        matcher.feed("abc")
        assert matcher.matched is None


class TestReasoningTokens:
    def test_tokens_until_the_content_count(self) -> None:
        splitter = PieceSplitter(reasoning=True, in_reasoning=True)
        chunks = [Chunk("Hmm", token_count=2), Chunk(" ok\n</think>\n\n", token_count=3)]
        chunks += [Chunk("Hi", token_count=1), Chunk("!", "stop", token_count=2)]
        pieces = [splitter.piece(c) for c in chunks]
        assert "".join(p.reasoning for p in pieces) == "Hmm ok", pieces
        assert "".join(p.content for p in pieces) == "Hi!", pieces
        assert splitter.reasoning_tokens == 5

    def test_no_reasoning_no_tokens(self) -> None:
        splitter = PieceSplitter(reasoning=True, in_reasoning=False)
        splitter.piece(Chunk("Hello", "stop", token_count=4))
        assert splitter.reasoning_tokens == 0


def tokenizer(template: str, custom: bool = False) -> SimpleNamespace:
    return SimpleNamespace(chat_template=template, _chat_template=(len if custom else None))


class TestReasoningSwitch:
    QWEN = "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    GPT_OSS = "Reasoning: {{ reasoning_effort }}"

    def test_enable_thinking_templates(self) -> None:
        qwen = tokenizer(self.QWEN)
        assert reasoning_template_kwargs(qwen, False) == {"enable_thinking": False}
        assert reasoning_template_kwargs(qwen, True, "high") == {"enable_thinking": True}
        assert reasoning_template_kwargs(qwen, None, "none") == {"enable_thinking": False}
        assert reasoning_template_kwargs(qwen, None) == {}

    def test_effort_templates(self) -> None:
        gpt = tokenizer(self.GPT_OSS)
        assert reasoning_template_kwargs(gpt, None, "xhigh") == {"reasoning_effort": "high"}
        assert reasoning_template_kwargs(gpt, True, "minimal") == {"reasoning_effort": "low"}

    def test_no_switch_no_kwargs(self) -> None:
        plain = tokenizer("{{ messages }}")
        assert reasoning_template_kwargs(plain, False, "high") == {}

    def test_custom_renderers_take_enable_thinking(self) -> None:
        custom = tokenizer("", custom=True)
        assert reasoning_template_kwargs(custom, False) == {"enable_thinking": False}


def stored(response_id: str) -> StoredResponse:
    return StoredResponse({"id": response_id}, (), ())


class TestResponseStore:
    def test_least_recently_used_goes_first(self) -> None:
        store = ResponseStore(2)
        store.put(stored("a"))
        store.put(stored("b"))
        assert store.get("a") is not None  # a is now the most recently used
        store.put(stored("c"))
        assert store.get("b") is None and store.get("a") and store.get("c")
        assert len(store) == 2

    def test_capacity_zero_keeps_nothing(self) -> None:
        store = ResponseStore(0)
        store.put(stored("a"))
        assert store.get("a") is None and len(store) == 0

    def test_delete(self) -> None:
        store = ResponseStore(3)
        store.put(stored("a"))
        assert store.delete("a") and not store.delete("a") and store.get("a") is None

    def test_negative_capacity_is_refused(self) -> None:
        with pytest.raises(ValueError, match="capacity"):
            ResponseStore(-1)
