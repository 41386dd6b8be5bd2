"""Per-request sampling features through the batched engine (tiny random llama): seeds,
penalties and logit bias against mlx-lm's ``generate_step``, min_tokens, and logprobs
against the log-softmax of mlx-lm's own single-sequence forward.

Every test's engine is checked for leaked slots on teardown (``make_engine``).
"""

from __future__ import annotations

from collections import defaultdict

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.outputs import RequestOutput
from tests.conftest import (
    Collector,
    gather_attention,
    greedy_reference,
    spy_row_groups,
    submit,
)

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16], [3], [100, 101, 102]]


class EventCollector(Collector):
    """A ``Collector`` that also keeps every event."""

    def __init__(self) -> None:
        super().__init__()
        self.events: dict[str, list[RequestOutput]] = defaultdict(list)

    def callback(self, request_id):
        inner = super().callback(request_id)

        def on_output(event: RequestOutput) -> None:
            self.events[request_id].append(event)
            inner(event)

        return on_output


def run(engine, requests: dict[str, tuple[list[int], dict]], col=None) -> EventCollector:
    """Submit every ``id: (prompt, params)`` at once and wait for all of them."""
    col = col or EventCollector()
    for rid, (prompt, params) in requests.items():
        submit(engine, col, rid, prompt, **params)
    for rid in requests:
        col.wait(rid)
    return col


def model_logprobs(model, tokens: list[int]) -> np.ndarray:
    """mlx-lm's own single-sequence forward with its KVCache: ``[T, V]`` log-softmax, row
    ``t`` the distribution of token ``t + 1``."""
    logits = model(mx.array([tokens]), cache=make_prompt_cache(model))[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def processed_reference(model, prompt: list[int], max_tokens: int, **settings) -> list[int]:
    """mlx-lm's greedy generation with its logits processors for ``settings``."""
    processors = make_logits_processors(**settings)
    steps = generate_step(
        mx.array(prompt),
        model,
        max_tokens=max_tokens,
        sampler=lambda x: mx.argmax(x, axis=-1),
        logits_processors=processors,
    )
    return [int(token) for token, _ in steps]


class TestSeed:
    def test_seeded_request_is_the_same_in_any_batch(self, tiny_llama, make_engine):
        engine = make_engine(tiny_llama, max_total_tokens=1024, max_prefill_tokens=8)
        seeded = {"temperature": 1.0, "seed": 1234, "max_tokens": 10}
        alone = run(engine, {"s": (PROMPTS[0], seeded)}).tokens["s"]
        # Other random and greedy rows, a different position in the batch, a chunked
        # neighbour, a second copy of the same request, and a different seed.
        crowd = {
            "r": (PROMPTS[2], {"temperature": 1.0, "max_tokens": 12}),
            "g": (PROMPTS[1], {"temperature": 0.0, "max_tokens": 6}),
            "s": (PROMPTS[0], seeded),
            "long": (list(range(20, 40)), {"temperature": 0.7, "max_tokens": 4}),
            "s2": (PROMPTS[0], seeded),
            "other": (PROMPTS[0], {**seeded, "seed": 99}),
        }
        col = run(engine, crowd)
        assert col.tokens["s"] == alone and col.tokens["s2"] == alone
        assert col.tokens["other"] != alone, "a different seed should give other tokens"

    def test_seeded_request_joining_a_running_batch(self, tiny_llama, make_engine):
        engine = make_engine(tiny_llama, max_total_tokens=1024)
        seeded = {"temperature": 1.0, "top_p": 0.9, "seed": 5, "max_tokens": 8}
        alone = run(engine, {"s": (PROMPTS[4], seeded)}).tokens["s"]
        col = EventCollector()
        for i, prompt in enumerate(PROMPTS[:3]):
            submit(engine, col, f"bg{i}", prompt, temperature=1.0, max_tokens=30)
        col.wait_tokens("bg0", 3)
        assert run(engine, {"s": (PROMPTS[4], seeded)}, col).tokens["s"] == alone
        for i in range(3):
            col.wait(f"bg{i}")


PENALTY_SETTINGS = {
    "rep": {"repetition_penalty": 1.5},
    "pres": {"presence_penalty": 2.0},
    "freq": {"frequency_penalty": 1.2},
    "bias": {"logit_bias": {5: 4.0, 17: 3.0}},
    "mixed": {"repetition_penalty": 1.2, "presence_penalty": 0.5, "logit_bias": {9: 2.0}},
}


class TestPenaltiesAndBias:
    def test_greedy_with_processors_equals_mlx_lm(self, tiny_llama, make_engine):
        # Greedy repeats prompt token 1 here: every penalty has something to act on.
        prompt = PROMPTS[0]
        max_tokens = 10
        engine = make_engine(tiny_llama, max_total_tokens=1024)
        requests = {
            name: (prompt, {"temperature": 0.0, "max_tokens": max_tokens, **settings})
            for name, settings in PENALTY_SETTINGS.items()
        }
        requests["plain"] = (prompt, {"temperature": 0.0, "max_tokens": max_tokens})
        col = run(engine, requests)
        plain = greedy_reference(tiny_llama.model, prompt, max_tokens)
        assert col.tokens["plain"] == plain
        for name, settings in PENALTY_SETTINGS.items():
            want = processed_reference(tiny_llama.model, prompt, max_tokens, **settings)
            assert col.tokens[name] == want, f"{name}: engine {col.tokens[name]} != {want}"
            assert want != plain, f"{name}: the setting should change the greedy output"

    def test_out_of_vocabulary_bias_is_ignored(self, tiny_llama, make_engine):
        engine = make_engine(tiny_llama, max_total_tokens=256)
        params = {"temperature": 1.0, "max_tokens": 4, "logit_bias": {10**6: 5.0, 42: 100.0}}
        assert run(engine, {"a": ([1, 2], params)}).tokens["a"] == [42] * 4


EOS = 200


@pytest.fixture(scope="module")
def tiny_llama_with_eos(tiny_llama):
    class Tokenizer:
        eos_token_ids = [EOS]

    return LoadedModel(tiny_llama.model, Tokenizer(), "tiny-llama-eos", {}, context_length=512)


class TestMinTokens:
    def test_eos_and_stop_ids_wait_for_min_tokens(self, tiny_llama_with_eos, make_engine):
        engine = make_engine(tiny_llama_with_eos, max_total_tokens=512)
        # The bias makes EOS (or the stop id) the certain choice as soon as it is allowed.
        eos = {"temperature": 1.0, "max_tokens": 12, "logit_bias": {EOS: 100.0}}
        stop = {"temperature": 0.0, "max_tokens": 12, "logit_bias": {33: 100.0}}
        col = run(
            engine,
            {
                "eos0": (PROMPTS[0], eos),
                "eos5": (PROMPTS[0], {**eos, "min_tokens": 5}),
                "stop3": (PROMPTS[1], {**stop, "min_tokens": 3, "stop_token_ids": (33,)}),
                "ignore": (PROMPTS[2], {**eos, "min_tokens": 2, "ignore_eos": True}),
            },
        )
        assert col.tokens["eos0"] == [EOS]
        assert len(col.tokens["eos5"]) == 6 and col.tokens["eos5"][-1] == EOS
        assert EOS not in col.tokens["eos5"][:5]
        assert len(col.tokens["stop3"]) == 4 and col.tokens["stop3"][-1] == 33
        assert col.final["stop3"].finish_reason == "stop"
        assert col.tokens["ignore"] == [EOS] * 12, "ignore_eos: EOS is neither banned nor a stop"


def check_entry(entry, token: int, dist: np.ndarray, k: int) -> None:
    """A ``TokenLogprob`` against the reference distribution ``dist [V]``."""
    assert entry.token_id == token
    assert abs(entry.logprob - dist[token]) < 1e-3, (entry.logprob, dist[token])
    assert len(entry.top) == k
    assert [t for t, _ in entry.top] == np.argsort(-dist)[:k].tolist()
    np.testing.assert_allclose([lp for _, lp in entry.top], np.sort(dist)[::-1][:k], atol=1e-3)


class TestLogprobs:
    def test_token_logprobs_are_the_models_raw_distribution(self, tiny_llama, make_engine):
        engine = make_engine(tiny_llama, max_total_tokens=1024)
        col = run(
            engine,
            {
                "greedy": (PROMPTS[0], {"temperature": 0.0, "max_tokens": 6, "logprobs": 5}),
                # Raw logprobs ignore temperature, penalties and bias.
                "warped": (
                    PROMPTS[2],
                    {
                        "temperature": 0.5,
                        "max_tokens": 6,
                        "logprobs": 0,
                        "presence_penalty": 1.0,
                        "logit_bias": {3: 2.0},
                    },
                ),
                "off": (PROMPTS[1], {"temperature": 1.0, "max_tokens": 6}),
                "top20": (PROMPTS[3], {"temperature": 1.0, "max_tokens": 3, "logprobs": 20}),
            },
        )
        assert all(e.logprobs is None for e in col.events["off"])
        for rid, k in (("greedy", 5), ("warped", 0), ("top20", 20)):
            prompt = {"greedy": PROMPTS[0], "warped": PROMPTS[2], "top20": PROMPTS[3]}[rid]
            tokens = col.tokens[rid]
            dists = model_logprobs(tiny_llama.model, prompt + tokens)
            entries = [lp for e in col.events[rid] for lp in e.logprobs]
            assert len(entries) == len(tokens)
            for j, (entry, token) in enumerate(zip(entries, tokens, strict=True)):
                check_entry(entry, token, dists[len(prompt) + j - 1], k)

    def test_prompt_logprobs_across_prefill_chunks(self, tiny_llama, make_engine):
        engine = make_engine(tiny_llama, max_total_tokens=1024, max_prefill_tokens=7)
        long_prompt = [(7 * i) % 250 + 1 for i in range(23)]  # 4 chunks of at most 7
        col = run(
            engine,
            {
                "long": (long_prompt, {"temperature": 0.0, "max_tokens": 3, "prompt_logprobs": 2}),
                "short": (PROMPTS[0], {"temperature": 1.0, "max_tokens": 2, "prompt_logprobs": 0}),
                "off": (PROMPTS[2], {"temperature": 0.0, "max_tokens": 3}),
                "one": ([5], {"temperature": 0.0, "max_tokens": 2, "prompt_logprobs": 1}),
            },
        )
        assert all(e.prompt_logprobs is None for e in col.events["off"])
        assert col.events["one"][0].prompt_logprobs == [None]
        for rid, prompt, k in (("long", long_prompt, 2), ("short", PROMPTS[0], 0)):
            first, *rest = col.events[rid]
            assert all(e.prompt_logprobs is None for e in rest), "only the first event"
            got = first.prompt_logprobs
            assert len(got) == len(prompt) and got[0] is None
            dists = model_logprobs(tiny_llama.model, prompt)
            for t in range(1, len(prompt)):
                check_entry(got[t], prompt[t], dists[t - 1], k)
        assert col.tokens["long"] == greedy_reference(tiny_llama.model, long_prompt, 3)

    @pytest.mark.parametrize("path", ["gather", "packed"])
    def test_prompt_logprobs_of_rows_in_grouped_or_packed_forwards(
        self, tiny_llama, make_engine, monkeypatch, path
    ):
        """A 40-token and two short prompts arrive together: on the gather path their
        prefill runs as two forwards (one per length group), packed as one forward of
        one-token rows; every prompt logprob lands on its row either way."""
        if path == "gather":
            gather_attention(monkeypatch)
        engine = make_engine(tiny_llama, max_total_tokens=1024, max_prefill_tokens=64)
        if path == "packed" and not engine.scheduler.plan.packed:
            pytest.skip(f"native attention off: {engine.executor.attention.path}")
        groups = spy_row_groups(engine)
        long_prompt = [(5 * i) % 250 + 1 for i in range(40)]
        prompts = {"long": long_prompt, "a": PROMPTS[0], "b": PROMPTS[2]}
        params = {"temperature": 0.0, "max_tokens": 2, "prompt_logprobs": 3}
        col = run(engine, {rid: (p, dict(params)) for rid, p in prompts.items()})
        if path == "gather":
            assert max(groups) > 1, f"the prefill was meant to be split, got groups {groups}"
        else:
            assert max(groups) == 1, f"a packed prefill is one forward, got groups {groups}"
        for rid, prompt in prompts.items():
            got = col.events[rid][0].prompt_logprobs
            dists = model_logprobs(tiny_llama.model, prompt)
            for t in range(1, len(prompt)):
                check_entry(got[t], prompt[t], dists[t - 1], 3)
            assert col.tokens[rid] == greedy_reference(tiny_llama.model, prompt, 2)


class TestSmolLM2Logprobs:
    def test_logprobs_and_prompt_logprobs_match_mlx_lm(self, smollm, make_engine):
        tok = smollm.tokenizer
        chat = [{"role": "user", "content": "Name a colour."}]
        prompt = tok.apply_chat_template(chat, add_generation_prompt=True)
        engine = make_engine(smollm, max_total_tokens=512, max_prefill_tokens=16)
        params = {"temperature": 0.0, "max_tokens": 4, "logprobs": 3, "prompt_logprobs": 2}
        col = run(engine, {"a": (prompt, params), "b": (prompt[:9], {"max_tokens": 4})})
        tokens = col.tokens["a"]
        dists = model_logprobs(smollm.model, prompt + tokens)
        first = col.events["a"][0]
        assert len(first.prompt_logprobs) == len(prompt) and first.prompt_logprobs[0] is None
        for t in range(1, len(prompt)):
            check_entry(first.prompt_logprobs[t], prompt[t], dists[t - 1], 2)
        entries = [lp for e in col.events["a"] for lp in e.logprobs]
        for j, (entry, token) in enumerate(zip(entries, tokens, strict=True)):
            check_entry(entry, token, dists[len(prompt) + j - 1], 3)
