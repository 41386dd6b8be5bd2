"""Speculative decoding inside the continuous batch: exact output, rollback, policy, metrics.

Greedy output with proposals must equal output without, token for token; a seeded sampled
request too (the same noise per output position); unseeded sampled output must have the
model's distribution (chi-square). Proposals come from the n-gram proposer, or from an
oracle patched in (the reference's own continuation, optionally corrupted) so that long
accepted runs, EOS / stop tokens / max_tokens inside them, and rejections at chosen
positions happen for sure.
"""

from __future__ import annotations

import logging
import math

import mlx.core as mx
import numpy as np
import pytest

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler import speculation
from mlxserve.scheduler.ngram import propose_ngram
from tests.conftest import Collector, NoEosTokenizer, gather_attention, greedy_reference, submit
from tests.tiny_models import build_tiny_model

# Prompts that repeat themselves (the n-gram proposer finds matches) of different lengths.
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7],
    [40, 41, 42, 40, 41, 42, 40, 41],
    list(range(100, 140)) + list(range(100, 120)),
]


def run(engine, prompts, **params):
    col = Collector()
    for i, prompt in enumerate(prompts):
        submit(engine, col, str(i), prompt, **params)
    finals = [col.wait(str(i)) for i in range(len(prompts))]
    return [col.tokens[str(i)] for i in range(len(prompts))], finals


def spec_stats(engine):
    return engine.scheduler.speculator.stats


class Oracle:
    """A proposer that knows each prompt's reference continuation; ``wrong_at`` corrupts
    the proposal at those output positions (so verification rejects there)."""

    def __init__(self, prompts, outputs, wrong_at=()):
        self.refs = [(list(p), list(o)) for p, o in zip(prompts, outputs, strict=True)]
        self.wrong_at = set(wrong_at)

    def __call__(self, ids, min_n, max_n, k):
        ids = ids.tolist()
        for prompt, out in self.refs:
            if ids[: len(prompt)] == prompt and len(ids) >= len(prompt):
                start = len(ids) - len(prompt)
                draft = out[start : start + k]
                return [
                    (t + 1) % 256 if start + j in self.wrong_at else t for j, t in enumerate(draft)
                ]
        return []


class TestNgramProposer:
    def test_latest_occurrence_of_the_longest_suffix(self):
        ids = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 2, 3])
        # "2 3" occurs at 1 and 5; the latest is followed by 7 8 2; "1 2 3"... not a suffix.
        assert propose_ngram(ids, 2, 3, 3) == [7, 8, 2], "should continue the latest match"
        ids = np.array([4, 5, 6, 1, 5, 6, 2, 4, 5, 6])
        assert propose_ngram(ids, 1, 3, 2) == [1, 5], "the 3-gram match should win"

    def test_no_match_and_short_continuations(self):
        assert propose_ngram(np.array([1, 2, 3, 4]), 1, 3, 3) == [], "nothing repeats"
        assert propose_ngram(np.array([3, 1, 3]), 1, 2, 4) == [1, 3], "clipped at the end"
        assert propose_ngram(np.array([7]), 1, 3, 2) == [], "too short to match"


class TestGreedyExact:
    @pytest.mark.parametrize("k", [1, 3, 5])
    def test_ngram_matches_plain_decoding(self, tiny_llama, make_engine, k):
        plain = make_engine(tiny_llama, max_total_tokens=1024, max_running_requests=4)
        want, _ = run(plain, PROMPTS, max_tokens=48, temperature=0.0)
        engine = make_engine(
            tiny_llama,
            max_total_tokens=1024,
            max_running_requests=4,
            speculative_method="ngram",
            num_speculative_tokens=k,
            prompt_lookup_min=1,
        )
        got, _ = run(engine, PROMPTS, max_tokens=48, temperature=0.0)
        assert got == want, f"K={k}: speculative output differs from plain decoding"
        assert greedy_reference(tiny_llama.model, PROMPTS[1], 48) == want[1], "mlx-lm oracle"
        stats = spec_stats(engine)
        assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0, f"no speculation: {stats}"

    def test_gather_attention_path(self, tiny_llama, make_engine, monkeypatch, references):
        """Without the native op rows are padded, not packed: a row with proposals runs
        like a prefill chunk in its own row group."""
        gather_attention(monkeypatch)
        oracle = Oracle(PROMPTS, references, wrong_at={4, 11})
        engine = oracle_engine(make_engine, tiny_llama, monkeypatch, oracle)
        assert not engine.plan.packed, "the gather path should not pack"
        got, _ = run(engine, PROMPTS, max_tokens=40, temperature=0.0)
        assert got == references, "padded verification changed the output"
        assert spec_stats(engine).num_accepted_tokens > 60

    def test_sliding_window_model(self, make_engine):
        model, _ = build_tiny_model("gemma3_text")
        loaded = LoadedModel(model, NoEosTokenizer(), "gemma3_text", {}, context_length=512)
        want = [greedy_reference(model, p, 40) for p in PROMPTS]
        engine = make_engine(
            loaded, max_total_tokens=1024, max_running_requests=4, speculative_method="ngram"
        )
        got, _ = run(engine, PROMPTS, max_tokens=40, temperature=0.0)
        assert got == want, "sliding-window model: speculative output differs from mlx-lm"


@pytest.fixture
def references(tiny_llama):
    return [greedy_reference(tiny_llama.model, p, 40) for p in PROMPTS]


def oracle_engine(make_engine, loaded, monkeypatch, oracle, k=5, **config):
    monkeypatch.setattr(speculation, "propose_ngram", oracle)
    config = {"max_total_tokens": 1024, "max_running_requests": 4, **config}
    return make_engine(loaded, speculative_method="ngram", num_speculative_tokens=k, **config)


class TestAcceptedRuns:
    def test_perfect_and_corrupted_proposals(
        self, tiny_llama, make_engine, monkeypatch, references
    ):
        oracle = Oracle(PROMPTS, references, wrong_at={3, 9, 10, 22})
        engine = oracle_engine(make_engine, tiny_llama, monkeypatch, oracle)
        got, _ = run(engine, PROMPTS, max_tokens=40, temperature=0.0)
        assert got == references, "verification changed the output"
        stats = spec_stats(engine)
        assert stats.num_accepted_tokens > 60, f"the oracle's runs were not accepted: {stats}"
        assert stats.num_accepted_tokens < stats.num_draft_tokens, "corruptions accepted"
        assert stats.accepted_per_pos[4] > 0, f"no run accepted in full: {stats}"

    def test_stop_token_and_max_tokens_inside_a_run(
        self, tiny_llama, make_engine, monkeypatch, references
    ):
        engine = oracle_engine(make_engine, tiny_llama, monkeypatch, Oracle(PROMPTS, references))
        # A stop token first emitted at output position 6 (the oracle proposes past it).
        ref = references[2]
        stop = next(t for i, t in enumerate(ref) if i >= 6 and t not in ref[:i])
        cut = ref.index(stop)
        got, finals = run(
            engine, [PROMPTS[2]], max_tokens=40, temperature=0.0, stop_token_ids=(stop,)
        )
        assert got[0] == ref[: cut + 1], f"should stop at position {cut} on token {stop}"
        assert finals[0].finish_reason == "stop", finals[0]
        got, finals = run(engine, PROMPTS, max_tokens=13, temperature=0.0)
        assert got == [r[:13] for r in references], "max_tokens cut in the wrong place"
        assert all(f.finish_reason == "length" and f.completion_tokens == 13 for f in finals)

    def test_eos_inside_a_run(self, tiny_llama, make_engine, monkeypatch, references):
        ref = references[0]
        eos = next(t for i, t in enumerate(ref) if i >= 7 and t not in ref[:i])

        class EosTokenizer:
            eos_token_ids = [eos]

        loaded = LoadedModel(tiny_llama.model, EosTokenizer(), "tiny-eos", {}, context_length=512)
        engine = oracle_engine(make_engine, loaded, monkeypatch, Oracle(PROMPTS, references))
        got, finals = run(engine, [PROMPTS[0]], max_tokens=40, temperature=0.0)
        assert got[0] == ref[: ref.index(eos) + 1], "EOS did not end the run where it was"
        assert finals[0].finish_reason == "stop"

    def test_logprobs_of_every_accepted_token(
        self, tiny_llama, make_engine, monkeypatch, references
    ):
        plain = make_engine(tiny_llama, max_total_tokens=1024)
        _, want = run(plain, PROMPTS[:1], max_tokens=20, temperature=0.0, logprobs=2)
        oracle = Oracle(PROMPTS, references, wrong_at={5})
        engine = oracle_engine(make_engine, tiny_llama, monkeypatch, oracle)
        col = Collector()
        events = []
        cb = col.callback("0")
        engine.add_request(
            "0", PROMPTS[0], _params(max_tokens=20, logprobs=2), lambda e: (events.append(e), cb(e))
        )
        col.wait("0")
        assert any(len(e.new_token_ids) > 1 for e in events), "no multi-token event"
        lps = [lp for e in events for lp in (e.logprobs or [])]
        assert [lp.token_id for lp in lps] == col.tokens["0"], "a token without its logprob"
        ref_events = plain_logprobs(plain, PROMPTS[0])
        for got_lp, want_lp in zip(lps, ref_events, strict=True):
            assert math.isclose(got_lp.logprob, want_lp.logprob, abs_tol=1e-3), (got_lp, want_lp)
            assert [t for t, _ in got_lp.top] == [t for t, _ in want_lp.top]


def _params(**kw):
    from mlxserve.scheduler.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, **kw)


def plain_logprobs(engine, prompt):
    events = []
    col = Collector()
    cb = col.callback("p")
    engine.add_request(
        "p", prompt, _params(max_tokens=20, logprobs=2), lambda e: (events.append(e), cb(e))
    )
    col.wait("p")
    return [lp for e in events for lp in (e.logprobs or [])]


class TestRollback:
    def test_tiny_pool_preemption_and_prefix_cache(
        self, tiny_llama, make_engine, monkeypatch, references
    ):
        oracle = Oracle(PROMPTS, references, wrong_at={2, 4, 6, 8, 15})
        # 3 requests of up to 100 tokens in 128 slots: preemption is certain.
        engine = oracle_engine(make_engine, tiny_llama, monkeypatch, oracle, max_total_tokens=128)
        assert_preemption_then_prefix_cache(engine, references)


class TestIneligibleRows:
    @pytest.mark.parametrize(
        "params",
        [
            {"repetition_penalty": 1.3},
            {"min_tokens": 20},
            {"logit_bias": ((7, 2.0),)},
        ],
    )
    def test_rows_run_without_proposals(self, tiny_llama, make_engine, monkeypatch, params):
        oracle = Oracle(PROMPTS, [[1] * 40] * 3)
        engine = oracle_engine(make_engine, tiny_llama, monkeypatch, oracle)
        fed = []
        forward = engine.executor.forward

        def spy(batch):
            fed.append(batch.spec_lens)
            return forward(batch)

        engine.executor.forward = spy
        run(engine, PROMPTS[:1], max_tokens=24, temperature=0.0, **params)
        proposals = [0 if s is None else int(s.sum()) for s in fed]
        if "min_tokens" in params:
            assert sum(proposals[:20]) == 0, "proposals before min_tokens was reached"
            assert sum(proposals[20:]) > 0, "no proposals once min_tokens was reached"
        else:
            assert sum(proposals) == 0, f"{params}: the row got proposals"


class TestSampled:
    def test_seeded_output_equals_plain(self, tiny_llama, make_engine, monkeypatch, references):
        params = {"max_tokens": 30, "temperature": 0.8, "top_k": 5, "seed": 11}
        plain = make_engine(tiny_llama, max_total_tokens=1024)
        want, _ = run(plain, PROMPTS, **params)
        engine = oracle_engine(make_engine, tiny_llama, monkeypatch, Oracle(PROMPTS, want))
        got, _ = run(engine, PROMPTS, **params)
        assert got == want, "a seeded request changed with speculation"
        assert spec_stats(engine).num_accepted_tokens > 20

    def test_first_verified_token_has_the_model_distribution(
        self, tiny_llama, make_engine, monkeypatch
    ):
        """Over many unseeded requests, ``(first token, second token)`` must fit the
        model's top-k distribution, the second token being verified against a proposal of
        its context's most likely token (accepted with its probability, else resampled)."""
        prompt = [3, 1, 4, 1, 5]
        top_k, n = 4, 800
        p0, p1 = pair_probs(tiny_llama.model, prompt, top_k)
        firsts = np.flatnonzero(p0)
        proposals = {int(t): int(np.argmax(p1[int(t)])) for t in firsts}

        def oracle(ids, min_n, max_n, k):
            ids = ids.tolist()
            return [proposals[ids[-1]]] if len(ids) == len(prompt) + 1 else []

        engine = oracle_engine(
            make_engine, tiny_llama, monkeypatch, oracle, max_running_requests=32
        )
        # max_tokens=3: the decode step after the first token may propose one token.
        got, _ = run(engine, [prompt] * n, max_tokens=3, temperature=1.0, top_k=top_k)
        stats = spec_stats(engine)
        assert 0 < stats.num_accepted_tokens < stats.num_drafts, f"want accepts and rejects {stats}"
        assert_pairs_fit(got, p0, p1, n)


def assert_preemption_then_prefix_cache(engine, references) -> None:  # noqa: ANN001
    """``PROMPTS`` on an engine whose pool forces preemption give ``references``, and again
    once the prefix cache holds them (never a rejected token)."""
    got, _ = run(engine, PROMPTS, max_tokens=40, temperature=0.0)
    assert got == references, "output changed under preemption"
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    got, _ = run(engine, PROMPTS, max_tokens=40, temperature=0.0)
    assert got == references, "output changed when served from the prefix cache"
    assert engine.scheduler.prefix_cache_hits > 0, "the prefix cache was not used"


def pair_probs(model, prompt: list[int], top_k: int) -> tuple[np.ndarray, dict]:  # noqa: ANN001
    """The model's top-k distribution of the first token after ``prompt`` and, for each
    first token it allows, of the second."""
    p0 = _filtered_probs(model(mx.array([prompt]))[0, -1], top_k)
    p1 = {
        int(t): _filtered_probs(model(mx.array([prompt + [int(t)]]))[0, -1], top_k)
        for t in np.flatnonzero(p0)
    }
    return p0, p1


def assert_pairs_fit(got: list[list[int]], p0: np.ndarray, p1: dict, n: int) -> None:
    """The ``(first, second)`` tokens of ``n`` outputs fit ``p0(a) p1[a](b)`` (chi-square,
    cells expected fewer than 5 times pooled)."""
    expected = {
        (int(a), int(b)): n * p0[a] * p1[int(a)][b]
        for a in np.flatnonzero(p0)
        for b in np.flatnonzero(p1[int(a)])
    }
    observed = dict.fromkeys(expected, 0)
    for tokens in got:
        cell = tuple(tokens[:2])
        assert cell in observed, f"{cell} has probability 0 under the filter"
        observed[cell] += 1
    small = [c for c, e in expected.items() if e < 5]
    big = [c for c in expected if c not in small]
    exp = [expected[c] for c in big] + ([sum(expected[c] for c in small)] if small else [])
    obs = [observed[c] for c in big] + ([sum(observed[c] for c in small)] if small else [])
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True))
    critical = chi_square_critical(len(exp) - 1)
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}: {observed} vs {expected}"


def _filtered_probs(logits: mx.array, top_k: int) -> np.ndarray:
    """The model's distribution at temperature 1 after the top-k filter."""
    x = np.array(logits.astype(mx.float32)).astype(np.float64)
    keep = np.argsort(-x)[:top_k]
    p = np.zeros_like(x)
    p[keep] = np.exp(x[keep] - x[keep].max())
    return p / p.sum()


def chi_square_critical(df: int, z: float = 3.29) -> float:
    """The chi-square value exceeded with probability ~5e-4 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


class TestRecurrentModels:
    def test_speculation_disabled_with_a_message(self, make_engine, caplog):
        model, _ = build_tiny_model("mamba2")
        loaded = LoadedModel(model, NoEosTokenizer(), "mamba2", {}, context_length=512)
        with caplog.at_level(logging.WARNING, logger="mlxserve.scheduler.speculation"):
            engine = make_engine(loaded, max_total_tokens=256, speculative_method="ngram")
        assert engine.scheduler.speculator is None, "speculation must be off for recurrent"
        assert any("recurrent" in r.getMessage() for r in caplog.records), caplog.text
        got, _ = run(engine, PROMPTS[:1], max_tokens=8, temperature=0.0)
        assert got[0] == greedy_reference(model, PROMPTS[0], 8)


COPY_TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, lit the great "
    "lamp, and wrote the weather, the ships and the wind into his logbook."
)


class TestSmolLM2:
    def test_copying_prompts_match_plain_decoding(self, smollm, make_engine):
        tok = smollm.tokenizer
        questions = [
            f"Repeat this text exactly, word for word: {COPY_TEXT}",
            f"Repeat exactly: {COPY_TEXT[:70]}",
            "Name a colour.",
        ]
        prompts = [
            tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
            for q in questions
        ]
        plain = make_engine(smollm, max_total_tokens=1024, max_running_requests=4)
        want, want_finals = run(plain, prompts, max_tokens=28, temperature=0.0)
        eos = set(tok.eos_token_ids)
        assert greedy_reference(smollm.model, prompts[2], 28, eos) == want[2], "mlx-lm oracle"
        engine = make_engine(
            smollm,
            max_total_tokens=1024,
            max_running_requests=4,
            speculative_method="ngram",
            num_speculative_tokens=3,
        )
        got, finals = run(engine, prompts, max_tokens=28, temperature=0.0)
        assert got == want, "speculative output differs from plain decoding"
        reasons = [f.finish_reason for f in finals]
        assert reasons == [f.finish_reason for f in want_finals], reasons
        stats = spec_stats(engine)
        assert stats.num_accepted_tokens >= 20, f"copying should be accepted: {stats}"


def _decoding(i: int, acceptance: float):
    from mlxserve.scheduler.request import Request
    from mlxserve.scheduler.sampling_params import SamplingParams

    req = Request(str(i), [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_tokens=50), lambda e: None)
    req.output_ids = [3]
    req.draft_acceptance = acceptance
    req.draft_weights = (acceptance * 10, 10.0)  # a history of proposals behind the rate
    return req


class TestPolicy:
    def speculator(self):
        from mlxserve.scheduler.config import EngineConfig

        return speculation.Speculator(EngineConfig(speculative_method="ngram"), 512)

    def test_batch_one_proposes_at_low_acceptance_a_big_batch_does_not(self):
        spec = self.speculator()
        [alone] = rows = [_decoding(0, 0.2)]
        assert spec.propose(rows, 100, len(rows)) == 3 and alone.draft_ids == [1, 2, 3]
        rows = [_decoding(i, 0.2) for i in range(32)]
        assert spec.propose(rows, 1000, len(rows)) == 0, "batch 32 at 20% should not speculate"
        rows[0].draft_acceptance = 0.95
        assert spec.propose(rows, 1000, len(rows)) == 3, "a row accepting nearly all should"
        rows = [_decoding(i, 0.2) for i in range(32)]
        rows[0].draft_weights = (0.0, 0.0)
        assert spec.propose(rows, 1000, len(rows)) == 1, "a fresh row is probed at once"

    def test_a_passed_over_row_is_probed_with_one_token(self):
        spec = self.speculator()
        rows = [_decoding(i, 0.05) for i in range(32)]
        given = [spec.propose(rows, 1000, len(rows)) for _ in range(speculation.PROBE_AFTER_STEPS)]
        assert given[:-1] == [0] * (len(given) - 1) and given[-1] == 32, given
        assert all(r.draft_ids == [1] for r in rows), "a probe proposes one token"

    def test_slots_bound_the_proposals(self):
        spec = self.speculator()
        rows = [_decoding(i, 0.9) for i in range(4)]
        assert spec.propose(rows, 5, len(rows)) == 5, "only the free slots may be proposed"

    def test_step_cost_fit(self):
        cost = speculation.StepCost()
        assert cost.overhead_tokens == speculation.FORWARD_OVERHEAD_TOKENS, "no data: the prior"
        for n in [1, 2, 4, 6, 8, 3, 5, 7, 1, 4]:
            cost.observe(n, 0.1 + 0.004 * n)  # a = 25 tokens' worth
        assert abs(cost.overhead_tokens - 25.0) < 0.5, cost.overhead_tokens
        for n in [1, 2, 4, 6, 8, 3, 5, 7, 1, 4] * 7:
            cost.observe(n, 0.1 + 0.0001 * n)  # tokens nearly free: a noisy outlier
        assert cost.overhead_tokens == 2 * speculation.FORWARD_OVERHEAD_TOKENS, "not clamped"
