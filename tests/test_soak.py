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
import json
import random
from dataclasses import dataclass, field

import httpx
import pytest

from mlx_backend.loaded_model import LoadedModel
from scheduler.config import EngineConfig
from server.config import ServerConfig
from tests.conftest import greedy_reference
from tests.ops_helpers import running_server

REQUESTS = 100
MAX_TOKENS = (8, 24, 48)
CONCURRENCY = 32
RSS_GROWTH_BOUND_MB = 300
SYSTEM = "You are a careful assistant who answers in one short sentence. "
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "How many legs does a spider have?",
    "What is two plus two?",
    "Which planet is closest to the sun?",
    "What do bees make?",
]
PROMPTS = [SYSTEM + q for q in QUESTIONS] + [
    "1, 2, 3, 4,",
    "The quick brown fox",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
]


@dataclass
class Outcome:
    prompt: str
    max_tokens: int
    kind: str  # "greedy", "sampled", "disconnect", "timeout"
    text: str = ""
    finish_reason: str | None = None
    errors: list[str] = field(default_factory=list)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def one(client: httpx.AsyncClient, url: str, model: str, out: Outcome, seed: int) -> None:
    body = {"model": model, "prompt": out.prompt, "max_tokens": out.max_tokens, "stream": True}
    body.update({"temperature": 0.8, "seed": seed} if out.kind == "sampled" else {"temperature": 0})
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            out.errors.append(f"HTTP {response.status_code}: {await response.aread()}")
            return
        chunks = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[len("data: ") :])
            if "error" in payload:
                out.errors.append(str(payload["error"]))
                return
            for choice in payload.get("choices", []):
                out.text += choice.get("text") or ""
                out.finish_reason = choice.get("finish_reason") or out.finish_reason
            chunks += 1
            if out.kind == "disconnect" and chunks == 2:
                return  # leaving the context manager closes the connection mid-stream


async def soak(url: str, model: str, outcomes: list[Outcome]) -> None:
    limit = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:

        async def run(i: int, out: Outcome) -> None:
            async with limit:
                task = one(client, url, model, out, seed=i)
                if out.kind == "timeout":
                    try:
                        await asyncio.wait_for(task, timeout=0.5 + (i % 3) * 0.5)
                    except asyncio.TimeoutError:
                        pass
                else:
                    await task

        await asyncio.gather(*(run(i, out) for i, out in enumerate(outcomes)))


def plan(rng: random.Random) -> list[Outcome]:
    outcomes = []
    for i in range(REQUESTS):
        kind = "greedy"
        if i % 5 == 0:
            kind = "disconnect"
        elif i % 11 == 3:
            kind = "timeout"
        elif i % 7 == 1:
            kind = "sampled"
        outcomes.append(Outcome(rng.choice(PROMPTS), rng.choice(MAX_TOKENS), kind))
    return outcomes


@pytest.fixture(scope="module")
def references(smollm: LoadedModel) -> dict[tuple[str, int], str]:
    tok = smollm.tokenizer
    eos = set(getattr(tok, "eos_token_ids", None) or [])
    refs = {}
    for prompt in PROMPTS:
        tokens = greedy_reference(smollm.model, list(tok.encode(prompt)), max(MAX_TOKENS), eos)
        for n in MAX_TOKENS:
            refs[(prompt, n)] = tok.decode([t for t in tokens[:n] if t not in eos])
    return refs


def test_soak_with_disconnects_and_timeouts(smollm: LoadedModel, references) -> None:
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
        checked = 0
        for i, out in enumerate(outcomes):
            if out.kind in ("disconnect", "timeout"):
                continue
            assert not out.errors, (i, out.errors)
            assert out.finish_reason in ("stop", "length"), (i, out.finish_reason)
            if out.kind == "greedy":
                want = references[(out.prompt, out.max_tokens)]
                assert out.text == want, f"request {i} ({out.prompt!r}): {out.text!r} != {want!r}"
                checked += 1
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
        assert ok.json()["choices"][0]["text"] == references[(PROMPTS[0], 8)]
