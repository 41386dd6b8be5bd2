"""Logits processors applied per row in one set of ops: logit bias, repetition / presence /
frequency penalties, and the min_tokens mask.

The semantics and order are mlx-lm's ``make_logits_processors`` (bias first, then the
repetition, presence and frequency penalties, each on the result of the previous one), so
a row gets exactly what ``mlx_lm.generate_step`` would give it alone. The min_tokens mask
comes last: a banned token stays banned whatever bias it was given.

Token ids reach here from requests. MLX does not bounds-check indices (an out-of-range id
can crash the process), so ids outside ``[0, V)`` are dropped in numpy first.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np

from mlxserve.scheduler.batch import PenaltyArrays, SamplingArrays, TokenValues

logger = logging.getLogger(__name__)


def process_logits(logits: mx.array, params: SamplingArrays) -> mx.array:
    """Apply the batch's logits processors; a batch that uses none gets ``logits`` back.

    Args:
        logits: float32 ``[B, V]``.
        params: the batch's sampling arrays.
    Returns:
        float32 ``[B, V]``, a new array (``logits`` itself is never modified).
    """
    if params.logit_bias is not None:
        logits = _add_bias(logits, params.logit_bias)
    if params.penalties is not None:
        logits = _penalize(logits, params.penalties)
    if params.banned is not None:
        logits = _ban(logits, params.banned)
    return logits


def _in_vocab(entries: TokenValues, vocab: int, what: str | None) -> np.ndarray:
    """The entries whose token id is inside the vocabulary (a warning naming ``what`` for
    the rest, unless ``what`` is None)."""
    ok = (entries.token_ids >= 0) & (entries.token_ids < vocab)
    if what is not None and not ok.all():
        bad = entries.token_ids[~ok]
        logger.warning("%s: dropping token ids outside the vocabulary of %d: %s", what, vocab, bad)
    return ok


def _flat_index(rows: np.ndarray, ids: np.ndarray, vocab: int) -> mx.array:
    return mx.array(rows.astype(np.int64) * vocab + ids.astype(np.int64))


def _scatter(logits: mx.array, flat: mx.array, values: mx.array) -> mx.array:
    """``logits`` with entries ``flat`` (indices into the flattened array) set to ``values``.

    NOTE: item assignment rebinds the very array object it is applied to; doing it on a
    reshaped handle keeps the caller's ``logits`` unchanged.
    """
    out = logits.reshape(-1)
    out[flat] = values
    return out.reshape(logits.shape)


def _add_bias(logits: mx.array, bias: TokenValues) -> mx.array:
    ok = _in_vocab(bias, logits.shape[-1], "logit_bias")
    if not ok.any():
        return logits
    rows = mx.array(bias.rows[ok])
    ids = mx.array(bias.token_ids[ok].astype(np.int32))
    return logits.at[rows, ids].add(mx.array(bias.values[ok]))


def _penalize(logits: mx.array, penalties: PenaltyArrays) -> mx.array:
    """Penalties on the distinct tokens of each row's window (a gather, elementwise math
    and a scatter of at most ``B x C`` entries, never a ``[B, V]`` pass)."""
    B, C = penalties.context_ids.shape
    V = logits.shape[-1]
    rows = np.repeat(np.arange(B, dtype=np.int64), C)
    ids = penalties.context_ids.reshape(-1).astype(np.int64)
    ok = (ids >= 0) & (ids < V)
    if not ok.any():
        return logits
    # One entry per distinct (row, token) with its count in the window: a repeated token is
    # penalized once by repetition / presence and once per occurrence by frequency.
    keys, counts = np.unique(rows[ok] * V + ids[ok], return_counts=True)
    r = keys // V
    flat = mx.array(keys)
    x = logits.reshape(-1)[flat]
    rep = mx.array(penalties.repetition[r])
    x = mx.where(x < 0, x * rep, x / rep)
    x = x - mx.array(penalties.presence[r])
    x = x - mx.array(penalties.frequency[r] * counts.astype(np.float32))
    return _scatter(logits, flat, x)


def _ban(logits: mx.array, banned: TokenValues) -> mx.array:
    V = logits.shape[-1]
    # Quietly: an EOS id past the logits (seen in some GGUF configs) can never be sampled.
    ok = _in_vocab(banned, V, None)
    if not ok.any():
        return logits
    flat = _flat_index(banned.rows[ok], banned.token_ids[ok], V)
    return _scatter(logits, flat, mx.array(-np.inf, dtype=logits.dtype))
