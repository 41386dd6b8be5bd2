"""The attention dispatch point: what it rebinds, which layers take the native op, what falls
back, and that the pure-MLX path stays available.

Exactness with the dispatch on is checked where the engines run: every engine test against
mlx-lm runs with it (it is the default), and ``test_hybrid_models.py`` also checks that each
architecture's ragged layers really reached the native op.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import base, llama
from mlx_lm.models.cache import KVCache

from mlxserve.mlx_backend.attention import dispatch, native
from mlxserve.mlx_backend.kv.cache_view import BatchCaches, BatchContext
from mlxserve.mlx_backend.kv.kv_pool import KVPool, StatePool
from mlxserve.mlx_backend.kv.layer_layout import probe_layout
from tests.conftest import Collector, greedy_reference, submit
from tests.tiny_models import (
    ARCHITECTURES,
    EXTRA_ARCHITECTURES,
    IN_MEMORY_ARCHITECTURES,
    build_tiny_model,
)

NATIVE = native.native_status().active
needs_native = pytest.mark.skipif(not NATIVE, reason=native.native_status().reason)

# The suite's architectures whose attention layers keep MLX's SDPA over the gathered K/V,
# and why (a substring of the reason the plan logs).
EXPECTED_FALLBACKS = {
    # MLA: queries of the latent width attend over (latent, rope-key) keys of another.
    "kimi_linear": "head dims differ",
    # plamo2 calls mx.fast.scaled_dot_product_attention itself.
    "plamo2": "without scaled_dot_product_attention",
}


class TestInstall:
    def test_rebinds_the_model_modules_name_only(self, tiny_llama):
        dispatch.install_dispatch(tiny_llama.model)
        assert llama.scaled_dot_product_attention is dispatch.scaled_dot_product_attention
        assert base.scaled_dot_product_attention is dispatch._mlx_lm_sdpa, (
            "mlx-lm's own function must stay as it is"
        )

    def test_other_caches_get_mlx_lm_unchanged(self):
        rng = np.random.default_rng(0)
        q, k, v = (mx.array(rng.standard_normal((1, 2, 3, 8), dtype=np.float32)) for _ in "qkv")
        cache = KVCache()
        got = dispatch.scaled_dot_product_attention(q, k, v, cache, scale=0.3, mask="causal")
        want = base.scaled_dot_product_attention(q, k, v, cache, scale=0.3, mask="causal")
        assert mx.array_equal(got, want), "a non-pool cache must get mlx-lm's exact result"


@needs_native
class TestPlanPerArchitecture:
    @pytest.mark.parametrize("arch", ARCHITECTURES + EXTRA_ARCHITECTURES + IN_MEMORY_ARCHITECTURES)
    def test_layers_on_the_native_op(self, arch):
        model, _ = build_tiny_model(arch)
        layout = probe_layout(model)
        plan = dispatch.plan_attention(model, layout)
        expected = EXPECTED_FALLBACKS.get(arch)
        if expected is None:
            assert plan.ragged_layers == {s.pool_index for s in layout.attention}, (
                f"{arch}: every attention layer should take the native op: {plan.fallbacks}"
            )
        else:
            assert plan.fallbacks and all(expected in why for why in plan.fallbacks.values()), (
                f"{arch}: expected fallbacks for '{expected}', got {plan.fallbacks}"
            )


def _decode_batch(slots: list[list[int]], lens: list[int]) -> SimpleNamespace:
    """What BatchContext reads of a decode ForwardBatch: row b's last slot is written."""
    B = len(lens)
    read = np.array(slots, np.int32)
    computed = np.array(lens, np.int32) - 1
    return SimpleNamespace(
        batch_size=B,
        input_ids=np.ones((B, 1), np.int32),
        computed_lens=computed,
        extend_lens=np.ones(B, np.int32),
        write_slots=read[np.arange(B), computed][:, None],
        read_slots=read,
        sliding_write_slots=np.zeros((B, 1), np.int32),
        sliding_read_slots=np.zeros((B, 1), np.int32),
        sliding_read_start=np.zeros(B, np.int32),
        state_slots=np.zeros(B, np.int32),
        fresh_rows=np.zeros(B, bool),
    )


@needs_native
class TestRuntimeFallback:
    def test_a_foreign_mask_falls_back_to_mlx_lm(self, tiny_llama, monkeypatch):
        """A mask the batch did not make (a model combining masks) is not trusted: the call
        goes to mlx-lm's function over the gathered K/V, logged once."""
        model = tiny_llama.model
        layout = probe_layout(model)
        kv = KVPool(layout, 16, 0)
        states = StatePool(layout, 1)
        batch = _decode_batch(slots=[[1, 2, 3]], lens=[3])
        ctx = BatchContext(batch)
        caches = BatchCaches(layout.specs, kv, states, ctx, frozenset({0}))
        view = caches.caches[0]
        rng = np.random.default_rng(1)
        k_new = mx.array(rng.standard_normal((1, 2, 1, 16), dtype=np.float32))
        keys, values = view.update_and_fetch(k_new, k_new)
        q = mx.array(rng.standard_normal((1, 4, 1, 16), dtype=np.float32))
        warned = []
        monkeypatch.setattr(dispatch, "_warn_once", lambda layer, why: warned.append(why))
        own = view.make_mask(1)
        foreign = mx.array(np.array(own))
        got = dispatch.scaled_dot_product_attention(q, keys, values, view, 0.25, foreign)
        want = base.scaled_dot_product_attention(q, keys, values, view, 0.25, foreign)
        assert mx.allclose(got, want, atol=1e-6) and warned == [
            "the mask is not one the cache made"
        ]
        native_out = dispatch.scaled_dot_product_attention(q, keys, values, view, 0.25, own)
        assert mx.allclose(native_out, want, atol=1e-5), "the view's own mask takes the op"
        assert len(warned) == 1

    def test_rewritten_keys_fall_back(self, tiny_llama, monkeypatch):
        model = tiny_llama.model
        layout = probe_layout(model)
        kv = KVPool(layout, 16, 0)
        ctx = BatchContext(_decode_batch(slots=[[1, 2]], lens=[2]))
        view = BatchCaches(layout.specs, kv, StatePool(layout, 1), ctx, frozenset({0})).caches[0]
        k_new = mx.ones((1, 2, 1, 16))
        keys, values = view.update_and_fetch(k_new, k_new)
        warned = []
        monkeypatch.setattr(dispatch, "_warn_once", lambda layer, why: warned.append(why))
        q = mx.ones((1, 4, 1, 16))
        dispatch.scaled_dot_product_attention(q, keys * 2, values, view, 0.25, view.make_mask(1))
        assert warned == ["the K/V passed are not the ones the cache returned"], warned


@needs_native
class TestQuantizedVariantStatus:
    def test_failed_quantized_self_test_turns_off_only_that_variant(self, monkeypatch):
        monkeypatch.delenv(native.ENV_SWITCH, raising=False)
        monkeypatch.setattr(native, "_quantized_self_test", lambda module: "max difference 1e0")
        status = native._load()
        assert status.active and not status.quantized, status
        assert "quantized self-test failed: max difference 1e0" in status.quantized_reason, status
        assert "quantized pools: not by the native op" in status.describe(), status.describe()

    def test_plan_over_quantized_pools_follows_the_variant(self, tiny_llama, monkeypatch):
        from mlxserve.mlx_backend.kv.quantization import KVQuantization

        model = tiny_llama.model
        layout = probe_layout(model)
        quant = KVQuantization(8, 32)
        on = dispatch.plan_attention(model, layout, quant)
        assert on.ragged_layers == {s.pool_index for s in layout.attention}, on.fallbacks
        assert "dequantized in the kernel" in on.path, on.path
        off = dataclasses.replace(
            native.native_status(), quantized=False, quantized_reason="not by the op (test)"
        )
        monkeypatch.setattr(native, "_status", off)
        plan = dispatch.plan_attention(model, layout, quant)
        assert plan.ragged_layers == frozenset() and "not by the op (test)" in plan.path, plan
        assert dispatch.plan_attention(model, layout).ragged_layers == on.ragged_layers, (
            "float pools keep the op when only the quantized variant is off"
        )

    def test_version_line_says_how_quantized_pools_are_read(self):
        from mlxserve.server.lifecycle.loading import attention_line

        line = attention_line()
        status = native.native_status()
        assert line.startswith(status.reason) and "quantized pools:" in line, line


class TestPureMlxPath:
    def test_switch_turns_the_op_off(self, monkeypatch):
        monkeypatch.setenv(native.ENV_SWITCH, "gather")
        status = native._load()
        assert not status.active and "MLXSERVE_ATTENTION=gather" in status.reason, status

    def test_mismatched_build_is_refused(self, monkeypatch):
        class Stale:
            @staticmethod
            def built_with_mlx() -> str:
                return "0.0.1"

        monkeypatch.delenv(native.ENV_SWITCH, raising=False)
        monkeypatch.setattr(native.importlib, "import_module", lambda name: Stale)
        module, why = native._import_extension()
        assert module is None and "built against MLX 0.0.1" in why
        monkeypatch.setattr(native, "extension", lambda: (module, why))
        status = native._load()
        assert not status.active and "built against MLX 0.0.1" in status.reason, status

    def test_engine_without_the_op_matches_mlx_lm(self, tiny_llama, make_engine, monkeypatch):
        monkeypatch.setattr(
            native, "native_status", lambda: native.NativeStatus(False, "off for this test")
        )
        engine = make_engine(tiny_llama, max_total_tokens=256)
        assert engine.executor.attention.ragged_layers == frozenset()
        assert "off for this test" in engine.executor.attention.path
        prompts = [[1, 2, 3, 4], [9, 8]]
        refs = [greedy_reference(tiny_llama.model, p, 6) for p in prompts]
        col = Collector()
        for i, p in enumerate(prompts):
            submit(engine, col, str(i), p, max_tokens=6, temperature=0.0)
        outputs = [(col.wait(str(i)), col.tokens[str(i)])[1] for i in range(len(prompts))]
        assert outputs == refs, "the pure-MLX path must still equal mlx-lm"
