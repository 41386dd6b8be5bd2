"""What the engine reports about itself: a state snapshot and per-request timings.

Two kinds of numbers, mirroring vLLM's split:

- **Engine state** (``EngineStats``): built by the engine thread at the end of every step
  and swapped in as one immutable object, so any thread may read it without a lock.
- **Request timings** (``RequestStats``): stamped by the engine thread as a request is
  queued, scheduled, gets tokens and finishes; each stamp is reported to a
  ``StatsObserver`` (the server's Prometheus metrics) right away.

Nothing here imports MLX or the server; memory figures are passed in by the engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from mlxserve.scheduler.memory_plan import MemoryStats
from mlxserve.scheduler.outputs import RequestOutput

if TYPE_CHECKING:
    from mlxserve.scheduler.scheduler import Scheduler


@dataclass(frozen=True)
class EngineStats:
    """One consistent view of the engine between two steps.

    Attributes:
        num_running: requests holding a row of the request table.
        num_waiting: requests submitted and not running (queued, or still in the inbox).
        kv_used_tokens: token slots owned by requests or locked by them in the prefix cache
            (slots the cache could evict count as free, as in vLLM).
        kv_total_tokens: token slots in the pool.
        num_preemptions: running requests preempted since start (cumulative).
        prefix_cache_queries: prompt tokens looked up in the prefix cache (cumulative).
        prefix_cache_hits: of those, tokens found cached (cumulative).
        prefix_cache_tokens: token slots the prefix cache holds now.
        prompt_tokens_computed: prompt tokens that went through a forward (cumulative; the
            rest came from the prefix cache).
        mlx_active_bytes: memory MLX holds in live arrays.
        mlx_peak_bytes: the largest ``mlx_active_bytes`` since start.
        mlx_cache_bytes: memory MLX keeps in its buffer cache for reuse.
        spec_num_drafts: proposals verified (speculative decoding; cumulative).
        spec_num_draft_tokens: tokens proposed in them (cumulative).
        spec_num_accepted_tokens: of those, tokens accepted (cumulative).
        spec_accepted_per_pos: accepted tokens by their position in the proposal.
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_used_tokens: int = 0
    kv_total_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_tokens: int = 0
    prompt_tokens_computed: int = 0
    mlx_active_bytes: int = 0
    mlx_peak_bytes: int = 0
    mlx_cache_bytes: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()

    @property
    def kv_usage(self) -> float:
        """Share of the KV pool in use, 0..1 (vLLM's ``kv_cache_usage_perc``)."""
        return self.kv_used_tokens / self.kv_total_tokens if self.kv_total_tokens else 0.0


@dataclass(frozen=True)
class FinishedRequest:
    """The life of one finished request, in seconds and tokens.

    ``queue_time``, ``inference_time`` and ``prefill_time`` are None when the request was
    never scheduled (rejected, or aborted while queued); ``decode_time`` is None when it
    produced no token.
    """

    finish_reason: str
    prompt_tokens: int
    generation_tokens: int
    max_tokens: int
    e2e_latency: float
    queue_time: float | None
    inference_time: float | None
    prefill_time: float | None
    decode_time: float | None


class StatsObserver(Protocol):
    """Receives request timings on the engine thread; must be quick and must not raise."""

    def on_first_token(self, prompt_tokens: int, num_tokens: int, ttft: float) -> None:
        """A request's first ``num_tokens`` tokens, ``ttft`` seconds after it arrived."""

    def on_next_tokens(self, num_tokens: int, inter_token_latency: float) -> None:
        """More tokens of a request, each ``inter_token_latency`` seconds after the last."""

    def on_finished(self, request: FinishedRequest) -> None:
        """A request left the engine (any finish reason)."""


@dataclass
class RequestStats:
    """Timestamps (``time.monotonic()``) of one request; stamped on the engine thread.

    ::

        arrival --queue--> scheduled --prefill--> first_token --decode--> finished
        |<------------------------------ e2e ---------------------------------->|
    """

    arrival: float = field(default_factory=time.monotonic)
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None

    def mark_scheduled(self, now: float) -> None:
        """The request entered a batch (only the first time counts, as in vLLM)."""
        if self.scheduled is None:
            self.scheduled = now

    def record(
        self, event: RequestOutput, max_tokens: int, now: float, observer: StatsObserver
    ) -> None:
        """Stamp one engine event of this request and report it to ``observer``."""
        n = len(event.new_token_ids)
        if n:
            if self.first_token is None:
                self.first_token = now
                observer.on_first_token(event.prompt_tokens, n, now - self.arrival)
            else:
                assert self.last_token is not None
                observer.on_next_tokens(n, (now - self.last_token) / n)
            self.last_token = now
        if event.finished:
            observer.on_finished(self._finished(event, max_tokens, now))

    def _finished(self, event: RequestOutput, max_tokens: int, now: float) -> FinishedRequest:
        scheduled, first = self.scheduled, self.first_token
        return FinishedRequest(
            finish_reason=event.finish_reason or "error",
            prompt_tokens=event.prompt_tokens,
            generation_tokens=event.completion_tokens,
            max_tokens=max_tokens,
            e2e_latency=now - self.arrival,
            queue_time=None if scheduled is None else scheduled - self.arrival,
            inference_time=None if scheduled is None else now - scheduled,
            prefill_time=None if scheduled is None or first is None else first - scheduled,
            decode_time=None if first is None else now - first,
        )


def engine_stats(
    sched: Scheduler, num_unfinished: int, memory: MemoryStats | None = None
) -> EngineStats:
    """Snapshot ``sched`` (call on the engine thread, between steps).

    Args:
        sched: the engine's scheduler.
        num_unfinished: requests submitted and not finished, including those still in the
            engine's inbox (they count as waiting).
        memory: the backend's memory (None: not known).
    """
    memory = memory or MemoryStats()
    running = len(sched.running)
    spec = sched.speculator.stats if sched.speculator is not None else None
    # The tightest slot space decides when requests must wait, so it is the one reported.
    used, total = 0, 0
    tree = sched.cache.tree
    for space in sched.spaces.spaces:
        size = space.allocator.size
        evictable = tree.evictable[space.name] if tree is not None else 0
        space_used = size - space.allocator.available_size() - evictable
        if total == 0 or space_used * total > used * size:
            used, total = space_used, size
    return EngineStats(
        num_running=running,
        num_waiting=max(num_unfinished - running, len(sched.waiting)),
        kv_used_tokens=used,
        kv_total_tokens=total,
        num_preemptions=sched.num_preemptions,
        prefix_cache_queries=sched.prefix_cache_queries,
        prefix_cache_hits=sched.prefix_cache_hits,
        prefix_cache_tokens=sched.cache.held_tokens(),
        prompt_tokens_computed=sched.prompt_tokens_computed,
        mlx_active_bytes=memory.active,
        mlx_peak_bytes=memory.peak,
        mlx_cache_bytes=memory.cache,
        spec_num_drafts=spec.num_drafts if spec else 0,
        spec_num_draft_tokens=spec.num_draft_tokens if spec else 0,
        spec_num_accepted_tokens=spec.num_accepted_tokens if spec else 0,
        spec_accepted_per_pos=tuple(spec.accepted_per_pos) if spec else (),
    )
