"""GGUF ``llama`` vocabularies: SentencePiece BPE rebuilt as a ``tokenizers`` BPE.

llama.cpp's converter writes a SentencePiece model as pieces, scores and token types, no
merges. SentencePiece's BPE repeatedly merges the adjacent pair whose concatenation is the
best-scoring piece, which is a ``tokenizers`` BPE whose merges are every split of every
piece into two pieces, ranked by the merged piece's score (what transformers'
``SentencePieceExtractor`` derives too). Around it, as llama.cpp tokenizes:

- spaces become ``▁`` and, with ``add_space_prefix`` (default true), one ``▁`` is put in
  front of the text and after every special token (a normalizer, so a leading space is
  kept: ``" hi"`` is ``▁▁hi``, as SentencePiece's ``add_dummy_prefix`` gives);
- characters outside the vocabulary become ``<0xXX>`` byte pieces (byte fallback);
- decoding turns ``▁`` back into spaces, bytes into text, and drops the prefix space.

Gemma files need two fixes transformers found: all-space pieces are stored as spaces
(they are looked up as ``▁``), and their merge order follows the file order, not scores.
"""

from __future__ import annotations

from tokenizers import decoders, models, normalizers

SPIECE = "\u2581"
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_BYTE = 6


def spm_merges(tokens: list[str], ranks: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every ``(left, right)`` whose concatenation is a normal piece, best piece first."""
    # User-defined pieces are matched whole before BPE runs (added tokens), never merged.
    normal = {t: i for i, t in enumerate(tokens) if types[i] == TOKEN_TYPE_NORMAL}
    order = sorted(normal.values(), key=lambda i: (-ranks[i], i))
    merges: list[tuple[str, str]] = []
    get = normal.get
    for index in order:
        piece = tokens[index]
        local = []
        for cut in range(1, len(piece)):
            left = get(piece[:cut])
            if left is not None:
                right = get(piece[cut:])
                if right is not None:
                    local.append((left, right))
        if local:
            local.sort()
            merges.extend((tokens[a], tokens[b]) for a, b in local)
    return merges


def sentencepiece_bpe(
    tokens: list[str],
    scores: list[float] | None,
    types: list[int],
    *,
    unk: str | None,
    add_space_prefix: bool,
    gemma: bool,
) -> tuple[models.Model, None, normalizers.Normalizer, decoders.Decoder]:
    """``(model, pre_tokenizer, normalizer, decoder)`` of a GGUF ``llama`` vocabulary."""
    if gemma:
        tokens = [SPIECE * len(t) if t and not t.strip(" ") else t for t in tokens]
        ranks = [-float(i) for i in range(len(tokens))]
    else:
        ranks = [float(s) for s in scores] if scores else [-float(i) for i in range(len(tokens))]
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    model = models.BPE(
        vocab=vocab,
        merges=spm_merges(tokens, ranks, types),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=any(t == TOKEN_TYPE_BYTE for t in types),
    )
    steps = [normalizers.Prepend(SPIECE)] if add_space_prefix else []
    normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPIECE)])
    decode = [decoders.Replace(SPIECE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        decode.append(decoders.Strip(" ", 1, 0))
    return model, None, normalizer, decoders.Sequence(decode)
