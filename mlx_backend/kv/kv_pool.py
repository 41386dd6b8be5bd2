"""Slot-indexed pools: the only KV store, and the recurrent state store.

Per attention cache of the model, K ``[n_kv_heads * (space + 1), k_head_dim]`` and V likewise,
where ``space`` is the size of the cache's slot space (full or sliding); with ``--kv-bits``
a row is a packed row of uint32 words (quantized values, scales and biases,
``kv/quantization.py``). Per recurrent cache, one array ``[state_slots + 1, *shape]`` per
state tensor. Slot 0 is padding everywhere.

NOTE: head-major K/V: a gather gives ``[H, B, S, D]`` whose ``[S, D]`` matrices are
contiguous, so attention reads them through batch strides. The token-major layout
``[slots, H, D]`` needed a transposing copy of every gathered K/V per layer and step:
measured on this CPU (B=32, S=180, 30 layers), 620 ms of attention per step vs 245 ms.

NOTE: each head-major pool is stored flat, ``[H * (space + 1), D]``, and read with whole-row
indices ``h * (space + 1) + slot`` (``FlatRows``): MLX's CPU gather copies ``D``-float rows
of a 2-D array much faster than it indexes axis 1 of a 3-D one. Measured here (B=32,
S=150, 30 layers, K and V): 177 ms per decode step vs 246 ms.

NOTE: each pool array has exactly one live reference (the lists here) so that a scatter
``pool[ids] = rows`` can donate the buffer and update in place; a stray extra reference
would turn every write into a copy of the whole pool.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxserve.mlx_backend.attention import native
from mlxserve.mlx_backend.kv.layer_layout import LayerLayout
from mlxserve.mlx_backend.kv.quantization import KVQuantization, PackedRows


def pool_zeros(shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    """``mx.zeros(shape, dtype)`` for a pool: on the CPU from the native op when it is built
    (the zeros written from the kernel thread pool onto transparent huge pages; ``mx.zeros``
    faults a pool in 4 KiB page by page: the default plan's 5.8 GB of SmolLM2 pools took
    ~13 s of start-up, ~4 s this way), else MLX's."""
    if mx.default_device().type == mx.cpu:
        module, _ = native.extension()
        if module is not None:
            return module.pool_zeros(list(shape), dtype)
    return mx.zeros(shape, dtype)


class FlatRows:
    """Slot ids turned into row ids of flat ``[H * size, D]`` pools, built once per head
    count and space size and shared by every layer of a forward that has that shape."""

    def __init__(self, slots: np.ndarray) -> None:
        self._slots = slots.astype(np.int32)
        self._rows: dict[tuple[int, int], mx.array] = {}

    def rows(self, heads: int, size: int) -> mx.array:
        """Row ids ``[heads, *slots.shape]``: row ``h * size + slot``."""
        key = (heads, size)
        if key not in self._rows:
            base = np.arange(heads, dtype=np.int32) * np.int32(size)
            shape = (heads,) + (1,) * self._slots.ndim
            self._rows[key] = mx.array(base.reshape(shape) + self._slots[None])
        return self._rows[key]


class KVPool:
    """K/V pools of every attention cache, indexed by ``CacheSpec.pool_index``.

    With ``quantization`` every row is a packed row (``kv/quantization.py``: mlx-lm's
    quantized values, scales and biases of one token and head in one row of uint32
    words), so a slot holds only quantized K/V and a read is still one gather per pool.

    Args:
        layout: the model's caches.
        full_tokens: slots of the full-attention space.
        sliding_tokens: slots of the sliding-window space.
        quantization: store K/V quantized (None: in the model's K/V dtype).
    """

    def __init__(
        self,
        layout: LayerLayout,
        full_tokens: int,
        sliding_tokens: int,
        quantization: KVQuantization | None = None,
    ) -> None:
        self.quantization = quantization
        self.k: list[mx.array] = []
        self.v: list[mx.array] = []
        # Per cache: the packed-row formats of K and V (None: float rows).
        self.formats: list[tuple[PackedRows, PackedRows] | tuple[None, None]] = []
        # (heads, rows per head) of each cache's flat pools.
        self.shapes: list[tuple[int, int]] = []
        for spec in layout.attention:
            size = (full_tokens if spec.kind == "full" else sliding_tokens) + 1
            heads, kv = spec.kv.n_kv_heads, spec.kv
            self.shapes.append((heads, size))
            if quantization is None:
                self.formats.append((None, None))
                self.k.append(pool_zeros((heads * size, kv.k_head_dim), kv.dtype))
                self.v.append(pool_zeros((heads * size, kv.v_head_dim), kv.dtype))
            else:
                k_rows = quantization.rows(kv.k_head_dim, kv.dtype)
                v_rows = quantization.rows(kv.v_head_dim, kv.dtype)
                self.formats.append((k_rows, v_rows))
                self.k.append(pool_zeros((heads * size, k_rows.words), mx.uint32))
                self.v.append(pool_zeros((heads * size, v_rows.words), mx.uint32))
        mx.eval(self.k, self.v)

    def write(self, index: int, slots: FlatRows, keys: mx.array, values: mx.array) -> None:
        """Scatter ``keys``/``values`` ``[H, T, D]`` into the slots ``[T]`` (quantized into
        packed rows first when the pools are)."""
        rows = slots.rows(*self.shapes[index]).reshape(-1)
        keys = keys.reshape(-1, keys.shape[-1])
        values = values.reshape(-1, values.shape[-1])
        k_rows, v_rows = self.formats[index]
        if k_rows is not None:
            keys, values = k_rows.encode(keys), v_rows.encode(values)
        self.k[index][rows] = keys
        self.v[index][rows] = values

    def read_rows(self, index: int, slots: FlatRows) -> tuple[mx.array, mx.array]:
        """Gather the stored K/V rows at the slots ``[B, S]`` as ``[B, H, S, width]``:
        float rows, or packed rows of a quantized pool."""
        rows = slots.rows(*self.shapes[index])
        return self.k[index][rows].swapaxes(0, 1), self.v[index][rows].swapaxes(0, 1)

    def read(self, index: int, slots: FlatRows) -> tuple[mx.array, mx.array]:
        """Gather K/V at the slots ``[B, S]`` as dense ``[B, H, S, D]`` (the layout SDPA
        takes), dequantizing the gathered rows of a quantized pool."""
        keys, values = self.read_rows(index, slots)
        k_rows, v_rows = self.formats[index]
        if k_rows is None:
            return keys, values
        return k_rows.dequantize(keys), v_rows.dequantize(values)

    def arrays(self) -> list[mx.array]:
        return self.k + self.v


class StatePool:
    """Recurrent state of every recurrent cache, indexed by ``CacheSpec.pool_index``.

    Args:
        layout: the model's caches.
        state_slots: one slot per request that can run at once.
    """

    def __init__(self, layout: LayerLayout, state_slots: int) -> None:
        self.states: list[list[mx.array | None]] = []
        for spec in layout.recurrent:
            entries = []
            for entry in spec.state.entries:
                if entry is None:
                    entries.append(None)
                else:
                    shape, dtype = entry
                    entries.append(mx.zeros((state_slots + 1, *shape), dtype))
            self.states.append(entries)
        mx.eval(self.arrays())

    def gather(self, index: int, slots: mx.array, fresh: mx.array | None) -> list:
        """Each state tensor of the batch's rows; rows in ``fresh`` start from zeros."""
        out = []
        for pool in self.states[index]:
            if pool is None:
                out.append(None)
                continue
            rows = pool[slots]
            if fresh is not None:
                rows = mx.where(fresh.reshape(-1, *([1] * (rows.ndim - 1))), 0, rows)
            out.append(rows)
        return out

    def scatter(self, index: int, slots: mx.array, values: list) -> None:
        """Write back each state tensor the layer left in its cache."""
        for pool, value in zip(self.states[index], values, strict=True):
            if pool is not None and value is not None:
                pool[slots] = value.astype(pool.dtype)

    def copy(self, pairs: np.ndarray) -> None:
        """Copy whole states between slots: ``pairs`` is int32 ``[K, 2]`` of (src, dst)."""
        if len(pairs) == 0:
            return
        src, dst = mx.array(pairs[:, 0]), mx.array(pairs[:, 1])
        for entries in self.states:
            for pool in entries:
                if pool is not None:
                    pool[dst] = pool[src]

    def arrays(self) -> list[mx.array]:
        return [a for entries in self.states for a in entries if a is not None]
