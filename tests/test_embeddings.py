"""Embeddings of a decoder model (``task=embed``, Qwen3-Embedding style): prefill-only rows
through the engine's batching and prefix cache, the final normed hidden state of each
input's last token, L2-normalized; equal (cosine > 0.9999) to the same model run directly,
without a cache, on each input alone. OpenAI's ``/v1/embeddings`` shapes (strings, token
ids, base64, ``dimensions``, usage, errors), and the 400s of a model asked for the wrong
task."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import mlx.core as mx
import numpy as np
import openai
import pytest

from mlxserve.mlx_backend.loading.loader import load_model
from mlxserve.scheduler.sampling_params import SamplingParams
from mlxserve.server.config import ServerConfig
from mlxserve.server.lifecycle.launch import BackgroundServer
from mlxserve.server.models.declarations import ModelDeclaration
from tests.conftest import Collector, greedy_reference, submit
from tests.ops_helpers import scrape
from tests.test_multi_model import serve
from tests.tiny_models import build_tiny_model_dir

# Ignored by the engine for embedding requests.
_PARAMS = SamplingParams(max_tokens=1)
TEXTS = ["hello", "the cat sat on the mat", "a dog runs there", "hello there world " * 6]


def reference(model, ids: list[int]) -> np.ndarray:  # noqa: ANN001
    """The input alone through the model, no cache: its last token's normed hidden state."""
    hidden = model.model(mx.array([ids]))[0, -1]
    vector = np.array(hidden.astype(mx.float32))
    return vector / np.linalg.norm(vector)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("embedding-models")
    return {
        "embed": build_tiny_model_dir("qwen3", root / "qwen3-embed", seed=3),
        "chat": build_tiny_model_dir("llama", root / "llama-chat"),
    }


@pytest.fixture(scope="module")
def direct(model_dirs: dict[str, Path]):  # noqa: ANN201
    """The embedding model loaded as mlxserve loads it, to run it directly."""
    return load_model(str(model_dirs["embed"]), task="embed")


@pytest.fixture(scope="module")
def server(model_dirs: dict[str, Path]) -> Iterator[BackgroundServer]:
    declarations = [
        ModelDeclaration(str(model_dirs["embed"]), ("emb",), task="embed", matryoshka=True),
        ModelDeclaration(str(model_dirs["chat"]), ("chat",)),
    ]
    server, _ = serve(declarations, ServerConfig(port=0))
    try:
        yield server
    finally:
        server.stop()  # AuditingLoader: every engine accounts for every slot at unload


def embed(http: httpx.Client, **body) -> httpx.Response:  # noqa: ANN003
    return http.post("/v1/embeddings", json={"model": "emb", **body})


class TestDecoderEmbeddings:
    def test_batched_mixed_length_inputs_equal_the_model_alone(self, client, direct) -> None:  # noqa: ANN001
        answer = client.embeddings.create(model="emb", input=TEXTS)
        assert [d.index for d in answer.data] == list(range(len(TEXTS)))
        tokens = 0
        for text, data in zip(TEXTS, answer.data, strict=True):
            ids = list(direct.tokenizer.encode(text))
            tokens += len(ids)
            want = reference(direct.model, ids)
            got = np.array(data.embedding)
            assert got.shape == want.shape, (got.shape, want.shape)
            assert cosine(got, want) > 0.9999, (text, cosine(got, want))
            assert abs(np.linalg.norm(got) - 1) < 1e-5, "L2-normalized"
        assert answer.usage.prompt_tokens == answer.usage.total_tokens == tokens, answer.usage
        assert answer.model == "emb"

    def test_token_id_inputs(self, http: httpx.Client, direct) -> None:  # noqa: ANN001
        ids = [[5, 6, 7, 8], [40, 41], [9] * 12]
        one = embed(http, input=ids[0]).json()["data"]
        many = embed(http, input=ids).json()["data"]
        assert len(one) == 1 and len(many) == 3, (one, many)
        assert cosine(one[0]["embedding"], reference(direct.model, ids[0])) > 0.9999
        for row, data in zip(ids, many, strict=True):
            assert cosine(data["embedding"], reference(direct.model, row)) > 0.9999, row

    def test_a_repeated_input_hits_the_prefix_cache(self, http: httpx.Client, server) -> None:  # noqa: ANN001
        text = "the same words again and again, long enough to be worth caching " * 2
        hits = ("mlxserve:prefix_cache_hits_total", frozenset({("model_name", "emb")}))
        first = np.array(embed(http, input=text).json()["data"][0]["embedding"])
        before = scrape(server.url).get(hits, 0.0)
        second = np.array(embed(http, input=text).json()["data"][0]["embedding"])
        after = scrape(server.url).get(hits, 0.0)
        assert after - before > 10, (before, after)
        assert np.allclose(first, second, atol=1e-5), np.abs(first - second).max()

    def test_base64_is_the_float32_bytes(self, http: httpx.Client) -> None:
        floats = embed(http, input="a dog runs").json()["data"][0]["embedding"]
        encoded = embed(http, input="a dog runs", encoding_format="base64").json()
        decoded = np.frombuffer(base64.b64decode(encoded["data"][0]["embedding"]), "<f4")
        assert np.allclose(decoded, floats, atol=1e-6), (decoded[:4], floats[:4])

    def test_dimensions_truncate_then_renormalize(self, http: httpx.Client, direct) -> None:  # noqa: ANN001
        data = embed(http, input="a dog runs", dimensions=16).json()["data"][0]["embedding"]
        full = reference(direct.model, list(direct.tokenizer.encode("a dog runs")))
        want = full[:16] / np.linalg.norm(full[:16])
        assert len(data) == 16 and cosine(data, want) > 0.9999, len(data)
        too_many = embed(http, input="a dog runs", dimensions=full.size + 1)
        assert too_many.status_code == 400, too_many.text
        assert too_many.json()["error"]["param"] == "dimensions", too_many.text

    def test_the_engine_accounts_for_every_slot(self, server) -> None:  # noqa: ANN001
        engine = server.app.state.server.models.get("emb").engine
        assert engine.wait_idle(30), "idle"
        engine.check_integrity()


class TestBadInput:
    @pytest.mark.parametrize(
        "body",
        [
            {"input": ""},
            {"input": []},
            {"input": ["fine", ""]},
            {"input": [[]]},
            {"input": [1, "two"]},
            {"input": [True, False]},
            {"input": [10**9]},
            {"input": [-1]},
            {"input": "x", "encoding_format": "hex"},
            {"input": "x", "dimensions": 0},
            {"input": "x", "unknown": 1},
            {"input": ["word"] * 2049},
            {"input": list(range(300)) * 20},
        ],
    )
    def test_is_a_400_in_openai_shape(self, http: httpx.Client, body: dict) -> None:
        response = embed(http, **body)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["type"] == "invalid_request_error", response.text

    def test_an_undeclared_model_is_a_404(self, http: httpx.Client) -> None:
        response = http.post("/v1/embeddings", json={"model": "/tmp/x", "input": "hi"})
        assert response.status_code == 404, response.text


class TestWrongTask:
    def test_a_chat_model_asked_for_embeddings(self, client) -> None:  # noqa: ANN001
        with pytest.raises(openai.BadRequestError) as raised:
            client.embeddings.create(model="chat", input="hello")
        assert "not an embedding model" in str(raised.value), raised.value

    @pytest.mark.parametrize(
        "path, body",
        [
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ("/v1/completions", {"prompt": "hi"}),
            ("/v1/responses", {"input": "hi"}),
        ],
    )
    def test_an_embedding_model_asked_to_generate(self, http: httpx.Client, path, body) -> None:  # noqa: ANN001
        response = http.post(path, json={"model": "emb", **body})
        assert response.status_code == 400, response.text
        assert "is an embedding model" in response.json()["error"]["message"], response.text

    def test_anthropic_messages_get_their_shape(self, server) -> None:  # noqa: ANN001
        client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
        with pytest.raises(anthropic.BadRequestError) as raised:
            client.messages.create(
                model="emb", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
            )
        assert "is an embedding model" in str(raised.value), raised.value

    def test_tokenize_serves_an_embedding_model(self, http: httpx.Client) -> None:
        response = http.post("/tokenize", json={"model": "emb", "prompt": "hello"})
        assert response.status_code == 200 and response.json()["count"] > 0, response.text


class TestEngineEmbeddings:
    """Embedding rows and generation rows in one engine (the executor projects and
    samples only when some row generates)."""

    def test_mixed_with_generation(self, tiny_llama, make_engine) -> None:  # noqa: ANN001
        engine = make_engine(tiny_llama, max_total_tokens=256, max_running_requests=6)
        collector = Collector()
        prompts = [[1, 2, 3, 4, 5], list(range(10, 31)), [7, 7, 7]]
        submit(engine, collector, "gen", [3, 1, 4, 1, 5], max_tokens=5, temperature=0)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"e{i}", prompt, _PARAMS, collector.callback(f"e{i}"), embed=True)
        for i, prompt in enumerate(prompts):
            event = collector.wait(f"e{i}")
            assert event.finish_reason == "stop" and event.prompt_tokens == len(prompt), event
            assert collector.tokens[f"e{i}"] == [], "an embedding request samples nothing"
            want = reference(tiny_llama.model, prompt)
            assert cosine(event.embedding, want) > 0.9999, (i, cosine(event.embedding, want))
        collector.wait("gen")
        want = greedy_reference(tiny_llama.model, [3, 1, 4, 1, 5], 5)
        assert collector.tokens["gen"] == want, (collector.tokens["gen"], want)

    def test_an_input_as_long_as_the_context(self, tiny_llama, make_engine) -> None:  # noqa: ANN001
        engine = make_engine(tiny_llama, max_total_tokens=64, max_running_requests=2)
        collector = Collector()
        context = engine.max_context_len
        engine.add_request("fits", [5] * context, _PARAMS, collector.callback("fits"), embed=True)
        engine.add_request(
            "over", [5] * (context + 1), _PARAMS, collector.callback("over"), embed=True
        )
        assert collector.wait("fits").finish_reason == "stop"
        over = collector.wait("over")
        assert over.finish_reason == "error" and "longer than the context" in over.error, over
