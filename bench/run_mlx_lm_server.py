"""Run ``mlx_lm.server`` in the compute environment mlxserve uses, for a fair comparison.

It calls mlxserve's ``enable_fast_blas()`` before MLX is imported (same OpenBLAS sgemm) and,
with ``--dequantize`` on (``auto``: when this checkout's mlxserve dequantizes, i.e. when
``mlx_backend/loading/dequantize.py`` exists), serves a float32 copy of the model directory
written with mlxserve's own ``dequantize_for_cpu``, so that both servers compute with the same
weights.
Every other argument goes to ``mlx_lm.server`` unchanged.

``--listen-backlog`` (default 128) raises the listen backlog of mlx_lm.server's
``ThreadingHTTPServer`` from socketserver's default of 5: with that default, a burst of 32
concurrent requests loses some connections (the client sees the connection closed before any
response; measured here 3-14 of 32 per burst, none with 128). ``--listen-backlog 0`` keeps 5.

Usage::

    .venv/bin/python bench/run_mlx_lm_server.py --model /tmp/smollm2-mlx --port 8081 \
        --decode-concurrency 32 --prompt-concurrency 32
    .venv/bin/python bench/run_mlx_lm_server.py --model DIR --prepare-only  # write the copy
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _env  # noqa: E402  (no mlx import: must precede mlx.core)

_QUANT_KEYS = ("quantization", "quantization_config")


def is_quantized(model_dir: Path) -> bool:
    """Whether the model directory's config declares quantized weights."""
    config = json.loads((model_dir / "config.json").read_text())
    return any(k in config for k in _QUANT_KEYS)


def float32_dir_for(model_dir: Path, cache_root: Path | None = None) -> Path:
    """Where the float32 copy of ``model_dir`` lives (keyed by its path, size and mtime)."""
    h = hashlib.sha256()
    for f in sorted(model_dir.glob("*")):
        st = f.stat()
        h.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    h.update(str(model_dir.resolve()).encode())
    root = cache_root or Path(os.environ.get("TMPDIR", "/tmp"))
    return root / f"{model_dir.name}-f32-{h.hexdigest()[:12]}"


def write_float32_copy(model_dir: Path, out_dir: Path) -> str:
    """Load ``model_dir`` with mlx-lm, dequantize it as mlxserve does, save it to ``out_dir``.

    Returns:
        One line saying what was done. Written to a temp name first, then renamed.
    """
    from mlx_lm.utils import load, save

    model, tokenizer, config = load(str(model_dir), return_config=True)
    line = _env.dequantize(model)
    for key in _QUANT_KEYS:
        config.pop(key, None)
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save(tmp, model_dir, model, tokenizer, config)
    # Tokenizer and template files exactly as mlxserve reads them (mlx-lm re-saves them through
    # transformers, which may rename classes): copy every file but the config and weights.
    for extra in model_dir.iterdir():
        if extra.is_file() and extra.name != "config.json" and "safetensors" not in extra.name:
            shutil.copy2(extra, tmp / extra.name)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return f"{line}; wrote {out_dir}"


def resolve_model(model: str, mode: str) -> tuple[str, str]:
    """The model directory the peer should serve, and a line saying why.

    Args:
        model: the ``--model`` given (a local directory).
        mode: ``on``, ``off`` or ``auto`` (on when this checkout's mlxserve dequantizes).
    """
    model_dir = Path(model)
    want = mode == "on" or (mode == "auto" and _env.has_module("loading/dequantize"))
    if not want:
        return model, f"serving {model} as is (--dequantize {mode})"
    if not model_dir.is_dir() or not is_quantized(model_dir):
        return model, f"serving {model} as is (not a quantized model directory)"
    out = float32_dir_for(model_dir)
    if (out / "config.json").is_file():
        return str(out), f"serving the float32 copy {out} (cached)"
    return str(out), write_float32_copy(model_dir, out)


def main(argv: list[str] | None = None) -> int:
    """Set up BLAS, pick the weights, then hand over to ``mlx_lm.server.main``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    p.add_argument("--model", required=True)
    p.add_argument("--dequantize", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--no-fast-blas", action="store_true", help="leave MLX's BLAS as it is")
    p.add_argument("--prepare-only", action="store_true", help="write the copy, then exit")
    p.add_argument("--listen-backlog", type=int, default=128, help="0: socketserver's 5")
    args, rest = p.parse_known_args(argv)
    blas = "fast BLAS: disabled by --no-fast-blas" if args.no_fast_blas else _env.enable_blas()
    print(f"[run_mlx_lm_server] {blas}", file=sys.stderr, flush=True)
    model, why = resolve_model(args.model, args.dequantize)
    print(f"[run_mlx_lm_server] {why}", file=sys.stderr, flush=True)
    if args.prepare_only:
        print(model)
        return 0
    if args.listen_backlog > 0:
        import socketserver

        # ThreadingHTTPServer reads this class attribute when it starts listening.
        socketserver.TCPServer.request_queue_size = args.listen_backlog
        print(f"[run_mlx_lm_server] listen backlog {args.listen_backlog}", file=sys.stderr)
    from mlx_lm import server

    sys.argv = ["mlx_lm.server", "--model", model, *rest]
    server.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
