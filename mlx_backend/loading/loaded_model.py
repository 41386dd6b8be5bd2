"""The result of loading a model: what the executor and the server need from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class LoadedModel:
    """A loaded mlx-lm model plus its tokenizer.

    Attributes:
        model: an mlx-lm ``nn.Module`` (``model(inputs, cache=...) -> logits``).
        tokenizer: mlx-lm ``TokenizerWrapper`` (``encode``, ``decode``,
            ``apply_chat_template``, ``eos_token_ids``, ``detokenizer``).
        model_id: the name served in ``/v1/models`` and checked against ``model`` fields.
        config: the model's config dict (``config.json`` shape).
        context_length: the longest prompt + completion the model is served with.
        kind: "decoder" (an mlx-lm model, served by the engine) or "encoder" (an
            mlx-embeddings model: ``model(input_ids, attention_mask=...)``, embeddings only).
        pooling: how an encoder's output is pooled (``encoders.POOLING_MODES``).
        vision: a vision model's ``VisionEncoder`` (images -> placeholder features);
            None for a text-only model.
    """

    model: Any
    tokenizer: Any
    model_id: str
    config: dict = field(default_factory=dict)
    context_length: int = 2048
    kind: Literal["decoder", "encoder"] = "decoder"
    pooling: str | None = None
    vision: Any = None
