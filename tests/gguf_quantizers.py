"""Small numpy encoders for GGUF's K-quant formats (gguf-py only dequantizes them).

Each encoder takes float32 rows (width a multiple of 256) and returns ``(raw, values)``:
the GGUF bytes and the float32 values those bytes stand for, computed the way ggml
decodes them. They are not llama.cpp's optimizing quantizers (no search for the best
scales), only valid encodings of the given weights; ``tests/test_gguf_formats.py`` checks
``values`` against ``gguf.quants.dequantize(raw)``.
"""

from __future__ import annotations

import numpy as np


def _f16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float16 rounding of ``x`` [n] -> (its 2 bytes [n, 2], its float32 value [n, 1])."""
    h = x.astype(np.float16)
    return h.reshape(-1, 1).view(np.uint8), h.astype(np.float32).reshape(-1, 1)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros_like(a), where=b != 0)


def _k_scales_pack(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins [n, 8] -> the 12 bytes Q4_K/Q5_K keep them in."""
    low_sc = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    low_m = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    rest = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return np.concatenate([low_sc, low_m, rest], axis=1).astype(np.uint8)


def _k_affine(x: np.ndarray, levels: int):
    """Shared Q4_K/Q5_K encoding: 8 sub-blocks of 32, v = d*sc*q - dmin*m."""
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0.0)
    scale = (sub.max(axis=2) - lo) / levels
    d_raw, d = _f16(scale.max(axis=1) / 63)
    dmin_raw, dmin = _f16(-lo.min(axis=1) / 63)
    sc = np.clip(np.round(_safe_div(scale, d)), 0, 63).astype(np.uint8)
    m = np.clip(np.round(_safe_div(-lo, dmin)), 0, 63).astype(np.uint8)
    eff_scale = d * sc.astype(np.float32)
    eff_min = dmin * m.astype(np.float32)
    q = np.round(
        _safe_div(sub + eff_min[..., None], np.broadcast_to(eff_scale[..., None], sub.shape))
    )
    q = np.clip(q, 0, levels).astype(np.uint8)
    values = (eff_scale[..., None] * q.astype(np.float32) - eff_min[..., None]).reshape(n, 256)
    head = np.concatenate([d_raw, dmin_raw, _k_scales_pack(sc, m)], axis=1)
    return head, q.reshape(n, 256), values


def _k_low_nibbles(q: np.ndarray) -> np.ndarray:
    chunks = q.reshape(-1, 4, 2, 32) & 15
    return (chunks[:, :, 0, :] | (chunks[:, :, 1, :] << 4)).reshape(-1, 128).astype(np.uint8)


def quantize_q4_k(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x = rows.astype(np.float32).reshape(-1, 256)
    head, q, values = _k_affine(x, 15)
    raw = np.concatenate([head, _k_low_nibbles(q)], axis=1)
    return _rows(raw, rows), values.reshape(rows.shape)


def quantize_q5_k(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x = rows.astype(np.float32).reshape(-1, 256)
    head, q, values = _k_affine(x, 31)
    high = (q >> 4).reshape(-1, 8, 32)
    qh = np.zeros((x.shape[0], 32), dtype=np.uint8)
    for s in range(8):
        qh |= (high[:, s, :] << s).astype(np.uint8)
    raw = np.concatenate([head, qh, _k_low_nibbles(q)], axis=1)
    return _rows(raw, rows), values.reshape(rows.shape)


def quantize_q6_k(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x = rows.astype(np.float32).reshape(-1, 256)
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    scale = np.abs(sub).max(axis=2) / 31
    d_raw, d = _f16(scale.max(axis=1) / 127)
    sc = np.clip(np.round(_safe_div(scale, d)), -128, 127).astype(np.int8)
    eff = d * sc.astype(np.float32)
    q = np.clip(np.round(_safe_div(sub, np.broadcast_to(eff[..., None], sub.shape))) + 32, 0, 63)
    q = q.astype(np.uint8).reshape(n, 256)
    values = (eff[..., None] * (q.reshape(n, 16, 16).astype(np.float32) - 32)).reshape(n, 256)
    low = (q & 15).reshape(n, 2, 2, 64)
    ql = (low[:, :, 0, :] | (low[:, :, 1, :] << 4)).reshape(n, 128)
    high = (q >> 4).reshape(n, 2, 4, 32)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    raw = np.concatenate([ql, qh.reshape(n, 64), sc.view(np.uint8), d_raw], axis=1)
    return _rows(raw.astype(np.uint8), rows), values.reshape(rows.shape)


def _rows(raw: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Blocks [n_blocks, type_size] -> bytes shaped like ``rows`` with its last axis in bytes."""
    *lead, cols = rows.shape
    return raw.reshape(*lead, -1)


K_QUANTIZERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}
