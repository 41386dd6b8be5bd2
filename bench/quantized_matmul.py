"""The native quantized matmul against float32 weights through OpenBLAS, per product.

``mlx_backend/quantized_matmul.py`` serves a model's 4- and 8-bit layers quantized; before,
the CPU path dequantized them to float32 for OpenBLAS's sgemm. This prints, per SmolLM2-135M
weight shape and number of x rows (a decode step's batch, or a prefill chunk), the time of one
product: the native op on the packed weights, its path from ``DENSE_ROWS`` rows on (the
native dequantize, then sgemm), and ``x @ W.T`` on the float32 weights. Thirty copies of each
layer shape are cycled, as a forward's thirty layers are, so the weights come from memory
(the lm_head is one matrix, 49152 x 576). Example::

    .venv/bin/python -m bench.quantized_matmul --json bench/results/quantized_matmul.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _env  # noqa: E402  (no mlx import: must precede mlx.core)

# (name, rows N, columns K, bits, copies cycled): SmolLM2-135M's layers (4-bit, group 32)
# and its tied embedding and head (8-bit).
SHAPES = [
    ("gate/up 1536x576", 1536, 576, 4, 30),
    ("down 576x1536", 576, 1536, 4, 30),
    ("q/o 576x576", 576, 576, 4, 30),
    ("lm_head 49152x576 8-bit", 49152, 576, 8, 1),
]
ROWS = [1, 4, 16, 32, 64, 256, 512, 1024]
GROUP_SIZE = 32


def per_product_ms(fn, copies: int, seconds: float = 0.5) -> float:  # noqa: ANN001
    """Median over rounds of one lazy graph of ``copies`` products, per product."""
    import mlx.core as mx

    mx.eval(fn())
    times = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds or len(times) < 3:
        t = time.perf_counter()
        mx.eval(fn())
        times.append((time.perf_counter() - t) / copies)
    return sorted(times)[len(times) // 2] * 1e3


def _paths(module, x, packed, dense, args):  # noqa: ANN001, ANN202
    """The three ways of one layer's products: as served, the kernel alone, float32."""
    from mlxserve.mlx_backend import quantized_matmul as qmm

    return (
        lambda: [qmm.product(module, x, *p, **args) for p in packed],
        lambda: [module.quantized_matmul(x, *p, **args) for p in packed],
        lambda: [x @ d.T for d in dense],
    )


def run() -> dict:
    """Time every shape and row count; returns the rows of the table."""
    notes = [_env.enable_blas()]
    import mlx.core as mx

    from mlxserve.mlx_backend import quantized_matmul as qmm
    from mlxserve.mlx_backend.attention import native

    module, why = native.extension()
    if module is None:
        raise SystemExit(f"native extension unavailable: {why}")
    results = []
    for name, n, k, bits, copies in SHAPES:
        packed, dense = [], []
        for _ in range(copies):
            w, s, b = mx.quantize(mx.random.normal((n, k)), group_size=GROUP_SIZE, bits=bits)
            d = mx.dequantize(w, s, b, group_size=GROUP_SIZE, bits=bits, dtype=mx.float32)
            mx.eval(w, s, b, d)
            packed.append((w, s, b))
            dense.append(d)
        for rows in ROWS:
            x = mx.random.normal((rows, k))
            mx.eval(x)
            args = {"group_size": GROUP_SIZE, "bits": bits}
            served_ms, kernel_ms, dense_ms = (
                per_product_ms(fn, copies) for fn in _paths(module, x, packed, dense, args)
            )
            results.append(
                {
                    "shape": name,
                    "rows": rows,
                    "served_ms": served_ms,
                    "kernel_ms": kernel_ms,
                    "float32_ms": dense_ms,
                }
            )
            print(json.dumps(results[-1]), flush=True)
    return {"notes": notes, "dense_rows": qmm.DENSE_ROWS, "results": results}


def markdown(summary: dict) -> str:
    """The table for docs/benchmarks.md."""
    lines = [
        "| shape | x rows | served (ms) | native kernel (ms) | float32 sgemm (ms) | "
        "float32 / served |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in summary["results"]:
        lines.append(
            f"| {r['shape']} | {r['rows']} | {r['served_ms']:.3f} | {r['kernel_ms']:.3f} | "
            f"{r['float32_ms']:.3f} | {r['float32_ms'] / r['served_ms']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: prints one JSON line per measurement, then the markdown table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="write the summary here")
    args = p.parse_args(argv)
    summary = run()
    print(markdown(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
