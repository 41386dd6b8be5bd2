"""The OpenAI-compatible API end to end: the real server, engine and embedded SmolLM2.

One server per module (uvicorn on a free port in a background thread); requests go through
the official ``openai`` client. Greedy and short, because the CPU decodes only a few
tokens per second.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.config import EngineConfig
from mlxserve.server.lifecycle.launch import BackgroundServer
from tests.ops_helpers import running_server

ENGINE_CONFIG = EngineConfig(max_total_tokens=4096, max_running_requests=8)
# A short system prompt keeps the prompt short (the default one is 31 tokens): prefill is slow.
HI = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
# Greedy SmolLM2 answers HI with "Hello! How can I help you?" and then its EOS.
HI_MAX_TOKENS = 16
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(smollm: LoadedModel) -> Iterator[BackgroundServer]:
    with running_server(smollm, ENGINE_CONFIG) as srv:
        yield srv


@pytest.fixture(scope="module")
def hi_reply(client: openai.OpenAI, model: str) -> openai.types.chat.ChatCompletion:
    """The non-streamed greedy answer to HI (shared: the CPU is slow)."""
    return client.chat.completions.create(
        model=model, messages=HI, temperature=0, max_tokens=HI_MAX_TOKENS, stream=False
    )


@pytest.fixture(scope="module")
def capital_completion(client: openai.OpenAI, model: str) -> openai.types.Completion:
    return client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=6)


def counts(usage) -> tuple[int, int, int]:
    """Token counts of a usage (its cached_tokens depend on what ran before)."""
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def stream_chat(client: openai.OpenAI, **kwargs) -> tuple[str, list, str | None]:
    """Concatenated content, all chunks, and the finish reason of a streamed chat."""
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert sum(r is not None for r in reasons) == 1, f"one finish chunk expected: {reasons}"
    return text, chunks, next(r for r in reasons if r is not None)


class TestModelsAndHealth:
    def test_models_lists_the_served_model(self, server: BackgroundServer, model: str) -> None:
        body = httpx.get(server.url + "/v1/models").json()
        assert body["object"] == "list"
        [card] = body["data"]
        assert card["id"] == model and card["object"] == "model", card
        assert card["owned_by"] == "mlxserve", card
        assert card["max_model_len"] == 4096, "context is capped by the 4096-slot pool"

    def test_openai_client_retrieves_the_model(self, client: openai.OpenAI, model: str) -> None:
        assert client.models.retrieve(model).id == model

    def test_health_ok(self, server: BackgroundServer) -> None:
        response = httpx.get(server.url + "/health")
        assert response.status_code == 200 and response.json() == {"status": "ok"}


class TestChatCompletion:
    def test_non_streamed_answer(self, hi_reply, smollm: LoadedModel, model: str) -> None:
        choice = hi_reply.choices[0]
        assert hi_reply.object == "chat.completion" and hi_reply.id.startswith("chatcmpl-")
        assert hi_reply.model == model
        assert choice.message.role == "assistant"
        assert choice.message.content.startswith("Hello"), choice.message.content
        assert "<|im_end|>" not in choice.message.content, "EOS text must not leak"
        assert choice.finish_reason == "stop", "greedy SmolLM2 ends this reply with EOS"
        prompt_len = len(smollm.tokenizer.apply_chat_template(HI, add_generation_prompt=True))
        usage = hi_reply.usage
        assert usage.prompt_tokens == prompt_len, (usage, prompt_len)
        assert 0 < usage.completion_tokens < HI_MAX_TOKENS, usage
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    def test_streamed_text_equals_non_streamed(self, client, model: str, hi_reply) -> None:
        text, chunks, reason = stream_chat(
            client,
            model=model,
            messages=HI,
            temperature=0,
            max_tokens=HI_MAX_TOKENS,
            stream_options={"include_usage": True},
        )
        assert chunks[0].choices[0].delta.role == "assistant", "first delta carries the role"
        assert text == hi_reply.choices[0].message.content
        assert reason == hi_reply.choices[0].finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage is not None, "usage chunk last"
        assert counts(chunks[-1].usage) == counts(hi_reply.usage)
        assert len({c.id for c in chunks}) == 1, "every chunk has the request's id"

    def test_length_limit(self, client, model: str, hi_reply) -> None:
        reply = client.chat.completions.create(
            model=model, messages=HI, temperature=0, max_completion_tokens=2
        )
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage.completion_tokens == 2
        assert hi_reply.choices[0].message.content.startswith(reply.choices[0].message.content)


class TestStopStrings:
    # "can I he" spans the tokens " can", " I" and " help".
    STOP = ["can I he", "never generated"]

    def test_non_streamed_stop(self, client, model: str, hi_reply) -> None:
        reply = client.chat.completions.create(
            model=model, messages=HI, temperature=0, max_tokens=HI_MAX_TOKENS, stop=self.STOP
        )
        full = hi_reply.choices[0].message.content
        assert reply.choices[0].message.content == full[: full.index("can I he")]
        assert reply.choices[0].finish_reason == "stop"
        assert reply.usage.completion_tokens < hi_reply.usage.completion_tokens

    def test_streamed_stop_never_emits_stop_text(self, client, model: str, hi_reply) -> None:
        text, chunks, reason = stream_chat(
            client, model=model, messages=HI, temperature=0, max_tokens=16, stop=self.STOP
        )
        full = hi_reply.choices[0].message.content
        assert text == full[: full.index("can I he")], (text, full)
        assert reason == "stop"
        assert not any("can I" in (c.choices[0].delta.content or "") for c in chunks)


class TestCompletions:
    def test_non_streamed(self, capital_completion, model: str) -> None:
        assert capital_completion.object == "text_completion"
        assert capital_completion.id.startswith("cmpl-") and capital_completion.model == model
        choice = capital_completion.choices[0]
        assert "Paris" in choice.text, choice.text
        assert choice.finish_reason == "length"
        assert capital_completion.usage.completion_tokens == 6
        assert capital_completion.usage.prompt_tokens > 0

    def test_streamed_equals_non_streamed(self, client, model: str, capital_completion) -> None:
        chunks = list(
            client.completions.create(
                model=model,
                prompt=PROMPT,
                temperature=0,
                max_tokens=6,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert text == capital_completion.choices[0].text
        assert [r for r in reasons if r] == ["length"], reasons
        assert counts(chunks[-1].usage) == counts(capital_completion.usage)

    def test_token_id_prompt_equals_text_prompt(
        self, client, model: str, smollm: LoadedModel, capital_completion
    ) -> None:
        ids = smollm.tokenizer.encode(PROMPT)
        reply = client.completions.create(model=model, prompt=ids, temperature=0, max_tokens=6)
        assert reply.choices[0].text == capital_completion.choices[0].text
        assert reply.usage.prompt_tokens == len(ids)


class TestClientDisconnect:
    """A client that goes away aborts its request: the engine goes idle long before the
    200 requested tokens (EOS ignored) could have been generated (~1 min on this CPU)."""

    def _assert_aborted_soon(self, server: BackgroundServer) -> None:
        assert server.engine.wait_idle(10), "request kept running after the client left"

    def test_closed_stream_aborts(self, server: BackgroundServer, model: str) -> None:
        body = {"model": model, "messages": HI, "max_tokens": 200, "ignore_eos": True}
        url = server.url + "/v1/chat/completions"
        with httpx.stream("POST", url, json=body | {"stream": True}, timeout=60) as response:
            assert response.status_code == 200
            data = (line for line in response.iter_lines() if line.startswith("data: "))
            first, second = next(data), next(data)  # the role chunk, then the first token
            assert '"role":"assistant"' in first and '"content"' in second, (first, second)
        self._assert_aborted_soon(server)

    def test_dropped_non_streamed_request_aborts(self, server, model: str) -> None:
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": 200}
        body["ignore_eos"] = True
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body, timeout=1.5)
        self._assert_aborted_soon(server)


class TestNoLeak:
    def test_engine_idle_and_slots_accounted(self, server: BackgroundServer) -> None:
        assert server.engine.wait_idle(60), "engine did not go idle"
        server.engine.check_integrity()
