"""The dispatch point for the elementwise work of mlx-lm's models on the CPU: ``swiglu``,
``mx.fast.rope`` and ``mx.fast.rms_norm`` from native ops that compute what MLX computes, bit
for bit, at SIMD width.

MLX's CPU backend (``mlx[cpu]`` 0.32) runs its exp, sin and cos one element at a time, with
its fused multiply-adds in libm: ~21 ns per element. That makes the MLP's activation
(``silu(gate) * x``) a fifth of a batch-32 decode step and a third of a prefill; and
``mx.fast.rope`` and ``mx.fast.rms_norm``, which on the CPU are graphs of a dozen and of
seven ops (cos and sin per element, sum, rsqrt, ...), another tenth. The native ops
(``csrc/mlx_math.h``, ``activation_kernel.cpp``, ``rope_kernel.cpp``, ``norm_kernel.cpp``)
repeat MLX's own formulas operation for operation, in MLX's order, so their results are
bit-identical to MLX's; each self-test checks that and the plan's line reports it.

- ``swiglu``, opt-in (``MLXSERVE_NATIVE_SWIGLU=on``): most mlx-lm models compute their MLP's
  activation with ``swiglu`` from ``mlx_lm.models.activations``, a name each model module
  (and ``switch_layers`` for MoE experts) binds at import; with the opt-in
  :func:`plan_native_ops` rebinds it in the modules the loaded model's layers come from.
  DESIGN.md keeps rebinding names in model code to the one attention dispatch point, hence
  off by default.
- ``mx.fast.rope`` and ``mx.fast.rms_norm``: called through ``mx.fast`` by ``nn.RoPE``,
  ``nn.RMSNorm`` and mlx-lm's own rope and norm classes; the plan replaces the attributes of
  ``mlx.core.fast`` with :func:`rope` and :func:`rms_norm` (once per process).

- ``mx.quantized_matmul`` (``quantized_matmul.py``): for models kept quantized on the CPU
  (too large as float32), 4- and 8-bit products without MLX's naive kernel; equal to the
  float32 product up to the order of the sums, not bit-identical.

The replacements serve a call from the native op only inside :func:`native_forward`, the
scope the executor opens around its own forwards, and only for what the op computes
(float32, no stream given); every other call, mlx-lm's own generation in the same process
included, gets MLX's or mlx-lm's function unchanged. A one-token probe forward at load says
which of them the model reaches. ``MLXSERVE_NATIVE_OPS=mlx`` turns them all off.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import activations as mlx_lm_activations
from mlx_lm.models.cache import KVCache

from mlxserve.mlx_backend.attention import native
from mlxserve.mlx_backend.model_modules import rebind_in_model_modules

logger = logging.getLogger(__name__)

ENV_SWITCH = "MLXSERVE_NATIVE_OPS"
_OFF_VALUES = {"mlx", "off", "0", "false", "no"}
# swiglu is served by rebinding a name in the model's own modules, which DESIGN.md reserves
# for the one attention dispatch point ("nothing else in model code is replaced"); so it is
# opt-in. rope and RMS norm replace MLX's functions, not model code, and are on by default.
SWIGLU_SWITCH = "MLXSERVE_NATIVE_SWIGLU"
_ON_VALUES = {"on", "1", "true", "yes"}


def swiglu_opted_in() -> bool:
    """Whether ``MLXSERVE_NATIVE_SWIGLU`` asks for the native swiglu (rebound in the loaded
    model's modules)."""
    return os.environ.get(SWIGLU_SWITCH, "").strip().lower() in _ON_VALUES


# MLX's and mlx-lm's own functions, kept before anything is replaced.
_mlx_lm_swiglu = mlx_lm_activations.swiglu
_mlx_rope = mx.fast.rope
_mlx_rms_norm = mx.fast.rms_norm
mlx_quantized_matmul = mx.quantized_matmul
# The self-tests' tolerance, relative to float64 (MLX's own swiglu is within 1.4e-6); the
# ops are used when within it, and reported bit-identical when they are.
SELF_TEST_TOLERANCE = 1e-5
MAX_ROPE_DIMS = 1024  # csrc/rope_kernel.h
# What each op replaces, for the plan's line.
_OP_NAMES = {
    "swiglu": "swiglu",
    "rope": "mx.fast.rope",
    "rms_norm": "mx.fast.rms_norm",
    "quantized_matmul": "mx.quantized_matmul",
}


class _Scope(threading.local):
    on: bool = False
    served: dict[str, int] | None = None  # set by the load-time probe: calls per op


_scope = _Scope()
_module: ModuleType | None = None
_swiglu_enabled = False  # the last plan's opt-in (MLXSERVE_NATIVE_SWIGLU)


@contextlib.contextmanager
def native_forward(active: bool = True) -> Iterator[None]:
    """Calls of the replaced functions on this thread take the native ops (when
    ``active``)."""
    before = _scope.on
    _scope.on = active
    try:
        yield
    finally:
        _scope.on = before


# ------------------------------------------------------------------ swiglu
def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """mlx-lm's ``swiglu``, from the native op inside :func:`native_forward`."""
    if (
        _scope.on
        and _swiglu_enabled
        and _module is not None
        and gate.dtype == mx.float32
        and x.dtype == mx.float32
        and gate.shape == x.shape
    ):
        count_served("swiglu")
        return silu_mul(gate, x)
    return _mlx_lm_swiglu(gate, x)


def serving_module() -> ModuleType | None:
    """The extension, when this thread is inside :func:`native_forward` and the ops serve."""
    return _module if _scope.on else None


def count_served(op: str) -> None:
    """Count one call the native op served, for the load-time probe."""
    if _scope.served is not None:
        _scope.served[op] = _scope.served.get(op, 0) + 1


def silu_mul(gate: mx.array, x: mx.array) -> mx.array:
    """The native op: ``silu(gate) * x`` of float32 arrays of one shape.

    Raises:
        RuntimeError: the ops are not available here (:func:`plan_native_ops` says why).
    """
    return _loaded().silu_mul(gate, x)


# ------------------------------------------------------------------ rope
def rope(
    a: mx.array,
    dims: int,
    *,
    traditional: bool,
    base: float | None,
    scale: float,
    offset: int | mx.array,
    freqs: mx.array | None = None,
    stream: mx.Stream | mx.Device | None = None,
) -> mx.array:
    """``mx.fast.rope``, from the native op inside :func:`native_forward`."""
    args = dict(traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs)
    if _scope.on and _module is not None and stream is None:
        out = _native_rope(a, dims, **args)
        if out is not None:
            count_served("rope")
            return out
    return _mlx_rope(a, dims, **args, stream=stream)


def _native_rope(a, dims, *, traditional, base, scale, offset, freqs) -> mx.array | None:  # noqa: ANN001
    """The native op's answer, or None for a call it does not take (MLX then validates)."""
    if a.dtype != mx.float32 or a.ndim < 3 or (base is None) == (freqs is None):
        return None
    if not (0 < dims <= min(a.shape[-1], MAX_ROPE_DIMS)) or dims % 2:
        return None
    if isinstance(offset, int):
        offset = mx.array([offset], dtype=mx.int32)
    elif not isinstance(offset, mx.array) or offset.ndim > 1:
        return None
    elif offset.dtype in (mx.int8, mx.int16, mx.int64):
        offset = offset.astype(mx.int32)  # as MLX does with integers of other widths
    if offset.dtype != mx.int32 or offset.size not in (1, a.shape[0]):
        return None
    if freqs is not None:
        if freqs.ndim != 1 or freqs.shape[0] != dims // 2:
            return None
        freqs = freqs.astype(mx.float32)
    return rope_op(a, dims, traditional, 1.0 if base is None else base, scale, offset, freqs)


def rope_op(a, dims, traditional, base, scale, offset, freqs) -> mx.array:  # noqa: ANN001
    """The native op on ``a`` viewed as ``[B, N, T, D]``, as MLX's CPU graph views it."""
    shape = a.shape
    x = a.reshape(shape[0], -1, shape[-2], shape[-1])
    out = _loaded().rope(
        x,
        dims,
        traditional=traditional,
        base=float(base),
        scale=float(scale),
        offset=offset,
        freqs=freqs,
    )
    return out.reshape(shape)


# ------------------------------------------------------------------ rms_norm
def rms_norm(
    x: mx.array,
    weight: mx.array | None,
    eps: float,
    *,
    stream: mx.Stream | mx.Device | None = None,
) -> mx.array:
    """``mx.fast.rms_norm``, from the native op inside :func:`native_forward`."""
    if (
        _scope.on
        and _module is not None
        and stream is None
        and x.dtype == mx.float32
        and x.ndim >= 1
        and x.shape[-1] > 0
        and (weight is None or (weight.dtype == mx.float32 and weight.shape == x.shape[-1:]))
    ):
        count_served("rms_norm")
        return rms_norm_op(x, weight, eps)
    return _mlx_rms_norm(x, weight, eps, stream=stream)


def rms_norm_op(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    """The native op: ``x * rsqrt(mean(x^2, -1) + eps) * weight`` as MLX's CPU graph."""
    return _loaded().rms_norm(x, weight, float(eps))


# ------------------------------------------------------------------ the plan
@dataclass(frozen=True)
class NativeOpsPlan:
    """Whether the loaded model's forwards take the native ops.

    Attributes:
        active: the ops serve calls inside :func:`native_forward`.
        path: one line for the start-up log.
        ops: the ops the model's forward reaches ("swiglu", "rope", "rms_norm").
    """

    active: bool
    path: str
    ops: tuple[str, ...] = ()


def plan_native_ops(model: nn.Module) -> NativeOpsPlan:
    """Decide, once at load, whether ``model``'s forwards take the native ops: replace
    ``mx.fast.rope`` and ``mx.fast.rms_norm``, with ``MLXSERVE_NATIVE_SWIGLU`` rebind
    ``swiglu`` in the model's modules, and run one probe forward to see which of them the
    model's layers reach."""
    if mx.default_device().type != mx.cpu:
        return NativeOpsPlan(False, "MLX's (MLX runs on the GPU)")
    why = _unavailable()
    if why is not None:
        return NativeOpsPlan(False, f"MLX's ({why})")
    from mlxserve.mlx_backend import quantized_matmul

    mx.fast.rope = rope  # idempotent; outside native_forward they are MLX's own
    mx.fast.rms_norm = rms_norm
    mx.quantized_matmul = quantized_matmul.quantized_matmul
    global _swiglu_enabled
    _swiglu_enabled = swiglu_opted_in()
    if _swiglu_enabled:
        rebind_in_model_modules(
            model, "swiglu", _mlx_lm_swiglu, swiglu, mlx_lm_activations.__name__
        )
    try:
        served = _probe(model)
    except Exception as e:  # noqa: BLE001 - a model the probe cannot run keeps MLX's path
        return NativeOpsPlan(False, f"MLX's (the probe forward failed: {e!r})")
    if not served:
        return NativeOpsPlan(False, "MLX's (the model calls none of the ops served)")
    return NativeOpsPlan(True, _path_line(served), tuple(served))


def describe() -> str:
    """One line for ``--version``, ``/version`` and the start-up log: whether the ops can
    serve in this process, and how exactly."""
    if mx.default_device().type != mx.cpu:
        return "MLX's (MLX runs on the GPU)"
    why = _unavailable()
    if why is not None:
        return f"MLX's ({why})"
    return _path_line([op for op in _OP_NAMES if op != "swiglu" or swiglu_opted_in()])


def _path_line(ops: list[str]) -> str:
    """ "native <ops> (<ISA>, bit-identical to MLX's)", as their self-tests found them; the
    quantized matmul, which sums in its own order, on a clause of its own."""
    elementwise = [op for op in ops if op != "quantized_matmul"]
    exact = (
        "bit-identical to" if all(_bit_identical[op] for op in elementwise) else "within 1e-5 of"
    )
    clauses = []
    if elementwise:
        names = ", ".join(_OP_NAMES[op] for op in elementwise)
        clauses.append(f"{names} ({_module.kernel_isa()}, {exact} MLX's)")
    if "quantized_matmul" in ops:
        clauses.append(f"mx.quantized_matmul ({_module.kernel_isa()}, within 1e-5 of float64)")
    return "native " + "; ".join(clauses)


def _probe(model: nn.Module) -> list[str]:
    """The ops a 2-token forward through the model's own caches reaches, in order."""
    caches = model.make_cache() if hasattr(model, "make_cache") else None
    if caches is None:
        caches = [KVCache() for _ in model.layers]
    _scope.served = {}
    try:
        with native_forward():
            mx.eval(model(mx.array([[0, 0]], dtype=mx.int32), cache=caches))
        return [op for op in _OP_NAMES if _scope.served.get(op)]
    finally:
        _scope.served = None


_lock = threading.Lock()
_checked: str | None = None  # "" once the ops passed their self-tests, else why not
_bit_identical: dict[str, bool] = {}  # per op: its self-test output equals MLX's


def unavailable_reason() -> str | None:
    """Why the native ops cannot serve in this process (checked once), or None."""
    return _unavailable()


def _loaded() -> ModuleType:
    if _module is None:
        raise RuntimeError(f"native ops are not available: {_unavailable()}")
    return _module


def _unavailable() -> str | None:
    """Why the ops cannot serve here (checked once per process), or None."""
    global _checked, _module
    with _lock:
        if _checked is None:
            setting = os.environ.get(ENV_SWITCH, "").strip().lower()
            module, why = native.extension()
            if setting in _OFF_VALUES:
                _checked = f"disabled by {ENV_SWITCH}={setting}"
            elif module is None:
                _checked = why
            else:
                from mlxserve.mlx_backend import quantized_matmul

                try:
                    error = (
                        _self_test_swiglu(module)
                        or _self_test_rope(module)
                        or _self_test_rms_norm(module)
                        or quantized_matmul.self_test(module)
                    )
                except Exception as e:  # noqa: BLE001 - never take the server down for a speed-up
                    error = repr(e)
                _checked = "" if error is None else f"self-test failed: {error}"
                _module = module if error is None else None
            if _checked:
                logger.warning("native ops off: %s", _checked)
        return _checked or None


def _relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want) / np.maximum(np.abs(want), 1e-30)))


def _self_test_swiglu(module: ModuleType) -> str | None:
    """silu * mul against float64 over the range an activation meets, and against mlx-lm."""
    gate = np.concatenate([np.linspace(-100, 100, 4001), [0.0, -1e-8, 1e-8]]).astype(np.float32)
    x = np.random.default_rng(0).standard_normal(gate.size).astype(np.float32)
    with mx.stream(mx.cpu):
        out = np.array(module.silu_mul(mx.array(gate), mx.array(x)))
        mlx = np.array(_mlx_lm_swiglu(mx.array(gate), mx.array(x)))
    g = gate.astype(np.float64)
    error = _relative_error(out, g / (1 + np.exp(-g)) * x)
    if not error <= SELF_TEST_TOLERANCE:
        return f"swiglu: max relative difference {error:.2e} to float64"
    _bit_identical["swiglu"] = bool(np.array_equal(out, mlx))
    return None


def _self_test_rope(module: ModuleType) -> str | None:
    """rope (both layouts, per-row offsets, base and freqs, a partial rotation) against
    MLX's ``mx.fast.rope``."""
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((2, 3, 5, 16)).astype(np.float32))
    offset = mx.array([0, 4000], dtype=mx.int32)
    freqs = mx.array(rng.uniform(1, 1e4, 6).astype(np.float32))
    identical = True
    with mx.stream(mx.cpu):
        for traditional, base, f, dims in [(False, 1e4, None, 16), (True, 5e5, None, 16),
                                           (False, None, freqs, 12)]:  # fmt: skip
            got = module.rope(
                x, dims, traditional=traditional, base=1.0 if base is None else base,
                scale=0.5, offset=offset, freqs=f,
            )  # fmt: skip
            want = _mlx_rope(
                x, dims, traditional=traditional, base=base, scale=0.5, offset=offset, freqs=f
            )
            got, want = np.array(got), np.array(want)
            error = float(np.max(np.abs(got - want)))
            if not error <= SELF_TEST_TOLERANCE * 10:
                return f"rope: max difference {error:.2e} to mx.fast.rope"
            identical = identical and bool(np.array_equal(got, want))
    _bit_identical["rope"] = identical
    return None


def _self_test_rms_norm(module: ModuleType) -> str | None:
    """RMS norm (with and without a weight, rows of two widths) against MLX's."""
    rng = np.random.default_rng(0)
    identical = True
    with mx.stream(mx.cpu):
        for shape in [(3, 2, 24), (9, 7)]:
            x = mx.array((rng.standard_normal(shape) * 3).astype(np.float32))
            w = mx.array(rng.standard_normal(shape[-1]).astype(np.float32))
            for weight in (w, None):
                got = np.array(module.rms_norm(x, weight, 1e-5))
                want = np.array(_mlx_rms_norm(x, weight, 1e-5))
                error = _relative_error(got, want)
                if not error <= SELF_TEST_TOLERANCE:
                    return f"rms_norm: max relative difference {error:.2e} to mx.fast.rms_norm"
                identical = identical and bool(np.array_equal(got, want))
    _bit_identical["rms_norm"] = identical
    return None
