"""Convert a GGUF file into an MLX model directory that ``mlx_lm.load`` reads.

The directory holds ``config.json`` (with the per-layer ``quantization`` entry),
``model.safetensors`` under mlx-lm parameter names, the tokenizer files and
``generation_config.json``. Weights are stored exactly as our GGUF loader holds
them (packed uint32 plus float32 scales/biases/norms), so ``mlx_lm.load`` of the
directory computes the same logits as ``load_gguf_model`` of the file.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import save_config

from mlxserve.mlx_backend.loading.gguf_model import load_gguf_model, metadata_value
from mlxserve.mlx_backend.loading.gguf_tokenizer import gguf_eos_token_ids, load_gguf_tokenizer


def convert_gguf(gguf_path: str, out_dir: str) -> None:
    """Write the GGUF model at ``gguf_path`` as an MLX model directory.

    Args:
        gguf_path: the GGUF file (see ``load_gguf_model`` for what is supported).
        out_dir: the directory to write; created if missing, files overwritten.

    Raises:
        ValueError: unsupported architecture, tensor type or tokenizer.
        FileNotFoundError: if ``gguf_path`` does not exist.
    """
    model, config, metadata = load_gguf_model(gguf_path)
    # Build the tokenizer before writing anything, so an unsupported tokenizer
    # does not leave a half-written directory behind.
    tokenizer = load_gguf_tokenizer(metadata)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # The names come from the built model itself, so they are exactly the ones
    # mlx-lm's load_weights(strict=True) expects.
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    save_config(dict(config), config_path=out / "config.json")

    tokenizer.save_pretrained(str(out))
    _make_tokenizer_config_portable(out / "tokenizer_config.json", tokenizer.chat_template)
    chat_template = metadata_value(metadata, "tokenizer.chat_template")
    if chat_template is not None and not (out / "chat_template.jinja").exists():
        # Older transformers keep the template only in tokenizer_config.json;
        # the .jinja file is what current loaders look for first.
        (out / "chat_template.jinja").write_text(chat_template, encoding="utf-8")

    # mlx-lm takes its stop tokens from generation_config.json's eos_token_id.
    generation: dict[str, int | list[int]] = {}
    if (bos := metadata_value(metadata, "tokenizer.ggml.bos_token_id")) is not None:
        generation["bos_token_id"] = int(bos)
    if eos_ids := gguf_eos_token_ids(metadata):
        generation["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    if (pad := metadata_value(metadata, "tokenizer.ggml.padding_token_id")) is not None:
        generation["pad_token_id"] = int(pad)
    with open(out / "generation_config.json", "w", encoding="utf-8") as f:
        json.dump(generation, f, indent=2)


def _make_tokenizer_config_portable(path: Path, chat_template: str | None) -> None:
    """Name the generic fast-tokenizer class and inline the chat template.

    transformers 5 records its own backend class (``TokenizersBackend``), which
    transformers 4 cannot resolve; ``PreTrainedTokenizerFast`` loads with both.
    transformers 4 also reads the chat template only from this file.
    """
    with open(path, encoding="utf-8") as f:
        tokenizer_config = json.load(f)
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if chat_template is not None:
        tokenizer_config.setdefault("chat_template", chat_template)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(tokenizer_config, f, indent=2, ensure_ascii=False)
