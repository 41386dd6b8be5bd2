"""Logprobs (chat and completions shapes, streamed and not), echo, and usage details over
HTTP with the real server, engine and embedded SmolLM2."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.config import EngineConfig
from mlxserve.server.lifecycle.launch import BackgroundServer
from tests.ops_helpers import running_server, sse_payloads

ENGINE_CONFIG = EngineConfig(max_total_tokens=4096, max_running_requests=8)
HI = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
PROMPT = "The capital of France is"
PROMPT_TOKENS = ["The", " capital", " of", " France", " is"]


@pytest.fixture(scope="module")
def server(smollm: LoadedModel) -> Iterator[BackgroundServer]:
    with running_server(smollm, ENGINE_CONFIG) as srv:
        yield srv


@pytest.fixture(scope="module")
def chat_reply(client: openai.OpenAI, model: str):
    return client.chat.completions.create(
        model=model, messages=HI, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3
    )


@pytest.fixture(scope="module")
def echo_reply(client: openai.OpenAI, model: str):
    return client.completions.create(
        model=model, prompt=PROMPT, temperature=0, max_tokens=3, logprobs=2, echo=True
    )


def stream(server: BackgroundServer, path: str, body: dict[str, Any]) -> list[dict]:
    body = body | {"stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + path, json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        payloads = list(sse_payloads(response.iter_lines()))
    assert payloads[-1] == "[DONE]"
    return payloads[:-1]


class TestChatLogprobs:
    def test_structure_and_values(self, chat_reply) -> None:
        choice = chat_reply.choices[0]
        content = choice.logprobs.content
        assert len(content) == chat_reply.usage.completion_tokens == 6
        assert "".join(item.token for item in content) == choice.message.content
        for item in content:
            assert item.logprob <= 0
            assert bytes(item.bytes) == item.token.encode()
            top = [t.logprob for t in item.top_logprobs]
            assert len(top) == 3 and top == sorted(top, reverse=True), top
            # Greedy: the chosen token is the most likely one, with the same logprob.
            assert item.top_logprobs[0].token == item.token
            assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)

    def test_streamed_equals_non_streamed(self, server, model: str, chat_reply) -> None:
        body = {"model": model, "messages": HI, "temperature": 0, "max_tokens": 6}
        chunks = stream(
            server, "/v1/chat/completions", body | {"logprobs": True, "top_logprobs": 3}
        )
        items = [
            item
            for chunk in chunks
            for choice in chunk["choices"]
            if choice["logprobs"]
            for item in choice["logprobs"]["content"]
        ]
        expected = chat_reply.model_dump()["choices"][0]["logprobs"]["content"]
        assert [i["token"] for i in items] == [e["token"] for e in expected]
        got = [i["logprob"] for i in items]
        assert got == pytest.approx([e["logprob"] for e in expected], abs=1e-4)

    def test_off_by_default(self, client, model: str) -> None:
        reply = client.chat.completions.create(model=model, messages=HI, max_tokens=1)
        assert reply.choices[0].logprobs is None

    def test_logprobs_without_top(self, client, model: str) -> None:
        reply = client.chat.completions.create(
            model=model, messages=HI, temperature=0, max_tokens=2, logprobs=True
        )
        assert [item.top_logprobs for item in reply.choices[0].logprobs.content] == [[], []]


class TestCompletionLogprobs:
    def test_echo_puts_the_prompt_and_its_logprobs_first(self, echo_reply) -> None:
        choice = echo_reply.choices[0]
        assert choice.text.startswith(PROMPT) and choice.text[len(PROMPT) :] == " Paris.\n"
        lp = choice.logprobs
        assert lp.tokens[:5] == PROMPT_TOKENS and "".join(lp.tokens) == choice.text
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(v <= 0 for v in lp.token_logprobs[1:])
        assert len(lp.tokens) == 5 + echo_reply.usage.completion_tokens
        for token, offset in zip(lp.tokens, lp.text_offset, strict=True):
            assert choice.text[offset : offset + len(token)] == token
        rest = zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True)
        for token, value, top in rest:
            assert top[token] == pytest.approx(value), "the chosen token is in its top dict"
            assert 2 <= len(top) <= 3 and max(top.values()) <= 0
        # Greedy: the generated tokens are the most likely.
        for value, top in zip(lp.token_logprobs[5:], lp.top_logprobs[5:], strict=True):
            assert value == pytest.approx(max(top.values()))

    def test_prompt_logprob_equals_generated_logprob(self, client, model, echo_reply) -> None:
        """' Paris' scored as a prompt token and as a generated token: the same model logprob."""
        scored = client.completions.create(
            model=model, prompt=PROMPT + " Paris", max_tokens=0, echo=True, logprobs=0
        )
        lp = scored.choices[0].logprobs
        assert scored.choices[0].text == PROMPT + " Paris" and lp.tokens[-1] == " Paris"
        assert scored.usage.completion_tokens == 0
        generated = echo_reply.choices[0].logprobs.token_logprobs[5]
        assert lp.token_logprobs[-1] == pytest.approx(generated, abs=2e-3)
        prompt_part = echo_reply.choices[0].logprobs.token_logprobs[1:5]
        assert lp.token_logprobs[1:5] == pytest.approx(prompt_part, abs=2e-3)

    def test_without_echo(self, client, model: str) -> None:
        reply = client.completions.create(
            model=model, prompt=PROMPT, temperature=0, max_tokens=3, logprobs=1
        )
        lp = reply.choices[0].logprobs
        assert "".join(lp.tokens) == reply.choices[0].text == " Paris.\n"
        assert lp.text_offset == [0, 6, 7]
        assert None not in lp.token_logprobs

    def test_echo_without_logprobs(self, client, model: str) -> None:
        reply = client.completions.create(
            model=model, prompt=PROMPT, temperature=0, max_tokens=1, echo=True
        )
        assert reply.choices[0].text == PROMPT + " Paris"
        assert reply.choices[0].logprobs is None

    def test_streamed_equals_non_streamed(self, server, model: str, echo_reply) -> None:
        body = {"model": model, "prompt": PROMPT, "temperature": 0, "max_tokens": 3}
        chunks = stream(server, "/v1/completions", body | {"logprobs": 2, "echo": True})
        choices = [c for chunk in chunks for c in chunk["choices"]]
        assert choices[0]["text"].startswith(PROMPT), "the first chunk carries the prompt"
        expected = echo_reply.choices[0]
        assert "".join(c["text"] for c in choices) == expected.text
        parts = [c["logprobs"] for c in choices if c["logprobs"]]
        assert [t for p in parts for t in p["tokens"]] == expected.logprobs.tokens
        assert [o for p in parts for o in p["text_offset"]] == expected.logprobs.text_offset
        usage = chunks[-1]["usage"]
        assert usage["completion_tokens"] == 3 and usage["prompt_tokens"] == 5


class TestUsage:
    def test_cached_tokens_of_a_repeated_prompt(self, client, model: str) -> None:
        messages = [{"role": "user", "content": "Name a color, in one word, please."}]
        first = client.chat.completions.create(model=model, messages=messages, max_tokens=1)
        second = client.chat.completions.create(model=model, messages=messages, max_tokens=1)
        details = second.usage.prompt_tokens_details
        assert 0 < details.cached_tokens < second.usage.prompt_tokens, second.usage
        assert first.usage.prompt_tokens_details.cached_tokens < details.cached_tokens

    def test_include_usage_counts_every_choice(self, server, model: str) -> None:
        body = {"model": model, "prompt": PROMPT, "max_tokens": 2, "n": 2, "ignore_eos": True}
        chunks = stream(server, "/v1/completions", body)
        assert all(chunk["usage"] is None for chunk in chunks[:-1])
        assert chunks[-1]["choices"] == []
        usage = chunks[-1]["usage"]
        assert usage["completion_tokens"] == 4 and usage["total_tokens"] == 9, usage
        assert "cached_tokens" in usage["prompt_tokens_details"]


def test_engine_idle_and_slots_accounted(server: BackgroundServer) -> None:
    assert server.engine.wait_idle(60), "engine did not go idle"
    server.engine.check_integrity()
