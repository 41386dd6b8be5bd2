"""Overlapped decode steps (``scheduler/lookahead.py``): the next decode step is built and
launched, fed by the lazy tokens of the step still computing, before that step is processed.

Against mlx-lm's single-sequence greedy generation and against the same engine with
``overlap="off"``; every engine is checked for leaked slots on teardown (``make_engine``).
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxserve.mlx_backend.loading.loader import load_model
from tests.conftest import Collector, greedy_reference, make_tiny_llama, submit
from tests.tiny_models import (
    RECURRENT_ARCHITECTURES,
    SLIDING_ARCHITECTURES,
    WINDOW,
    build_tiny_model_dir,
)

PROMPTS = [
    [1, 2, 3, 4, 5],
    [7, 8],
    [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23],
    [100, 101, 102],
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def references(tiny_llama):
    return [greedy_reference(tiny_llama.model, p, MAX_TOKENS) for p in PROMPTS]


def spy_launches(engine) -> list[bool]:
    """Record each launched step: True when it was built ahead (fed by another step)."""
    seen: list[bool] = []
    launch = engine.executor.launch

    def recording(batch, after=None, after_rows=None):
        seen.append(after is not None)
        return launch(batch, after, after_rows)

    engine.executor.launch = recording
    return seen


def run_all(engine, prompts, per_request=None, **params):
    col = Collector()
    for i, prompt in enumerate(prompts):
        extra = (per_request or {}).get(i, {})
        submit(engine, col, str(i), prompt, **({"max_tokens": MAX_TOKENS} | params | extra))
    finals = [col.wait(str(i)) for i in range(len(prompts))]
    return [col.tokens[str(i)] for i in range(len(prompts))], finals


class TestOverlappedDecode:
    def test_steps_are_built_ahead_and_match_the_reference(
        self, tiny_llama, make_engine, references
    ):
        engine = make_engine(
            tiny_llama, max_total_tokens=1024, max_running_requests=8, overlap="on"
        )
        launches = spy_launches(engine)
        outputs, finals = run_all(engine, PROMPTS, temperature=0.0)
        assert outputs == references
        assert all(f.finish_reason == "length" for f in finals)
        # One decode step launched on its own, then (almost) every one built ahead.
        assert sum(launches) >= MAX_TOKENS - 4, launches

    @pytest.mark.parametrize("overlap", ["off", "auto"])  # auto: off on the CPU backend
    def test_off_runs_every_step_synchronously(self, tiny_llama, make_engine, references, overlap):
        if overlap == "auto" and mx.default_device().type != mx.cpu:
            pytest.skip("auto overlaps on a GPU")
        engine = make_engine(tiny_llama, max_total_tokens=1024, overlap=overlap)
        launches = spy_launches(engine)
        outputs, _ = run_all(engine, PROMPTS, temperature=0.0)
        assert outputs == references
        assert launches == []

    @pytest.mark.parametrize(
        "params",
        [
            {"temperature": 1.0, "seed": 7},  # the draw's key is (seed, position)
            {"temperature": 0.0, "min_tokens": 6, "logprobs": 2},
            {"temperature": 0.0, "logit_bias": ((7, 3.0),)},
            {"temperature": 0.0, "repetition_penalty": 1.3},  # never built ahead
        ],
    )
    def test_same_output_as_synchronous_steps(self, tiny_llama, make_engine, params):
        runs = []
        for overlap in ("on", "off"):
            engine = make_engine(tiny_llama, max_total_tokens=1024, overlap=overlap)
            outputs, finals = run_all(engine, PROMPTS, **params)
            runs.append((outputs, [f.completion_tokens for f in finals]))
        assert runs[0] == runs[1]

    def test_a_row_stopping_on_its_token_wastes_one_row_and_frees_its_slots(
        self, tiny_llama, make_engine, references
    ):
        # Request 0 stops on its 4th token: the step after it was already built with its
        # row, which computes for nothing and is skipped.
        stop = references[0][3]
        assert stop not in references[0][:3]
        engine = make_engine(tiny_llama, max_total_tokens=1024, overlap="on")
        launches = spy_launches(engine)
        outputs, finals = run_all(engine, PROMPTS, {0: {"stop_token_ids": [stop]}}, temperature=0.0)
        assert outputs[0] == references[0][:4] and finals[0].finish_reason == "stop"
        assert outputs[1:] == references[1:]
        assert any(launches)

    def test_abort_while_a_step_computes(self, tiny_llama, make_engine, references):
        engine = make_engine(tiny_llama, max_total_tokens=1024, overlap="on")
        col = Collector()
        for i, prompt in enumerate(PROMPTS):
            max_tokens = 400 if i == 0 else MAX_TOKENS
            submit(engine, col, str(i), prompt, max_tokens=max_tokens, temperature=0.0)
        col.wait_tokens("0", 3)
        engine.abort("0")
        assert col.wait("0").finish_reason == "abort"
        for i in range(1, len(PROMPTS)):
            col.wait(str(i))
            assert col.tokens[str(i)] == references[i]

    def test_a_failed_launch_fails_every_request_in_flight_and_the_engine_goes_on(
        self, tiny_llama, make_engine, references
    ):
        engine = make_engine(tiny_llama, max_total_tokens=1024, overlap="on")
        launch, failed = engine.executor.launch, []

        def failing_once(batch, after=None, after_rows=None):
            if after is not None and not failed:
                failed.append(batch.batch_size)
                raise RuntimeError("injected launch failure")
            return launch(batch, after, after_rows)

        engine.executor.launch = failing_once
        _, finals = run_all(engine, PROMPTS[:2], temperature=0.0)
        # Request 1 fails with it unless it came in after the failure (then it is served).
        assert failed and finals[0].finish_reason == "error" and "injected" in finals[0].error
        assert finals[1].finish_reason in ("error", "length")
        outputs, _ = run_all(engine, PROMPTS, temperature=0.0)
        assert outputs == references


# Sliding-window layouts that overlap (the recurrent ones never do): gemma3's sliding +
# full layers, gpt-oss's attention sinks, an all-sliding-but-one llama.
SLIDING = [a for a in SLIDING_ARCHITECTURES if a not in RECURRENT_ARCHITECTURES]


class TestOtherLayouts:
    @pytest.mark.parametrize("arch", SLIDING)
    def test_sliding_windows_match_the_reference(self, arch, tmp_path, make_engine):
        loaded = load_model(str(build_tiny_model_dir(arch, tmp_path / arch)))
        # Longer than the window, so rows trim their sliding slots while a step is ahead.
        prompts = [[(7 * i + 3 * j) % 200 + 10 for j in range(n)] for i, n in enumerate([3, 9])]
        refs = [greedy_reference(loaded.model, p, 3 * WINDOW) for p in prompts]
        engine = make_engine(loaded, max_total_tokens=512, overlap="on")
        launches = spy_launches(engine)
        outputs, _ = run_all(engine, prompts, max_tokens=3 * WINDOW, temperature=0.0)
        assert outputs == refs, arch
        assert sum(launches) > WINDOW

    def test_quantized_pools_give_what_synchronous_steps_give(self, make_engine):
        llama = make_tiny_llama(head_dim=32)  # --kv-group-size 32 must divide it
        runs = []
        for overlap in ("on", "off"):
            engine = make_engine(
                llama, max_total_tokens=1024, kv_bits=8, kv_group_size=32, overlap=overlap
            )
            launches = spy_launches(engine)
            runs.append((run_all(engine, PROMPTS, temperature=0.0)[0], any(launches)))
        assert runs[0][0] == runs[1][0]
        assert runs[0][1] and not runs[1][1]


def test_the_assumed_token_never_reaches_the_prefix_cache_key():
    """all_ids() (the prefix cache's key) cached inside the block holds the placeholder; it
    must be recomputed once the real token of the same length arrives."""
    from mlxserve.scheduler.lookahead import assumed_next_token
    from mlxserve.scheduler.request import Request
    from mlxserve.scheduler.sampling_params import SamplingParams

    req = Request("r", [5, 6, 7], SamplingParams(max_tokens=4), lambda e: None)
    with assumed_next_token([req]):
        assert list(req.all_ids()) == [5, 6, 7, 0]
    req.output_ids.append(42)
    assert list(req.all_ids()) == [5, 6, 7, 42]
