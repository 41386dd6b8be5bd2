"""The prefill time budget: a prefill step between decode steps takes a bounded multiple of
a decode step's time (numpy side only: step times are fed in, no model runs)."""

from __future__ import annotations

import numpy as np

from mlxserve.scheduler.batch import ForwardOutput
from mlxserve.scheduler.request import Request
from mlxserve.scheduler.row_groups import FORWARD_OVERHEAD_TOKENS
from mlxserve.scheduler.sampling_params import SamplingParams
from mlxserve.scheduler.step_budget import MIN_CHUNK_TOKENS, PREFILL_STEP_RATIO, StepBudget
from tests.test_scheduler_prefill import add, make_scheduler


class TestStepBudget:
    def test_full_budget_without_decoding_or_measurements(self):
        budget = StepBudget(2048)
        assert budget.prefill_tokens(decoding=False) == 2048
        assert budget.prefill_tokens(decoding=True) == 2048, "nothing measured yet"
        budget.observe("decode", 32, 1, 0.2)
        budget.observe("prefill", 100, 1, 0.005 * (100 + FORWARD_OVERHEAD_TOKENS))
        assert budget.prefill_tokens(decoding=False) == 2048

    def test_chunk_fits_the_ratio_of_a_decode_step(self):
        budget = StepBudget(2048)
        budget.observe("decode", 32, 1, 0.2)
        budget.observe("prefill", 100, 1, 0.005 * (100 + FORWARD_OVERHEAD_TOKENS))
        tokens = budget.prefill_tokens(decoding=True)
        step_s = 0.005 * (tokens + FORWARD_OVERHEAD_TOKENS)
        assert tokens == int(PREFILL_STEP_RATIO * 0.2 / 0.005) - FORWARD_OVERHEAD_TOKENS
        assert step_s <= PREFILL_STEP_RATIO * 0.2 + 1e-9, f"{tokens} tokens take {step_s} s"

    def test_bounds(self):
        slow = StepBudget(2048)
        slow.observe("decode", 1, 1, 0.01)
        slow.observe("prefill", 10, 1, 10.0)
        assert slow.prefill_tokens(decoding=True) == MIN_CHUNK_TOKENS, "a prompt always moves"
        small = StepBudget(8)
        small.observe("decode", 1, 1, 0.01)
        small.observe("prefill", 10, 1, 10.0)
        assert small.prefill_tokens(decoding=True) == 8, "never above max_prefill_tokens"

    def test_moving_average_follows_the_load(self):
        budget = StepBudget(4096)
        budget.observe("decode", 8, 1, 0.1)
        for _ in range(20):
            budget.observe("decode", 8, 1, 0.4)
        assert abs(budget.decode_s - 0.4) < 1e-3, budget.decode_s


class TestSchedulerUsesTheBudget:
    def test_prompt_arriving_during_decode_is_chunked_by_time(self):
        sched = make_scheduler(budget=1024)
        add(sched, [20], max_tokens=50)
        batch = sched.schedule()  # the first prompt, alone: the full budget
        assert batch.phase == "prefill" and batch.num_tokens == 20
        sched.process(batch, ForwardOutput(np.full(batch.batch_size, 7, np.int32)))
        sched.budget.observe("decode", 1, 1, 0.1)
        sched.budget.observe("prefill", 100, 1, 0.001 * (100 + FORWARD_OVERHEAD_TOKENS))
        allowed = sched.budget.prefill_tokens(decoding=True)
        assert MIN_CHUNK_TOKENS <= allowed < 600, allowed
        params = SamplingParams(max_tokens=3, temperature=0.0)
        sched.add(Request("long", list(range(5000, 5600)), params, lambda e: None))
        phases = []
        for _ in range(6):
            batch = sched.schedule()
            phases.append((batch.phase, batch.num_tokens))
            sched.process(batch, ForwardOutput(np.full(batch.batch_size, 7, np.int32)))
        prefills = [n for phase, n in phases if phase == "prefill"]
        assert prefills and max(prefills) <= allowed, f"steps {phases}, budget {allowed}"
        assert ("decode", 1) in phases, f"decode steps must go on between chunks: {phases}"
