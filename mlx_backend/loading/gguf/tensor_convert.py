"""Turn one GGUF tensor into MLX arrays: exactly quantized, exactly float, or requantized.

Which of the three a tensor gets depends on its type and on where it goes:

- block formats MLX's affine (or mxfp4) mode holds exactly (``affine_formats.AFFINE_FORMATS``)
  stay quantized, bit for bit, when the parameter is a quantizable layer's weight;
- formats MLX cannot hold exactly (``float_formats.FLOAT_DECODED``) become their exact
  float32 values, or, when ``inexact_as_float`` is off (weights meant to stay quantized),
  8-bit group-32 MLX quantization of those values (not exact: the load report says so);
- plain floats stay floats (float32 on the CPU; F16/BF16 keep their dtype elsewhere).

Any other type (Q8_1, Q8_K, integer tensors, ids gguf-py does not know) is refused by name.
Decoding runs over row chunks so the temporary numpy arrays stay small.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from mlxserve.mlx_backend.loading.gguf.affine_formats import AFFINE_FORMATS, GROUP
from mlxserve.mlx_backend.loading.gguf.float_formats import (
    FLOAT_DECODED,
    PLAIN_FLOATS,
    decode_to_float32,
    plain_float32,
)
from mlxserve.mlx_backend.loading.gguf.packing import pack_rows
from mlxserve.mlx_backend.loading.gguf.reader import GGUFFile, TensorInfo

# Values decoded per chunk: bounds the numpy temporaries (a few bytes per value each).
_CHUNK_VALUES = 1 << 22
REQUANT_BITS = 8
SUPPORTED_TYPES = frozenset(AFFINE_FORMATS) | FLOAT_DECODED | PLAIN_FLOATS


class UnsupportedTensorType(ValueError):
    """A tensor's type is not one mlxserve converts."""


@dataclass
class ConvertedTensor:
    """One GGUF tensor as MLX arrays.

    Attributes:
        weight: float values, or packed uint32 words when ``quantization`` is set.
        scales: per-group scales (float32; uint8 exponents for mxfp4), or None.
        biases: per-group biases (float32), or None.
        quantization: ``{"group_size", "bits", "mode"}`` for ``nn.quantize``, or None.
        handling: one of "exact", "float", "dequantized", "requantized" (see module doc).
    """

    weight: mx.array
    scales: mx.array | None
    biases: mx.array | None
    quantization: dict | None
    handling: str

    def map_rows(self, fn) -> ConvertedTensor:
        """Apply a row-wise function (permutation, reshape of leading axes) to every array."""
        return ConvertedTensor(
            fn(self.weight),
            None if self.scales is None else fn(self.scales),
            None if self.biases is None else fn(self.biases),
            self.quantization,
            self.handling,
        )


def check_supported(info: TensorInfo) -> None:
    """Raise ``UnsupportedTensorType`` naming the tensor if its type is not converted."""
    if info.type_name not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(SUPPORTED_TYPES))
        raise UnsupportedTensorType(
            f"tensor {info.name!r} has GGUF type {info.type_name}, which mlxserve does not "
            f"convert (supported: {supported})"
        )


def convert_tensor(
    gguf: GGUFFile,
    info: TensorInfo,
    *,
    quantizable: bool,
    inexact_as_float: bool,
    float_dtype: mx.Dtype | None,
) -> ConvertedTensor:
    """Convert one tensor (see the module doc for the rules).

    Args:
        gguf: the open file.
        info: the tensor.
        quantizable: the tensor is the weight of a layer MLX can quantize (Linear,
            Embedding, SwitchLinear); otherwise it always becomes float.
        inexact_as_float: formats MLX cannot hold exactly become float32 (True) or are
            requantized to 8 bits (False).
        float_dtype: dtype of float results; None keeps the file's (F16 -> float16, BF16 ->
            bfloat16, everything else float32).

    Raises:
        UnsupportedTensorType: the type is not converted.
    """
    check_supported(info)
    try:
        return _convert(gguf, info, quantizable, inexact_as_float, float_dtype)
    finally:
        gguf.release(info)


def _convert(gguf, info, quantizable, inexact_as_float, float_dtype) -> ConvertedTensor:
    name = info.type_name
    cols = info.shape[-1]
    raw = gguf.tensor_bytes(info)
    if name in PLAIN_FLOATS:
        return ConvertedTensor(
            _plain(name, raw, info.shape, float_dtype), None, None, None, "float"
        )
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    blocks = raw.reshape(-1, type_size)
    fmt = AFFINE_FORMATS.get(name)
    keep_quantized = quantizable and len(info.shape) >= 2
    if fmt is not None and keep_quantized:
        weight, scales, biases = _affine(blocks, fmt, info.shape)
        quant = {"group_size": GROUP, "bits": fmt.bits, "mode": fmt.mode}
        return ConvertedTensor(weight, scales, biases, quant, "exact")
    values = _float(name, blocks, block, cols).reshape(info.shape)
    if keep_quantized and not inexact_as_float and fmt is None and cols % GROUP == 0:
        w, s, b = mx.quantize(mx.array(values), group_size=GROUP, bits=REQUANT_BITS)
        mx.eval(w, s, b)
        quant = {"group_size": GROUP, "bits": REQUANT_BITS, "mode": "affine"}
        return ConvertedTensor(w, s, b, quant, "requantized")
    out = mx.array(values)
    if float_dtype is not None and float_dtype != mx.float32:
        out = out.astype(float_dtype)
    mx.eval(out)
    return ConvertedTensor(out, None, None, None, "dequantized")


def _plain(name: str, raw: np.ndarray, shape: tuple[int, ...], float_dtype) -> mx.array:
    if float_dtype is None and name == "BF16":
        out = mx.array(raw.view(np.uint16).reshape(shape)).view(mx.bfloat16)
    elif float_dtype is None and name == "F16":
        out = mx.array(raw.view(np.float16).reshape(shape))
    else:
        out = mx.array(plain_float32(name, raw).reshape(shape))
        if float_dtype is not None and float_dtype != mx.float32:
            out = out.astype(float_dtype)
    mx.eval(out)
    return out


def _chunks(n_blocks: int, blocks_per_row: int):
    rows = n_blocks // blocks_per_row
    step = max(1, _CHUNK_VALUES // (blocks_per_row * 32))
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        yield start, stop, slice(start * blocks_per_row, stop * blocks_per_row)


def _affine(blocks: np.ndarray, fmt, shape: tuple[int, ...]):
    cols = shape[-1]
    n_rows = _n_rows(shape)
    blocks_per_row = blocks.shape[0] // n_rows
    words = np.empty((n_rows, cols * fmt.bits // 32), dtype=np.uint32)
    scale_dtype = np.uint8 if fmt.mode == "mxfp4" else np.float32
    scales = np.empty((n_rows, cols // GROUP), dtype=scale_dtype)
    biases = None if fmt.mode == "mxfp4" else np.empty((n_rows, cols // GROUP), np.float32)
    for start, stop, sl in _chunks(blocks.shape[0], blocks_per_row):
        dec = fmt.decode(blocks[sl])
        rows = stop - start
        words[start:stop] = pack_rows(dec.q.reshape(rows, cols), fmt.bits)
        scales[start:stop] = dec.scales.reshape(rows, -1)
        if biases is not None:
            biases[start:stop] = dec.biases.reshape(rows, -1)
    lead = shape[:-1]
    w = mx.array(words.reshape(*lead, -1))
    del words
    s = mx.array(scales.reshape(*lead, -1))
    b = None if biases is None else mx.array(biases.reshape(*lead, -1))
    mx.eval(w, s, *(() if b is None else (b,)))
    return w, s, b


def _n_rows(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape[:-1]:
        n *= d
    return n


def _float(name: str, blocks: np.ndarray, block: int, cols: int) -> np.ndarray:
    """Exact float32 values of any block format, [n_values]."""
    out = np.empty(blocks.shape[0] * block, dtype=np.float32)
    fmt = AFFINE_FORMATS.get(name)
    step = max(1, _CHUNK_VALUES // block)
    for start in range(0, blocks.shape[0], step):
        part = blocks[start : start + step]
        if fmt is not None:
            out[start * block : (start + len(part)) * block] = affine_values(fmt, part).ravel()
        else:
            out[start * block : (start + len(part)) * block] = decode_to_float32(name, part).ravel()
    return out


_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def affine_values(fmt, blocks: np.ndarray) -> np.ndarray:
    """The float32 values of affine-format blocks: scale * q + bias per group of 32."""
    dec = fmt.decode(blocks)
    n = blocks.shape[0]
    groups = dec.q.reshape(n, -1, GROUP)
    if fmt.mode == "mxfp4":
        scale = np.ldexp(np.float32(1), dec.scales.astype(np.int32) - 127).astype(np.float32)
        return (_E2M1[groups] * scale.reshape(n, -1, 1)).reshape(n, -1)
    scale = dec.scales.reshape(n, -1, 1)
    bias = dec.biases.reshape(n, -1, 1)
    return (scale * groups.astype(np.float32) + bias).reshape(n, -1)
