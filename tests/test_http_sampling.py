"""Sampling parameters over HTTP, each shown to take effect: seed, penalties, logit_bias,
n, min_tokens, stop; and their validation. Real server, engine and embedded SmolLM2."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.config import EngineConfig
from mlxserve.server.lifecycle.launch import BackgroundServer
from tests.ops_helpers import COUNTING, running_server, sse_payloads
from tests.test_http_errors import assert_openai_error

ENGINE_CONFIG = EngineConfig(max_total_tokens=4096, max_running_requests=8)
HI = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
PROMPT = "The capital of France is"
PARIS, LONDON = 7042, 4528  # " Paris", " London"
# A prompt whose continuation varies when sampled at temperature 1.
OPEN_PROMPT = "My favourite animal is the"


@pytest.fixture(scope="module")
def server(smollm: LoadedModel) -> Iterator[BackgroundServer]:
    with running_server(smollm, ENGINE_CONFIG) as srv:
        yield srv


def complete(client: openai.OpenAI, model: str, prompt: str = PROMPT, **kwargs: Any) -> str:
    kwargs = {"temperature": 0, "max_tokens": 4} | kwargs
    return client.completions.create(model=model, prompt=prompt, **kwargs).choices[0].text


class TestSeed:
    def test_same_seed_same_text_whatever_the_batch(self, client, model: str) -> None:
        seeded = {"prompt": OPEN_PROMPT, "temperature": 1.0, "seed": 1234, "max_tokens": 8}
        alone = complete(client, model, **seeded)
        # The same request again, this time batched with other requests (seeded or not).
        others = [
            {"prompt": COUNTING, "temperature": 1.0, "max_tokens": 10},
            {"prompt": "Once upon a time", "temperature": 0.7, "seed": 5, "max_tokens": 6},
            seeded,
        ]
        with ThreadPoolExecutor(len(others)) as pool:
            results = list(pool.map(lambda kw: complete(client, model, **kw), others))
        assert results[-1] == alone, "a seeded request ignores what shares its batch"
        different = complete(client, model, **(seeded | {"seed": 99}))
        assert different != alone, "another seed draws other tokens"

    def test_n_choices_differ_and_each_is_reproducible(self, client, model: str) -> None:
        kwargs = {"prompt": OPEN_PROMPT, "temperature": 1.0, "seed": 7, "max_tokens": 6, "n": 3}
        kwargs["extra_body"] = {"ignore_eos": True}
        first = client.completions.create(model=model, **kwargs)
        assert [c.index for c in first.choices] == [0, 1, 2]
        texts = [c.text for c in first.choices]
        assert len(set(texts)) > 1, f"choices get distinct seeds: {texts}"
        assert first.usage.completion_tokens == 18
        # Choice i samples with seed + i: choice 1 is the n=1 answer of seed 8.
        assert complete(client, model, **(kwargs | {"n": 1, "seed": 8})) == texts[1]


class TestN:
    def test_streamed_n_choices(self, http: httpx.Client, model: str) -> None:
        body = {"model": model, "messages": HI, "max_tokens": 5, "n": 2, "temperature": 0}
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            payloads = list(sse_payloads(response.iter_lines()))
        assert payloads[-1] == "[DONE]"
        chunks = payloads[:-1]
        texts, finishes = {0: "", 1: ""}, {0: [], 1: []}
        for chunk in chunks[:-1]:
            [choice] = chunk["choices"]
            texts[choice["index"]] += choice["delta"].get("content") or ""
            if choice["finish_reason"]:
                finishes[choice["index"]].append(choice["finish_reason"])
        assert texts[0] == texts[1] and texts[0].startswith("Hello"), texts
        assert finishes == {0: ["length"], 1: ["length"]}
        usage = chunks[-1]["usage"]
        assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == 10, usage

    def test_closing_an_n_stream_aborts_every_choice(self, server, model: str) -> None:
        body = {"model": model, "prompt": COUNTING, "max_tokens": 300, "ignore_eos": True}
        body |= {"n": 3, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            next(lines)
        assert server.engine.wait_idle(10), "choices kept running after the client left"


class TestLogitBias:
    def test_minus_100_removes_the_greedy_token(self, client, model: str) -> None:
        assert complete(client, model, max_tokens=1) == " Paris"
        assert complete(client, model, max_tokens=1, logit_bias={str(PARIS): -100}) != " Paris"

    def test_plus_100_forces_a_token(self, client, model: str) -> None:
        text = complete(client, model, max_tokens=3, logit_bias={str(LONDON): 100})
        assert text == " London" * 3


class TestPenalties:
    # Greedy SmolLM2 answers " them, but I'm not sure I": penalties on the prompt's and
    # output's repeated tokens change that (" them, but they're ..."); a negative presence
    # penalty makes it repeat.
    PROMPT = "I like cats. I like"
    BASE = " them, but I'm"

    def test_greedy_base(self, client, model: str) -> None:
        assert complete(client, model, prompt=self.PROMPT, max_tokens=5) == self.BASE

    @pytest.mark.parametrize(
        "penalty",
        [{"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 1.5}],
        ids=lambda p: next(iter(p)),
    )
    def test_penalty_changes_the_greedy_continuation(self, client, model, penalty) -> None:
        text = complete(client, model, prompt=self.PROMPT, max_tokens=5, extra_body=penalty)
        assert text != self.BASE

    def test_negative_presence_penalty_repeats(self, client, model: str) -> None:
        text = complete(client, model, prompt=self.PROMPT, max_tokens=5, presence_penalty=-2)
        assert text.startswith(" cats. I like cats"), text


class TestLengthControls:
    def test_min_tokens_holds_off_eos(self, client, model: str) -> None:
        # Greedy SmolLM2 answers HI with 8 tokens then EOS ("Hello! How can I help you?").
        reply = client.chat.completions.create(
            model=model, messages=HI, temperature=0, max_tokens=12, extra_body={"min_tokens": 12}
        )
        assert reply.choices[0].message.content.startswith("Hello! How can I help you?")
        assert reply.usage.completion_tokens == 12 and reply.choices[0].finish_reason == "length"

    def test_stop_strings_do_not_apply_before_min_tokens(self, client, model: str) -> None:
        assert complete(client, model, max_tokens=4, stop=[" Paris"]) == ""
        text = complete(client, model, max_tokens=4, stop=[" Paris"], extra_body={"min_tokens": 1})
        assert text.startswith(" Paris"), text

    def test_four_stop_strings(self, client, model: str) -> None:
        stops = ["zzz", "yyy", "xxx", "."]
        assert complete(client, model, max_tokens=6, stop=stops) == " Paris"


class TestValidation:
    @pytest.mark.parametrize(
        ("fields", "param"),
        [
            ({"n": 0}, "n"),
            ({"n": 129}, "n"),
            ({"n": True}, "n"),
            ({"seed": "abc"}, "seed"),
            ({"seed": 2**64}, "seed"),
            ({"presence_penalty": 2.5}, "presence_penalty"),
            ({"frequency_penalty": -3}, "frequency_penalty"),
            ({"repetition_penalty": 0}, "repetition_penalty"),
            ({"repetition_penalty": 1e308}, "repetition_penalty"),  # inf as a float32
            ({"logit_bias": {"abc": 1}}, "logit_bias"),
            ({"logit_bias": {"5": 101}}, "logit_bias"),
            ({"logit_bias": {"5": "high"}}, "logit_bias"),
            ({"logit_bias": {"49152": 1}}, "logit_bias"),
            ({"logit_bias": {"-1": 1}}, "logit_bias"),
            ({"logit_bias": [1, 2]}, "logit_bias"),
            ({"min_tokens": -1}, "min_tokens"),
            ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
            ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
            ({"logprobs": 3}, "logprobs"),
            ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
            ({"top_logprobs": 2}, "top_logprobs"),
            ({"reasoning_effort": "high"}, "reasoning_effort"),
        ],
        ids=lambda v: repr(v)[:40],
    )
    def test_chat_400(self, http: httpx.Client, model: str, fields: dict, param: str) -> None:
        body = {"model": model, "messages": HI, "max_tokens": 4} | fields
        assert_openai_error(http.post("/v1/chat/completions", json=body), 400, param=param)

    @pytest.mark.parametrize(
        ("fields", "param"),
        [
            ({"logprobs": 21}, "logprobs"),
            ({"logprobs": True}, "logprobs"),
            ({"max_tokens": 0}, "echo"),
            ({"best_of": 2}, "best_of"),
            ({"echo": 5}, "echo"),
        ],
        ids=lambda v: repr(v)[:40],
    )
    def test_completion_400(self, http: httpx.Client, model: str, fields: dict, param) -> None:
        body = {"model": model, "prompt": "Hi", "max_tokens": 4} | fields
        assert_openai_error(http.post("/v1/completions", json=body), 400, param=param)

    def test_best_of_equal_to_n_is_accepted(self, http: httpx.Client, model: str) -> None:
        body = {"model": model, "prompt": "Hi", "max_tokens": 1, "n": 2, "best_of": 2}
        assert http.post("/v1/completions", json=body).status_code == 200

    def test_engine_idle_and_slots_accounted(self, server: BackgroundServer) -> None:
        assert server.engine.wait_idle(60), "engine did not go idle"
        server.engine.check_integrity()
