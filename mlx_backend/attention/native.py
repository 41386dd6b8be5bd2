"""The native ragged attention op (``csrc/``, built at install) and whether this process can
use it.

The extension is an MLX primitive compiled against one MLX version's C++ headers, whose
interface changes between releases; it is used only when it was built against the MLX that
is imported now and passes a small self-test against ``mx.fast.scaled_dot_product_attention``.
Otherwise :func:`native_status` says why, in one line, and the server runs on the pure-MLX
path (MLX's SDPA over K/V gathered out of the pools). ``MLXSERVE_ATTENTION=gather`` asks for
that path on purpose (benchmarks, bisecting a numerical difference).

The op also reads quantized pools (``--kv-bits``: packed rows of ``kv/quantization.py``,
float32 scales and biases), dequantizing each row in the kernel. That variant has a
self-test of its own: if only it fails, float32 pools keep the op and quantized pools keep
their pure-MLX path (``NativeStatus.quantized``).
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

if TYPE_CHECKING:
    from mlxserve.mlx_backend.kv.quantization import PackedRows

logger = logging.getLogger(__name__)

ENV_SWITCH = "MLXSERVE_ATTENTION"
_GATHER_VALUES = {"gather", "off", "0", "false", "no", "mlx"}
# The self-test's tolerance against mx.fast.scaled_dot_product_attention (the kernel's
# polynomial exp and summation order differ from MLX's by ~1e-6 on unit-scale inputs).
SELF_TEST_TOLERANCE = 1e-4
# The quantized variants the self-test checks: (bits, group size) over rows of 64 values.
SELF_TEST_QUANTIZED = ((8, 32), (4, 64))


@dataclass(frozen=True)
class NativeStatus:
    """Whether the native op is usable here.

    Attributes:
        active: the extension loaded, matches the imported MLX and passed its self-test.
        reason: one line: what is active, or why it is not.
        isa: the kernel build this CPU runs ("x86-64-v3", ...), when loaded.
        quantized: the op also reads quantized pools (its quantized self-test passed).
        quantized_reason: one line: how quantized pools are read, or why not by the op.
    """

    active: bool
    reason: str
    isa: str | None = None
    quantized: bool = False
    quantized_reason: str = ""

    def describe(self) -> str:
        """One line for ``--version`` and the start-up log: the float and quantized pools'
        attention."""
        if not self.active:
            return self.reason
        return f"{self.reason}; quantized pools: {self.quantized_reason}"


_lock = threading.Lock()
_status: NativeStatus | None = None
_module: ModuleType | None = None


def native_status() -> NativeStatus:
    """Load and check the extension once per process; never raises."""
    global _status
    with _lock:
        if _status is None:
            try:
                _status = _load()
            except Exception as e:  # never take the server down for a speed-up
                _status = NativeStatus(False, f"native attention failed to load: {e!r}")
            if not _status.active:
                logger.warning("native attention off: %s", _status.reason)
            elif not _status.quantized:
                logger.warning("native attention off for quantized pools: %s", _status.reason)
        return _status


_extension: tuple[ModuleType | None, str] | None = None
_extension_lock = threading.Lock()


def extension() -> tuple[ModuleType | None, str]:
    """The native extension (its attention and activation ops, its thread pool) when it was
    built against the MLX imported now, else None and why; imported once per process."""
    global _extension
    with _extension_lock:
        if _extension is None:
            _extension = _import_extension()
        return _extension


def _import_extension() -> tuple[ModuleType | None, str]:
    try:
        module = importlib.import_module("mlxserve.mlx_backend.attention._native")
    except ImportError as e:
        return None, f"the native extension was not built at install ({e})"
    built = module.built_with_mlx()
    running = mx.__version__.split(".dev")[0]
    if built != running:
        return None, f"built against MLX {built} but MLX {running} is imported; reinstall mlxserve"
    return module, "loaded"


def _load() -> NativeStatus:
    global _module
    setting = os.environ.get(ENV_SWITCH, "").strip().lower()
    if setting in _GATHER_VALUES:
        return NativeStatus(False, f"disabled by {ENV_SWITCH}={setting}")
    module, why = extension()
    if module is None:
        return NativeStatus(False, why)
    error = _self_test(module)
    if error is not None:
        return NativeStatus(False, f"self-test failed: {error}")
    _module = module
    isa = module.kernel_isa()
    reason = f"native ragged attention ({isa})"
    quantized_error = _quantized_self_test(module)
    if quantized_error is not None:
        why = f"not by the native op (its quantized self-test failed: {quantized_error})"
        return NativeStatus(True, reason, isa, False, why)
    return NativeStatus(True, reason, isa, True, "native op, in-kernel dequantization")


def _self_test(module: ModuleType) -> str | None:
    """Ragged decode and prefill with GQA against gather + mask + MLX's SDPA."""
    return _compare_to_sdpa(module, dim=16)


def _quantized_self_test(module: ModuleType) -> str | None:
    """The same over 8-bit and 4-bit packed pools, against SDPA over the pools' rows
    dequantized by ``PackedRows.dequantize``."""
    from mlxserve.mlx_backend.kv.quantization import PackedRows

    for bits, group_size in SELF_TEST_QUANTIZED:
        error = _compare_to_sdpa(module, 64, PackedRows(bits, group_size, 64, mx.float32))
        if error is not None:
            return f"{bits}-bit, group {group_size}: {error}"
    return None


def _compare_to_sdpa(module: ModuleType, dim: int, packed: PackedRows | None = None) -> str | None:
    """Run the op on random pools (``packed``: a ``PackedRows`` format to store them in)
    and compare its real queries' output with MLX's SDPA; the error, or None."""
    rng = np.random.default_rng(0)
    heads, size = 2, 40
    k = mx.array(rng.standard_normal((heads * size, dim), dtype=np.float32))
    v = mx.array(rng.standard_normal((heads * size, dim), dtype=np.float32))
    k_pool, v_pool, quantized = k, v, {}
    if packed is not None:
        k_pool, v_pool = packed.encode(k), packed.encode(v)
        k, v = packed.dequantize(k_pool), packed.dequantize(v_pool)
        quantized = {"bits": packed.bits, "group_size": packed.group_size}
    lens = np.array([3, 17], np.int32)
    q_len = np.array([1, 4], np.int32)
    L = int(q_len.max())
    slots = np.zeros((2, int(lens.max())), np.int32)
    for b, n in enumerate(lens):
        slots[b, :n] = rng.permutation(np.arange(1, size))[:n]
    meta = padded_runs(lens, np.zeros(2, np.int32), lens - q_len, q_len, L)
    q = mx.array(rng.standard_normal((2, 2 * heads, L, dim), dtype=np.float32))
    with mx.stream(mx.cpu):
        out = module.ragged_attention(
            q,
            k_pool,
            v_pool,
            mx.array(slots),
            mx.array(meta.astype(np.int32)),
            scale=0.25,
            window=0,
            kv_heads=heads,
            rows_per_head=size,
            **quantized,
        )
        rows = mx.array((np.arange(heads)[:, None, None] * size + slots[None]).astype(np.int32))
        keys, values = k[rows].swapaxes(0, 1), v[rows].swapaxes(0, 1)
        k_pos = np.arange(slots.shape[1])[None, None, None, :]
        q_pos = (lens - q_len)[:, None, None, None] + np.arange(L)[None, None, :, None]
        visible = (k_pos <= q_pos) & (k_pos < lens[:, None, None, None])
        ref = mx.fast.scaled_dot_product_attention(
            q, keys, values, scale=0.25, mask=mx.array(visible)
        )
        real = mx.array(np.arange(L)[None, None, :, None] < q_len[:, None, None, None])
        diff = mx.max(mx.abs(mx.where(real, out - ref, 0))).item()
    if not diff <= SELF_TEST_TOLERANCE:
        return f"max difference {diff:.2e} to MLX's SDPA"
    return None


def ragged_attention(
    queries: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    slots: mx.array,
    meta: mx.array,
    sinks: mx.array | None,
    *,
    scale: float,
    window: int,
    kv_heads: int,
    rows_per_head: int,
    bits: int = 0,
    group_size: int = 0,
) -> mx.array:
    """Attention of ``queries`` ``[B, Hq, L, D]`` over the pool rows ``slots`` names.

    Args:
        queries: float32 ``[B, Hq, L, Dk]``.
        k_pool, v_pool: float32 flat head-major pools ``[kv_heads * rows_per_head, D]``,
            or with ``bits`` uint32 pools of packed rows (``kv/quantization.py``, float32
            scales and biases), ``[kv_heads * rows_per_head, words]``.
        slots: int32 ``[B, S]``: the slot of each row's key column.
        meta: int32 ``[R, 6]``: runs of queries (``padded_runs``, ``csrc/attention_kernel.h``):
            slots row, key count, position of key column 0, position of the first query,
            queries, index of the first query in ``B * L``; queries no run covers are
            padding and get zeros.
        sinks: ``[Hq]`` extra logits (gpt-oss) or None.
        scale: the score scale.
        window: sliding window (keys at positions ``> p - window``), 0 for none.
        kv_heads, rows_per_head: the pools' layout.
        bits, group_size: the packed rows' quantization (8 or 4 bits; group size 32, 64 or
            128); 0 for float32 pools.

    Returns:
        ``[B, Hq, L, Dv]`` float32.

    Raises:
        RuntimeError: the native op is not active, or not for quantized pools (check
            :func:`native_status` first).
    """
    if _module is None:
        raise RuntimeError("native attention is not active: " + native_status().reason)
    if bits and not native_status().quantized:
        raise RuntimeError(
            "native attention on quantized pools: " + native_status().quantized_reason
        )
    return _module.ragged_attention(
        queries,
        k_pool,
        v_pool,
        slots,
        meta,
        sinks,
        scale=scale,
        window=window,
        kv_heads=kv_heads,
        rows_per_head=rows_per_head,
        bits=bits,
        group_size=group_size,
    )


def padded_runs(
    key_count: np.ndarray,
    key_start: np.ndarray,
    q_start: np.ndarray,
    q_len: np.ndarray,
    L: int,
    slot_rows: np.ndarray | None = None,
    q_first: np.ndarray | None = None,
) -> np.ndarray:
    """The op's ``meta`` for one run per row: row ``b``'s queries are ``b * L ..`` (a
    padded ``[B, L]`` batch) over slots row ``b``, unless ``q_first``/``slot_rows`` say
    otherwise (a packed batch of one-token rows: consecutive rows, one slots row)."""
    B = len(key_count)
    rows = np.arange(B, dtype=np.int32)
    return np.stack(
        [
            rows if slot_rows is None else slot_rows,
            key_count,
            key_start,
            q_start,
            q_len,
            rows * L if q_first is None else q_first,
        ],
        axis=1,
    ).astype(np.int32)


def set_threads(n: int) -> None:
    """Threads the native kernels may use (the calling thread included); no-op when the
    extension is not loaded."""
    module, _ = extension()
    if module is not None:
        module.set_threads(int(n))


def threads() -> int:
    """Threads the native kernels use now (0 when the extension is not loaded)."""
    module, _ = extension()
    return 0 if module is None else int(module.threads())
