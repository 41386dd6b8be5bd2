"""Soak with faults (CI-sized): ~100 streamed requests at concurrency 32 against a pool small
enough to force preemption and prefix-cache eviction; a fifth of the clients disconnect
mid-stream and some are cancelled by a client timeout.

Every greedy request that was not cut returns exactly its solo greedy reference (mlx-lm,
one sequence at a time), which is also the isolation check: under heavy batching and
preemption no request sees another's tokens. Afterwards every token and state slot is free
or owned by the prefix cache (``running_server`` checks on exit), the engine is alive, and
resident memory grew by less than ``RSS_GROWTH_BOUND_MB``. A larger run lives in
``bench/soak.py``.
"""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from bench.soak import CONCURRENCY, PROMPTS, check, plan, references, rss_mb, soak
from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.config import EngineConfig
from mlxserve.server.config import ServerConfig
from tests.ops_helpers import running_server

RSS_GROWTH_BOUND_MB = 300


@pytest.fixture(scope="module")
def refs(smollm: LoadedModel) -> dict[tuple[str, int], str]:
    return references(smollm)


def test_soak_with_disconnects_and_timeouts(smollm: LoadedModel, refs) -> None:
    # ~25 + 48 tokens x 32 running requests needs ~2,300 slots: 192 forces preemption,
    # and the prefix cache keeps being evicted.
    engine_config = EngineConfig(
        max_total_tokens=192, max_running_requests=CONCURRENCY, max_prefill_tokens=256
    )
    outcomes = plan(random.Random(0))
    with running_server(smollm, engine_config, ServerConfig(port=0)) as srv:
        model = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
        rss_before = rss_mb()
        asyncio.run(soak(srv.url, model, outcomes))
        assert srv.engine.wait_idle(60)
        rss_after = rss_mb()
        assert srv.engine.is_alive
        sched = srv.engine.scheduler
        figures = {
            "requests": len(outcomes),
            "disconnects": sum(o.kind == "disconnect" for o in outcomes),
            "timeouts": sum(o.kind == "timeout" for o in outcomes),
            "preemptions": sched.num_preemptions,
            "evicted tokens": sched.cache.tree.num_evicted_tokens,
            "prefix hits": sched.prefix_cache_hits,
            "rss growth MB": round(rss_after - rss_before, 1),
        }
        print("soak figures:", figures)
        failures = check(outcomes, refs)
        assert not failures, failures
        checked = sum(o.kind == "greedy" for o in outcomes)
        assert checked >= 50
        assert sched.num_preemptions > 0, "the pool was meant to force preemption"
        assert sched.cache.tree.num_evicted_tokens > 0, "and prefix-cache eviction"
        assert rss_after - rss_before < RSS_GROWTH_BOUND_MB, figures
        # The server still answers normally afterwards.
        ok = httpx.post(
            srv.url + "/v1/completions",
            json={"model": model, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0},
            timeout=60,
        )
        assert ok.json()["choices"][0]["text"] == refs[(PROMPTS[0], 8)]
