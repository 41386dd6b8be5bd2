"""Decoder embedding checkpoints (Qwen3-Embedding style) as mlx-lm models.

An embedding model is often saved as transformers' bare base model: its weights are named
``layers.0...`` / ``embed_tokens.weight`` without the ``model.`` prefix of the causal-LM
class mlx-lm builds, and it may have no ``lm_head`` although its config says the head is
untied (Qwen3-Embedding-8B). Neither matters to embeddings, which read the final normed
hidden state and never the head; so for ``task=embed`` the names get their prefix and a
missing head is the embedding matrix itself (the same array: no memory, never computed,
as nothing is sampled).
"""

from __future__ import annotations

from typing import Any

import mlx.nn as nn
from mlx.utils import tree_flatten


def _with_inner_prefix(model: nn.Module, weights: dict[str, Any]) -> dict[str, Any]:
    """Prefix ``model.`` to the names of a bare base model's weights."""
    if "model" not in model or any(k.startswith("model.") for k in weights):
        return weights
    inner = {name for name, _ in tree_flatten(model["model"].parameters())}
    if not any(k in inner for k in weights):
        return weights
    return {k if k.startswith("lm_head.") else f"model.{k}": v for k, v in weights.items()}


def _with_head(model: nn.Module, weights: dict[str, Any]) -> dict[str, Any]:
    """Give an untied head without weights the embedding's arrays."""
    if "lm_head" not in model or any(k.startswith("lm_head.") for k in weights):
        return weights
    out = dict(weights)
    for leaf in ("weight", "scales", "biases"):
        embedding = weights.get(f"model.embed_tokens.{leaf}")
        if embedding is not None:
            out[f"lm_head.{leaf}"] = embedding
    return out


def embedding_model_classes(config: dict) -> tuple[type, type]:
    """mlx-lm's model and args classes for ``config``, the model's ``sanitize`` also
    taking a base model's weight names and a missing head (``mlx_lm.utils.load_model``'s
    ``get_model_classes``)."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)

    class EmbeddingCheckpoint(model_class):
        def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
            weights = _with_inner_prefix(self, weights)
            if hasattr(super(), "sanitize"):
                weights = super().sanitize(weights)
            return _with_head(self, weights)

    EmbeddingCheckpoint.__name__ = model_class.__name__
    EmbeddingCheckpoint.__qualname__ = model_class.__qualname__
    return EmbeddingCheckpoint, args_class
