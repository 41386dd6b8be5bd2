"""One-row products (a decode step of one sequence): OpenBLAS's sgemm vs its sgemv, and MLX.

Every linear layer of a one-sequence decode step is a vector times a weight matrix. libmlx
hands it to ``cblas_sgemm`` with m == 1; OpenBLAS's sgemm packs the weights first and reads
them far below memory bandwidth, its sgemv streams them. ``csrc/cblas_shim.c`` therefore
sends m == 1 and n == 1 products to sgemv. This prints, per SmolLM2-135M weight shape (and
one large matrix), the bytes of weights read per second by OpenBLAS's sgemm with m == 1 and
by its sgemv (both called directly through ctypes), and by MLX's ``x @ W.T`` through the
shim. The small matrices stay in the CPU's caches between calls (the first four rows);
the large ones are read from memory. Example::

    .venv/bin/python -m bench.blas_gemv --json bench/results/blas_gemv.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from functools import partial
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _env  # noqa: E402  (no mlx import: must precede mlx.core)

# (name, rows N, columns K) of W in y = W x; SmolLM2-135M's projections and tied lm_head.
SHAPES = [
    ("q/o proj 576x576", 576, 576),
    ("k/v proj 192x576", 192, 576),
    ("gate/up proj 1536x576", 1536, 576),
    ("down proj 576x1536", 576, 1536),
    ("lm_head 49152x576", 49152, 576),
    ("8192x8192", 8192, 8192),
]
ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112


def openblas() -> ctypes.CDLL:
    from mlxserve.mlx_backend.cpu.blas import _scipy_openblas_lib

    lib = ctypes.CDLL(str(_scipy_openblas_lib()))
    i, f, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    lib.scipy_cblas_sgemm.argtypes = [i] * 6 + [f, p, i, p, i, f, p, i]
    lib.scipy_cblas_sgemv.argtypes = [i, i, i, i, f, p, i, p, i, f, p, i]
    return lib


def per_call(fn, weight_bytes: int) -> float:  # noqa: ANN001
    """Median seconds of ``fn()`` over enough calls to read ~1.5 GB of weights."""
    fn()
    times = []
    for _ in range(max(5, int(1.5e9 // weight_bytes))):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write the table here too")
    args = ap.parse_args()
    print(_env.enable_blas())
    import mlx.core as mx
    import numpy as np

    lib = openblas()
    rng = np.random.default_rng(0)
    rows = []
    print(f"{'shape':<24}{'sgemm m=1':>12}{'sgemv':>10}{'MLX x@W.T':>12}   (GB/s of weights)")
    for name, n, k in SHAPES:
        w = rng.random((n, k), dtype=np.float32)
        x = rng.random((1, k), dtype=np.float32)
        y = np.zeros((1, n), np.float32)
        wp, xp, yp = w.ctypes.data, x.ctypes.data, y.ctypes.data
        gemm_args = (ROW_MAJOR, NO_TRANS, TRANS, 1, n, k, 1.0, xp, k, wp, k, 0.0, yp, n)
        gemm = per_call(partial(lib.scipy_cblas_sgemm, *gemm_args), w.nbytes)
        gemv_args = (ROW_MAJOR, NO_TRANS, n, k, 1.0, wp, k, xp, 1, 0.0, yp, 1)
        gemv = per_call(partial(lib.scipy_cblas_sgemv, *gemv_args), w.nbytes)
        wm, xm = mx.array(w), mx.array(x)
        mx.eval(wm, xm)
        mlx = per_call(partial(lambda a, b: mx.eval(a @ b.T), xm, wm), w.nbytes)
        row = {
            "shape": name,
            "sgemm_m1_gbps": w.nbytes / gemm / 1e9,
            "sgemv_gbps": w.nbytes / gemv / 1e9,
            "mlx_gbps": w.nbytes / mlx / 1e9,
        }
        rows.append(row)
        print(
            f"{name:<24}{row['sgemm_m1_gbps']:>12.1f}{row['sgemv_gbps']:>10.1f}"
            f"{row['mlx_gbps']:>12.1f}"
        )
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "versions": _env.mlx_versions()}, indent=1))


if __name__ == "__main__":
    main()
