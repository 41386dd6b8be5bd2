"""Logits of each row's last fed token, without projecting every prefill position.

A prefill chunk of L tokens only needs the logits of its last real token per row; the
vocabulary projection of all B x L positions (49k x 576 per token for SmolLM2) is a large
share of the prefill's work. mlx-lm models are ``Model(inner=model.model, head)``, but the
head differs by family (``lm_head``, tied embeddings, soft-capping, logit scales), so the
split path is used only when it reproduces the model's own logits on a probe input.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from mlxserve.mlx_backend.native_ops import native_forward

logger = logging.getLogger(__name__)


def _candidate_heads(model: nn.Module) -> list[Callable[[mx.array], mx.array]]:
    heads = []
    if "lm_head" in model:
        heads.append(model.lm_head)
    inner = model.get("model")
    if inner is not None and "embed_tokens" in inner:
        heads.append(inner.embed_tokens.as_linear)
    return heads


def vocab_size(model: nn.Module, native_ops: bool = False) -> int:
    """The width of the model's logits (may exceed the tokenizer's vocabulary); the probe
    forward takes the native ops when the model's forwards do."""
    with native_forward(native_ops):
        return int(model(mx.array([[0]], dtype=mx.int32)).shape[-1])


def find_verified_head(
    model: nn.Module, native_ops: bool = False
) -> Callable[[mx.array], mx.array] | None:
    """The head ``h -> logits`` with ``head(model.model(x)) == model(x)``, or ``None``.

    Both sides run in the scope the model's forwards run in (``native_ops``): the question
    is whether the split reproduces the model's own logits, the same ops on both sides, and
    outside the scope a kept-quantized model's probe forwards take MLX's naive CPU
    quantized matmul (1.5 s of start-up for SmolLM2)."""
    inner = model.get("model") if isinstance(model, nn.Module) else None
    if inner is None:
        return None
    probe = mx.array([[1, 2, 3, 4]], dtype=mx.int32)
    with native_forward(native_ops):
        try:
            want = model(probe)
            hidden = inner(probe)
        except Exception:  # noqa: BLE001 - any signature mismatch means "use the full path"
            return None
        for head in _candidate_heads(model):
            try:
                got = head(hidden)
            except Exception:  # noqa: BLE001
                continue
            if got.shape == want.shape and mx.allclose(got, want, atol=1e-4, rtol=1e-4).item():
                return head
    logger.info("logits: no verified head split; projecting every position")
    return None


class LastTokenLogits:
    """``model(inputs, cache)`` reduced to the logits at ``last_pos`` of each row.

    Args:
        model: an mlx-lm model.
        native_ops: run the model's forwards in ``native_ops.native_forward`` (the load-time
            plan said they take the native ops).
    """

    def __init__(self, model: nn.Module, native_ops: bool = False) -> None:
        self.model = model
        self.head = find_verified_head(model, native_ops)
        self.native_ops = native_ops

    def __call__(self, inputs: mx.array, caches: list, last_pos: mx.array) -> mx.array:
        """Returns: ``[B, V]`` logits of position ``last_pos[b]`` of each row ``b``."""
        return self.at(inputs, caches, mx.arange(inputs.shape[0]), last_pos)

    def at(
        self,
        inputs: mx.array,
        caches: list,
        rows: mx.array,
        positions: mx.array,
        **model_inputs: mx.array,
    ) -> mx.array:
        """Logits of chosen ``(row, position)`` pairs only: each row's last position, plus
        every prompt position of the rows that asked for prompt logprobs.

        ``model_inputs`` go to the model as they are (a vision model's ``inputs_embeds``
        and ``position_ids``).

        Returns: ``[N, V]`` logits of position ``positions[n]`` of row ``rows[n]``.
        """
        with native_forward(self.native_ops):
            if self.head is None:
                return self.model(inputs, cache=caches, **model_inputs)[rows, positions]
            hidden = self.model.model(inputs, cache=caches, **model_inputs)
            # The head inside the scope too: a quantized head is a native quantized matmul.
            return self.head(hidden[rows, positions][:, None, :])[:, 0, :]

    def hidden_and_logits(
        self,
        inputs: mx.array,
        caches: list,
        rows: mx.array,
        positions: mx.array,
        logits: bool = True,
        **model_inputs: mx.array,
    ) -> tuple[mx.array, mx.array | None]:
        """The final (normed) hidden states of chosen ``(row, position)`` pairs, what an
        embedding model pools, and (with ``logits``) the head's logits of the same pairs.

        Returns: ``[N, hidden]`` and ``[N, V]`` (or None).

        Raises:
            ValueError: the model has no inner ``model`` returning its hidden states, or
                logits are asked of a model whose head could not be split off.
        """
        inner = self.model.get("model") if isinstance(self.model, nn.Module) else None
        if inner is None:
            raise ValueError(
                f"{type(self.model).__name__} has no inner model returning hidden states: "
                "it cannot serve embeddings"
            )
        if logits and self.head is None:
            raise ValueError("this model's head cannot be split off: embed and generate apart")
        with native_forward(self.native_ops):
            hidden = inner(inputs, cache=caches, **model_inputs)[rows, positions]
            if not logits:
                return hidden, None
            return hidden, self.head(hidden[:, None, :])[:, 0, :]
