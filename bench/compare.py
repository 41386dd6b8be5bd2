"""mlxserve vs its peers on the same model: a concurrency sweep, the docs, a chart.

The peers: mlx_lm.server of this venv (0.32), and from a venv the bench sets up itself
(:mod:`bench.peers`) vllm-mlx 0.6.0 (``--continuous-batching``) and mlx_lm.server 0.31
(``--peers`` picks). Runs the forward ceiling (:mod:`bench.forward_ceiling`) first, then for
each concurrency level (and round) starts each server in turn -- never two at once -- waits
for ``/health``, warms it up, runs :func:`bench.loadgen.run_level` and stops it; the order
rotates from level to level. Every peer gets mlxserve's BLAS and (when mlxserve dequantizes)
the same float32 weights (``bench/run_mlx_lm_server.py``, ``bench/run_peer_server.py``).
Writes the raw results as JSON and renders ``docs/benchmarks.md`` and ``docs/benchmarks.png``
(:mod:`bench.report`).

Every loop is bounded: request counts per level, a wall-clock cap per level, start and stop
timeouts per server. All traffic goes to 127.0.0.1. Example::

    .venv/bin/python -m bench.compare --model /tmp/smollm2-mlx          # the full run
    .venv/bin/python -m bench.compare --model /tmp/smollm2-mlx --quick  # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _env, peers, report
from bench.corpus import LENGTHS
from bench.loadgen import requests_for, run_level, warmup

ROOT = _env.REPO_ROOT
PY = sys.executable
HOST = "127.0.0.1"


class Server:
    """One server subprocess: started, health-checked, stopped by its own pid only.

    Args:
        name: label for logs and results.
        cmd: the command line (its ``--port`` must be ``port``).
        port: the TCP port it listens on.
        log_path: where its stdout and stderr go.
    """

    def __init__(
        self,
        name: str,
        cmd: list[str],
        port: int,
        log_path: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name, self.cmd, self.port, self.log_path = name, cmd, port, log_path
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.base_url = f"http://{HOST}:{port}/v1"

    def start(self, timeout_s: float) -> float:
        """Start the process and wait until ``/health`` answers 200; returns seconds taken."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child until stop()
        log.write(f"\n=== {datetime.datetime.now()} {shlex.join(self.cmd)}\n".encode())
        log.flush()
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=self.env
        )
        log.close()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see log")
            try:
                if httpx.get(f"http://{HOST}:{self.port}/health", timeout=2.0).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} not healthy within {timeout_s:.0f}s; see {self.log_path}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL -- to this process only, with timeouts."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            self.proc.send_signal(sig)
            try:
                self.proc.wait(wait_s)
                return
            except subprocess.TimeoutExpired:
                continue

    def model_name(self) -> str:
        """The ``model`` field to send: mlxserve's served id, or mlx_lm's ``default_model``."""
        if self.name in (report.PEER, peers.MLX_LM_OLD):
            return "default_model"
        data = httpx.get(f"{self.base_url}/models", timeout=10.0).json()
        return data["data"][0]["id"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def ensure_model(model_dir: Path) -> None:
    """Convert the embedded SmolLM2 GGUF into ``model_dir`` if it does not exist yet."""
    if (model_dir / "config.json").is_file():
        return
    code = (
        "from mlxserve.mlx_backend.loading.loader import embedded_gguf_path; "
        "print(embedded_gguf_path())"
    )
    gguf = subprocess.run([PY, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    cmd = [PY, "-m", "mlxserve.server.cli", "convert", gguf.stdout.strip(), str(model_dir)]
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=600)


def server_commands(args: argparse.Namespace, port: int) -> dict[str, list[str]]:
    """Both servers' command lines with the benchmark's settings."""
    batch = str(args.max_running_requests)
    ours = [PY, "-m", "mlxserve.server.cli", "--model", str(args.model), "--host", HOST]
    ours += ["--port", str(port), "--max-total-tokens", str(args.max_total_tokens)]
    ours += ["--max-running-requests", batch]
    peer = [PY, str(ROOT / "bench" / "run_mlx_lm_server.py"), "--model", str(args.model)]
    peer += ["--dequantize", args.peer_dequantize, "--host", HOST, "--port", str(port)]
    peer += ["--decode-concurrency", batch, "--prompt-concurrency", str(args.prompt_concurrency)]
    cmds = {report.OURS: ours, report.PEER: peer}
    wanted = [p for p in args.peers if p != report.PEER]
    if wanted:
        python = peers.ensure_venv()
        model = float32_model(args)
        extra = peers.peer_commands(
            python, model, HOST, port, args.max_running_requests, args.prompt_concurrency
        )
        cmds.update({name: extra[name] for name in wanted})
    return {name: cmds[name] for name in [report.OURS, *args.peers]}


def float32_model(args: argparse.Namespace) -> str:
    """The model directory the other venv's peers serve: the float32 copy when mlxserve
    dequantizes (written once by ``bench/run_mlx_lm_server.py --prepare-only``)."""
    cmd = [PY, str(ROOT / "bench" / "run_mlx_lm_server.py"), "--model", str(args.model)]
    cmd += ["--dequantize", args.peer_dequantize, "--prepare-only"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True, timeout=900)
    return out.stdout.strip().splitlines()[-1]


def run_ceiling(args: argparse.Namespace, levels: list[int]) -> dict[str, Any]:
    """The forward ceiling in a subprocess (fresh MLX and BLAS), at the sweep's batch sizes."""
    out = args.out_dir / "ceiling.json"
    cmd = [PY, "-m", "bench.forward_ceiling", "--model", str(args.model), "--batch"]
    cmd += [str(c) for c in levels]
    cmd += ["--steps", str(args.ceiling_steps or args.max_tokens), "--json", str(out)]
    cmd += ["--repeats", str(args.ceiling_repeats)]
    print(f"[compare] {shlex.join(cmd)}", flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=args.time_cap * 2)
    return json.loads(out.read_text())


def run_engine_steps(
    args: argparse.Namespace, batch: int, equal_prompt_tokens: int | None = None
) -> dict[str, Any]:
    """mlxserve's engine without HTTP (:mod:`bench.engine_steps`) in a subprocess, on the
    corpus's prompts or on the ceiling's ``equal_prompt_tokens``-token ones."""
    name = f"engine_steps_equal{equal_prompt_tokens}" if equal_prompt_tokens else "engine_steps"
    out = args.out_dir / f"{name}.json"
    cmd = [PY, "-m", "bench.engine_steps", "--model", str(args.model), "--requests", str(batch)]
    cmd += ["--max-tokens", str(args.ceiling_steps or args.max_tokens), "--json", str(out)]
    if equal_prompt_tokens:
        cmd += ["--equal-prompt-tokens", str(equal_prompt_tokens)]
    cmd += ["--timeout", str(args.time_cap * 2)]
    print(f"[compare] {shlex.join(cmd)}", flush=True)
    subprocess.run(cmd, cwd=ROOT, check=False, timeout=args.time_cap * 2 + 120)
    return json.loads(out.read_text()) if out.is_file() else {}


def log_lines(path: Path, words: tuple[str, ...]) -> list[str]:
    """Distinct log lines of ``path`` mentioning any of ``words`` (case-insensitive)."""
    if not path.is_file():
        return []
    seen: dict[str, None] = {}
    for line in path.read_text(errors="replace").splitlines():
        if not line.startswith("===") and any(w in line.lower() for w in words):
            seen.setdefault(line.split(": ", 1)[-1].strip()[:240], None)
    return list(seen)[:4]


def machine() -> str:
    """CPU model, cores, memory."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem = int(Path("/proc/meminfo").read_text().split()[1]) / 2**20
    except OSError:
        mem = 0.0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{platform.system()} {platform.machine()}, {cpu}, {cores} cores, {mem:.0f} GiB"


def load_avg() -> str:
    """The 1-minute load average."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "?"


def git_rev() -> str:
    """Short commit of the working tree (+ "dirty" if modified)."""
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            text=True,
            capture_output=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=ROOT, text=True, capture_output=True, timeout=10
        ).stdout.strip()
        return rev + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "?"


def sweep(args: argparse.Namespace, levels: list[int], results: dict[str, Any]) -> None:
    """Every level and round: each server started, warmed, measured and stopped in turn."""
    port = args.port or free_port()
    cmds = server_commands(args, port)
    logs = args.out_dir / "logs"
    results["meta"]["ours_cmd"] = shlex.join(cmds[report.OURS])
    results["meta"]["peer_cmd"] = shlex.join(cmds.get(report.PEER, []))
    results["meta"]["peer_cmds"] = {n: shlex.join(c) for n, c in cmds.items() if n != report.OURS}
    step = 0
    names = list(cmds)
    for rnd in range(args.rounds):
        for i, c in enumerate(levels):
            k = (i + rnd) % len(names)
            order = names[k:] + names[:k]
            n = requests_for(c, args.requests_per_level, args.min_requests)
            for name in order:
                env = home = None
                if name in (peers.VLLM_MLX, peers.MLX_LM_OLD):
                    home = peers.throwaway_home()
                    env = peers.peer_env(home)
                log = logs / f"{name.replace(' ', '_')}.log"
                server = Server(name, cmds[name], port, log, env)
                try:
                    started = server.start(args.start_timeout)
                    model = server.model_name()
                    asyncio.run(warmup(server.base_url, model))
                    stats = asyncio.run(
                        run_level(
                            server.base_url,
                            model,
                            c,
                            n,
                            args.max_tokens,
                            args.seed,
                            args.time_cap,
                            prompt_start=100_000 * rnd + 1000 * i,
                        )
                    )
                finally:
                    server.stop()
                    if home is not None:
                        shutil.rmtree(home, ignore_errors=True)
                step += 1
                row = asdict(stats) | {"round": rnd, "start_s": started}
                results["servers"].setdefault(name, []).append(row)
                print(
                    f"[compare] round {rnd} conc {c:>2} {name:<14} {stats.output_tok_s:7.1f} "
                    f"tok/s, ttft p50 {report._f(stats.ttft_p50, 1e3, 0)} ms, "
                    f"{stats.errors} errors, {stats.wall_s:.0f}s (start {started:.0f}s)",
                    flush=True,
                )


def build_parser() -> argparse.ArgumentParser:
    """The compare argument parser."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        type=Path,
        default=Path("/tmp/smollm2-mlx"),
        help="MLX model dir both servers load (created from the embedded GGUF if missing)",
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests-per-level", type=float, default=2.0)
    p.add_argument("--min-requests", type=int, default=4)
    p.add_argument("--time-cap", type=float, default=240.0, help="wall-clock cap per level (s)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=0, help="server port (0: a free one)")
    p.add_argument("--start-timeout", type=float, default=180.0)
    p.add_argument(
        "--max-running-requests",
        type=int,
        default=32,
        help="mlxserve's batch and mlx_lm's --decode-concurrency",
    )
    p.add_argument("--max-total-tokens", type=int, default=32768, help="mlxserve's KV pool")
    p.add_argument(
        "--prompt-concurrency",
        type=int,
        default=32,
        help="mlx_lm.server's --prompt-concurrency (its default is 8)",
    )
    p.add_argument("--peer-dequantize", choices=("auto", "on", "off"), default="auto")
    p.add_argument(
        "--peers",
        nargs="+",
        choices=report.PEERS,
        default=list(report.PEERS),
        help="peers to run (the last two from the venv bench/peers.py sets up)",
    )
    p.add_argument("--ceiling-steps", type=int, default=32, help="decode steps (0: --max-tokens)")
    p.add_argument("--ceiling-repeats", type=int, default=2)
    p.add_argument("--no-ceiling", dest="ceiling", action="store_false")
    p.add_argument(
        "--no-engine-steps",
        dest="engine_steps",
        action="store_false",
        help="skip timing mlxserve's engine without HTTP at the largest batch",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: concurrency 1 4, max_tokens 16, 4 requests per level",
    )
    p.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--md", type=Path, default=ROOT / "docs" / "benchmarks.md")
    p.add_argument("--png", type=Path, default=ROOT / "docs" / "benchmarks.png")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and write the results and docs."""
    args = build_parser().parse_args(argv)
    if args.quick:
        args.concurrency, args.max_tokens, args.requests_per_level = [1, 4], 16, 1.0
        args.time_cap, args.ceiling_repeats = min(args.time_cap, 120.0), 1
        args.ceiling_steps = 16
        if "--md" not in (argv or sys.argv):  # a smoke run never overwrites the real docs
            args.md = args.out_dir / "quick.md"
            args.png = args.out_dir / "quick.png"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for old in (args.out_dir / "logs").glob("*.log"):  # the notes read this run's logs only
        old.unlink()
    args.model = args.model.resolve()
    ensure_model(args.model)
    t0 = time.monotonic()
    results: dict[str, Any] = {
        "meta": {
            "command": shlex.join([".venv/bin/python", "-m", "bench.compare", *sys.argv[1:]]),
            "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
            "machine": machine(),
            "load_before": load_avg(),
            "versions": ", ".join(f"{k} {v}" for k, v in _env.mlx_versions().items())
            + f", Python {platform.python_version()}, mlxserve {git_rev()}",
            "model": str(args.model),
            "model_name": args.model.name,
            "max_tokens": args.max_tokens,
            "seed": args.seed,
            "prompt_words": f"{min(LENGTHS)}-{max(LENGTHS)}",
            "rounds": args.rounds,
            "requests_note": ", ".join(
                f"{c}: {requests_for(c, args.requests_per_level, args.min_requests)}"
                for c in args.concurrency
            )
            + f" (cap {args.time_cap:.0f}s per level)",
        },
        "servers": {},
    }
    if args.ceiling:
        results["ceiling"] = run_ceiling(args, args.concurrency)
    if args.engine_steps:
        batch = max(args.concurrency)
        results["engine_steps"] = run_engine_steps(args, batch)
        ceiling_rows = results.get("ceiling", {}).get("results", [])
        if ceiling_rows:
            equal = ceiling_rows[0]["prompt_tokens"]
            results["engine_steps_equal"] = run_engine_steps(args, batch, equal)
    try:
        sweep(args, args.concurrency, results)
    finally:
        meta = results["meta"]
        meta["load_after"] = load_avg()
        meta["elapsed_min"] = (time.monotonic() - t0) / 60
        meta["weights"] = describe_weights(args)
        meta["notes"] = notes(args)
        raw = args.out_dir / ("quick.json" if args.quick else "compare.json")
        raw.write_text(json.dumps(results, indent=2) + "\n")
        print(f"[compare] wrote {raw}")
        if results["servers"]:
            for path in report.write_docs(results, args.md, args.png):
                print(f"[compare] wrote {path}")
    return 0


def describe_weights(args: argparse.Namespace) -> str:
    """Which weights each server computed with, from their logs."""
    peer = log_lines(args.out_dir / "logs" / f"{report.PEER}.log", ("serving",))
    return "mlx_lm.server: " + (peer[-1] if peer else "?")


def notes(args: argparse.Namespace) -> list[str]:
    """What the servers' logs say about BLAS and dequantization, and known caveats."""
    words = ("blas", "dequantiz", "kept quantized", "attention")
    out = []
    for name in (report.OURS, *args.peers):
        lines = log_lines(args.out_dir / "logs" / f"{name.replace(' ', '_')}.log", words)
        out.append(f"{name} log: " + ("; ".join(lines) if lines else "no BLAS/dequantize line"))
    out += [
        "mlx_lm.server runs through `bench/run_mlx_lm_server.py` with a listen backlog of 128: "
        "with socketserver's default of 5 a burst of 32 concurrent requests loses connections "
        "(closed before any response; 3-14 of 32 per burst in our tests, 3 of 64 requests in a "
        "full run).",
        "mlx_lm.server keeps its LRU prompt cache (10 entries by default), which reuses the "
        "chat template's shared system-prompt prefix (about 30 tokens) across requests; "
        "mlxserve's radix prefix cache shares it too, also between requests of one burst.",
        "Both servers start OpenBLAS with one thread per CPU (unless OPENBLAS_NUM_THREADS is "
        "set). mlxserve lowers the count while other processes keep CPUs busy "
        "(mlx_backend/cpu/blas_threads.py); mlx_lm.server keeps it. On an idle machine both "
        "use every CPU.",
        "`--prompt-concurrency 32` (its default is 8) lets mlx_lm.server prefill as many "
        "prompts per step as mlxserve may; at concurrency 16 both settings gave the same "
        "throughput and TTFT within 10%.",
        "Decode tok/s '-': a request of the first wave failed, or the wave never decoded "
        "all at once.",
        "vllm-mlx 0.6.0 and mlx_lm.server 0.31 run from bench/.peer-venv (bench/peers.py: "
        "mlx[cpu], mlx-lm>=0.31.3,<0.32, vllm-mlx --no-deps plus what its text server imports), "
        "each with a throwaway HOME (vllm-mlx persists its prefix cache under ~/.cache), the "
        "float32 copy of the model and mlxserve's OpenBLAS shim (bench/run_peer_server.py); "
        "vllm-mlx with --continuous-batching --max-num-seqs 32.",
    ]
    return out


if __name__ == "__main__":
    sys.exit(main())
