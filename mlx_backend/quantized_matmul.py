"""``mx.quantized_matmul`` on the CPU from the native kernel, for models kept quantized.

The CPU backend turns quantized layers into float32 ones when they fit in memory
(``loading/dequantize.py``): OpenBLAS's sgemm is then the fastest path. A model that does
not fit as float32 (a 4-bit 8B model is 32 GB as float32) stays quantized, and MLX's CPU
``quantized_matmul`` is a naive loop (SmolLM2-135M 4-bit: ~5 tok/s at any batch). The native
op (``csrc/qmm_kernel.cpp``) serves those products instead: every W row is dequantized once
per call (``scale * q + bias``, exactly as ``mx.dequantize``) and multiplied by every row of
x at SIMD width, so the weights are read once and never stored as float32. From
``DENSE_ROWS`` rows of x on (a long prefill chunk) one layer's weights are dequantized by the
native op into a transient float32 matrix and multiplied by OpenBLAS, which is faster there.

Results equal the float32 product with ``mx.dequantize``'s weights up to the order of the
sums (the tests bound the difference against float64); an output does not depend on how many
rows x has. What the op does not take (GPU, other dtypes, 2-, 3-, 5- or 6-bit, other modes,
``transpose=False``, no biases) gets MLX's function unchanged, as does every call outside
:func:`~mlxserve.mlx_backend.native_ops.native_forward`.
"""

from __future__ import annotations

from types import ModuleType

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxserve.mlx_backend import native_ops

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
# From this many rows of x on, dequantize to a transient float32 matrix and use sgemm
# (bench/quantized_matmul.py: the kernel beats float32 weights resident in memory up to ~32
# rows and the transient copy, whose writing costs as much as a 64-row product, up to ~512).
DENSE_ROWS = 512
# The self-test's tolerance, relative to the largest float64 output.
SELF_TEST_TOLERANCE = 1e-5


def quantized_matmul(
    x: mx.array,
    w: mx.array,
    /,
    scales: mx.array,
    biases: mx.array | None = None,
    transpose: bool = True,
    group_size: int | None = None,
    bits: int | None = None,
    mode: str = "affine",
    *,
    stream: mx.Stream | mx.Device | None = None,
) -> mx.array:
    """``mx.quantized_matmul``, from the native op inside ``native_forward``."""
    module = native_ops.serving_module()
    if (
        module is not None
        and stream is None
        and _native_takes(x, w, scales, biases, transpose, group_size, bits, mode)
    ):
        native_ops.count_served("quantized_matmul")
        return product(module, x, w, scales, biases, group_size, bits)
    return native_ops.mlx_quantized_matmul(
        x, w, scales, biases, transpose, group_size, bits, mode, stream=stream
    )


def layers_served(model: nn.Module) -> int:
    """How many quantized layers of ``model`` the native op would serve: all of them, or 0
    when one is of a kind it does not take (MoE experts, 2-, 3-, 5- or 6-bit, other modes),
    when the model has none, or when the native ops cannot serve here (GPU, no extension,
    ``MLXSERVE_NATIVE_OPS=mlx``). The loader keeps a model quantized only when it is all."""
    if mx.default_device().type != mx.cpu or native_ops.unavailable_reason() is not None:
        return 0
    count = 0
    for _, module in model.named_modules():
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            if not _layer_taken(module):
                return 0
            count += 1
        elif hasattr(module, "group_size") and hasattr(module, "bits"):
            return 0  # another quantized kind (mlx-lm's QuantizedSwitchLinear, ...)
    return count


def _layer_taken(module: nn.Module) -> bool:
    return (
        module.mode == "affine"
        and module.bits in BITS
        and module.group_size in GROUP_SIZES
        and module.get("biases") is not None
        and module.weight.ndim == 2
    )


def _native_takes(x, w, scales, biases, transpose, group_size, bits, mode) -> bool:  # noqa: ANN001
    """Whether the native op computes this call (else MLX validates and computes it)."""
    if mode != "affine" or not transpose or biases is None:
        return False
    if (group_size or 64) not in GROUP_SIZES or (bits or 4) not in BITS:
        return False
    if x.dtype != mx.float32 or x.ndim < 1 or w.dtype != mx.uint32 or w.ndim != 2:
        return False
    if scales.dtype != mx.float32 or biases.dtype != mx.float32:
        return False
    k = w.shape[1] * 32 // (bits or 4)
    groups = k // (group_size or 64)
    return x.shape[-1] == k and scales.shape == biases.shape == (w.shape[0], groups)


def product(
    module: ModuleType,
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int | None,
    bits: int | None,
) -> mx.array:
    """``x @ dequantize(w).T`` by the native op, or through a transient float32 matrix when x
    has ``DENSE_ROWS`` rows or more."""
    args = {"group_size": group_size or 64, "bits": bits or 4}
    rows = x.size // max(x.shape[-1], 1)
    if rows >= DENSE_ROWS:
        return x @ module.dequantize(w, scales, biases, **args).T
    return module.quantized_matmul(x, w, scales, biases, **args)


def self_test(module: ModuleType) -> str | None:
    """The op against float64 (every bits and group size, row counts on both sides of the
    kernel's blocks) and its dequantization against ``mx.dequantize``; None when it passes."""
    rng = np.random.default_rng(0)
    with mx.stream(mx.cpu):
        for bits in BITS:
            for group_size in GROUP_SIZES:
                weight = mx.array(rng.standard_normal((7, 256)).astype(np.float32))
                w, scales, biases = mx.quantize(weight, group_size=group_size, bits=bits)
                args = {"group_size": group_size, "bits": bits}
                want_w = mx.dequantize(w, scales, biases, dtype=mx.float32, **args)
                if not np.array_equal(
                    np.array(module.dequantize(w, scales, biases, **args)), np.array(want_w)
                ):
                    return f"dequantize ({bits}-bit, group {group_size}) differs from MLX's"
                for rows in (1, 5):
                    x = rng.standard_normal((rows, 256)).astype(np.float32)
                    got = np.array(module.quantized_matmul(mx.array(x), w, scales, biases, **args))
                    want = x.astype(np.float64) @ np.array(want_w).astype(np.float64).T
                    error = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
                    if not error <= SELF_TEST_TOLERANCE:
                        return f"quantized_matmul: relative difference {error:.2e} to float64"
    return None
