"""The numpy-only description of one forward pass, handed from scheduler to executor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np


@dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling parameters of a batch (``temperature == 0`` is greedy)."""

    temperature: np.ndarray  # float32 [B]
    top_p: np.ndarray  # float32 [B]
    top_k: np.ndarray  # int32 [B], 0 = off
    min_p: np.ndarray  # float32 [B]


@dataclass(frozen=True)
class ForwardBatch:
    """A padded batch of rows; row ``b`` feeds ``extend_lens[b]`` new tokens.

    Layout of row ``b`` (``S = max(cached_lens + extend_lens)``)::

        input_ids[b]   : t t t 0 0          (L = max extend_len, right-padded)
        write_slots[b] : s s s 0 0          (pad positions write the padding slot 0)
        read_slots[b]  : s s s s s s s 0 0  (the row's slots for positions 0..total-1)

    Attributes:
        phase: "prefill" (some row feeds more than one token) or "decode".
        input_ids: int32 [B, L].
        cached_lens: int32 [B], tokens already in the pool (the RoPE offset of each row).
        extend_lens: int32 [B], real tokens of each row in ``input_ids``.
        write_slots: int32 [B, L], where the new tokens' K/V go.
        read_slots: int32 [B, S], slots of positions ``0..cached+extend-1``, padded with 0.
        sliding_write_slots / sliding_read_slots: the same in the sliding-window space,
            whose read column 0 is position ``sliding_read_start[b]`` (earlier positions
            are out of every window and their slots already freed).
        state_slots: int32 [B], each row's recurrent-state slot (0 without recurrent layers).
        fresh_rows: bool [B], rows starting from position 0 (their recurrent state is zero).
        sample_rows: bool [B], rows whose last token is the end of the sequence so far,
            so the forward's token for that row is a real next token.
        sampling: per-row sampling parameters.
    """

    phase: Literal["prefill", "decode"]
    request_ids: list[str]
    input_ids: np.ndarray
    cached_lens: np.ndarray
    extend_lens: np.ndarray
    write_slots: np.ndarray
    read_slots: np.ndarray
    sliding_write_slots: np.ndarray
    sliding_read_slots: np.ndarray
    sliding_read_start: np.ndarray
    state_slots: np.ndarray
    fresh_rows: np.ndarray
    sample_rows: np.ndarray
    sampling: SamplingArrays

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.extend_lens.sum())


@dataclass(frozen=True)
class ForwardOutput:
    """What a forward produced: one sampled token per row (meaningful where sampled)."""

    next_token_ids: np.ndarray  # int32 [B]
