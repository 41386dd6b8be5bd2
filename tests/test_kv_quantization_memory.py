"""Quantized K/V pools: what they store, how many slots a budget gives, and the options."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
import pytest

from mlxserve.mlx_backend import memory
from mlxserve.mlx_backend.kv.kv_pool import FlatRows, KVPool
from mlxserve.mlx_backend.kv.layer_layout import CacheSpec, KVShape, LayerLayout, probe_layout
from mlxserve.mlx_backend.kv.quantization import KVQuantization
from mlxserve.mlx_backend.memory import plan_memory
from mlxserve.scheduler.config import EngineConfig
from mlxserve.server.cli import _from_args, build_parser
from tests.conftest import make_tiny_llama
from tests.test_kv_quantization import make_llama

GIB = 2**30


def smollm_like(dtype: mx.Dtype = mx.float32) -> LayerLayout:
    """SmolLM2-135M's caches: 30 full-attention layers of 3 K/V heads of 64."""
    return LayerLayout([CacheSpec("full", kv=KVShape(3, 64, 64, dtype)) for _ in range(30)])


def slots(layout: LayerLayout, bits: int | None, budget: int = GIB) -> int:
    quant = None if bits is None else KVQuantization(bits, 64)
    plan = plan_memory(layout, 0, 1, 1, 1.0, 10**9, quantization=quant, memory_bytes=budget)
    return plan.full_tokens


class TestPlanCountsQuantizedBytes:
    def test_bytes_per_token_are_packed_values_scales_and_biases(self):
        layout = smollm_like()
        # Per head row of 64: float32 256 bytes; 8-bit 64 + 4 + 4; 4-bit 32 + 4 + 4.
        per_row = {None: 256, 8: 72, 4: 40}
        for bits, row in per_row.items():
            quant = None if bits is None else KVQuantization(bits, 64)
            assert layout.bytes_per_token("full", quant) == 30 * 3 * 2 * row, bits

    def test_same_budget_gives_the_target_multiples_of_slots(self):
        f32, f16 = smollm_like(), smollm_like(mx.float16)
        for layout, name, targets in ((f32, "float32", (3.5, 6.0)), (f16, "float16", (1.8, 3.5))):
            base = slots(layout, None)
            assert base == GIB // layout.bytes_per_token("full"), name
            for bits, target in zip((8, 4), targets, strict=True):
                ratio = slots(layout, bits) / base
                assert ratio >= target, f"{bits}-bit over {name}: {ratio:.2f}x < {target}x"

    def test_group_size_32_costs_more_side_bytes(self):
        layout = smollm_like()
        g32 = layout.bytes_per_token("full", KVQuantization(8, 32))
        g64 = layout.bytes_per_token("full", KVQuantization(8, 64))
        assert g32 == g64 + 30 * 3 * 2 * 8, "one more scale and bias (float32) per row"


class TestEngineSlotsFromMemory:
    def test_budget_sized_pool_holds_more_quantized_slots(self, make_engine, monkeypatch):
        loaded = make_llama(32)
        budget = 4 * 2**20
        monkeypatch.setattr(memory, "available_memory_bytes", lambda: budget)
        layout = probe_layout(loaded.model)
        totals = {}
        for bits in (None, 8, 4):
            quant = None if bits is None else KVQuantization(bits, 32)
            engine = make_engine(loaded, mem_fraction=0.5, kv_bits=bits, kv_group_size=32)
            totals[bits] = _total_tokens(engine)
            want = (budget // 2) // layout.bytes_per_token("full", quant)
            assert totals[bits] == want, f"{bits}: {totals[bits]} slots, expected {want}"
        # Head rows of 32: float32 128 bytes, 8-bit 32 + 8, 4-bit 16 + 8.
        assert totals[8] / totals[None] >= 3.1 and totals[4] / totals[None] >= 5.3, totals


def _total_tokens(engine) -> int:
    """The ``kv_cache_total_tokens`` the engine reports (its stats refresh every step)."""
    for _ in range(200):
        if engine.stats().kv_total_tokens:
            break
        time.sleep(0.01)
    return engine.stats().kv_total_tokens


class TestPoolsHoldOnlyPackedRows:
    def test_quantized_pool_is_packed_words_and_reads_back_mlx_lm_values(self):
        loaded = make_llama(64)
        layout = probe_layout(loaded.model)
        quant = KVQuantization(4, 32)
        pool = KVPool(layout, 16, 0, quant)
        words = (64 * 4 // 8 + 2 * 2 * 4) // 4  # 32 value bytes, 2 groups of float32 s/b
        for array in pool.arrays():
            assert array.dtype == mx.uint32, f"a {array.dtype} array in a quantized pool"
            assert array.shape == (2 * 17, words), array.shape
        keys = mx.random.normal((2, 3, 64))  # [H, T, D]
        values = mx.random.normal((2, 3, 64))
        slots = np.array([5, 9, 2])
        pool.write(0, FlatRows(slots), keys, values)
        k, v = pool.read(0, FlatRows(slots[None]))  # [B=1, H, S, D]
        for got, dense in ((k, keys), (v, values)):
            want = mx.dequantize(*mx.quantize(dense, group_size=32, bits=4), group_size=32, bits=4)
            assert mx.array_equal(got[0], want).item(), "read-back is not mlx-lm's dequantized K/V"
        k_rows, _ = pool.read_rows(0, FlatRows(slots[None]))
        packed, scales, biases = pool.formats[0][0].mlx_lm_tuple(k_rows)
        wants = mx.quantize(keys, group_size=32, bits=4)
        for got, want in zip((packed, scales, biases), wants, strict=True):
            assert mx.array_equal(got[0], want).item(), "stored rows are not mx.quantize's"


class TestOptions:
    def test_cli_flags_parse_into_the_engine_config(self):
        parser = build_parser()
        default = _from_args(EngineConfig, parser.parse_args([]))
        assert (default.kv_bits, default.kv_group_size) == (None, 64), "off by default"
        config = _from_args(
            EngineConfig, parser.parse_args(["--kv-bits", "4", "--kv-group-size", "32"])
        )
        assert (config.kv_bits, config.kv_group_size) == (4, 32)

    @pytest.mark.parametrize("argv", [["--kv-bits", "3"], ["--kv-group-size", "16"]])
    def test_cli_rejects_other_values(self, argv, capsys):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
        assert "invalid choice" in capsys.readouterr().err

    @pytest.mark.parametrize("field", [{"kv_bits": 2}, {"kv_group_size": 48}])
    def test_config_rejects_other_values(self, field):
        with pytest.raises(ValueError, match=next(iter(field))):
            EngineConfig(**field)

    def test_group_size_that_does_not_divide_the_head_dim_fails_at_start(self):
        from mlxserve.server.lifecycle.engines import build_engine

        loaded = make_tiny_llama()  # head dim 16: no group size divides it
        engine = build_engine(loaded, EngineConfig(max_total_tokens=64, kv_bits=8))
        try:
            with pytest.raises(RuntimeError) as info:
                engine.start()
        finally:
            engine.shutdown()
        message = str(info.value)
        assert "--kv-group-size 64 does not divide" in message and "16" in message, message
        assert "run without --kv-bits" in message, message
