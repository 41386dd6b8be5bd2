"""Turning the scheduler's chosen rows into the numpy arrays of a ``ForwardBatch``."""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from mlxserve.scheduler.batch import ForwardBatch, ImageEmbeddings
from mlxserve.scheduler.multimodal import chunk_images
from mlxserve.scheduler.request import Request
from mlxserve.scheduler.row_groups import plan_decode_groups, plan_row_groups
from mlxserve.scheduler.sampling_arrays import build_sampling_arrays
from mlxserve.scheduler.token_spaces import TokenSpace, TokenSpaces


def _space_slots(
    space: TokenSpace | None, rows: list[tuple[Request, int]]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Write slots ``[B, L]``, read slots ``[B, S]`` and the position of read column 0
    ``[B]`` of one space; zeros (the padding slot) where a row has nothing."""
    B, L = len(rows), max(n for _, n in rows)
    if space is None:
        return np.zeros((B, L), np.int32), np.zeros((B, 1), np.int32), np.zeros(B, np.int32)
    starts = np.array([space.start(r) for r, _ in rows], np.int32)
    ends = np.array([r.computed_len + n for r, n in rows], np.int32)
    S = int((ends - starts).max())
    write = np.zeros((B, L), np.int32)
    read = np.zeros((B, S), np.int32)
    for i, (req, n) in enumerate(rows):
        row = space.table[req.row]
        write[i, :n] = row[req.computed_len : req.computed_len + n]
        read[i, : ends[i] - starts[i]] = row[starts[i] : ends[i]]
    return write, read, starts


def build_forward_batch(
    phase: str,
    rows: list[tuple[Request, int]],
    spaces: TokenSpaces,
    eos_token_ids: Collection[int] = (),
    ragged_attention: bool = False,
    packed: bool = False,
) -> ForwardBatch:
    """Rows are ``(request, n)``: feed ``n`` tokens of the request from ``computed_len``.
    ``eos_token_ids`` are masked for rows still below their ``min_tokens``; with
    ``ragged_attention`` decode rows are not split by context, and with ``packed`` no
    rows are split at all (the backend packs them: nothing is padded)."""
    B, L = len(rows), max(n for _, n in rows)
    input_ids = np.zeros((B, L), np.int32)
    drafts = np.array([len(r.draft_ids) for r, _ in rows], np.int32)
    for i, (req, n) in enumerate(rows):
        real = n - int(drafts[i])
        input_ids[i, :real] = req.token_ids(req.computed_len, req.computed_len + real)
        input_ids[i, real:n] = req.draft_ids
    write, read, _ = _space_slots(spaces.full, rows)
    sliding_write, sliding_read, sliding_start = _space_slots(spaces.sliding, rows)
    extend_lens = np.array([n for _, n in rows], np.int32)
    ends = np.array([r.computed_len + n for r, n in rows], np.int32)
    sample_rows = np.array([r.computed_len + n - len(r.draft_ids) == r.seq_len for r, n in rows])
    embed_rows = np.array([r.embed for r, _ in rows]) & sample_rows
    return ForwardBatch(
        phase=phase,
        request_ids=[r.request_id for r, _ in rows],
        input_ids=input_ids,
        computed_lens=np.array([r.computed_len for r, _ in rows], np.int32),
        extend_lens=extend_lens,
        write_slots=write,
        read_slots=read,
        sliding_write_slots=sliding_write,
        sliding_read_slots=sliding_read,
        sliding_read_start=sliding_start,
        state_slots=np.array([r.state_slot or 0 for r, _ in rows], np.int32),
        fresh_rows=np.array([r.computed_len == 0 for r, _ in rows]),
        sample_rows=sample_rows,
        sampling=build_sampling_arrays(rows, eos_token_ids),
        row_groups=()
        if packed
        else _row_groups(extend_lens, ends, sliding_start, spaces, ragged_attention),
        embed_rows=embed_rows if embed_rows.any() else None,
        image_embeddings=_image_embeddings(rows),
        position_ids=_position_ids(rows, L),
        spec_lens=drafts if drafts.any() else None,
    )


def _image_embeddings(rows: list[tuple[Request, int]]) -> ImageEmbeddings | None:
    """The image placeholders the rows' chunks feed, with their vision features."""
    found = []
    for i, (req, n) in enumerate(rows):
        if req.images is None or n == 1 and req.computed_len >= req.prompt_len:
            continue
        chunk = chunk_images(req.images, req.computed_len, n)
        if chunk is not None:
            found.append((i, chunk))
    if not found:
        return None
    return ImageEmbeddings(
        rows=np.concatenate([np.full(len(c.columns), i, np.int32) for i, c in found]),
        columns=np.concatenate([c.columns for _, c in found]),
        features=np.concatenate([c.features for _, c in found]),
    )


def _position_ids(rows: list[tuple[Request, int]], L: int) -> np.ndarray | None:
    """Explicit ``[3, B, L]`` positions when a row has M-RoPE images (None: every row's
    positions are its token indices, which the executor derives itself)."""
    if all(req.images is None or not req.images.explicit for req, _ in rows):
        return None
    positions = np.zeros((3, len(rows), L), np.int32)
    for i, (req, n) in enumerate(rows):
        if req.images is None:
            positions[:, i, :n] = np.arange(req.computed_len, req.computed_len + n)
        else:
            positions[:, i, :n] = req.images.positions_of(req.computed_len, n)
    return positions


def _row_groups(
    extend_lens: np.ndarray,
    ends: np.ndarray,
    sliding_start: np.ndarray,
    spaces: TokenSpaces,
    ragged_attention: bool,
) -> tuple[np.ndarray, ...]:
    """The step's forwards: prefill rows grouped by tokens fed (the dense layers pad every
    row to the longest), decode rows by the context their attention reads (the full
    space's when the model has one) unless attention is ragged; ``()`` is one forward."""
    if int(extend_lens.max()) > 1:
        groups = plan_row_groups(extend_lens)
    elif ragged_attention:
        return ()  # decode feeds one token per row and attention reads each row's own keys
    elif spaces.full is not None:
        groups = plan_decode_groups(ends)
    elif spaces.sliding is not None:
        groups = plan_decode_groups(ends - sliding_start)
    else:
        return ()  # no attention: nothing is padded
    return tuple(groups) if len(groups) > 1 else ()
