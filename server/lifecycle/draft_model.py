"""The draft model of ``--speculative-method draft``: loaded like a served model, checked
against the served model's vocabulary, wrapped for the engine (``scheduler/draft.py``)."""

from __future__ import annotations

import logging
from typing import Any

from mlxserve.mlx_backend.executor import MLXExecutor
from mlxserve.mlx_backend.loading.dequantize import dequantize_for_cpu
from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.mlx_backend.loading.loader import load_model
from mlxserve.scheduler.config import EngineConfig
from mlxserve.scheduler.draft import DraftModel

logger = logging.getLogger(__name__)


def draft_model_for(
    loaded: LoadedModel, config: EngineConfig, draft: LoadedModel | None = None
) -> DraftModel | None:
    """The engine's draft model: ``draft`` if given (tests), else ``config.draft_model``
    loaded and converted as a served model is; None without the draft method.

    Raises:
        ModelLoadError: the draft model cannot be loaded.
        ValueError: it is not a text decoder, or its vocabulary is not the served model's.
    """
    if config.speculative_method != "draft":
        return None
    if draft is None:
        draft = load_model(config.draft_model)
        note = dequantize_for_cpu(draft.model).reason
        logger.info("draft model %s loaded: %s", draft.model_id, note)
    if draft.kind != "decoder" or draft.vision is not None:
        raise ValueError(f"draft model {draft.model_id}: a text decoder is needed")
    mismatch = vocabulary_mismatch(loaded.tokenizer, draft.tokenizer)
    if mismatch is not None:
        raise ValueError(
            f"draft model {draft.model_id} cannot propose for {loaded.model_id}: {mismatch}"
        )
    return DraftModel(MLXExecutor(draft.model, seed=config.seed), draft.model_id)


def vocabulary_mismatch(served: Any, draft: Any) -> str | None:
    """Why two tokenizers do not share token ids, or None when they do (compared by their
    vocabularies, else by their sizes; tokenizers that expose neither are taken as equal)."""
    a, b = _vocab(served), _vocab(draft)
    if a is not None and b is not None:
        if a != b:
            differ = sum(1 for token, i in a.items() if b.get(token) != i) + len(b.keys() - a)
            return f"the tokenizers' vocabularies differ ({differ} of {len(a)} entries)"
        return None
    sizes = getattr(served, "vocab_size", None), getattr(draft, "vocab_size", None)
    if None not in sizes and sizes[0] != sizes[1]:
        return f"vocabulary sizes differ ({sizes[0]} vs {sizes[1]})"
    return None


def _vocab(tokenizer: Any) -> dict[str, int] | None:
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    try:
        return dict(get_vocab())
    except Exception:  # noqa: BLE001 - a wrapper without one: compare sizes instead
        return None
