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

# Values decoded per chunk: bounds the numpy temporaries (up to ~16 bytes per value).
_CHUNK_VALUES = 1 << 20
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
        # The chunks' buffers would otherwise stay in MLX's cache, counted as resident.
        mx.clear_cache()


def _convert(gguf, info, quantizable, inexact_as_float, float_dtype) -> ConvertedTensor:
    name = info.type_name
    raw = gguf.tensor_bytes(info)
    if name in PLAIN_FLOATS:
        weight = _plain(name, raw, info.shape, float_dtype)
        return ConvertedTensor(weight, None, None, None, "float")
    _, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    blocks = raw.reshape(-1, type_size)
    fmt = AFFINE_FORMATS.get(name)
    keep_quantized = quantizable and len(info.shape) >= 2
    if fmt is not None and keep_quantized:
        weight, scales, biases = _affine(blocks, fmt, info.shape)
        quant = {"group_size": GROUP, "bits": fmt.bits, "mode": fmt.mode}
        return ConvertedTensor(weight, scales, biases, quant, "exact")
    if keep_quantized and not inexact_as_float and fmt is None and info.shape[-1] % GROUP == 0:
        weight, scales, biases = _requantized(name, blocks, info.shape)
        quant = {"group_size": GROUP, "bits": REQUANT_BITS, "mode": "affine"}
        return ConvertedTensor(weight, scales, biases, quant, "requantized")
    out = _float(name, blocks, info.shape)
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


class _Rows:
    """A tensor's blocks in chunks of whole rows (about ``_CHUNK_VALUES`` values each), and
    MLX outputs allocated once: a slice update of a singly referenced MLX array happens in
    place, so converting never holds more than the result plus one chunk."""

    def __init__(self, blocks: np.ndarray, shape: tuple[int, ...]) -> None:
        self.lead, self.cols = shape[:-1], shape[-1]
        self.rows = 1
        for d in self.lead:
            self.rows *= d
        self.blocks_per_row = blocks.shape[0] // self.rows
        self.blocks = blocks
        self.step = max(1, _CHUNK_VALUES // self.cols)

    def chunks(self):
        """``(start_row, stop_row, blocks of those rows)``."""
        per_row = self.blocks_per_row
        for start in range(0, self.rows, self.step):
            stop = min(self.rows, start + self.step)
            yield start, stop, self.blocks[start * per_row : stop * per_row]

    def allocate(self, width: int, dtype: mx.Dtype) -> mx.array:
        out = mx.zeros((self.rows, width), dtype=dtype)
        mx.eval(out)
        return out

    def shaped(self, a: mx.array) -> mx.array:
        return a.reshape(*self.lead, a.shape[-1])


def _affine(blocks: np.ndarray, fmt, shape: tuple[int, ...]):
    rows = _Rows(blocks, shape)
    groups = rows.cols // GROUP
    words = rows.allocate(rows.cols * fmt.bits // 32, mx.uint32)
    scales = rows.allocate(groups, mx.uint8 if fmt.mode == "mxfp4" else mx.float32)
    biases = None if fmt.mode == "mxfp4" else rows.allocate(groups, mx.float32)
    for start, stop, part in rows.chunks():
        dec = fmt.decode(part)
        n = stop - start
        words[start:stop] = mx.array(pack_rows(dec.q.reshape(n, rows.cols), fmt.bits))
        scales[start:stop] = mx.array(dec.scales.reshape(n, groups))
        if biases is not None:
            biases[start:stop] = mx.array(dec.biases.reshape(n, groups))
        mx.eval(words, scales, *(() if biases is None else (biases,)))
    return (
        rows.shaped(words),
        rows.shaped(scales),
        None if biases is None else rows.shaped(biases),
    )


def _values(name: str, part: np.ndarray) -> np.ndarray:
    """Exact float32 values of blocks of any block format, [n_blocks, block_size]."""
    fmt = AFFINE_FORMATS.get(name)
    return affine_values(fmt, part) if fmt is not None else decode_to_float32(name, part)


def _float(name: str, blocks: np.ndarray, shape: tuple[int, ...]) -> mx.array:
    rows = _Rows(blocks, shape)
    out = rows.allocate(rows.cols, mx.float32)
    for start, stop, part in rows.chunks():
        out[start:stop] = mx.array(_values(name, part).reshape(stop - start, rows.cols))
        mx.eval(out)
    return out.reshape(shape)


def _requantized(name: str, blocks: np.ndarray, shape: tuple[int, ...]):
    rows = _Rows(blocks, shape)
    groups = rows.cols // GROUP
    words = rows.allocate(rows.cols * REQUANT_BITS // 32, mx.uint32)
    scales = rows.allocate(groups, mx.float32)
    biases = rows.allocate(groups, mx.float32)
    for start, stop, part in rows.chunks():
        values = mx.array(_values(name, part).reshape(stop - start, rows.cols))
        w, s, b = mx.quantize(values, group_size=GROUP, bits=REQUANT_BITS)
        words[start:stop], scales[start:stop], biases[start:stop] = w, s, b
        mx.eval(words, scales, biases)
    return rows.shaped(words), rows.shaped(scales), rows.shaped(biases)


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
