"""The prefill time budget: a prefill step between decode steps takes a bounded multiple of
a decode step's time (numpy side only: step times are fed in, no model runs)."""

from __future__ import annotations

import numpy as np

from mlxserve.scheduler.batch import ForwardOutput
from mlxserve.scheduler.config import EngineConfig
from mlxserve.scheduler.memory_plan import MemoryPlan
from mlxserve.scheduler.request import Request
from mlxserve.scheduler.row_groups import FORWARD_OVERHEAD_TOKENS
from mlxserve.scheduler.sampling_params import SamplingParams
from mlxserve.scheduler.scheduler import Scheduler
from mlxserve.scheduler.step_budget import MIN_CHUNK_TOKENS, PREFILL_STEP_RATIO, StepBudget
from tests.test_scheduler_prefill import add, make_scheduler


class TestStepBudget:
    def test_full_budget_without_decoding_or_measurements(self):
        budget = StepBudget(2048)
        assert budget.prefill_tokens(0) == 2048
        assert budget.prefill_tokens(32) == 2048, "nothing measured yet"
        budget.observe("decode", 32, 1, 0.2)
        budget.observe("prefill", 100, 1, 0.005 * (100 + FORWARD_OVERHEAD_TOKENS))
        assert budget.prefill_tokens(0) == 2048

    def test_chunk_fits_the_ratio_of_a_decode_step(self):
        budget = StepBudget(2048)
        budget.observe("decode", 32, 1, 0.2)
        budget.observe("prefill", 100, 1, 0.005 * (100 + FORWARD_OVERHEAD_TOKENS))
        tokens = budget.prefill_tokens(32)
        step_s = 0.005 * (tokens + FORWARD_OVERHEAD_TOKENS)
        assert tokens == int(PREFILL_STEP_RATIO * 0.2 / 0.005) - FORWARD_OVERHEAD_TOKENS
        assert step_s <= PREFILL_STEP_RATIO * 0.2 + 1e-9, f"{tokens} tokens take {step_s} s"

    def test_bounds(self):
        slow = StepBudget(2048)
        slow.observe("decode", 1, 1, 0.01)
        slow.observe("prefill", 10, 1, 10.0)
        assert slow.prefill_tokens(1) == MIN_CHUNK_TOKENS, "a prompt always moves"
        small = StepBudget(8)
        small.observe("decode", 1, 1, 0.01)
        small.observe("prefill", 10, 1, 10.0)
        assert small.prefill_tokens(1) == 8, "never above max_prefill_tokens"

    def test_packed_budget_counts_tokens_until_timed(self):
        """Decode rows and chunks share the forward: before a decode step and a packed step
        are measured, D rows allow RATIO x (D + overhead) prompt tokens."""
        budget = StepBudget(2048)
        for rows in (1, 8, 32):
            want = max(MIN_CHUNK_TOKENS, int(PREFILL_STEP_RATIO * (rows + FORWARD_OVERHEAD_TOKENS)))
            assert budget.prefill_tokens(rows, packed=True) == want
        budget.observe("decode", 32, 1, 0.2)
        assert budget.prefill_tokens(32, packed=True) == want, "no packed step measured yet"
        budget.observe("prefill", 132, 1, 0.6, decode_tokens=32)
        assert budget.packed_token_s is not None

    def test_packed_step_is_timed_against_a_decode_step(self):
        """A packed step costs a decode step plus its prompt tokens' measured share: the
        chunks take at most RATIO decode steps' time, however a prompt token compares with
        a decode row."""
        budget = StepBudget(2048)
        decode_s, token_s = 0.125, 0.0025
        budget.observe("decode", 32, 1, decode_s)
        budget.observe("prefill", 32 + 100, 1, decode_s + 100 * token_s, decode_tokens=32)
        assert abs(budget.packed_token_s - token_s) < 1e-12
        tokens = budget.prefill_tokens(32, packed=True)
        assert abs(tokens - PREFILL_STEP_RATIO * decode_s / token_s) <= 1
        step_s = decode_s + tokens * token_s
        assert step_s <= (1 + PREFILL_STEP_RATIO) * decode_s + 1e-9, (tokens, step_s)

    def test_packed_decode_cost_scales_with_its_rows(self):
        """Timed at batch 1 (the request before a burst), a decode step of D rows is taken
        to cost D + overhead units: a burst's 24 decode rows are not held to the batch-1
        step's time (which would leave every chunk at the minimum)."""
        budget = StepBudget(2048)
        unit, token_s = 0.003, 0.005
        budget.observe("decode", 1, 1, unit * (1 + FORWARD_OVERHEAD_TOKENS))
        decode_24 = unit * (24 + FORWARD_OVERHEAD_TOKENS)
        budget.observe("prefill", 24 + 60, 1, decode_24 + 60 * token_s, decode_tokens=24)
        assert abs(budget.packed_token_s - token_s) < 1e-9
        tokens = budget.prefill_tokens(24, packed=True)
        assert abs(tokens - PREFILL_STEP_RATIO * decode_24 / token_s) <= 1, tokens
        batch_1 = unit * (1 + FORWARD_OVERHEAD_TOKENS)
        assert tokens > 2 * PREFILL_STEP_RATIO * batch_1 / token_s, "held to batch 1's step"

    def test_packed_noise_never_makes_prompt_tokens_free(self):
        """A packed step measured faster than the decode average (load moved) still charges
        its prompt tokens a tenth of the step: the budget stays bounded."""
        budget = StepBudget(4096)
        budget.observe("decode", 32, 1, 0.5)
        budget.observe("prefill", 32 + 64, 1, 0.3, decode_tokens=32)
        assert budget.packed_token_s == 0.1 * 0.3 / 64
        assert MIN_CHUNK_TOKENS <= budget.prefill_tokens(32, packed=True) <= 4096

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
        allowed = sched.budget.prefill_tokens(32)
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


class TestPackedSteps:
    """A packed backend (``MemoryPlan.packed``) runs decode rows and prefill chunks in one
    forward: a prompt arriving never stops the streams, and nothing is split."""

    def _scheduler(self):
        config = EngineConfig(max_total_tokens=4096, max_running_requests=8)
        plan = MemoryPlan(full_tokens=4096, ragged_attention=True)
        return Scheduler(config, plan, max_context_len=1024, eos_token_ids=set())

    def test_decode_rows_ride_along_every_chunk(self):
        sched = self._scheduler()
        params = SamplingParams(max_tokens=40, temperature=0.0)
        sched.add(Request("short", list(range(1, 21)), params, lambda e: None))
        step = sched.schedule()
        sched.process(step, ForwardOutput(np.full(step.batch_size, 7, np.int32)))
        sched.add(Request("long", list(range(100, 700)), params, lambda e: None))
        chunks = []
        while any(r.pending_len > 1 for r in sched.running) or sched.waiting:
            step = sched.schedule()
            assert step.request_ids[0] == "short" and int(step.extend_lens[0]) == 1, (
                "the decoding row leads every step"
            )
            assert step.row_groups == (), "a packed step is one forward"
            chunks.append(int(step.extend_lens[1:].sum()))
            sched.process(step, ForwardOutput(np.full(step.batch_size, 7, np.int32)))
        allowed = max(MIN_CHUNK_TOKENS, int(PREFILL_STEP_RATIO * (1 + FORWARD_OVERHEAD_TOKENS)))
        assert sum(chunks) == 600 and max(chunks) <= allowed, chunks
        while sched.has_work():
            step = sched.schedule()
            sched.process(step, ForwardOutput(np.full(step.batch_size, 7, np.int32)))
        sched.check_integrity()
