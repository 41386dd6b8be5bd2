"""Rebinding a name in the modules a loaded mlx-lm model's layers come from.

mlx-lm model files bind shared functions at import (``from .base import
scaled_dot_product_attention``, ``from .activations import swiglu``), and their layers call
them by that module-level name. Rebinding the name in those modules, and nowhere else, is
how the dispatch points (``attention/dispatch.py``, ``activations.py``) serve a loaded
model without changing its code.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import mlx.nn as nn


def rebind_in_model_modules(
    model: nn.Module, name: str, original: Callable, replacement: Callable, home: str
) -> list[str]:
    """Where ``name`` is bound to ``original`` (or already to ``replacement``) in a module
    one of ``model``'s layers (or the model) is defined in, bind it to ``replacement``
    (idempotent). ``home``, the module that defines ``original`` (it may define layers too,
    e.g. ``activations.SwiGLU``), keeps it. Returns the names of the rebound modules."""
    names = sorted({type(m).__module__ for m in model.modules()} | {type(model).__module__})
    rebound = []
    for module_name in names:
        if module_name == home:
            continue
        module = sys.modules.get(module_name)
        bound = getattr(module, name, None)
        if bound is original:
            setattr(module, name, replacement)
        if bound is original or bound is replacement:
            rebound.append(module_name)
    return rebound
