"""The ``n`` choices of one request: ``n`` engine requests, started together, read as one.

Each choice is its own ``Generation`` (its own engine request id, seed, stop matcher and
detokenizer); they are submitted in one go, so that the engine's prefix cache can share the
prompt's prefill between them. ``stream()`` interleaves their chunks as they come, tagged
with the choice index; ``abort()`` ends them all (client gone, error, shutdown).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from mlxserve.server.serving.generation import Chunk, Generation, GenerationError
from mlxserve.server.serving.usage import UsageCounts


@dataclass
class ChoiceChunks:
    """Everything one choice produced (for a non-streamed answer)."""

    chunks: list[Chunk] = field(default_factory=list)

    @property
    def finish_reason(self) -> str | None:
        return self.chunks[-1].finish_reason if self.chunks else None


class Choices:
    """The generations answering one request, one per choice, in choice order.

    Args:
        response_id: the id of the response (``chatcmpl-...`` / ``cmpl-...``).
        generations: one per choice, not started yet.
    """

    def __init__(self, response_id: str, generations: list[Generation]) -> None:
        if not generations:
            raise ValueError("a request has at least one choice")
        self.id = response_id
        self.generations = generations

    @property
    def prompt_ids(self) -> list[int]:
        return self.generations[0].prompt_ids

    def start(self) -> None:
        """Hand every choice to the engine (one after the other, in the same instant)."""
        for gen in self.generations:
            gen.start()

    def abort(self) -> None:
        """Stop every choice still running (idempotent)."""
        for gen in self.generations:
            gen.abort()

    def usage(self) -> UsageCounts:
        """What the answer used: the prompt once, the completions of all choices."""
        first = self.generations[0]
        return UsageCounts(
            first.prompt_tokens,
            sum(gen.completion_tokens for gen in self.generations),
            first.cached_tokens,
        )

    async def stream(self) -> AsyncIterator[tuple[int, Chunk]]:
        """``(choice index, chunk)`` as the choices produce them, until all finished.

        Raises:
            GenerationError: the first failure of any choice (the caller aborts the rest).
        """
        if len(self.generations) == 1:
            async for chunk in self.generations[0].chunks():
                yield 0, chunk
            return
        # maxsize=1: a choice's chunks wait in its own Generation until they are read, so
        # its unread-tokens bound (max_buffered_tokens) still holds.
        merged: asyncio.Queue[tuple[int, Chunk | GenerationError | None]] = asyncio.Queue(1)

        async def pump(index: int, gen: Generation) -> None:
            try:
                async for chunk in gen.chunks():
                    await merged.put((index, chunk))
                await merged.put((index, None))
            except GenerationError as e:
                await merged.put((index, e))

        tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(self.generations)]
        try:
            running = len(tasks)
            while running:
                index, item = await merged.get()
                if item is None:
                    running -= 1
                elif isinstance(item, GenerationError):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()

    async def collect(self) -> list[ChoiceChunks]:
        """Every chunk of every choice (waits for the end).

        Raises:
            GenerationError: a choice failed (the others are aborted).
        """
        results = [ChoiceChunks() for _ in self.generations]
        try:
            async for index, chunk in self.stream():
                results[index].chunks.append(chunk)
        except BaseException:
            self.abort()
            raise
        return results
