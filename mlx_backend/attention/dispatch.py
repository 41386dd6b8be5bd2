"""The one dispatch point for attention (DESIGN.md): mlx-lm's ``scaled_dot_product_attention``,
routed for the loaded model's modules to the native ragged attention over the pools (float32,
or quantized pools dequantized in the kernel), or to the folded attention over quantized pools
where the native op does not serve them (``FoldedPoolKVCacheView.attention``).

mlx-lm's attention layers call ``scaled_dot_product_attention(queries, keys, values,
cache=..., scale=..., mask=..., sinks=...)``, a name each model module binds at import
(``from .base import scaled_dot_product_attention``). :func:`install_dispatch` rebinds that
name, in the modules the loaded model's layers come from and nowhere else, to
:func:`scaled_dot_product_attention` below, which serves a call from the native op when its
``cache`` is a pool view of a layer on the ragged path (and the call is one the op can
serve exactly), and calls mlx-lm's function unchanged otherwise. Nothing else in model code
is replaced; a model that computes attention itself (soft-capping outside SDPA) runs on the
gathered K/V the view returned.

Which layers take the ragged path is decided once, at load (:func:`plan_attention`): one
probe forward through the model's own caches records the layers whose cache reaches the
function; the rest, and every layer when the native op is off or MLX does not run on the
CPU, keep MLX's SDPA over the gathered K/V. At run time a call whose mask or K/V are not the
view's own (a model that rewrites them) falls back too, logged once per layer.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base as mlx_lm_base
from mlx_lm.models.cache import CacheList, KVCache

from mlxserve.mlx_backend.attention import native
from mlxserve.mlx_backend.kv.cache_view import FoldedPoolKVCacheView, PoolKVCacheView
from mlxserve.mlx_backend.kv.layer_layout import CacheSpec, LayerLayout
from mlxserve.mlx_backend.kv.quantization import KVQuantization
from mlxserve.mlx_backend.model_modules import rebind_in_model_modules

logger = logging.getLogger(__name__)

# mlx-lm's own function, kept before anything is rebound.
_mlx_lm_sdpa = mlx_lm_base.scaled_dot_product_attention
NAME = "scaled_dot_product_attention"
# The native op's per-task buffers (csrc/attention_kernel.h): query heads per KV head,
# their floats (heads x head dim), and the head dim.
MAX_GROUP = 64
MAX_GROUP_FLOATS = 8192
MAX_HEAD_DIM = 512


def scaled_dot_product_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache,  # noqa: ANN001 - any mlx-lm cache
    scale: float,
    mask: mx.array | str | None,
    sinks: mx.array | None = None,
) -> mx.array:
    """mlx-lm's ``scaled_dot_product_attention``, served from the pools for ragged views
    and folded quantized views (each returns None for a call it does not cover)."""
    if type(cache) is PoolKVCacheView and cache.ragged:
        out = _ragged(queries, keys, values, cache, scale, mask, sinks)
        if out is not None:
            return out
    elif type(cache) is FoldedPoolKVCacheView:
        out = cache.attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        if out is not None:
            return out
    probe = _probe.active
    if probe is not None:
        probe.record(cache, queries, keys, sinks)
    return _mlx_lm_sdpa(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def _ragged(queries, keys, values, view: PoolKVCacheView, scale, mask, sinks) -> mx.array | None:  # noqa: ANN001
    """The native op's answer, or None (logged once per layer) when it cannot give it."""
    why = None
    if view.fetched is None or keys is not view.fetched[0] or values is not view.fetched[1]:
        why = "the K/V passed are not the ones the cache returned"
    elif queries.dtype != mx.float32:
        why = f"queries are {queries.dtype}"
    ragged = view.ragged_keys(mask) if why is None else None
    if why is None and ragged is None:
        why = "the mask is not one the cache made"
    if why is not None:
        _warn_once(view.pool_index, why)
        return None
    return native.ragged_attention(
        queries,
        ragged.k_pool,
        ragged.v_pool,
        ragged.slots,
        ragged.meta,
        sinks,
        scale=float(scale),
        window=ragged.window,
        kv_heads=ragged.kv_heads,
        rows_per_head=ragged.rows_per_head,
        bits=ragged.bits,
        group_size=ragged.group_size,
    )


_warned: set[tuple[int, str]] = set()


def _warn_once(layer: int, why: str) -> None:
    if (layer, why) not in _warned:
        _warned.add((layer, why))
        logger.warning("attention layer %d falls back to MLX's SDPA: %s", layer, why)


# ------------------------------------------------------------------ installing, per model
def install_dispatch(model: nn.Module) -> list[str]:
    """Rebind ``scaled_dot_product_attention`` in the modules ``model``'s layers come from
    (idempotent). Returns the names of the modules that now dispatch."""
    return rebind_in_model_modules(
        model, NAME, _mlx_lm_sdpa, scaled_dot_product_attention, mlx_lm_base.__name__
    )


@dataclass
class AttentionPlan:
    """Which attention layers (``CacheSpec.pool_index``) run on the native op.

    Attributes:
        ragged_layers: pool indices served by the native op.
        path: one line for the start-up log and ``/version``.
        fallbacks: pool index -> why that layer keeps MLX's SDPA over the gathered K/V.
    """

    ragged_layers: frozenset[int]
    path: str
    fallbacks: dict[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class _Call:
    """What one layer passed to the function in the probe forward."""

    q_dtype: mx.Dtype
    q_heads: int
    q_dim: int


class _Probe:
    """Records, during the load-time probe forward, which caches reach the function."""

    def __init__(self) -> None:
        self.calls: dict[int, _Call] = {}

    def record(self, cache, queries: mx.array, keys: mx.array, sinks) -> None:  # noqa: ANN001
        self.calls[id(cache)] = _Call(queries.dtype, queries.shape[1], queries.shape[-1])


class _ProbeSlot(threading.local):
    active: _Probe | None = None


_probe = _ProbeSlot()


def plan_attention(
    model: nn.Module, layout: LayerLayout, quantization: KVQuantization | None = None
) -> AttentionPlan:
    """Install the dispatch for ``model`` and decide, per attention layer, its path.

    A layer takes the native op when the op is active, MLX runs on the CPU, the layer's
    K/V are float32 and a probe forward through the model's own caches shows the layer's
    cache reaching ``scaled_dot_product_attention`` with float32 queries. With
    ``quantization`` the pools hold packed rows (float32 scales and biases) and the op's
    quantized variant must be active too; the plan's text then describes the op only (the
    executor names the path of the other layers).
    """
    specs = layout.attention
    if mx.default_device().type != mx.cpu:
        return AttentionPlan(frozenset(), "MLX SDPA over gathered K/V (MLX runs on the GPU)")
    status = native.native_status()
    if not status.active:
        return AttentionPlan(frozenset(), f"MLX SDPA over gathered K/V ({status.reason})")
    if quantization is not None and not status.quantized:
        return AttentionPlan(frozenset(), f"quantized pools read {status.quantized_reason}")
    install_dispatch(model)
    calls = _probe_calls(model, layout)
    ragged, fallbacks = set(), {}
    for spec, call in zip(specs, calls, strict=True):
        why = _refusal(spec, call, quantization)
        if why is None:
            ragged.add(spec.pool_index)
        else:
            fallbacks[spec.pool_index] = why
    what = status.reason
    if quantization is not None:
        what += f" on {quantization.describe()} packed pools, dequantized in the kernel"
    path = f"{what}, {len(ragged)}/{len(specs)} attention layers"
    return AttentionPlan(frozenset(ragged), path, fallbacks)


def _refusal(
    spec: CacheSpec, call: _Call | None, quantization: KVQuantization | None = None
) -> str | None:
    """Why the native op cannot serve this layer, or None when it can."""
    if call is None:
        return "computes attention without scaled_dot_product_attention (e.g. soft-capping)"
    kv = spec.kv
    if kv.dtype != mx.float32:
        if quantization is not None:
            return f"scales and biases are {kv.dtype}; the native op reads float32 ones"
        return f"K/V are {kv.dtype}; the native op reads float32 pools"
    if call.q_dtype != mx.float32:
        return f"queries are {call.q_dtype}"
    if call.q_dim != kv.k_head_dim:
        return f"query and key head dims differ ({call.q_dim} vs {kv.k_head_dim})"
    group, rest = divmod(call.q_heads, kv.n_kv_heads)
    width = max(kv.k_head_dim, kv.v_head_dim)
    if rest or group > MAX_GROUP or group * width > MAX_GROUP_FLOATS or width > MAX_HEAD_DIM:
        return (
            f"{call.q_heads} query heads over {kv.n_kv_heads} KV heads of dim {width} exceed "
            "the native op's task buffers"
        )
    return None


def _probe_calls(model: nn.Module, layout: LayerLayout) -> list[_Call | None]:
    """Per attention leaf (``layout.attention`` order), what it passed to the function in a
    2-token forward through the model's own caches, or None when it did not call it."""
    caches = model.make_cache() if hasattr(model, "make_cache") else None
    if caches is None:
        caches = [KVCache() for _ in model.layers]
    probe = _Probe()
    _probe.active = probe
    try:
        mx.eval(model(mx.array([[0, 0]], dtype=mx.int32), cache=caches))
    finally:
        _probe.active = None
    leaves = []
    for cache in caches:
        leaves.extend(cache.caches if type(cache) is CacheList else [cache])
    pairs = zip(layout.leaves(), leaves, strict=True)
    return [probe.calls.get(id(c)) for spec, c in pairs if spec.kind in ("full", "sliding")]
