"""LoRA (and DoRA) adapters of mlx-lm over a loaded base model.

An adapter directory is what ``mlx_lm.lora`` writes: ``adapter_config.json`` (which
layers, rank, scale) and ``adapters.safetensors``. ``with_adapter`` builds the adapted
model over a module tree of its own that shares the base's arrays
(``shared_weights.tree_sharing_arrays``) and applies the adapter with mlx-lm's own
``load_adapters``, so the result is what ``mlx_lm.load(base, adapter_path=...)`` builds.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.mlx_backend.loading.shared_weights import tree_sharing_arrays

ADAPTER_FILES = ("adapter_config.json", "adapters.safetensors")


def check_adapter_dir(path: str) -> Path:
    """The adapter directory at ``path``.

    Raises:
        ModelLoadError: it is not a directory with both adapter files.
    """
    from mlxserve.mlx_backend.loading.loader import ModelLoadError

    root = Path(path).expanduser()
    missing = [name for name in ADAPTER_FILES if not (root / name).is_file()]
    if not root.is_dir() or missing:
        raise ModelLoadError(
            f"{path} is not an mlx-lm adapter directory (it needs {' and '.join(missing)})"
        )
    return root


def with_adapter(base: LoadedModel, path: str, model_id: str) -> LoadedModel:
    """``base`` with the adapter at ``path`` applied, on a module tree of its own over the
    base's arrays (``base`` itself is unchanged).

    Raises:
        ModelLoadError: the adapter directory is incomplete or does not fit the model.
    """
    from mlx_lm.tuner.utils import load_adapters

    from mlxserve.mlx_backend.loading.loader import (
        ModelLoadError,
        cast_float_parameters_to_float32,
    )

    root = check_adapter_dir(path)
    model = tree_sharing_arrays(base.model)
    try:
        load_adapters(model, str(root))
    except Exception as e:  # noqa: BLE001 - a bad adapter is the user's one-line error
        raise ModelLoadError(f"Cannot apply the adapter {path}: {e}") from e
    model.eval()
    # Adapter matrices saved in half precision compute slowly on the CPU (the base's
    # parameters are float32 already: nothing of the base is cast, or copied).
    cast_float_parameters_to_float32(model)
    return dataclasses.replace(base, model=model, model_id=model_id)
