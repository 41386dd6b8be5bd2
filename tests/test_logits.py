"""Last-token logits: the split head path is used only when it equals the model's logits."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlxserve.mlx_backend.logits import LastTokenLogits


class ScaledHeadModel(nn.Module):
    """A model whose logits are not ``lm_head(model(x))`` (like soft-capped families)."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.model = base.model
        self.lm_head = base.lm_head

    def __call__(self, inputs, cache=None):
        return 2.0 * self.lm_head(self.model(inputs, cache=cache))


def check_against_full(model: nn.Module, split: LastTokenLogits) -> None:
    inputs = mx.array([[5, 6, 7, 8], [9, 10, 0, 0]], dtype=mx.int32)
    last = mx.array([3, 1], dtype=mx.int32)
    want = model(inputs)[mx.arange(2), last]
    got = split(inputs, None, last)
    assert got.shape == want.shape, (got.shape, want.shape)
    diff = mx.abs(got - want).max().item()
    assert diff < 1e-4, f"last-token logits differ from the model's by {diff}"


class TestLastTokenLogits:
    def test_llama_uses_the_split_head_and_matches(self, tiny_llama):
        split = LastTokenLogits(tiny_llama.model)
        assert split.head is not None, "llama's lm_head should verify"
        check_against_full(tiny_llama.model, split)

    def test_unrecognised_head_falls_back_to_full_logits(self, tiny_llama):
        model = ScaledHeadModel(tiny_llama.model)
        split = LastTokenLogits(model)
        assert split.head is None, "a head that changes the logits must not be split"
        check_against_full(model, split)

    def test_embedded_smollm_ties_its_head(self, smollm):
        split = LastTokenLogits(smollm.model)
        assert split.head is not None, "SmolLM2's tied embedding head should verify"
        check_against_full(smollm.model, split)
