"""The process's one CPU thread policy: OpenBLAS and the native attention kernel together.

Both run parallel-fors that wait for their slowest thread, so both follow the CPUs other
processes leave free (``blas_threads.py``). Both counts are process-wide, so every executor
(every loaded model, decoder or encoder) steers the same policy.
"""

from __future__ import annotations

from collections.abc import Callable

from mlxserve.mlx_backend.attention import native
from mlxserve.mlx_backend.cpu.blas import adaptive_thread_control, fixed_thread_count
from mlxserve.mlx_backend.cpu.blas_threads import AdaptiveBlasThreads, shared_blas_threads


def _blas_and_attention_control() -> tuple[int, Callable[[int], None]] | None:
    control = adaptive_thread_control()
    if control is None:
        return None
    cpus, set_blas_threads = control

    def set_threads(n: int) -> None:
        set_blas_threads(n)
        native.set_threads(n)

    native.set_threads(cpus)
    return cpus, set_threads


def cpu_thread_policy() -> AdaptiveBlasThreads | None:
    """The shared policy (built on first use); ``None`` where the counts are not ours to
    change (no OpenBLAS shim, or the user fixed ``OPENBLAS_NUM_THREADS``), in which case
    the attention kernel gets the fixed count."""
    policy = shared_blas_threads(_blas_and_attention_control)
    if policy is None:
        native.set_threads(fixed_thread_count())
    return policy
