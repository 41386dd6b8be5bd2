"""GGUF ``gpt2`` vocabularies: byte-level BPE with merges and a pre-tokenizer by name.

GGUF files carry the vocabulary as plain lists (``tokenizer.ggml.tokens``, ``merges``) plus
the name of a split regex (``tokenizer.ggml.pre``) that llama.cpp hard-codes; this module
rebuilds the equivalent ``tokenizers`` model and pre-tokenizer, so encoding matches the
``tokenizer.json`` the file was converted from.
"""

from __future__ import annotations

import logging

from tokenizers import Regex, decoders, models, pre_tokenizers

logger = logging.getLogger(__name__)

# HF tokenizer.json split regexes (the originals llama.cpp's llama-vocab.cpp quotes).
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")
_TEKKEN_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_REGEXES = {"llama3": _LLAMA3_REGEX, "qwen2": _QWEN2_REGEX, "tekken": _TEKKEN_REGEX}
_REGEXES["gpt-4o"] = _GPT4O_REGEX

# tokenizer.ggml.pre -> pipeline family; the groups mirror llama.cpp's llm_tokenizer_bpe.
PRE_FAMILIES = {
    # GPT-2 regex on its own (ByteLevel's built-in split).
    **dict.fromkeys(["gpt2", "mpt", "olmo", "jais", "default"], "gpt2"),
    # \p{N} split into single digits first, then the GPT-2 regex (SmolLM / StarCoder).
    **dict.fromkeys(
        ["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"],
        "digits",
    ),
    **dict.fromkeys(
        ["llama-bpe", "llama3", "llama-v3", "dbrx", "smaug-bpe", "falcon3", "lfm2", "pixtral"],
        "llama3",
    ),
    **dict.fromkeys(["qwen2", "stablelm2", "deepseek-r1-qwen", "megrez"], "qwen2"),
    "tekken": "tekken",
    **dict.fromkeys(["gpt-4o", "llama4"], "gpt-4o"),
}


def bpe_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The ``tokenizers`` pre-tokenizer equivalent to llama.cpp's ``pre`` type.

    Raises:
        ValueError: the pre-tokenizer is not one of ``PRE_FAMILIES``.
    """
    if pre is None:
        # Files converted before llama.cpp recorded it; llama.cpp then uses the GPT-2 split.
        logger.warning("GGUF file names no tokenizer.ggml.pre; using the GPT-2 split")
        pre = "gpt2"
    family = PRE_FAMILIES.get(pre)
    if family is None:
        supported = ", ".join(sorted(PRE_FAMILIES))
        raise ValueError(f"Unsupported GGUF pre-tokenizer {pre!r} (supported: {supported})")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if family == "gpt2":
        return byte_level
    if family == "digits":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_REGEXES[family]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def byte_level_bpe(
    tokens: list[str], merges: list[str], pre: str | None, unk: str | None
) -> tuple[models.Model, pre_tokenizers.PreTokenizer, None, decoders.Decoder]:
    """``(model, pre_tokenizer, normalizer, decoder)`` of a GGUF ``gpt2`` vocabulary."""
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    model = models.BPE(
        vocab={tok: i for i, tok in enumerate(tokens)},
        merges=pairs,
        unk_token=unk,
        fuse_unk=False,
        byte_fallback=False,
    )
    return model, bpe_pre_tokenizer(pre), None, decoders.ByteLevel()
