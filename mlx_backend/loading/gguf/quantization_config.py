"""The ``quantization`` entry of an mlx-lm ``config.json`` for a model loaded from GGUF.

GGUF files mix bit widths per tensor (a Q4_K_M file holds 4-, 5-, 6- and 8-bit tensors), so
the most common setting becomes the default and every layer that differs is listed by its
path, as mlx-lm's own mixed-precision conversions do; ``mlx_lm.load`` quantizes each layer
with its entry. Float layers need no entry: mlx-lm quantizes only layers that have scales.
"""

from __future__ import annotations

from typing import Any


def _entry(setting: dict) -> dict[str, Any]:
    entry = {"group_size": setting["group_size"], "bits": setting["bits"]}
    if setting.get("mode", "affine") != "affine":
        entry["mode"] = setting["mode"]
    return entry


def quantization_config(per_layer: dict[str, dict]) -> dict[str, Any]:
    """``{"group_size", "bits", "mode", <path>: {...} for layers that differ}``.

    Args:
        per_layer: module path -> ``{"group_size", "bits", "mode"}`` of each quantized layer.
    """
    settings = [tuple(sorted(_entry(q).items())) for q in per_layer.values()]
    default = dict(max(sorted(set(settings)), key=settings.count))
    config: dict[str, Any] = {**default, "mode": default.get("mode", "affine")}
    for path, q in per_layer.items():
        if _entry(q) != default:
            config[path] = _entry(q)
    return config
