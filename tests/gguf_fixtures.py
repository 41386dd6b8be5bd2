"""Tiny 2-layer random-weight GGUF files per architecture, and their float references.

``write_gguf(arch, path)`` builds the mlx-lm model of ``gguf_fixture_specs.CONFIGS[arch]``
with random weights, converts every parameter the way llama.cpp's converter does, encodes
it in the type ``tensor_type`` picks (gguf-py's quantizers for the legacy types, BF16 and
MXFP4; ``gguf_quantizers`` for the K-quants), and writes the file with gguf-py's
``GGUFWriter`` together with a tokenizer (byte-level BPE or a SentencePiece model trained
here). The reference is the same mlx-lm model holding ``gguf.quants.dequantize`` of each
written tensor, converted back: the independent float answer the loader must match.
"""

from __future__ import annotations

import importlib
import io
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from gguf.quants import dequantize, quantize
from mlx.utils import tree_flatten

from tests.gguf_fixture_specs import (
    CONFIGS,
    from_gguf,
    gguf_name,
    llama3_rope_factors,
    to_gguf,
    write_metadata,
)
from tests.gguf_fixture_specs import tensor_type as default_tensor_type
from tests.gguf_quantizers import K_QUANTIZERS
from tests.tiny_models import _byte_level_tokenizer_json

SPM_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Hello world, hello there!\n"
    "Numbers 12345 and 67890 are split into digits; pieces become ids.\n"
    "Tokenizers learn merges from text: the, then, there, these, those, other.\n"
    "User: what is the capital of France? Assistant: Paris is the capital.\n"
) * 8


@dataclass
class GGUFFixture:
    """A written file and what it stands for."""

    arch: str
    path: Path
    config: dict[str, Any]  # the mlx-lm config of the reference
    reference: nn.Module  # mlx-lm model holding gguf-py's dequantized weights (float32)
    types: dict[str, str]  # GGUF tensor name -> type written
    tokenizer_kind: str


def _random_weights(model: nn.Module, tied: bool, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, w in tree_flatten(model.parameters()):
        shape = w.shape
        if name.endswith("norm.weight") or "layernorm" in name:
            base = 0.0 if "gemma" in type(model).__module__ else 1.0
            if "post_" in name:  # Gemma's sandwich norms: louder blocks, varied tokens
                base = 4.0
            value = base + 0.1 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            value = 0.1 * rng.standard_normal(shape)
        elif "embed_tokens" in name:
            # Gemma scales embeddings by sqrt(hidden) and normalizes every block's output:
            # a small embedding keeps the input token from dominating the tied head.
            std = 0.05 if "gemma" in type(model).__module__ else 0.3 if tied else 1.0
            value = std * rng.standard_normal(shape)
        elif "conv.conv" in name:
            value = rng.standard_normal(shape) / np.sqrt(shape[1])
        else:
            gain = 4.0 if name == "lm_head.weight" else 1.0
            # A tied head sees the input token's embedding through the residual stream:
            # stronger block outputs keep greedy decoding from repeating that token.
            if tied and any(k in name for k in ("o_proj", "out_proj", "down_proj", "w2")):
                gain = 4.0
            value = gain * rng.standard_normal(shape) / np.sqrt(shape[-1])
        out[name] = value.astype(np.float32)
    return out


def _encode(type_name: str, values: np.ndarray) -> np.ndarray:
    """GGUF bytes (or float array for F32/F16) of ``values`` in ``type_name``."""
    if type_name == "F32":
        return values.astype(np.float32)
    if type_name == "F16":
        return values.astype(np.float16)
    if type_name in K_QUANTIZERS:
        return K_QUANTIZERS[type_name](values)[0]
    return quantize(values, gguf.GGMLQuantizationType[type_name])


def _decode(type_name: str, data: np.ndarray) -> np.ndarray:
    if type_name in ("F32", "F16"):
        return data.astype(np.float32)
    return dequantize(data, gguf.GGMLQuantizationType[type_name]).astype(np.float32)


@lru_cache(maxsize=4)
def spm_model_proto(add_dummy_prefix: bool = True) -> bytes:
    """A SentencePiece BPE model (byte fallback, identity normalization, as Llama's)."""
    import sentencepiece as spm

    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(SPM_CORPUS.splitlines()),
        model_writer=out,
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        add_dummy_prefix=add_dummy_prefix,
        remove_extra_whitespaces=False,
        split_digits=True,
        character_coverage=1.0,
        hard_vocab_limit=False,
        user_defined_symbols=["<|im_start|>", "<|im_end|>"],
        minloglevel=2,
    )
    return out.getvalue()


def write_spm_vocab(writer: Any, add_dummy_prefix: bool = True) -> None:
    """What llama.cpp's ``_set_vocab_sentencepiece`` writes for our SentencePiece model."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString(spm_model_proto(add_dummy_prefix))
    # sentencepiece piece types -> gguf TokenType (NORMAL 1, UNKNOWN 2, CONTROL 3,
    # USER_DEFINED 4, UNUSED 5, BYTE 6).
    types = {1: 1, 2: 2, 3: 3, 4: 4, 5: 5, 6: 6}
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([p.piece for p in proto.pieces])
    writer.add_token_scores([p.score for p in proto.pieces])
    writer.add_token_types([types[p.type] for p in proto.pieces])
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(add_dummy_prefix)


def write_gpt2_vocab(writer: Any, pre: str = "gpt2") -> None:
    spec = json.loads(_byte_level_tokenizer_json())
    vocab = spec["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    tokens.append("<|endoftext|>")
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 1) + [3])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_add_bos_token(False)


def write_gguf(
    arch: str, path: Path, seed: int = 0, tensor_type=default_tensor_type
) -> GGUFFixture:
    """Write the ``arch`` fixture at ``path``; see the module doc."""
    module_name, config, tok_kind = CONFIGS[arch]
    config = json.loads(json.dumps(config))
    module = importlib.import_module(f"mlx_lm.models.{module_name}")
    model = module.Model(module.ModelArgs.from_dict(config))
    # Untied heads (where the architecture has one) vary greedy tokens more.
    tied = config.get("tie_word_embeddings") is True or "lm_head.weight" not in dict(
        tree_flatten(model.parameters())
    )
    weights = _random_weights(model, tied, seed)
    if tied:
        weights.pop("lm_head.weight", None)

    writer = gguf.GGUFWriter(str(path), arch)
    write_metadata(writer, arch, config)
    if tok_kind == "spm":
        write_spm_vocab(writer, add_dummy_prefix=arch != "gemma3")
    else:
        write_gpt2_vocab(writer, "qwen2" if arch.startswith("qwen") else "gpt2")

    reference: dict[str, mx.array] = {}
    types: dict[str, str] = {}
    for index, (name, value) in enumerate(weights.items()):
        target = gguf_name(arch, name)
        data = to_gguf(arch, name, value)
        kind = tensor_type(arch, target, data.shape, index)
        encoded = _encode(kind, data)
        raw_dtype = None if kind in ("F32", "F16") else gguf.GGMLQuantizationType[kind]
        writer.add_tensor(target, encoded, raw_dtype=raw_dtype)
        types[target] = kind
        decoded = _decode(kind, encoded).reshape(data.shape)
        reference[name] = mx.array(from_gguf(arch, name, decoded, value.shape))
    if arch == "llama":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(config))
        types["rope_freqs.weight"] = "F32"
    if arch == "phi3":
        for kind in ("long", "short"):
            factors = np.array(config["rope_scaling"][f"{kind}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{kind}.weight", factors)
            types[f"rope_factors_{kind}.weight"] = "F32"
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ref_model = module.Model(module.ModelArgs.from_dict(config))
    if hasattr(ref_model, "sanitize"):
        reference = ref_model.sanitize(reference)
    ref_model.load_weights(list(reference.items()), strict=True)
    ref_model.eval()
    mx.eval(ref_model.parameters())
    return GGUFFixture(arch, Path(path), config, ref_model, types, tok_kind)


def rewrite_gguf(
    src: Path,
    dst: Path,
    *,
    drop: tuple[str, ...] = (),
    add: dict[str, np.ndarray] | None = None,
    metadata: dict[str, Any] | None = None,
    arch: str | None = None,
) -> Path:
    """Copy a GGUF file with tensors dropped or added and metadata values replaced (for
    the refusal tests); read with gguf-py's own reader."""
    reader = gguf.GGUFReader(str(src))
    fields = {
        name: field.contents()
        for name, field in reader.fields.items()
        if not name.startswith("GGUF.") and name != "general.architecture"
    }
    old_arch = reader.fields["general.architecture"].contents()
    new_arch = arch or old_arch
    writer = gguf.GGUFWriter(str(dst), new_arch)
    for name, value in {**fields, **(metadata or {})}.items():
        name = name.replace(f"{old_arch}.", f"{new_arch}.", 1)
        if isinstance(value, bool):
            writer.add_bool(name, value)
        elif isinstance(value, int):
            writer.add_uint32(name, value)
        elif isinstance(value, float):
            writer.add_float32(name, value)
        elif isinstance(value, str):
            writer.add_string(name, value)
        else:
            writer.add_array(name, value)
    for t in reader.tensors:
        if t.name in drop:
            continue
        kind = gguf.GGMLQuantizationType(t.tensor_type)
        data = np.array(t.data)
        if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor(t.name, data)
        else:
            writer.add_tensor(t.name, data, raw_dtype=kind)
    for name, value in (add or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(dst)
