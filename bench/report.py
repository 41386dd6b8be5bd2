"""Turn a comparison run's results into ``docs/benchmarks.md`` and ``docs/benchmarks.png``.

The input is the JSON :mod:`bench.compare` writes: run metadata, per-server per-level stats
(:class:`bench.loadgen.LevelStats` as dicts, one per round) and the forward ceiling.
``python -m bench.report RESULTS.json`` re-renders the docs from a saved run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

OURS, PEER = "mlxserve", "mlx_lm.server"
# Every peer a run may hold, in table order (bench/peers.py names the other two).
PEERS = (PEER, "vllm-mlx", "mlx_lm.server 0.31")
# The output tok/s ratio mlxserve must reach over each peer, per concurrency (issue 21).
THROUGHPUT_TARGETS = {1: 1.2, 4: 1.5, 16: 2.0, 32: 2.5}
METRICS = ("output_tok_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "steady_decode_tok_s")


def median_level(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Combine one level's rounds: the median of each metric, errors and requests summed."""
    out = dict(rounds[0])
    for key in METRICS + ("mean_output_tokens",):
        values = [r[key] for r in rounds if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    out["errors"] = sum(r["errors"] for r in rounds)
    out["requests"] = sum(r["requests"] for r in rounds)
    return out


def combined(results: dict[str, Any]) -> dict[str, dict[int, dict[str, Any]]]:
    """``{server: {concurrency: level stats (median over rounds)}}``."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for server, levels in results["servers"].items():
        by_c: dict[int, list[dict[str, Any]]] = {}
        for level in levels:
            by_c.setdefault(level["concurrency"], []).append(level)
        out[server] = {c: median_level(rs) for c, rs in sorted(by_c.items())}
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _f(v: float | None, scale: float = 1.0, digits: int = 1, suffix: str = "") -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}{suffix}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def ceiling_at(results: dict[str, Any], batch: int) -> float | None:
    """The forward ceiling (tok/s) at ``batch``, if measured."""
    for row in results.get("ceiling", {}).get("results", []):
        if row["batch"] == batch:
            return row["ceiling_tok_s"]
    return None


def _decode_step(results: dict[str, Any], eng: dict[str, Any]) -> str:
    """An ``engine_steps`` result's full-batch decode step, and its share of the ceiling."""
    ceil = ceiling_at(results, eng["requests"])
    share = _f(_ratio(eng["full_batch_decode_tok_s"], ceil), 100, 0, "%")
    return (
        f"decode step at batch {eng['requests']} median {eng['full_batch_step_ms']:.0f} ms = "
        f"{eng['full_batch_decode_tok_s']:.1f} tok/s ({share} of the ceiling)"
    )


def targets(results: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met) for each of the issue's targets; met is None if unmeasured."""
    comb = combined(results)
    ours = comb.get(OURS, {})
    rows: list[tuple[str, str, bool | None]] = []
    for peer_name in PEERS:
        peer = comb.get(peer_name)
        if not peer:
            continue

        def metric(c: int, key: str, peer: dict = peer) -> float | None:
            if c not in ours or c not in peer:
                return None
            return _ratio(ours[c][key], peer[c][key])

        for c, want in THROUGHPUT_TARGETS.items():
            r = metric(c, "output_tok_s")
            met = None if r is None else r >= want
            rows.append((f"vs {peer_name}, concurrency {c}: output tok/s >= {want}x", _x(r), met))
        for c in (16, 32):
            r = metric(c, "ttft_p50")
            met = None if r is None else r <= 0.5
            rows.append((f"vs {peer_name}, concurrency {c}: TTFT p50 <= 0.5x", _x(r), met))
    top = max(ours) if ours else None
    if top is not None:
        s = ours[top]
        r = _ratio(s["itl_p99"], s["itl_p50"])
        label = f"concurrency {top}: ITL p99 <= 3x ITL p50"
        rows.append((label, _x(r), None if r is None else r <= 3.0))
    ceil = ceiling_at(results, top) if top else None
    dec = ours[top]["steady_decode_tok_s"] if top else None
    r = _ratio(dec, ceil)
    label = f"decode at batch {top} (chat corpus): >= 1.5x the bare mlx-lm loop"
    got = "-" if r is None else f"{r:.2f}x ({_f(dec)} vs {_f(ceil)} tok/s)"
    rows.append((label, got, None if r is None else r >= 1.5))
    return rows


def markdown(results: dict[str, Any], png_name: str | None) -> str:
    """The whole ``docs/benchmarks.md`` text."""
    meta = results["meta"]
    comb = combined(results)
    ours = comb.get(OURS, {})
    peers = [(name, comb[name]) for name in PEERS if comb.get(name)]
    peer_cmds = meta.get("peer_cmds") or {PEER: meta["peer_cmd"]}
    lines = [
        "# Benchmarks: mlxserve vs " + ", ".join(name for name, _ in peers),
        "",
        f"Generated by `bench/compare.py` on {meta['date']}. Command:",
        "",
        "```bash",
        meta["command"],
        "```",
        "",
        "## Set-up",
        "",
        f"- Machine: {meta['machine']}",
        f"- Load average before / after the run: {meta['load_before']} / {meta['load_after']}"
        + " (the machine may be shared; numbers move with other processes' CPU use)",
        f"- Versions: {meta['versions']}",
        f"- Model: `{meta['model']}`; {meta['weights']}",
        f"- Workload: streaming chat completions, temperature 0, `max_tokens` "
        f"{meta['max_tokens']}, `stream_options.include_usage`; prompts from `bench/corpus.py` "
        f"(seed {meta['seed']}, {meta['prompt_words']} words, a distinct prompt per request); "
        f"requests per level: {meta['requests_note']}; rounds: {meta['rounds']}, "
        "server order alternated per level and round, each server restarted per level "
        "and warmed up with one short request.",
        f"- mlxserve: `{meta['ours_cmd']}`",
        *(f"- {name}: `{cmd}`" for name, cmd in peer_cmds.items()),
        f"- Run time: {meta['elapsed_min']:.1f} min",
        "",
        "## Results",
        "",
        "Output tok/s: output tokens received (`usage.completion_tokens`) over the level's wall "
        "time. Decode tok/s: tokens the first `concurrency` requests received while all of "
        "them were decoding, over that window (the server's pure decode rate at that batch). "
        "TTFT and ITL in ms (ITL: gaps between content chunks). Ratios are mlxserve / "
        "each peer (higher is better for tok/s, lower for latencies).",
        "",
        "| conc | server | out tok/s | decode tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 "
        "| out tok/req | errors |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    levels = sorted(set(ours).union(*(set(t) for _, t in peers)))
    for c in levels:
        for name, table in [(OURS, ours), *peers]:
            if c not in table:
                continue
            s = table[c]
            lines.append(
                f"| {c} | {name} | {_f(s['output_tok_s'])} | {_f(s['steady_decode_tok_s'])} | "
                f"{_f(s['ttft_p50'], 1e3, 0)} | {_f(s['ttft_p99'], 1e3, 0)} | "
                f"{_f(s['itl_p50'], 1e3, 0)} | {_f(s['itl_p99'], 1e3, 0)} | "
                f"{_f(s['mean_output_tokens'])} | {s['errors']}/{s['requests']} |"
            )
        for peer_name, peer in peers:
            if c not in ours or c not in peer:
                continue
            a, b = ours[c], peer[c]
            cells = [_x(_ratio(a[k], b[k])) for k in METRICS[:5]]
            dec = _x(_ratio(a["steady_decode_tok_s"], b["steady_decode_tok_s"]))
            lines.append(
                f"| {c} | **/ {peer_name}** | **{cells[0]}** | {dec} | **{cells[1]}** | "
                f"{cells[2]} | {cells[3]} | {cells[4]} | | |"
            )
    lines += ["", f"![tok/s and TTFT vs concurrency]({png_name})" if png_name else "", ""]
    ceiling = results.get("ceiling", {})
    if ceiling.get("results"):
        lines += [
            "## Forward ceiling",
            "",
            "`bench/forward_ceiling.py`: the model loaded as mlxserve loads it, B equal-length "
            "prompts prefilled into mlx-lm's `KVCache`, then greedy decode steps timed (sync: "
            "`mx.eval` per step; pipelined: next step queued with `mx.async_eval` first). "
            + "; ".join(ceiling.get("notes", [])),
            "",
            "| batch | prompt tokens | steps | prefill tok/s | decode sync | decode pipelined "
            "| mlxserve decode | mlxserve / ceiling |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in ceiling["results"]:
            dec = ours.get(row["batch"], {}).get("steady_decode_tok_s")
            lines.append(
                f"| {row['batch']} | {row['prompt_tokens']} | {row['steps']} | "
                f"{row['prefill_tok_s']:.0f} | {row['sync_tok_s']:.1f} | "
                f"{row['pipelined_tok_s']:.1f} | {_f(dec)} | "
                f"{_f(_ratio(dec, row['ceiling_tok_s']), 100, 0, '%')} |"
            )
        lines.append("")
    eng = results.get("engine_steps") or {}
    if eng.get("full_batch_decode_tok_s"):
        lines += [
            f"mlxserve's engine without HTTP (`bench/engine_steps.py`: {eng['requests']} "
            f"requests submitted at once, {eng['max_tokens']} tokens each): "
            f"{_decode_step(results, eng)}; prefill "
            f"{eng['prefill_steps']} steps of {eng['prefill_forwards']} forwards, "
            f"{eng['prefill_s']:.1f} s for {eng['prompt_tokens']} prompt tokens, of which "
            f"{eng['prefill_fed_tokens']} were fed (the rest came from the prefix cache), "
            f"computing {eng['prefill_computed_positions']} positions with padding.",
            "",
        ]
    equal = results.get("engine_steps_equal") or {}
    if equal.get("full_batch_decode_tok_s"):
        lines += [
            f"The same engine on the ceiling's own prompts ({equal['prompts']}, no EOS): "
            f"{_decode_step(results, equal)}. The difference from the corpus run is padding: "
            "a decode step attends over the longest row's context for every row.",
            "",
        ]
    lines += ["## Targets", "", "| target | measured | met |", "|---|---|---|"]
    for label, got, met in targets(results):
        lines.append(f"| {label} | {got} | {'-' if met is None else 'yes' if met else 'NO'} |")
    notes = meta.get("notes") or []
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines).rstrip() + "\n"


def chart(results: dict[str, Any], path: Path) -> bool:
    """Write the tok/s and TTFT p50 vs concurrency chart; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    comb = combined(results)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name, marker in zip((OURS, *PEERS), "os^v", strict=True):
        table = comb.get(name, {})
        if not table:
            continue
        cs = sorted(table)
        ax1.plot(cs, [table[c]["output_tok_s"] for c in cs], marker=marker, label=name)
        ttft = [table[c]["ttft_p50"] for c in cs]
        ax2.plot(cs, [t * 1e3 if t is not None else float("nan") for t in ttft], marker=marker)
    levels = sorted({c for table in comb.values() for c in table})
    for ax, title in ((ax1, "output tok/s (aggregate)"), (ax2, "TTFT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    ax1.set_ylim(bottom=0)
    ax2.set_yscale("log")
    ax1.legend()
    fig.suptitle(f"{results['meta']['model_name']}, max_tokens {results['meta']['max_tokens']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_docs(results: dict[str, Any], md_path: Path, png_path: Path | None) -> list[Path]:
    """Write the markdown (and the chart if possible); returns the files written."""
    written = []
    png_name = None
    if png_path is not None and chart(results, png_path):
        written.append(png_path)
        png_name = png_path.name
    text = markdown(results, png_name)
    if md_path.is_file():
        text = text.rstrip("\n") + "\n" + _other_sections(md_path.read_text(), text)
    md_path.write_text(text)
    written.insert(0, md_path)
    return written


def _other_sections(old: str, new: str) -> str:
    """The ``## `` sections of ``old`` that ``new`` does not have (the prefix-cache and
    grammar sections other benchmarks wrote), in their order."""
    headings = {line for line in new.splitlines() if line.startswith("## ")}
    kept = []
    for part in ("\n" + old).split("\n## ")[1:]:
        heading = "## " + part.splitlines()[0]
        if heading not in headings:
            kept.append("\n## " + part.rstrip("\n") + "\n")
    return "".join(kept)


def main(argv: list[str] | None = None) -> int:
    """Re-render the docs from a saved results JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path)
    p.add_argument("--md", type=Path, default=Path("docs/benchmarks.md"))
    p.add_argument("--png", type=Path, default=Path("docs/benchmarks.png"))
    args = p.parse_args(argv)
    for path in write_docs(json.loads(args.results.read_text()), args.md, args.png):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
