"""Splitting a model over the group with mlx-lm's own methods: ``shard(group)`` (tensor
parallelism: every layer split), after checking it can be split evenly (``shard()`` itself
does not check: one KV head over two ranks gives ``n_kv_heads = 0`` and a reshape error
much later), or ``pipeline(group)`` (pipeline parallelism: each rank keeps a run of whole
layers; rank 0 the last ones)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

# The widths ``shard()`` divides by the group size, by the names mlx-lm's ModelArgs use.
_SPLIT_WIDTHS = {
    "attention heads": ("num_attention_heads", "n_heads"),
    "KV heads": ("num_key_value_heads", "n_kv_heads"),
    "MLP width": ("intermediate_size", "hidden_dim"),
    "expert MLP width": ("moe_intermediate_size",),
    "shared expert MLP width": ("shared_expert_intermediate_size",),
}


class ShardingError(ValueError):
    """The model cannot be split over the group."""


def model_type(model: nn.Module) -> str:
    args = getattr(model, "args", None)
    return str(getattr(model, "model_type", None) or getattr(args, "model_type", None) or "?")


def check_shardable(model: nn.Module, ranks: int) -> None:
    """Raise ``ShardingError`` naming the model type and the width, unless ``model`` has
    mlx-lm's ``shard()`` and every width it splits divides by ``ranks``."""
    kind = model_type(model)
    if not callable(getattr(model, "shard", None)):
        raise ShardingError(
            f"model type {kind!r} has no tensor-parallel shard() in mlx-lm; "
            "serve it on one process (without --tensor-parallel / --distributed)"
        )
    args = getattr(model, "args", None)
    text_args = getattr(args, "text_config", None)
    for label, names in _SPLIT_WIDTHS.items():
        value = _first(args, names)
        if value is None and isinstance(text_args, dict):
            value = next((text_args[n] for n in names if isinstance(text_args.get(n), int)), None)
        if label == "KV heads" and value is None:
            value = _first(args, _SPLIT_WIDTHS["attention heads"])
        if isinstance(value, int) and value % ranks:
            raise ShardingError(
                f"cannot split {kind} over {ranks} ranks: its {label} ({value}) "
                f"do not divide by {ranks}"
            )


def shard_model(model: nn.Module, group: mx.distributed.Group) -> None:
    """Keep this rank's share of ``model``'s weights (in place), after ``check_shardable``."""
    check_shardable(model, group.size())
    model.shard(group)


def pipeline_module(model: nn.Module) -> nn.Module:
    """The module holding mlx-lm's ``pipeline()`` (the model or its inner text model).

    Raises:
        ShardingError: the model has none.
    """
    inner = getattr(model, "model", None)
    language = getattr(model, "language_model", None)
    candidates = [model, inner, language, getattr(language, "model", None)]
    for module in candidates:
        if module is not None and callable(getattr(module, "pipeline", None)):
            return module
    raise ShardingError(
        f"model type {model_type(model)!r} has no pipeline() in mlx-lm; use --tensor-parallel"
    )


def pipeline_model(model: nn.Module, group: mx.distributed.Group) -> None:
    """Keep this rank's run of layers (in place); each rank needs at least one.

    Raises:
        ShardingError: no ``pipeline()``, or fewer layers than ranks.
    """
    module = pipeline_module(model)
    layers = len(getattr(module, "layers", []) or [])
    if layers < group.size():
        raise ShardingError(f"cannot split {layers} layers over {group.size()} ranks")
    module.pipeline(group)


def split_model(model: nn.Module, group: mx.distributed.Group, split: str) -> int:
    """Split ``model`` over ``group`` by ``split`` ("tensor" or "pipeline").

    Returns:
        the collectives one forward issues (tensor: 2 per layer; pipeline: a send or a
        receive and the final all_gather).
    """
    if split == "pipeline":
        pipeline_model(model, group)
        return 2
    shard_model(model, group)
    return 2 * sharded_layers(model)


def _first(args: object, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(args, name, None)
        if isinstance(value, int):
            return value
    return None


def sharded_layers(model: nn.Module) -> int:
    """How many layers ``shard()`` split (each all_sums twice per forward: attention out,
    MLP down)."""
    layers = getattr(model, "layers", None)
    return len(layers) if layers is not None else 0
