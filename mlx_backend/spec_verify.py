"""Verification positions of a batch with proposals (speculative decoding), numpy only.

A row with ``k`` proposals (``ForwardBatch.spec_lens``) needs a token at each of its last
``1 + k`` fed positions; every other row at its last position only. Those ``(row, position)``
pairs are the batch's *entries*, ordered by row then position; the sampler runs once over
all of them, each entry with its row's parameters as the plain decode step at that output
position would use them (a seeded row's ``j``-th entry draws with the key of output
position ``output_len + j``). Why the tokens picked this way make speculation exact is in
``scheduler/speculation.py``.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from mlxserve.scheduler.batch import (
    ForwardBatch,
    LogprobArrays,
    PenaltyArrays,
    SamplingArrays,
    SeedArrays,
    TokenValues,
)


class VerifyEntries:
    """The entries of a batch with proposals.

    Attributes:
        owner: int ``[E]``, the batch row of each entry.
        offset: int ``[E]``, the entry's index among its row's entries (``j``).
        position: int ``[E]``, the entry's position within its row's fed tokens.
        start / count: int ``[B]``, each row's first entry and number of entries.
        last: int ``[B]``, each row's last entry (its last fed position).
    """

    def __init__(self, batch: ForwardBatch) -> None:
        spec = batch.spec_lens.astype(np.int64)
        self.count = spec + 1
        self.start = np.cumsum(self.count) - self.count
        self.last = self.start + spec
        self.owner = np.repeat(np.arange(batch.batch_size), self.count)
        self.offset = np.arange(int(self.count.sum())) - self.start[self.owner]
        first_checked = batch.extend_lens.astype(np.int64) - 1 - spec
        self.position = first_checked[self.owner] + self.offset
        self.width = int(self.count.max())

    def of_rows(self, rows: np.ndarray) -> np.ndarray:
        """The entries of ``rows``, row by row in the order given."""
        rows = np.asarray(rows, np.int64)
        counts = self.count[rows]
        ends = np.cumsum(counts)
        return np.repeat(self.start[rows] - (ends - counts), counts) + np.arange(int(ends[-1]))

    def token_table(self, tokens: np.ndarray) -> np.ndarray:
        """``[B, width]``: the tokens of each row's entries, -1 beyond its count."""
        table = np.full((len(self.count), self.width), -1, np.int32)
        table[self.owner, self.offset] = tokens
        return table

    def logprobs_by_row(self, arrays: LogprobArrays | None) -> LogprobArrays | None:
        """Entry-indexed logprobs re-indexed by batch row, ``positions`` the entry's ``j``."""
        if arrays is None:
            return None
        entries = arrays.rows.astype(np.int64)
        return replace(
            arrays,
            rows=self.owner[entries].astype(np.int32),
            positions=self.offset[entries].astype(np.int32),
        )

    def expand(self, params: SamplingArrays) -> SamplingArrays:
        """Each row's sampling parameters for each of its entries."""
        o = self.owner
        seeds = params.seeds
        if seeds is not None:
            seeds = SeedArrays(
                seeded=seeds.seeded[o],
                seeds=seeds.seeds[o],
                positions=seeds.positions[o] + self.offset,
            )
        pen = params.penalties
        if pen is not None:
            pen = PenaltyArrays(
                pen.context_ids[o], pen.repetition[o], pen.presence[o], pen.frequency[o]
            )
        return SamplingArrays(
            temperature=params.temperature[o],
            top_p=params.top_p[o],
            top_k=params.top_k[o],
            min_p=params.min_p[o],
            seeds=seeds,
            penalties=pen,
            logit_bias=self._expand_values(params.logit_bias),
            banned=self._expand_values(params.banned),
            logprobs=None if params.logprobs is None else params.logprobs[o],
            prompt_logprobs=params.prompt_logprobs,
            token_bitmask=None if params.token_bitmask is None else params.token_bitmask[o],
        )

    def _expand_values(self, values: TokenValues | None) -> TokenValues | None:
        """Row-indexed sparse values repeated for each entry of their row."""
        if values is None:
            return None
        rows = values.rows.astype(np.int64)
        n = self.count[rows]
        pick = np.repeat(np.arange(len(rows)), n)
        entries = self.of_rows(rows)
        return TokenValues(
            rows=entries.astype(np.int32),
            token_ids=values.token_ids[pick],
            values=values.values[pick],
        )
