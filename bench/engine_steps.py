"""mlxserve's engine without HTTP: the time of each forward, by phase and batch size.

Loads the model as mlxserve does, starts its ``Engine``, submits ``requests``
greedy corpus prompts at once and times every ``executor.forward`` call (the engine's
overlapped decode steps are off here, ``overlap`` off: an overlapped step's time is
not one forward's). The median decode
step at the full batch, set against :mod:`bench.forward_ceiling`, says how much of the gap
to the ceiling is the engine's (slot-pool gathers, masks, sampling, scheduling) rather than
the HTTP layer's. With ``--equal-prompt-tokens N`` the prompts are the ceiling's own (``N``
random token ids per row, from the same generator, decoded with ``ignore_eos``): the step
then differs from the ceiling's only by the engine, while the corpus's prompts of mixed
lengths also make every decode step attend over the longest row's context. With
``--long-prompt-tokens N`` the first corpus prompt is replaced by ``N`` random token ids:
one long conversation among short chats, the case decode row groups exist for. Example::

    .venv/bin/python -m bench.engine_steps --model /tmp/smollm2-mlx --requests 32 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _env  # noqa: E402  (no mlx import: must precede mlx.core)


def run(
    model_spec: str | None,
    requests: int,
    max_tokens: int,
    seed: int,
    timeout_s: float,
    equal_prompt_tokens: int | None = None,
    long_prompt_tokens: int | None = None,
    float32_weights: bool = False,
    long_steps: int | None = None,
) -> dict[str, Any]:
    """Serve ``requests`` prompts through the engine and summarize its forward times
    (corpus prompts, the first one ``long_prompt_tokens`` long if given, or the ceiling's
    ``equal_prompt_tokens``-token ones). With ``long_steps``, the long request is aborted
    after that many full-batch decode steps and the others (``ignore_eos``) go on without
    it: both step times come from one run, minutes apart, not from two runs."""
    notes = [_env.enable_blas()]
    import numpy as np

    from bench.corpus import chat_ids, make_prompts
    from bench.forward_ceiling import prompt_ids as ceiling_prompt_ids
    from mlxserve.mlx_backend.loading.loader import load_model
    from mlxserve.scheduler.config import EngineConfig
    from mlxserve.scheduler.row_groups import padded_area
    from mlxserve.scheduler.sampling_params import SamplingParams
    from mlxserve.server.lifecycle.engines import build_engine

    loaded = load_model(model_spec)
    if float32_weights:
        notes.append(_env.dequantize(loaded.model))
    else:
        notes.append(f"weights: {_env.serving_conversion(loaded)}")
    config = EngineConfig(max_total_tokens=32768, max_running_requests=requests, overlap="off")
    engine = build_engine(loaded, config)
    engine.start()
    # phase, rows, tokens fed, positions computed, forwards, seconds
    steps: list[tuple[str, int, int, int, int, float]] = []
    forward = engine.executor.forward

    def timed_forward(batch: Any) -> Any:
        start = time.perf_counter()
        out = forward(batch)
        if long_steps and batch.phase == "decode" and batch.batch_size == requests:
            full_steps[0] += 1
            if full_steps[0] == long_steps:
                engine.abort("r0")
        groups = list(batch.row_groups) or [np.arange(batch.batch_size)]
        computed = padded_area(batch.extend_lens, groups)
        if batch.phase == "prefill" and getattr(engine.executor, "packs_prefill", False):
            computed = batch.num_tokens  # one forward of one-token rows: nothing padded
        steps.append(
            (
                batch.phase,
                batch.batch_size,
                batch.num_tokens,
                computed,
                len(groups),
                time.perf_counter() - start,
            )
        )
        return out

    full_steps = [0]
    engine.executor.forward = timed_forward
    done = threading.Event()
    left = [requests]
    lock = threading.Lock()

    def on_output(event: Any) -> None:
        if event.finished:
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set()

    if equal_prompt_tokens:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        prompts = ceiling_prompt_ids(requests, equal_prompt_tokens, engine.vocab_size)
    else:
        # With long_steps the chats must outlive the long request: none stops at EOS.
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=bool(long_steps))
        prompts = [chat_ids(loaded.tokenizer, p) for p in make_prompts(seed, requests)]
        if long_prompt_tokens:
            prompts[0] = ceiling_prompt_ids(1, long_prompt_tokens, engine.vocab_size)[0]
    start = time.perf_counter()
    try:
        for i, ids in enumerate(prompts):
            engine.add_request(f"r{i}", ids, params, on_output)
        finished = done.wait(timeout_s)
    finally:
        engine.shutdown()
    wall = time.perf_counter() - start
    prefill = [s for s in steps if s[0] == "prefill"]
    full_at = [i for i, s in enumerate(steps) if s[0] == "decode" and s[1] == requests]
    full = [steps[i][5] for i in full_at]
    median = statistics.median(full) if full else None
    # Steps of the others alone after the long request left (after the last full step)
    tail = steps[full_at[-1] + 1 :] if full_at else []
    alone = [s[5] for s in tail if s[0] == "decode" and s[1] == requests - 1]
    return {
        "notes": notes,
        "finished": finished,
        "prompts": _describe_prompts(equal_prompt_tokens, long_prompt_tokens),
        "requests": requests,
        "max_tokens": max_tokens,
        "wall_s": wall,
        "prefill_steps": len(prefill),
        "prefill_s": sum(s[5] for s in prefill),
        "prompt_tokens": sum(len(ids) for ids in prompts),
        "prefill_fed_tokens": sum(s[2] for s in prefill),
        "prefill_computed_positions": sum(s[3] for s in prefill),
        "prefill_forwards": sum(s[4] for s in prefill),
        "decode_steps": sum(1 for s in steps if s[0] == "decode"),
        "decode_s": sum(s[5] for s in steps if s[0] == "decode"),
        "full_batch_decode_steps": len(full),
        "full_batch_step_ms": None if median is None else median * 1e3,
        "full_batch_decode_tok_s": None if median is None else requests / median,
        **(_without_long(alone, median) if long_steps else {}),
    }


def _without_long(alone: list[float], median: float | None) -> dict[str, Any]:
    """The steps of the other rows once the long request left, and the ratio to them."""
    base = statistics.median(alone) if alone else None
    return {
        "without_long_steps": len(alone),
        "without_long_step_ms": None if base is None else base * 1e3,
        "with_long_over_without": None if base is None or median is None else median / base,
    }


def _describe_prompts(equal_prompt_tokens: int | None, long_prompt_tokens: int | None) -> str:
    if equal_prompt_tokens:
        return f"{equal_prompt_tokens} random tokens each"
    if long_prompt_tokens:
        return f"corpus, the first replaced by {long_prompt_tokens} random tokens"
    return "corpus"


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: prints (and optionally writes) the summary as JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model spec as for mlxserve (default: embedded)")
    p.add_argument("--requests", type=int, default=32, help="requests (and the batch size)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="give up after this (s)")
    p.add_argument(
        "--equal-prompt-tokens",
        type=int,
        default=None,
        help="use the forward ceiling's prompts of this many tokens instead of the corpus",
    )
    p.add_argument(
        "--long-prompt-tokens",
        type=int,
        default=None,
        help="replace the first corpus prompt by this many random token ids",
    )
    p.add_argument(
        "--float32-weights",
        action="store_true",
        help="dequantize a quantized model to float32 (what mlxserve did before the native "
        "quantized matmul) instead of converting it as mlxserve serves it",
    )
    p.add_argument(
        "--long-steps",
        type=int,
        default=None,
        help="with --long-prompt-tokens: abort the long request after this many full-batch "
        "decode steps and time the others' steps without it in the same run (every request "
        "ignores EOS; --max-tokens must outlast the long prompt's prefill)",
    )
    p.add_argument("--json", type=Path, help="write the summary here")
    args = p.parse_args(argv)
    if args.long_steps and not args.long_prompt_tokens:
        p.error("--long-steps needs --long-prompt-tokens (the request it aborts)")
    if args.long_steps and args.equal_prompt_tokens:
        p.error("--long-steps runs the corpus prompts, not --equal-prompt-tokens")
    result = run(
        args.model,
        args.requests,
        args.max_tokens,
        args.seed,
        args.timeout,
        args.equal_prompt_tokens,
        args.long_prompt_tokens,
        args.float32_weights,
        args.long_steps,
    )
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0 if result["finished"] else 1


if __name__ == "__main__":
    sys.exit(main())
