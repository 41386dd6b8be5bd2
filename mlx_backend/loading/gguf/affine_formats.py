"""GGUF block formats that MLX's affine quantization holds exactly, decoded to integers.

MLX's affine mode stores ``w = scale * q + bias`` per group of 32 consecutive values of a row
with ``q`` an unsigned integer of ``bits`` bits. Each format below is that, with the group's
scale and bias derived from the block's fields:

=======  ====  ===========================  =========================  ====================
format   bits  q                            scale                      bias
=======  ====  ===========================  =========================  ====================
Q4_0     4     4-bit                        d                          -8 d
Q4_1     4     4-bit                        d                          m
Q5_0     5     4 low bits + 1 high bit      d                          -16 d
Q5_1     5     4 low bits + 1 high bit      d                          m
Q8_0     8     int8 + 128                   d                          -128 d
Q4_K     4     4-bit, 8 sub-blocks of 32    d * sc_j (6-bit sc)        -dmin * m_j (6-bit m)
Q5_K     5     4 + 1 bits, 8 sub-blocks     d * sc_j                   -dmin * m_j
=======  ====  ===========================  =========================  ====================

The scales and biases are float32: ``d * sc_j`` has up to 17 significant bits, more than
float16 holds. Every product above is exact in float32 and ``scale * q + bias`` rounds once,
as llama.cpp's own dequantization does, so MLX dequantizes to the very same floats.

MXFP4 is decoded here too: its codes and E8M0 exponents are MLX's ``mxfp4`` mode as is.
Each decoder takes ``blocks`` (uint8, one block per row) and returns ``q`` (uint8, one value
per element in row order) and per-32 scales and biases (``biases`` is None for MXFP4).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

GROUP = 32
_BITS32 = np.arange(32, dtype=np.uint32)
_BITS8 = np.arange(8, dtype=np.uint8)


class AffineBlocks(NamedTuple):
    """Decoded blocks: ``q`` [n, block], ``scales`` / ``biases`` [n, block // 32]."""

    q: np.ndarray
    scales: np.ndarray
    biases: np.ndarray | None


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 field at byte ``start`` of each block, as float32 [n, 1]."""
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes [n, k] -> 2k values: all low nibbles, then all high nibbles (ggml's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits_32(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: 4 bytes as one little-endian u32, bit i belonging to value i -> [n, 32]."""
    word = qh.copy().view(np.uint32)  # [n, 1]
    return ((word >> _BITS32) & 1).astype(np.uint8)


def q4_0(blocks: np.ndarray) -> AffineBlocks:
    d = _f16(blocks, 0)
    return AffineBlocks(_nibbles(blocks[:, 2:18]), d, -8.0 * d)


def q4_1(blocks: np.ndarray) -> AffineBlocks:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    return AffineBlocks(_nibbles(blocks[:, 4:20]), d, m)


def q5_0(blocks: np.ndarray) -> AffineBlocks:
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 6:22]) | (_high_bits_32(blocks[:, 2:6]) << 4)
    return AffineBlocks(q, d, -16.0 * d)


def q5_1(blocks: np.ndarray) -> AffineBlocks:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _nibbles(blocks[:, 8:24]) | (_high_bits_32(blocks[:, 4:8]) << 4)
    return AffineBlocks(q, d, m)


def q8_0(blocks: np.ndarray) -> AffineBlocks:
    d = _f16(blocks, 0)
    q = (blocks[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return AffineBlocks(q, d, -128.0 * d)


def k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins packed in Q4_K/Q5_K's 12 bytes -> two [n, 8] arrays.

    Bytes 0-3 hold scales 0-3 (low 6 bits), bytes 4-7 mins 0-3; scales/mins 4-7 keep their
    low 4 bits in bytes 8-11 and their top 2 bits in the top bits of bytes 0-7.
    """
    low_sc, low_m, rest = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([low_sc & 0x3F, (rest & 0x0F) | ((low_sc >> 6) << 4)], axis=-1)
    m = np.concatenate([low_m & 0x3F, (rest >> 4) | ((low_m >> 6) << 4)], axis=-1)
    return sc, m


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 128 bytes: 4 chunks of 32 bytes; a chunk's low nibbles are sub-block 2j,
    its high nibbles sub-block 2j + 1 -> [n, 256] in element order."""
    n = qs.shape[0]
    chunks = qs.reshape(n, 4, 1, 32)
    return np.concatenate([chunks & 0x0F, chunks >> 4], axis=2).reshape(n, 256)


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, m = k_scale_min(blocks[:, 4:16])
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def q4_k(blocks: np.ndarray) -> AffineBlocks:
    scales, biases = _k_scales(blocks)
    return AffineBlocks(_k_low_nibbles(blocks[:, 16:144]), scales, biases)


def q5_k(blocks: np.ndarray) -> AffineBlocks:
    scales, biases = _k_scales(blocks)
    n = blocks.shape[0]
    # qh: bit i of byte k is the high bit of element k of sub-block i.
    qh = blocks[:, 16:48].reshape(n, 1, 32)
    high = ((qh >> _BITS8.reshape(1, 8, 1)) & 1).reshape(n, 256)
    q = _k_low_nibbles(blocks[:, 48:176]) | (high << 4)
    return AffineBlocks(q, scales, biases)


def mxfp4(blocks: np.ndarray) -> AffineBlocks:
    """E2M1 codes (ggml's order: low nibbles then high nibbles) and E8M0 exponents."""
    return AffineBlocks(_nibbles(blocks[:, 1:17]), blocks[:, 0:1].copy(), None)


class AffineFormat(NamedTuple):
    """How one GGUF type maps onto MLX quantization."""

    bits: int
    mode: str  # "affine" or "mxfp4"
    decode: Callable[[np.ndarray], AffineBlocks]


AFFINE_FORMATS: dict[str, AffineFormat] = {
    "Q4_0": AffineFormat(4, "affine", q4_0),
    "Q4_1": AffineFormat(4, "affine", q4_1),
    "Q5_0": AffineFormat(5, "affine", q5_0),
    "Q5_1": AffineFormat(5, "affine", q5_1),
    "Q8_0": AffineFormat(8, "affine", q8_0),
    "Q4_K": AffineFormat(4, "affine", q4_k),
    "Q5_K": AffineFormat(5, "affine", q5_k),
    "MXFP4": AffineFormat(4, "mxfp4", mxfp4),
}
