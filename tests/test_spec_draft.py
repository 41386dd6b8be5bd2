"""Speculative decoding with a draft model (``--speculative-method draft``): exact output,
the draft kept in step with the served model's slots, its cost policy and its failures.

Greedy output with a draft must equal output without, token for token, whatever the
draft is: the served model itself (every proposal accepted: long runs, EOS / stop tokens /
max_tokens cut inside them), or a perturbed copy (runs rejected part way, slots rolled
back). Sampled output keeps the model's distribution (chi-square over many requests).
"""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler import draft, speculation
from mlxserve.scheduler.config import EngineConfig
from mlxserve.scheduler.request import Request
from mlxserve.scheduler.sampling_params import SamplingParams
from mlxserve.scheduler.speculation import Speculator
from mlxserve.server.lifecycle.draft_model import vocabulary_mismatch
from tests.conftest import greedy_reference, make_tiny_llama
from tests.test_spec_decode import (
    PROMPTS,
    assert_pairs_fit,
    assert_preemption_then_prefix_cache,
    pair_probs,
    run,
)
from tests.tiny_models import build_tiny_model

DRAFT = {"speculative_method": "draft", "draft_model": "test-draft"}


def perturbed(loaded: LoadedModel, scale: float, seed: int = 1) -> LoadedModel:
    """A copy of ``loaded``'s model with noise on every matrix: a draft that agrees with
    the served model on most tokens, not all."""
    model = make_tiny_llama().model
    mx.random.seed(seed)
    weights = [
        (name, w + scale * mx.random.normal(w.shape) * mx.sqrt(mx.var(w)) if w.ndim == 2 else w)
        for name, w in tree_flatten(loaded.model.parameters())
    ]
    model.load_weights(weights)
    mx.eval(model.parameters())
    return LoadedModel(model, loaded.tokenizer, "tiny-draft", {}, context_length=512)


@pytest.fixture(scope="module")
def noisy_draft(tiny_llama):
    return perturbed(tiny_llama, 0.2)


@pytest.fixture(scope="module")
def references(tiny_llama):
    return [greedy_reference(tiny_llama.model, p, 40) for p in PROMPTS]


def stats(engine):
    return engine.scheduler.speculator.stats


class TestGreedyExact:
    @pytest.mark.parametrize("k", [1, 3, 5])
    def test_a_perfect_draft(self, tiny_llama, make_engine, references, k):
        engine = make_engine(
            tiny_llama, draft=tiny_llama, max_total_tokens=1024, num_speculative_tokens=k, **DRAFT
        )
        got, _ = run(engine, PROMPTS, max_tokens=40, temperature=0.0)
        assert got == references, f"K={k}: output with the draft differs from mlx-lm's"
        s = stats(engine)
        assert s.num_drafts > 0, "no proposal was made"
        # The model as its own draft: only a near-tie decided apart by the two forwards'
        # different shapes (one token vs the verified run) can reject.
        assert s.num_accepted_tokens >= 0.9 * s.num_draft_tokens, f"its own draft: {s}"

    @pytest.mark.parametrize("k", [1, 3, 5])
    def test_a_draft_that_is_partly_wrong(
        self, tiny_llama, noisy_draft, make_engine, references, k
    ):
        engine = make_engine(
            tiny_llama, draft=noisy_draft, max_total_tokens=1024, num_speculative_tokens=k, **DRAFT
        )
        got, _ = run(engine, PROMPTS, max_tokens=40, temperature=0.0)
        assert got == references, f"K={k}: rejected proposals changed the output"
        s = stats(engine)
        assert 0 < s.num_accepted_tokens < s.num_draft_tokens, f"want accepts and rejects: {s}"

    def test_gather_attention_path(self, tiny_llama, noisy_draft, make_engine, monkeypatch):
        from tests.conftest import gather_attention

        gather_attention(monkeypatch)
        want = [greedy_reference(tiny_llama.model, p, 30) for p in PROMPTS]
        engine = make_engine(tiny_llama, draft=noisy_draft, max_total_tokens=1024, **DRAFT)
        assert not engine.plan.packed, "the gather path should not pack"
        got, _ = run(engine, PROMPTS, max_tokens=30, temperature=0.0)
        assert got == want, "padded verification with a draft changed the output"


class TestCutsInsideAcceptedRuns:
    def test_max_tokens_and_stop_token(self, tiny_llama, make_engine, references):
        engine = make_engine(
            tiny_llama, draft=tiny_llama, max_total_tokens=1024, num_speculative_tokens=5, **DRAFT
        )
        got, finals = run(engine, PROMPTS, max_tokens=7, temperature=0.0)
        assert got == [r[:7] for r in references], "max_tokens inside a run"
        assert all(f.finish_reason == "length" for f in finals)
        stop = references[0][9]
        cut = references[0].index(stop) + 1
        greedy = {"max_tokens": 40, "temperature": 0.0}
        got, finals = run(engine, PROMPTS[:1], stop_token_ids=[stop], **greedy)
        assert got[0] == references[0][:cut], "a stop token inside a run"
        assert finals[0].finish_reason == "stop"

    def test_eos_inside_a_run(self, tiny_llama, make_engine, references):
        eos = references[2][12]

        class EosTokenizer:
            eos_token_ids = [eos]

        loaded = LoadedModel(tiny_llama.model, EosTokenizer(), "tiny-eos", {}, 512)
        engine = make_engine(loaded, draft=loaded, max_total_tokens=1024, **DRAFT)
        got, finals = run(engine, PROMPTS[2:], max_tokens=40, temperature=0.0)
        want = greedy_reference(tiny_llama.model, PROMPTS[2], 40, eos={eos})
        assert got[0] == want and finals[0].finish_reason == "stop", "EOS inside a run"


class TestSlots:
    def test_tiny_pool_preemption_and_prefix_cache(
        self, tiny_llama, noisy_draft, make_engine, references
    ):
        # 3 requests of up to 100 tokens in 128 slots: preemption is certain.
        engine = make_engine(tiny_llama, draft=noisy_draft, max_total_tokens=128, **DRAFT)
        assert_preemption_then_prefix_cache(engine, references)
        assert stats(engine).num_accepted_tokens > 0

    def test_memory_budget_counts_the_draft_pools(self, tiny_llama, noisy_draft, make_engine):
        budget = 4 << 20
        alone = make_engine(tiny_llama, kv_memory_bytes=budget)
        both = make_engine(tiny_llama, draft=noisy_draft, kv_memory_bytes=budget, **DRAFT)
        # The draft has the served model's shapes: each slot costs twice the bytes.
        assert both.plan.full_tokens == alone.plan.full_tokens // 2, (
            f"{both.plan.full_tokens} slots with the draft vs {alone.plan.full_tokens} alone"
        )


class TestLazyDraft:
    def spy(self, engine):
        fed, forward = [], engine.draft.executor.forward

        def spy(batch):
            fed.append(batch.extend_lens.tolist())
            return forward(batch)

        engine.draft.executor.forward = spy
        return fed

    def test_rows_without_proposals_cost_the_draft_nothing(self, tiny_llama, make_engine):
        engine = make_engine(tiny_llama, draft=tiny_llama, max_total_tokens=1024, **DRAFT)
        fed = self.spy(engine)
        run(engine, PROMPTS, max_tokens=20, temperature=0.0, repetition_penalty=1.3)
        assert fed == [], f"the draft ran for rows that cannot take proposals: {fed}"

    def test_a_long_prompt_is_caught_up_in_chunks(self, tiny_llama, make_engine):
        prompt = [(7 * i) % 251 for i in range(300)]
        engine = make_engine(tiny_llama, draft=tiny_llama, max_total_tokens=1024, **DRAFT)
        fed = self.spy(engine)
        got, _ = run(engine, [prompt], max_tokens=20, temperature=0.0)
        assert got[0] == greedy_reference(tiny_llama.model, prompt, 20)
        # The prompt's first chunk (that step decodes without a proposal), then the rest of
        # the prompt and the two tokens decoded since (the first proposal), then one token
        # per further proposed token.
        assert fed[0] == [draft.CATCH_UP_TOKENS], fed[:3]
        assert fed[1] == [300 + 2 - draft.CATCH_UP_TOKENS], fed[:3]
        assert fed[2] == [1], fed[:3]
        assert stats(engine).num_accepted_tokens > 0


class TestSampled:
    def test_seeded_output_equals_plain(self, tiny_llama, make_engine, monkeypatch):
        # The model as its own draft proposes its argmax: accepted where the seeded draw
        # picks it, rejected elsewhere (every row proposes: this checks exactness, not the
        # policy).
        monkeypatch.setattr(speculation, "GAIN_MARGIN", 0.0)
        params = {"max_tokens": 30, "temperature": 0.5, "top_k": 5, "seed": 11}
        want, _ = run(make_engine(tiny_llama, max_total_tokens=1024), PROMPTS, **params)
        engine = make_engine(tiny_llama, draft=tiny_llama, max_total_tokens=1024, **DRAFT)
        got, _ = run(engine, PROMPTS, **params)
        assert got == want, "a seeded request changed with a draft model"
        assert stats(engine).num_accepted_tokens > 0

    def test_second_token_has_the_model_distribution(self, tiny_llama, make_engine, monkeypatch):
        """``(first, second)`` token pairs of many unseeded requests fit the model's top-k
        distribution, the second being verified against the draft's argmax (the model
        itself as draft: accepted with its probability, else resampled)."""
        prompt = [3, 1, 4, 1, 5]
        top_k, n = 4, 600
        p0, p1 = pair_probs(tiny_llama.model, prompt, top_k)
        # Every row proposes (the policy would stop after a few rejections): this checks
        # the verification's distribution, not the policy.
        monkeypatch.setattr(speculation, "GAIN_MARGIN", 0.0)
        engine = make_engine(
            tiny_llama, draft=tiny_llama, max_total_tokens=2048, max_running_requests=32, **DRAFT
        )
        got, _ = run(engine, [prompt] * n, max_tokens=3, temperature=1.0, top_k=top_k)
        s = stats(engine)
        assert 0 < s.num_accepted_tokens < s.num_drafts, f"want accepts and rejects: {s}"
        assert_pairs_fit(got, p0, p1, n)


class TestFailures:
    def test_a_failing_draft_turns_the_method_off(
        self, tiny_llama, noisy_draft, make_engine, references, caplog
    ):
        engine = make_engine(tiny_llama, draft=noisy_draft, max_total_tokens=1024, **DRAFT)
        draft = engine.draft
        forward, calls = draft.executor.forward, []

        def flaky(batch):
            calls.append(batch.batch_size)
            if len(calls) == 3:
                raise RuntimeError("draft out of memory")
            return forward(batch)

        draft.executor.forward = flaky
        with caplog.at_level(logging.ERROR):
            got, _ = run(engine, PROMPTS, max_tokens=40, temperature=0.0)
        assert got == references, "a failing draft changed the output"
        assert not draft.active and "speculative decoding is off" in caplog.text
        assert len(calls) == 3, "the draft ran again after it failed"

    def test_another_vocabulary_is_refused(self, tiny_llama, make_engine):
        class Vocab:
            def __init__(self, words):
                self.words = words

            def get_vocab(self):
                return {w: i for i, w in enumerate(self.words)}

        assert vocabulary_mismatch(Vocab("abc"), Vocab("abc")) is None
        assert "differ" in vocabulary_mismatch(Vocab("abc"), Vocab("abd"))
        other = LoadedModel(tiny_llama.model, Vocab("xyz"), "other", {}, 512)
        with pytest.raises(ValueError, match="cannot propose"):
            make_engine(
                LoadedModel(tiny_llama.model, Vocab("abc"), "t", {}, 512), draft=other, **DRAFT
            )

    def test_a_draft_with_sliding_layers_is_refused(self, tiny_llama, make_engine):
        model, _ = build_tiny_model("gemma3_text")
        draft = LoadedModel(model, tiny_llama.tokenizer, "gemma3", {}, 512)
        with pytest.raises(RuntimeError, match="full-attention layers only"):
            make_engine(tiny_llama, draft=draft, max_total_tokens=256, **DRAFT)

    def test_the_method_and_the_model_go_together(self):
        with pytest.raises(ValueError, match="go together"):
            EngineConfig(speculative_method="draft")
        with pytest.raises(ValueError, match="go together"):
            EngineConfig(draft_model="some/model")


def _row(i: int, acceptance: float) -> Request:
    req = Request(f"r{i}", list(range(10)), SamplingParams(max_tokens=100), lambda e: None)
    req.output_ids = [1]
    req.draft_acceptance = acceptance
    req.draft_weights = (5.0, 5.0)
    return req


class TestPolicy:
    def speculator(self, draft_seconds: float) -> Speculator:
        s = Speculator(EngineConfig(num_speculative_tokens=4, **DRAFT), 4096)
        for tokens in (1, 2, 4, 8, 1, 2, 4, 8):
            s.cost.observe(tokens, 0.1 + 0.005 * tokens)  # a = 100 ms, b = 5 ms a token
        s.draft_seconds = draft_seconds
        return s

    def test_a_cheap_draft_proposes_its_full_depth(self):
        rows = [_row(0, 0.9)]
        assert self.speculator(0.005).propose(rows, 100, 1) == 4
        assert rows[0].draft_ids == [-1] * 4, "placeholders until the draft fills them"

    def test_a_draft_slower_than_what_it_saves_proposes_nothing(self):
        rows = [_row(0, 0.9)]
        assert self.speculator(0.5).propose(rows, 100, 1) == 0
        assert rows[0].draft_ids == []

    def test_the_depth_follows_the_acceptance(self):
        low, high = [_row(0, 0.5)], [_row(0, 0.95)]
        self.speculator(0.01).propose(low, 100, 1)
        self.speculator(0.01).propose(high, 100, 1)
        assert 0 < len(low[0].draft_ids) < len(high[0].draft_ids), (low, high)


SMOL_QUESTIONS = [
    "Name a colour.",
    "Count from one to ten.",
    "Repeat exactly: the lighthouse keeper climbed the spiral stairs every evening at dusk.",
]
SMOL_SIZES = {"max_total_tokens": 1024, "max_running_requests": 4}
SMOL_GREEDY = {"max_tokens": 16, "temperature": 0.0}


@pytest.fixture(scope="module")
def smol_plain(smollm):
    """SmolLM2's prompts and their plain greedy outputs (no speculation)."""
    from mlxserve.server.lifecycle.engines import build_engine
    from tests.conftest import audit_and_stop

    tok = smollm.tokenizer
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        for q in SMOL_QUESTIONS
    ]
    engine = build_engine(smollm, EngineConfig(**SMOL_SIZES))
    engine.start()
    try:
        want, finals = run(engine, prompts, **SMOL_GREEDY)
    finally:
        audit_and_stop([engine])
    return prompts, want, [f.finish_reason for f in finals]


class TestSmolLM2:
    def test_a_draft_loaded_from_its_spec(self, smollm, smol_plain, make_engine):
        """SmolLM2 proposing for itself, loaded through ``--draft-model``'s path (the
        embedded GGUF: a real tokenizer for the vocabulary check): output equal to plain
        decoding, the draft's K/V in step (nearly every proposal accepted)."""
        from mlxserve.mlx_backend.loading.loader import embedded_gguf_path

        prompts, want, reasons = smol_plain
        engine = make_engine(
            smollm, speculative_method="draft", draft_model=embedded_gguf_path(), **SMOL_SIZES
        )
        assert engine.draft.name.startswith("SmolLM2-135M-Instruct"), engine.draft.name
        got, finals = run(engine, prompts, **SMOL_GREEDY)
        assert got == want, "output with SmolLM2's draft differs from plain decoding"
        assert [f.finish_reason for f in finals] == reasons
        s = engine.scheduler.speculator.stats
        assert s.num_accepted_tokens >= 0.9 * s.num_draft_tokens > 0, f"draft out of step: {s}"

    @pytest.mark.parametrize("method", ["ngram", "draft"])
    @pytest.mark.parametrize("k", [1, 5])
    def test_other_proposal_depths(self, smollm, smol_plain, make_engine, method, k):
        prompts, want, reasons = smol_plain
        config = {"speculative_method": method, "num_speculative_tokens": k, **SMOL_SIZES}
        if method == "draft":
            config |= {"draft_model": "smollm", "draft": smollm}
        else:
            config["prompt_lookup_min"] = 2
        engine = make_engine(smollm, **config)
        got, finals = run(engine, prompts, **SMOL_GREEDY)
        assert got == want, f"{method} K={k}: output differs from plain decoding"
        assert [f.finish_reason for f in finals] == reasons
        assert engine.scheduler.speculator.stats.num_drafts > 0, "nothing was proposed"


class TestPolicyPrior:
    def test_a_new_row_starts_from_the_drafts_recent_acceptance(self):
        s = Speculator(EngineConfig(num_speculative_tokens=3, **DRAFT), 4096)
        for tokens in (1, 2, 4, 8, 1, 2, 4, 8):
            s.cost.observe(tokens, 0.1 + 0.005 * tokens)
        s.draft_seconds = 0.001
        old = _row(0, 0.5)
        for _ in range(4):  # a draft that is always wrong
            s.verify(old, [7, 7, 7], np.array([1, 2, 3, 4]))
        fresh = _row(1, 0.5)
        fresh.draft_weights = (0.0, 0.0)
        assert s.propose([fresh], 100, 1) == 0, "a new row was proposed for"
        assert fresh.draft_acceptance == s.draft_acceptance < 0.2, fresh.draft_acceptance

    def test_until_a_verification_one_new_row_tries_the_draft(self):
        s = Speculator(EngineConfig(num_speculative_tokens=3, **DRAFT), 4096)
        rows = [_row(i, 0.5) for i in range(3)]
        for row in rows:
            row.draft_weights = (0.0, 0.0)
        s.propose(rows, 100, 3)
        assert [len(r.draft_ids) > 0 for r in rows].count(True) == 1, [r.draft_ids for r in rows]

    def test_a_poor_draft_is_probed_by_one_row_every_so_many_steps(self):
        s = Speculator(EngineConfig(num_speculative_tokens=3, **DRAFT), 4096)
        for tokens in (1, 2, 4, 8, 1, 2, 4, 8):
            s.cost.observe(tokens, 0.1 + 0.005 * tokens)
        rows = [_row(i, 0.05) for i in range(8)]
        probes = []
        for _ in range(2 * speculation.PROBE_AFTER_STEPS):
            s.propose(rows, 100, len(rows))
            probes.append(sum(len(r.draft_ids) for r in rows))
        assert sum(probes) == 2 and max(probes) == 1, probes
