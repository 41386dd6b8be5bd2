"""Llama 3.x RoPE frequencies: the ``rope_freqs`` tensor llama.cpp writes, and back.

llama.cpp's converter turns Llama 3.1's ``rope_scaling`` (``factor``, ``low_freq_factor``,
``high_freq_factor``, ``original_max_position_embeddings``) into one factor per rotated
pair and writes only those (``rope_freqs.weight``); the RoPE angle of pair ``i`` is
``pos / (base ** (2i / d) * factor_i)``. mlx-lm's ``Llama3RoPE`` holds exactly those
periods in ``_freqs``, so the loader sets them from the tensor (``exact_periods``), and
``fit_llama3_scaling`` recovers parameters that reproduce them for a ``config.json``.

The factors only pin the combinations ``old / (hf - lf)`` and ``lf / (hf - lf)``, so the
fit fixes ``original_max_position_embeddings`` (the file's, else Llama 3's 8192); any
values with the same combinations give the same frequencies.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

_DEFAULT_OLD_CONTEXT = 8192
_TOLERANCE = 1e-4


def exact_periods(factors: np.ndarray, base: float, dims: int) -> mx.array:
    """``_freqs`` for mlx-lm's ``Llama3RoPE`` that apply ``factors`` exactly."""
    periods = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    return periods * mx.array(factors.astype(np.float32))


def llama3_factors(scaling: dict, base: float, dims: int) -> np.ndarray:
    """The per-pair factors mlx-lm's ``Llama3RoPE`` derives from a ``rope_scaling`` dict."""
    factor = scaling["factor"]
    lf, hf = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelens = 2 * math.pi * base ** (np.arange(0, dims, 2) / dims)
    smooth = (old / wavelens - lf) / (hf - lf)
    out = np.where(wavelens > old / lf, factor, 1.0)
    medium = (wavelens > old / hf) & (wavelens < old / lf)
    return np.where(medium, 1.0 / ((1 - smooth) / factor + smooth), out)


def fit_llama3_scaling(
    factors: np.ndarray, base: float, dims: int, old_context: int | None
) -> tuple[dict, float]:
    """``rope_scaling`` (llama3 type) reproducing ``factors``, and the largest relative error.

    Args:
        factors: the ``rope_freqs`` values, one per rotated pair.
        base: the RoPE base (``rope.freq_base``).
        dims: the rotated dimensions (head_dim).
        old_context: ``rope.scaling.original_context_length`` if the file has it.
    """
    f = factors.astype(np.float64)
    old = float(old_context or _DEFAULT_OLD_CONTEXT)
    factor = float(f.max())
    wavelens = 2 * math.pi * base ** (np.arange(0, dims, 2) / dims)
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "original_max_position_embeddings": int(old),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    }
    if factor > 1.0 + _TOLERANCE:
        medium = (f > 1.0 + _TOLERANCE) & (f < factor - _TOLERANCE * factor)
        # smooth s = (1/f - 1/factor) / (1 - 1/factor) = old / (wl (hf - lf)) - lf / (hf - lf)
        s = (1.0 / f[medium] - 1.0 / factor) / (1.0 - 1.0 / factor)
        inv_wl = 1.0 / wavelens[medium]
        if medium.sum() >= 2:
            a, b = np.polyfit(inv_wl, s, 1)
            span = old / a
            lf = -b * span
            scaling.update(low_freq_factor=float(lf), high_freq_factor=float(lf + span))
        elif medium.sum() == 1:
            # One point pins one combination; keep Llama 3's low_freq_factor of 1.
            hf = 1.0 + (old * inv_wl[0] - 1.0) / s[0]
            scaling["high_freq_factor"] = float(hf)
        else:
            # A step: put both thresholds between the last unscaled and first scaled pair.
            unscaled = wavelens[f <= 1.0 + _TOLERANCE]
            scaled = wavelens[f >= factor - _TOLERANCE * factor]
            if len(unscaled) and len(scaled):
                cut = math.sqrt(unscaled.max() * scaled.min())
                scaling.update(low_freq_factor=old / cut, high_freq_factor=old / cut * 1.001)
    fitted = llama3_factors(scaling, base, dims)
    error = float(np.max(np.abs(fitted - f) / np.maximum(np.abs(f), 1e-12)))
    return scaling, error
