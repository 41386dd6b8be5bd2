"""Write a GGUF file out as an MLX model directory that ``mlx_lm.load`` reads.

The directory holds ``config.json`` (mlx-lm ``model_type``, per-layer ``quantization``),
``model.safetensors`` under mlx-lm parameter names, the tokenizer files, the chat template
and ``generation_config.json``. The weights are exactly what ``load_gguf_model`` holds, so
``mlx_lm.load`` of the directory computes the same logits as our loader on the file.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import save_config

from mlxserve.mlx_backend.loading.dequantize import dequantize_all_layers
from mlxserve.mlx_backend.loading.gguf.architectures.base import UnsupportedModel
from mlxserve.mlx_backend.loading.gguf.model_loader import GGUFModel, load_gguf_model
from mlxserve.mlx_backend.loading.gguf.tokenizer import gguf_eos_token_ids, load_gguf_tokenizer

_PERIOD_TOLERANCE = 1e-4


def convert_gguf(gguf_path: str, out_dir: str, *, dequantize: bool = False) -> list[str]:
    """Write the GGUF model at ``gguf_path`` as an MLX model directory.

    Args:
        gguf_path: the GGUF file (any architecture and type ``load_gguf_model`` supports).
        out_dir: the directory to write; created if missing, files overwritten.
        dequantize: write every weight as float32 (exact) instead of keeping quantized
            layers quantized (formats MLX cannot hold exactly then become 8-bit).

    Returns:
        The load report's lines (how each GGUF type was written).

    Raises:
        ValueError: unsupported architecture, tensor, type or tokenizer, or RoPE
            frequencies a ``config.json`` cannot express.
        FileNotFoundError: if ``gguf_path`` does not exist.
    """
    loaded = load_gguf_model(gguf_path, inexact_as_float=dequantize)
    # Build and check everything before writing, so a failure leaves no half-written dir.
    tokenizer = load_gguf_tokenizer(loaded.metadata, loaded.architecture.chat_family)
    _check_rope_periods_reproducible(loaded)
    config = dict(loaded.config)
    if dequantize:
        dequantize_all_layers(loaded.model)
        config.pop("quantization", None)
        config.pop("quantization_config", None)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # The names come from the built model itself: exactly what mlx-lm's
    # load_weights(strict=True) expects after its sanitize (which leaves them as they are).
    weights = dict(tree_flatten(loaded.model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    save_config(config, config_path=out / "config.json")
    tokenizer.save_pretrained(str(out))
    _make_tokenizer_config_portable(out / "tokenizer_config.json", tokenizer.chat_template)
    if not (out / "chat_template.jinja").exists():
        # Older transformers keep the template only in tokenizer_config.json; current
        # loaders look for the .jinja file first.
        (out / "chat_template.jinja").write_text(tokenizer.chat_template, encoding="utf-8")
    _write_generation_config(out / "generation_config.json", loaded.metadata)
    return loaded.report.lines()


def _check_rope_periods_reproducible(loaded: GGUFModel) -> None:
    """A table may set RoPE periods from a tensor (Llama 3's rope_freqs); mlx-lm rebuilds
    them from config.json, so they must come out the same."""
    module = importlib.import_module(f"mlx_lm.models.{loaded.architecture.mlx_module}")
    fresh = dict(module.Model(module.ModelArgs.from_dict(loaded.config)).named_modules())
    for name, mod in loaded.model.named_modules():
        ours = getattr(mod, "_freqs", None)
        theirs = getattr(fresh.get(name), "_freqs", None)
        if ours is None or theirs is None:
            continue
        error = mx.max(mx.abs(ours - theirs) / mx.abs(ours)).item()
        if error > _PERIOD_TOLERANCE:
            raise UnsupportedModel(
                f"the file's RoPE frequencies ({name}) cannot be written as a config.json "
                f"rope_scaling (off by {error:.1e}); serve the .gguf file directly instead"
            )


def _write_generation_config(path: Path, metadata: dict) -> None:
    # mlx-lm takes its stop tokens from generation_config.json's eos_token_id.
    generation: dict[str, int | list[int]] = {}
    if (bos := metadata.get("tokenizer.ggml.bos_token_id")) is not None:
        generation["bos_token_id"] = int(bos)
    if eos_ids := gguf_eos_token_ids(metadata):
        generation["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    if (pad := metadata.get("tokenizer.ggml.padding_token_id")) is not None:
        generation["pad_token_id"] = int(pad)
    with open(path, "w", encoding="utf-8") as f:
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
