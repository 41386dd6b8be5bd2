"""A tiny random BERT (sentence-transformers layout) built from mlx-embeddings' own classes.

``build_tiny_bert_dir`` writes ``config.json`` (``model_type: bert``), ``model.safetensors``
(the mlx-embeddings model's parameter names), a WordPiece ``tokenizer.json`` that wraps each
input in ``[CLS] ... [SEP]``, and, when a pooling mode is given, ``modules.json`` +
``1_Pooling/config.json`` as sentence-transformers saves them; the directory loads through
``mlx_embeddings.utils.load`` and through mlxserve's ``load_model(..., task="embed")``.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

WORDS = ["hello", "there", "world", "the", "cat", "sat", "on", "mat", "a", "dog", "runs"]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
BERT_CONFIG = {
    "model_type": "bert",
    "architectures": ["BertModel"],
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
    "hidden_act": "gelu",
    "pad_token_id": 0,
}


def _vocab() -> dict[str, int]:
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces = SPECIALS + WORDS + letters + [f"##{c}" for c in letters]
    pieces += list(".,!?")
    return {piece: i for i, piece in enumerate(dict.fromkeys(pieces))}


def _tokenizer_json(vocab: dict[str, int]) -> str:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    tokenizer.decoder = decoders.WordPiece()
    return tokenizer.to_str()


def build_tiny_bert_dir(path: Path, seed: int = 0, pooling: str | None = "mean") -> Path:
    """Write the tiny random BERT at ``path``; ``pooling`` ("mean", "cls", "max",
    "lasttoken") writes a sentence-transformers Pooling module, None writes none."""
    from mlx_embeddings.models import bert

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab = _vocab()
    config = {**BERT_CONFIG, "vocab_size": len(vocab)}
    mx.random.seed(seed)
    model = bert.Model(bert.ModelArgs.from_dict(config))
    weights = {}
    for name, w in tree_flatten(model.parameters()):
        if w.ndim == 2:
            w = mx.random.normal(w.shape) * (1.0 if "embeddings" in name else w.shape[-1] ** -0.5)
        weights[name] = w.astype(mx.float32)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (path / "tokenizer.json").write_text(_tokenizer_json(vocab))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "cls_token": "[CLS]",
        "sep_token": "[SEP]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "mask_token": "[MASK]",
        "model_max_length": config["max_position_embeddings"],
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    if pooling is not None:
        st = "sentence_transformers.models."
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": st + "Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": st + "Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": st + "Normalize"},
        ]
        (path / "modules.json").write_text(json.dumps(modules, indent=2) + "\n")
        (path / "1_Pooling").mkdir(exist_ok=True)
        modes = ("cls_token", "mean_tokens", "max_tokens", "lasttoken")
        keys = {f"pooling_mode_{m}": m.startswith(pooling) for m in modes}
        pooling_config = {"word_embedding_dimension": config["hidden_size"], **keys}
        (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config) + "\n")
    return path
