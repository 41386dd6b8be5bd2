"""The native quantized matmul (``mlx_backend/quantized_matmul.py``, ``csrc/qmm_kernel.cpp``):
the op against float64 and ``mx.dequantize``, its dispatch inside ``native_forward`` only,
the loader keeping a model quantized when the op serves every layer, and the engine on kept
quantized weights against mlx-lm's generation on the same weights dequantized."""

from __future__ import annotations

import copy
from fractions import Fraction

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxserve.mlx_backend import native_ops
from mlxserve.mlx_backend import quantized_matmul as qmm
from mlxserve.mlx_backend.attention import native
from mlxserve.mlx_backend.loading.dequantize import dequantize_all_layers
from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.mlx_backend.loading.loader import load_model
from mlxserve.mlx_backend.logits import find_verified_head
from mlxserve.server.lifecycle.loading import convert_for_backend
from tests.conftest import Collector, greedy_reference, make_tiny_llama, submit

EXTENSION, WHY = native.extension()
pytestmark = pytest.mark.skipif(EXTENSION is None, reason=f"native extension: {WHY}")
# Relative to the largest float64 output: products of K <= 1,536 float32 terms.
TOLERANCE = 2e-6


def quantized(n: int, k: int, bits: int, group_size: int, seed: int = 0):
    weight = mx.array(np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32))
    w, scales, biases = mx.quantize(weight, group_size=group_size, bits=bits)
    dense = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits, dtype=mx.float32)
    return w, scales, biases, np.array(dense)


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))


def float32_nearest(value: Fraction) -> np.float32:
    """``value`` rounded to the nearest float32, ties to even (one rounding, exactly)."""
    guess = np.float32(float(value))
    candidates = [
        np.nextafter(guess, np.float32(-np.inf)),
        guess,
        np.nextafter(guess, np.float32(np.inf)),
    ]
    return min(
        candidates,
        key=lambda c: (abs(Fraction(float(c)) - value), int(c.view(np.uint32)) & 1),
    )


def kernel_order_sum(x: np.ndarray, w: np.ndarray, fused: bool) -> np.float32:
    """The kernel's sum of x * w in float32 (csrc/qmm_kernel.cpp): lane l adds the terms
    l, l + 8, ... one after another, then the lanes are added in sum8's order."""
    lanes = []
    for lane in range(8):
        acc = np.float32(0)
        for xv, wv in zip(x[lane::8], w[lane::8], strict=True):
            term = Fraction(float(xv)) * Fraction(float(wv))
            if not fused:
                term = Fraction(float(float32_nearest(term)))
            acc = float32_nearest(Fraction(float(acc)) + term)
        lanes.append(acc)
    a = lanes
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))


class TestOp:
    @pytest.mark.parametrize("bits", [4, 8])
    @pytest.mark.parametrize("group_size", [32, 64, 128])
    def test_dequantize_equals_mlx(self, bits, group_size):
        w, scales, biases, dense = quantized(37, 384, bits, group_size)
        got = np.array(EXTENSION.dequantize(w, scales, biases, group_size=group_size, bits=bits))
        assert np.array_equal(got, dense), f"{bits}-bit, group {group_size}: not MLX's floats"

    @pytest.mark.parametrize("bits", [4, 8])
    @pytest.mark.parametrize("group_size", [32, 64, 128])
    @pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 33])
    @pytest.mark.parametrize("n", [1, 2, 3, 100])
    def test_product_against_float64(self, bits, group_size, rows, n):
        w, scales, biases, dense = quantized(n, 256, bits, group_size, seed=rows)
        x = np.random.default_rng(n).standard_normal((rows, 256)).astype(np.float32)
        got = np.array(
            EXTENSION.quantized_matmul(
                mx.array(x), w, scales, biases, group_size=group_size, bits=bits
            )
        )
        want = x.astype(np.float64) @ dense.astype(np.float64).T
        assert got.shape == (rows, n)
        error = relative_error(got, want)
        assert error <= TOLERANCE, f"relative error {error:.2e} ({rows} x {n})"

    @pytest.mark.parametrize("rows", [qmm.DENSE_ROWS - 1, qmm.DENSE_ROWS])
    def test_both_paths_of_a_served_product(self, rows):
        """Below DENSE_ROWS the kernel, from it a transient float32 weight and sgemm."""
        w, scales, biases, dense = quantized(40, 128, 4, 32)
        x = np.random.default_rng(rows).standard_normal((rows, 128)).astype(np.float32)
        got = np.array(qmm.product(EXTENSION, mx.array(x), w, scales, biases, 32, 4))
        want = x.astype(np.float64) @ dense.astype(np.float64).T
        assert relative_error(got, want) <= TOLERANCE

    def test_an_output_does_not_depend_on_the_other_rows(self):
        """Each row's outputs are the same sums in the same order, one row or 33."""
        w, scales, biases, _ = quantized(50, 512, 4, 64)
        x = mx.array(np.random.default_rng(1).standard_normal((33, 512)).astype(np.float32))
        args = {"group_size": 64, "bits": 4}
        batch = np.array(EXTENSION.quantized_matmul(x, w, scales, biases, **args))
        for i in (0, 4, 32):
            alone = np.array(EXTENSION.quantized_matmul(x[i : i + 1], w, scales, biases, **args))
            assert np.array_equal(batch[i], alone[0]), f"row {i} differs alone"

    @pytest.mark.parametrize("rows", [1, 9])
    def test_sums_in_the_kernel_order_bit_for_bit(self, rows):
        """Each output is the kernel's documented sum, exactly: eight lane sums along K (a
        fused multiply-add per term where the build has FMA), then ((a0 + a4) + (a2 + a6)) +
        ((a1 + a5) + (a3 + a7)); weights dequantized in registers (1 row) or from scratch with
        eight sums reduced at once (9 rows: blocks of 4 x 3 outputs)."""
        k, n = 64, 7
        w, scales, biases, dense = quantized(n, k, 4, 32, seed=rows)
        x = np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32)
        got = np.array(
            EXTENSION.quantized_matmul(mx.array(x), w, scales, biases, group_size=32, bits=4)
        )
        fused = EXTENSION.kernel_isa() != "x86-64-v2"  # the baseline x86 build has no FMA
        want = np.array(
            [[kernel_order_sum(x[i], dense[j], fused) for j in range(n)] for i in range(rows)],
            dtype=np.float32,
        )
        assert np.array_equal(got, want)

    def test_leading_dimensions_and_a_transposed_input(self):
        w, scales, biases, dense = quantized(24, 128, 8, 32)
        x = mx.array(np.random.default_rng(2).standard_normal((2, 128, 3)).astype(np.float32))
        x = x.transpose(0, 2, 1)  # not row-contiguous: the op copies it
        got = np.array(EXTENSION.quantized_matmul(x, w, scales, biases, group_size=32, bits=8))
        want = np.array(x).astype(np.float64) @ dense.astype(np.float64).T
        assert got.shape == (2, 3, 24)
        assert relative_error(got, want) <= TOLERANCE

    def test_no_rows(self):
        w, scales, biases, _ = quantized(8, 64, 4, 32)
        out = EXTENSION.quantized_matmul(
            mx.zeros((0, 64)), w, scales, biases, group_size=32, bits=4
        )
        assert out.shape == (0, 8)

    @pytest.mark.parametrize(
        "change, message",
        [
            ({"bits": 2}, "bits must be 4 or 8"),
            ({"group_size": 16}, "group_size must be"),
            ({"x": mx.zeros((1, 32))}, "last dimension"),
            ({"x": mx.zeros((1, 64), dtype=mx.float16)}, "float32"),
        ],
    )
    def test_invalid_calls_raise(self, change, message):
        w, scales, biases, _ = quantized(8, 64, 4, 32)
        args = {"x": mx.zeros((1, 64)), "group_size": 32, "bits": 4} | change
        x = args.pop("x")
        with pytest.raises(ValueError, match=message):
            EXTENSION.quantized_matmul(x, w, scales, biases, **args)


class TestDispatch:
    """``mx.quantized_matmul`` after the plan: the native op inside ``native_forward`` for
    what it takes, MLX's function everywhere else."""

    @pytest.fixture(autouse=True)
    def planned(self):
        model = make_tiny_llama().model
        nn.quantize(model, group_size=32, bits=4)
        plan = native_ops.plan_native_ops(model)
        assert "quantized_matmul" in plan.ops, plan

    def counted(self, monkeypatch) -> list[int]:
        calls = []
        original = EXTENSION.quantized_matmul

        def counting(*args, **kwargs):
            calls.append(1)
            return original(*args, **kwargs)

        monkeypatch.setattr(EXTENSION, "quantized_matmul", counting)
        return calls

    def test_inside_the_scope_only(self, monkeypatch):
        calls = self.counted(monkeypatch)
        w, scales, biases, dense = quantized(16, 64, 4, 32)
        x = mx.array(np.random.default_rng(3).standard_normal((2, 64)).astype(np.float32))
        outside = np.array(mx.quantized_matmul(x, w, scales, biases, group_size=32, bits=4))
        assert calls == [], "outside native_forward the call is MLX's"
        with native_ops.native_forward():
            inside = np.array(mx.quantized_matmul(x, w, scales, biases, group_size=32, bits=4))
        assert calls == [1], "inside native_forward the native op serves"
        want = np.array(x).astype(np.float64) @ dense.astype(np.float64).T
        assert relative_error(inside, want) <= TOLERANCE
        assert relative_error(outside, want) <= 1e-5

    def test_the_load_time_head_check_runs_in_the_forwards_scope(self, monkeypatch):
        """The split-head check at load runs its probe forwards where the model's forwards
        run: inside the scope the native op serves them (outside, MLX's naive CPU kernel took
        1.5 s of SmolLM2's start-up)."""
        model = make_tiny_llama().model
        nn.quantize(model, group_size=32, bits=4)
        assert native_ops.plan_native_ops(model).active
        calls = self.counted(monkeypatch)
        assert find_verified_head(model, native_ops=True) is not None
        assert calls, "the probe forwards inside the scope take the native op"
        served = len(calls)
        assert find_verified_head(model, native_ops=False) is not None
        assert len(calls) == served, "outside the scope the probe forwards are MLX's"

    @pytest.mark.parametrize(
        "case", ["transpose=False", "no biases", "float16 x", "2-bit", "stream"]
    )
    def test_calls_it_does_not_take_are_mlx_s(self, monkeypatch, case):
        calls = self.counted(monkeypatch)
        bits = 2 if case == "2-bit" else 4
        w, scales, biases, dense = quantized(32, 64, bits, 32)
        x = mx.array(np.random.default_rng(4).standard_normal((2, 64)).astype(np.float32))
        kwargs = {"group_size": 32, "bits": bits}
        if case == "transpose=False":
            w, scales, biases = mx.quantize(mx.array(dense.T.copy()), group_size=32, bits=4)
            kwargs["transpose"] = False  # x [2, 64] times W^T [64, 32], packed along 32
        if case == "no biases":
            biases = None
            kwargs["mode"] = "mxfp4"
            w, scales = mx.quantize(mx.array(dense), group_size=32, bits=4, mode="mxfp4")
        if case == "float16 x":
            x = x.astype(mx.float16)
        if case == "stream":
            kwargs["stream"] = mx.cpu
        with native_ops.native_forward():
            out = mx.quantized_matmul(x, w, scales, biases, **kwargs)
            mx.eval(out)
        assert calls == [], f"{case}: the native op must not take it"

    def test_a_wrong_shape_is_mlx_s_error(self):
        w, scales, biases, _ = quantized(16, 64, 4, 32)
        with native_ops.native_forward(), pytest.raises(ValueError):
            mx.eval(mx.quantized_matmul(mx.zeros((2, 96)), w, scales, biases, group_size=32))


class TestLoaderKeepsServedModelsQuantized:
    def test_every_layer_served_stays_quantized_with_float32_scales(self):
        loaded = make_tiny_llama()
        nn.quantize(loaded.model, group_size=32, bits=8)
        note = convert_for_backend(loaded)
        assert note.startswith("kept quantized: the native quantized matmul serves"), note
        layers = [m for _, m in loaded.model.named_modules() if isinstance(m, nn.QuantizedLinear)]
        assert layers and all(m.scales.dtype == mx.float32 for m in layers)

    def test_a_layer_it_cannot_serve_dequantizes_the_model(self):
        loaded = make_tiny_llama()
        six_bit = "model.layers.0.mlp.down_proj"
        nn.quantize(
            loaded.model,
            group_size=32,
            bits=4,
            class_predicate=lambda path, m: (
                hasattr(m, "to_quantized")
                and ({"bits": 6, "group_size": 32} if path == six_bit else True)
            ),
        )
        assert qmm.layers_served(loaded.model) == 0
        note = convert_for_backend(loaded)
        assert note.startswith("dequantized"), note

    def test_native_ops_off_dequantizes(self, monkeypatch):
        loaded = make_tiny_llama()
        nn.quantize(loaded.model, group_size=32, bits=4)
        monkeypatch.setattr(native_ops, "unavailable_reason", lambda: "off for the test")
        assert convert_for_backend(loaded).startswith("dequantized")


def engine_matches_dense_reference(make_engine, served: LoadedModel, dense, prompts, tokens):
    eos = set(served.tokenizer.eos_token_ids)
    references = [greedy_reference(dense, p, tokens, eos) for p in prompts]
    engine = make_engine(served, max_total_tokens=2048, max_running_requests=8)
    col = Collector()
    for i, prompt in enumerate(prompts):
        submit(engine, col, str(i), prompt, max_tokens=tokens, temperature=0.0)
    for i, want in enumerate(references):
        col.wait(str(i), timeout=300)
        assert col.tokens[str(i)] == want, f"request {i}: {col.tokens[str(i)]} != {want}"
    assert engine.executor.native_ops.ops.count("quantized_matmul") == 1


class TestEngineOnQuantizedWeights:
    """Greedy tokens of concurrent requests on kept quantized weights equal mlx-lm's own
    generation on the same weights dequantized to float32 (the same floats, summed in
    another order)."""

    @pytest.mark.parametrize("bits, group_size", [(4, 32), (8, 64)])
    def test_tiny_llama(self, make_engine, bits, group_size):
        served = make_tiny_llama(seed=3)
        nn.quantize(served.model, group_size=group_size, bits=bits)
        dense = copy.deepcopy(served.model)
        dequantize_all_layers(dense)
        assert convert_for_backend(served).startswith("kept quantized")
        rng = np.random.default_rng(bits)
        prompts = [rng.integers(1, 256, size=n).tolist() for n in (5, 17, 40, 9)]
        engine_matches_dense_reference(make_engine, served, dense, prompts, 12)

    def test_smollm2(self, make_engine, smollm):
        """The embedded model as ``mlxserve`` now serves it (4-bit layers, an 8-bit tied
        embedding and head) against the ``smollm`` fixture: the same model dequantized."""
        served = load_model(None)
        assert convert_for_backend(served).startswith("kept quantized")
        tok = served.tokenizer
        questions = ["What is the capital of France?", "Name a colour.", "Count to five."]
        prompts = [
            tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
            for q in questions
        ]
        engine_matches_dense_reference(make_engine, served, smollm.model, prompts, 10)
