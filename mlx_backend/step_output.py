"""A step's lazy results, and the per-group pieces the executor assembles them from."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlxserve.mlx_backend.spec_verify import VerifyEntries
from mlxserve.scheduler.batch import ForwardOutput


class LaunchedStep:
    """A step's lazy results (``MLXExecutor.launch``; ``forward`` evaluates one at once):
    ``result()`` waits for them and turns them into a ``ForwardOutput``."""

    def __init__(
        self,
        batch_size: int,
        tokens: mx.array | None,
        pending: tuple,
        hidden: mx.array | None,
        entries: VerifyEntries | None,
    ) -> None:
        self.batch_size = batch_size
        self.tokens = tokens  # int32 [entries] (None: nothing sampled)
        self._pending = pending  # (sampled logprobs, prompt logprobs), each None if unasked
        self._hidden = hidden
        self._entries = entries

    def arrays(self) -> list[mx.array]:
        """What evaluating the step computes (the pools' scatters come with the pools)."""
        extra = [a for p in self._pending if p is not None for a in p.arrays()]
        return [a for a in (self.tokens, self._hidden) if a is not None] + extra

    def result(self) -> ForwardOutput:
        mx.eval(self.arrays())
        return self.output()

    def output(self) -> ForwardOutput:
        hidden = None if self._hidden is None else np.array(self._hidden)
        if self.tokens is None:
            return ForwardOutput(
                next_token_ids=np.zeros(self.batch_size, np.int32), embeddings=hidden
            )
        token_ids = np.array(self.tokens, dtype=np.int32)
        sampled, prompt = self._pending
        logprobs = None if sampled is None else sampled.to_numpy()
        spec_tokens = None
        if self._entries is not None:
            spec_tokens = self._entries.token_table(token_ids)
            token_ids = token_ids[self._entries.last]
            logprobs = self._entries.logprobs_by_row(logprobs)
        return ForwardOutput(
            next_token_ids=token_ids,
            logprobs=logprobs,
            prompt_logprobs=None if prompt is None else prompt.to_numpy(),
            embeddings=hidden,
            spec_token_ids=spec_tokens,
        )


@dataclass
class GroupOutput:
    """What one row group's forward gave (MLX arrays, lazy until evaluated)."""

    logits: mx.array | None  # [n, V], the rows' last positions (None: nothing sampled)
    prompt_logits: mx.array | None  # [k, V], the prompt positions asked for
    prompt_entries: np.ndarray | None  # which entries of ``prompt_at`` those are
    hidden: mx.array | None  # [n, hidden], the last positions (embedding rows)

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.logits, self.prompt_logits, self.hidden) if a is not None]


def in_order(parts: list[mx.array], indices) -> mx.array:  # noqa: ANN001
    """Concatenate ``parts`` (part ``k`` holds the entries ``indices[k]``) in entry order."""
    if len(parts) == 1:
        # One part holds every entry; it is in order unless a single group was reordered.
        order = np.asarray(indices[0])
        if np.array_equal(order, np.arange(len(order))):
            return parts[0]
    order = np.concatenate([np.asarray(i) for i in indices])
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    return mx.concatenate(parts)[mx.array(inverse.astype(np.int32))]
