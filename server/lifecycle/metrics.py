"""Prometheus metrics for ``/metrics``: vLLM's names and meanings, prefixed ``mlxserve:``.

Two sources, as in vLLM:

- request-level counters and histograms are fed by the engine thread as each request gets
  tokens and finishes (``Metrics`` is the engine's ``StatsObserver``);
- engine-state gauges (and the engine's own counters) are read at scrape time from the
  engine's last ``EngineStats`` snapshot, so a scrape never waits for the engine.

Each app gets its own ``CollectorRegistry`` (never the process-wide default), so several
servers in one process (tests, benchmarks) do not collide.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mlxserve.scheduler.stats import EngineStats, FinishedRequest

PREFIX = "mlxserve:"
FINISH_REASONS = ("stop", "length", "abort", "error")

# vLLM's buckets (vllm/v1/metrics/loggers.py), so dashboards' quantiles mean the same.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class Metrics:
    """The metrics of one served model; also the engine's ``StatsObserver``.

    Args:
        model_name: the served model name (the ``model_name`` label, as in vLLM).
        max_model_len: the context length (top of the token-count buckets).
        engine_stats: returns the engine's current ``EngineStats`` (thread-safe), or None
            while there is no engine yet.
    """

    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        engine_stats: Callable[[], EngineStats | None],
    ) -> None:
        # No "_created" series: they double the exposition and dashboards do not use them.
        # A process-wide switch, which is fine: it only drops those series.
        disable_created_metrics()
        self.registry = CollectorRegistry()
        reg = self.registry

        # Children bound to the model label: the engine thread only touches ready objects.
        def counter(name: str, doc: str) -> Any:
            return Counter(PREFIX + name, doc, ["model_name"], registry=reg).labels(model_name)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Any:
            family = Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets, registry=reg)
            return family.labels(model_name)

        token_buckets = build_1_2_5_buckets(max(max_model_len, 1))
        self._prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self._generation_tokens = counter(
            "generation_tokens", "Number of generation tokens processed."
        )
        success = Counter(
            PREFIX + "request_success",
            "Count of processed requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=reg,
        )
        # Every reason is exported from the start (at 0), so rate() works from the first scrape.
        self._success = {r: success.labels(model_name, r) for r in FINISH_REASONS}
        self._ttft = histogram(
            "time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self._itl = histogram(
            "inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )
        self._e2e = histogram(
            "e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self._queue = histogram(
            "request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self._inference = histogram(
            "request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self._prefill = histogram(
            "request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self._decode = histogram(
            "request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self._prompt_len = histogram(
            "request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self._generation_len = histogram(
            "request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self._max_tokens = histogram(
            "request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            token_buckets,
        )
        self.registry.register(_EngineCollector(model_name, engine_stats))

    # ----------------------------------------------------------------- StatsObserver
    def on_first_token(self, prompt_tokens: int, num_tokens: int, ttft: float) -> None:
        self._prompt_tokens.inc(prompt_tokens)
        self._generation_tokens.inc(num_tokens)
        self._ttft.observe(ttft)

    def on_next_tokens(self, num_tokens: int, inter_token_latency: float) -> None:
        self._generation_tokens.inc(num_tokens)
        for _ in range(num_tokens):
            self._itl.observe(inter_token_latency)

    def on_finished(self, request: FinishedRequest) -> None:
        reason = request.finish_reason
        counter = self._success.get(reason) or self._success["error"]
        counter.inc()
        self._e2e.observe(request.e2e_latency)
        self._prompt_len.observe(request.prompt_tokens)
        self._generation_len.observe(request.generation_tokens)
        self._max_tokens.observe(request.max_tokens)
        for histogram, value in (
            (self._queue, request.queue_time),
            (self._inference, request.inference_time),
            (self._prefill, request.prefill_time),
            (self._decode, request.decode_time),
        ):
            if value is not None:
                histogram.observe(value)

    # ----------------------------------------------------------------- exposition
    def render(self) -> tuple[bytes, str]:
        """The text exposition of every metric, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _EngineCollector(Collector):
    """Engine-state gauges and the engine's own counters, read from its snapshot on scrape."""

    def __init__(self, model_name: str, engine_stats: Callable[[], EngineStats | None]) -> None:
        self._model_name = model_name
        self._engine_stats = engine_stats

    def collect(self) -> Iterator[Metric]:
        stats = self._engine_stats() or EngineStats()
        families = (
            (GaugeMetricFamily, "num_requests_running",
             "Number of requests in model execution batches.", stats.num_running),
            (GaugeMetricFamily, "num_requests_waiting",
             "Number of requests waiting to be processed.", stats.num_waiting),
            (GaugeMetricFamily, "kv_cache_usage_perc",
             "KV-cache usage. 1 means 100 percent usage.", stats.kv_usage),
            (GaugeMetricFamily, "kv_cache_total_tokens",
             "Token slots in the KV pool.", stats.kv_total_tokens),
            (CounterMetricFamily, "num_preemptions",
             "Cumulative number of preemption from the engine.", stats.num_preemptions),
            (CounterMetricFamily, "prefix_cache_queries",
             "Prefix cache queries, in terms of number of queried tokens.",
             stats.prefix_cache_queries),
            (CounterMetricFamily, "prefix_cache_hits",
             "Prefix cache hits, in terms of number of cached tokens.", stats.prefix_cache_hits),
            (GaugeMetricFamily, "prefix_cache_tokens",
             "Token slots held by the prefix cache.", stats.prefix_cache_tokens),
            (CounterMetricFamily, "prompt_tokens_computed",
             "Prompt tokens that went through a forward (not served from the prefix cache).",
             stats.prompt_tokens_computed),
            (GaugeMetricFamily, "mlx_active_memory_bytes",
             "Memory MLX holds in live arrays.", stats.mlx_active_bytes),
            (GaugeMetricFamily, "mlx_peak_memory_bytes",
             "Peak of mlx_active_memory_bytes since start.", stats.mlx_peak_bytes),
            (GaugeMetricFamily, "mlx_cache_memory_bytes",
             "Memory MLX keeps cached for reuse.", stats.mlx_cache_bytes),
        )  # fmt: skip
        for family_class, name, doc, value in families:
            family = family_class(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self._model_name], value)
            yield family
