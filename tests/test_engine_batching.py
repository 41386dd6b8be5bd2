"""The batched engine against mlx-lm's single-sequence greedy generation (tiny random llama).

Every test's engine is checked for leaked slots on teardown (``make_engine``).
"""

from __future__ import annotations

import pytest

from mlxserve.scheduler import row_groups
from tests.conftest import (
    Collector,
    gather_attention,
    greedy_reference,
    spy_row_groups,
    submit,
)

PROMPTS = [
    [1, 2, 3, 4, 5],
    [7, 8],
    [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23],
    [3],
    [5, 6, 7, 8, 9, 10, 11],
    [100, 101, 102],
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def references(tiny_llama):
    return [greedy_reference(tiny_llama.model, p, MAX_TOKENS) for p in PROMPTS]


def run_all(engine, prompts, max_tokens=MAX_TOKENS, late_index=None):
    """Submit every prompt (one of them after the others have started decoding)."""
    col = Collector()
    for i, prompt in enumerate(prompts):
        if i == late_index:
            col.wait_tokens("0", 2, timeout=30)
        submit(engine, col, str(i), prompt, max_tokens=max_tokens, temperature=0.0)
    finals = [col.wait(str(i)) for i in range(len(prompts))]
    return [col.tokens[str(i)] for i in range(len(prompts))], finals


class TestBatchedGreedy:
    def test_concurrent_requests_match_reference(self, tiny_llama, make_engine, references):
        engine = make_engine(tiny_llama, max_total_tokens=1024, max_running_requests=8)
        outputs, finals = run_all(engine, PROMPTS, late_index=4)
        for i, (got, want) in enumerate(zip(outputs, references, strict=True)):
            assert got == want, f"request {i}: engine {got} != mlx-lm {want}"
        assert all(f.finish_reason == "length" for f in finals), [f.finish_reason for f in finals]
        assert all(f.completion_tokens == MAX_TOKENS for f in finals)

    def test_single_row_batches_match_reference(self, tiny_llama, make_engine, references):
        engine = make_engine(tiny_llama, max_total_tokens=1024, max_running_requests=1)
        outputs, _ = run_all(engine, PROMPTS)
        assert outputs == references, "one-at-a-time serving must equal the reference"


class TestChunkedPrefill:
    def test_tiny_chunks_give_the_same_tokens(self, tiny_llama, make_engine, references):
        engine = make_engine(tiny_llama, max_total_tokens=1024, max_prefill_tokens=3)
        outputs, _ = run_all(engine, PROMPTS, late_index=2)
        for i, (got, want) in enumerate(zip(outputs, references, strict=True)):
            assert got == want, f"request {i} chunked by 3: {got} != {want}"


class TestRowGroups:
    def test_mixed_lengths_run_as_separate_forwards_and_match(
        self, tiny_llama, make_engine, monkeypatch
    ):
        gather_attention(monkeypatch)  # a packed backend runs every prefill as one forward
        prompts = [[(3 * i + k) % 250 + 1 for i in range(n)] for k, n in enumerate([2, 60, 3, 45])]
        refs = [greedy_reference(tiny_llama.model, p, MAX_TOKENS) for p in prompts]
        engine = make_engine(tiny_llama, max_total_tokens=1024, max_prefill_tokens=256)
        groups = spy_row_groups(engine)
        outputs, _ = run_all(engine, prompts)
        assert max(groups) > 1, f"the prefill was meant to be split, got groups {groups}"
        for i, (got, want) in enumerate(zip(outputs, refs, strict=True)):
            assert got == want, f"request {i} ({len(prompts[i])} tokens): {got} != {want}"

    def test_decode_rows_grouped_by_context_match(self, tiny_llama, make_engine, monkeypatch):
        # On the gather path a free extra forward splits decode rows by context length
        # (the real cost only splits far-apart contexts, which a tiny test cannot afford).
        gather_attention(monkeypatch)
        monkeypatch.setattr(row_groups, "DECODE_OVERHEAD_KEYS", 0)
        prompts = [[(5 * i + k) % 250 + 1 for i in range(n)] for k, n in enumerate([70, 2, 9, 33])]
        refs = [greedy_reference(tiny_llama.model, p, MAX_TOKENS) for p in prompts]
        engine = make_engine(tiny_llama, max_total_tokens=1024)
        groups = spy_row_groups(engine, phase="decode")
        outputs, _ = run_all(engine, prompts)
        assert max(groups) > 1, f"decode was meant to be split, got groups {groups}"
        for i, (got, want) in enumerate(zip(outputs, refs, strict=True)):
            assert got == want, f"request {i} ({len(prompts[i])} tokens): {got} != {want}"

    def test_ragged_decode_is_one_forward(self, tiny_llama, make_engine, monkeypatch):
        """With the native op nothing of a decode row is padded: no split, however far
        apart the contexts (and however cheap an extra forward)."""
        monkeypatch.setattr(row_groups, "DECODE_OVERHEAD_KEYS", 0)
        prompts = [[(5 * i + k) % 250 + 1 for i in range(n)] for k, n in enumerate([70, 2, 9, 33])]
        refs = [greedy_reference(tiny_llama.model, p, MAX_TOKENS) for p in prompts]
        engine = make_engine(tiny_llama, max_total_tokens=1024)
        if not engine.scheduler.plan.ragged_attention:
            pytest.skip(f"native attention off: {engine.executor.attention.path}")
        groups = spy_row_groups(engine, phase="decode")
        outputs, _ = run_all(engine, prompts)
        assert groups and max(groups) == 1, f"ragged decode was split: {groups}"
        assert outputs == refs, "ragged decode must equal mlx-lm"


class TestPackedSteps:
    def test_mixed_prefill_and_decode_rows_run_packed_and_match(
        self, tiny_llama, make_engine, monkeypatch
    ):
        """With ragged attention and no recurrent layer, prompts of any length and the
        decoding rows beside them run as one forward of one-token rows."""
        from mlxserve.mlx_backend import executor as executor_module

        packed = []
        real = executor_module.PackedBatchContext

        def counting(batch, rows=None):
            packed.append(int(batch.extend_lens.sum()))
            return real(batch, rows)

        monkeypatch.setattr(executor_module, "PackedBatchContext", counting)
        prompts = [[(3 * i + k) % 250 + 1 for i in range(n)] for k, n in enumerate([2, 60, 3, 45])]
        refs = [greedy_reference(tiny_llama.model, p, MAX_TOKENS) for p in prompts]
        engine = make_engine(tiny_llama, max_total_tokens=1024, max_prefill_tokens=256)
        if not engine.scheduler.plan.packed:
            pytest.skip(f"native attention off: {engine.executor.attention.path}")
        groups = spy_row_groups(engine)
        outputs, _ = run_all(engine, prompts, late_index=3)
        assert packed and max(groups) == 1, f"packed steps {packed}, groups {groups}"
        assert outputs == refs, "packed steps must equal mlx-lm"


class TestPreemption:
    def test_tiny_pool_preempts_and_output_is_unchanged(self, tiny_llama, make_engine):
        prompts = [[i + 1, i + 2, i + 3, i + 4] for i in range(0, 60, 10)]
        refs = [greedy_reference(tiny_llama.model, p, 24) for p in prompts]
        # 6 requests x 28 tokens do not fit in 64 slots: decoding must preempt.
        engine = make_engine(tiny_llama, max_total_tokens=64, max_running_requests=6)
        outputs, finals = run_all(engine, prompts, max_tokens=24)
        assert engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
        for i, (got, want) in enumerate(zip(outputs, refs, strict=True)):
            assert got == want, f"preempted request {i}: {got} != {want}"


class TestAbort:
    def test_abort_mid_decode_frees_slots(self, tiny_llama, make_engine):
        engine = make_engine(tiny_llama, max_total_tokens=256)
        col = Collector()
        submit(engine, col, "long", [1, 2, 3], max_tokens=400, temperature=0.0)
        submit(engine, col, "short", [4, 5], max_tokens=4, temperature=0.0)
        col.wait_tokens("long", 3, timeout=30)
        engine.abort("long")
        assert col.wait("long").finish_reason == "abort"
        assert col.wait("short").finish_reason == "length"
        assert engine.wait_idle(10)
        engine.check_integrity()
        assert engine.scheduler.cache.available() == 256, "abort must free every slot"

    def test_abort_of_unknown_or_finished_request_is_harmless(self, tiny_llama, make_engine):
        engine = make_engine(tiny_llama, max_total_tokens=128)
        col = Collector()
        submit(engine, col, "a", [1, 2], max_tokens=2, temperature=0.0)
        col.wait("a")
        engine.abort("a")
        engine.abort("never-existed")
        submit(engine, col, "b", [1, 2], max_tokens=2, temperature=0.0)
        assert col.wait("b").finish_reason == "length"


class TestLimits:
    def test_prompt_filling_the_context_fails_only_that_request(self, tiny_llama, make_engine):
        engine = make_engine(tiny_llama, max_total_tokens=64)
        col = Collector()
        submit(engine, col, "huge", list(range(1, 65)), max_tokens=4, temperature=0.0)
        submit(engine, col, "ok", [1, 2, 3], max_tokens=3, temperature=0.0)
        huge = col.wait("huge")
        assert huge.finish_reason == "error" and "context" in huge.error, huge
        assert col.wait("ok").finish_reason == "length"

    def test_generation_stops_at_the_context_limit(self, tiny_llama, make_engine):
        engine = make_engine(tiny_llama, max_total_tokens=16)
        col = Collector()
        submit(engine, col, "a", [1, 2, 3, 4], max_tokens=100, temperature=0.0)
        final = col.wait("a")
        assert final.finish_reason == "length"
        assert final.prompt_tokens + final.completion_tokens == 16, final

    def test_stop_token_ids_finish_with_stop(self, tiny_llama, make_engine, references):
        engine = make_engine(tiny_llama, max_total_tokens=128)
        col = Collector()
        stop_at = references[0][3]
        submit(
            engine, col, "a", PROMPTS[0], max_tokens=12, temperature=0.0, stop_token_ids=(stop_at,)
        )
        final = col.wait("a")
        assert final.finish_reason == "stop"
        assert col.tokens["a"] == references[0][: references[0].index(stop_at) + 1]
