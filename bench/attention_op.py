"""Attention of one layer, per call: the native ragged op vs gather + mask + MLX's SDPA.

SmolLM2-135M's shapes (9 query heads over 3 KV heads of dim 64), flat head-major pools as
``KVPool`` holds them; 30 layers' pools are cycled so that K/V come from memory, not cache.
The gather path is what ``PoolKVCacheView`` did before the dispatch (and still does for
layers that fall back): gather each row's slots padded to the longest row, mask, and
``mx.fast.scaled_dot_product_attention``. With ``--kv-bits 8,4`` the op also runs over the
same pools quantized into packed rows (``--kv-bits``'s pools, group size ``--group-size``),
side by side with its float32 run, its difference measured against SDPA over the packed
rows dequantized. Example::

    .venv/bin/python -m bench.attention_op --json bench/results/attention_op.json
    .venv/bin/python -m bench.attention_op --kv-bits 8,4 --json bench/results/attention_quant.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _env  # noqa: E402  (no mlx import: must precede mlx.core)

Q_HEADS, KV_HEADS, DIM, LAYERS = 9, 3, 64, 30

# (name, context of each row, queries per row)
CASES = [
    ("decode B=32, contexts 56..330", [56 + (330 - 56) * i // 31 for i in range(32)], 1),
    ("decode B=32, 31 x 150 + 1 x 2,000", [150] * 31 + [2000], 1),
    ("decode B=31, 31 x 150", [150] * 31, 1),
    ("decode B=32, 31 x 150 + 1 x 8,000", [150] * 31 + [8000], 1),
    ("decode B=1, 8,000", [8000], 1),
    ("decode B=1, 2,000", [2000], 1),
    ("prefill B=1, L=512 after 1,500 cached", [2012], 512),
]


def _time(fn, repeat: int) -> tuple[float, float]:  # noqa: ANN001
    """(wall, CPU) seconds per call, the fastest of ``repeat`` sweeps over the layers. CPU
    time (every thread of this process) is the steadier number on a shared machine."""
    import mlx.core as mx

    mx.eval(fn(0))
    wall = cpu = float("inf")
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        for layer in range(LAYERS):
            mx.eval(fn(layer))
        wall = min(wall, (time.perf_counter() - t0) / LAYERS)
        cpu = min(cpu, (time.process_time() - c0) / LAYERS)
    return wall, cpu


def run_case(
    contexts: list[int],
    q_len: int,
    repeat: int,
    kv_bits: tuple[int, ...] = (),
    group_size: int = 64,
) -> dict[str, float]:
    import mlx.core as mx
    import numpy as np

    from mlxserve.mlx_backend.attention import native
    from mlxserve.mlx_backend.kv.quantization import PackedRows

    rng = np.random.default_rng(0)
    B, S, L = len(contexts), max(contexts), q_len
    rows = sum(contexts) + 1
    pools = [
        (
            mx.array(rng.standard_normal((KV_HEADS * rows, DIM), dtype=np.float32)),
            mx.array(rng.standard_normal((KV_HEADS * rows, DIM), dtype=np.float32)),
        )
        for _ in range(LAYERS)
    ]
    slots = np.zeros((B, S), np.int32)
    start = 1
    for b, n in enumerate(contexts):
        slots[b, :n] = np.arange(start, start + n)
        start += n
    counts = np.array(contexts, np.int32)
    q_start = counts - L
    meta = mx.array(native.padded_runs(counts, 0 * counts, q_start, np.full(B, L), L))
    q = mx.array(rng.standard_normal((B, Q_HEADS, L, DIM), dtype=np.float32))
    flat = mx.array((np.arange(KV_HEADS)[:, None, None] * rows + slots[None]).astype(np.int32))
    k_pos = np.arange(S)[None, None, None, :]
    q_pos = q_start[:, None, None, None] + np.arange(L)[None, None, :, None]
    mask = mx.array((k_pos <= q_pos) & (k_pos < counts[:, None, None, None]))
    mx_slots = mx.array(slots)
    mx.eval(pools, q, mask, flat, meta, mx_slots)

    def gathered(layer: int) -> mx.array:
        k, v = pools[layer]
        keys, values = k[flat].swapaxes(0, 1), v[flat].swapaxes(0, 1)
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.125, mask=mask)

    def ragged(layer: int, over=pools, **quant: int) -> mx.array:  # noqa: ANN001
        k, v = over[layer]
        return native.ragged_attention(
            q,
            k,
            v,
            mx_slots,
            meta,
            None,
            scale=0.125,
            window=0,
            kv_heads=KV_HEADS,
            rows_per_head=rows,
            **quant,
        )

    diff = mx.max(mx.abs(gathered(0) - ragged(0))).item()
    (gather_wall, gather_cpu), (native_wall, native_cpu) = (
        _time(gathered, repeat),
        _time(ragged, repeat),
    )
    out = {
        "gather_ms": gather_wall * 1e3,
        "native_ms": native_wall * 1e3,
        "gather_cpu_ms": gather_cpu * 1e3,
        "native_cpu_ms": native_cpu * 1e3,
        "max_abs_diff": diff,
    }
    for bits in kv_bits:
        fmt = PackedRows(bits, group_size, DIM, mx.float32)
        packed = [(fmt.encode(k), fmt.encode(v)) for k, v in pools]
        mx.eval(packed)
        quant = {"bits": bits, "group_size": group_size}
        k, v = (fmt.dequantize(p) for p in packed[0])
        keys, values = k[flat].swapaxes(0, 1), v[flat].swapaxes(0, 1)
        ref = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.125, mask=mask)
        got = ragged(0, packed, **quant)
        wall, cpu = _time(functools.partial(ragged, over=packed, **quant), repeat)
        out[f"native_{bits}bit_ms"] = wall * 1e3
        out[f"native_{bits}bit_cpu_ms"] = cpu * 1e3
        out[f"max_abs_diff_{bits}bit"] = mx.max(mx.abs(got - ref)).item()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=0, help="kernel threads (0: CPUs)")
    parser.add_argument("--kv-bits", default="", help="also time quantized pools, e.g. 8,4")
    parser.add_argument("--group-size", type=int, default=64)
    args = parser.parse_args(argv)
    kv_bits = tuple(int(b) for b in args.kv_bits.split(",") if b)
    notes = [_env.enable_blas()]
    from mlxserve.mlx_backend.attention import native

    status = native.native_status()
    if not status.active:
        print(f"native attention off: {status.reason}", file=sys.stderr)
        return 1
    if kv_bits and not status.quantized:
        print(f"native attention off for quantized pools: {status.quantized_reason}")
        return 1
    if args.threads:
        native.set_threads(args.threads)
    results = []
    for name, contexts, q_len in CASES:
        r = run_case(contexts, q_len, args.repeat, kv_bits, args.group_size)
        r["case"] = name
        results.append(r)
        quantized = "".join(
            f"  {b}-bit {r[f'native_{b}bit_ms']:7.2f} ms ({r[f'native_{b}bit_cpu_ms']:7.2f} CPU, "
            f"{r[f'native_{b}bit_cpu_ms'] / r['native_cpu_ms']:.2f}x, "
            f"diff {r[f'max_abs_diff_{b}bit']:.1e})"
            for b in kv_bits
        )
        print(
            f"{name:40s} gather {r['gather_ms']:8.2f} ms ({r['gather_cpu_ms']:8.2f} CPU)  "
            f"native {r['native_ms']:7.2f} ms ({r['native_cpu_ms']:7.2f} CPU)  "
            f"max diff {r['max_abs_diff']:.1e}{quantized}"
        )
    report = {
        "versions": _env.mlx_versions(),
        "load_before": os.getloadavg()[0],
        "notes": notes,
        "kernel": status.describe(),
        "kv_bits": list(kv_bits),
        "group_size": args.group_size,
        "threads": native.threads(),
        "results": results,
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
