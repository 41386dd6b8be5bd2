"""``/metrics`` series of a tensor-parallel group, read from rank 0's executor on scrape."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mlxserve.server.lifecycle.metrics import PREFIX

if TYPE_CHECKING:
    from mlxserve.mlx_backend.distributed.executor import DistributedStats


class GroupCollector(Collector):
    """The group's size, its forwards, and the time they spend sending batches and (as
    estimated from the all_sum latency measured at start-up) in collectives."""

    def __init__(self, stats: Callable[[], DistributedStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        p = PREFIX + "tensor_parallel_"
        yield GaugeMetricFamily(p + "ranks", "Processes the model is split over.", s.ranks)
        yield CounterMetricFamily(p + "steps", "Forwards run by the group.", s.steps)
        yield CounterMetricFamily(
            p + "forward_seconds",
            "Time rank 0 spent in forwards (model, collectives, sampling).",
            s.forward_seconds,
        )
        yield CounterMetricFamily(
            p + "send_seconds",
            "Time rank 0 spent sending batches to the other ranks.",
            s.send_seconds,
        )
        yield GaugeMetricFamily(
            p + "collectives_per_step",
            "all_sum collectives in the last forward (2 per sharded layer per row group).",
            s.collectives_per_step,
        )
        yield CounterMetricFamily(
            p + "collective_seconds_estimate",
            "Estimated time in collectives: their count x the fastest all_sum time for the "
            "step's activations measured at start-up (a floor under CPU contention).",
            s.collective_seconds,
        )
