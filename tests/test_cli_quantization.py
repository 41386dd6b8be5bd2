"""The CPU weight policy: quantized for the native quantized matmul when it serves every
layer, else dequantized; quantized as loaded with --keep-quantized."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlxserve.mlx_backend import native_ops
from mlxserve.mlx_backend.loading.loader import load_model
from mlxserve.server.cli import _from_args, build_parser
from mlxserve.server.config import ModelConfig
from mlxserve.server.lifecycle.loading import convert_for_backend, keep_quantized_note


def quantized_layers(model: nn.Module) -> int:
    return sum(isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding) for m in model.modules())


class TestWeightPolicy:
    def test_flag_parses_into_the_server_config(self):
        parser = build_parser()
        assert _from_args(ModelConfig, parser.parse_args([])).keep_quantized is False
        args = parser.parse_args(["--keep-quantized"])
        assert _from_args(ModelConfig, args).keep_quantized is True

    def test_default_conversion_keeps_what_the_native_op_serves(self):
        kept, converted = load_model(None), load_model(None)
        assert "kept" in keep_quantized_note(kept)
        assert quantized_layers(kept.model) > 0, "--keep-quantized must leave layers as loaded"
        note = convert_for_backend(converted)
        assert note.startswith("kept quantized: the native quantized matmul serves"), note
        assert quantized_layers(converted.model) == quantized_layers(kept.model)
        scales = [m.scales for m in converted.model.modules() if hasattr(m, "scales")]
        assert all(s.dtype == mx.float32 for s in scales), "scales must be float32 for the op"

    def test_without_the_native_op_the_default_conversion_dequantizes(self, monkeypatch):
        monkeypatch.setattr(native_ops, "unavailable_reason", lambda: "off for the test")
        converted = load_model(None)
        note = convert_for_backend(converted)
        assert quantized_layers(converted.model) == 0, f"still quantized after: {note}"
