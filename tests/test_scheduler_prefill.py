"""Prefill packing on the numpy side alone: tokens within budget, rows grouped by length,
chunking, and equal row lengths for recurrent models. No model runs here: each step's tokens
are faked."""

from __future__ import annotations

import numpy as np
import pytest

from mlxserve.scheduler.batch import ForwardOutput
from mlxserve.scheduler.config import EngineConfig
from mlxserve.scheduler.memory_plan import MemoryPlan
from mlxserve.scheduler.request import Request
from mlxserve.scheduler.row_groups import (
    DECODE_OVERHEAD_KEYS,
    FORWARD_OVERHEAD_TOKENS,
    padded_area,
    plan_decode_groups,
    plan_row_groups,
)
from mlxserve.scheduler.sampling_params import SamplingParams
from mlxserve.scheduler.scheduler import Scheduler


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
    def test_tokens_within_budget_and_groups_cover_every_row(self, seed):
        rng = np.random.default_rng(seed)
        sched = make_scheduler(budget=64)
        add(sched, rng.integers(1, 150, size=12).tolist())
        for batch in drain(sched):
            if batch.phase != "prefill":
                continue
            assert batch.num_tokens <= 64, f"prefill feeds {batch.num_tokens} > budget 64"
            groups = list(batch.row_groups) or [np.arange(batch.batch_size)]
            rows = np.sort(np.concatenate(groups))
            assert rows.tolist() == list(range(batch.batch_size)), "groups miss or repeat rows"
            # Grouping never costs more than one forward per row would.
            area = padded_area(batch.extend_lens, groups)
            overhead = FORWARD_OVERHEAD_TOKENS * (len(groups) - batch.batch_size)
            assert area <= batch.num_tokens - overhead
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
        assert first.batch_size == 4, "four 8-token prompts fit one 64-token prefill"
        assert first.row_groups == (), "equal rows run as one forward"

    def test_rows_are_not_cut_to_the_first_rows_width(self):
        sched = make_scheduler(budget=64)
        add(sched, [8, 40])
        first = sched.schedule()
        assert first.extend_lens.tolist() == [8, 40]


class TestRowGroups:
    def test_equal_lengths_make_one_group(self):
        assert [g.tolist() for g in plan_row_groups(np.full(5, 30))] == [[0, 1, 2, 3, 4]]

    def test_far_apart_lengths_split(self):
        groups = plan_row_groups(np.array([10, 200, 12, 190]))
        assert [sorted(g.tolist()) for g in groups] == [[1, 3], [0, 2]]

    def test_close_lengths_stay_together(self):
        # Splitting would save 4 padded positions but cost a whole forward.
        assert len(plan_row_groups(np.array([100, 98, 96]))) == 1

    @pytest.mark.parametrize("seed", range(20))
    def test_plan_is_optimal_among_contiguous_splits(self, seed):
        rng = np.random.default_rng(seed)
        lens = rng.integers(1, 300, size=int(rng.integers(1, 9)))
        groups = plan_row_groups(lens)
        cost = padded_area(lens, groups) + FORWARD_OVERHEAD_TOKENS * len(groups)
        ordered = np.sort(lens)[::-1]
        B = len(lens)
        for mask in range(1 << (B - 1)):  # every split of the sorted rows
            cuts = [0] + [i + 1 for i in range(B - 1) if mask >> i & 1] + [B]
            brute = sum(
                (b - a) * int(ordered[a]) + FORWARD_OVERHEAD_TOKENS
                for a, b in zip(cuts[:-1], cuts[1:], strict=True)
            )
            assert cost <= brute

    def test_plan_is_optimal_with_a_decode_sized_overhead(self):
        # The O(B) shortcut (padding below one forward's cost) must agree with the DP.
        rng = np.random.default_rng(0)
        for _ in range(50):
            lens = rng.integers(1, 5000, size=int(rng.integers(1, 9)))
            groups = plan_row_groups(lens, DECODE_OVERHEAD_KEYS)
            cost = padded_area(lens, groups) + DECODE_OVERHEAD_KEYS * len(groups)
            ordered = np.sort(lens)[::-1]
            for mask in range(1 << (len(lens) - 1)):
                cuts = [0] + [i + 1 for i in range(len(lens) - 1) if mask >> i & 1] + [len(lens)]
                brute = sum(
                    (b - a) * int(ordered[a]) + DECODE_OVERHEAD_KEYS
                    for a, b in zip(cuts[:-1], cuts[1:], strict=True)
                )
                assert cost <= brute, (lens.tolist(), [g.tolist() for g in groups])


class TestDecodeGroups:
    def test_one_long_context_decodes_apart_from_short_ones(self):
        contexts = np.array([150] * 15 + [4000] + [120] * 16)
        groups = plan_decode_groups(contexts)
        assert [g.tolist() for g in groups][0] == [15], "the long row runs alone"
        assert sorted(np.concatenate(groups[1:]).tolist()) == [i for i in range(32) if i != 15]

    def test_chat_sized_contexts_decode_together(self):
        # The benchmark corpus: 32 contexts of 60-215 tokens. Splitting saves less padding
        # than a second forward costs.
        contexts = np.linspace(60, 215, 32).astype(int)
        assert len(plan_decode_groups(contexts)) == 1

    def test_decode_batch_carries_its_groups(self):
        sched = make_scheduler(budget=1024)
        add(sched, [900, 20, 25, 30, 12, 40, 22, 18])
        decode = [b for b in drain(sched) if b.phase == "decode"]
        assert decode, "the requests were meant to decode"
        assert len(decode[0].row_groups) == 2, decode[0].row_groups
        long_row = int(np.argmax(decode[0].computed_lens))
        assert [g.tolist() for g in decode[0].row_groups][0] == [long_row]
        sched.check_integrity()


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
