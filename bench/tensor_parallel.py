"""Tensor parallelism on one machine: 2 ranks (``--tensor-parallel 2``, ring over
127.0.0.1) against one process, same random llama, same requests, one server at a time.

    .venv/bin/python -m bench.tensor_parallel [--hidden 768 --layers 8 --requests 8]

Prints, for each set-up, single-stream and concurrent decode tokens/s, and for the group
the forwards run, rank 0's time per step, the all_sum latency measured at start-up and the
estimated time per step in collectives (``/metrics``). NOTE: on this 2-core machine the two
ranks share the cores with each other (and with whatever else runs), so the ratio says what
the group costs, not what two Macs gain.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import mlx.core as mx
from mlx.utils import tree_flatten

from bench._env import REPO_ROOT
from tests.tiny_models import _TOKENIZER_CONFIG, _byte_level_tokenizer_json, build_tiny_model

CLI = "import sys; from mlxserve.server.cli import main; sys.exit(main(sys.argv[1:]))"


def build_model(path: Path, hidden: int, layers: int) -> Path:
    """A random llama with 16 heads / 8 KV heads of ``hidden`` width (byte tokenizer)."""
    overrides = {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": 4 * hidden,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
    }
    model, config = build_tiny_model("llama", 0, overrides)
    path.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").write_text(_byte_level_tokenizer_json())
    (path / "tokenizer_config.json").write_text(json.dumps(_TOKENIZER_CONFIG))
    return path


def free_port() -> int:
    import socket

    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def start(
    model: Path, ranks: int, log: Path, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    args = ["--model", str(model), "--max-total-tokens", "8192", "--port", str(port)]
    if ranks > 1:
        args += ["--tensor-parallel", str(ranks)]
    proc = subprocess.Popen(
        [sys.executable, "-c", CLI, *args],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        cwd=REPO_ROOT,
        env={**os.environ, **(env or {})},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
        time.sleep(0.5)
    raise RuntimeError("server did not start")


def generate(url: str, model: str, prompt: list[int], tokens: int) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0}
    body["ignore_eos"] = True
    r = httpx.post(url + "/v1/completions", json=body, timeout=600).json()
    return r["usage"]["completion_tokens"]


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    found = re.findall(rf"^mlxserve:{name}(?:_total)?(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(found[0]) if found else float("nan")


def measure(
    model: Path, ranks: int, requests: int, tokens: int, log: Path, env: dict | None = None
) -> dict:
    proc, url = start(model, ranks, log, env)
    name = model.name
    try:
        generate(url, name, [1, 2, 3], 4)  # warm
        steps0 = metric(url, "tensor_parallel_steps")
        fwd0 = metric(url, "tensor_parallel_forward_seconds")
        send0 = metric(url, "tensor_parallel_send_seconds")
        coll0 = metric(url, "tensor_parallel_collective_seconds_estimate")
        started = time.perf_counter()
        single = generate(url, name, [5, 6, 7, 8], tokens) / (time.perf_counter() - started)
        prompts = [[(7 * i + k) % 250 + 1 for i in range(32)] for k in range(requests)]
        started = time.perf_counter()
        with ThreadPoolExecutor(requests) as pool:
            done = sum(pool.map(lambda p: generate(url, name, p, tokens), prompts))
        concurrent = done / (time.perf_counter() - started)
        row = {"ranks": ranks, "single_tok_s": single, "concurrent_tok_s": concurrent}
        if ranks > 1:
            steps = metric(url, "tensor_parallel_steps") - steps0
            row["steps"] = steps
            row["step_ms"] = 1e3 * (metric(url, "tensor_parallel_forward_seconds") - fwd0) / steps
            row["collective_ms"] = (
                1e3 * (metric(url, "tensor_parallel_collective_seconds_estimate") - coll0) / steps
            )
            row["send_ms"] = 1e3 * (metric(url, "tensor_parallel_send_seconds") - send0) / steps
            row["collectives_per_step"] = metric(url, "tensor_parallel_collectives_per_step")
            line = re.search(
                r"all_sum over \d+ ranks: (\d+) us latency, ([\d.inf]+) GB/s", log.read_text()
            )
            row["all_sum"] = line.group(0) if line else "?"
        return row
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "tp-llama", args.hidden, args.layers)
        setups = [
            ("1 process", 1, None),
            ("1 process, 1 BLAS thread", 1, {"OPENBLAS_NUM_THREADS": "1"}),
            ("2 ranks (1 BLAS thread each)", 2, None),
        ]
        rows = []
        for label, ranks, env in setups:
            log = Path(tmp) / f"{len(rows)}.log"
            rows.append(measure(model, ranks, args.requests, args.tokens, log, env))
            rows[-1]["label"] = label
    print(f"model: llama, hidden {args.hidden}, {args.layers} layers, 16 heads / 8 KV heads")
    print(f"| set-up | single stream tok/s | {args.requests} streams tok/s |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['label']} | {r['single_tok_s']:.1f} | {r['concurrent_tok_s']:.1f} |")
    group = rows[-1]
    print(
        f"2 ranks: {group['steps']:.0f} forwards, {group['step_ms']:.1f} ms per step on rank 0, "
        f"{group['send_ms']:.2f} ms sending the batch, "
        f"{group['collectives_per_step']:.0f} all_sums in the last step, estimated "
        f"{group['collective_ms']:.2f} ms per step in collectives; {group['all_sum']}"
    )


if __name__ == "__main__":
    main()
