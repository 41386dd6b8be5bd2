"""Prometheus metrics for ``/metrics``: vLLM's names and meanings, prefixed ``mlxserve:``.

Two sources, as in vLLM:

- request-level counters and histograms are fed by the engine thread as each request gets
  tokens and finishes (``Metrics`` is the engine's ``StatsObserver``);
- engine-state gauges (and the engine's own counters) are read at scrape time from the
  engine's last ``EngineStats`` snapshot, so a scrape never waits for the engine.

Each app gets its own ``CollectorRegistry`` (never the process-wide default), so several
servers in one process (tests, benchmarks) do not collide; in it every series carries the
``model_name`` label, one child per served model. Model loads and unloads are counted too
(``model_loads_total``, ``model_unloads_total``, ``model_load_seconds``).
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
MODEL_LOAD_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
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
    """The server's metrics: one registry, every model's series labelled ``model_name``.

    ``add_model`` gives each loaded model a ``ModelMetrics`` (its engine's
    ``StatsObserver``) and exports its engine's state gauges until ``remove_model``; the
    model's counters and histograms stay (a counter never goes back). The histograms'
    token-count buckets follow the first model's context length.
    """

    def __init__(self) -> None:
        # No "_created" series: they double the exposition and dashboards do not use them.
        # A process-wide switch, which is fine: it only drops those series.
        disable_created_metrics()
        self.registry = CollectorRegistry()
        self._families: _Families | None = None
        self._engines = _EngineCollector()
        self.registry.register(self._engines)
        self._vision = _VisionCollector()
        self.registry.register(self._vision)
        reg = self.registry
        self._loads = Counter(
            PREFIX + "model_loads", "Models loaded.", ["model_name"], registry=reg
        )
        self._unloads = Counter(
            PREFIX + "model_unloads", "Models unloaded.", ["model_name"], registry=reg
        )
        self._load_seconds = Histogram(
            PREFIX + "model_load_seconds",
            "Histogram of model load time in seconds.",
            ["model_name"],
            buckets=MODEL_LOAD_BUCKETS,
            registry=reg,
        )

    def add_model(
        self,
        model_name: str,
        max_model_len: int,
        engine_stats: Callable[[], EngineStats | None],
        vision: Any = None,
    ) -> ModelMetrics:
        """Start exporting a loaded model (and its vision encoder's counts: an object with
        ``images_encoded``, ``cache_hits`` and ``encoder_seconds``); returns its engine's
        observer."""
        if self._families is None:
            self._families = _Families(self.registry, max_model_len)
        self._engines.models[model_name] = engine_stats
        if vision is not None:
            self._vision.models[model_name] = vision
        return ModelMetrics(self._families, model_name)

    def remove_model(self, model_name: str) -> None:
        """Stop exporting an unloaded model's engine state."""
        self._engines.models.pop(model_name, None)
        self._vision.models.pop(model_name, None)

    def model_loaded(self, model_name: str, seconds: float) -> None:
        self._loads.labels(model_name).inc()
        self._load_seconds.labels(model_name).observe(seconds)

    def model_unloaded(self, model_name: str) -> None:
        self._unloads.labels(model_name).inc()

    def render(self) -> tuple[bytes, str]:
        """The text exposition of every metric, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _Families:
    """The request metric families (created once per registry)."""

    def __init__(self, reg: CollectorRegistry, max_model_len: int) -> None:
        def counter(name: str, doc: str, labels: Sequence[str] = ("model_name",)) -> Counter:
            return Counter(PREFIX + name, doc, list(labels), registry=reg)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets, registry=reg)

        token_buckets = build_1_2_5_buckets(max(max_model_len, 1))
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "generation_tokens", "Number of generation tokens processed."
        )
        self.success = counter(
            "request_success",
            "Count of processed requests, by finish reason.",
            ("model_name", "finished_reason"),
        )
        self.ttft = histogram(
            "time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue = histogram(
            "request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference = histogram(
            "request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill = histogram(
            "request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode = histogram(
            "request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prompt_len = histogram(
            "request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.generation_len = histogram(
            "request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self.max_tokens = histogram(
            "request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            token_buckets,
        )


class ModelMetrics:
    """One model's request metrics; its engine's ``StatsObserver``.

    Args:
        families: the server's metric families.
        model_name: the served model name (the ``model_name`` label, as in vLLM).
    """

    def __init__(self, families: _Families, model_name: str) -> None:
        f = families
        # Children bound to the model label: the engine thread only touches ready objects.
        self._prompt_tokens = f.prompt_tokens.labels(model_name)
        self._generation_tokens = f.generation_tokens.labels(model_name)
        # Every reason is exported from the start (at 0), so rate() works from the first scrape.
        self._success = {r: f.success.labels(model_name, r) for r in FINISH_REASONS}
        self._ttft = f.ttft.labels(model_name)
        self._itl = f.itl.labels(model_name)
        self._e2e = f.e2e.labels(model_name)
        self._queue = f.queue.labels(model_name)
        self._inference = f.inference.labels(model_name)
        self._prefill = f.prefill.labels(model_name)
        self._decode = f.decode.labels(model_name)
        self._prompt_len = f.prompt_len.labels(model_name)
        self._generation_len = f.generation_len.labels(model_name)
        self._max_tokens = f.max_tokens.labels(model_name)

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


class _EngineCollector(Collector):
    """Engine-state gauges and the engine's own counters of every loaded model, read from
    each engine's snapshot on scrape."""

    def __init__(self) -> None:
        # model name -> its engine's stats (replaced whole, never mutated in place).
        self.models: dict[str, Callable[[], EngineStats | None]] = {}

    def collect(self) -> Iterator[Metric]:
        models = [(name, stats() or EngineStats()) for name, stats in list(self.models.items())]
        for family_class, name, doc, value_of in _ENGINE_FAMILIES:
            family = family_class(PREFIX + name, doc, labels=["model_name"])
            for model_name, stats in models:
                family.add_metric([model_name], value_of(stats))
            yield family
        # Accepted tokens by their position in the proposal (vLLM's per-position counter).
        per_pos = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=["model_name", "position"],
        )
        for model_name, stats in models:
            for position, count in enumerate(stats.spec_accepted_per_pos):
                per_pos.add_metric([model_name, str(position)], count)
        yield per_pos


class _VisionCollector(Collector):
    """The vision encoder's counters of every loaded vision model, read on scrape."""

    def __init__(self) -> None:
        self.models: dict[str, Any] = {}

    def collect(self) -> Iterator[Metric]:
        models = list(self.models.items())
        for name, doc, attribute in _VISION_FAMILIES:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            for model_name, vision in models:
                family.add_metric([model_name], float(getattr(vision, attribute)))
            yield family


_VISION_FAMILIES = (
    ("images_processed", "Images run through the vision encoder.", "images_encoded"),
    ("vision_encoder_seconds", "Seconds the vision encoder ran.", "encoder_seconds"),
    ("vision_cache_hits", "Images whose features the vision cache already held.", "cache_hits"),
)


# (family, name, help, the value in a snapshot) of every engine-state series.
_ENGINE_FAMILIES: tuple[tuple[Any, str, str, Callable[[EngineStats], float]], ...] = (
    (GaugeMetricFamily, "num_requests_running",
     "Number of requests in model execution batches.", lambda s: s.num_running),
    (GaugeMetricFamily, "num_requests_waiting",
     "Number of requests waiting to be processed.", lambda s: s.num_waiting),
    (GaugeMetricFamily, "kv_cache_usage_perc",
     "KV-cache usage. 1 means 100 percent usage.", lambda s: s.kv_usage),
    (GaugeMetricFamily, "kv_cache_total_tokens",
     "Token slots in the KV pool.", lambda s: s.kv_total_tokens),
    (CounterMetricFamily, "num_preemptions",
     "Cumulative number of preemption from the engine.", lambda s: s.num_preemptions),
    (CounterMetricFamily, "prefix_cache_queries",
     "Prefix cache queries, in terms of number of queried tokens.",
     lambda s: s.prefix_cache_queries),
    (CounterMetricFamily, "prefix_cache_hits",
     "Prefix cache hits, in terms of number of cached tokens.", lambda s: s.prefix_cache_hits),
    (GaugeMetricFamily, "prefix_cache_tokens",
     "Token slots held by the prefix cache.", lambda s: s.prefix_cache_tokens),
    (CounterMetricFamily, "prompt_tokens_computed",
     "Prompt tokens that went through a forward (not served from the prefix cache).",
     lambda s: s.prompt_tokens_computed),
    (CounterMetricFamily, "spec_decode_num_drafts",
     "Number of spec decoding drafts.", lambda s: s.spec_num_drafts),
    (CounterMetricFamily, "spec_decode_num_draft_tokens",
     "Number of draft tokens.", lambda s: s.spec_num_draft_tokens),
    (CounterMetricFamily, "spec_decode_num_accepted_tokens",
     "Number of accepted tokens.", lambda s: s.spec_num_accepted_tokens),
    (GaugeMetricFamily, "mlx_active_memory_bytes",
     "Memory MLX holds in live arrays.", lambda s: s.mlx_active_bytes),
    (GaugeMetricFamily, "mlx_peak_memory_bytes",
     "Peak of mlx_active_memory_bytes since start.", lambda s: s.mlx_peak_bytes),
    (GaugeMetricFamily, "mlx_cache_memory_bytes",
     "Memory MLX keeps cached for reuse.", lambda s: s.mlx_cache_bytes),
)  # fmt: skip
