"""Speculative decoding (n-gram prompt lookup, a draft model) against plain decoding.

Two workloads through mlxserve's engine (no HTTP), greedy:

- ``copy``: rewrite a given ~300-token text with one change (each request its own text);
- ``chat``: the chat corpus (``bench/corpus.py``), open-ended answers.

For each workload and concurrency, the same requests run with ``--speculative-method off``
and each of ``--methods`` (``ngram``; ``draft``, whose draft model is the served model's
first ``--draft-layers`` layers) one right after the other, ``--repeats`` times interleaved
(so machine load hits all alike; the best run of each is reported), each on a fresh
engine. Reported: output tok/s over the wall time (prefill included) and their ratio,
engine steps, the time of the decode steps alone, a fit of a decode step's time to the
tokens it feeds (the cost the adaptive policy weighs), the acceptance rate per proposal
position, and whether the greedy tokens were identical. Example::

    .venv/bin/python -m bench.spec_decode --concurrency 1 4 16 --json bench/results/spec.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _env  # noqa: E402  (no mlx import: must precede mlx.core)
from bench.corpus import WORDS, chat_ids, make_prompts  # noqa: E402

SWAPS = (("river", "canal"), ("morning", "evening"), ("garden", "orchard"), ("stone", "brick"))


def copy_text(index: int, words: int = 210) -> str:
    """A deterministic plain-English text of about 300 tokens."""
    rng = random.Random(index)
    sentences = []
    while sum(len(s.split()) for s in sentences) < words:
        a, b, c, d = (rng.choice(WORDS) for _ in range(4))
        sentences.append(f"The {a} near the {b} was {c}, and every {d} in the river town knew it.")
    return " ".join(sentences)


def copy_prompt(index: int) -> str:
    old, new = SWAPS[index % len(SWAPS)]
    return (
        f"Rewrite the following text exactly as it is, changing only the word '{old}' to "
        f"'{new}' everywhere. Output only the rewritten text.\n\n{copy_text(index)}"
    )


def first_layers_draft(loaded: Any, layers: int) -> Any:
    """A draft model made of the served model's first ``layers`` decoder layers, its
    final norm and head (an early-exit "self-draft": the only smaller model with the same
    vocabulary on a machine without a model hub). Shares the served model's arrays."""
    import dataclasses

    from mlx.utils import tree_flatten

    model = loaded.model
    draft = type(model)(model.args)
    draft.model.layers = draft.model.layers[:layers]
    keep = [
        (name, w)
        for name, w in tree_flatten(model.parameters())
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers
    ]
    draft.load_weights(keep)
    return dataclasses.replace(loaded, model=draft, model_id=f"first-{layers}-layers")


def run_one(
    loaded: Any,
    prompts: list[list[int]],
    concurrency: int,
    method: str,
    max_tokens: int,
    k: int,
    draft: Any = None,
) -> dict[str, Any]:
    """Serve ``prompts`` at most ``concurrency`` at a time on a fresh engine."""
    import numpy as np

    from mlxserve.scheduler.config import EngineConfig
    from mlxserve.scheduler.sampling_params import SamplingParams
    from mlxserve.server.lifecycle.engines import build_engine

    config = EngineConfig(
        max_total_tokens=32768,
        max_running_requests=max(concurrency, 1),
        speculative_method=method,
        num_speculative_tokens=k,
        draft_model=draft.model_id if method == "draft" else None,
    )
    engine = build_engine(loaded, config, draft=draft if method == "draft" else None)
    engine.start()
    steps: list[tuple[str, int, int, bool, float]] = []
    forward = engine.executor.forward

    def timed_forward(batch: Any) -> Any:
        start = time.perf_counter()
        out = forward(batch)
        spec = batch.spec_lens is not None
        steps.append(
            (batch.phase, batch.batch_size, batch.num_tokens, spec, time.perf_counter() - start)
        )
        return out

    engine.executor.forward = timed_forward
    tokens: dict[str, list[int]] = {}
    slots = threading.Semaphore(concurrency)
    done = threading.Event()
    left = [len(prompts)]
    lock = threading.Lock()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)

    def callback(rid: str):
        def on_output(event: Any) -> None:
            tokens[rid].extend(event.new_token_ids)
            if event.finished:
                slots.release()
                with lock:
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()

        return on_output

    start = time.perf_counter()
    try:
        for i, ids in enumerate(prompts):
            slots.acquire()
            tokens[str(i)] = []
            engine.add_request(str(i), ids, params, callback(str(i)))
        done.wait(3600)
        wall = time.perf_counter() - start
        stats = engine.stats()
        spec = engine.scheduler.speculator
        overhead = spec.cost.overhead_tokens if spec is not None else None
    finally:
        engine.shutdown()
    output = sum(len(t) for t in tokens.values())
    decode = [s for s in steps if s[0] == "decode"]
    plain = [s[4] for s in decode if not s[3]]
    with_drafts = [s[4] for s in decode if s[3]]
    fit = None
    if len({s[2] for s in decode}) > 2:
        b, a = np.polyfit([s[2] for s in decode], [s[4] for s in decode], 1)
        fit = {"fixed_ms": a * 1e3, "per_token_ms": b * 1e3}
    return {
        "method": method,
        "output_tokens": output,
        "wall_s": wall,
        "output_tok_s": output / wall,
        "engine_steps": len(steps),
        "decode_steps": len(decode),
        "decode_steps_with_proposals": sum(1 for s in decode if s[3]),
        "decode_s": sum(s[4] for s in decode),
        "decode_tokens_fed": sum(s[2] for s in decode),
        "median_plain_decode_step_ms": statistics.median(plain) * 1e3 if plain else None,
        "median_decode_step_with_proposals_ms": (
            statistics.median(with_drafts) * 1e3 if with_drafts else None
        ),
        "decode_step_fit": fit,
        "policy_overhead_tokens": overhead,
        "drafts": stats.spec_num_drafts,
        "draft_tokens": stats.spec_num_draft_tokens,
        "accepted_tokens": stats.spec_num_accepted_tokens,
        "acceptance_per_pos": [
            round(n / stats.spec_num_drafts, 3) if stats.spec_num_drafts else 0.0
            for n in stats.spec_accepted_per_pos
        ],
        "tokens": tokens,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model spec as for mlxserve (default: embedded)")
    p.add_argument("--workloads", nargs="+", default=["copy", "chat"], choices=["copy", "chat"])
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16])
    p.add_argument("--copy-max-tokens", type=int, default=160)
    p.add_argument("--chat-max-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=3, help="--num-speculative-tokens")
    p.add_argument(
        "--methods", nargs="+", default=["off", "ngram"], choices=["off", "ngram", "draft"]
    )
    p.add_argument(
        "--draft-layers",
        type=int,
        default=8,
        help="the draft method's model: the served model's first N layers",
    )
    p.add_argument(
        "--repeats", type=int, default=2, help="runs of each method per cell (the best of each)"
    )
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    notes = [_env.enable_blas()]
    from mlxserve.mlx_backend.loading.loader import load_model

    loaded = load_model(args.model)
    notes.append(_env.dequantize(loaded.model))
    methods = ["off"] + [m for m in args.methods if m != "off"]
    draft = first_layers_draft(loaded, args.draft_layers) if "draft" in methods else None
    results = []
    for workload in args.workloads:
        for c in args.concurrency:
            n = max(2, c)
            if workload == "copy":
                texts, max_tokens = [copy_prompt(i) for i in range(n)], args.copy_max_tokens
            else:
                texts, max_tokens = make_prompts(0, n), args.chat_max_tokens
            prompts = [chat_ids(loaded.tokenizer, t) for t in texts]
            runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
            for _ in range(args.repeats):  # interleaved: load changes hit both alike
                for method in runs:
                    runs[method].append(
                        run_one(loaded, prompts, c, method, max_tokens, args.k, draft)
                    )
            best = {m: max(runs[m], key=lambda r: r["output_tok_s"]) for m in runs}
            off = best["off"]
            row = {
                "workload": workload,
                "concurrency": c,
                "requests": n,
                "mean_prompt_tokens": sum(map(len, prompts)) / n,
                "max_tokens": max_tokens,
                "speedup": {m: best[m]["output_tok_s"] / off["output_tok_s"] for m in best},
                "decode_speedup": {m: off["decode_s"] / best[m]["decode_s"] for m in best},
                "all_tok_s": {m: [round(r["output_tok_s"], 2) for r in runs[m]] for m in runs},
                "identical_tokens": all(
                    r["tokens"] == runs["off"][0]["tokens"] for m in runs for r in runs[m]
                ),
            }
            row |= {m: {k: v for k, v in best[m].items() if k != "tokens"} for m in best}
            results.append(row)
            print(json.dumps({k: v for k, v in row.items()}, indent=None), flush=True)
    out = {"notes": notes, "k": args.k, "methods": methods, "results": results}
    if draft is not None:
        out["draft"] = draft.model_id
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
