"""An mlx-vlm model's language model, shaped as the executor runs mlx-lm models.

mlx-vlm's ``LanguageModel`` returns ``LanguageModelOutput(logits=...)`` and the Qwen-VL
families keep M-RoPE state on the module (``_rope_deltas``, ``_position_ids``), which is
right for one sequence and wrong for every other row of a batch. So the executor does not
call it: it calls the inner text model (``language_model.model``, unmodified) with
explicit ``inputs_embeds`` and ``position_ids`` and applies the head itself, the split
``mlxserve.mlx_backend.logits`` already verifies for mlx-lm models.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn


class _Held:
    """A reference ``nn.Module`` does not register (no second copy in its parameters)."""

    def __init__(self, value: Any) -> None:
        self.value = value


class VisionLanguageModel(nn.Module):
    """``model(inputs, cache=..., inputs_embeds=..., position_ids=...) -> logits``.

    Attributes:
        model: the text model (``language_model.model``): ``embed_tokens``, ``layers``.
        lm_head: the untied head, when the model has one.
        explicit_positions: the text model takes ``position_ids [3, B, L]`` (M-RoPE) and
            every forward over pool caches must pass them (their offsets are per-row
            arrays the model's own position fallback cannot use).
        deepstack_layers: Qwen3-VL's deepstack: an image position's features also add
            one vector each to the hidden states after the first ``deepstack_layers``
            layers (0: none).
    """

    def __init__(self, vlm: nn.Module, explicit_positions: bool, deepstack_layers: int = 0) -> None:
        super().__init__()
        language = vlm.language_model
        self.model = language.model
        if "lm_head" in language:
            self.lm_head = language.lm_head
        # The vision tower and projector are the vision encoder's; registered here too so
        # that the model's parameters (what memory budgets count) include them.
        self.vision_modules = {
            name: child for name, child in vlm.children().items() if name != "language_model"
        }
        self._language = _Held(language)
        self.explicit_positions = explicit_positions
        self.deepstack_layers = deepstack_layers

    @property
    def layers(self) -> list[nn.Module]:
        return self.model.layers

    def make_cache(self) -> list[Any]:
        language = self._language.value
        if hasattr(language, "make_cache"):
            return language.make_cache()
        from mlx_lm.models.cache import KVCache

        return [KVCache() for _ in self.model.layers]

    def embed(self, input_ids: mx.array) -> mx.array:
        """The token embeddings the text model starts from."""
        return self.model.embed_tokens(input_ids)

    def image_inputs(
        self, input_ids: mx.array, rows: mx.array, columns: mx.array, features: mx.array
    ) -> dict[str, Any]:
        """The text model's inputs for a forward whose ``(rows, columns)`` positions (in
        row-major order) are image placeholders with ``features``: the token embeddings
        with the features written over those positions, and for deepstack models the
        positions' mask and the per-layer vectors (``features`` holds them side by side:
        ``[K, hidden * (1 + deepstack_layers)]``)."""
        embeds = self.embed(input_ids)
        width = features.shape[1] // (1 + self.deepstack_layers)
        embeds[rows, columns] = features[:, :width].astype(embeds.dtype)
        inputs: dict[str, Any] = {"inputs_embeds": embeds}
        if self.deepstack_layers:
            mask = mx.zeros(input_ids.shape, dtype=mx.bool_)
            mask[rows, columns] = True
            inputs["visual_pos_masks"] = mask
            inputs["deepstack_visual_embeds"] = [
                features[:, width * (k + 1) : width * (k + 2)].astype(embeds.dtype)
                for k in range(self.deepstack_layers)
            ]
        return inputs

    def head(self, hidden: mx.array) -> mx.array:
        if "lm_head" in self:
            return self.lm_head(hidden)
        return self.model.embed_tokens.as_linear(hidden)

    def __call__(
        self,
        inputs: mx.array,
        cache: list | None = None,
        position_ids: mx.array | None = None,
        **image_inputs: Any,
    ) -> mx.array:
        """Logits of every position; ``image_inputs`` are what ``image_inputs`` gave."""
        if self.explicit_positions:
            if position_ids is None:
                position_ids = default_positions(inputs, cache)
            image_inputs["position_ids"] = position_ids
        return self.head(self.model(inputs, cache=cache, **image_inputs))


def default_positions(inputs: mx.array, cache: list | None) -> mx.array:
    """``[3, B, L]`` positions ``offset + 0..L-1`` of a single-offset (probe) forward."""
    B, L = inputs.shape
    offset = 0
    if cache and cache[0] is not None:
        offset = int(cache[0].offset)
    index = mx.arange(offset, offset + L, dtype=mx.int32)
    return mx.broadcast_to(index[None, None, :], (3, B, L))
