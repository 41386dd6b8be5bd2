"""Slot-indexed K/V pools: the only KV store. One K and one V array per attention layer."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache


@dataclass(frozen=True)
class AttentionLayerShape:
    """Per-token K/V shape of one attention layer."""

    n_kv_heads: int
    k_head_dim: int
    v_head_dim: int
    dtype: mx.Dtype

    @property
    def bytes_per_token(self) -> int:
        return self.n_kv_heads * (self.k_head_dim + self.v_head_dim) * self.dtype.size


def probe_layer_shapes(model: nn.Module) -> list[AttentionLayerShape]:
    """Run one token through the model with mlx-lm's own caches and read the K/V shapes.

    This asks the model itself instead of parsing configs, so head counts, head dims and
    the activation dtype are exactly what the layers produce.

    Raises:
        NotImplementedError: a layer uses a cache type other than plain attention (recurrent
            or sliding-window layers are not supported by this executor yet).
    """
    caches = model.make_cache() if hasattr(model, "make_cache") else None
    if caches is None:
        caches = [KVCache() for _ in model.layers]
    for i, c in enumerate(caches):
        if type(c) is not KVCache:
            raise NotImplementedError(
                f"layer {i} uses {type(c).__name__}; only full-attention layers are supported"
            )
    mx.eval(model(mx.array([[0]], dtype=mx.int32), cache=caches))
    shapes = []
    for c in caches:
        _, n_kv_heads, _, k_dim = c.keys.shape
        shapes.append(AttentionLayerShape(n_kv_heads, k_dim, c.values.shape[-1], c.keys.dtype))
    return shapes


class KVPool:
    """Per layer, K ``[size + 1, n_kv_heads, k_head_dim]`` and V likewise; row 0 is padding.

    NOTE: each pool array has exactly one live reference (this object's lists) so that a
    scatter ``pool[ids] = rows`` can donate the buffer and update in place; a stray extra
    reference would turn every write into a copy of the whole pool.
    """

    def __init__(self, size: int, shapes: list[AttentionLayerShape]) -> None:
        self.size = size
        self.shapes = shapes
        self.k = [mx.zeros((size + 1, s.n_kv_heads, s.k_head_dim), s.dtype) for s in shapes]
        self.v = [mx.zeros((size + 1, s.n_kv_heads, s.v_head_dim), s.dtype) for s in shapes]
        mx.eval(self.k, self.v)

    @property
    def num_layers(self) -> int:
        return len(self.shapes)

    @staticmethod
    def bytes_per_token(shapes: list[AttentionLayerShape]) -> int:
        return sum(s.bytes_per_token for s in shapes)

    def write(self, layer: int, slots: mx.array, keys: mx.array, values: mx.array) -> None:
        """Scatter ``keys``/``values`` ``[T, H, D]`` into ``slots`` ``[T]`` of ``layer``."""
        self.k[layer][slots] = keys
        self.v[layer][slots] = values

    def read(self, layer: int, slots: mx.array) -> tuple[mx.array, mx.array]:
        """Gather K/V at ``slots`` ``[B, S]`` as ``[B, H, S, D]`` (the layout SDPA takes)."""
        keys = self.k[layer][slots].transpose(0, 2, 1, 3)
        values = self.v[layer][slots].transpose(0, 2, 1, 3)
        return keys, values
