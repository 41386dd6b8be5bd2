"""Random LoRA adapters for a tiny model dir, in mlx-lm's adapter layout.

``build_lora_adapter_dir`` converts the base's last ``num_layers`` blocks with mlx-lm's own
``linear_to_lora_layers``, draws random ``lora_a`` / ``lora_b`` (mlx-lm starts ``lora_b`` at
zero, which would change nothing) and writes ``adapter_config.json`` +
``adapters.safetensors`` as ``mlx_lm.lora`` does, so ``mlx_lm.load(base,
adapter_path=...)`` loads it.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten


def build_lora_adapter_dir(
    base_dir: Path, path: Path, seed: int, rank: int = 4, num_layers: int = 2, scale: float = 4.0
) -> Path:
    """Write a random LoRA adapter of the model at ``base_dir`` to ``path``."""
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model, _ = load(str(base_dir))
    lora = {"rank": rank, "scale": scale, "dropout": 0.0}
    linear_to_lora_layers(model, num_layers, lora)
    mx.random.seed(seed)
    weights = {
        name: mx.random.normal(w.shape) * (w.shape[0] ** -0.5 if name.endswith("lora_a") else 0.5)
        for name, w in tree_flatten(model.parameters())
        if name.rsplit(".", 1)[-1] in ("lora_a", "lora_b")
    }
    mx.save_safetensors(str(path / "adapters.safetensors"), weights)
    config = {"fine_tune_type": "lora", "num_layers": num_layers, "lora_parameters": lora}
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path
