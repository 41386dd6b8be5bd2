"""A Hugging Face fast tokenizer built from a GGUF file's vocabulary.

Both GGUF vocabulary kinds are rebuilt with the ``tokenizers`` library: ``gpt2``
(byte-level BPE, ``tokenizer_bpe``) and ``llama`` (SentencePiece, ``tokenizer_spm``).
Control tokens become special added tokens and user-defined ones plain added tokens, so
both are matched whole before the model runs, as llama.cpp matches them; BOS/EOS are added
around each encoded text when the file asks (``add_bos_token`` / ``add_eos_token``).
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Tokenizer, processors
from transformers import PreTrainedTokenizerFast

from mlxserve.mlx_backend.loading.gguf.chat_templates import chat_template_for
from mlxserve.mlx_backend.loading.gguf.tokenizer_bpe import byte_level_bpe
from mlxserve.mlx_backend.loading.gguf.tokenizer_spm import sentencepiece_bpe

# llama.cpp token types (gguf.TokenType).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
SUPPORTED_KINDS = ("gpt2", "llama")


def _token(tokens: list[str], metadata: dict, key: str) -> str | None:
    """The text of ``tokenizer.ggml.<key>_token_id``, if the file names a valid one."""
    token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
    if token_id is None or not 0 <= int(token_id) < len(tokens):
        return None
    return tokens[int(token_id)]


def gguf_eos_token_ids(metadata: dict) -> list[int]:
    """The ids that end a generation: eos, then end-of-turn / end-of-message if named."""
    ids: list[int] = []
    for key in ("eos", "eot", "eom"):
        value = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return ids


def tokenizer_kind(metadata: dict) -> str:
    """``gpt2`` or ``llama`` (``tokenizer.ggml.model``).

    Raises:
        ValueError: no tokenizer, or a kind mlxserve does not build.
    """
    kind = metadata.get("tokenizer.ggml.model")
    if kind is None:
        raise ValueError("GGUF file has no tokenizer (tokenizer.ggml.model is missing)")
    if kind not in SUPPORTED_KINDS:
        raise ValueError(
            f"Unsupported GGUF tokenizer model {kind!r} (supported: {', '.join(SUPPORTED_KINDS)})"
        )
    return kind


def build_gguf_tokenizer(metadata: dict) -> Tokenizer:
    """The raw ``tokenizers.Tokenizer`` a GGUF file's metadata describes.

    Raises:
        ValueError: the tokenizer kind or pre-tokenizer is not supported, or the
            vocabulary is missing.
    """
    kind = tokenizer_kind(metadata)
    tokens: list[str] = metadata.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ValueError("GGUF metadata has no tokenizer.ggml.tokens")
    types = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    unk = _token(tokens, metadata, "unknown")
    if kind == "gpt2":
        merges = metadata.get("tokenizer.ggml.merges") or []
        parts = byte_level_bpe(tokens, merges, metadata.get("tokenizer.ggml.pre"), unk)
    else:
        arch = str(metadata.get("general.architecture", ""))
        parts = sentencepiece_bpe(
            tokens,
            metadata.get("tokenizer.ggml.scores"),
            types,
            unk=unk,
            add_space_prefix=bool(metadata.get("tokenizer.ggml.add_space_prefix", True)),
            gemma=arch.startswith("gemma"),
        )
    model, pre_tokenizer, normalizer, decoder = parts
    tokenizer = Tokenizer(model)
    if pre_tokenizer is not None:
        tokenizer.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.decoder = decoder
    _add_special_tokens(tokenizer, tokens, types)
    _add_bos_eos(tokenizer, tokens, metadata, kind)
    return tokenizer


def _add_special_tokens(tokenizer: Tokenizer, tokens: list[str], types: list[int]) -> None:
    # Control tokens must be matched before BPE runs, or "<|im_start|>" would be split into
    # "<", "|", "im", ... pieces.
    tokenizer.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, t in enumerate(types)
            if t == TOKEN_TYPE_CONTROL
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(types)
            if t == TOKEN_TYPE_USER_DEFINED
        ]
    )


def _add_bos_eos(tokenizer: Tokenizer, tokens: list[str], metadata: dict, kind: str) -> None:
    bos, eos = _token(tokens, metadata, "bos"), _token(tokens, metadata, "eos")
    # llama.cpp adds BOS for SentencePiece vocabularies unless the file says not to.
    add_bos_default = kind == "llama"
    add_bos = bos is not None and bool(
        metadata.get("tokenizer.ggml.add_bos_token", add_bos_default)
    )
    add_eos = eos is not None and bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    if not (add_bos or add_eos):
        if kind == "gpt2":
            tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
        return

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


def load_gguf_tokenizer(metadata: dict, arch_family: str = "") -> PreTrainedTokenizerFast:
    """A ``transformers`` fast tokenizer for a GGUF file.

    Args:
        metadata: the file's GGUF metadata.
        arch_family: the architecture table's chat family, for the default template.

    Returns:
        The tokenizer with bos/eos/unk/pad tokens and a chat template: the file's own, or
        its family's standard one (``chat_templates``).

    Raises:
        ValueError: the tokenizer kind or pre-tokenizer is not supported.
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
    arch = metadata.get("general.architecture")
    if (context := metadata.get(f"{arch}.context_length")) is not None:
        kwargs["model_max_length"] = int(context)
    kwargs["chat_template"], _ = chat_template_for(metadata, arch_family)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, clean_up_tokenization_spaces=False, **kwargs
    )
