"""Serve MLX's CPU matmuls from OpenBLAS instead of the reference BLAS in the ``mlx[cpu]`` wheel.

The Linux ``mlx[cpu]`` wheel links a reference (netlib) BLAS: a 1024x1024 float32 matmul takes
about 0.65 s. MLX's CPU matmul calls ``cblas_sgemm``, and libmlx resolves that symbol through the
dynamic linker's global scope before its own dependencies. So a library that exports
``cblas_sgemm`` and is loaded with ``RTLD_GLOBAL`` *before* ``mlx.core`` is imported takes over
every float32 matmul.

``scipy-openblas32`` (a pip wheel, no gfortran needed) exports only prefixed symbols
(``scipy_cblas_sgemm``), so a tiny C shim (``csrc/cblas_shim.c``, built at install by
``setup.py`` into this package as ``_cblas_shim*.so``) exports the plain names libmlx imports
and forwards them; its ``scipy_*`` references resolve against OpenBLAS, loaded globally just
before it. The shim also counts its sgemm calls, which lets :func:`verify_blas` prove that
libmlx really bound to it.

Call :func:`enable_fast_blas` first thing in the process, before anything imports ``mlx.core``.
It never raises: when it cannot help it returns an inactive :class:`BlasStatus` with a reason.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ENV_SWITCH = "MLXSERVE_BLAS"
_OFF_VALUES = {"off", "0", "false", "no", "none", "disable", "disabled"}

# Every BLAS symbol libmlx.so (0.32) imports (`nm -D --undefined-only libmlx.so | grep blas`)
# is forwarded by the shim; the LAPACK ones (sgetrf_, ...) serve linalg only, never inference,
# and stay with the wheel.
SHIM_GLOB = "_cblas_shim*.so"


@dataclass(frozen=True)
class BlasStatus:
    """The outcome of :func:`enable_fast_blas`.

    Attributes:
        active: a fast ``cblas_sgemm`` was loaded into the global symbol scope.
        path: the library that now provides ``cblas_sgemm`` (the shim, or ``MLXSERVE_BLAS``).
        reason: one human-readable line: what was loaded, or why nothing was.
    """

    active: bool
    path: str | None
    reason: str


_lock = threading.Lock()
_status: BlasStatus | None = None
_shim: ctypes.CDLL | None = None  # set only when our own shim is loaded (it has the counter)
_openblas: ctypes.CDLL | None = None  # OpenBLAS under the shim (thread count, version)
_user_threads = False  # the user set OPENBLAS_NUM_THREADS (or GOTO_/OMP_): never change it
_blas: ctypes.CDLL | None = None  # kept referenced so the library is never unloaded


def blas_status() -> BlasStatus | None:
    """The status of the last :func:`enable_fast_blas` call, or None if it never ran."""
    return _status


def enable_fast_blas() -> BlasStatus:
    """Make MLX's CPU float32 matmuls use OpenBLAS; idempotent and thread-safe, never raises.

    Must run before ``mlx.core`` is first imported. CPython loads extensions with
    ``RTLD_NOW``, so libmlx binds ``cblas_sgemm`` during that import (measured: even with no
    matmul run yet, a later preload is ignored). A late call detects this with a test matmul
    and returns inactive, saying why.

    ``MLXSERVE_BLAS=off`` disables this; ``MLXSERVE_BLAS=/path/lib.so`` preloads that library
    instead of the shim (it must export plain ``cblas_sgemm``, e.g. Debian's libopenblas.so.0).
    Unless ``OPENBLAS_NUM_THREADS`` (or ``GOTO_``/``OMP_NUM_THREADS``) is set, OpenBLAS gets
    one thread per CPU this process may use, and the engine adapts the count to what other
    processes leave free (see :func:`_default_thread_count`).

    Returns:
        The :class:`BlasStatus`; the same object on every later call.
    """
    global _status
    with _lock:
        if _status is None:
            try:
                _status = _enable()
            except Exception as e:  # never take the server down for a speed-up
                _status = BlasStatus(False, None, f"fast BLAS setup failed: {e!r}")
        return _status


def _enable() -> BlasStatus:
    global _shim, _blas, _openblas
    if not sys.platform.startswith("linux"):
        return BlasStatus(False, None, f"not Linux ({sys.platform}): MLX uses Metal/Accelerate")
    setting = os.environ.get(ENV_SWITCH, "").strip()
    if setting.lower() in _OFF_VALUES:
        return BlasStatus(False, None, f"disabled by {ENV_SWITCH}={setting}")
    late = "mlx.core" in sys.modules
    _default_thread_count()

    if setting:
        # A bare name ("libopenblas.so.0") is left to the linker's search path.
        path = os.path.abspath(os.path.expanduser(setting)) if "/" in setting else setting
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            return BlasStatus(False, None, f"{ENV_SWITCH}={setting} could not be loaded: {e}")
        if not hasattr(lib, "cblas_sgemm"):
            return BlasStatus(False, None, f"{ENV_SWITCH}={setting} does not export cblas_sgemm")
        _blas = lib
        what = f"cblas_sgemm from {path} ({ENV_SWITCH})"
    else:
        openblas = _scipy_openblas_lib()
        if openblas is None:
            return BlasStatus(False, None, "scipy-openblas32 is not installed")
        shim_path = _packaged_shim()
        if shim_path is None:
            return BlasStatus(
                False, None, "the OpenBLAS shim was not built at install (see setup.py)"
            )
        try:
            # OpenBLAS first, globally: the shim's scipy_cblas_* references resolve to it.
            lib = ctypes.CDLL(str(openblas), mode=ctypes.RTLD_GLOBAL)
            shim = ctypes.CDLL(str(shim_path), mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            return BlasStatus(False, None, f"the BLAS shim could not be loaded: {e}")
        _shim = _blas = shim
        _openblas = lib
        path = str(shim_path)
        what = f"cblas_sgemm from OpenBLAS {_openblas_version(lib)} via {shim_path.name}"
    threads = _openblas_threads(_openblas) or os.environ.get("OPENBLAS_NUM_THREADS", "?")
    # CPython dlopens extensions with RTLD_NOW, so libmlx normally bound cblas_sgemm at import;
    # only our shim's call counter can tell whether it did (a MLXSERVE_BLAS library cannot).
    if late and not (_shim is not None and _matmul_uses_loaded_blas()):
        return BlasStatus(
            False,
            path,
            f"loaded {what} but mlx.core was imported first and keeps the reference BLAS; "
            "call enable_fast_blas() before any mlx import",
        )
    return BlasStatus(
        True, path, f"{what}, OpenBLAS threads: {threads}" + (" (late)" if late else "")
    )


def verify_blas() -> bool:
    """Check, after importing mlx, that MLX's float32 matmul is right and uses the loaded BLAS.

    Multiplies two small random matrices with MLX and with numpy (relative error 1e-3).
    With our shim it also checks the shim's sgemm call counter went up, which proves libmlx
    bound to it (with a ``MLXSERVE_BLAS`` library only the numbers can be checked).

    Returns:
        True when the result is right and, with the shim, served by it; False otherwise
        (including when :func:`enable_fast_blas` did not activate anything).
    """
    status = _status
    return status is not None and status.active and _matmul_uses_loaded_blas()


def _matmul_uses_loaded_blas() -> bool:
    """An MLX CPU matmul is right and, when our shim is loaded, went through it."""
    try:
        import mlx.core as mx
        import numpy as np

        rng = np.random.default_rng(0)
        a = rng.standard_normal((96, 80), dtype=np.float32)
        b = rng.standard_normal((80, 72), dtype=np.float32)
        before = _shim_calls()
        with mx.stream(mx.cpu):
            out = np.array(mx.matmul(mx.array(a), mx.array(b)))
        expected = a.astype(np.float64) @ b.astype(np.float64)
        right = bool(np.abs(out - expected).max() <= 1e-3 * np.abs(expected).max())
        used = _shim is None or _shim_calls() > before
        return right and used
    except Exception:
        return False


def _shim_calls() -> int:
    if _shim is None:
        return 0
    fn = _shim.mlxserve_shim_sgemm_calls
    fn.restype = ctypes.c_long
    return int(fn())


def _default_thread_count() -> None:
    """Set ``OPENBLAS_NUM_THREADS`` unless the user chose a count; OpenBLAS reads it at load.

    MLX runs its CPU ops on one stream thread, and that thread is the one calling sgemm, so
    OpenBLAS's threads are MLX's only compute threads. OpenBLAS starts one per CPU; the engine
    then lowers and raises the count as other processes take and free CPUs
    (``blas_threads.py``), because an OpenBLAS gemm waits for all its threads and
    one that is not scheduled stalls it. Measured on this 2-CPU VM (SmolLM2, 32 requests,
    ``bench/engine_steps.py``): idle, 2 threads prefill in 19.6 s and decode a batch-32 step in
    540 ms where 1 thread takes 26.6 s and 651 ms; with one other busy process, 2 threads take
    44.3 s and 1,307 ms while 1 thread stays at 27.1 s and 654 ms.
    """
    global _user_threads
    _user_threads = any(
        os.environ.get(k) for k in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")
    )
    if not _user_threads:
        os.environ["OPENBLAS_NUM_THREADS"] = str(_cpu_count())


def adaptive_thread_control() -> tuple[int, Callable[[int], None]] | None:
    """``(CPUs, set_threads)`` when the engine may change OpenBLAS's thread count: our shim is
    active and the user did not fix the count (``OPENBLAS_NUM_THREADS`` and the like).
    ``None`` otherwise."""
    status = _status
    if _shim is None or _openblas is None or _user_threads or status is None or not status.active:
        return None
    try:
        fn = _openblas.scipy_openblas_set_num_threads
    except AttributeError:
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = None
    return _cpu_count(), lambda n: fn(int(n))


def fixed_thread_count() -> int:
    """The thread count to use where it is not adapted: ``OPENBLAS_NUM_THREADS`` when the
    user set it, else one per CPU this process may use."""
    try:
        return max(1, int(os.environ.get("OPENBLAS_NUM_THREADS", "")))
    except ValueError:
        return _cpu_count()


def _openblas_threads(lib: ctypes.CDLL | None) -> str | None:
    """The thread count OpenBLAS actually uses (shim only), as text."""
    if lib is None:
        return None
    try:
        fn = lib.scipy_openblas_get_num_threads
        fn.restype = ctypes.c_int
        return str(fn())
    except Exception:
        return None


def _cpu_count() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))  # respects taskset / container cpusets
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _scipy_openblas_lib() -> Path | None:
    """Where ``libscipy_openblas.so`` is, found without importing the package."""
    try:
        spec = importlib.util.find_spec("scipy_openblas32")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    lib_dir = Path(list(spec.submodule_search_locations)[0]) / "lib"
    libs = sorted(lib_dir.glob("libscipy_openblas*.so"))
    return libs[0].resolve() if libs else None


def _packaged_shim() -> Path | None:
    """The shim ``setup.py`` built into this package, or None."""
    found = sorted(Path(__file__).resolve().parent.glob(SHIM_GLOB))
    return found[0] if found else None


def _openblas_version(lib: ctypes.CDLL) -> str:
    try:
        fn = lib.scipy_openblas_get_config
        fn.restype = ctypes.c_char_p
        return fn().decode().split()[1]  # "OpenBLAS 0.3.30 DYNAMIC_ARCH ..."
    except Exception:
        return "(version unknown)"
