"""mlx-vlm model directories: a vision tower beside the language model.

A directory is a vision model when its ``config.json`` has a ``vision_config``, a
``preprocessor_config.json`` (or ``processor_config.json``) sits beside it, and its
``model_type`` is a family mlxserve runs images for (``vision/families.py``). Anything
else loads through mlx-lm as before.
"""

from __future__ import annotations

import json
from pathlib import Path

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel

_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def vision_model_type(path: str) -> str | None:
    """The model type of a vision model directory mlxserve can serve, or None."""
    from mlxserve.mlx_backend.vision.families import FAMILIES

    root = Path(path)
    try:
        config = json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or not isinstance(config.get("vision_config"), dict):
        return None
    if not any((root / name).is_file() for name in _PROCESSOR_FILES):
        return None
    model_type = config.get("model_type")
    return model_type if model_type in FAMILIES else None


def load_vision_model(path: str, model_id: str, model_type: str) -> LoadedModel:
    """Load an mlx-vlm directory: the model (mlx-vlm's classes and weights), the tokenizer
    (mlx-lm's wrapper), the image processor (transformers'), and the vision encoder."""
    from mlx_lm.utils import load_tokenizer
    from mlx_vlm.utils import load_config
    from mlx_vlm.utils import load_model as load_vlm
    from transformers import AutoImageProcessor

    from mlxserve.mlx_backend.loading.loader import (
        cast_float_parameters_to_float32,
        context_length_of,
    )
    from mlxserve.mlx_backend.vision.encoder import VisionEncoder
    from mlxserve.mlx_backend.vision.families import family_of
    from mlxserve.mlx_backend.vision.language_model import VisionLanguageModel

    root = Path(path)
    config = load_config(root)
    vlm = load_vlm(root)
    vlm.eval()
    cast_float_parameters_to_float32(vlm)
    tokenizer = load_tokenizer(root, eos_token_ids=config.get("eos_token_id"))
    processor = AutoImageProcessor.from_pretrained(str(root))
    family = family_of(model_type, vlm, processor, tokenizer)
    return LoadedModel(
        model=VisionLanguageModel(vlm, family.explicit_positions, family.deepstack_layers),
        tokenizer=tokenizer,
        model_id=model_id,
        config=config,
        context_length=context_length_of(config),
        vision=VisionEncoder(family),
    )
