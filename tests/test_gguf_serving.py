"""A Q4_K_M-style GGUF of a non-llama architecture served by the real ``mlxserve`` CLI.

The file is the tiny Gemma 3 of ``tests/gguf_fixtures.py``: Q4_K and Q6_K tensors with
Q5_0 / Q8_0 fallbacks for the 320-wide rows, a SentencePiece vocabulary, no chat template
(the built-in one is used). Concurrent chat completions through the OpenAI SDK must give
exactly the greedy continuations of the independent float reference (gguf-py's
dequantized weights in mlx-lm's own model).
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from mlxserve.mlx_backend.loading.gguf.reader import GGUFFile
from mlxserve.mlx_backend.loading.gguf.tokenizer import gguf_eos_token_ids, load_gguf_tokenizer
from tests.conftest import greedy_reference
from tests.gguf_fixtures import write_gguf
from tests.ops_helpers import cli_server

MAX_TOKENS = 10
QUESTIONS = ["What is the capital of France?", "Hello there!", "Numbers 12345 please"]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return write_gguf("gemma3", tmp_path_factory.mktemp("served") / "tiny-gemma3-Q4_K_M.gguf")


@pytest.fixture(scope="module")
def served(gemma):
    args = ["--model", str(gemma.path), "--max-total-tokens", "512"]
    with cli_server(args) as (_, url):
        yield openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)


def expected_token_bytes(gemma, question: str) -> list[list[int]]:
    """The reference's greedy tokens for the chat prompt, as the UTF-8 bytes of each token
    (byte-fallback pieces are single bytes: comparing text would hide which tokens)."""
    with GGUFFile(str(gemma.path)) as gf:
        metadata = gf.metadata
    tok = load_gguf_tokenizer(metadata, "gemma")
    text = tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    prompt = tok.encode(text, add_special_tokens=False)
    eos = set(gguf_eos_token_ids(metadata))
    tokens = greedy_reference(gemma.reference, prompt, MAX_TOKENS, eos=eos)
    out = []
    for piece in tok.convert_ids_to_tokens([t for t in tokens if t not in eos]):
        if re.fullmatch(r"<0x[0-9A-F]{2}>", piece):
            out.append([int(piece[3:5], 16)])
        else:
            out.append(list(piece.replace("\u2581", " ").encode()))
    return out


class TestServedGGUF:
    def test_types_are_a_q4_k_m_mix(self, gemma):
        kinds = set(gemma.types.values())
        assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0"} <= kinds, kinds

    def test_concurrent_chat_completions_equal_the_float_reference(self, served, gemma):
        model = served.models.list().data[0].id
        assert model == "tiny-gemma3-Q4_K_M", model

        def ask(question: str) -> list[list[int]]:
            reply = served.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": question}],
                temperature=0.0,
                max_tokens=MAX_TOKENS,
                logprobs=True,
            )
            return [entry.bytes for entry in reply.choices[0].logprobs.content]

        with ThreadPoolExecutor(len(QUESTIONS)) as pool:
            answers = list(pool.map(ask, QUESTIONS))
        for question, answer in zip(QUESTIONS, answers, strict=True):
            want = expected_token_bytes(gemma, question)
            assert len(set(map(tuple, want))) > 2, f"a degenerate reference: {want}"
            assert answer == want, f"{question!r}: served {answer}, reference {want}"
