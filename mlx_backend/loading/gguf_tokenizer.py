"""Build a Hugging Face fast tokenizer from the vocabulary stored in GGUF metadata.

GGUF files carry the tokenizer as plain lists (``tokenizer.ggml.tokens``,
``merges``, ``token_type``) plus a pre-tokenizer name (``tokenizer.ggml.pre``)
that llama.cpp maps onto a hard-coded split regex. This module rebuilds the
equivalent ``tokenizers`` pipeline so encoding matches the original HF
``tokenizer.json`` the GGUF was converted from.
"""

from __future__ import annotations

import logging
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from mlxserve.mlx_backend.loading.gguf_model import metadata_value

logger = logging.getLogger(__name__)

# llama.cpp token types (llama_token_type / gguf TokenType).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# HF tokenizer.json split regexes of the Llama 3 and Qwen 2 families (the originals
# that llama.cpp's llama-vocab.cpp quotes before adapting them to its own engine).
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")

# tokenizer.ggml.pre -> pipeline family. The groups mirror llama.cpp's
# llm_tokenizer_bpe switch: same regexes, same tokenization.
_PRE_FAMILIES = {
    # GPT-2 regex on its own (ByteLevel's built-in split).
    "gpt2": "gpt2",
    "mpt": "gpt2",
    "olmo": "gpt2",
    "jais": "gpt2",
    # \p{N} split into single digits first, then the GPT-2 regex; this is HF's
    # Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)] of
    # SmolLM / StarCoder tokenizer.json files.
    "smollm": "digits",
    "starcoder": "digits",
    "refact": "digits",
    "command-r": "digits",
    "codeshell": "digits",
    "exaone": "digits",
    "minerva": "digits",
    "llama-bpe": "llama3",
    "llama3": "llama3",
    "dbrx": "llama3",
    "smaug-bpe": "llama3",
    "qwen2": "qwen2",
    "stablelm2": "qwen2",
}


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The ``tokenizers`` pre-tokenizer equivalent to llama.cpp's ``pre`` type."""
    family = _PRE_FAMILIES.get(pre)
    if family is None:
        supported = ", ".join(sorted(_PRE_FAMILIES))
        raise ValueError(f"Unsupported GGUF pre-tokenizer {pre!r} (supported: {supported})")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if family == "gpt2":
        return byte_level
    if family == "digits":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    regex = _LLAMA3_REGEX if family == "llama3" else _QWEN2_REGEX
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _token(tokens: list[str], metadata: dict, key: str) -> str | None:
    """The token text of ``tokenizer.ggml.<key>_token_id``, if the file names one."""
    token_id = metadata_value(metadata, f"tokenizer.ggml.{key}_token_id")
    if token_id is None or not 0 <= int(token_id) < len(tokens):
        return None
    return tokens[int(token_id)]


def gguf_eos_token_ids(metadata: dict) -> list[int]:
    """The ids that end a generation: eos plus end-of-turn / end-of-message if named.

    Args:
        metadata: GGUF metadata.

    Returns:
        Distinct token ids in the order eos, eot, eom (possibly empty).
    """
    ids: list[int] = []
    for key in ("eos", "eot", "eom"):
        value = metadata_value(metadata, f"tokenizer.ggml.{key}_token_id")
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return ids


def build_gguf_tokenizer(metadata: dict) -> Tokenizer:
    """Build the raw ``tokenizers.Tokenizer`` described by GGUF metadata.

    Args:
        metadata: GGUF metadata from ``mx.load(path, return_metadata=True)``.

    Returns:
        A byte-level BPE ``Tokenizer`` with the file's control and user-defined
        tokens registered as added tokens.

    Raises:
        ValueError: if the tokenizer model or pre-tokenizer is not supported, or
            the vocabulary is missing.
    """
    kind = metadata_value(metadata, "tokenizer.ggml.model")
    if kind is None:
        raise ValueError("GGUF file has no tokenizer (tokenizer.ggml.model is missing)")
    if kind != "gpt2":
        raise ValueError(f"Unsupported GGUF tokenizer model {kind!r} (supported: 'gpt2')")
    tokens: list[str] = metadata.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ValueError("GGUF metadata has no tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges") or []]
    pre = metadata_value(metadata, "tokenizer.ggml.pre")
    if pre is None:
        # Files converted before llama.cpp recorded the pre-tokenizer; llama.cpp
        # itself then falls back to a GPT-2 style split.
        logger.warning("GGUF file names no tokenizer.ggml.pre; using the GPT-2 split")
        pre = "gpt2"

    tokenizer = Tokenizer(
        models.BPE(
            vocab={tok: i for i, tok in enumerate(tokens)},
            merges=merges,
            unk_token=_token(tokens, metadata, "unknown"),
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tokenizer.pre_tokenizer = _pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()

    token_types = metadata_value(metadata, "tokenizer.ggml.token_type") or []
    # Control tokens must be matched before BPE runs, or "<|im_start|>" would be
    # split into "<", "|", "im", ... pieces.
    special = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, t in enumerate(token_types)
        if t == TOKEN_TYPE_CONTROL
    ]
    user = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i, t in enumerate(token_types)
        if t == TOKEN_TYPE_USER_DEFINED
    ]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user)

    bos, eos = _token(tokens, metadata, "bos"), _token(tokens, metadata, "eos")
    add_bos = bos is not None and bool(metadata_value(metadata, "tokenizer.ggml.add_bos_token"))
    add_eos = eos is not None and bool(metadata_value(metadata, "tokenizer.ggml.add_eos_token"))
    if add_bos or add_eos:
        # Mirrors llama.cpp, which adds bos/eos around every encoded text when
        # the file asks for it.
        def template(part: str, type_id: int) -> str:
            items = [f"{bos}:{type_id}"] if add_bos else []
            items.append(f"${part}:{type_id}")
            return " ".join(items + ([f"{eos}:{type_id}"] if add_eos else []))

        specials = {tok for tok, on in ((bos, add_bos), (eos, add_eos)) if on}
        tokenizer.post_processor = processors.TemplateProcessing(
            single=template("A", 0),
            pair=f"{template('A', 0)} {template('B', 1)}",
            special_tokens=[(tok, tokens.index(tok)) for tok in specials],
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def load_gguf_tokenizer(metadata: dict) -> PreTrainedTokenizerFast:
    """Build a ``transformers`` fast tokenizer from GGUF metadata.

    Args:
        metadata: GGUF metadata from ``mx.load(path, return_metadata=True)``.

    Returns:
        A ``PreTrainedTokenizerFast`` with bos/eos/unk/pad tokens and the file's
        chat template (``tokenizer.chat_template``) set.

    Raises:
        ValueError: if the tokenizer model or pre-tokenizer is not supported.
    """
    backend = build_gguf_tokenizer(metadata)
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    kwargs: dict[str, Any] = {
        name: tok
        for name, key in (
            ("bos_token", "bos"),
            ("eos_token", "eos"),
            ("unk_token", "unknown"),
            ("pad_token", "padding"),
        )
        if (tok := _token(tokens, metadata, key)) is not None
    }
    arch = metadata_value(metadata, "general.architecture")
    if (context := metadata_value(metadata, f"{arch}.context_length")) is not None:
        kwargs["model_max_length"] = int(context)
    chat_template = metadata_value(metadata, "tokenizer.chat_template")
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, clean_up_tokenization_spaces=False, **kwargs
    )
