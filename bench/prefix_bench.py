"""Prefix-cache benchmark: mlxserve vs mlx_lm.server on shared-prefix and multi-turn chat.

Two workloads, run on each server in turn (mlxserve first: start, both workloads, stop; then
mlx_lm.server the same way), every server started fresh with :func:`bench.compare.Server`:

1. *Shared system prompt*: a deterministic system prompt of about ``--system-tokens`` tokens
   (counted with the model's tokenizer) and ``--users`` distinct short questions, all sent at
   once. "cold": the first batch the fresh server sees with that system prompt; "warm": the
   same system prompt with new questions, sent after every cold answer arrived.
2. *Multi-turn*: ``--conversations`` conversations of ``--turns`` turns with their own (fresh)
   system prompt. Turn k of every conversation is sent at once, each carrying the whole
   conversation so far (the assistant texts the server actually returned); turn k+1 starts
   after all turn-k answers arrived.

Streaming chat completions, temperature 0, ``stream_options.include_usage``. Reported: TTFT
percentiles, wall times, ``usage.prompt_tokens`` and ``usage.prompt_tokens_details.
cached_tokens`` sums, and for mlxserve the prompt tokens it actually computed
(``mlxserve:prompt_tokens_computed_total`` from ``/metrics``, read before and after each
phase). All traffic goes to 127.0.0.1; every phase has a wall-clock cap. Example::

    .venv/bin/python -m bench.prefix_bench --markdown          # the full run (about 10 min)
    .venv/bin/python -m bench.prefix_bench --quick --servers mlxserve
    .venv/bin/python -m bench.prefix_bench --render bench/results/prefix_bench.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
import random
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _env, compare
from bench.corpus import WORDS
from bench.loadgen import RequestResult, one_request, summarize, warmup
from bench.report import OURS, PEER, _f, _ratio, _x

# mlxserve with --disable-prefix-cache: the baseline where every request prefills its
# whole prompt (its "cold" is what a cold batch costs without any sharing).
NOCACHE = "mlxserve-nocache"
SERVERS = (OURS, NOCACHE, PEER)

COMPUTED, PROMPT = "mlxserve:prompt_tokens_computed_total", "mlxserve:prompt_tokens_total"
LOGS = compare.ROOT / "bench" / "results" / "logs"


# ----------------------------------------------------------------------------- workload text
def count_tokens(model_dir: Path, text: str) -> int:
    """Tokens of ``text`` (no special tokens) with the model's ``tokenizer.json``."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return len(tok.encode(text, add_special_tokens=False).ids)


def system_prompt(model_dir: Path, seed: int, target_tokens: int) -> tuple[str, int]:
    """A deterministic system prompt of at least ``target_tokens`` tokens, and its count."""
    rng = random.Random(seed)
    a, b = rng.sample(WORDS, 2)
    lines = [f"You are the assistant of the {a} {b} guild (edition {seed}). Follow these rules."]
    n = 0
    while n < target_tokens:  # about 20 tokens per rule; recount each 10 rules
        for _ in range(10):
            w = rng.sample(WORDS, 4)
            lines.append(
                f"Rule {len(lines)}: when a guest mentions the {w[0]} or the {w[1]}, "
                f"answer kindly and recall the {w[2]} near the {w[3]}."
            )
        n = count_tokens(model_dir, "\n".join(lines))
    while len(lines) > 1:  # trim back to the smallest prompt reaching the target
        shorter = count_tokens(model_dir, "\n".join(lines[:-1]))
        if shorter < target_tokens:
            break
        lines.pop()
        n = shorter
    return "\n".join(lines), n


def question(seed: int, index: int) -> str:
    """A short user question, distinct per ``(seed, index)``."""
    w = random.Random(seed * 7919 + index).sample(WORDS, 2)
    return f"Question {index}: in one sentence, what links a {w[0]} and a {w[1]}?"


# ----------------------------------------------------------------------------- measuring
async def scrape(base_url: str) -> dict[str, float]:
    """The two prompt-token counters from mlxserve's ``/metrics`` (summed over labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    url = base_url.removesuffix("/v1") + "/metrics"
    async with httpx.AsyncClient(timeout=30.0) as client:
        text = (await client.get(url)).text
    out = {COMPUTED: 0.0, PROMPT: 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in out:
                out[sample.name] += sample.value
    return out


async def phase(
    server: compare.Server, model: str, prompts: list[list[dict[str, str]]], args: Any
) -> tuple[dict[str, Any], list[RequestResult]]:
    """Send ``prompts`` at once; their summary (+ token sums, metric deltas) and results."""
    url = server.base_url + "/chat/completions"
    ours = server.name in (OURS, NOCACHE)
    before = await scrape(server.base_url) if ours else {}
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    timeout = httpx.Timeout(args.time_cap, connect=30.0)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        tasks = [
            asyncio.create_task(one_request(client, url, model, p, args.max_tokens))
            for p in prompts
        ]
        done, pending = await asyncio.wait(tasks, timeout=args.time_cap)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    wall = time.perf_counter() - t0
    results = [
        t.result() if t in done else RequestResult(start=t0, end=t0 + wall, error="cancelled")
        for t in tasks
    ]
    stats = summarize(results, len(prompts), wall)
    row: dict[str, Any] = asdict(stats)
    del row["steady_decode_tok_s"], row["steady_window_s"]
    row["prompt_tokens"] = sum(r.prompt_tokens or 0 for r in results)
    cached = [r.cached_tokens for r in results if r.cached_tokens is not None]
    row["cached_tokens"] = sum(cached) if cached else None
    if ours:
        await asyncio.sleep(0.2)  # the engine snapshot behind /metrics trails the last token
        after = await scrape(server.base_url)
        row["metric_prompt_tokens"] = int(after[PROMPT] - before[PROMPT])
        row["computed_tokens"] = int(after[COMPUTED] - before[COMPUTED])
    print(
        f"[prefix_bench] {server.name:<14} {len(prompts):>2} reqs: ttft p50 "
        f"{_f(stats.ttft_p50, 1e3, 0)} ms p99 {_f(stats.ttft_p99, 1e3, 0)} ms, wall "
        f"{wall:.1f}s, prompt {row['prompt_tokens']}, cached {row['cached_tokens']}, "
        f"computed {row.get('computed_tokens', '-')}, {stats.errors} errors",
        flush=True,
    )
    return row, results


async def workloads(server: compare.Server, args: Any, sys_a: str, sys_b: str) -> dict:
    """Both workloads on one started server."""
    model = server.model_name()
    await warmup(server.base_url, model)
    out: dict[str, Any] = {}
    sys_msg = {"role": "system", "content": sys_a}
    for i, name in enumerate(("cold", "warm")):
        qs = [question(args.seed, i * 1000 + u) for u in range(args.users)]
        prompts = [[sys_msg, {"role": "user", "content": q}] for q in qs]
        out[name], _ = await phase(server, model, prompts, args)
    convs = [[{"role": "system", "content": sys_b}] for _ in range(args.conversations)]
    turns = []
    for t in range(args.turns):
        for c, conv in enumerate(convs):
            conv.append({"role": "user", "content": question(args.seed + 1, 100 * c + t)})
        row, results = await phase(server, model, [list(c) for c in convs], args)
        turns.append(row)
        for conv, r in zip(convs, results, strict=True):
            conv.append({"role": "assistant", "content": r.text})
    out["turns"] = turns
    keys = ("prompt_tokens", "cached_tokens", "computed_tokens", "metric_prompt_tokens")
    out["multi"] = {k: sum(r[k] for r in turns if r.get(k) is not None) for k in keys}
    out["multi"]["wall_s"] = sum(r["wall_s"] for r in turns)
    out["multi"]["errors"] = sum(r["errors"] for r in turns)
    return out


def run_server(name: str, cmd: list[str], port: int, args: Any, sys_a: str, sys_b: str) -> dict:
    """Start one server, run both workloads, stop it; an ``error`` entry if it failed."""
    log = LOGS / f"prefix-{name}.log"
    server = compare.Server(name, cmd, port, log)
    try:
        started = server.start(args.start_timeout)
        print(f"[prefix_bench] {name} healthy after {started:.1f}s", flush=True)
        return {"start_s": started} | asyncio.run(workloads(server, args, sys_a, sys_b))
    except Exception as e:  # noqa: BLE001 - recorded and reported, the other server still runs
        tail = log.read_text(errors="replace").splitlines()[-5:] if log.is_file() else []
        print(f"[prefix_bench] {name} failed: {e!r}; log tail: {tail}", flush=True)
        return {"error": f"{type(e).__name__}: {e}", "log_tail": tail}
    finally:
        server.stop()


# ----------------------------------------------------------------------------- report
def targets(res: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met); met None where unmeasured or only shown for reference."""
    ours, peer = res["servers"].get(OURS, {}), res["servers"].get(PEER, {})
    nocache = res["servers"].get(NOCACHE, {})

    def ratio(a: dict[str, Any], b: dict[str, Any], pa: str, pb: str) -> float | None:
        return _ratio((a.get(pa) or {}).get("ttft_p50"), (b.get(pb) or {}).get("ttft_p50"))

    multi = ours.get("multi") or {}
    share = _ratio(multi.get("computed_tokens"), multi.get("prompt_tokens"))
    cold = ratio(ours, peer, "cold", "cold")
    rows = [
        ("mlxserve warm TTFT p50 <= 0.2x mlxserve cold", ratio(ours, ours, "warm", "cold"), 0.2),
        (
            "mlxserve warm TTFT p50 <= 0.2x cold without the cache (--disable-prefix-cache)",
            ratio(ours, nocache, "warm", "cold"),
            0.2,
        ),
        ("warm: mlxserve TTFT p50 <= 0.5x mlx_lm.server", ratio(ours, peer, "warm", "warm"), 0.5),
        ("multi-turn: mlxserve computed <= 0.3x prompt tokens", share, 0.3),
    ]
    out = [(label, _x(r), None if r is None else r <= lim) for label, r, lim in rows]
    out.insert(2, ("cold: mlxserve TTFT p50 vs mlx_lm.server (reference only)", _x(cold), None))
    return out


def _n(v: Any) -> str:
    return "-" if v is None else str(v)


def markdown(res: dict[str, Any]) -> str:
    """The "## Prefix cache" section for ``docs/benchmarks.md``."""
    m, servers = res["meta"], res["servers"]
    lines = [
        "## Prefix cache",
        "",
        f"Generated by `bench/prefix_bench.py` on {m['date']} ({m['elapsed_min']:.1f} min; load "
        f"average {m['load_before']} before, {m['load_after']} after): `{m['command']}`. "
        f"{m['machine']}; {m['versions']}; model `{m['model']}`. Each server started fresh "
        "and warmed up with one short request, then ran both workloads; streaming chat "
        f"completions, temperature 0, `max_tokens` {m['max_tokens']}, seed {m['seed']}.",
        "",
        f"**Shared system prompt**: one system prompt of {m['system_tokens']} tokens, "
        f"{m['users']} users with distinct one-line questions sent at once. *cold*: the first "
        "batch with that system prompt; *warm*: the same system prompt, new questions. TTFT "
        "in ms; prompt and cached tokens: sums of `usage.prompt_tokens` and "
        "`usage.prompt_tokens_details.cached_tokens`; computed: mlxserve's "
        "`prompt_tokens_computed` counter over the phase.",
        "",
        "| phase | server | TTFT p50 | TTFT p99 | wall s | prompt tok | cached tok "
        "| computed tok | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for ph in ("cold", "warm"):
        for name in SERVERS:
            s = servers.get(name, {}).get(ph)
            if s:
                lines.append(
                    f"| {ph} | {name} | {_f(s['ttft_p50'], 1e3, 0)} | "
                    f"{_f(s['ttft_p99'], 1e3, 0)} | {s['wall_s']:.1f} | {s['prompt_tokens']} | "
                    f"{_n(s['cached_tokens'])} | {_n(s.get('computed_tokens'))} | "
                    f"{s['errors']}/{s['requests']} |"
                )
    lines += [
        "",
        f"**Multi-turn**: {m['conversations']} conversations x {m['turns']} turns with their "
        f"own system prompt ({m['multi_system_tokens']} tokens). Turn k of every "
        "conversation is sent at once, with the whole conversation so far (the assistant "
        "texts that server returned); turn k+1 after all turn-k answers.",
        "",
        "| turn | server | TTFT p50 | TTFT p99 | wall s | prompt tok | cached tok "
        "| computed tok | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t in range(m["turns"]):
        for name in SERVERS:
            turns = servers.get(name, {}).get("turns") or []
            if t < len(turns):
                s = turns[t]
                lines.append(
                    f"| {t + 1} | {name} | {_f(s['ttft_p50'], 1e3, 0)} | "
                    f"{_f(s['ttft_p99'], 1e3, 0)} | {s['wall_s']:.1f} | {s['prompt_tokens']} | "
                    f"{_n(s['cached_tokens'])} | {_n(s.get('computed_tokens'))} | "
                    f"{s['errors']}/{s['requests']} |"
                )
    for name in SERVERS:
        s = servers.get(name, {}).get("multi")
        if s:
            computed = s["computed_tokens"] if name != PEER else None
            lines.append(
                f"| **all** | {name} | | | {s['wall_s']:.1f} | {s['prompt_tokens']} | "
                f"{_n(s['cached_tokens'])} | {_n(computed)} | {s['errors']} errors |"
            )
    lines += ["", "| target | measured | met |", "|---|---|---|"]
    for label, got, met in targets(res):
        lines.append(f"| {label} | {got} | {'-' if met is None else 'yes' if met else 'NO'} |")
    notes = [
        "mlx_lm.server exposes no computed-prompt-tokens counter; its `cached_tokens` is the "
        "prefix its LRU prompt cache supplied (10 entries by default).",
        f"mlxserve: `{m.get('ours_cmd', '?')}`; mlx_lm.server: `{m.get('peer_cmd', '?')}`.",
    ]
    for name in SERVERS:
        if err := servers.get(name, {}).get("error"):
            notes.append(f"{name} did not run: {err}")
    lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    """The prefix_bench argument parser."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=Path("/tmp/smollm2-mlx"))
    p.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--multi-system-tokens", type=int, default=500)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-cap", type=float, default=600.0, help="wall-clock cap per phase (s)")
    p.add_argument("--start-timeout", type=float, default=180.0)
    p.add_argument("--port", type=int, default=0, help="server port (0: a free one)")
    p.add_argument("--max-running-requests", type=int, default=32)
    p.add_argument("--max-total-tokens", type=int, default=32768, help="mlxserve's KV pool")
    p.add_argument("--prompt-concurrency", type=int, default=32)
    p.add_argument("--peer-dequantize", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--quick", action="store_true", help="smoke run: 4 users, 2x2 turns, short")
    p.add_argument("--json", type=Path, help="raw results (default bench/results/prefix_bench*)")
    p.add_argument("--markdown", action="store_true", help="print the markdown section")
    p.add_argument("--render", type=Path, help="print the section of a saved JSON; no run")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run both servers' workloads, write the JSON, print the summary (and markdown)."""
    args = build_parser().parse_args(argv)
    if args.render:
        print(markdown(json.loads(args.render.read_text())), end="")
        return 0
    if args.quick:
        args.system_tokens, args.multi_system_tokens, args.users = 300, 150, 4
        args.conversations, args.turns, args.max_tokens = 2, 2, 8
        args.time_cap = min(args.time_cap, 300.0)
    results_dir = compare.ROOT / "bench" / "results"
    args.json = args.json or results_dir / f"prefix_bench{'_quick' if args.quick else ''}.json"
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.model = args.model.resolve()
    compare.ensure_model(args.model)
    sys_a, n_a = system_prompt(args.model, args.seed, args.system_tokens)
    sys_b, n_b = system_prompt(args.model, args.seed + 1, args.multi_system_tokens)
    port = args.port or compare.free_port()
    args.peers = [PEER]  # compare.server_commands' peers: the target is mlx_lm.server's
    cmds = compare.server_commands(args, port)
    cmds[NOCACHE] = [*cmds[OURS], "--disable-prefix-cache"]
    t0 = time.monotonic()
    meta = {
        "command": shlex.join([".venv/bin/python", "-m", "bench.prefix_bench", *sys.argv[1:]]),
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "machine": compare.machine(),
        "load_before": compare.load_avg(),
        "versions": ", ".join(f"{k} {v}" for k, v in _env.mlx_versions().items())
        + f", Python {platform.python_version()}, mlxserve {compare.git_rev()}",
        "model": str(args.model),
        "system_tokens": n_a,
        "multi_system_tokens": n_b,
        "ours_cmd": shlex.join(cmds[OURS]),
        "peer_cmd": shlex.join(cmds[PEER]),
    } | {k: getattr(args, k) for k in ("users", "conversations", "turns", "max_tokens", "seed")}
    res: dict[str, Any] = {"meta": meta, "servers": {}}
    print(f"[prefix_bench] system prompts: {n_a} and {n_b} tokens", flush=True)
    try:
        for name in SERVERS:
            if name in args.servers:
                (LOGS / f"prefix-{name}.log").unlink(missing_ok=True)
                res["servers"][name] = run_server(name, cmds[name], port, args, sys_a, sys_b)
    finally:
        meta["load_after"] = compare.load_avg()
        meta["elapsed_min"] = (time.monotonic() - t0) / 60
        args.json.write_text(json.dumps(res, indent=2) + "\n")
        print(f"[prefix_bench] wrote {args.json}")
    for label, got, met in targets(res):
        print(f"[prefix_bench] target: {label}: {got} ({'-' if met is None else met})")
    if args.markdown:
        print(markdown(res), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
