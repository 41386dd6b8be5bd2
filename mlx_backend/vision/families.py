"""What differs between vision-language families: how an image becomes placeholder
tokens, how the vision tower is called, and how the prompt's positions are computed.

Each family runs mlx-vlm's own modules (vision tower, projector, ``get_rope_index``)
unmodified; only the plumbing around them lives here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn
import numpy as np


@dataclass
class EncodedImage:
    """One image through the vision tower: a feature row per placeholder token."""

    features: np.ndarray  # float32 [tokens, hidden]
    grid: tuple[int, ...]  # the family's layout of the image (Qwen-VL: t, h, w patches)


def _embedding_dtype(vlm: nn.Module) -> mx.Dtype:
    """The dtype of the text model's input embeddings (what mlx-vlm casts image features
    to; a quantized embedding's weight is packed, so ask the embedding itself)."""
    return vlm.language_model.model.embed_tokens(mx.array([0])).dtype


@dataclass(frozen=True)
class Splice:
    """An image's placeholder replaced: the last ``drop_before`` tokens before it and the
    first ``skip_after`` after it go too (re-tokenized into ``tokens``), and the ``n``
    feature positions start at ``tokens[offset]``."""

    tokens: list[int]
    offset: int
    drop_before: int = 0
    skip_after: int = 0


class VisionFamily(Protocol):
    """A vision-language family's image path.

    Attributes:
        placeholder_id: the token the chat template writes once per image.
        explicit_positions: the text model takes ``position_ids`` (M-RoPE).
        deepstack_layers: how many deepstack vectors follow each feature row (Qwen3-VL).
    """

    placeholder_id: int
    explicit_positions: bool
    deepstack_layers: int

    def encode(self, image: Any) -> EncodedImage:
        """A PIL RGB image -> its placeholder features (runs the vision tower)."""
        ...

    def splice(self, before: list[int], n: int, after: list[int]) -> Splice:
        """How one image's ``placeholder_id`` is replaced for ``n`` feature rows, given
        the prompt tokens ``before`` it (since the previous image) and ``after`` it."""
        ...

    def positions(
        self, prompt_ids: list[int], images: list[EncodedImage]
    ) -> tuple[np.ndarray | None, int]:
        """The prompt's explicit ``[3, P]`` positions and position delta (None, 0: the
        token index)."""
        ...


class QwenVLFamily:
    """qwen2_vl and qwen2_5_vl: dynamic resolution (one placeholder per 2x2 merged
    patch), M-RoPE positions from ``get_rope_index``."""

    explicit_positions = True
    deepstack_layers = 0

    def __init__(self, vlm: nn.Module, image_processor: Any, tokenizer: Any) -> None:
        self.vlm = vlm
        self.processor = image_processor
        self.placeholder_id = int(vlm.config.image_token_id)
        self.merge = int(vlm.config.vision_config.spatial_merge_size)

    def splice(self, before: list[int], n: int, after: list[int]) -> Splice:
        return Splice([self.placeholder_id] * n, 0)

    def encode(self, image: Any) -> EncodedImage:
        inputs = self.processor(images=[image], return_tensors="np")
        grid = np.asarray(inputs["image_grid_thw"], np.int32)
        tower = self.vlm.vision_tower
        pixels = mx.array(inputs["pixel_values"]).astype(tower.patch_embed.proj.weight.dtype)
        features = self._tower(pixels, mx.array(grid))
        t, h, w = (int(v) for v in grid[0])
        assert features.shape[0] == t * h * w // self.merge**2, features.shape
        return EncodedImage(np.array(features.astype(mx.float32)), (t, h, w))

    def positions(
        self, prompt_ids: list[int], images: list[EncodedImage]
    ) -> tuple[np.ndarray | None, int]:
        grids = mx.array([img.grid for img in images], dtype=mx.int32) if images else None
        ids = mx.array([prompt_ids], dtype=mx.int32)
        position_ids, delta = self.vlm.language_model.get_rope_index(ids, grids)
        if position_ids.ndim == 2:  # no image: plain positions
            return None, 0
        return np.array(position_ids[:, 0, :]).astype(np.int32), int(np.array(delta).ravel()[0])

    def _tower(self, pixels: mx.array, grid: mx.array) -> mx.array:
        return self.vlm.vision_tower(pixels, grid, output_hidden_states=False)


class Qwen3VLFamily(QwenVLFamily):
    """qwen3_vl: Qwen-VL's placeholders and M-RoPE, plus deepstack: the vision tower also
    gives one vector per placeholder for each of the first text layers, carried beside
    the feature row (``[tokens, hidden * (1 + layers)]``)."""

    def __init__(self, vlm: nn.Module, image_processor: Any, tokenizer: Any) -> None:
        super().__init__(vlm, image_processor, tokenizer)
        self.placeholder_id = int(vlm.config.image_token_index)
        self.deepstack_layers = len(vlm.config.vision_config.deepstack_visual_indexes)

    def _tower(self, pixels: mx.array, grid: mx.array) -> mx.array:
        features, deepstack = self.vlm.vision_tower(pixels, grid)
        return mx.concatenate([features, *deepstack], axis=-1)


class Gemma3Family:
    """gemma3: a fixed-size SigLIP image (``mm_tokens_per_image`` placeholders), the
    template's ``<start_of_image>`` expanded as Gemma3's processor expands it in the text
    (``\\n\\n<start_of_image>`` + image tokens + ``<end_of_image>\\n\\n``), features scaled
    by ``1/sqrt(hidden)`` (the text model scales every input embedding by ``sqrt(hidden)``),
    ordinary positions.

    The processor tokenizes the expanded text, where the framing newlines join the
    newlines around them (Gemma's tokenizer has one token for a run of newlines: the
    template's ``user\\n`` before an image becomes ``\\n\\n\\n``); so the newline-only
    tokens next to the placeholder are encoded again together with the framing's."""

    explicit_positions = False
    deepstack_layers = 0

    def __init__(self, vlm: nn.Module, image_processor: Any, tokenizer: Any) -> None:
        self.vlm = vlm
        self.processor = image_processor
        self.image_token_id = int(vlm.config.image_token_index)
        self.placeholder_id = int(tokenizer.convert_tokens_to_ids("<start_of_image>"))
        self.end_id = int(tokenizer.convert_tokens_to_ids("<end_of_image>"))
        self.tokenizer = tokenizer
        self.scale = float(vlm.config.hidden_size) ** 0.5
        self._newline_counts: dict[int, int] = {}

    def _newlines_of(self, token: int) -> int:
        """How many newlines ``token`` is, if it is nothing but newlines (else 0)."""
        if token not in self._newline_counts:
            text = self.tokenizer.decode([token])
            self._newline_counts[token] = len(text) if text and set(text) == {"\n"} else 0
        return self._newline_counts[token]

    def _newline_run(self, tokens: list[int]) -> tuple[int, int]:
        """``(tokens, newlines)`` of the newline-only tokens at the start of ``tokens``."""
        count = newlines = 0
        for token in tokens:
            k = self._newlines_of(token)
            if not k:
                break
            count, newlines = count + 1, newlines + k
        return count, newlines

    def splice(self, before: list[int], n: int, after: list[int]) -> Splice:
        drop, lead = self._newline_run(before[::-1])
        skip, trail = self._newline_run(after)
        encode = self.tokenizer.encode
        head = list(encode("\n" * (lead + 2), add_special_tokens=False))
        tail = list(encode("\n" * (trail + 2), add_special_tokens=False))
        tokens = [*head, self.placeholder_id, *[self.image_token_id] * n, self.end_id, *tail]
        return Splice(tokens, len(head) + 1, drop, skip)

    def encode(self, image: Any) -> EncodedImage:
        inputs = self.processor(images=[image], return_tensors="np")
        pixels = mx.array(inputs["pixel_values"]).transpose(0, 2, 3, 1)
        dtype = _embedding_dtype(self.vlm)
        hidden, _, _ = self.vlm.vision_tower(pixels.astype(dtype), output_hidden_states=True)
        features = self.vlm.multi_modal_projector(hidden)[0] / self.scale
        return EncodedImage(np.array(features.astype(dtype).astype(mx.float32)), ())

    def positions(
        self, prompt_ids: list[int], images: list[EncodedImage]
    ) -> tuple[np.ndarray | None, int]:
        return None, 0


class LlavaFamily:
    """llava (1.5): a fixed-size CLIP image, one placeholder per patch (the selected
    hidden layer without its CLS row, projected), ordinary positions."""

    explicit_positions = False
    deepstack_layers = 0

    def __init__(self, vlm: nn.Module, image_processor: Any, tokenizer: Any) -> None:
        self.vlm = vlm
        self.processor = image_processor
        self.placeholder_id = int(vlm.config.image_token_index)

    def splice(self, before: list[int], n: int, after: list[int]) -> Splice:
        return Splice([self.placeholder_id] * n, 0)

    def encode(self, image: Any) -> EncodedImage:
        vlm = self.vlm
        inputs = self.processor(images=[image], return_tensors="np")
        pixels = mx.array(inputs["pixel_values"]).transpose(0, 2, 3, 1)
        *_, hidden_states = vlm.vision_tower(pixels, output_hidden_states=True)
        layer = vlm.vision_feature_layer
        if not isinstance(layer, int):
            raise NotImplementedError("llava with several vision feature layers")
        selected = hidden_states[layer]
        if vlm.vision_feature_select_strategy == "default":
            selected = selected[:, 1:]
        features = vlm.multi_modal_projector(selected)[0]
        dtype = _embedding_dtype(vlm)
        return EncodedImage(np.array(features.astype(dtype).astype(mx.float32)), ())

    def positions(
        self, prompt_ids: list[int], images: list[EncodedImage]
    ) -> tuple[np.ndarray | None, int]:
        return None, 0


# model_type -> family class (the families whose batched output is checked against
# mlx-vlm's own generation in tests/test_vision_engine.py).
FAMILIES: dict[str, type] = {
    "qwen2_vl": QwenVLFamily,
    "qwen2_5_vl": QwenVLFamily,
    "qwen3_vl": Qwen3VLFamily,
    "gemma3": Gemma3Family,
    "llava": LlavaFamily,
}


def family_of(
    model_type: str, vlm: nn.Module, image_processor: Any, tokenizer: Any
) -> VisionFamily:
    """The family of ``model_type``.

    Raises:
        NotImplementedError: a model type mlxserve does not run images for.
    """
    cls = FAMILIES.get(model_type)
    if cls is None:
        raise NotImplementedError(f"image inputs for {model_type!r} models are not supported")
    return cls(vlm, image_processor, tokenizer)
