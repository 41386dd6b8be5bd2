"""Encoder embedding models (BERT family: sentence-transformers MiniLM, E5, BGE, ...) through
``mlx-embeddings``, and how their output is pooled.

A model directory is an encoder when its ``config.json`` names a model type that mlx-lm
does not know and mlx-embeddings does (``bert``, ``xlm_roberta``, ``modernbert``, ...). The
pooling follows the sentence-transformers ``Pooling`` module of the directory
(``modules.json`` -> ``1_Pooling/config.json``: CLS token, mean, max or last token); without
one, the model's own pooled output (mlx-embeddings' ``text_embeds``) is used.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel

logger = logging.getLogger(__name__)

POOLING_MODES = ("cls", "mean", "max", "lasttoken", "model")
# sentence-transformers' Pooling config keys -> our modes.
_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}
# Model types whose positions start past a padding index (their max_position_embeddings
# counts padding_idx + 1 positions that no token uses).
_PADDED_POSITIONS = ("xlm_roberta", "roberta", "camembert")


def read_config(path: str | Path) -> dict | None:
    """A model directory's ``config.json`` (None when there is none or it is not JSON)."""
    config = Path(path).expanduser() / "config.json"
    try:
        return json.loads(config.read_text())
    except (OSError, ValueError):
        return None


def _mlx_lm_knows(model_type: str) -> bool:
    from mlx_lm.utils import MODEL_REMAPPING

    name = MODEL_REMAPPING.get(model_type, model_type)
    return importlib.util.find_spec(f"mlx_lm.models.{name}") is not None


def _mlx_embeddings_knows(model_type: str) -> bool:
    # find_spec of the top-level package does not import it (which imports mlx-vlm).
    spec = importlib.util.find_spec("mlx_embeddings")
    if spec is None or not spec.submodule_search_locations:
        return False
    models = Path(list(spec.submodule_search_locations)[0]) / "models"
    return (models / f"{model_type}.py").is_file() or (models / model_type).is_dir()


def encoder_model_type(path: str | None) -> str | None:
    """The mlx-embeddings model type of an encoder model directory at ``path`` (None: not a
    local directory, or a model mlx-lm runs as a decoder)."""
    if path is None:
        return None
    config = read_config(path)
    if not config or not isinstance(config.get("model_type"), str):
        return None
    model_type = config["model_type"].replace("-", "_")
    if _mlx_lm_knows(model_type):
        return None
    return model_type if _mlx_embeddings_knows(model_type) else None


def pooling_mode(path: str | Path) -> str:
    """How the directory's sentence-transformers ``Pooling`` module pools ("model" when it
    has none: the model's own pooled output).

    Raises:
        ValueError: a pooling mode mlxserve does not implement, or several at once.
    """
    root = Path(path)
    pooling_dir = root / "1_Pooling"
    try:
        modules = json.loads((root / "modules.json").read_text())
        for module in modules:
            if str(module.get("type", "")).endswith("Pooling"):
                pooling_dir = root / module.get("path", "1_Pooling")
    except (OSError, ValueError, AttributeError):
        pass
    try:
        config = json.loads((pooling_dir / "config.json").read_text())
    except (OSError, ValueError):
        return "model"
    modes = [mode for key, mode in _POOLING_KEYS.items() if config.get(key)]
    if len(modes) != 1 or modes[0] not in POOLING_MODES:
        raise ValueError(f"pooling {modes or 'none'} of {pooling_dir} is not supported")
    return modes[0]


def load_encoder(path: str, model_id: str) -> LoadedModel:
    """Load an encoder model directory through mlx-embeddings, its tokenizer through
    mlx-lm's (the same ``TokenizerWrapper`` every model has).

    Raises:
        mlxserve.mlx_backend.loading.loader.ModelLoadError: mlx-embeddings is missing, or
            the model or its pooling cannot be loaded.
    """
    from mlxserve.mlx_backend.loading.loader import (
        ModelLoadError,
        cast_float_parameters_to_float32,
    )

    try:
        from mlx_embeddings.utils import load_model as load_embedding_model
    except ImportError as e:
        raise ModelLoadError(
            f"{path} is an encoder model, which needs the mlx-embeddings package ({e})"
        ) from e
    from mlx_lm.utils import load_tokenizer

    root = Path(path).expanduser()
    config = read_config(root) or {}
    try:
        pooling = pooling_mode(root)
        model = load_embedding_model(root, path_to_repo=str(root))
        tokenizer = load_tokenizer(root)
    except Exception as e:  # noqa: BLE001 - any failure to load is the user's one-line error
        raise ModelLoadError(f"Cannot load encoder model {path}: {e}") from e
    cast_float_parameters_to_float32(model)
    model_type = str(config.get("model_type", "")).replace("-", "_")
    context = int(config.get("max_position_embeddings") or 512)
    if model_type in _PADDED_POSITIONS:
        context -= int(config.get("pad_token_id") or 1) + 1
    logger.info("encoder %s (%s), pooling %s", model_id, model_type, pooling)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=model_id,
        config=config,
        context_length=context,
        kind="encoder",
        pooling=pooling,
    )
