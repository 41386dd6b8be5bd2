"""The vision tower as a service: images -> placeholder features, once per image content.

A request's images are encoded at admission, before the request reaches the engine: on
one worker thread of its own (MLX streams are per thread; one thread also bounds the
memory and CPU the vision tower takes), never inside the engine's step loop. Features are
kept in an LRU keyed by the image's content hash, so the same image in the next turn of a
conversation skips the vision tower (and, through the prefix cache's image keys, its
prefill too).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlxserve.mlx_backend.vision.families import EncodedImage, VisionFamily


@dataclass(frozen=True)
class ImageInput:
    """A decoded image (a PIL RGB image) and the sha256 hex digest of its bytes."""

    image: Any
    digest: str


@dataclass(frozen=True)
class PlacedImage:
    """An image's placeholders in the expanded prompt and their features."""

    start: int
    length: int
    features: np.ndarray  # float32 [length, hidden]
    digest: str


@dataclass(frozen=True)
class PreparedPrompt:
    """A prompt with its images laid over their placeholders (numpy only).

    Attributes:
        ids: the prompt, each image's placeholder expanded to one token per feature row.
        images: the images in prompt order.
        positions: int32 ``[3, len(ids)]`` M-RoPE positions (None: the token index).
        position_delta: what a position after the prompt adds to its index.
    """

    ids: list[int]
    images: list[PlacedImage]
    positions: np.ndarray | None
    position_delta: int


class PlaceholderMismatch(ValueError):
    """The prompt's image placeholders do not match the images given."""


class VisionEncoder:
    """Encodes a prompt's images and lays their features over its placeholders.

    Args:
        family: the model's vision family.
        cache_size: images whose features are kept (LRU by content hash).
    """

    def __init__(self, family: VisionFamily, cache_size: int = 64) -> None:
        self.family = family
        self.cache_size = cache_size
        self._cache: OrderedDict[str, EncodedImage] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vision")
        self.images_encoded = 0
        self.cache_hits = 0
        self.encoder_seconds = 0.0
        self._pending = 0

    @property
    def pending(self) -> int:
        """Prompts submitted and not yet prepared (the vision thread's queue)."""
        return self._pending

    def submit(
        self, prompt_ids: list[int], images: list[ImageInput]
    ) -> concurrent.futures.Future[PreparedPrompt]:
        """``prepare`` on the vision thread."""
        with self._lock:
            self._pending += 1
        future = self._pool.submit(self.prepare, prompt_ids, images)
        future.add_done_callback(self._done)
        return future

    def _done(self, _: concurrent.futures.Future) -> None:
        with self._lock:
            self._pending -= 1

    def prepare(self, prompt_ids: list[int], images: list[ImageInput]) -> PreparedPrompt:
        """Expand each image's one placeholder token in ``prompt_ids`` (in order) as the
        family's processor does (one token per feature row, plus the family's framing),
        and return the expanded prompt with its images.

        Raises:
            PlaceholderMismatch: the prompt has not one placeholder per image.
        """
        token = self.family.placeholder_id
        slots = [i for i, t in enumerate(prompt_ids) if t == token]
        if len(slots) != len(images):
            raise PlaceholderMismatch(
                f"the prompt has {len(slots)} image placeholders for {len(images)} images"
            )
        encoded = [self._encode(img) for img in images]
        ids: list[int] = []
        placed: list[PlacedImage] = []
        last = since = 0  # next prompt token to copy; where the text since the last image starts
        ends = [*slots[1:], len(prompt_ids)]
        for slot, end, img, enc in zip(slots, ends, images, encoded, strict=True):
            ids.extend(prompt_ids[last:slot])
            n = enc.features.shape[0]
            splice = self.family.splice(ids[since:], n, prompt_ids[slot + 1 : end])
            del ids[len(ids) - splice.drop_before :]
            placed.append(PlacedImage(len(ids) + splice.offset, n, enc.features, img.digest))
            ids.extend(splice.tokens)
            since = len(ids) - len(splice.tokens) + splice.offset + n
            last = slot + 1 + splice.skip_after
        ids.extend(prompt_ids[last:])
        positions, delta = self.family.positions(ids, encoded)
        return PreparedPrompt(ids, placed, positions, delta)

    def features(self, img: ImageInput) -> np.ndarray:
        """One image's placeholder features: from the cache, else encoded on the calling
        thread (a preempted request whose released features are needed again)."""
        return self._encode(img).features

    def _encode(self, img: ImageInput) -> EncodedImage:
        with self._lock:
            hit = self._cache.get(img.digest)
            if hit is not None:
                self._cache.move_to_end(img.digest)
                self.cache_hits += 1
                return hit
        start = time.perf_counter()
        encoded = self.family.encode(img.image)
        with self._lock:
            self.encoder_seconds += time.perf_counter() - start
            self.images_encoded += 1
            self._cache[img.digest] = encoded
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return encoded

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            self._cache.clear()
