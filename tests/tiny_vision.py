"""Tiny random-weight vision-language models, saved as loadable mlx-vlm directories.

Built from mlx-vlm's own config classes and ``Model`` (the module of the model type),
with the byte-level BPE tokenizer of ``tiny_models`` plus the family's image tokens, a
chat template that writes an image part as the family's placeholder text, and a
``preprocessor_config.json`` whose pixel bounds keep an image to a handful of
placeholder tokens. ``vlm_reference`` is mlx-vlm's own single-request greedy generation:
the oracle of the vision tests.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import io
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from tests.tiny_model_configs import (
    EOS_TOKEN,
    EOS_TOKEN_ID,
    HEAD_GAIN,
    TIED_EMBED_STD,
    VOCAB_SIZE,
)
from tests.tiny_models import _byte_level_tokenizer_json, _random_weights

# Image tokens follow the byte-level vocabulary (the Qwen-VL ones; gemma3's take the same
# ids with its own names).
VISION_START_ID = VOCAB_SIZE
IMAGE_TOKEN_ID = VOCAB_SIZE + 1
VISION_END_ID = VOCAB_SIZE + 2
VIDEO_TOKEN_ID = VOCAB_SIZE + 3
_QWEN_SPECIALS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
_GEMMA_SPECIALS = ["<start_of_image>", "<image_soft_token>", "<end_of_image>"]

_QWEN_TEXT = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "vocab_size": VOCAB_SIZE + 8,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
    "vision_start_token_id": VISION_START_ID,
    "image_token_id": IMAGE_TOKEN_ID,
    "vision_end_token_id": VISION_END_ID,
    "video_token_id": VIDEO_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
}

CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2_vl": {
        "model_type": "qwen2_vl",
        **_QWEN_TEXT,
        "vision_config": {
            "model_type": "qwen2_vl",
            "depth": 1,
            "embed_dim": 32,
            "hidden_size": 64,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "mlp_ratio": 2,
            "in_channels": 3,
        },
    },
    "qwen2_5_vl": {
        "model_type": "qwen2_5_vl",
        **_QWEN_TEXT,
        "vision_config": {
            "model_type": "qwen2_5_vl",
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": 64,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 56,
            "fullatt_block_indexes": [1],
            "in_channels": 3,
        },
    },
    "qwen3_vl": {
        "model_type": "qwen3_vl",
        "image_token_id": IMAGE_TOKEN_ID,
        "video_token_id": VIDEO_TOKEN_ID,
        "vision_start_token_id": VISION_START_ID,
        "vision_end_token_id": VISION_END_ID,
        "vocab_size": VOCAB_SIZE + 8,
        "eos_token_id": EOS_TOKEN_ID,
        "text_config": {
            "model_type": "qwen3_vl",
            "num_hidden_layers": 3,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "rms_norm_eps": 1e-6,
            "vocab_size": VOCAB_SIZE + 8,
            "rope_theta": 10000.0,
            "max_position_embeddings": 1024,
            "rope_scaling": {"type": "default", "mrope_section": [2, 3, 3]},
        },
        "vision_config": {
            "model_type": "qwen3_vl",
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": 64,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 16,
            "deepstack_visual_indexes": [0, 1],
            "in_channels": 3,
        },
    },
    "gemma3": {
        "model_type": "gemma3",
        "hidden_size": 64,
        "vocab_size": VOCAB_SIZE + 8,
        "image_token_index": IMAGE_TOKEN_ID,
        "boi_token_index": VISION_START_ID,
        "eoi_token_index": VISION_END_ID,
        "mm_tokens_per_image": 16,
        "eos_token_id": EOS_TOKEN_ID,
        "text_config": {
            "model_type": "gemma3_text",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "head_dim": 16,
            "num_key_value_heads": 2,
            "vocab_size": VOCAB_SIZE + 8,
            "sliding_window": 16,
            "sliding_window_pattern": 2,
            "mm_tokens_per_image": 16,
            "query_pre_attn_scalar": 16,
            "max_position_embeddings": 1024,
        },
        "vision_config": {
            "model_type": "siglip_vision_model",
            "num_hidden_layers": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "patch_size": 14,
            "image_size": 56,
        },
    },
    "llava": {
        "model_type": "llava",
        "image_token_index": IMAGE_TOKEN_ID,
        "vocab_size": VOCAB_SIZE + 8,
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "eos_token_id": EOS_TOKEN_ID,
        "text_config": {
            "model_type": "llama",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": VOCAB_SIZE + 8,
            "max_position_embeddings": 1024,
        },
        "vision_config": {
            "model_type": "clip_vision_model",
            "num_hidden_layers": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "image_size": 56,
            "patch_size": 14,
            "projection_dim": 32,
        },
    },
}

# 28x28-pixel merged patches: an image becomes between 4 and 16 placeholder tokens.
_QWEN_PROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "min_pixels": 28 * 28 * 4,
    "max_pixels": 28 * 28 * 16,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}

# A fixed 56x56 SigLIP input: 4x4 patches pooled to 4 placeholder tokens.
_GEMMA_PROCESSOR = {
    "image_processor_type": "Gemma3ImageProcessor",
    "size": {"height": 56, "width": 56},
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "do_pan_and_scan": False,
}

# A 56x56 CLIP input (resized and center-cropped): 4x4 patches, 16 placeholder tokens.
_LLAVA_PROCESSOR = {
    "image_processor_type": "CLIPImageProcessor",
    "size": {"shortest_edge": 56},
    "crop_size": {"height": 56, "width": 56},
    "do_center_crop": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}

# model type -> (its image tokens, the processor config, what the template writes per image)
_FAMILY_FILES = {
    "qwen2_vl": (_QWEN_SPECIALS, _QWEN_PROCESSOR, "<|vision_start|><|image_pad|><|vision_end|>"),
    "qwen2_5_vl": (
        _QWEN_SPECIALS,
        _QWEN_PROCESSOR,
        "<|vision_start|><|image_pad|><|vision_end|>",
    ),
    "qwen3_vl": (
        _QWEN_SPECIALS,
        {**_QWEN_PROCESSOR, "image_processor_type": "Qwen2VLImageProcessor", "patch_size": 14},
        "<|vision_start|><|image_pad|><|vision_end|>",
    ),
    "gemma3": (_GEMMA_SPECIALS, _GEMMA_PROCESSOR, "<start_of_image>"),
    "llava": (["<pad_0>", "<image>"], _LLAVA_PROCESSOR, "<image>"),
}


def _chat_template(image_text: str) -> str:
    return (
        "{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}"
        "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
        + image_text
        + "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )


def _model_module(model_type: str):
    return importlib.import_module(f"mlx_vlm.models.{model_type}")


def _merged(base: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in (overrides or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def build_tiny_vlm(model_type: str, seed: int = 0, overrides: dict[str, Any] | None = None):
    """The random mlx-vlm model of ``model_type`` in memory, and its config dict."""
    from mlx_vlm.utils import update_module_configs

    config = _merged(CONFIGS[model_type], overrides)
    module = _model_module(model_type)
    build = copy.deepcopy(config)
    build.setdefault("text_config", {})
    model_config = module.ModelConfig.from_dict(build)
    model_config = update_module_configs(model_config, module, build, ["text", "vision"])
    mx.random.seed(seed)
    model = module.Model(model_config)
    weights = dict(_random_weights(model))
    if model_type == "gemma3":
        # gemma3's head is tied (its sanitize copies the embedding over lm_head): a small
        # embedding keeps the input token from dominating (see tiny_models), and the head
        # gain goes into the final norm.
        embed = "language_model.model.embed_tokens.weight"
        weights[embed] = weights[embed] * (TIED_EMBED_STD / float(weights[embed].std()))
        del weights["language_model.lm_head.weight"]
        weights = model.language_model.sanitize(weights)
        norm = "language_model.model.norm.weight"
        weights[norm] = mx.full(weights[norm].shape, HEAD_GAIN)
    model.load_weights(list(weights.items()))
    model.eval()
    mx.eval(model.parameters())
    return model, config


def build_tiny_vlm_dir(
    model_type: str,
    path: Path,
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
    processor_overrides: dict[str, Any] | None = None,
) -> Path:
    """Write a loadable mlx-vlm directory for ``model_type`` at ``path`` (``overrides``
    merged into its config, ``processor_overrides`` into its processor config: larger
    models for benchmarks)."""
    from tokenizers import Tokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model, config = build_tiny_vlm(model_type, seed, overrides)
    mx.save_safetensors(
        str(path / "model.safetensors"),
        dict(tree_flatten(model.parameters())),
        metadata={"format": "mlx"},
    )
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    specials, processor, image_text = _FAMILY_FILES[model_type]
    tokenizer = Tokenizer.from_str(_byte_level_tokenizer_json())
    tokenizer.add_special_tokens(specials)
    assert tokenizer.token_to_id(specials[1]) == IMAGE_TOKEN_ID
    (path / "tokenizer.json").write_text(tokenizer.to_str())
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "model_max_length": 4096,
        "chat_template": _chat_template(image_text),
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    processor = _merged(processor, processor_overrides)
    (path / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    return path


def random_png(seed: int, width: int = 90, height: int = 60) -> bytes:
    """A PNG of random pixels (different seeds: different images)."""
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def vlm_reference(
    model_dir: Path, prompt_ids: list[int], images: list[bytes], max_tokens: int
) -> list[int]:
    """mlx-vlm's own greedy generation of one request: the image processor's pixels, the
    whole mlx-vlm model (vision tower, merge, M-RoPE), ``generate_step``.

    ``prompt_ids`` hold each image's placeholder already expanded (the count comes from
    the processor, as mlx-vlm's processor expands it).
    """
    from mlx_vlm.generate.ar import generate_step
    from mlx_vlm.utils import load_model
    from PIL import Image
    from transformers import AutoImageProcessor

    model = load_model(Path(model_dir))
    kwargs: dict[str, Any] = {}
    pixels = None
    if images:
        processor = AutoImageProcessor.from_pretrained(str(model_dir))
        pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
        inputs = processor(images=pil, return_tensors="np")
        pixels = mx.array(inputs["pixel_values"])
        if "image_grid_thw" in inputs:
            kwargs["image_grid_thw"] = mx.array(inputs["image_grid_thw"])
    ids = mx.array([prompt_ids])
    # gemma3's get_input_embeddings needs the attention mask (all ones: no padding).
    steps = generate_step(
        ids,
        model,
        pixels,
        mx.ones_like(ids),
        max_tokens=max_tokens,
        temperature=0.0,
        **kwargs,
    )
    return [int(token) for token, _ in steps]
