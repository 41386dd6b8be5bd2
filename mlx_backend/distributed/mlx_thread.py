"""One daemon thread that runs every MLX call of a rank, so a caller can give up on it.

NOTE: when a peer dies mid-collective, MLX's ring backend logs "Failing pending tasks" but
the ``mx.eval`` waiting on that collective never returns (measured: still blocked after
15 s). Running the MLX work here lets the engine thread (or a worker's reader) stop
waiting when the group is known to be broken; the stuck thread is left to die with the
process (the CLI ends a rank with ``os._exit``).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any


class MLXThread:
    """Runs submitted calls one at a time, in order, on one daemon thread (MLX streams are
    per thread: the pools must be made and written by the same thread)."""

    def __init__(self, name: str = "mlxserve-mlx") -> None:
        self._jobs: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, call: Callable[[], Any]) -> Future:
        future: Future = Future()
        self._jobs.put((call, future))
        return future

    def run(self, call: Callable[[], Any], give_up: Future) -> Any:
        """``call()``'s result, or ``give_up``'s exception as soon as it has one (the call
        is then abandoned on the thread)."""
        return result_unless(self.submit(call), give_up)

    def _loop(self) -> None:
        while True:
            call, future = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                future.set_exception(e)


def result_unless(future: Future, give_up: Future) -> Any:
    """``future``'s result, or ``give_up``'s exception as soon as it has one.

    Raises:
        BaseException: what ``future`` raised, or ``give_up``'s exception.
    """
    wait([future, give_up], return_when=FIRST_COMPLETED)
    if not future.done():
        raise give_up.exception()  # type: ignore[misc]
    return future.result()
