"""The elementwise dispatch point: the native ``swiglu``, ``mx.fast.rope`` and
``mx.fast.rms_norm`` bit for bit against MLX, what the plan replaces, when a call takes the
native op and when MLX's or mlx-lm's own function serves it.

Exactness with them on is checked where the engines run: every engine test against mlx-lm
runs with them (the default on the CPU), and ``test_hybrid_models.py`` checks that each
architecture's forward really reached the ops its plan names.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn
import numpy as np
import pytest
from mlx_lm.models import activations as mlx_lm_activations
from mlx_lm.models import llama
from mlx_lm.models.rope_utils import initialize_rope

from mlxserve.mlx_backend import native_ops
from mlxserve.mlx_backend.native_ops import native_forward, plan_native_ops
from tests.conftest import Collector, greedy_reference, submit
from tests.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def plan(tiny_llama):
    # The native swiglu is opt-in (it rebinds a name in the model's modules); these tests
    # opt in. test_default_leaves_swiglu_to_mlx_lm checks the default.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(native_ops.SWIGLU_SWITCH, "on")
        plan = plan_native_ops(tiny_llama.model)
    if not plan.active:
        pytest.skip(plan.path)
    assert plan.ops == ("swiglu", "rope", "rms_norm"), plan
    return plan


@pytest.fixture
def default_plan(tiny_llama, monkeypatch):
    monkeypatch.delenv(native_ops.SWIGLU_SWITCH, raising=False)
    plan = plan_native_ops(tiny_llama.model)
    yield plan
    monkeypatch.setenv(native_ops.SWIGLU_SWITCH, "on")
    plan_native_ops(tiny_llama.model)  # back to the module's opt-in plan


def mlx_swiglu(gate: mx.array, x: mx.array) -> mx.array:
    return (gate * mx.sigmoid(gate)) * x


class TestSwiglu:
    def test_matches_float64_over_the_activation_range(self, plan):
        rng = np.random.default_rng(1)
        gate = np.concatenate([rng.standard_normal(20000) * 8, np.linspace(-90, 90, 1801)])
        gate = gate.astype(np.float32)
        x = rng.standard_normal(gate.size).astype(np.float32)
        got = np.array(native_ops.silu_mul(mx.array(gate), mx.array(x)))
        g = gate.astype(np.float64)
        want = g / (1 + np.exp(-g)) * x
        rel = np.abs(got - want) / np.maximum(np.abs(want), 1e-30)
        assert rel.max() < 5e-6, f"max relative error {rel.max():.2e}"

    def test_bit_identical_to_mlx_lm_swiglu(self, plan):
        # MLX's exp, sigmoid and products, operation for operation (activation_kernel.cpp):
        # the engine's MLP activations are exactly the reference's.
        rng = np.random.default_rng(5)
        for scale in (1, 4, 30, 100):
            gate = mx.array((rng.standard_normal(200_000) * scale).astype(np.float32))
            x = mx.array(rng.standard_normal(200_000).astype(np.float32))
            got = native_ops.silu_mul(gate, x)
            assert mx.array_equal(got, mlx_lm_activations.swiglu(gate, x)).item(), scale
            assert mx.array_equal(got, mlx_swiglu(gate, x)).item(), scale
        assert "bit-identical" in plan.path

    def test_infinities_nan_and_zero_as_mlx(self, plan):
        gate = mx.array([0.0, -0.0, np.inf, -np.inf, np.nan, 200.0, -200.0], dtype=mx.float32)
        x = mx.ones_like(gate)
        got = np.array(native_ops.silu_mul(gate, x))
        want = np.array(mlx_swiglu(gate, x))
        np.testing.assert_array_equal(got, want)  # NaN where MLX has NaN

    @pytest.mark.parametrize(
        "shape", [(1,), (7,), (3, 1, 1536), (2, 300, 1536), (4, 33, 17)], ids=str
    )
    def test_shapes_single_block_and_split_over_threads(self, plan, shape):
        # (2, 300, 1536) is 28 blocks of the op's split over the thread pool.
        rng = np.random.default_rng(2)
        gate, x = (mx.array(rng.standard_normal(shape).astype(np.float32)) for _ in "gx")
        got = native_ops.silu_mul(gate, x)
        assert got.shape == gate.shape and got.dtype == mx.float32
        assert mx.array_equal(got, mlx_swiglu(gate, x)).item()

    def test_strided_and_broadcast_inputs(self, plan):
        rng = np.random.default_rng(3)
        a = mx.array(rng.standard_normal((48, 64)).astype(np.float32))
        b = mx.array(rng.standard_normal((64, 48)).astype(np.float32))
        row = mx.broadcast_to(mx.array(rng.standard_normal(48).astype(np.float32)), (64, 48))
        for gate, x in [(a.T, b), (b, a.T), (a.T[::2], b[::2]), (b, row), (row, b)]:
            got = native_ops.silu_mul(gate, x)
            assert mx.array_equal(got, mlx_swiglu(gate, x)).item()

    def test_rejects_what_it_cannot_compute(self, plan):
        a = mx.zeros((2, 3))
        with pytest.raises(ValueError, match="same shape"):
            native_ops.silu_mul(a, mx.zeros((3, 2)))
        with pytest.raises(ValueError, match="float32"):
            native_ops.silu_mul(a.astype(mx.bfloat16), a.astype(mx.bfloat16))


class TestDefault:
    def test_default_leaves_swiglu_to_mlx_lm(self, plan, default_plan):
        assert default_plan.ops == ("rope", "rms_norm"), default_plan
        assert "swiglu" not in default_plan.path
        calls, op = [], native_ops.silu_mul
        native_ops.silu_mul = lambda g, x: calls.append(1) or op(g, x)
        try:
            gate = mx.ones((2, 4))
            with native_forward():  # even where an opt-in plan rebound it earlier
                got = llama.swiglu(gate, gate)
        finally:
            native_ops.silu_mul = op
        assert not calls
        assert mx.array_equal(got, native_ops._mlx_lm_swiglu(gate, gate)).item()

    def test_engine_with_swiglu_opted_in_matches_mlx_lm(
        self, plan, tiny_llama, make_engine, attention_spy, monkeypatch
    ):
        monkeypatch.setenv(native_ops.SWIGLU_SWITCH, "on")
        prompts = [[5 + i, 9, 13, 2 * i + 1] * (i + 1) for i in range(4)]
        refs = [greedy_reference(tiny_llama.model, p, 12) for p in prompts]
        engine = make_engine(tiny_llama, max_total_tokens=256, max_running_requests=4)
        assert engine.executor.native_ops.ops == ("swiglu", "rope", "rms_norm")
        col = Collector()
        for i, p in enumerate(prompts):
            submit(engine, col, str(i), p, max_tokens=12, temperature=0.0, ignore_eos=True)
        for i, want in enumerate(refs):
            col.wait(str(i))
            assert col.tokens[str(i)] == want, f"request {i}"
        assert all(attention_spy.elementwise_calls[op] > 0 for op in ("swiglu", "rope"))


class TestDispatch:
    def test_rebinds_the_model_modules_name_only(self, plan):
        assert llama.swiglu is native_ops.swiglu
        assert mlx_lm_activations.swiglu is native_ops._mlx_lm_swiglu, (
            "mlx-lm's own function must stay as it is"
        )

    def test_native_only_inside_the_scope(self, plan, monkeypatch):
        monkeypatch.setattr(native_ops, "_swiglu_enabled", True)  # as the opt-in plan left it
        calls = []
        op = native_ops.silu_mul
        monkeypatch.setattr(native_ops, "silu_mul", lambda g, x: calls.append(1) or op(g, x))
        rng = np.random.default_rng(4)
        gate, x = (mx.array(rng.standard_normal((2, 5)).astype(np.float32)) for _ in "gx")
        outside = native_ops.swiglu(gate, x)
        assert not calls
        assert mx.array_equal(outside, native_ops._mlx_lm_swiglu(gate, x)), (
            "outside the executor's forwards (mlx-lm's own generation) mlx-lm's result, exactly"
        )
        with native_forward():
            inside = native_ops.swiglu(gate, x)
            with native_forward(False):
                native_ops.swiglu(gate, x)
        assert len(calls) == 1
        assert mx.array_equal(inside, outside).item()

    def test_other_dtypes_and_broadcasts_get_mlx_lm(self, plan, monkeypatch):
        monkeypatch.setattr(native_ops, "silu_mul", lambda g, x: pytest.fail("native op called"))
        gate = mx.ones((2, 4), dtype=mx.bfloat16)
        with native_forward():
            assert native_ops.swiglu(gate, gate).dtype == mx.bfloat16
            native_ops.swiglu(mx.ones((2, 4)), mx.ones((1, 4)))

    def test_a_model_without_swiglu_takes_the_others(self):
        model, _ = build_tiny_model("gemma3_text")  # gelu, not swiglu
        plan = plan_native_ops(model)
        assert plan.ops == ("rope", "rms_norm"), plan

    def test_a_failing_self_test_leaves_mlx_and_never_raises(self, plan, monkeypatch):
        def broken(module):
            raise AttributeError("stale build")

        monkeypatch.setattr(native_ops, "_checked", None)
        monkeypatch.setattr(native_ops, "_module", native_ops._module)
        monkeypatch.setattr(native_ops, "_self_test_rope", broken)
        assert "self-test failed" in native_ops._unavailable()
        assert native_ops._module is None
        with native_forward():  # the replaced functions now serve from MLX
            x = mx.ones((1, 1, 2, 8))
            rope_args = dict(traditional=False, base=1e4, scale=1.0, offset=0)
            assert mx.array_equal(
                mx.fast.rope(x, 8, **rope_args), native_ops._mlx_rope(x, 8, **rope_args)
            )

    def test_a_model_the_probe_cannot_run_keeps_mlx(self, plan):
        class Broken(mlx.nn.Module):
            layers: list = []

            def __call__(self, inputs, cache=None):
                raise TypeError("needs pixel values")

        plan = plan_native_ops(Broken())
        assert not plan.active and "probe forward failed" in plan.path

    def test_switched_off_by_the_environment(self):
        code = (
            "import mlx.core as mx\n"
            "from tests.conftest import make_tiny_llama\n"
            "from mlxserve.mlx_backend.native_ops import plan_native_ops\n"
            "print(plan_native_ops(make_tiny_llama().model).path)\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={"MLXSERVE_NATIVE_OPS": "mlx", "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=120,
            cwd=str(Path(__file__).parents[1]),
        )
        assert out.returncode == 0, out.stderr
        assert "disabled by MLXSERVE_NATIVE_OPS=mlx" in out.stdout


ROPE_CASES = [
    # (B, N, T, D, dims, traditional, base, scale, offsets): a decode step with per-row
    # offsets, a prefill chunk after a cached prefix, partial rotation, traditional pairs,
    # positions past 2^23 (MLX's libm path), a scalar offset.
    (32, 9, 1, 64, 64, False, 1e4, 1.0, list(range(5, 32 * 37, 37))),
    (1, 9, 300, 64, 64, False, 1e4, 1.0, [1500]),
    (2, 4, 7, 128, 64, True, 5e5, 0.25, [3, 100_000]),
    (3, 2, 5, 80, 48, False, 1e6, 1.0, [9_000_000, 0, 1]),
    (2, 3, 4, 32, 32, True, 1e4, 2.0, 17),
]


class TestRope:
    @pytest.mark.parametrize("case", ROPE_CASES, ids=lambda c: f"B{c[0]}T{c[2]}d{c[4]}")
    def test_bit_identical_to_mx_fast_rope(self, plan, case):
        B, N, T, D, dims, traditional, base, scale, offsets = case
        rng = np.random.default_rng(6)
        # The layout attention hands rope: [B, T, N, D] transposed to [B, N, T, D].
        x = mx.array(rng.standard_normal((B, T, N, D)).astype(np.float32)).transpose(0, 2, 1, 3)
        offset = offsets if isinstance(offsets, int) else mx.array(offsets, dtype=mx.int32)
        args = dict(traditional=traditional, base=base, scale=scale, offset=offset)
        with native_forward():
            got = mx.fast.rope(x, dims, **args)
        want = native_ops._mlx_rope(x, dims, **args)
        assert mx.array_equal(got, want).item()

    def test_freqs_three_dims_and_five_dims(self, plan):
        rng = np.random.default_rng(7)
        freqs = mx.array(rng.uniform(1, 1e4, 16).astype(np.float32))
        for shape in [(2, 6, 32), (2, 3, 2, 6, 32)]:
            x = mx.array(rng.standard_normal(shape).astype(np.float32))
            args = dict(traditional=False, base=None, scale=1.0, offset=mx.array([4, 9]))
            with native_forward():
                got = mx.fast.rope(x, 32, freqs=freqs, **args)
            assert mx.array_equal(got, native_ops._mlx_rope(x, 32, freqs=freqs, **args)).item()

    def test_mlx_lm_rope_classes(self, plan, monkeypatch):
        # Llama 3's and YaRN's scaled ropes reach mx.fast.rope with freqs.
        calls = []
        op = native_ops.rope_op
        monkeypatch.setattr(native_ops, "rope_op", lambda *a: calls.append(1) or op(*a))
        x = mx.array(np.random.default_rng(8).standard_normal((2, 4, 5, 64)).astype(np.float32))
        for scaling in [
            {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 8192},
            {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
        ]:  # fmt: skip
            module = initialize_rope(64, 5e5, False, scaling, max_position_embeddings=131072)
            want = module(x, offset=mx.array([3, 7000]))
            with native_forward():
                got = module(x, offset=mx.array([3, 7000]))
            assert mx.array_equal(got, want).item(), scaling["type"]
        assert len(calls) == 2

    def test_outside_the_scope_and_what_the_op_does_not_take_get_mlx(self, plan, monkeypatch):
        monkeypatch.setattr(native_ops, "rope_op", lambda *a: pytest.fail("native op called"))
        x = mx.ones((1, 2, 3, 8))
        args = dict(traditional=False, base=1e4, scale=1.0, offset=0)
        mx.fast.rope(x, 8, **args)  # outside native_forward
        with native_forward():
            mx.fast.rope(x.astype(mx.bfloat16), 8, **args)
            mx.fast.rope(x, 8, stream=mx.cpu, **args)
            with pytest.raises(ValueError):  # MLX's own validation and message
                mx.fast.rope(x, 7, **args)

    def test_plan_replaces_mx_fast_rope_and_rms_norm(self, plan):
        assert mx.fast.rope is native_ops.rope
        assert mx.fast.rms_norm is native_ops.rms_norm
        assert "bit-identical" in plan.path


class TestRmsNorm:
    @pytest.mark.parametrize("shape", [(32, 1, 576), (1, 300, 576), (5, 64), (3, 7), (13,)])
    def test_bit_identical_to_mx_fast_rms_norm(self, plan, shape):
        # Rows in blocks of eight and the rows after them; split over the thread pool at 300.
        rng = np.random.default_rng(9)
        x = mx.array((rng.standard_normal(shape) * 4).astype(np.float32))
        w = mx.array(rng.standard_normal(shape[-1]).astype(np.float32))
        for weight in (w, None, 1.0 + w):  # gemma's norms pass 1 + weight
            with native_forward():
                got = mx.fast.rms_norm(x, weight, 1e-6)
            assert mx.array_equal(got, native_ops._mlx_rms_norm(x, weight, 1e-6)).item()

    def test_strided_input_and_nn_rmsnorm(self, plan):
        rng = np.random.default_rng(10)
        x = mx.array(rng.standard_normal((4, 48, 64)).astype(np.float32)).transpose(1, 0, 2)
        norm = mlx.nn.RMSNorm(64, eps=1e-5)
        norm.weight = mx.array(rng.standard_normal(64).astype(np.float32))
        want = norm(x)
        with native_forward():
            got = norm(x)
        assert mx.array_equal(got, want).item()

    def test_outside_the_scope_and_other_dtypes_get_mlx(self, plan, monkeypatch):
        monkeypatch.setattr(native_ops, "rms_norm_op", lambda *a: pytest.fail("native op called"))
        x = mx.ones((2, 8))
        mx.fast.rms_norm(x, mx.ones(8), 1e-5)
        with native_forward():
            mx.fast.rms_norm(x.astype(mx.bfloat16), mx.ones(8, dtype=mx.bfloat16), 1e-5)
            mx.fast.rms_norm(x, mx.ones(8, dtype=mx.bfloat16), 1e-5)
            mx.fast.rms_norm(x, mx.ones(8), 1e-5, stream=mx.cpu)
            with pytest.raises(ValueError):  # MLX's own validation and message
                mx.fast.rms_norm(x, mx.ones(7), 1e-5)
