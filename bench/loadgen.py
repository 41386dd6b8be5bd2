"""Async load generator for OpenAI-compatible servers: streaming chat completions, a sweep.

For each concurrency level, ``concurrency`` workers send greedy (temperature 0) streaming chat
completions with a fixed ``max_tokens`` and prompts of mixed lengths from
:mod:`bench.corpus`, until the level's request count is reached or its wall-clock cap passes.
Per level it reports the aggregate output tok/s, TTFT and inter-token latency (ITL)
percentiles, errors, and the *steady decode rate*: the tokens the first wave of
``concurrency`` requests received while all of them were decoding (after the last one's
first token, before the first one finished) divided by that window, i.e. the server's pure
decode rate at batch ``concurrency``.

Output tokens are the ``usage.completion_tokens`` of the last stream chunk
(``stream_options.include_usage``); when a server sends no usage, content chunks are counted.

Example::

    .venv/bin/python -m bench.loadgen --base-url http://127.0.0.1:8000/v1 --model default_model \
        --concurrency 1 4 16 32 --max-tokens 64 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.corpus import make_prompts


@dataclass
class RequestResult:
    """What one streamed request produced.

    Attributes:
        start: send time (``time.perf_counter``).
        end: time the stream ended (or failed).
        chunk_times: arrival time of each chunk carrying content.
        output_tokens: ``usage.completion_tokens``, or the content chunk count without usage.
        usage_reported: the server sent a usage chunk.
        error: None on success, else a one-line description.
        text: the content received, concatenated.
        prompt_tokens: ``usage.prompt_tokens``, if reported.
        cached_tokens: ``usage.prompt_tokens_details.cached_tokens``, if reported.
    """

    start: float
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    usage_reported: bool = False
    error: str | None = None
    text: str = ""
    prompt_tokens: int | None = None
    cached_tokens: int | None = None

    @property
    def ttft(self) -> float | None:
        """Seconds from send to the first content chunk."""
        return self.chunk_times[0] - self.start if self.chunk_times else None


@dataclass
class LevelStats:
    """The summary of one concurrency level (times in seconds, rates in tokens per second)."""

    concurrency: int
    requests: int
    completed: int
    errors: int
    wall_s: float
    output_tokens: int
    output_tok_s: float
    ttft_p50: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    steady_decode_tok_s: float | None
    steady_window_s: float | None
    usage_reported: bool
    mean_output_tokens: float
    error_samples: list[str]


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


async def one_request(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompt: str | list[dict[str, str]],
    max_tokens: int,
) -> RequestResult:
    """Send one streaming chat completion and time its chunks.

    ``prompt``: the user message, or the whole ``messages`` list.
    """
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult(start=time.perf_counter())
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                if chunk.get("error"):
                    result.error = f"stream error: {str(chunk['error'])[:200]}"
                    return result
                for choice in chunk.get("choices") or []:
                    if content := (choice.get("delta") or {}).get("content"):
                        result.chunk_times.append(now)
                        result.text += content
                        break
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    result.output_tokens = int(usage["completion_tokens"])
                    result.usage_reported = True
                    result.prompt_tokens = usage.get("prompt_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens")
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"[:200]
    finally:
        result.end = time.perf_counter()
        if not result.usage_reported:
            result.output_tokens = len(result.chunk_times)
    return result


def _steady_decode(results: list[RequestResult], concurrency: int) -> tuple[float, float] | None:
    """Tokens/s of the first wave while all ``concurrency`` requests were decoding."""
    wave = [r for r in results[:concurrency] if r.error is None and r.chunk_times]
    if len(wave) < concurrency:
        return None
    lo = max(r.chunk_times[0] for r in wave)
    hi = min(r.chunk_times[-1] for r in wave)
    if hi - lo <= 0:
        return None
    # Chunks after the last first-token, up to and including the first last-chunk.
    n = sum(sum(1 for t in r.chunk_times if lo < t <= hi) for r in wave)
    return n / (hi - lo), hi - lo


def summarize(results: list[RequestResult], concurrency: int, wall_s: float) -> LevelStats:
    """Aggregate one level's request results (``results`` in send order)."""
    ok = [r for r in results if r.error is None]
    ttfts = [t for r in ok if (t := r.ttft) is not None]
    itls = [float(d) for r in ok for d in np.diff(r.chunk_times)]
    tokens = sum(r.output_tokens for r in results)
    steady = _steady_decode(results, concurrency)
    return LevelStats(
        concurrency=concurrency,
        requests=len(results),
        completed=len(ok),
        errors=len(results) - len(ok),
        wall_s=wall_s,
        output_tokens=tokens,
        output_tok_s=tokens / wall_s if wall_s > 0 else 0.0,
        ttft_p50=_pct(ttfts, 50),
        ttft_p99=_pct(ttfts, 99),
        itl_p50=_pct(itls, 50),
        itl_p99=_pct(itls, 99),
        steady_decode_tok_s=steady[0] if steady else None,
        steady_window_s=steady[1] if steady else None,
        usage_reported=bool(ok) and all(r.usage_reported for r in ok),
        mean_output_tokens=float(np.mean([r.output_tokens for r in ok])) if ok else 0.0,
        error_samples=sorted({r.error for r in results if r.error})[:3],
    )


async def run_level(
    base_url: str,
    model: str,
    concurrency: int,
    num_requests: int,
    max_tokens: int,
    seed: int,
    time_cap_s: float,
    prompt_start: int = 0,
    request_timeout_s: float = 600.0,
) -> LevelStats:
    """Run one concurrency level and summarize it.

    Args:
        base_url: the server's OpenAI base URL (ending in ``/v1``).
        model: the ``model`` field to send.
        concurrency: requests in flight at once (one worker each).
        num_requests: requests to send in total.
        max_tokens: ``max_tokens`` of every request.
        seed: corpus seed.
        time_cap_s: wall-clock cap: no request starts after it, and any still running at
            the cap plus a grace of ``time_cap_s / 4`` is cancelled and counted as an error.
        prompt_start: index of the first corpus prompt (keeps levels' prompts distinct).
        request_timeout_s: per-request HTTP timeout.

    Returns:
        The level's :class:`LevelStats`.
    """
    url = base_url.rstrip("/") + "/chat/completions"
    prompts = make_prompts(seed, num_requests, start=prompt_start)
    results: list[RequestResult | None] = [None] * num_requests
    next_index = 0
    start = time.perf_counter()
    deadline = start + time_cap_s
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(request_timeout_s, connect=30.0)

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

        async def worker() -> None:
            nonlocal next_index
            while next_index < num_requests and time.perf_counter() < deadline:
                i = next_index
                next_index += 1
                results[i] = RequestResult(start=time.perf_counter(), error="cancelled at cap")
                results[i] = await one_request(client, url, model, prompts[i], max_tokens)

        tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
        _, pending = await asyncio.wait(tasks, timeout=time_cap_s * 1.25)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    end = max([r.end for r in results if r is not None and r.end] or [time.perf_counter()])
    for r in results:
        if r is not None and not r.end:
            r.end = end  # a cancelled request: its start time stays, its error says why
    sent = [r for r in results if r is not None]
    return summarize(sent, concurrency, end - start)


async def wait_ready(base_url: str, timeout_s: float) -> bool:
    """Poll ``GET /health`` until the server answers 200 or ``timeout_s`` passes.

    Not ``/v1/models``: mlx_lm.server 0.32.2 drops that connection when the Hugging Face cache
    directory does not exist (``CacheNotFound`` in its handler).
    """
    health = base_url.rstrip("/").removesuffix("/v1") + "/health"
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=5.0) as client:
        while time.monotonic() < deadline:
            try:
                if (await client.get(health)).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
    return False


async def warmup(base_url: str, model: str, max_tokens: int = 8) -> RequestResult:
    """One short unmeasured request (first-call costs: kernels, allocations)."""
    url = base_url.rstrip("/") + "/chat/completions"
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        return await one_request(client, url, model, "Say hello.", max_tokens)


def requests_for(concurrency: int, per_level: float, minimum: int) -> int:
    """Requests for one level: ``per_level`` x concurrency, at least ``minimum``."""
    return max(minimum, int(round(per_level * concurrency)))


def _fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def format_table(levels: list[LevelStats]) -> str:
    """A fixed-width text table of the levels (latencies in ms)."""
    head = (
        f"{'conc':>5} {'reqs':>5} {'err':>4} {'tok/s':>8} {'decode':>8} {'ttft50':>8} "
        f"{'ttft99':>8} {'itl50':>7} {'itl99':>7} {'out/req':>7} {'wall':>6}"
    )
    rows = [head]
    for s in levels:
        rows.append(
            f"{s.concurrency:>5} {s.requests:>5} {s.errors:>4} {s.output_tok_s:>8.1f} "
            f"{_fmt(s.steady_decode_tok_s):>8} {_fmt(s.ttft_p50, 1e3, 0):>8} "
            f"{_fmt(s.ttft_p99, 1e3, 0):>8} {_fmt(s.itl_p50, 1e3, 0):>7} "
            f"{_fmt(s.itl_p99, 1e3, 0):>7} {s.mean_output_tokens:>7.1f} {s.wall_s:>6.1f}"
        )
    return "\n".join(rows)


async def sweep(args: argparse.Namespace) -> list[LevelStats]:
    """Warm up, then run every level of ``args.concurrency`` in order."""
    if not await wait_ready(args.base_url, args.ready_timeout):
        raise SystemExit(f"loadgen: {args.base_url} did not answer within {args.ready_timeout}s")
    if args.warmup:
        await warmup(args.base_url, args.model)
    levels = []
    for i, c in enumerate(args.concurrency):
        n = requests_for(c, args.requests_per_level, args.min_requests)
        stats = await run_level(
            args.base_url,
            args.model,
            c,
            n,
            args.max_tokens,
            args.seed,
            args.time_cap,
            prompt_start=args.prompt_start + 1000 * i,
        )
        levels.append(stats)
        print(format_table([stats]).splitlines()[-1], file=sys.stderr, flush=True)
    return levels


def build_parser() -> argparse.ArgumentParser:
    """The loadgen argument parser."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="OpenAI base URL")
    p.add_argument("--model", default="default_model", help="model field sent in requests")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request")
    p.add_argument(
        "--requests-per-level", type=float, default=2.0, help="requests = this x concurrency"
    )
    p.add_argument("--min-requests", type=int, default=4, help="at least this many per level")
    p.add_argument("--time-cap", type=float, default=300.0, help="wall-clock cap per level (s)")
    p.add_argument("--seed", type=int, default=0, help="prompt corpus seed")
    p.add_argument("--prompt-start", type=int, default=0, help="first corpus index")
    p.add_argument("--ready-timeout", type=float, default=120.0, help="wait for the server (s)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the warmup")
    p.add_argument("--json", type=Path, help="write the per-level results here")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the sweep, print the table, optionally write JSON."""
    args = build_parser().parse_args(argv)
    levels = asyncio.run(sweep(args))
    print(format_table(levels))
    if args.json:
        args.json.write_text(json.dumps([asdict(s) for s in levels], indent=2) + "\n")
    return 0 if all(s.errors == 0 for s in levels) else 1


if __name__ == "__main__":
    sys.exit(main())
