"""What kind of memory each layer needs, read off the model's own ``make_cache()``.

The executor builds its pools and cache views from this, and the engine sizes memory
with it. Kinds::

    full       KVCache           K/V for every position   -> full token-slot space
    sliding    RotatingKVCache   K/V for the last `window` -> sliding token-slot space
    recurrent  ArraysCache       fixed-size state tensors -> one state slot per request
    list       CacheList         several of the above side by side (e.g. falcon_h1)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from mlxserve.mlx_backend.kv.quantization import KVQuantization


@dataclass(frozen=True)
class KVShape:
    """Per-token K/V shape of one attention cache."""

    n_kv_heads: int
    k_head_dim: int
    v_head_dim: int
    dtype: mx.Dtype

    def bytes_per_token(self, quantization: KVQuantization | None = None) -> int:
        """Pool bytes of one token: float K/V, or their packed values, scales and biases."""
        if quantization is None:
            return self.n_kv_heads * (self.k_head_dim + self.v_head_dim) * self.dtype.size
        k = quantization.row_bytes(self.k_head_dim, self.dtype)
        v = quantization.row_bytes(self.v_head_dim, self.dtype)
        return self.n_kv_heads * (k + v)


@dataclass(frozen=True)
class StateShape:
    """Per-request shapes of one recurrent cache's state tensors (``None``: unused entry)."""

    entries: tuple[tuple[tuple[int, ...], mx.Dtype] | None, ...]

    @property
    def bytes_per_slot(self) -> int:
        total = 0
        for entry in self.entries:
            if entry is not None:
                shape, dtype = entry
                n = 1
                for d in shape:
                    n *= d
                total += n * dtype.size
        return total


@dataclass
class CacheSpec:
    """One cache of the model's cache list (a leaf, or a ``list`` of leaves).

    ``pool_index`` numbers the leaves of each kind in model order: attention leaves index
    the K/V pools, recurrent leaves index the state pools.
    """

    kind: str  # "full" | "sliding" | "recurrent" | "list"
    window: int | None = None
    kv: KVShape | None = None
    state: StateShape | None = None
    children: list[CacheSpec] = field(default_factory=list)
    pool_index: int = -1


@dataclass
class LayerLayout:
    """The model's caches, classified, plus numbers the scheduler and sizing need."""

    specs: list[CacheSpec]

    def leaves(self) -> list[CacheSpec]:
        out = []
        for spec in self.specs:
            out.extend(spec.children if spec.kind == "list" else [spec])
        return out

    @property
    def attention(self) -> list[CacheSpec]:
        return [s for s in self.leaves() if s.kind in ("full", "sliding")]

    @property
    def recurrent(self) -> list[CacheSpec]:
        return [s for s in self.leaves() if s.kind == "recurrent"]

    @property
    def has_full(self) -> bool:
        return any(s.kind == "full" for s in self.leaves())

    @property
    def sliding_window(self) -> int | None:
        """The widest sliding window (what the sliding slot space must keep), or None."""
        windows = [s.window for s in self.leaves() if s.kind == "sliding"]
        return max(windows) if windows else None

    def bytes_per_token(self, kind: str, quantization: KVQuantization | None = None) -> int:
        """Pool bytes of one token slot of the ``kind`` space, over all its layers."""
        return sum(s.kv.bytes_per_token(quantization) for s in self.leaves() if s.kind == kind)

    def check_quantization(self, quantization: KVQuantization) -> None:
        """Raises:
        ValueError: some attention cache's K or V rows do not split into whole groups."""
        for spec in self.attention:
            quantization.check_dim(spec.kv.k_head_dim, "key head dim")
            quantization.check_dim(spec.kv.v_head_dim, "value head dim")

    @property
    def bytes_per_state_slot(self) -> int:
        return sum(s.state.bytes_per_slot for s in self.recurrent)


# mlx-vlm's language models make caches of mlx-vlm's own classes, of the same contract as
# mlx-lm's namesakes (checked by the vision tests against mlx-vlm's own generation).
_VLM_CACHES = {"KVCache": "full", "RotatingKVCache": "sliding"}


def _vlm_kind(cache) -> str | None:
    if type(cache).__module__ != "mlx_vlm.models.cache":
        return None
    return _VLM_CACHES.get(type(cache).__name__)


def _classify(cache) -> CacheSpec:
    # NOTE: exact types, not isinstance: a subclass (QuantizedKVCache, ChunkedKVCache, ...)
    # has other semantics and must be refused rather than silently run as its parent.
    vlm_kind = _vlm_kind(cache)
    if vlm_kind == "full":
        return CacheSpec("full")
    if vlm_kind == "sliding":
        if getattr(cache, "keep", 0):
            raise NotImplementedError("RotatingKVCache with keep > 0 is not supported")
        return CacheSpec("sliding", window=cache.max_size)
    if type(cache) is KVCache:
        return CacheSpec("full")
    if type(cache) is RotatingKVCache:
        if cache.keep:
            raise NotImplementedError("RotatingKVCache with keep > 0 is not supported")
        return CacheSpec("sliding", window=cache.max_size)
    if isinstance(cache, ArraysCache) and type(cache).__name__ in ("ArraysCache", "MambaCache"):
        return CacheSpec("recurrent")
    if type(cache) is CacheList:
        return CacheSpec("list", children=[_classify(c) for c in cache.caches])
    raise NotImplementedError(f"cache type {type(cache).__name__} is not supported")


def _read_shapes(spec: CacheSpec, cache) -> None:
    if spec.kind == "list":
        for child, sub in zip(spec.children, cache.caches, strict=True):
            _read_shapes(child, sub)
    elif spec.kind == "recurrent":
        spec.state = StateShape(
            tuple(None if a is None else (tuple(a.shape[1:]), a.dtype) for a in cache.cache)
        )
    else:
        _, n_kv_heads, _, k_dim = cache.keys.shape
        spec.kv = KVShape(n_kv_heads, k_dim, cache.values.shape[-1], cache.keys.dtype)


def probe_layout(model: nn.Module) -> LayerLayout:
    """Classify the model's caches and read their shapes from one probe token.

    Raises:
        NotImplementedError: a cache type this executor cannot run (named in the message).
    """
    caches = model.make_cache() if hasattr(model, "make_cache") else None
    if caches is None:
        caches = [KVCache() for _ in model.layers]
    specs = [_classify(c) for c in caches]
    mx.eval(model(mx.array([[0]], dtype=mx.int32), cache=caches))
    for spec, cache in zip(specs, caches, strict=True):
        _read_shapes(spec, cache)
    layout = LayerLayout(specs)
    for i, spec in enumerate(layout.attention):
        spec.pool_index = i
    for i, spec in enumerate(layout.recurrent):
        spec.pool_index = i
    return layout


def _quantized_caches(caches: list, quantization: KVQuantization) -> list:
    out = []
    for cache in caches:
        if type(cache) is CacheList:
            out.append(CacheList(*_quantized_caches(cache.caches, quantization)))
        elif type(cache) in (KVCache, RotatingKVCache):
            out.append(QuantizedKVCache(quantization.group_size, quantization.bits))
        else:
            out.append(cache)
    return out


def probe_quantized_sdpa(model: nn.Module, quantization: KVQuantization) -> str | None:
    """Whether the model runs on quantized K/V tuples: one probe token through it with an
    mlx-lm ``QuantizedKVCache`` in place of every attention cache.

    Returns:
        None if it runs, else what failed (attention sinks, say, which mlx-lm's quantized
        SDPA refuses, or attention code that does not go through mlx-lm's dispatch).
    """
    caches = model.make_cache() if hasattr(model, "make_cache") else None
    if caches is None:
        caches = [KVCache() for _ in model.layers]
    try:
        mx.eval(
            model(mx.array([[0]], dtype=mx.int32), cache=_quantized_caches(caches, quantization))
        )
    except Exception as e:  # noqa: BLE001 - any failure means: not on this path
        return f"{type(e).__name__}: {e}"
    return None
