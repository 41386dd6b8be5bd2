"""The CPU fast paths: OpenBLAS behind MLX's cblas_sgemm, and float32 dequantization.

BLAS preloading only works before mlx.core is imported, and pytest has imported it long before
these tests run, so each BLAS case runs in a fresh interpreter.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Prints the status, then an MLX float32 matmul checked against numpy in float64.
_PROBE = """
import json
from mlxserve.mlx_backend.cpu.blas import enable_fast_blas, verify_blas
status = enable_fast_blas()
import mlx.core as mx
import numpy as np
rng = np.random.default_rng(1)
a = rng.standard_normal((300, 257), dtype=np.float32)
b = rng.standard_normal((257, 129), dtype=np.float32)
out = np.array(mx.array(a) @ mx.array(b))
exact = a.astype(np.float64) @ b.astype(np.float64)
rel = float(np.abs(out - exact).max() / np.abs(exact).max())
print(json.dumps({"active": status.active, "path": status.path, "reason": status.reason,
                  "verify": verify_blas(), "rel_err": rel}))
"""


# Products with one row or one column, in every layout MLX may hand to cblas_sgemm
# (transposed views, addmm's alpha and beta), against numpy in float64.
_VECTOR_PROBE = """
import json
from mlxserve.mlx_backend.cpu.blas import enable_fast_blas, verify_blas
assert enable_fast_blas().active
import mlx.core as mx
import numpy as np
rng = np.random.default_rng(2)
worst, cases = 0.0, 0
for m, k, n in [(1, 5, 7), (1, 576, 1536), (7, 33, 1), (1, 1, 9), (3, 4, 1), (1, 64, 1),
                (1, 300, 2)]:
    for ta in (False, True):
        for tb in (False, True):
            a_np = rng.standard_normal((k, m) if ta else (m, k), dtype=np.float32)
            b_np = rng.standard_normal((n, k) if tb else (k, n), dtype=np.float32)
            a, b = mx.array(a_np), mx.array(b_np)
            a, b = (a.T if ta else a), (b.T if tb else b)
            exact = (a_np.T if ta else a_np).astype(np.float64) @ (
                b_np.T if tb else b_np).astype(np.float64)
            bias = rng.standard_normal((n,), dtype=np.float32)
            # A NaN-filled buffer freed just before: the next output may reuse it.
            mx.eval(mx.full((m, n), float("nan")))
            for out, want in ((a @ b, exact), (mx.addmm(mx.array(bias), a, b, alpha=0.5,
                              beta=2.0), 0.5 * exact + 2.0 * bias)):
                got = np.array(out).astype(np.float64)
                worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
                cases += 1
print(json.dumps({"verify": verify_blas(), "cases": cases, "worst_rel_err": worst}))
"""


def run_probe(blas_setting: str | None) -> dict:
    """Run the probe in a fresh interpreter with ``MLXSERVE_BLAS`` set (or unset)."""
    env = dict(os.environ)
    env.pop("MLXSERVE_BLAS", None)
    if blas_setting is not None:
        env["MLXSERVE_BLAS"] = blas_setting
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def can_build_shim() -> bool:
    """OpenBLAS is installed and setup.py built the shim into the package."""
    from mlxserve.mlx_backend.cpu.blas import _packaged_shim

    has_openblas = importlib.util.find_spec("scipy_openblas32") is not None
    return has_openblas and _packaged_shim() is not None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the BLAS shim is Linux-only")
class TestFastBlas:
    def test_shim_is_active_and_right(self):
        if not can_build_shim():
            pytest.skip("needs scipy-openblas32 and the shim built at install")
        result = run_probe(None)
        assert result["active"], result["reason"]
        assert result["verify"], "libmlx did not call the shim's cblas_sgemm"
        assert result["rel_err"] < 1e-3

    def test_off_switch(self):
        result = run_probe("off")
        assert not result["active"]
        assert "MLXSERVE_BLAS" in result["reason"]
        assert not result["verify"]
        assert result["rel_err"] < 1e-3  # the reference BLAS still computes

    def test_bogus_library_falls_back(self):
        result = run_probe("/nonexistent.so")
        assert not result["active"]
        assert "/nonexistent.so" in result["reason"]
        assert result["rel_err"] < 1e-3

    def test_vector_products_go_through_sgemv_rightly(self):
        """One-row and one-column products (the shim sends them to sgemv): every layout of
        A and B, alpha and beta, and an output buffer MLX left uninitialized."""
        if not can_build_shim():
            pytest.skip("needs scipy-openblas32 and the shim built at install")
        code = _VECTOR_PROBE
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("MLXSERVE_BLAS", None)
        proc = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert result["verify"], "libmlx did not call the shim's cblas_sgemm"
        assert result["cases"] == 7 * 4 * 2
        assert result["worst_rel_err"] < 1e-5, result

    def test_late_call_is_reported_inactive(self):
        """Once mlx.core is imported, libmlx has bound cblas_sgemm: enabling must say so."""
        if not can_build_shim():
            pytest.skip("needs scipy-openblas32 and the shim built at install")
        code = (
            "import mlx.core\nfrom mlxserve.mlx_backend.cpu.blas import enable_fast_blas\n"
            "s = enable_fast_blas()\nprint(s.active, s.reason)"
        )
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("MLXSERVE_BLAS", None)
        proc = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("False") and "imported first" in proc.stdout


# Measured on SmolLM2-135M Q4_1 with this 37-token prompt, max |log-prob diff| over 8 steps:
# 0.0 with the wheel's reference BLAS, 1.0e-4 with OpenBLAS (summation order only; raw logits
# reach ~38). 1e-2 leaves room for other BLAS builds and CPUs.
LOGIT_ATOL = 1e-2
N_TOKENS = 8


def greedy_with_logits(model, prompt: list[int]) -> tuple[list[int], list]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    tokens, logits = [], []
    sampler = lambda x: mx.argmax(x, axis=-1)  # noqa: E731
    for token, logprobs in generate_step(
        mx.array(prompt), model, max_tokens=N_TOKENS, sampler=sampler
    ):
        tokens.append(int(token))
        logits.append(logprobs)
    return tokens, logits


def test_dequantized_smollm_matches_quantized():
    """One load, run quantized, dequantized in place, run again: same tokens, close logits."""
    import mlx.core as mx

    from mlxserve.mlx_backend.loading.dequantize import dequantize_for_cpu
    from mlxserve.mlx_backend.loading.loader import ModelLoadError, load_model

    if mx.default_device().type != mx.cpu:
        pytest.skip("dequantization only applies to the CPU backend")
    try:
        loaded = load_model(None)
    except ModelLoadError as e:
        pytest.skip(str(e))
    prompt = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
    )
    q_tokens, q_logits = greedy_with_logits(loaded.model, prompt)

    refused = dequantize_for_cpu(loaded.model, budget_bytes=0)
    assert not refused.dequantized and refused.bytes_after == refused.bytes_before
    assert "kept quantized" in refused.reason

    status = dequantize_for_cpu(loaded.model, budget_bytes=None)
    assert status.dequantized, status.reason
    assert status.bytes_after > 3 * status.bytes_before  # 4-bit (+scales) -> float32
    dq_tokens, dq_logits = greedy_with_logits(loaded.model, prompt)

    assert dq_tokens == q_tokens
    # generate_step yields log-probabilities: logits minus one logsumexp per step.
    diff = max(mx.abs(a - b).max().item() for a, b in zip(q_logits, dq_logits, strict=True))
    assert diff < LOGIT_ATOL, diff
    assert dequantize_for_cpu(loaded.model).reason == "no quantized layers"
