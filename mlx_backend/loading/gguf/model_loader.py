"""Load a GGUF file as an mlx-lm model through its architecture table.

The model is built from mlx-lm's own ``ModelArgs``; each of its parameters is looked up in
the file by gguf-py's tensor-name map (or the table's overrides), converted one tensor at a
time (``tensor_convert``), transformed back from llama.cpp's layout, and loaded strictly:
every mlx-lm parameter must come from the file and every tensor in the file must be used.
Layers the file holds quantized are quantized in the model with the file's bit widths.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from mlxserve.mlx_backend.loading.gguf.architectures import architecture_for
from mlxserve.mlx_backend.loading.gguf.architectures.base import (
    Architecture,
    Hparams,
    UnsupportedModel,
)
from mlxserve.mlx_backend.loading.gguf.load_report import LoadReport
from mlxserve.mlx_backend.loading.gguf.quantization_config import quantization_config
from mlxserve.mlx_backend.loading.gguf.reader import GGUFFile
from mlxserve.mlx_backend.loading.gguf.tensor_convert import (
    ConvertedTensor,
    check_supported,
    convert_tensor,
)

_GGUF_ARCHES = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}


@dataclass
class GGUFModel:
    """A loaded GGUF model.

    Attributes:
        model: the mlx-lm model, weights evaluated, in eval mode.
        config: HF-shaped config (mlx-lm ``model_type``; ``quantization`` per layer when any
            layer is quantized), what ``mlxserve convert`` writes as ``config.json``.
        metadata: the file's GGUF metadata (plain Python values).
        architecture: the table used.
        report: how each tensor type was handled.
    """

    model: nn.Module
    config: dict[str, Any]
    metadata: dict[str, Any]
    architecture: Architecture
    report: LoadReport = field(default_factory=LoadReport)


def load_gguf_model(path: str, *, inexact_as_float: bool | None = None) -> GGUFModel:
    """Load ``path`` as an mlx-lm model.

    Args:
        path: the GGUF file.
        inexact_as_float: formats MLX cannot hold exactly (Q6_K, Q3_K, Q2_K, IQ*, TQ*)
            become exact float32 values (True) or MLX 8-bit quantization of them (False,
            for weights meant to stay quantized). None: True on the CPU backend when the
            whole model fits in memory as float32 (the CPU path dequantizes every layer
            after loading anyway, see ``dequantize.py``), else False.

    Returns:
        The ``GGUFModel``. On the CPU backend every float is float32.

    Raises:
        UnsupportedModel: the architecture, a tensor, a tensor type, a shape or a
            metadata value is not supported; the message names it.
        GGUFError: the file is not a readable GGUF file (e.g. truncated).
        OSError: the file cannot be read.
    """
    with GGUFFile(path) as gf:
        arch = architecture_for(gf.architecture)
        for info in gf.tensors.values():
            check_supported(info)
        if inexact_as_float is None:
            inexact_as_float = _float32_fits(gf)
        float_dtype = mx.float32 if mx.default_device() == mx.cpu else None

        def read_float(name: str) -> np.ndarray:
            t = convert_tensor(
                gf, gf.tensors[name], quantizable=False, inexact_as_float=True, float_dtype=None
            )
            return np.array(t.weight.astype(mx.float32))

        hp = Hparams(arch.gguf_name, gf.metadata, gf.tensors, read_float)
        config = arch.config(hp)
        model = _build_model(arch, config)
        report = LoadReport()
        weights, quant, sources = _convert_parameters(
            gf, arch, model, config, inexact_as_float, float_dtype, report
        )
        extra = {n: read_float(n) for n in arch.extra_tensors if n in gf.tensors}
        metadata = gf.metadata

    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    _check_complete(model, weights, sources)
    if quant:
        nn.quantize(model, class_predicate=lambda p, m: quant.get(p, False))
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:  # MLX names the parameter; keep it one line
        raise UnsupportedModel(f"{arch.gguf_name}: {' '.join(str(e).split())}") from e
    del weights
    if arch.post_load is not None:
        arch.post_load(model, extra, config)
    model.eval()
    mx.eval(model.parameters())
    if quant:
        config["quantization"] = config["quantization_config"] = quantization_config(quant)
    return GGUFModel(model, config, metadata, arch, report)


def _build_model(arch: Architecture, config: dict[str, Any]) -> nn.Module:
    """mlx-lm's model for the table's config (lazy random weights, replaced before use)."""
    module = importlib.import_module(f"mlx_lm.models.{arch.mlx_module}")
    try:
        return module.Model(module.ModelArgs.from_dict(config))
    except (TypeError, KeyError, AssertionError, ValueError) as e:
        # Metadata values mlx-lm's model cannot be built with (missing or contradictory).
        raise UnsupportedModel(
            f"{arch.gguf_name}: mlx-lm's {arch.mlx_module} cannot be built from the file's "
            f"metadata ({type(e).__name__}: {' '.join(str(e).split())})"
        ) from e


def _convert_parameters(gf, arch, model, config, inexact_as_float, float_dtype, report):
    """Every mlx-lm parameter from its GGUF tensor: ``(weights, per-module quantization)``."""
    names = gguf.get_tensor_name_map(_GGUF_ARCHES[arch.gguf_name], config_layers(config))
    modules = dict(model.named_modules())
    weights: dict[str, mx.array] = {}
    quant: dict[str, dict] = {}
    sources: dict[str, str] = {}
    used: set[str] = set()
    for mlx_name, param in tree_flatten(model.parameters()):
        gguf_name = arch.override(mlx_name) or names.get_name(mlx_name, (".weight", ".bias"))
        if gguf_name is None:
            raise UnsupportedModel(f"{arch.gguf_name}: no GGUF tensor maps to {mlx_name}")
        sources[mlx_name] = gguf_name
        if gguf_name not in gf.tensors:
            continue  # a tied head (sanitize drops it) or missing: _check_complete decides
        used.add(gguf_name)
        info = gf.tensors[gguf_name]
        path, _, kind = mlx_name.rpartition(".")
        transforms = [t for t in arch.transforms if t.matches(mlx_name)]
        quantizable = (
            kind == "weight"
            and hasattr(modules.get(path), "to_quantized")
            and not any(t.needs_float for t in transforms)
        )
        tensor = convert_tensor(
            gf,
            info,
            quantizable=quantizable,
            inexact_as_float=inexact_as_float,
            float_dtype=float_dtype,
        )
        for t in transforms:
            tensor = tensor.map_rows(lambda a, t=t: t.fn(a, config))
        _check_shape(tensor, param.shape, gguf_name, mlx_name)
        report.add(info.type_name, tensor.handling, _detail(tensor))
        weights[mlx_name] = tensor.weight
        if tensor.quantization is not None:
            quant[path] = tensor.quantization
            weights[f"{path}.scales"] = tensor.scales
            if tensor.biases is not None:
                weights[f"{path}.biases"] = tensor.biases
    unused = sorted(set(gf.tensors) - used - arch.extra_tensors)
    if unused:
        shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
        raise UnsupportedModel(
            f"{arch.gguf_name}: GGUF tensors with no place in mlx-lm's {arch.mlx_module} "
            f"model: {shown}"
        )
    return weights, quant, sources


def _float32_fits(gf: GGUFFile) -> bool:
    if mx.default_device() != mx.cpu:
        return False
    from mlxserve.mlx_backend.loading.dequantize import default_growth_budget_bytes

    float32_bytes = sum(4 * t.n_elements for t in gf.tensors.values())
    file_bytes = sum(t.nbytes for t in gf.tensors.values())
    return float32_bytes - file_bytes <= default_growth_budget_bytes()


def config_layers(config: dict) -> int:
    return int(config["num_hidden_layers"])


def _detail(tensor: ConvertedTensor) -> dict[str, str]:
    if tensor.quantization is not None:
        mode = tensor.quantization["mode"]
        return {
            "bits": str(tensor.quantization["bits"]),
            "mode": "" if mode == "affine" else f" ({mode})",
        }
    return {"dtype": str(tensor.weight.dtype).removeprefix("mlx.core.")}


def _check_shape(tensor: ConvertedTensor, expected, gguf_name: str, mlx_name: str) -> None:
    shape = tuple(tensor.weight.shape)
    if tensor.quantization is not None:
        shape = (*shape[:-1], shape[-1] * 32 // tensor.quantization["bits"])
    if shape != tuple(expected):
        raise UnsupportedModel(
            f"GGUF tensor {gguf_name!r} has shape {shape}; mlx-lm's {mlx_name} needs "
            f"{tuple(expected)} (metadata and tensors disagree)"
        )


def _check_complete(model: nn.Module, weights: dict[str, mx.array], sources: dict[str, str]):
    """After ``sanitize`` (which drops a tied head): every parameter must have a tensor."""
    missing = [
        f"{sources.get(n, '?')} (for {n})"
        for n, _ in tree_flatten(model.parameters())
        if n not in weights
    ]
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise UnsupportedModel(f"the GGUF file lacks tensors: {shown}")
