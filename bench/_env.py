"""The compute environment mlxserve sets up at start, reproduced for the benchmark's peers.

mlxserve (``mlxserve.server.cli``) preloads OpenBLAS for MLX's float32 matmuls
(``mlx_backend/cpu/blas.py``: ``enable_fast_blas``) before MLX is imported, and on the CPU
backend turns 4-bit weights into float32 ones (``mlx_backend/loading/dequantize.py``).
The forward-ceiling loop and the mlx_lm.server wrapper do the same through this module so
that every number compares the same weights under the same BLAS. When those modules are
missing (an older checkout) everything here degrades to a no-op and says so.

Import this module before anything imports ``mlx.core``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def has_module(name: str) -> bool:
    """Whether ``mlx_backend/<name>.py`` exists in this checkout (without importing it)."""
    return (REPO_ROOT / "mlx_backend" / f"{name}.py").is_file()


def enable_blas() -> str:
    """Call ``enable_fast_blas()`` if the checkout has it; returns one line saying what happened.

    Must run before ``mlx.core`` is imported (``mlx_backend/__init__.py`` imports nothing).
    """
    if not has_module("cpu/blas"):
        return "fast BLAS: mlx_backend/cpu/blas.py not present (reference BLAS)"
    if "mlx.core" in sys.modules:
        return "fast BLAS: skipped, mlx.core was imported first"
    from mlxserve.mlx_backend.cpu.blas import enable_fast_blas

    status = enable_fast_blas()
    return f"fast BLAS: {'active' if status.active else 'inactive'}: {status.reason}"


def serving_conversion(loaded: Any) -> str:
    """Convert a loaded model as ``mlxserve`` serves it (the native quantized matmul's
    quantized weights, else float32); returns mlxserve's log line. An older checkout without
    that stage dequantizes."""
    try:
        from mlxserve.server.lifecycle.loading import convert_for_backend
    except ImportError:
        return dequantize(loaded.model)
    return convert_for_backend(loaded) or "no conversion"


def dequantize(model: Any, budget_bytes: int | None = None) -> str:
    """Dequantize ``model`` in place to float32 on the CPU as far as ``budget_bytes`` allows
    (the peers' weights, and mlxserve's before the native quantized matmul); returns one
    line."""
    if not has_module("loading/dequantize"):
        return "dequantize: mlx_backend/loading/dequantize.py not present (weights kept quantized)"
    from mlxserve.mlx_backend.loading.dequantize import dequantize_for_cpu

    return f"dequantize: {dequantize_for_cpu(model, budget_bytes).reason}"


def mlx_versions() -> dict[str, str]:
    """Versions of mlx and mlx-lm (read from package metadata)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("mlx", "mlx-lm", "mlx-cpu"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def find_spec_ok(name: str) -> bool:
    """Whether ``name`` is importable, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
