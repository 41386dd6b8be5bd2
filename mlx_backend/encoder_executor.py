"""The MLX side of an encoder model: a padded batch through the mlx-embeddings model, pooled.

It implements the ``EncoderExecutor`` protocol of ``scheduler/encoder_engine.py`` (numpy in,
numpy out); MLX arrays never leave this module. Rows are right-padded and masked, so each
row's tokens keep their positions and attend only to each other: a batched row pools to
what the same input gives alone.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from mlxserve.mlx_backend.cpu.thread_policy import cpu_thread_policy
from mlxserve.scheduler.memory_plan import MemoryStats


def pool(hidden: mx.array, mask: mx.array, mode: str) -> mx.array:
    """Pool ``[B, L, H]`` hidden states over each row's real tokens (``mask`` ``[B, L]``,
    1.0 for real tokens, which lead each row) as sentence-transformers' ``Pooling`` does.

    Args:
        mode: "cls" (the first token), "mean", "max" or "lasttoken".
    """
    if mode == "cls":
        return hidden[:, 0]
    if mode == "lasttoken":
        last = mx.sum(mask, axis=1).astype(mx.int32) - 1
        return hidden[mx.arange(hidden.shape[0]), last]
    weights = mask[..., None]
    if mode == "max":
        return mx.max(mx.where(weights > 0, hidden, mx.array(-1e9, hidden.dtype)), axis=1)
    if mode == "mean":
        return mx.sum(hidden * weights, axis=1) / mx.maximum(mx.sum(weights, axis=1), 1e-9)
    raise ValueError(f"unknown pooling mode {mode!r}")


class MLXEncoderExecutor:
    """Runs an mlx-embeddings encoder (``model(input_ids, attention_mask=...)`` returning
    ``last_hidden_state`` and ``text_embeds``).

    Args:
        model: the loaded mlx-embeddings model.
        pooling: "model" (its own ``text_embeds``), "cls", "mean", "max" or "lasttoken".
    """

    def __init__(self, model: nn.Module, pooling: str = "model") -> None:
        self.model = model
        self.pooling = pooling
        # As for the decoders (the same process-wide policy): fewer OpenBLAS threads while
        # other processes keep CPUs busy.
        self.blas_threads = cpu_thread_policy()

    def materialize(self) -> None:
        # NOTE: MLX streams are per thread: every lazy array of the model is evaluated on
        # the loading thread, before the encoder thread uses it (see MLXExecutor).
        mx.eval([a for _, a in tree_flatten(self.model) if isinstance(a, mx.array)])

    def encode(self, input_ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        if self.blas_threads is not None:
            self.blas_threads.update()
        B, L = input_ids.shape
        mask = (np.arange(L)[None, :] < lengths[:, None]).astype(np.float32)
        mask_mx = mx.array(mask)
        out = self.model(mx.array(input_ids.astype(np.int32)), attention_mask=mask_mx)
        if self.pooling == "model" and getattr(out, "text_embeds", None) is not None:
            pooled = out.text_embeds
        else:
            mode = "mean" if self.pooling == "model" else self.pooling
            pooled = pool(out.last_hidden_state, mask_mx, mode)
        pooled = pooled.astype(mx.float32)
        mx.eval(pooled)
        return np.array(pooled)

    def memory(self) -> MemoryStats:
        return MemoryStats(mx.get_active_memory(), mx.get_peak_memory(), mx.get_cache_memory())

    def close(self) -> None:
        self.model = None
        mx.synchronize()
