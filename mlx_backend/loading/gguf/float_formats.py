"""GGUF formats that MLX's quantization cannot hold exactly, dequantized to float32.

Q6_K, Q3_K and Q2_K scale sub-blocks of 16 values (MLX's smallest group is 32); the IQ
types index codebooks and IQ4_NL / NVFP4 non-uniform grids; TQ1_0/TQ2_0 are ternary. Their
exact value is a float32, computed here the way ggml does (every product below is exact
in float32). Q6_K/Q3_K/Q2_K are decoded by our own code; the codebook formats by gguf-py's
numpy dequantizers (llama.cpp's own Python package), which hold their grids.
"""

from __future__ import annotations

import numpy as np
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

_SHIFT_2BIT = np.array([0, 2, 4, 6], dtype=np.uint8)
_SHIFT_NIBBLE = np.array([0, 4], dtype=np.uint8)
_BITS8 = np.arange(8, dtype=np.uint8)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def q6_k(blocks: np.ndarray) -> np.ndarray:
    """ql[128] (low 4 bits), qh[64] (high 2 bits), 16 int8 scales, d: v = d * sc * (q - 32)."""
    n = blocks.shape[0]
    ql = blocks[:, 0:128].reshape(n, 2, 1, 64) >> _SHIFT_NIBBLE.reshape(1, 1, 2, 1)
    ql = (ql & 0x0F).reshape(n, 8, 32)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32) >> _SHIFT_2BIT.reshape(1, 1, 4, 1)
    qh = (qh & 0x03).reshape(n, 8, 32)
    q = (ql | (qh << 4)).astype(np.int8) - np.int8(32)
    scale = _f16(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32)
    return (scale.reshape(n, 16, 1) * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, 256)


def q3_k(blocks: np.ndarray) -> np.ndarray:
    """hmask[32], qs[64] (low 2 bits), 12 bytes of 6-bit scales, d: v = d * (sc - 32) * q
    with q = low 2 bits - 4 where the hmask bit is clear."""
    n = blocks.shape[0]
    scales = blocks[:, 96:108]
    low = (scales[:, 0:8].reshape(n, 1, 8) >> _SHIFT_NIBBLE.reshape(1, 2, 1)).reshape(n, 16)
    high = (scales[:, 8:12].reshape(n, 1, 4) >> _SHIFT_2BIT.reshape(1, 4, 1)).reshape(n, 16)
    sc = ((low & 0x0F) | ((high & 0x03) << 4)).astype(np.int8) - np.int8(32)
    scale = _f16(blocks, 108) * sc.astype(np.float32)
    ql = blocks[:, 32:96].reshape(n, 2, 1, 32) >> _SHIFT_2BIT.reshape(1, 1, 4, 1)
    ql = (ql & 0x03).reshape(n, 16, 16)
    hm = blocks[:, 0:32].reshape(n, 1, 1, 32) >> _BITS8.reshape(1, 1, 8, 1)
    hm = (hm & 0x01).reshape(n, 16, 16)
    q = ql.astype(np.int8) - ((hm ^ 1) << 2).astype(np.int8)
    return (scale.reshape(n, 16, 1) * q.astype(np.float32)).reshape(n, 256)


def q2_k(blocks: np.ndarray) -> np.ndarray:
    """16 bytes of (4-bit scale, 4-bit min), qs[64] (2-bit), d, dmin: v = d sc q - dmin m."""
    n = blocks.shape[0]
    sc = blocks[:, 0:16]
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)
    scale = (d * (sc & 0x0F).astype(np.float32)).reshape(n, 16, 1)
    low = (dmin * (sc >> 4).astype(np.float32)).reshape(n, 16, 1)
    q = blocks[:, 16:80].reshape(n, 2, 1, 32) >> _SHIFT_2BIT.reshape(1, 1, 4, 1)
    q = (q & 0x03).reshape(n, 16, 16).astype(np.float32)
    return (scale * q - low).reshape(n, 256)


_OWN_DECODERS = {"Q6_K": q6_k, "Q3_K": q3_k, "Q2_K": q2_k}
# Decoded by gguf-py (codebooks, non-uniform grids, ternary, NVFP4's E4M3 scales).
_GGUF_PY_DECODED = frozenset(
    {
        "IQ1_S",
        "IQ1_M",
        "IQ2_XXS",
        "IQ2_XS",
        "IQ2_S",
        "IQ3_XXS",
        "IQ3_S",
        "IQ4_NL",
        "IQ4_XS",
        "TQ1_0",
        "TQ2_0",
        "NVFP4",
    }
)
# Plain floats; F64 is rounded to float32 (no model computes in float64).
PLAIN_FLOATS = frozenset({"F32", "F16", "BF16", "F64"})
FLOAT_DECODED = frozenset(_OWN_DECODERS) | _GGUF_PY_DECODED


def decode_to_float32(type_name: str, blocks: np.ndarray) -> np.ndarray:
    """Blocks of a FLOAT_DECODED type [n, type_size] -> float32 [n, block_size]."""
    own = _OWN_DECODERS.get(type_name)
    if own is not None:
        return own(blocks)
    return gguf_dequantize(blocks, GGMLQuantizationType[type_name]).reshape(blocks.shape[0], -1)


def plain_float32(type_name: str, raw: np.ndarray) -> np.ndarray:
    """F32/F16/BF16/F64 bytes -> float32 (BF16 widened exactly: its bits are float32's top 16)."""
    if type_name == "F32":
        return raw.view(np.float32)
    if type_name == "F16":
        return raw.view(np.float16).astype(np.float32)
    if type_name == "BF16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if type_name == "F64":
        return raw.view(np.float64).astype(np.float32)
    raise ValueError(f"{type_name} is not a plain float type")
