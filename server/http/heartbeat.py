"""Keep-alive for event streams: an async iterator that also says when it has been quiet.

A long prefill on a small CPU can keep a stream silent for a minute; proxies and clients
that time out idle connections would drop it. ``with_heartbeats`` passes the items of a
stream through and yields ``HEARTBEAT`` whenever ``interval`` seconds went by without one,
so that the protocol can send its keep-alive event (Anthropic's ``ping``).

The source is read by a task into a one-item queue, so that waiting with a timeout never
cancels the source itself (cancelling an async generator's ``__anext__`` would close it).
Close the returned iterator (``aclose``) before closing the source.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, Final


class _Heartbeat:
    def __repr__(self) -> str:
        return "HEARTBEAT"


HEARTBEAT: Final = _Heartbeat()
_END = object()


async def with_heartbeats(source: AsyncIterator[Any], interval: float) -> AsyncIterator[Any]:
    """The items of ``source``, with ``HEARTBEAT`` after each ``interval`` s of silence.

    Raises:
        whatever ``source`` raises, when it raises it.
    """
    queue: asyncio.Queue[tuple[Any, BaseException | None]] = asyncio.Queue(1)

    async def pump() -> None:
        try:
            async for item in source:
                await queue.put((item, None))
            await queue.put((_END, None))
        except Exception as e:  # noqa: BLE001 - re-raised by the consumer
            await queue.put((_END, e))

    task = asyncio.ensure_future(pump())
    try:
        while True:
            try:
                item, error = await asyncio.wait_for(queue.get(), interval)
            except asyncio.TimeoutError:
                yield HEARTBEAT
                continue
            if error is not None:
                raise error
            if item is _END:
                return
            yield item
    finally:
        # Wait for the pump to stop, so that the source is no longer running when the
        # caller closes it.
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
