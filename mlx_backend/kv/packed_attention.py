"""Attention over packed (quantized) K/V rows with the dequantization folded in.

With ``x`` a row's integer values, ``s``/``b`` its group's scale and bias, a dequantized
key is ``s * x + b`` per group, so for a query ``q``::

    q . k        = sum_g  s_g * (q_g . x_g)  +  b_g * sum(q_g)
    sum_j p_j v_j = sum_j (p_j * s_j) x_j     +  sum_j p_j b_j      (per group of v)

The integer values are converted to float once (no multiply-add over every K/V value);
scales and biases scale the ``[L, S]`` scores and probabilities instead of the
``[S, D]`` K/V. With 4-bit values the low and high nibbles are two planes of even and odd
elements, each multiplied with the matching half of the query (or written to the
matching half of the output), so they are never interleaved back into rows::

    scores [B, Hkv, G, M, S] = q_plane [B, Hkv, G, M, D/G/n] @ x_plane^T, summed over planes
    (M = repeats * L: the query heads that share a K/V head, times the query positions)

NOTE: measured on the CPU backend (SmolLM2's shapes, 30 layers, batch 32, 250 positions,
8-bit, gathers included, best of 7 beside other jobs): this attention 335 ms, the float
pool's gather + SDPA 413 ms, gather + dequantize + SDPA 468 ms; whole decode steps in
docs/benchmarks.md ("Quantized KV").
"""

from __future__ import annotations

import mlx.core as mx

from mlxserve.mlx_backend.kv.quantization import PackedRows


def _grouped(x: mx.array, groups: int) -> mx.array:
    """``[B, H, N, G * w]`` -> ``[B, H, G, N, w]``."""
    B, H, N, width = x.shape
    if groups == 1:
        return x[:, :, None]
    return x.reshape(B, H, N, groups, width // groups).transpose(0, 1, 3, 2, 4)


def _per_group(side: mx.array) -> mx.array:
    """Scales or biases ``[B, H, S, G]`` -> ``[B, H, G, 1, S]``."""
    return side.transpose(0, 1, 3, 2)[:, :, :, None, :]


def _sum_groups(x: mx.array) -> mx.array:
    return x[:, :, 0] if x.shape[2] == 1 else x.sum(axis=2)


def _masked(scores: mx.array, mask: mx.array | None, n_q_heads: int) -> mx.array:
    """Apply a boolean or additive mask ``[B, 1 | Hq, L, S]`` to ``[B, Hkv, rep, L, S]``."""
    if mask is None:
        return scores
    if mask.ndim == 4:
        B, heads, L, S = mask.shape
        if heads == n_q_heads and heads > 1:
            mask = mask.reshape(B, scores.shape[1], scores.shape[2], L, S)
        else:
            mask = mask[:, :, None]
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, mx.finfo(scores.dtype).min)
    return scores + mask


def folded_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    k_rows: PackedRows,
    v_rows: PackedRows,
    scale: float,
    mask: mx.array | None,
) -> mx.array:
    """Scaled dot-product attention of ``queries`` ``[B, Hq, L, Dk]`` over packed K/V rows
    ``[B, Hkv, S, words]``; returns ``[B, Hq, L, Dv]`` in the queries' dtype.

    Args:
        mask: None, a boolean mask (True: attend) or an additive one, broadcastable to
            ``[B, Hq, L, S]``.
    """
    B, Hq, L, Dk = queries.shape
    Hkv, S = keys.shape[1], keys.shape[2]
    rep, M = Hq // Hkv, Hq // Hkv * L
    dtype = queries.dtype
    q = (queries * scale).reshape(B, Hkv, M, Dk)

    k_values, k_scales, k_biases = k_rows.split(keys)
    planes = k_rows.value_planes(k_values)
    n, G = len(planes), k_rows.groups
    dots = None
    for i, plane in enumerate(planes):
        q_plane = _grouped(q if n == 1 else q[..., i::n], G)
        x = _grouped(plane, G).astype(dtype)
        part = q_plane @ x.swapaxes(-1, -2)
        dots = part if dots is None else dots + part
    q_sums = _grouped(q, G).sum(axis=-1, keepdims=True)
    scores = _sum_groups(dots * _per_group(k_scales) + q_sums * _per_group(k_biases))
    scores = _masked(scores.reshape(B, Hkv, rep, L, S), mask, Hq)
    probs = mx.softmax(scores, axis=-1, precise=True).reshape(B, Hkv, M, S)

    v_values, v_scales, v_biases = v_rows.split(values)
    planes = v_rows.value_planes(v_values)
    n, G = len(planes), v_rows.groups
    weighted = probs[:, :, None] * _per_group(v_scales)
    bias = (probs @ v_biases.astype(dtype)).transpose(0, 1, 3, 2)[..., None]
    outs = []
    for plane in planes:
        out = weighted @ _grouped(plane, G).astype(dtype) + bias
        outs.append(out.transpose(0, 1, 3, 2, 4).reshape(B, Hkv, M, -1))
    out = outs[0] if n == 1 else mx.stack(outs, axis=-1).reshape(B, Hkv, M, -1)
    return out.reshape(B, Hq, L, -1).astype(dtype)
