"""Soak with faults against an in-process mlxserve: streamed requests at high concurrency on a
small pool (preemption + prefix-cache eviction), a share of clients disconnecting
mid-stream or cancelled by a client timeout. Greedy requests that were not cut must equal
their solo mlx-lm greedy reference; afterwards no slot may leak.

``tests/test_soak.py`` runs the CI-sized version (100 requests); this runs a larger one::

    .venv/bin/python -m bench.soak --requests 500 --concurrency 32 --max-total-tokens 192
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

REQUESTS = 100
MAX_TOKENS = (8, 24, 48)
CONCURRENCY = 32
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


async def soak(
    url: str, model: str, outcomes: list[Outcome], concurrency: int = CONCURRENCY
) -> None:
    limit = asyncio.Semaphore(concurrency)
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


def plan(rng: random.Random, requests: int = REQUESTS) -> list[Outcome]:
    outcomes = []
    for i in range(requests):
        kind = "greedy"
        if i % 5 == 0:
            kind = "disconnect"
        elif i % 11 == 3:
            kind = "timeout"
        elif i % 7 == 1:
            kind = "sampled"
        outcomes.append(Outcome(rng.choice(PROMPTS), rng.choice(MAX_TOKENS), kind))
    return outcomes


def references(loaded, prompts=PROMPTS, max_tokens=MAX_TOKENS) -> dict[tuple[str, int], str]:  # noqa: ANN001
    """Solo greedy text of every prompt at every max_tokens (mlx-lm, one sequence)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    tok = loaded.tokenizer
    eos = set(getattr(tok, "eos_token_ids", None) or [])
    refs = {}
    for prompt in prompts:
        tokens = []
        steps = generate_step(
            mx.array(list(tok.encode(prompt))),
            loaded.model,
            max_tokens=max(max_tokens),
            sampler=lambda x: mx.argmax(x, axis=-1),
        )
        for token, _ in steps:
            tokens.append(int(token))
            if tokens[-1] in eos:
                break
        for n in max_tokens:
            refs[(prompt, n)] = tok.decode([t for t in tokens[:n] if t not in eos])
    return refs


def check(outcomes: list[Outcome], refs: dict[tuple[str, int], str]) -> list[str]:
    """Failures: errors of requests that were not cut, and greedy texts that differ."""
    failures = []
    for i, out in enumerate(outcomes):
        if out.kind in ("disconnect", "timeout"):
            continue
        if out.errors or out.finish_reason not in ("stop", "length"):
            failures.append(f"request {i}: {out.finish_reason} {out.errors}")
        elif out.kind == "greedy" and out.text != refs[(out.prompt, out.max_tokens)]:
            failures.append(f"request {i} ({out.prompt!r}): {out.text!r}")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY)
    parser.add_argument("--max-total-tokens", type=int, default=192)
    args = parser.parse_args(argv)
    from bench._env import dequantize, enable_blas

    enable_blas()
    from mlxserve.mlx_backend.loading.loader import load_model
    from mlxserve.scheduler.config import EngineConfig
    from mlxserve.server.config import ServerConfig
    from mlxserve.server.lifecycle.launch import serve_in_background

    loaded = load_model(None)
    dequantize(loaded.model)
    refs = references(loaded)
    config = EngineConfig(
        max_total_tokens=args.max_total_tokens,
        max_running_requests=args.concurrency,
        max_prefill_tokens=256,
    )
    srv = serve_in_background(loaded, config, ServerConfig(port=0))
    try:
        model = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
        outcomes = plan(random.Random(0), args.requests)
        rss_before, t0 = rss_mb(), time.monotonic()
        asyncio.run(soak(srv.url, model, outcomes, args.concurrency))
        idle = srv.engine.wait_idle(120)
        wall, rss_after = time.monotonic() - t0, rss_mb()
        srv.engine.check_integrity()
        sched = srv.engine.scheduler
        failures = check(outcomes, refs)
        rows = {
            "requests": len(outcomes),
            "disconnects": sum(o.kind == "disconnect" for o in outcomes),
            "client timeouts": sum(o.kind == "timeout" for o in outcomes),
            "greedy checked": sum(o.kind == "greedy" for o in outcomes),
            "preemptions": sched.num_preemptions,
            "evicted tokens": sched.cache.tree.num_evicted_tokens,
            "prefix-cache hit tokens": sched.prefix_cache_hits,
            "failures": len(failures),
            "slots leaked": 0,  # check_integrity above raises otherwise
            "engine idle and alive": idle and srv.engine.is_alive,
            "RSS growth (MB)": round(rss_after - rss_before, 1),
            "wall (s)": round(wall, 1),
        }
        print("| figure | value |\n|---|---|")
        for name, value in rows.items():
            print(f"| {name} | {value} |")
        for failure in failures[:20]:
            print("FAIL", failure)
        return 1 if failures or not idle else 0
    finally:
        srv.stop()


if __name__ == "__main__":
    raise SystemExit(main())
