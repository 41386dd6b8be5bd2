"""Load time and peak memory of a GGUF file through mlxserve's reader (not a timed test).

Writes a Q4_K_M-style GGUF of a qwen3-shaped model (Q4_K, Q6_K for attn_v / the first
ffn_down / the output head, Q5_0 / Q8_0 where rows of ``--ff`` values are not a multiple
of 256, F32 norms) with the encoders of ``tests/gguf_quantizers.py``, then loads it in a
fresh subprocess per mode and reports wall time, the process's resident memory before
the load (after imports), its peak during the load, and the parameter bytes of the result:

- ``quantized``: ``load_gguf_model(inexact_as_float=False)`` (``--keep-quantized``, or a
  GPU): Q6_K requantized to 8 bits, everything else exact;
- ``cpu``: the CPU default (Q6_K dequantized exactly to float32);
- ``cpu+float32``: the CPU default plus the serving path's dequantization to float32.

Usage::

    .venv/bin/python -m bench.gguf_load --hidden 1024 --layers 12 --ff 2880 --vocab 32000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import _env  # noqa: F401  (puts the repository on sys.path)

_CHILD = r"""
import json, resource, sys, time
import mlx.core as mx
from mlx.utils import tree_flatten
from mlxserve.mlx_backend.loading.gguf.model_loader import load_gguf_model
from mlxserve.mlx_backend.loading.dequantize import dequantize_for_cpu

def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
path, mode = sys.argv[1], sys.argv[2]
import mlx_lm.models.base  # noqa: F401  (imports counted in the baseline, not the load)
before = rss()
t = time.perf_counter()
loaded = load_gguf_model(path, inexact_as_float=(mode != "quantized"))
if mode == "cpu+float32":
    dequantize_for_cpu(loaded.model, budget_bytes=1 << 40)
seconds = time.perf_counter() - t
params = sum(v.nbytes for _, v in tree_flatten(loaded.model.parameters()))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"mode": mode, "seconds": seconds, "rss_before": before, "peak": peak,
                  "rss_after": rss(), "param_bytes": params, "report": loaded.report.lines()}))
"""


def write_file(path: Path, hidden: int, layers: int, ff: int, vocab: int, seed: int = 0) -> None:
    import gguf
    import numpy as np
    from gguf.quants import quantize

    from tests.gguf_quantizers import K_QUANTIZERS

    rng = np.random.default_rng(seed)
    heads, kv_heads, head_dim = hidden // 64, max(1, hidden // 128), 64
    w = gguf.GGUFWriter(str(path), "qwen3")
    for key, value in (
        ("context_length", 4096),
        ("embedding_length", hidden),
        ("block_count", layers),
        ("feed_forward_length", ff),
        ("attention.head_count", heads),
        ("attention.head_count_kv", kv_heads),
        ("attention.key_length", head_dim),
        ("attention.value_length", head_dim),
    ):
        w.add_uint32(f"qwen3.{key}", value)
    w.add_float32("qwen3.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32("qwen3.rope.freq_base", 1e6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_token_merges([])

    def add(name: str, shape: tuple[int, ...], kind: str) -> None:
        x = (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])).astype(np.float32)
        if kind in ("Q4_K", "Q6_K") and shape[-1] % 256:
            kind = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}[kind]
        if kind == "F32":
            w.add_tensor(name, x)
        elif kind in K_QUANTIZERS:
            w.add_tensor(name, K_QUANTIZERS[kind](x)[0], raw_dtype=gguf.GGMLQuantizationType[kind])
        else:
            qt = gguf.GGMLQuantizationType[kind]
            w.add_tensor(name, quantize(x, qt), raw_dtype=qt)

    add("token_embd.weight", (vocab, hidden), "Q4_K")
    for i in range(layers):
        b = f"blk.{i}."
        add(b + "attn_q.weight", (heads * head_dim, hidden), "Q4_K")
        add(b + "attn_k.weight", (kv_heads * head_dim, hidden), "Q4_K")
        add(b + "attn_v.weight", (kv_heads * head_dim, hidden), "Q6_K")
        add(b + "attn_output.weight", (hidden, heads * head_dim), "Q4_K")
        add(b + "ffn_gate.weight", (ff, hidden), "Q4_K")
        add(b + "ffn_up.weight", (ff, hidden), "Q4_K")
        add(b + "ffn_down.weight", (hidden, ff), "Q6_K" if i == 0 else "Q4_K")
        for norm in ("attn_norm", "ffn_norm"):
            add(b + f"{norm}.weight", (hidden,), "F32")
        for norm in ("attn_q_norm", "attn_k_norm"):
            add(b + f"{norm}.weight", (head_dim,), "F32")
    add("output_norm.weight", (hidden,), "F32")
    add("output.weight", (vocab, hidden), "Q6_K")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--ff", type=int, default=2880)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--file", help="an existing GGUF file to load instead")
    parser.add_argument("--modes", default="quantized,cpu,cpu+float32")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.file) if args.file else Path(tmp) / "bench-qwen3-Q4_K_M.gguf"
        if not args.file:
            t = time.perf_counter()
            write_file(path, args.hidden, args.layers, args.ff, args.vocab)
            print(f"wrote {path.name} in {time.perf_counter() - t:.1f}s")
        size = path.stat().st_size
        print(f"file: {size / 2**20:.1f} MiB; load averages {os.getloadavg()}")
        print(
            "| mode | load s | RSS before MiB | peak MiB | peak - before MiB | "
            "(peak - before) / file | params MiB |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|")
        for mode in args.modes.split(","):
            out = subprocess.run(
                [sys.executable, "-c", _CHILD, str(path), mode],
                capture_output=True,
                text=True,
                check=True,
                cwd=_env.REPO_ROOT,
            )
            r = json.loads(out.stdout.strip().splitlines()[-1])
            grew = r["peak"] - r["rss_before"]
            print(
                f"| {mode} | {r['seconds']:.2f} | {r['rss_before'] / 2**20:.0f} | "
                f"{r['peak'] / 2**20:.0f} | {grew / 2**20:.0f} | {grew / size:.2f} | "
                f"{r['param_bytes'] / 2**20:.0f} |"
            )
            for line in r["report"]:
                print(f"    {line}")


if __name__ == "__main__":
    main()
