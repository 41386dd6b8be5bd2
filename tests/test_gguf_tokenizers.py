"""Tokenizers rebuilt from GGUF vocabularies, against the tokenizers they were made from.

``llama`` (SentencePiece) vocabularies are checked against the ``sentencepiece`` library
running the very model whose pieces, scores and types the fixture wrote (as llama.cpp's
converter writes them); ``gpt2`` (byte-level BPE) vocabularies against the Hugging Face
``tokenizer.json`` they came from. Plus the added tokens, BOS, streaming detokenization and
the chat template a file without one gets.
"""

from __future__ import annotations

import logging

import gguf
import pytest
import sentencepiece as spm
from mlx_lm.tokenizer_utils import SPMStreamingDetokenizer
from tokenizers import Tokenizer

from mlxserve.mlx_backend.loading.gguf.chat_templates import TEMPLATES, default_template_name
from mlxserve.mlx_backend.loading.gguf.reader import GGUFFile
from mlxserve.mlx_backend.loading.gguf.tokenizer import build_gguf_tokenizer, load_gguf_tokenizer
from mlxserve.mlx_backend.loading.gguf.tokenizer_bpe import PRE_FAMILIES, bpe_pre_tokenizer
from tests.gguf_fixtures import spm_model_proto, write_gpt2_vocab, write_spm_vocab
from tests.tiny_models import _byte_level_tokenizer_json

MIXED = [
    "Hello world 123",
    "  two  spaces\n\n\ttab, don't it'll",
    "Héllo 世界! π≈3.14159 😀 naïve",
    " leading space and trailing ",
    "The capital of France is Paris. Numbers 12345 and 67890.",
    "unseen: ZQX jjj ⊕ \u00a0nbsp",
]


def metadata_of(tmp_path, write_vocab, arch: str = "llama") -> dict:
    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    write_vocab(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with GGUFFile(str(path)) as gf:
        return gf.metadata


@pytest.fixture(params=[True, False], ids=["space-prefix", "no-space-prefix"])
def spm_case(request, tmp_path):
    prefix = request.param
    metadata = metadata_of(tmp_path, lambda w: write_spm_vocab(w, add_dummy_prefix=prefix))
    reference = spm.SentencePieceProcessor(model_proto=spm_model_proto(prefix))
    return load_gguf_tokenizer(metadata, "llama"), reference, metadata


class TestSentencePiece:
    @pytest.mark.parametrize("text", MIXED)
    def test_encoding_equals_sentencepiece(self, spm_case, text):
        ours, reference, _ = spm_case
        got = ours.encode(text, add_special_tokens=False)
        want = reference.encode(text)
        assert got == want, (
            f"{text!r}: {ours.convert_ids_to_tokens(got)} != {reference.encode(text, out_type=str)}"
        )

    @pytest.mark.parametrize("text", MIXED)
    def test_decode_round_trip(self, spm_case, text):
        ours, reference, _ = spm_case
        ids = reference.encode(text)
        assert ours.decode(ids) == reference.decode(ids), f"{text!r} decodes differently"

    def test_bos_is_added_as_the_file_asks(self, spm_case):
        ours, reference, _ = spm_case
        assert ours.encode("Hello") == [1, *reference.encode("Hello")], ours.encode("Hello")

    def test_user_defined_and_control_tokens_are_single_ids(self, spm_case):
        ours, reference, _ = spm_case
        for piece in ("<|im_start|>", "<|im_end|>", "<s>", "</s>"):
            ids = ours.encode(piece, add_special_tokens=False)
            assert ids == [reference.piece_to_id(piece)], f"{piece!r} -> {ids}"

    def test_streaming_detokenizer_gives_the_decoded_text(self, spm_case):
        ours, reference, metadata = spm_case
        text = MIXED[2]
        detok = SPMStreamingDetokenizer(
            ours, trim_space=metadata["tokenizer.ggml.add_space_prefix"]
        )
        for token in reference.encode(text):
            detok.add_token(token)
        detok.finalize()
        assert detok.text == text, f"streamed {detok.text!r}"


class TestByteLevelBPE:
    @pytest.mark.parametrize("text", MIXED)
    def test_encoding_equals_the_tokenizer_json(self, tmp_path, text):
        metadata = metadata_of(tmp_path, write_gpt2_vocab, arch="qwen2")
        ours = build_gguf_tokenizer(metadata)
        reference = Tokenizer.from_str(_byte_level_tokenizer_json())
        got = ours.encode(text, add_special_tokens=False).ids
        assert got == reference.encode(text).ids, f"{text!r}: {got}"
        assert ours.decode(got) == text, f"{text!r} does not round-trip"

    @pytest.mark.parametrize("pre", sorted(set(PRE_FAMILIES)))
    def test_every_named_pre_tokenizer_builds(self, pre):
        pieces = bpe_pre_tokenizer(pre).pre_tokenize_str("Hello world 123!")
        assert "".join(p for p, _ in pieces).replace("Ġ", " ") == "Hello world 123!", pieces

    def test_unknown_pre_tokenizer_is_refused_by_name(self):
        with pytest.raises(ValueError, match="'no-such-pre'"):
            bpe_pre_tokenizer("no-such-pre")


class TestChatTemplateDefaults:
    @pytest.mark.parametrize(
        ("tokens", "family", "want"),
        [
            (["<|start_header_id|>", "<|eot_id|>"], "llama", "llama3"),
            (["<start_of_turn>", "<end_of_turn>"], "gemma", "gemma"),
            (["<|im_start|>"], "llama", "chatml"),
            (["<|user|>", "<|assistant|>", "<|end|>"], "phi3", "phi3"),
            (["[INST]", "[/INST]"], "llama", "mistral"),
            (["a", "b"], "gemma", "gemma"),
            (["a", "b"], "chatml", "chatml"),
            (["a", "b"], "llama", "mistral"),
        ],
    )
    def test_family(self, tokens, family, want):
        assert default_template_name(tokens, family) == want

    @pytest.mark.parametrize("name", sorted(TEMPLATES))
    def test_templates_render_a_conversation(self, tmp_path, name):
        metadata = metadata_of(tmp_path, write_gpt2_vocab, arch="qwen2")
        tok = load_gguf_tokenizer(metadata, "chatml")
        messages = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Capital of France?"},
        ]
        text = tok.apply_chat_template(
            messages, chat_template=TEMPLATES[name], tokenize=False, add_generation_prompt=True
        )
        for m in messages:
            assert m["content"] in text, f"{name}: {m['content']!r} missing from {text!r}"
        assert text.index("Hi there") < text.index("Capital of France?"), text

    def test_file_without_template_gets_the_family_default_logged(self, tmp_path, caplog):
        metadata = metadata_of(tmp_path, write_spm_vocab, arch="gemma3")
        with caplog.at_level(logging.INFO):
            tok = load_gguf_tokenizer(metadata, "gemma")
        assert tok.chat_template == TEMPLATES["chatml"], "the vocab's <|im_start|> decides first"
        assert "built-in chatml template" in caplog.text, caplog.text

    def test_file_template_wins(self, tmp_path):
        def vocab(writer):
            write_gpt2_vocab(writer)
            writer.add_chat_template("{{ messages[0]['content'] }}!")

        tok = load_gguf_tokenizer(metadata_of(tmp_path, vocab), "llama")
        text = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
        assert text == "x!", text
