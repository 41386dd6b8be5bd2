"""The "## Quantized KV" section of docs/benchmarks.md, rendered from
``bench/kv_quant.py``'s results (``--docs``, or ``--from-json`` to re-render)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

BITS = (None, 8, 4)


def _name(bits: int | None) -> str:
    return "off" if bits is None else f"{bits}-bit"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _text_tokens(result: dict[str, Any]) -> str:
    pools = result.get("loglik", {}).get("pools", {})
    return str(next(iter(pools.values()))["tokens"]) if pools else "?"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def _run(part: dict[str, Any]) -> str:
    run = part.get("run")
    if not run:
        return ""
    return (
        f"run {run['when']}, {run['minutes']} min, load average {run['load_before']} -> "
        f"{run['load_after']}"
    )


def markdown(result: dict[str, Any]) -> str:
    """The "## Quantized KV" section of docs/benchmarks.md from a results dict."""
    versions = ", ".join(f"{k} {v}" for k, v in result.get("versions", {}).items())
    commands = []
    for part in result.values():
        command = part.get("run", {}).get("command") if isinstance(part, dict) else None
        if command and command not in commands:
            commands.append(command)
    lines = [
        "## Quantized KV",
        "",
        " then ".join(f"`{c}`" for c in commands) + " (raw JSON in "
        f"`bench/results/kv_quant.json`). Linux x86_64, 2 cores; {versions}. SmolLM2-135M (30 "
        "layers, 3 K/V heads of 64, float32 K/V on the CPU), group size "
        f"{result.get('group_size')}. Other helpers' jobs shared the 2 CPUs throughout (the "
        "load averages below), so speed figures are ratios measured side by side in one run.",
        "",
    ]
    targets: list[tuple[str, str, bool]] = []
    if "slots" in result:
        sl = result["slots"]
        lines += [
            f"**Slots in the same budget** ({sl['budget_mib']:.0f} MiB, the memory planner; "
            f"{_run(sl)}):",
            "",
            "| pool | bytes/token | slots (float32 K/V) | vs float32 "
            "| slots (float16 K/V) | vs float16 |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for name, pool in sl["pools"].items():
            lines.append(
                f"| {name} | {pool['bytes_per_token']} | {pool['slots']} | {_x(pool['x_float32'])} "
                f"| {pool['float16_slots']} | {_x(pool['x_float16'])} |"
            )
        lines.append("")
        for name, t32, t16 in (("8-bit", 3.5, 1.8), ("4-bit", 6.0, 3.5)):
            pool = sl["pools"][name]
            targets.append(
                (
                    f"{name} slots >= {t32}x the float32 pool",
                    _x(pool["x_float32"]),
                    pool["x_float32"] >= t32,
                )
            )
            targets.append(
                (
                    f"{name} slots >= {t16}x the float16 pool (Metal)",
                    _x(pool["x_float16"]),
                    pool["x_float16"] >= t16,
                )
            )
    if "speed" in result:
        sp = result["speed"]
        lines += [
            f"**Decode at batch {sp['requests']}** (the corpus's chat prompts, greedy, "
            f"{sp['max_tokens']} tokens each; {sp['full_batch_decode_steps']} full-batch steps, "
            "each run through every pool and path in turn; 'vs off' is the median of the "
            f"per-step ratios; {_run(sp)}):",
            "",
            "| pool, attention path | decode step ms | tok/s | vs off | prefill s |",
            "|---|---:|---:|---:|---:|",
        ]
        for name, c in sp["configs"].items():
            lines.append(
                f"| {name} | {c['decode_step_ms']:.0f} | {c['decode_tok_s']:.1f} | "
                f"{_x(c['x_off_tok_s'])} | {c['prefill_s']:.1f} |"
            )
        lines.append("")
        paths = [(n, c["attention"]) for n, c in sp["configs"].items() if c.get("attention")]
        if paths:
            lines += ["Attention per configuration (the start-up log's line):", ""]
            lines += [f"- {name}: {path}" for name, path in paths]
            lines.append("")
        best = sp["configs"]["8-bit folded"]["x_off_tok_s"]
        targets.append(
            ("8-bit decode tok/s >= 0.9x the float pool (CPU default path)", _x(best), best >= 0.9)
        )
    if "quality" in result or "loglik" in result:
        q = result.get("quality", {"pools": {}})
        ll = result.get("loglik", {"pools": {}})
        lines += [
            f"**Quality** (greedy tokens of the same {q.get('requests', '?')} prompts, "
            f"{q.get('max_tokens', '?')} tokens each, against the float pool; mean "
            f"log-likelihood per token of a fixed {_text_tokens(result)}-token text through "
            "`/v1/completions` "
            f"`echo` + `logprobs`; {_run(q)}; {_run(ll)}):",
            "",
            "| pool | greedy tokens equal (per position) | common prefix | mlx-lm alone: "
            "equal | mlx-lm alone: common prefix | mean log-likelihood |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        ref = result.get("mlx_lm_quality", {"pools": {}})
        for name in BITS:
            n = _name(name)
            qp, rp, lp = q["pools"].get(n, {}), ref["pools"].get(n, {}), ll["pools"].get(n, {})
            cells = [
                _pct(qp.get("greedy_equal_positional")),
                _pct(qp.get("greedy_equal_prefix")),
                _pct(rp.get("greedy_equal_positional")),
                _pct(rp.get("greedy_equal_prefix")),
                "-" if lp.get("mean_loglik") is None else f"{lp['mean_loglik']:.4f}",
            ]
            lines.append(f"| {n} | {' | '.join(cells)} |")
        lines.append("")
        if ref.get("run"):
            lines += [f"mlx-lm alone: {_run(ref)}.", ""]
    if "long" in result:
        lo = result["long"]
        lines += [
            f"**Long prompts in a fixed budget** ({lo['budget_mib']:.0f} MiB of KV, "
            f"{lo['prompt_tokens']}-token prompts, {lo['max_tokens']} tokens each, one request "
            f"more than the slots hold; {_run(lo)}):",
            "",
            "| pool | slots | requests | decoding at once | wall s |",
            "|---|---:|---:|---:|---:|",
        ]
        for name, pool in lo["pools"].items():
            lines.append(
                f"| {name} | {pool['slots']} | {pool['requests']} | {pool['max_concurrent']} "
                f"| {pool['wall_s']:.0f} |"
            )
        lines.append("")
    if targets:
        lines += ["| target | measured | met |", "|---|---|---|"]
        lines += [f"| {t} | {m} | {'yes' if ok else 'NO'} |" for t, m, ok in targets]
        lines.append("")
    lines += NOTES
    return "\n".join(lines) + "\n"


NOTES = [
    "Notes:",
    "",
    "- Attention path per backend: on the CPU, `folded`: with the native op active (the "
    "default build), the native ragged op reads the packed rows in place and dequantizes "
    "each K/V row in the kernel (no gather, no padding, packed steps as over the float "
    "pool); without it, mlxserve's attention over the gathered packed rows "
    "(`mlx_backend/kv/packed_attention.py`), which folds the scales and biases into the "
    "scores. MLX's CPU `quantized_matmul` is a naive kernel, so mlx-lm's quantized SDPA is "
    "the slowest path, and dequantizing every gathered value with MLX ops costs more than "
    "the float pool's whole read. On Metal, `quantized-sdpa` (mlx-lm's own), whose "
    "`quantized_matmul` is a real kernel; not measured here (no Metal on this machine).",
    "- 4-bit K/V costs SmolLM2-135M most of its greedy agreement; mlx-lm's own "
    "`QuantizedKVCache(64, 4)` does the same (generating alone, 3 of the first 4 corpus "
    "prompts diverge from the float cache at the first token, at 7-64 tokens with 8 bits).",
    "",
]


def write_docs(result: dict[str, Any], path: Path) -> None:
    """Replace (or append) the "## Quantized KV" section of ``path``."""
    section = markdown(result)
    text = path.read_text() if path.is_file() else ""
    parts = ("\n" + text).split("\n## ")
    kept = [parts[0].lstrip("\n")] + [
        "## " + p for p in parts[1:] if not p.startswith("Quantized KV")
    ]
    path.write_text("\n".join(part.rstrip("\n") + "\n" for part in kept) + "\n" + section)
