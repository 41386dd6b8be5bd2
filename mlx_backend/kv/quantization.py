"""K/V quantization of the pools (``--kv-bits``, ``--kv-group-size``): mlx-lm's format,
one packed row per token and head.

A quantized row holds what ``mx.quantize`` makes of one head's K (or V) of one token,
exactly the values, scales and biases mlx-lm's ``QuantizedKVCache`` stores, side by side in
one row of uint32 words so that a read is a single gather::

    bytes  [0, D*bits/8)           packed values: element i in bits [bits*i, bits*(i+1))
                                   of its little-endian word (bytes hold 8-bit values in
                                   order, or two 4-bit values, low nibble first)
           [.., + G*size)          scales, G = D / group_size, in the model's K/V dtype
           [.., + G*size)          biases: value = packed * scale + bias, per group

Quantization is per row (token and head), so quantizing a whole prefill at once gives the
bytes that quantizing it token by token would. Every size is a multiple of 4 bytes (D is
a multiple of the group size, 32 or more).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import mlx.core as mx

KV_BITS = (8, 4)
KV_GROUP_SIZES = (32, 64, 128)

# How attention reads quantized pools:
#   "quantized-sdpa": the cache view carries ``bits`` and ``group_size`` and returns mlx-lm's
#       (packed, scales, biases) tuples, so mlx-lm's own quantized SDPA runs on them.
#   "dequantize": the view returns dequantized K/V and the model's dense SDPA runs on them.
#   "folded": mlxserve's own attention on the packed rows: the native ragged op, which reads
#       them in place and dequantizes them in the kernel (``mlx_backend/attention/``), on
#       the layers it serves; elsewhere, or with the op off, ``kv/packed_attention.py``, where
#       the scales and biases are applied to the scores and probabilities, not to every K/V
#       value; any attention call neither covers runs as "dequantize".
AttentionPath = Literal["quantized-sdpa", "dequantize", "folded"]
ATTENTION_PATHS: tuple[str, ...] = ("quantized-sdpa", "dequantize", "folded")


@dataclass(frozen=True)
class KVQuantization:
    """How the K/V pools are quantized.

    Attributes:
        bits: bits per stored value (8 or 4).
        group_size: values sharing one scale and bias (32, 64 or 128).
    """

    bits: int
    group_size: int

    def __post_init__(self) -> None:
        if self.bits not in KV_BITS:
            raise ValueError(f"kv bits must be one of {KV_BITS}, got {self.bits}")
        if self.group_size not in KV_GROUP_SIZES:
            raise ValueError(
                f"kv group size must be one of {KV_GROUP_SIZES}, got {self.group_size}"
            )

    def describe(self) -> str:
        return f"{self.bits}-bit, group {self.group_size}"

    def row_bytes(self, dim: int, dtype: mx.Dtype) -> int:
        """Bytes of one quantized row: packed values plus a scale and a bias per group."""
        return dim * self.bits // 8 + 2 * (dim // self.group_size) * dtype.size

    def check_dim(self, dim: int, what: str) -> None:
        """Raises:
        ValueError: ``dim`` values cannot be split into groups of ``group_size``."""
        if dim % self.group_size:
            sizes = [g for g in KV_GROUP_SIZES if dim % g == 0]
            hint = f"use --kv-group-size {sizes[-1]}" if sizes else "run without --kv-bits"
            raise ValueError(
                f"--kv-group-size {self.group_size} does not divide the model's {what} "
                f"({dim} values per head); {hint}"
            )

    def rows(self, dim: int, dtype: mx.Dtype) -> PackedRows:
        """The packed-row format of ``dim``-value rows of ``dtype``."""
        return PackedRows(self.bits, self.group_size, dim, dtype)


@dataclass(frozen=True)
class PackedRows:
    """The packed-row format of one pool: its width, and the views of a gathered row."""

    bits: int
    group_size: int
    dim: int
    dtype: mx.Dtype

    @property
    def groups(self) -> int:
        return self.dim // self.group_size

    @property
    def value_bytes(self) -> int:
        return self.dim * self.bits // 8

    @property
    def words(self) -> int:
        """uint32 words per row."""
        return (self.value_bytes + 2 * self.groups * self.dtype.size) // 4

    def encode(self, rows: mx.array) -> mx.array:
        """Quantize float rows ``[T, D]`` into packed rows ``[T, words]``."""
        packed, scales, biases = mx.quantize(rows, group_size=self.group_size, bits=self.bits)
        parts = [a.view(mx.uint8) for a in (packed, scales, biases)]
        return mx.concatenate(parts, axis=-1).view(mx.uint32)

    def split(self, rows: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """``(values, scales, biases)`` of packed rows ``[..., words]``: the values as
        uint8 bytes ``[..., D * bits / 8]``, scales and biases ``[..., G]``."""
        raw = rows.view(mx.uint8)
        end = self.value_bytes
        side = self.groups * self.dtype.size
        scales = raw[..., end : end + side].view(self.dtype)
        biases = raw[..., end + side : end + 2 * side].view(self.dtype)
        return raw[..., :end], scales, biases

    def mlx_lm_tuple(self, rows: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """``(packed uint32 words, scales, biases)`` of packed rows, as ``mx.quantize``
        returns them (what mlx-lm's quantized SDPA takes)."""
        _, scales, biases = self.split(rows)
        return rows[..., : self.value_bytes // 4], scales, biases

    def value_planes(self, values: mx.array) -> list[mx.array]:
        """The unpacked values as ``n`` integer planes ``[..., D / n]``: plane ``k`` holds
        elements ``k, k + n, k + 2n, ...`` (8 bits: the bytes themselves, n = 1; 4 bits:
        low and high nibbles, n = 2). Each plane keeps the grouping: its ``D / G / n``
        consecutive entries belong to one group."""
        if self.bits == 8:
            return [values]
        return [values & 15, values >> 4]

    def dequantize(self, rows: mx.array) -> mx.array:
        """Dense rows ``[..., D]`` of packed rows; bit-identical to ``mx.dequantize``.

        NOTE: plain ops: they run ~3x faster than ``mx.dequantize`` on MLX's CPU backend
        (measured: the K/V of 30 layers, 32 rows x 200 positions x 3 heads x 64 values:
        50 ms vs 146 ms at 8 bits).
        """
        values, scales, biases = self.split(rows)
        planes = self.value_planes(values)
        values = planes[0] if len(planes) == 1 else mx.stack(planes, axis=-1)
        lead = rows.shape[:-1]
        values = values.reshape(*lead, self.groups, self.group_size).astype(self.dtype)
        dense = values * scales[..., None] + biases[..., None]
        return dense.reshape(*lead, self.dim)


def default_attention_path() -> AttentionPath:
    """The fastest path on this backend (measured: docs/benchmarks.md, "Quantized KV").

    NOTE: on MLX's CPU backend ``quantized_matmul`` is a naive kernel, so mlx-lm's quantized
    SDPA is the slowest path, and dequantizing every gathered K/V value costs more than the
    float pool's whole read; the native op dequantizes each row in the kernel as it reads it
    (0.91-0.97x the float pool's decode rate), and without it the folded attention converts
    the packed values to float once and applies scales and biases to the scores. On Metal
    ``quantized_matmul`` is a real kernel that reads the packed K/V directly.
    """
    return "quantized-sdpa" if mx.metal.is_available() else "folded"
