"""Raw model logprobs of sampled and prompt tokens, with their top-k alternatives.

OpenAI defines logprobs on the model's own distribution, so they are the log-softmax of
the logits *before* any sampling transform (temperature, penalties, bias, filters). Only the
rows (and prompt positions) that asked are computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlxserve.scheduler.batch import ForwardBatch, LogprobArrays


@dataclass
class PendingLogprobs:
    """Lazy MLX results, evaluated with the step's tokens, then read back as numpy."""

    rows: np.ndarray
    positions: np.ndarray | None
    token_ids: mx.array
    logprobs: mx.array
    top_ids: mx.array
    top_logprobs: mx.array

    def arrays(self) -> list[mx.array]:
        return [self.token_ids, self.logprobs, self.top_ids, self.top_logprobs]

    def to_numpy(self) -> LogprobArrays:
        return LogprobArrays(
            rows=self.rows.astype(np.int32),
            token_ids=np.array(self.token_ids, dtype=np.int32),
            logprobs=np.array(self.logprobs, dtype=np.float32),
            top_ids=np.array(self.top_ids, dtype=np.int32),
            top_logprobs=np.array(self.top_logprobs, dtype=np.float32),
            positions=None if self.positions is None else self.positions.astype(np.int32),
        )


def _logprobs(logits: mx.array, token_ids: mx.array, k: int) -> tuple[mx.array, mx.array, mx.array]:
    """Log-softmax of ``logits [N, V]``: the logprob of ``token_ids [N]`` and the ``k`` most
    likely tokens of each row (ids and logprobs, most likely first).

    Only the chosen entries are normalized (``logit - logsumexp``): the full ``[N, V]``
    log-softmax is never materialized, and the top-k is found on the logits (same order).
    """
    logits = logits.astype(mx.float32)
    lse = mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen = (mx.take_along_axis(logits, token_ids[:, None], axis=-1) - lse)[:, 0]
    N, V = logits.shape
    k = min(k, V)
    if k == 0:
        return chosen, mx.zeros((N, 0), mx.int32), mx.zeros((N, 0), mx.float32)
    # argpartition finds the k best in O(V); only those k are sorted.
    best = mx.argpartition(logits, kth=V - k, axis=-1)[:, V - k :]
    best_logits = mx.take_along_axis(logits, best, axis=-1)
    order = mx.argsort(-best_logits, axis=-1)
    top_ids = mx.take_along_axis(best, order, axis=-1).astype(mx.int32)
    return chosen, top_ids, mx.take_along_axis(best_logits, order, axis=-1) - lse


def sampled_logprobs(
    logits: mx.array, tokens: mx.array, top_k: np.ndarray | None
) -> PendingLogprobs | None:
    """Logprobs of the sampled ``tokens [B]`` under the raw ``logits [B, V]`` for the rows
    with ``top_k >= 0``; ``None`` when no row asked."""
    if top_k is None:
        return None
    rows = np.flatnonzero(top_k >= 0)
    if rows.size == 0:
        return None
    idx = mx.array(rows.astype(np.int32))
    token_ids = tokens[idx]
    lp, top_ids, top_lp = _logprobs(logits[idx], token_ids, int(top_k[rows].max()))
    return PendingLogprobs(rows, None, token_ids, lp, top_ids, top_lp)


def prompt_positions(batch: ForwardBatch) -> tuple[np.ndarray, np.ndarray] | None:
    """``(rows, local positions)`` whose logits prompt logprobs need, row-major; ``None``
    when no row asked."""
    request = batch.sampling.prompt_logprobs
    if request is None:
        return None
    rows, positions = np.nonzero(request.targets >= 0)
    return rows, positions


def prompt_logprobs(
    logits: mx.array, batch: ForwardBatch, rows: np.ndarray, positions: np.ndarray
) -> PendingLogprobs:
    """Logprobs of the prompt tokens predicted at ``(rows, positions)``.

    Args:
        logits: ``[P, V]`` logits of those positions.
        batch: the step's batch (targets, top-k, each row's offset).
        rows, positions: from ``prompt_positions``.
    """
    request = batch.sampling.prompt_logprobs
    vocab = logits.shape[-1]
    # Prompt ids index the logits: keep them in range whatever a caller sent (MLX does not
    # bounds-check); an id the embedding accepted is in range anyway.
    targets = np.clip(request.targets[rows, positions], 0, vocab - 1).astype(np.int32)
    k = int(request.top_k[np.unique(rows)].max())
    token_ids = mx.array(targets)
    lp, top_ids, top_lp = _logprobs(logits, token_ids, k)
    # Position ``p`` of a row predicts prompt position ``computed_len + p + 1``.
    prompt_pos = batch.computed_lens[rows].astype(np.int64) + positions + 1
    return PendingLogprobs(rows, prompt_pos, token_ids, lp, top_ids, top_lp)
