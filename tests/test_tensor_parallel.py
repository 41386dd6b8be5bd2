"""Tensor parallelism: a 2-rank server (``--tensor-parallel 2``, ring over 127.0.0.1)
answers concurrent greedy requests token for token like one process, its idle rank sleeps,
and a lost or missing rank stops the group with an error instead of a hang."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI

from mlxserve.mlx_backend.loading.loader import load_model
from mlxserve.scheduler.config import EngineConfig
from mlxserve.server.config import ServerConfig
from mlxserve.server.lifecycle.launch import serve_in_background
from tests.tensor_parallel_server import (
    RankedServer,
    cpu_seconds,
    require_loopback_ports,
)
from tests.tiny_models import build_tiny_model_dir

# 4 prompts of 61 tokens + 4 x 24 generated do not fit 96 slots: decoding must preempt.
POOL = 96
MAX_TOKENS = 24
PROMPTS = [
    [(7 * i + 3) % 250 + 1 for i in range(30)],
    [(5 * i + 1) % 250 + 1 for i in range(5)],
    [(3 * i + 2) % 250 + 1 for i in range(17)],
    [(11 * i + 4) % 250 + 1 for i in range(9)],
]
# Shares the first prompt's first 30 tokens: served from the prefix cache.
CACHED = [*PROMPTS[0], 9, 8, 7]


def _complete(url: str, model: str, prompt: list[int]) -> tuple[str, list[str]]:
    client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    r = client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=1
    )
    choice = r.choices[0]
    return choice.text, list(choice.logprobs.tokens)


def _answers(url: str, model: str) -> list[tuple[str, list[str]]]:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda p: _complete(url, model, p), PROMPTS))
    # One after the other: the first leaves its prompt in the prefix cache for the second.
    return [*answers, _complete(url, model, PROMPTS[0]), _complete(url, model, CACHED)]


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    values = re.findall(rf"^mlxserve:{name}(?:_total)?(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert values, f"/metrics has no {name}"
    return float(values[0])


# Tensor parallelism (every layer split) on two families with shard(); pipeline
# parallelism (each rank a run of layers) on a hybrid model with pipeline().
SPLITS = [("llama", "--tensor-parallel"), ("qwen3", "--tensor-parallel")]
SPLITS += [("qwen3_next", "--pipeline-parallel")]


@pytest.fixture(scope="module", params=SPLITS, ids=[arch for arch, _ in SPLITS])
def split(request):
    return request.param


@pytest.fixture(scope="module")
def model_dir(split, tmp_path_factory):
    require_loopback_ports()
    return build_tiny_model_dir(split[0], tmp_path_factory.mktemp(split[0]))


@pytest.fixture(scope="module")
def two_ranks(model_dir, split, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / f"{model_dir.name}.log"
    args = ["--model", str(model_dir), split[1], "2"]
    args += ["--max-total-tokens", str(POOL), "--distributed-timeout", "60"]
    # With n-gram speculation on (the one process runs without): rows with proposals run
    # packed on every rank, so the workers must see them (greedy output is unchanged).
    args += ["--speculative-method", "ngram"]
    server = RankedServer(args, log).wait_ready()
    yield server
    # A drain (SIGTERM) closes the group: rank 0 tells rank 1, both exit 0.
    status = server.stop()
    assert status == 0, f"rank 0 exited {status} after SIGTERM:\n{server.log()}"
    assert not server.leftover, f"ranks {server.leftover} outlived rank 0"
    assert "rank 1: closed by rank 0" in server.log(), server.log()


@pytest.fixture(scope="module")
def one_process(model_dir):
    srv = serve_in_background(
        load_model(str(model_dir)), EngineConfig(max_total_tokens=POOL), ServerConfig(port=0)
    )
    yield srv
    assert srv.engine.wait_idle(30), "the reference engine did not go idle"
    srv.engine.check_integrity()
    srv.stop()


class TestTwoRanksEqualOneProcess:
    def test_concurrent_greedy_tokens_match(self, two_ranks, one_process, model_dir, split):
        got = _answers(two_ranks.url, model_dir.name)
        want = _answers(one_process.url, model_dir.name)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g[1] == w[1], f"{model_dir.name} prompt {i}: 2 ranks {g[1]} != 1 process {w[1]}"
            assert len(g[1]) == MAX_TOKENS, f"prompt {i} stopped early: {g[1]}"
        assert _metric(two_ranks.url, "num_preemptions") > 0, "the pool was meant to preempt"
        assert _metric(two_ranks.url, "prefix_cache_hits") > 0, "the last prompt was cached"
        if split[1] == "--tensor-parallel":  # (qwen3_next is recurrent: no speculation)
            drafts = _metric(two_ranks.url, "spec_decode_num_drafts")
            assert drafts > 0, "the rows were meant to verify proposals on both ranks"

    def test_no_slot_leaks(self, two_ranks):
        # Whenever the engine goes idle it audits its slots (free + requests' + prefix
        # cache's == total) and logs an error if one is missing; no request holds any.
        _complete(two_ranks.url, two_ranks_model(two_ranks), PROMPTS[1])
        time.sleep(0.5)
        used = _metric(two_ranks.url, "kv_cache_usage_perc")
        assert used == 0, f"an idle engine's requests still hold {used:.0%} of the pool"
        assert _metric(two_ranks.url, "prefix_cache_tokens") > 0, "the prefix cache kept none"
        assert "slot accounting is broken" not in two_ranks.log(), two_ranks.log()

    def test_each_rank_holds_half_the_kv(self, two_ranks, one_process):
        # Tensor parallel: half the KV heads of every layer; pipeline: half the layers.
        pools = re.findall(
            r"KV pools \(float\): \d+ full-attention slots \(([\d.]+) MiB\)", two_ranks.log()
        )
        assert len(pools) == 2, f"expected one pool line per rank: {pools}"
        one = one_process.engine.executor.kv.arrays()
        one_bytes = sum(a.nbytes for a in one)
        assert all(abs(float(p) - one_bytes / 2**21) < 0.06 for p in pools), (pools, one_bytes)


def two_ranks_model(server: RankedServer) -> str:
    return httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]


class TestIdleRankSleeps:
    def test_idle_rank_uses_under_5_percent_cpu(self, two_ranks):
        ranks = two_ranks.ranks()
        assert len(ranks) == 1, f"rank 0 should have started one rank, has {ranks}"
        before, start = cpu_seconds(ranks[0]), time.monotonic()
        time.sleep(2.0)
        share = (cpu_seconds(ranks[0]) - before) / (time.monotonic() - start)
        assert share < 0.05, f"idle rank 1 used {share:.0%} of a core"


class TestGroupMetrics:
    def test_ranks_steps_and_collectives_are_exported(self, two_ranks, split):
        _complete(two_ranks.url, two_ranks_model(two_ranks), PROMPTS[1])
        assert _metric(two_ranks.url, "tensor_parallel_ranks") == 2
        assert _metric(two_ranks.url, "tensor_parallel_steps") >= MAX_TOKENS
        collectives = _metric(two_ranks.url, "tensor_parallel_collectives_per_step")
        # Sharded: two layers, an all_sum after attention and after the MLP of each, per
        # row group; pipelined: a send or receive and the final all_gather per row group.
        per_group = 4 if split[1] == "--tensor-parallel" else 2
        assert collectives > 0 and collectives % per_group == 0, collectives
        forward = _metric(two_ranks.url, "tensor_parallel_forward_seconds")
        collectives = _metric(two_ranks.url, "tensor_parallel_collective_seconds_estimate")
        assert 0 < collectives < forward, (collectives, forward)
