"""The one dispatch point for attention: mlx-lm's ``scaled_dot_product_attention``, routed
to mlxserve's own attention when its cache is a pool view that has one.

mlx-lm's model modules import ``scaled_dot_product_attention`` from ``models/base.py`` by
name and call it with the layer's cache. ``install`` rebinds that name, in the modules
whose classes make up a given model, to ``dispatch``: for a ``FoldedPoolKVCacheView`` it
runs the view's attention over the packed rows; for any other cache (mlx-lm's own caches
in a reference run in the same process, a float pool view) and for any call that view
does not cover, it calls mlx-lm's function unchanged. This module is the only place that
knows how the routing is installed.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base

from mlxserve.mlx_backend.kv.cache_view import FoldedPoolKVCacheView

_MLX_LM_SDPA = base.scaled_dot_product_attention
_NAME = "scaled_dot_product_attention"


def dispatch(
    queries: mx.array,
    keys,  # noqa: ANN001 - whatever the cache returned
    values,  # noqa: ANN001
    cache,  # noqa: ANN001
    scale: float,
    mask,  # noqa: ANN001
    sinks: mx.array | None = None,
) -> mx.array:
    """``mlx_lm.models.base.scaled_dot_product_attention``, with pool views' own
    attention where it applies."""
    if isinstance(cache, FoldedPoolKVCacheView):
        out = cache.attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        if out is not None:
            return out
    return _MLX_LM_SDPA(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def install(model: nn.Module) -> list[str]:
    """Route the attention calls of ``model``'s modules through ``dispatch``.

    Returns:
        the names of the modules now routed (those that call mlx-lm's function by the
        name they imported); empty if the model's attention never goes through it.
    """
    names = {type(model).__module__} | {type(m).__module__ for m in model.modules()}
    routed = []
    for name in sorted(names):
        module = sys.modules.get(name)
        current = getattr(module, _NAME, None)
        if current is dispatch:
            routed.append(name)
        elif current is _MLX_LM_SDPA:
            setattr(module, _NAME, dispatch)
            routed.append(name)
    return routed
