"""Pack unsigned integers into MLX's quantized weight layout.

MLX stores a row of ``bits``-bit values as a little-endian bit stream in uint32 words: value
``i`` occupies bits ``[i * bits, (i + 1) * bits)`` of the row (for 4 bits: 8 values per word,
the first in the lowest nibble; for 5 bits: 8 values per 5 bytes). Rows are packed
independently, so any permutation or split of rows commutes with packing.
"""

from __future__ import annotations

import numpy as np


def pack_rows(q: np.ndarray, bits: int) -> np.ndarray:
    """``q`` (uint8, [..., cols], values < 2**bits) -> uint32 [..., cols * bits // 32].

    Raises:
        ValueError: if ``cols * bits`` is not a multiple of 32 or ``bits`` is unsupported.
    """
    *lead, cols = q.shape
    if (cols * bits) % 32:
        raise ValueError(f"cannot pack rows of {cols} {bits}-bit values into uint32 words")
    if bits == 8:
        packed = np.ascontiguousarray(q, dtype=np.uint8)
    elif bits == 4:
        packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    elif bits in (2, 3, 5, 6):
        # 8 values -> `bits` bytes: assemble them in a uint64, keep the low `bits` bytes.
        groups = q.reshape(*lead, cols // 8, 8).astype(np.uint64)
        shifts = (np.arange(8, dtype=np.uint64) * np.uint64(bits)).reshape(8)
        word = np.bitwise_or.reduce(groups << shifts, axis=-1)
        packed = word.astype("<u8").view(np.uint8).reshape(*lead, cols // 8, 8)[..., :bits]
    else:
        raise ValueError(f"unsupported bit width {bits}")
    return np.ascontiguousarray(packed).reshape(*lead, cols * bits // 8).view(np.uint32)
