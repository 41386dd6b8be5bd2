"""Weights shared by the models served over them: a base model loaded once, however many
declared models (the base itself, LoRA adapters over it) use it.

``SharedWeights.acquire`` returns the base of a key, loading (and converting) it when no
model holds it; each holder ``release``-s it when it is unloaded, and the last one drops
it. ``tree_sharing_arrays`` gives a model a module tree of its own (an adapter replaces
layers in it) over the base's very arrays, so a second adapter costs its own LoRA matrices
and nothing of the base.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel


@dataclass
class _Base:
    loaded: LoadedModel
    nbytes: int
    holders: int = 0


class SharedWeights:
    """Base models by key (a source and how it is loaded), counted by their holders."""

    def __init__(self) -> None:
        self._bases: dict[Hashable, _Base] = {}
        self._lock = threading.Lock()

    def acquire(self, key: Hashable, load: Callable[[], LoadedModel]) -> tuple[LoadedModel, int]:
        """The base of ``key`` and its parameter bytes, loaded by ``load`` (which also
        converts it for the backend) when no model holds it; the caller holds it until
        ``release(key)``.

        Raises:
            Exception: whatever ``load`` raised (nothing is held then).
        """
        with self._lock:
            base = self._bases.get(key)
            if base is None:
                loaded = load()
                base = _Base(loaded, parameter_bytes(loaded.model))
                self._bases[key] = base
            base.holders += 1
            return base.loaded, base.nbytes

    def release(self, key: Hashable) -> None:
        """One holder of ``key`` is unloaded; the last one drops the base."""
        with self._lock:
            base = self._bases.get(key)
            if base is None:
                return
            base.holders -= 1
            if base.holders <= 0:
                del self._bases[key]

    def resident(self) -> dict[Hashable, int]:
        """The bases held now and their bytes."""
        with self._lock:
            return {key: base.nbytes for key, base in self._bases.items()}


def parameter_bytes(model: Any, exclude: set[int] | None = None) -> int:
    """Bytes of ``model``'s parameters, leaving out the arrays whose ids are ``exclude``."""
    if model is None:
        return 0
    exclude = exclude or set()
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()) if id(v) not in exclude)


def array_ids(model: nn.Module) -> set[int]:
    """The ids of every parameter array of ``model``."""
    return {id(v) for _, v in tree_flatten(model.parameters())}


def _arrays(obj: Any, found: dict[int, mx.array]) -> None:
    """Every MLX array reachable from ``obj`` (parameters, and private arrays such as RoPE
    frequency tables), by id."""
    if isinstance(obj, mx.array):
        found[id(obj)] = obj
    elif isinstance(obj, nn.Module):
        for value in list(obj.values()) + list(vars(obj).values()):
            _arrays(value, found)
    elif isinstance(obj, dict):
        for value in obj.values():
            _arrays(value, found)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _arrays(value, found)


def tree_sharing_arrays(model: nn.Module) -> nn.Module:
    """A copy of ``model``'s module tree whose every array is ``model``'s own (no array
    is copied: the memo maps each to itself)."""
    memo: dict[int, Any] = {}
    _arrays(model, memo)
    return copy.deepcopy(model, memo)
