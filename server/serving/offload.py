"""CPU-heavy request work off the event loop: chat templates, tokenizing, grammar compiling.

A 15 MB message takes seconds to render and encode; on the event loop that would freeze
every stream and ``/health`` for as long. Such work runs on a small, bounded pool of worker
threads instead (the loop keeps its turn: Python switches threads every few milliseconds,
and the tokenizer releases the GIL while it encodes).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

# Workers for request preparation; more would only share the same two cores here.
WORKERS = 4

_pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="mlxserve-prepare")


async def offload(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on a worker thread; exceptions reach the caller as raised."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_pool, functools.partial(fn, *args, **kwargs))
