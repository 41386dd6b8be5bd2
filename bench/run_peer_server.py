"""Run a peer server (vllm-mlx, or mlx_lm.server of another mlx-lm) in the peers' venv with
mlxserve's BLAS: ``bench/peers.py`` builds the command lines.

Run by the peers' own python (``bench/.peer-venv``), which has neither mlxserve nor this
repository on its path: this file imports nothing from either. With ``--openblas`` and
``--shim`` it loads OpenBLAS and mlxserve's cblas shim globally before MLX is imported, as
``mlx_backend/cpu/blas.py`` does, so libmlx's sgemm binds to OpenBLAS (one thread per CPU,
unless ``OPENBLAS_NUM_THREADS`` is set). mlx_lm.server gets a listen backlog of 128, as in
``bench/run_mlx_lm_server.py`` (with socketserver's default of 5 a burst of 32 requests
loses connections). Usage::

    bench/.peer-venv/bin/python bench/run_peer_server.py --openblas LIB --shim SHIM \
        vllm-mlx serve MODEL_DIR --port 8081 --continuous-batching
    bench/.peer-venv/bin/python bench/run_peer_server.py mlx_lm.server --model DIR --port 8081
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys


def preload_blas(openblas: str, shim: str) -> str:
    """OpenBLAS, then the shim, both RTLD_GLOBAL, before ``mlx.core`` is imported."""
    if "mlx.core" in sys.modules:
        return "mlx.core already imported: MLX keeps its bundled BLAS"
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    ctypes.CDLL(openblas, mode=ctypes.RTLD_GLOBAL)
    ctypes.CDLL(shim, mode=ctypes.RTLD_GLOBAL)
    return f"OpenBLAS {openblas} via {shim}, threads {os.environ['OPENBLAS_NUM_THREADS']}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    p.add_argument("--openblas")
    p.add_argument("--shim")
    p.add_argument("server", choices=("vllm-mlx", "mlx_lm.server"))
    args, rest = p.parse_known_args(argv)
    if args.openblas and args.shim:
        print(f"[run_peer_server] {preload_blas(args.openblas, args.shim)}", file=sys.stderr)
    else:
        print("[run_peer_server] MLX's bundled BLAS (no --openblas/--shim)", file=sys.stderr)
    if args.server == "vllm-mlx":
        from vllm_mlx import cli

        sys.argv = ["vllm-mlx", *rest]
        cli.main()
        return 0
    import socketserver

    # ThreadingHTTPServer reads this class attribute when it starts listening.
    socketserver.TCPServer.request_queue_size = 128
    import mlx_lm
    from mlx_lm import server

    print(f"[run_peer_server] mlx-lm {mlx_lm.__version__}", file=sys.stderr)
    sys.argv = ["mlx_lm.server", *rest]
    server.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
