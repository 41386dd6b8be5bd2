"""Prefill packing on the numpy side alone: padded area within budget, chunking, and equal
row lengths for recurrent models. No model runs here: each step's tokens are faked."""

from __future__ import annotations

import numpy as np
import pytest

from scheduler.batch import ForwardOutput
from scheduler.config import EngineConfig
from scheduler.memory_plan import MemoryPlan
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler


def make_scheduler(budget: int, recurrent: bool = False) -> Scheduler:
    config = EngineConfig(max_total_tokens=4096, max_running_requests=16, max_prefill_tokens=budget)
    plan = MemoryPlan(full_tokens=4096, state_slots=16 if recurrent else 0)
    return Scheduler(config, plan, max_context_len=1024, eos_token_ids=set())


def add(sched: Scheduler, lengths: list[int], max_tokens: int = 3) -> None:
    for i, n in enumerate(lengths):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        # Distinct prompts: identical ones would share a prefill through the prefix cache.
        prompt = list(range(1000 * i + 1, 1000 * i + n + 1))
        sched.add(Request(f"r{i}", prompt, params, lambda e: None))


def drain(sched: Scheduler, max_steps: int = 500) -> list:
    """Run steps with fake tokens until idle; returns the batches."""
    batches = []
    for _ in range(max_steps):
        if not sched.has_work():
            return batches
        batch = sched.schedule()
        assert batch is not None, "work is left but nothing was scheduled"
        batches.append(batch)
        sched.process(batch, ForwardOutput(np.full(batch.batch_size, 7, np.int32)))
    raise AssertionError("scheduler did not finish")


class TestPrefillPacking:
    @pytest.mark.parametrize("seed", range(5))
    def test_padded_area_never_exceeds_the_budget(self, seed):
        rng = np.random.default_rng(seed)
        sched = make_scheduler(budget=64)
        add(sched, rng.integers(1, 150, size=12).tolist())
        for batch in drain(sched):
            if batch.phase == "prefill":
                area = batch.input_ids.shape[0] * batch.input_ids.shape[1]
                assert area <= 64, f"prefill computes {batch.input_ids.shape} > budget 64"
        sched.check_integrity()

    def test_long_prompt_is_chunked_and_completes(self):
        sched = make_scheduler(budget=16)
        add(sched, [50])
        prefills = [b for b in drain(sched) if b.phase == "prefill"]
        assert [int(b.extend_lens[0]) for b in prefills] == [16, 16, 16, 2]
        sched.check_integrity()

    def test_short_rows_pack_together(self):
        sched = make_scheduler(budget=64)
        add(sched, [8, 8, 8, 8])
        first = sched.schedule()
        assert first.batch_size == 4, "four 8-token prompts fit one 64-position prefill"


class TestRecurrentPrefill:
    def test_rows_of_one_step_feed_equal_lengths(self):
        sched = make_scheduler(budget=64, recurrent=True)
        add(sched, [5, 9, 3, 12, 5, 1])
        for batch in drain(sched):
            if batch.phase == "prefill":
                lens = set(batch.extend_lens.tolist())
                assert len(lens) == 1, f"recurrent prefill rows differ in length: {lens}"
        sched.check_integrity()
        free = sched.state_allocator.available_size() + len(sched.cache.owned_states())
        assert free == 16, "every state slot is free or a prefix-cache snapshot"
