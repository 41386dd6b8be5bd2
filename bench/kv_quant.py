"""Quantized KV pools (``--kv-bits``) against the float pool, side by side in one run.

Parts (``--parts`` picks some), each comparing off / 8-bit / 4-bit (group size 64):

- ``slots``: token slots the memory planner gives each pool for the same budget
  (``--budget-mib``), for float32 K/V (the CPU) and float16 (what Metal runs).
- ``speed``: the corpus's chat prompts decoded greedily at batch ``--requests`` for
  ``--max-tokens`` tokens through the engine (no HTTP), every batch run through one
  executor per pool and attention path in turn (``FanOutExecutor``): the median
  full-batch decode step, and per step the float pool's time over each one's (tok/s
  relative to float, paired step by step so a neighbour's load hits all alike).
- ``quality``: the same prompts per pool on the backend's default attention path: the
  share of greedy tokens equal to the float pool's (per position, and the mean common
  prefix as a share of ``--max-tokens``).
- ``long``: how many ``--long-prompt-tokens``-token requests decode at once in a fixed
  budget (``--long-budget-mib``): the widest decode batch the engine reached, with one
  request more than the slots hold.
- ``mlx_lm_quality``: the same agreement for mlx-lm itself (each prompt alone, float cache
  against a ``QuantizedKVCache`` per layer from the first token).
- ``loglik``: mean log-likelihood per token of a fixed text, read through
  ``/v1/completions`` with ``echo`` and ``logprobs`` from a served model.

Example::

    .venv/bin/python -m bench.kv_quant --json bench/results/kv_quant.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _env  # noqa: E402  (no mlx import: must precede mlx.core)
from bench.fanout_executor import FanOutExecutor  # noqa: E402
from bench.kv_quant_common import (  # noqa: E402
    BITS,
    GROUP_SIZE,
    corpus,
    make_engine,
    pool_name,
    quant,
    serve,
)
from bench.kv_quant_quality import loglik, mlx_lm_quality, quality  # noqa: E402
from bench.kv_quant_report import write_docs  # noqa: E402


def slots(layout: Any, budget_bytes: int) -> dict[str, Any]:
    """Full-attention slots per pool at ``budget_bytes``; the float16 pool (what Metal
    runs) is computed from the same shapes."""
    import dataclasses

    import mlx.core as mx

    from mlxserve.mlx_backend.kv.layer_layout import LayerLayout
    from mlxserve.mlx_backend.memory import plan_memory

    def plan(layout: LayerLayout, bits: int | None) -> int:
        return plan_memory(
            layout, 0, 1, 1, 1.0, 10**9, quantization=quant(bits), memory_bytes=budget_bytes
        ).full_tokens

    half = LayerLayout(
        [
            dataclasses.replace(s, kv=dataclasses.replace(s.kv, dtype=mx.float16))
            for s in layout.specs
        ]
    )
    out: dict[str, Any] = {"budget_mib": budget_bytes / 2**20, "pools": {}}
    for bits in BITS:
        out["pools"][pool_name(bits)] = {
            "bytes_per_token": layout.bytes_per_token("full", quant(bits)),
            "slots": plan(layout, bits),
            "float16_slots": plan(half, bits),
        }
    base, base16 = out["pools"]["off"]["slots"], out["pools"]["off"]["float16_slots"]
    for pool in out["pools"].values():
        pool["x_float32"] = pool["slots"] / base
        pool["x_float16"] = pool["float16_slots"] / base16
    return out


def speed(
    loaded: Any,
    requests: int,
    max_tokens: int,
    timeout_s: float,
    paths: tuple[str, ...] = ("folded", "dequantize", "quantized-sdpa"),
) -> dict:
    """Step times of the float pool and of every quantized pool and attention path of
    ``paths`` over the same batches (each step runs every configuration)."""
    from mlxserve.scheduler.config import EngineConfig
    from mlxserve.scheduler.engine import Engine
    from mlxserve.scheduler.sampling_params import SamplingParams

    configs = [(None, None)] + [(b, p) for b in (8, 4) for p in paths]
    fan = FanOutExecutor(loaded, configs, GROUP_SIZE)
    slots = requests * 512
    engine = Engine(
        fan,
        EngineConfig(max_total_tokens=slots, max_running_requests=requests),
        context_length=loaded.context_length,
        tokenizer=loaded.tokenizer,
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    res = serve(engine, corpus(loaded, requests), params, timeout_s)
    full = [t for phase, rows, t in fan.steps if phase == "decode" and rows == requests]
    prefill = [t for phase, _, t in fan.steps if phase == "prefill"]
    out: dict[str, Any] = {
        "finished": res["finished"],
        "requests": requests,
        "max_tokens": max_tokens,
        "full_batch_decode_steps": len(full),
        "configs": {},
    }
    for i, (bits, path) in enumerate(configs):
        step = statistics.median(t[i] for t in full)
        out["configs"][pool_name(bits, path)] = {
            "decode_step_ms": step * 1e3,
            "decode_tok_s": requests / step,
            # Per step, the float pool's time over this one's: tok/s relative to float.
            "x_off_tok_s": statistics.median(t[0] / t[i] for t in full),
            "prefill_s": sum(t[i] for t in prefill),
            # What served attention (the native op or a quantized path), as logged.
            "attention": fan.executors[i].attention.path,
        }
    return out


def long_context(
    loaded: Any, budget_bytes: int, prompt_tokens: int, max_tokens: int, timeout_s: float
) -> dict:
    """The most ``prompt_tokens``-token requests decoding at once in ``budget_bytes``."""
    from bench.forward_ceiling import prompt_ids
    from mlxserve.mlx_backend.kv.layer_layout import probe_layout
    from mlxserve.mlx_backend.logits import vocab_size
    from mlxserve.mlx_backend.memory import plan_memory
    from mlxserve.scheduler.sampling_params import SamplingParams

    layout = probe_layout(loaded.model)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out: dict[str, Any] = {
        "budget_mib": budget_bytes / 2**20,
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "pools": {},
    }
    for bits in BITS:
        slots = plan_memory(
            layout, 0, 1, 1, 1.0, 10**9, quantization=quant(bits), memory_bytes=budget_bytes
        ).full_tokens
        # One request more than the slots could hold, so the last one must wait.
        fits = slots // (prompt_tokens + max_tokens)
        n = fits + 1
        prompts = prompt_ids(n, prompt_tokens, vocab_size(loaded.model))
        engine = make_engine(loaded, bits, None, max_total_tokens=slots, max_running_requests=n)
        start = time.perf_counter()
        res = serve(engine, prompts, params, timeout_s)
        widest = max((s[1] for s in res["steps"] if s[0] == "decode"), default=0)
        out["pools"][pool_name(bits)] = {
            "slots": slots,
            "requests": n,
            "finished": res["finished"],
            "max_concurrent": widest,
            "wall_s": time.perf_counter() - start,
        }
        print(f"long {pool_name(bits)}: {slots} slots, {widest} at once", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: prints (and optionally writes) the results as JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model spec as for mlxserve (default: embedded)")
    p.add_argument("--parts", default="slots,speed,quality,loglik,long")
    p.add_argument("--budget-mib", type=float, default=1024.0, help="budget of the slots part")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument(
        "--paths",
        default="folded,dequantize,quantized-sdpa",
        help="quantized attention paths the speed part compares with the float pool",
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--long-budget-mib", type=float, default=192.0)
    p.add_argument("--long-prompt-tokens", type=int, default=4000)
    p.add_argument("--long-max-tokens", type=int, default=48)
    p.add_argument("--timeout", type=float, default=3600.0, help="per part")
    p.add_argument("--json", type=Path, help="write the results here, after every part")
    p.add_argument("--merge", action="store_true", help="keep the other parts of --json")
    p.add_argument("--docs", type=Path, help="write the results' section into this markdown")
    p.add_argument("--from-json", type=Path, help="render --docs from saved results; run nothing")
    args = p.parse_args(argv)
    if args.from_json:
        write_docs(json.loads(args.from_json.read_text()), args.docs)
        return 0
    notes = [_env.enable_blas()]
    from mlxserve.mlx_backend.kv.layer_layout import probe_layout
    from mlxserve.mlx_backend.loading.loader import load_model

    loaded = load_model(args.model)
    notes.append(_env.dequantize(loaded.model))
    result: dict[str, Any] = {}
    if args.merge and args.json and args.json.is_file():
        result = json.loads(args.json.read_text())
    result.update(notes=notes, group_size=GROUP_SIZE, versions=_env.mlx_versions())
    command = ".venv/bin/python -m bench.kv_quant " + " ".join(argv or sys.argv[1:])
    runs = {
        "slots": lambda: slots(probe_layout(loaded.model), int(args.budget_mib * 2**20)),
        "speed": lambda: speed(
            loaded, args.requests, args.max_tokens, args.timeout, tuple(args.paths.split(","))
        ),
        "quality": lambda: quality(loaded, args.requests, args.max_tokens, args.timeout),
        "loglik": lambda: loglik(loaded),
        "mlx_lm_quality": lambda: mlx_lm_quality(loaded, args.requests, args.max_tokens),
        "long": lambda: long_context(
            loaded,
            int(args.long_budget_mib * 2**20),
            args.long_prompt_tokens,
            args.long_max_tokens,
            args.timeout,
        ),
    }
    for part in args.parts.split(","):
        before, start = _load(), time.time()
        result[part] = runs[part]()
        result[part]["run"] = {
            "command": command,
            "when": time.strftime("%Y-%m-%d %H:%M", time.localtime(start)),
            "minutes": round((time.time() - start) / 60, 1),
            "load_before": before,
            "load_after": _load(),
        }
        if args.json:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    if args.docs:
        write_docs(result, args.docs)
    return 0


def _load() -> str:
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


if __name__ == "__main__":
    sys.exit(main())
