"""The sampling part of a ``ForwardBatch``: per-row parameters as numpy arrays.

Each optional feature (seeds, penalties, logit bias, min_tokens, logprobs, prompt logprobs)
gets its arrays only when some row of the batch uses it, so the sampler can skip it with an
``is None`` check.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from mlxserve.scheduler.batch import (
    PenaltyArrays,
    PromptLogprobRequest,
    SamplingArrays,
    SeedArrays,
    TokenValues,
)
from mlxserve.scheduler.request import Request
from mlxserve.scheduler.sampling_params import PENALTY_CONTEXT

_SEED_MASK = (1 << 64) - 1


def build_sampling_arrays(
    rows: list[tuple[Request, int]], eos_token_ids: Collection[int] = ()
) -> SamplingArrays:
    """Rows are ``(request, n)`` as in ``build_forward_batch``; ``eos_token_ids`` are masked
    (with each request's ``stop_token_ids``) for rows that have not reached ``min_tokens``."""
    params = [r.params for r, _ in rows]
    return SamplingArrays(
        # Greedy rows (a temperature below MIN_TEMPERATURE) carry 0: the sampler's argmax.
        temperature=np.array([0.0 if p.greedy else p.temperature for p in params], np.float32),
        top_p=np.array([p.top_p for p in params], np.float32),
        top_k=np.array([p.top_k for p in params], np.int32),
        min_p=np.array([p.min_p for p in params], np.float32),
        seeds=_seeds(rows),
        penalties=_penalties(rows),
        logit_bias=_logit_bias(rows),
        banned=_banned(rows, eos_token_ids),
        logprobs=_logprobs(rows),
        prompt_logprobs=_prompt_logprobs(rows),
    )


def _samples(req: Request, n: int) -> bool:
    """The row's forward ends at the end of the sequence (and its proposals): its token is
    really sampled."""
    return req.computed_len + n - len(req.draft_ids) == req.seq_len


def _seeds(rows: list[tuple[Request, int]]) -> SeedArrays | None:
    if all(r.params.seed is None for r, _ in rows):
        return None
    return SeedArrays(
        seeded=np.array([r.params.seed is not None for r, _ in rows]),
        # Negative or huge seeds are fine: only their value modulo 2**64 keys the draws.
        seeds=np.array([(r.params.seed or 0) & _SEED_MASK for r, _ in rows], np.uint64),
        positions=np.array([r.output_len for r, _ in rows], np.int64),
    )


def _penalties(rows: list[tuple[Request, int]]) -> PenaltyArrays | None:
    if not any(r.params.uses_penalties for r, _ in rows):
        return None
    # As mlx-lm's processors: the window is the last tokens of prompt + output so far.
    context = np.full((len(rows), PENALTY_CONTEXT), -1, np.int32)
    for i, (req, n) in enumerate(rows):
        if req.params.uses_penalties and _samples(req, n):
            window = req.token_ids(max(0, req.seq_len - PENALTY_CONTEXT), req.seq_len)
            context[i, : len(window)] = window
    params = [r.params for r, _ in rows]
    return PenaltyArrays(
        context_ids=context,
        repetition=np.array([p.repetition_penalty for p in params], np.float32),
        presence=np.array([p.presence_penalty for p in params], np.float32),
        frequency=np.array([p.frequency_penalty for p in params], np.float32),
    )


def _token_values(entries: list[tuple[int, int, float]]) -> TokenValues | None:
    if not entries:
        return None
    rows, ids, values = zip(*entries, strict=True)
    return TokenValues(
        rows=np.array(rows, np.int32),
        # int64 first: an absurd id must fail the sampler's range check, not wrap around.
        token_ids=np.array(ids, np.int64),
        values=np.array(values, np.float32),
    )


def _logit_bias(rows: list[tuple[Request, int]]) -> TokenValues | None:
    return _token_values(
        [(i, t, v) for i, (req, _) in enumerate(rows) for t, v in req.params.logit_bias]
    )


def _banned(rows: list[tuple[Request, int]], eos_token_ids: Collection[int]) -> TokenValues | None:
    entries = []
    for i, (req, _) in enumerate(rows):
        p = req.params
        if req.output_len >= p.min_tokens:
            continue
        stops = set(p.stop_token_ids)
        if not p.ignore_eos:
            stops |= set(eos_token_ids)
        entries.extend((i, t, -np.inf) for t in sorted(stops))
    return _token_values(entries)


def _logprobs(rows: list[tuple[Request, int]]) -> np.ndarray | None:
    if all(r.params.logprobs is None for r, _ in rows):
        return None
    return np.array(
        [
            r.params.logprobs if r.params.logprobs is not None and _samples(r, n) else -1
            for r, n in rows
        ],
        np.int32,
    )


def _prompt_logprobs(rows: list[tuple[Request, int]]) -> PromptLogprobRequest | None:
    """Position ``j`` of a row predicts prompt token ``j + 1``; the last position of a chunk
    predicts the first token of the next chunk, and the last prompt position predicts the
    first output token (not a prompt logprob). Once a request has output, its prompt
    logprobs were delivered: a recompute after preemption does not ask again."""
    L = max(n for _, n in rows)
    top_k = np.full(len(rows), -1, np.int32)
    targets = np.full((len(rows), L), -1, np.int32)
    for i, (req, n) in enumerate(rows):
        k = req.params.prompt_logprobs
        if k is None or req.output_len > 0:
            continue
        start = req.computed_len
        count = min(n, req.prompt_len - 1 - start)
        if count <= 0:
            continue
        top_k[i] = k
        targets[i, :count] = req.prompt_ids[start + 1 : start + 1 + count]
    if not (top_k >= 0).any():
        return None
    return PromptLogprobRequest(top_k=top_k, targets=targets)
