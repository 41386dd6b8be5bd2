"""Batched sampling with per-row parameters: one set of array ops for the whole batch."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxserve.mlx_backend.penalties import process_logits
from mlxserve.scheduler.batch import SamplingArrays, SeedArrays


def _filtered_logits(
    logits: mx.array, top_k: mx.array, top_p: mx.array, min_p: mx.array
) -> mx.array:
    """Mask (to -inf) the tokens that each row's top_k / top_p / min_p filters remove."""
    V = logits.shape[-1]
    order = mx.argsort(-logits, axis=-1)  # [B, V], most likely first
    sorted_logits = mx.take_along_axis(logits, order, axis=-1)
    sorted_probs = mx.softmax(sorted_logits, axis=-1)
    rank = mx.arange(V, dtype=mx.int32)[None, :]
    k = mx.where(top_k > 0, top_k, V)[:, None]
    keep = rank < k
    # top_p keeps the smallest prefix whose mass reaches p: a token stays while the mass
    # before it is still below p, and the most likely token always stays (a top_p that is
    # 0 in float32, like 1e-300, once removed every token and the draw came from nothing).
    # top_p == 1 keeps all: a cumsum rounding to 1 before the tail must not cut it, or a
    # row's draw would depend on whether another row of its batch needs filtering.
    mass_before = mx.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep = keep & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1) | (rank == 0))
    keep = keep & (sorted_probs >= min_p[:, None] * sorted_probs[:, :1])
    sorted_logits = mx.where(keep, sorted_logits, -mx.inf)
    # Scatter back to vocabulary order.
    inverse = mx.argsort(order, axis=-1)
    return mx.take_along_axis(sorted_logits, inverse, axis=-1)


def seed_key(seed: int, position: int) -> np.ndarray:
    """The MLX PRNG key (uint32 ``[2]``) of a seeded request's draw at ``position``.

    It depends on nothing but ``(seed, position)``: not on the step, the batch, or what
    the engine RNG did before, which is what makes a seeded request reproducible.
    ``SeedSequence`` hashes the pair so that nearby seeds and positions give unrelated keys.
    """
    return np.random.SeedSequence((seed, position)).generate_state(2, np.uint32)


def _gumbel_noise(key: mx.array, seeds: SeedArrays, vocab: int) -> mx.array:
    """Gumbel noise ``[B, V]``: seeded rows from their own key, the others from ``key``."""
    B = seeds.seeded.shape[0]
    own = np.zeros((B, 2), np.uint32)
    for b in np.flatnonzero(seeds.seeded):
        own[b] = seed_key(int(seeds.seeds[b]), int(seeds.positions[b]))
    keys = mx.where(mx.array(seeds.seeded)[:, None], mx.array(own), mx.random.split(key, B))
    # vmap draws each row from its own key exactly as an unbatched draw would.
    return mx.vmap(lambda k: mx.random.gumbel(shape=(vocab,), key=k))(keys)


def apply_token_bitmask(logits: mx.array, bitmask: np.ndarray) -> mx.array:
    """Set to -inf the logits of tokens whose bit is clear (grammar constraints).

    Args:
        logits: float ``[B, V]``.
        bitmask: int32 ``[B, ceil(V / 32)]``, bit ``v % 32`` of word ``v // 32`` for token v.
    """
    V = logits.shape[-1]
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :V]
    return mx.where(mx.array(allowed.astype(bool)), logits, -mx.inf)


class Sampler:
    """Picks one token per row: argmax where temperature is 0, otherwise a draw from the
    temperature-scaled, filtered distribution. Logit bias, penalties and the min_tokens
    mask (see ``penalties.py``) apply to greedy and sampled rows alike."""

    def __init__(self, seed: int = 0) -> None:
        self._key = mx.random.key(seed)

    def __call__(self, logits: mx.array, params: SamplingArrays) -> mx.array:
        """Args:
            logits: float ``[B, V]``, the logits of each row's last position.
            params: per-row sampling parameters.
        Returns:
            int32 ``[B]`` token ids.
        """
        logits = process_logits(logits.astype(mx.float32), params)
        if params.token_bitmask is not None:
            logits = apply_token_bitmask(logits, params.token_bitmask)
        greedy = mx.argmax(logits, axis=-1).astype(mx.int32)
        temperature = params.temperature
        if not (temperature > 0).any():
            return greedy
        needs_filter = (
            (params.top_k > 0).any() or (params.top_p < 1).any() or (params.min_p > 0).any()
        )
        safe_t = mx.array(np.where(temperature > 0, temperature, 1.0).astype(np.float32))
        scaled = logits / safe_t[:, None]
        if needs_filter:
            scaled = _filtered_logits(
                scaled, mx.array(params.top_k), mx.array(params.top_p), mx.array(params.min_p)
            )
        self._key, sub = mx.random.split(self._key)
        if params.seeds is None:
            sampled = mx.random.categorical(scaled, axis=-1, key=sub)
        else:
            # Gumbel-max: the argmax of logits + Gumbel noise is a categorical draw, and
            # the noise can come from a different key in each row.
            noise = _gumbel_noise(sub, params.seeds, scaled.shape[-1])
            sampled = mx.argmax(scaled + noise, axis=-1)
        return mx.where(mx.array(temperature > 0), sampled.astype(mx.int32), greedy)
