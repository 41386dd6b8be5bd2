"""/metrics after real traffic: every metric is exported and moved as the traffic says.

One server whose KV pool (32 slots) is too small for its two concurrent 22-token requests,
so the newer one is preempted and resumed; a third request ends on a stop string. The
SmolLM2 CPU decode is slow, so the traffic is run once (module fixture) and each test
checks one family of metrics against it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.config import EngineConfig
from mlxserve.server.lifecycle.launch import BackgroundServer
from tests.ops_helpers import COUNTING, completion, metric, running_server, scrape, sse_payloads

POOL = 32
MAX_TOKENS = 12  # 11 prompt + 12 - 1 = 22 slots each: two do not fit in 32 together
PROMPT_TOKENS = 11  # len(tokenize(COUNTING)) == len(tokenize(OTHER_COUNTING))
OTHER_COUNTING = "5, 6, 7, 8,"
STOP_PROMPT = "The capital of France is"  # greedy: " Paris." -> stops at "."
STOP_PROMPT_TOKENS = 5


@pytest.fixture(scope="module")
def server(smollm: LoadedModel) -> Iterator[BackgroundServer]:
    config = EngineConfig(max_total_tokens=POOL, max_running_requests=2)
    with running_server(smollm, config) as srv:
        yield srv


def _stream(url: str, body: dict[str, Any], first_chunk: threading.Event, out: list) -> None:
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for payload in sse_payloads(response.iter_lines()):
            first_chunk.set()
            out.append(payload)


@pytest.fixture(scope="module")
def traffic(server: BackgroundServer, smollm: LoadedModel) -> dict[str, Any]:
    """Two concurrent streams (one preempted), a scrape while they run, a stop-string finish;
    returns the scrapes and the answers."""
    # Two different prompts: identical ones would share their slots (prefix cache) and fit.
    bodies = [
        completion(
            smollm.model_id,
            prompt,
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
        )
        for prompt in (COUNTING, OTHER_COUNTING)
    ]
    started = [threading.Event(), threading.Event()]
    outs: list[list] = [[], []]
    threads = [
        threading.Thread(target=_stream, args=(server.url, bodies[i], started[i], outs[i]))
        for i in range(2)
    ]
    for thread in threads:
        thread.start()
    assert started[0].wait(120), "the first stream produced nothing"
    during = scrape(server.url)
    for thread in threads:
        thread.join(120)
    stopped = httpx.post(
        server.url + "/v1/completions",
        json=completion(smollm.model_id, STOP_PROMPT, max_tokens=4, stop=["."]),
        timeout=120,
    )
    assert stopped.status_code == 200, stopped.text
    assert server.engine.wait_idle(60)
    return {"during": during, "after": scrape(server.url), "streams": outs, "stopped": stopped}


class TestTrafficRan:
    def test_answers(self, traffic: dict[str, Any]) -> None:
        for out in traffic["streams"]:
            assert out[-1] == "[DONE]", out[-3:]
            usage = dict(out[-2]["usage"])
            assert usage.pop("prompt_tokens_details")["cached_tokens"] >= 0
            assert usage == {
                "prompt_tokens": PROMPT_TOKENS,
                "completion_tokens": MAX_TOKENS,
                "total_tokens": PROMPT_TOKENS + MAX_TOKENS,
            }, usage
        choice = traffic["stopped"].json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice


class TestEngineGauges:
    def test_running_and_kv_usage_while_busy(self, traffic: dict[str, Any]) -> None:
        during = traffic["during"]
        assert metric(during, "mlxserve:num_requests_running") >= 1, "a stream was running"
        usage = metric(during, "mlxserve:kv_cache_usage_perc")
        assert 0 < usage <= 1, f"KV usage while running: {usage}"

    def test_back_to_zero_when_idle(self, traffic: dict[str, Any]) -> None:
        after = traffic["after"]
        assert metric(after, "mlxserve:num_requests_running") == 0
        assert metric(after, "mlxserve:num_requests_waiting") == 0
        assert metric(after, "mlxserve:kv_cache_usage_perc") == 0
        assert metric(after, "mlxserve:kv_cache_total_tokens") == POOL

    def test_preemption_counted(self, traffic: dict[str, Any]) -> None:
        # 2 x 22 slots > 32: the newer stream had to give its slots back at least once.
        assert metric(traffic["after"], "mlxserve:num_preemptions_total") >= 1

    def test_prefix_cache_counters_exported(self, traffic: dict[str, Any]) -> None:
        after = traffic["after"]
        queries = metric(after, "mlxserve:prefix_cache_queries_total")
        hits = metric(after, "mlxserve:prefix_cache_hits_total")
        assert 0 <= hits <= queries, (hits, queries)

    def test_mlx_memory(self, traffic: dict[str, Any]) -> None:
        after = traffic["after"]
        active = metric(after, "mlxserve:mlx_active_memory_bytes")
        peak = metric(after, "mlxserve:mlx_peak_memory_bytes")
        assert active > 0, "the model and the KV pool live in MLX arrays"
        assert peak >= active, (peak, active)
        assert metric(after, "mlxserve:mlx_cache_memory_bytes") >= 0


class TestRequestCounters:
    def test_token_counters(self, traffic: dict[str, Any]) -> None:
        after = traffic["after"]
        # A preempted request recomputes its prompt but it is counted once, as in vLLM.
        prompt = metric(after, "mlxserve:prompt_tokens_total")
        assert prompt == 2 * PROMPT_TOKENS + STOP_PROMPT_TOKENS, prompt
        # The engine may run a token past the stop string before its abort lands.
        generated = metric(after, "mlxserve:generation_tokens_total")
        assert 2 * MAX_TOKENS + 2 <= generated <= 2 * MAX_TOKENS + 4, generated

    def test_success_by_finish_reason(self, traffic: dict[str, Any]) -> None:
        after = traffic["after"]
        name = "mlxserve:request_success_total"
        assert metric(after, name, finished_reason="length") == 2
        assert metric(after, name, finished_reason="stop") == 1, "a stop string is a stop"
        assert metric(after, name, finished_reason="abort") == 0
        assert metric(after, name, finished_reason="error") == 0


class TestHistograms:
    @pytest.mark.parametrize(
        "name",
        [
            "time_to_first_token_seconds",
            "e2e_request_latency_seconds",
            "request_queue_time_seconds",
            "request_inference_time_seconds",
            "request_prefill_time_seconds",
            "request_decode_time_seconds",
        ],
    )
    def test_one_observation_per_request(self, traffic: dict[str, Any], name: str) -> None:
        after = traffic["after"]
        assert metric(after, f"mlxserve:{name}_count") == 3
        total = metric(after, f"mlxserve:{name}_sum")
        assert total >= 0 and metric(after, f"mlxserve:{name}_bucket", le="+Inf") == 3

    def test_latencies_are_ordered(self, traffic: dict[str, Any]) -> None:
        after = traffic["after"]
        e2e = metric(after, "mlxserve:e2e_request_latency_seconds_sum")
        ttft = metric(after, "mlxserve:time_to_first_token_seconds_sum")
        queue = metric(after, "mlxserve:request_queue_time_seconds_sum")
        assert 0 <= queue < ttft < e2e, (queue, ttft, e2e)

    def test_inter_token_latency(self, traffic: dict[str, Any]) -> None:
        after = traffic["after"]
        count = metric(after, "mlxserve:inter_token_latency_seconds_count")
        generated = metric(after, "mlxserve:generation_tokens_total")
        # Every token but each request's first one is an inter-token gap.
        assert count == generated - 3, (count, generated)
        assert metric(after, "mlxserve:inter_token_latency_seconds_sum") > 0

    def test_token_histograms(self, traffic: dict[str, Any]) -> None:
        after = traffic["after"]
        prompt_sum = metric(after, "mlxserve:request_prompt_tokens_sum")
        assert prompt_sum == 2 * PROMPT_TOKENS + STOP_PROMPT_TOKENS
        assert metric(after, "mlxserve:request_prompt_tokens_bucket", le="10.0") == 1
        generated = metric(after, "mlxserve:request_generation_tokens_sum")
        assert generated == metric(after, "mlxserve:generation_tokens_total")
        assert metric(after, "mlxserve:request_generation_tokens_count") == 3
        assert metric(after, "mlxserve:request_params_max_tokens_sum") == 2 * MAX_TOKENS + 4
