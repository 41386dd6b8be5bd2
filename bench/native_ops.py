"""The native elementwise ops (``mlx_backend/native_ops.py``) against MLX's own, per call.

For SmolLM2-135M's shapes at a batch-32 decode step and a 512-token prefill chunk, each op is
called as often as one forward calls it (30 layers: one swiglu, two ropes and two norms per
layer, plus the final norm), in one graph, MLX's and the native op alternated; the table
gives the milliseconds of those calls per forward and whether the results are bit-identical.

    .venv/bin/python -m bench.native_ops [--json bench/results/native_ops.json]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

from mlxserve.mlx_backend.cpu.blas import enable_fast_blas

enable_fast_blas()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from mlxserve.mlx_backend import native_ops  # noqa: E402

LAYERS = 30
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 9, 3, 64


def _time(fn: Callable[[], list[mx.array]], repeats: int) -> float:
    mx.eval(fn())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(fn())
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def cases(batch: int, tokens: int) -> dict[str, tuple[Callable, Callable, list[mx.array]]]:
    """Per op: (MLX's call, the native call, the inputs of one forward's calls)."""
    rng = np.random.default_rng(0)

    def arrays(shape, n):
        return [mx.array(rng.standard_normal(shape).astype(np.float32)) for _ in range(n)]

    offset = mx.array(rng.integers(50, 300, batch).astype(np.int32))
    weight = mx.array(rng.standard_normal(HIDDEN).astype(np.float32))
    q_shape = (batch, tokens, HEADS, HEAD_DIM)
    k_shape = (batch, tokens, KV_HEADS, HEAD_DIM)
    rope_args = dict(traditional=False, base=1e5, scale=1.0, offset=offset)
    gates = arrays((batch, tokens, INTERMEDIATE), 2 * LAYERS)
    heads = arrays(q_shape, LAYERS) + arrays(k_shape, LAYERS)
    return {
        "swiglu": (
            lambda g, x: native_ops._mlx_lm_swiglu(g, x),
            native_ops.silu_mul,
            list(zip(gates[::2], gates[1::2], strict=True)),
        ),
        "rope": (
            lambda x: native_ops._mlx_rope(x.transpose(0, 2, 1, 3), HEAD_DIM, **rope_args),
            lambda x: native_ops.rope(x.transpose(0, 2, 1, 3), HEAD_DIM, **rope_args),
            [(h,) for h in heads],
        ),
        "rms_norm": (
            lambda x: native_ops._mlx_rms_norm(x, weight, 1e-5),
            lambda x: native_ops.rms_norm(x, weight, 1e-5),
            [(x,) for x in arrays((batch, tokens, HIDDEN), 2 * LAYERS + 1)],
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    print(native_ops.describe())
    results = []
    for phase, batch, tokens in [("decode B=32", 32, 1), ("prefill L=512", 1, 512)]:
        for op, (mlx_call, native_call, inputs) in cases(batch, tokens).items():
            mx.eval([a for args_ in inputs for a in args_])
            with native_ops.native_forward():
                mlx_ms = _time(lambda: [mlx_call(*a) for a in inputs], args.repeats)  # noqa: B023
                native_ms = _time(lambda: [native_call(*a) for a in inputs], args.repeats)  # noqa: B023
                got = [native_call(*a) for a in inputs[:2]]
            want = [mlx_call(*a) for a in inputs[:2]]
            exact = all(mx.array_equal(g, w).item() for g, w in zip(got, want, strict=True))
            row = dict(phase=phase, op=op, calls=len(inputs), mlx_ms=mlx_ms, native_ms=native_ms,
                       bit_identical=exact)  # fmt: skip
            results.append(row)
            print(
                f"{phase:14s} {op:9s} x{len(inputs):3d}  MLX {mlx_ms:8.2f} ms  native "
                f"{native_ms:7.2f} ms  {mlx_ms / native_ms:5.1f}x  bit-identical {exact}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ops": native_ops.describe(), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
