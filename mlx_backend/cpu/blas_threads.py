"""OpenBLAS's thread count, following the CPUs other processes leave free (Linux CPU backend).

Every CPU helps a forward while the machine is otherwise idle, but an OpenBLAS gemm waits for
all its threads, so a CPU that another process keeps busy makes every gemm wait for a
scheduler tick: measured on a 2-CPU VM with one busy process, 2 threads ran a batch-32 decode
step in 1,307 ms where 1 thread took 654 ms (idle: 540 vs 651 ms). Once a second, between
engine steps, the CPU time other processes (and the hypervisor, as steal) took on this
process's CPUs sets how many threads the next gemms may use: fewer at once when others get
busy, more again only after they stayed quiet for a few seconds.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

# Other processes' CPU use (in CPUs) that still leaves every thread worth having. Measured on
# the 2-CPU VM, batch-32 decode step with 2 threads vs 1: a benchmark client using 0.3 CPU,
# 2 threads still decoded faster (mlx_lm.server, fixed at 2: 59.9 vs our 49.2 tok/s after we
# dropped to 1); a neighbour using 0.5 CPU, 731 vs 654 ms (prefill even); 1.0 CPU, 1,307 vs
# 654 ms.
IDLE_OTHERS = 0.4
# Seconds between two looks at the CPU counters.
INTERVAL_S = 1.0
# Seconds other processes must stay quiet before threads are added back (removing them is
# immediate). Counted in measured seconds, not looks: the counters are read only between
# forwards, and one prefill forward may take many seconds.
QUIET_S_TO_GROW = 3.0


def cpu_seconds() -> tuple[float, float] | None:
    """``(busy, ours)``: CPU seconds this process's CPUs spent busy or stolen since boot, and
    CPU seconds this process used; ``None`` where ``/proc/stat`` cannot be read."""
    try:
        cpus = {f"cpu{i}" for i in os.sched_getaffinity(0)}
        busy_ticks = 0
        with open("/proc/stat") as f:
            for line in f:
                fields = line.split()
                if fields and fields[0] in cpus:
                    # user nice system idle iowait irq softirq steal
                    v = [int(x) for x in fields[1:9]]
                    busy_ticks += v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
        hz = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None
    t = os.times()
    return busy_ticks / hz, t.user + t.system


class AdaptiveBlasThreads:
    """Sets OpenBLAS's thread count from other processes' recent CPU use.

    Args:
        cpus: CPUs this process may run on (the most threads it will use).
        set_threads: applies a thread count (called only between forwards).
        sample: ``cpu_seconds``-like counter reader (tests pass a fake).
        clock: monotonic seconds.
    """

    def __init__(
        self,
        cpus: int,
        set_threads: Callable[[int], None],
        sample: Callable[[], tuple[float, float] | None] = cpu_seconds,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cpus = cpus
        self.threads = cpus
        self._set = set_threads
        self._sample = sample
        self._clock = clock
        self._last = sample()
        self._last_t = clock()
        self._quiet_s = 0.0
        self._lock = threading.Lock()
        if self._last is None:
            # Blind: keep one CPU for everything else, as a fixed count would.
            self._apply(max(1, cpus - 1), "cannot read /proc/stat")

    def update(self) -> None:
        """Look at the counters if a second has passed; change the thread count if needed
        (thread-safe: every engine of the process calls it)."""
        with self._lock:
            self._update()

    def _update(self) -> None:
        if self._last is None:
            return
        now = self._clock()
        elapsed = now - self._last_t
        if elapsed < INTERVAL_S:
            return
        current = self._sample()
        if current is None:
            return
        busy = current[0] - self._last[0]
        ours = current[1] - self._last[1]
        self._last, self._last_t = current, now
        others = max(0.0, (busy - ours) / elapsed)
        target = max(1, min(self.cpus, self.cpus - math.ceil(others - IDLE_OTHERS)))
        if target < self.threads:
            self._quiet_s = 0.0
            self._apply(target, f"other processes use {others:.1f} CPUs")
        elif target > self.threads:
            self._quiet_s += elapsed
            if self._quiet_s >= QUIET_S_TO_GROW:
                self._quiet_s = 0.0
                self._apply(target, f"other processes use {others:.1f} CPUs")
        else:
            self._quiet_s = 0.0

    def _apply(self, threads: int, why: str) -> None:
        logger.info("OpenBLAS threads %d -> %d: %s", self.threads, threads, why)
        self._set(threads)
        self.threads = threads


_shared: AdaptiveBlasThreads | None = None
_shared_made = False
_shared_lock = threading.Lock()


def shared_blas_threads(
    control: Callable[[], tuple[int, Callable[[int], None]] | None],
) -> AdaptiveBlasThreads | None:
    """The process's one thread-count policy (OpenBLAS's count is process-wide, so every
    engine, whatever its model, steers the same one); built from ``control()`` on first use
    (None: the count is not ours to change)."""
    global _shared, _shared_made
    with _shared_lock:
        if not _shared_made:
            found = control()
            _shared = None if found is None else AdaptiveBlasThreads(*found)
            _shared_made = True
            if _shared is not None:
                logger.info(
                    "OpenBLAS threads: %d, fewer while other processes keep CPUs busy",
                    _shared.threads,
                )
        return _shared
