"""Image inputs of a request, on numpy: where each image's placeholder tokens sit in the
prompt, the vision features that replace their embeddings, and explicit positions for
models whose rotary positions are not the token index (M-RoPE).

The vision tower runs once per image before the request reaches the engine; the engine
only slices these arrays into each prefill chunk (``chunk_images``) and hands them to the
executor in the ``ForwardBatch``. Once a request's prefill has passed an image, the
image's features are released; a preempted request that must recompute the image gets
them back from ``restore`` (the vision encoder's cache, or the image encoded again).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

# Prefix-cache keys of image placeholders: negative int32, so never a real token id.
_KEY_LIMIT = 2**31 - 1


@dataclass
class ImageSpan:
    """One image of a prompt.

    Attributes:
        start: the position of its first placeholder token.
        length: how many placeholder tokens it has (one per feature row).
        features: float32 ``[length, hidden]``: the embedding of each placeholder position
            (None once released).
        digest: the image content's hash (hex): its prefix-cache key and vision-cache key.
    """

    start: int
    length: int
    features: np.ndarray | None
    digest: str
    _keys: np.ndarray | None = field(default=None, repr=False)

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def cache_keys(self) -> np.ndarray:
        """int32 ``[length]``: the ids standing in for this image's placeholders in
        prefix-cache keys, drawn from the content hash. One 31-bit key per position, so
        two different images collide only if every one of their keys does."""
        if self._keys is None:
            rng = np.random.default_rng(int(self.digest[:32], 16))
            self._keys = -rng.integers(1, _KEY_LIMIT, size=self.length, dtype=np.int64)
            self._keys = self._keys.astype(np.int32)
        return self._keys


@dataclass
class MultimodalPrompt:
    """The images of one prompt, in prompt order, and the model's positions for it.

    Attributes:
        spans: the images, non-overlapping, ascending by ``start``.
        positions: int32 ``[3, prompt_len]`` M-RoPE positions of the prompt (None: the
            model's positions are the token index).
        position_delta: what a position after the prompt adds to its index (M-RoPE's
            ``rope_delta``: an image of ``h x w`` placeholders advances the position by
            ``max(h, w)``, not ``h * w``).
        restore: gives a released image's features back (called on the engine thread;
            None: features are never released).
    """

    spans: list[ImageSpan]
    positions: np.ndarray | None = None
    position_delta: int = 0
    restore: Callable[[ImageSpan], np.ndarray] | None = None
    restored: int = 0  # how many times released features were given back

    @property
    def explicit(self) -> bool:
        """The positions differ from the token index somewhere."""
        return self.positions is not None or self.position_delta != 0

    def release_before(self, position: int) -> None:
        """Release the features of the images that end at or before ``position`` (the
        prefill has passed them), when they can be restored."""
        if self.restore is None:
            return
        for span in self.spans:
            if span.end <= position:
                span.features = None

    def features_of(self, span: ImageSpan) -> np.ndarray:
        """``span``'s features, restored if they were released."""
        if span.features is None:
            assert self.restore is not None, "features released without a way back"
            span.features = self.restore(span)
            self.restored += 1
        return span.features

    def cache_ids(self, ids: np.ndarray) -> np.ndarray:
        """``ids`` with every image placeholder replaced by its image's cache key, so a
        prefix match covers an image only when the image's content is the same."""
        keyed = ids.copy()
        for span in self.spans:
            end = min(span.end, len(keyed))
            keyed[span.start : end] = span.cache_keys[: end - span.start]
        return keyed

    def positions_of(self, start: int, n: int) -> np.ndarray:
        """int32 ``[3, n]``: the positions of sequence positions ``start..start+n-1``."""
        index = np.arange(start, start + n, dtype=np.int64)
        out = np.broadcast_to(index + self.position_delta, (3, n)).astype(np.int32)
        if self.positions is not None:
            inside = index < self.positions.shape[1]
            out[:, inside] = self.positions[:, index[inside]]
        return out


def multimodal_prompt(
    prepared,  # noqa: ANN001 - any PreparedPrompt shape
    restore: Callable[[ImageSpan], np.ndarray] | None = None,
) -> MultimodalPrompt:
    """The engine's view of a vision encoder's prepared prompt (``images`` with ``start``,
    ``length``, ``features``, ``digest``; ``positions``; ``position_delta``)."""
    spans = [ImageSpan(i.start, i.length, i.features, i.digest) for i in prepared.images]
    return MultimodalPrompt(spans, prepared.positions, prepared.position_delta, restore)


@dataclass(frozen=True)
class ChunkImages:
    """The image positions of one prefill chunk of one row: columns and their features."""

    columns: np.ndarray  # int32 [K], positions in the chunk (0..n-1)
    features: np.ndarray  # float32 [K, hidden]


def chunk_images(mm: MultimodalPrompt, start: int, n: int) -> ChunkImages | None:
    """The image placeholders among positions ``start..start+n-1``, or None."""
    columns, features = [], []
    for span in mm.spans:
        lo, hi = max(span.start, start), min(span.end, start + n)
        if lo >= hi:
            continue
        columns.append(np.arange(lo - start, hi - start, dtype=np.int32))
        features.append(mm.features_of(span)[lo - span.start : hi - span.start])
    if not columns:
        return None
    return ChunkImages(np.concatenate(columns), np.concatenate(features))
