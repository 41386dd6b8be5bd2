"""The numpy-only description of one forward pass, handed from scheduler to executor."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from mlxserve.scheduler.outputs import TokenLogprob


@dataclass(frozen=True)
class TokenValues:
    """Sparse ``(row, token id, value)`` entries of a ``[B, V]`` logits array.

    Token ids come from requests: the sampler drops those outside the vocabulary before
    they reach MLX (which does not bounds-check indices).
    """

    rows: np.ndarray  # int32 [N]
    token_ids: np.ndarray  # int64 [N], unchecked against the vocabulary
    values: np.ndarray  # float32 [N]


@dataclass(frozen=True)
class SeedArrays:
    """Rows with a seed draw from a key derived from ``(seed, output position)`` only."""

    seeded: np.ndarray  # bool [B]
    seeds: np.ndarray  # uint64 [B] (the seed modulo 2**64; 0 where not seeded)
    positions: np.ndarray  # int64 [B], tokens the row generated before this one


@dataclass(frozen=True)
class PenaltyArrays:
    """Repetition / presence / frequency penalties over each row's recent tokens."""

    context_ids: np.ndarray  # int32 [B, C], the last C tokens of prompt + output, -1 padded
    repetition: np.ndarray  # float32 [B], 1 = off
    presence: np.ndarray  # float32 [B], 0 = off
    frequency: np.ndarray  # float32 [B], 0 = off


@dataclass(frozen=True)
class PromptLogprobRequest:
    """Rows that want the logprob of each prompt token fed in this step."""

    top_k: np.ndarray  # int32 [B], -1 = row does not ask
    # int32 [B, L]: the prompt token that fed position ``i`` of the row predicts (the next
    # prompt token, possibly the first of the next chunk); -1 where there is none.
    targets: np.ndarray


@dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling parameters of a batch (``temperature == 0`` is greedy).

    The optional groups are ``None`` when no row of the batch uses the feature, so a plain
    batch pays nothing for them.
    """

    temperature: np.ndarray  # float32 [B]
    top_p: np.ndarray  # float32 [B]
    top_k: np.ndarray  # int32 [B], 0 = off
    min_p: np.ndarray  # float32 [B]
    seeds: SeedArrays | None = None
    penalties: PenaltyArrays | None = None
    logit_bias: TokenValues | None = None  # added to the logits
    banned: TokenValues | None = None  # masked to -inf (EOS / stop ids before min_tokens)
    logprobs: np.ndarray | None = None  # int32 [B], top-k of the sampled token, -1 = off
    prompt_logprobs: PromptLogprobRequest | None = None
    # int32 [B, ceil(V / 32)]: bit v of row b set iff token v is allowed (grammar
    # constraints; all ones for unconstrained rows).
    token_bitmask: np.ndarray | None = None


@dataclass(frozen=True)
class ImageEmbeddings:
    """Input embeddings that replace the token embeddings at some ``(row, column)`` of
    ``input_ids``: the vision features of the image placeholders a prefill chunk feeds."""

    rows: np.ndarray  # int32 [K]
    columns: np.ndarray  # int32 [K]
    features: np.ndarray  # float32 [K, hidden]


@dataclass(frozen=True)
class ForwardBatch:
    """A padded batch of rows; row ``b`` feeds ``extend_lens[b]`` new tokens.

    Layout of row ``b`` (``S = max(computed_lens + extend_lens)``)::

        input_ids[b]   : t t t 0 0          (L = max extend_len, right-padded)
        write_slots[b] : s s s 0 0          (pad positions write the padding slot 0)
        read_slots[b]  : s s s s s s s 0 0  (the row's slots for positions 0..total-1)

    Attributes:
        phase: "prefill" (some row feeds more than one token) or "decode".
        input_ids: int32 [B, L].
        computed_lens: int32 [B], tokens already in the pool (the RoPE offset of each row).
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
        state_copies_in: int32 [K, 2] ``(src, dst)`` state slots copied before the forward:
            a request resuming from a prefix-cache snapshot gets the snapshot's state.
        state_snapshots: int32 [K, 2] ``(src, dst)`` state slots copied after the forward:
            a row's state at the end of its chunk, kept by the prefix cache.
        row_groups: the rows split into forwards of similar width (``row_groups.py``:
            tokens fed in prefill, context read in decode); empty means one forward of all
            rows. Each group is padded only to its own widest row.
        embed_rows: bool [B], rows of embedding requests whose prompt ends in this step:
            the forward returns the final hidden state of their last position instead of a
            token (None: no such row). When every row is one, nothing is sampled.
        image_embeddings: the image placeholders of this step's prefill chunks (None: none).
        position_ids: int32 ``[3, B, L]`` explicit M-RoPE positions of every fed token
            (None: a row's positions are ``computed_lens[b] + 0..L-1``); set when a row of
            the batch has M-RoPE images (explicit positions or a position delta).
        spec_lens: int32 [B], proposed tokens at the end of each row (speculative decoding:
            the row feeds its last token then ``spec_lens[b]`` proposals, and a token is
            sampled at each of those ``1 + spec_lens[b]`` positions, as the plain decode
            step at that output position would); None: no row has proposals.
        decode_rows: the leading rows that decode (all of a decode step's; in a packed
            prefill step, the decoding rows that ride along the prompt chunks).
    """

    phase: Literal["prefill", "decode"]
    request_ids: list[str]
    input_ids: np.ndarray
    computed_lens: np.ndarray
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
    state_copies_in: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int32))
    state_snapshots: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int32))
    row_groups: tuple[np.ndarray, ...] = ()
    embed_rows: np.ndarray | None = None
    image_embeddings: ImageEmbeddings | None = None
    position_ids: np.ndarray | None = None
    spec_lens: np.ndarray | None = None
    decode_rows: int = 0

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.extend_lens.sum())


@dataclass(frozen=True)
class LogprobArrays:
    """Raw model logprobs (log-softmax before any sampling transform) of N tokens.

    Entry ``n`` belongs to batch row ``rows[n]``; for prompt logprobs ``positions[n]`` is
    the prompt position of ``token_ids[n]`` (entries of one row ascend by position).
    ``top_ids[n, :k]`` / ``top_logprobs[n, :k]`` are the ``k`` most likely tokens, most
    likely first, where ``k`` is what that row asked for (``K`` is the batch's largest).
    """

    rows: np.ndarray  # int32 [N]
    token_ids: np.ndarray  # int32 [N]
    logprobs: np.ndarray  # float32 [N]
    top_ids: np.ndarray  # int32 [N, K]
    top_logprobs: np.ndarray  # float32 [N, K]
    positions: np.ndarray | None = None  # int32 [N]

    def entry(self, n: int, k: int) -> TokenLogprob:
        """Entry ``n`` with its ``k`` best alternatives."""
        top = zip(self.top_ids[n, :k].tolist(), self.top_logprobs[n, :k].tolist(), strict=True)
        return TokenLogprob(int(self.token_ids[n]), float(self.logprobs[n]), tuple(top))


@dataclass(frozen=True)
class ForwardOutput:
    """What a forward produced: one sampled token per row (meaningful where sampled).

    ``logprobs`` covers the sampled tokens of the rows that asked; ``prompt_logprobs`` the
    prompt positions of the rows that asked. Both are ``None`` when no row asked.
    ``embeddings`` holds the final hidden state of the last position of each row of
    ``batch.embed_rows`` (other rows mean nothing; None when the batch has no such row).
    ``spec_token_ids[b, j]`` is the token sampled at fed position ``j`` of the last
    ``1 + batch.spec_lens[b]`` of row ``b`` (-1 beyond; None without ``spec_lens``); such a
    row's ``logprobs`` entries carry that ``j`` in ``positions``.
    """

    next_token_ids: np.ndarray  # int32 [B]
    logprobs: LogprobArrays | None = None
    prompt_logprobs: LogprobArrays | None = None
    embeddings: np.ndarray | None = None  # float32 [B, hidden]
    spec_token_ids: np.ndarray | None = None  # int32 [B, 1 + max(spec_lens)]
