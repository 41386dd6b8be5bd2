"""Unit tests of the logprobs shapes (server/api/openai/logprobs.py) and the token texts they
show (server/serving/token_logprobs.py)."""

from __future__ import annotations

import math

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.outputs import TokenLogprob
from mlxserve.server.api.openai.logprobs import chat_logprobs, completion_logprobs
from mlxserve.server.serving.token_logprobs import (
    MIN_LOGPROB,
    TokenEntry,
    TokenTexts,
    clamp,
    prompt_entries,
)


class SentencePieceLike:
    """Pieces with "▁" for spaces and <0xNN> byte tokens, as Llama/Mistral tokenizers."""

    pieces = {0: "▁Hello", 1: "<0xE2>", 2: "<0x98>", 3: "<0x95>", 4: "world"}

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return self.pieces[token_id]

    def decode(self, ids: list[int]) -> str:
        assert ids == [4], "only pieces without a space or byte marker are decoded"
        return "world"


def test_byte_level_tokens(smollm: LoadedModel) -> None:
    texts = TokenTexts(smollm.tokenizer)
    [space_cap] = smollm.tokenizer.encode(" capital")
    assert texts.of(space_cap) == (" capital", list(b" capital"))
    first, second = smollm.tokenizer.encode(" 😀")
    assert bytes(texts.of(first)[1] + texts.of(second)[1]) == " 😀".encode()
    assert texts.of(second)[0] == "bytes:\\x80", "not UTF-8 on its own: escaped like OpenAI"
    assert texts.of(2) == ("<|im_end|>", list(b"<|im_end|>")), "special tokens by name"


def test_sentencepiece_tokens() -> None:
    texts = TokenTexts(SentencePieceLike())
    assert texts.of(0) == (" Hello", list(b" Hello"))
    assert texts.of(1) == ("bytes:\\xe2", [0xE2])
    assert b"".join(bytes(texts.of(i)[1]) for i in (1, 2, 3)).decode() == "☕"
    assert texts.of(4)[0] == "world"


def test_clamp() -> None:
    assert clamp(-math.inf) == MIN_LOGPROB and clamp(math.nan) == MIN_LOGPROB
    assert clamp(-0.5) == -0.5


def test_chat_shape() -> None:
    texts = TokenTexts(SentencePieceLike())
    entry = TokenEntry(0, -0.25, ((0, -0.25), (4, -1.5), (1, -math.inf)), 0)
    [item] = chat_logprobs([entry], texts, top_n=2)
    assert item.model_dump() == {
        "token": " Hello",
        "logprob": -0.25,
        "bytes": list(b" Hello"),
        "top_logprobs": [
            {"token": " Hello", "logprob": -0.25, "bytes": list(b" Hello")},
            {"token": "world", "logprob": -1.5, "bytes": list(b"world")},
        ],
    }


def test_completion_shape_adds_the_sampled_token_and_offsets() -> None:
    texts = TokenTexts(SentencePieceLike())
    entries = [TokenEntry(4, -3.0, ((0, -0.1),), 0), TokenEntry(0, -0.1, ((0, -0.1),), 5)]
    shape = completion_logprobs(entries, texts, top_n=1, offset=10)
    assert shape.model_dump() == {
        "tokens": ["world", " Hello"],
        "token_logprobs": [-3.0, -0.1],
        "top_logprobs": [{" Hello": -0.1, "world": -3.0}, {" Hello": -0.1}],
        "text_offset": [10, 15],
    }


def test_prompt_entries(smollm: LoadedModel) -> None:
    ids = list(smollm.tokenizer.encode("The capital of France"))
    logprobs = [None] + [TokenLogprob(t, -1.0, ((t, -1.0),)) for t in ids[1:]]
    entries = prompt_entries(smollm.tokenizer, ids, logprobs)
    assert [e.text_offset for e in entries] == [0, 3, 11, 14]
    assert entries[0].logprob is None and entries[1].logprob == -1.0
    shape = completion_logprobs(entries, TokenTexts(smollm.tokenizer), top_n=1)
    assert shape.token_logprobs[0] is None and shape.top_logprobs[0] is None
    assert [e.logprob for e in prompt_entries(smollm.tokenizer, ids, None)] == [None] * 4
