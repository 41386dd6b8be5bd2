"""The GGUF path of mlx_backend on the embedded SmolLM2-135M-Instruct Q4_1 file: our loader,
the converter (checked against mlx-lm's own loader), the tokenizer rebuilt from GGUF
metadata, and the errors users see. Nothing is downloaded."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load as mlx_lm_load

from mlxserve.mlx_backend.loading.gguf.architectures import architecture_for
from mlxserve.mlx_backend.loading.gguf.convert import convert_gguf
from mlxserve.mlx_backend.loading.gguf.model_loader import load_gguf_model
from mlxserve.mlx_backend.loading.gguf.tokenizer import build_gguf_tokenizer, load_gguf_tokenizer
from mlxserve.mlx_backend.loading.loader import (
    EMBEDDED_MODEL_ID,
    ModelLoadError,
    cast_float_parameters_to_float32,
    embedded_gguf_path,
    load_model,
)

CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return embedded_gguf_path()


@pytest.fixture(scope="module")
def gguf_loaded(gguf_path):
    """(model, config, metadata) from our GGUF loader."""
    loaded = load_gguf_model(gguf_path)
    return loaded.model, loaded.config, loaded.metadata


@pytest.fixture(scope="module")
def tokenizer(gguf_loaded):
    return load_gguf_tokenizer(gguf_loaded[2])


@pytest.fixture(scope="module")
def converted_dir(gguf_path, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("smollm2_mlx")
    convert_gguf(gguf_path, str(out))
    return str(out)


class TestLoaderMatchesMlxLmOnConvertedDir:
    def test_same_logits(self, gguf_loaded, tokenizer, converted_dir):
        model, _, _ = gguf_loaded
        ref_model, ref_tokenizer = mlx_lm_load(converted_dir)
        prompt = "The capital of France is"
        ids = tokenizer.encode(prompt)
        assert ref_tokenizer.encode(prompt) == ids, "converted tokenizer encodes differently"
        ours = model(mx.array([ids]))
        theirs = ref_model(mx.array([ids]))
        assert ours.dtype == mx.float32, f"our model computes in {ours.dtype}, not float32"
        diff = mx.abs(ours - theirs).max().item()
        assert diff < 1e-4, f"logits differ by {diff} between our loader and mlx_lm.load"

    def test_config_records_per_layer_bits(self, gguf_loaded):
        _, config, _ = gguf_loaded
        quant = config.get("quantization")
        assert quant and quant["bits"] == 4 and quant["group_size"] == 32, f"got {quant}"
        assert quant.get("model.embed_tokens") == {"group_size": 32, "bits": 8}, (
            f"token_embd is 8-bit in the file, config says {quant.get('model.embed_tokens')}"
        )
        assert config["tie_word_embeddings"] is True, "SmolLM2 has no output.weight"

    def test_load_model_dir_uses_basename_and_context(self, converted_dir):
        loaded = load_model(converted_dir)
        assert loaded.model_id == converted_dir.rstrip("/").rsplit("/", 1)[-1]
        assert loaded.context_length == 8192, f"context {loaded.context_length}"


class TestGreedyChatAnswer:
    def test_capital_of_france_is_paris(self, smollm):
        loaded = smollm  # load_model(None), shared with the other SmolLM2 tests
        assert loaded.model_id == EMBEDDED_MODEL_ID
        assert loaded.context_length == 8192, f"context {loaded.context_length}"
        tok = loaded.tokenizer
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}],
            add_generation_prompt=True,
        )
        cache = make_prompt_cache(loaded.model)
        logits = loaded.model(mx.array([prompt]), cache=cache)
        out: list[int] = []
        for _ in range(20):
            token = mx.argmax(logits[0, -1]).item()
            if token in tok.eos_token_ids:
                break
            out.append(token)
            logits = loaded.model(mx.array([[token]]), cache=cache)
        answer = tok.decode(out)
        assert out, "the model emitted end-of-sequence at once (q/k permutation not undone?)"
        assert "Paris" in answer, f"greedy answer was {answer!r}"


class TestTokenizer:
    def test_control_tokens_are_single_ids(self, tokenizer, gguf_loaded):
        tokens = gguf_loaded[2]["tokenizer.ggml.tokens"]
        for text in CONTROL_TOKENS:
            ids = tokenizer.encode(text, add_special_tokens=False)
            assert ids == [tokens.index(text)], f"{text!r} encodes as {ids}"

    @pytest.mark.parametrize(
        "text",
        [
            "Hello world 123",
            "  two  spaces\n\n\ttab, don't it'll",
            "Héllo 世界! π≈3.14159 😀 naïve",
            "<|im_start|>user\n42<|im_end|>",
        ],
    )
    def test_round_trip(self, tokenizer, text):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text, f"{text!r} -> {ids} -> {tokenizer.decode(ids)!r}"

    def test_digits_split_individually(self, tokenizer):
        pieces = tokenizer.convert_ids_to_tokens(tokenizer.encode("Hello world 123"))
        assert pieces == ["Hello", "Ġworld", "Ġ", "1", "2", "3"], f"got {pieces}"

    def test_chat_template_is_chatml(self, tokenizer):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
        )
        assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"), text
        assert text.startswith("<|im_start|>system\n"), text

    def test_add_bos_token_is_honoured(self, gguf_loaded):
        metadata = {**gguf_loaded[2], "tokenizer.ggml.add_bos_token": mx.array(True)}
        ids = load_gguf_tokenizer(metadata).encode("hi")
        assert ids[0] == 1 and len(ids) == 2, f"expected bos (1) then one token, got {ids}"

    def test_unsupported_tokenizer_model(self):
        with pytest.raises(ValueError, match="'t5'"):
            build_gguf_tokenizer({"tokenizer.ggml.model": "t5"})


class TestErrors:
    def test_unsupported_architecture_in_metadata(self):
        with pytest.raises(ValueError, match="'mamba'"):
            architecture_for("mamba")

    def test_unsupported_architecture_file(self, tmp_path):
        path = str(tmp_path / "tiny-mamba.gguf")
        mx.save_gguf(
            path, {"token_embd.weight": mx.zeros((4, 8))}, {"general.architecture": "mamba"}
        )
        with pytest.raises(ValueError, match="'mamba'"):
            load_gguf_model(path)
        with pytest.raises(ModelLoadError, match="'mamba'"):
            load_model(path)

    def test_unsupported_tensor_type(self, tmp_path):
        import gguf
        import numpy as np

        path = str(tmp_path / "tiny.gguf")
        writer = gguf.GGUFWriter(path, "llama")
        # Q8_1 is an activation format llama.cpp never stores weights in.
        block = np.zeros((4, 40), dtype=np.uint8)
        writer.add_tensor("output.weight", block, raw_dtype=gguf.GGMLQuantizationType.Q8_1)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with pytest.raises(ValueError, match="Q8_1") as info:
            load_gguf_model(path)
        assert "output.weight" in str(info.value), f"the tensor is not named: {info.value}"

    @pytest.mark.parametrize("spec", ["./no/such/model", "~/no-such-model-dir", "/no/such/m.gguf"])
    def test_nonexistent_path(self, spec):
        with pytest.raises(ModelLoadError) as info:
            load_model(spec)
        assert "\n" not in str(info.value), f"message is not one line: {info.value}"

    def test_unreachable_repo_id(self, monkeypatch, tmp_path):
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.chdir(tmp_path)  # so the repo id cannot name a local directory
        with pytest.raises(ModelLoadError, match="mlxserve-test/no-such-model") as info:
            load_model("mlxserve-test/no-such-model")
        assert "\n" not in str(info.value), f"message is not one line: {info.value}"


class TestRepoIdFromCache:
    def test_cached_repo_loads_offline(self, converted_dir, monkeypatch, tmp_path):
        from huggingface_hub import constants

        # A Hub cache holding one snapshot of the converted model, as a download leaves it.
        repo = tmp_path / "models--mlxserve-test--smollm2"
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text("0" * 40)
        (repo / "snapshots").mkdir()
        (repo / "snapshots" / ("0" * 40)).symlink_to(converted_dir, target_is_directory=True)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        loaded = load_model("mlxserve-test/smollm2")
        assert loaded.model_id == "mlxserve-test/smollm2", f"model_id {loaded.model_id}"
        assert loaded.context_length == 8192, f"context {loaded.context_length}"


class TestCpuFloat32Cast:
    def test_half_parameters_become_float32(self):
        layer = nn.Linear(8, 4)
        layer.set_dtype(mx.float16)
        cast = cast_float_parameters_to_float32(layer)
        if mx.default_device() != mx.cpu:
            pytest.skip("the cast only applies on the CPU backend")
        assert cast == 2 and layer.weight.dtype == mx.float32, f"{cast} cast, {layer.weight.dtype}"
