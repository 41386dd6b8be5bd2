"""Turn a quantized model's layers into float32 ones on MLX's CPU backend, when memory allows.

MLX's CPU ``quantized_matmul`` is a naive kernel that does not batch: SmolLM2-135M 4-bit
decodes at ~5-6 tok/s whatever the batch size. Dense float32 weights instead go through
``cblas_sgemm``, which with OpenBLAS (see ``cpu/blas.py``) is many times faster and
scales with the batch. On Metal the quantized kernels are fast, so nothing is done there.

A model whose float32 weights do not fit stays quantized, its half-precision parameters
(scales, biases, norms) widened to float32: the native ``mx.quantized_matmul``
(``mlx_backend/quantized_matmul.py``) then serves its products instead of MLX's naive kernel.

``mlx_lm.utils.dequantize_model`` is not reused: it keeps the scales' dtype (often bfloat16,
which the CPU computes slowly), leaves biases in their dtype, builds the whole dense graph
lazily at once and has no memory check.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from mlxserve.mlx_backend.memory import available_memory_bytes

logger = logging.getLogger(__name__)

_MiB = 1 << 20
# Left free when no budget is given: the KV pool is sized from what remains after loading.
_MIN_MARGIN_BYTES = 1 << 30
_MARGIN_FRACTION = 0.2


@dataclass(frozen=True)
class DequantStatus:
    """The outcome of :func:`dequantize_for_cpu`.

    Attributes:
        dequantized: quantized layers were replaced by float32 ones.
        layers: how many layers were (or, if not dequantized, would have been) replaced.
        bytes_before: parameter bytes of the model before.
        bytes_after: parameter bytes after (kept quantized: half-precision parameters may have
            been widened to float32).
        reason: one human-readable line.
    """

    dequantized: bool
    layers: int
    bytes_before: int
    bytes_after: int
    reason: str


def dequantize_for_cpu(model: nn.Module, budget_bytes: int | None = None) -> DequantStatus:
    """Replace quantized layers by float32 ones on the CPU backend if the growth fits the budget.

    Handles ``nn.QuantizedLinear``, ``nn.QuantizedEmbedding`` (``nn.Embedding`` keeps
    ``as_linear`` for tied heads) and mlx-lm's ``QuantizedSwitchLinear`` (MoE experts). When it
    dequantizes, the model's remaining floating parameters (norms, biases) are cast to float32
    too, so every op runs in float32: the CPU computes half precision slowly, through float32.
    The model is updated in place.

    Args:
        model: the loaded model.
        budget_bytes: how many bytes the parameters may grow by. None: the available system
            memory minus a margin (the larger of 1 GiB and 20%), left for the KV pool and
            activations.

    Returns:
        A :class:`DequantStatus` with the parameter bytes before and after.
    """
    before = _param_bytes(model)
    if mx.default_device().type != mx.cpu:
        return DequantStatus(False, 0, before, before, "not on the CPU backend: kept quantized")
    targets = _quantized_modules(model)
    if not targets:
        return DequantStatus(False, 0, before, before, "no quantized layers")

    quantized = sum(_param_bytes(m) for _, m in targets)
    dense = sum(_dense_bytes(m) for _, m in targets)
    # Non-quantized parameters that would be widened to float32 as well.
    widened = sum(
        v.size * (4 - v.dtype.size)
        for v in _float_leaves(model)
        if v.dtype in (mx.float16, mx.bfloat16)
    )
    growth = dense - quantized + widened
    if budget_bytes is None:
        budget_bytes = default_growth_budget_bytes()
    if growth > budget_bytes:
        reason = (
            f"kept quantized: float32 weights need {growth / _MiB:.0f} MiB more, "
            f"budget {max(budget_bytes, 0) / _MiB:.0f} MiB"
        )
        if widen_half_precision(model):
            reason += "; half-precision scales, biases and norms widened to float32"
        return DequantStatus(False, len(targets), before, _param_bytes(model), reason)

    dequantize_all_layers(model)
    after = _param_bytes(model)
    return DequantStatus(
        True,
        len(targets),
        before,
        after,
        f"dequantized {len(targets)} layers to float32: "
        f"{before / _MiB:.0f} MiB -> {after / _MiB:.0f} MiB",
    )


def dequantize_all_layers(model: nn.Module) -> int:
    """Replace every quantized layer by its float32 equivalent, on any backend, and cast the
    remaining half-precision parameters to float32 (``mlxserve convert --dequantize``).

    Returns:
        The number of layers replaced.
    """
    targets = _quantized_modules(model)
    replacements = []
    for name, module in targets:
        dense_module = _to_dense(module)
        # One layer at a time: the lazy graph and peak memory stay one layer big.
        mx.eval(dense_module.parameters())
        replacements.append((name, dense_module))
    if replacements:
        model.update_modules(tree_unflatten(replacements))
    model.update(tree_map(_as_float32, model.parameters()))
    mx.eval(model.parameters())
    return len(targets)


def widen_half_precision(model: nn.Module) -> int:
    """Cast the half-precision parameters of a model kept quantized (scales, biases, norms)
    to float32 on the CPU backend: the CPU computes half precision through float32 anyway,
    and the native ``mx.quantized_matmul`` takes float32 scales. They are a few percent of
    the quantized weights (a 4-bit group of 64 has one scale and one bias).

    Returns:
        The bytes the parameters grew by (0 on a GPU or when nothing was half precision).
    """
    if mx.default_device().type != mx.cpu:
        return 0
    before = _param_bytes(model)
    model.update(tree_map(_as_float32, model.parameters()))
    mx.eval(model.parameters())
    return _param_bytes(model) - before


def default_growth_budget_bytes() -> int:
    """How many bytes the parameters may grow by when dequantized: the available system
    memory minus a margin (the larger of 1 GiB and 20%) left for the KV pool and activations."""
    available = available_memory_bytes()
    return available - max(_MIN_MARGIN_BYTES, int(available * _MARGIN_FRACTION))


def _quantized_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    kinds: tuple[type, ...] = (nn.QuantizedLinear, nn.QuantizedEmbedding)
    try:
        from mlx_lm.models.switch_layers import QuantizedSwitchLinear

        kinds += (QuantizedSwitchLinear,)
    except ImportError:  # an mlx-lm without MoE layers: nothing of that kind to find
        pass
    return [(name, m) for name, m in model.named_modules() if isinstance(m, kinds)]


def _param_bytes(module: nn.Module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def _float_leaves(module: nn.Module) -> list[mx.array]:
    return [v for _, v in tree_flatten(module.parameters()) if mx.issubdtype(v.dtype, mx.floating)]


def _dense_bytes(module: nn.Module) -> int:
    """float32 bytes of the module's weight (and bias) once dequantized."""
    *lead, packed_cols = module.weight.shape
    cols = packed_cols * 32 // module.bits  # weights are packed into uint32 words
    size = cols
    for d in lead:
        size *= d
    bias = module["bias"].size if "bias" in module else 0
    return 4 * (size + bias)


def _dense_weight(module: nn.Module) -> mx.array:
    kwargs = {"group_size": module.group_size, "bits": module.bits, "mode": module.mode}
    biases = module.get("biases")
    global_scale = getattr(module, "global_scale", None)
    if global_scale is not None and global_scale.ndim > 0 and module.weight.ndim == 3:
        # mlx-lm quantizes each expert with its own nvfp4 global scale: undo it per expert.
        return mx.stack(
            [
                mx.dequantize(
                    module.weight[e],
                    module.scales[e],
                    None if biases is None else biases[e],
                    global_scale=global_scale[e],
                    dtype=mx.float32,
                    **kwargs,
                )
                for e in range(module.weight.shape[0])
            ]
        )
    return mx.dequantize(
        module.weight,
        module.scales,
        biases,
        global_scale=global_scale,
        dtype=mx.float32,
        **kwargs,
    )


def _to_dense(module: nn.Module) -> nn.Module:
    """The float32 equivalent of one quantized module."""
    weight = _dense_weight(module)
    has_bias = "bias" in module
    if isinstance(module, nn.QuantizedEmbedding):
        dense = nn.Embedding(weight.shape[0], weight.shape[1])
    elif isinstance(module, nn.QuantizedLinear):
        dense = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias)
    else:  # QuantizedSwitchLinear: weight is (experts, out, in)
        from mlx_lm.models.switch_layers import SwitchLinear

        dense = SwitchLinear(weight.shape[2], weight.shape[1], weight.shape[0], bias=has_bias)
    # Assigning replaces the constructors' random init before it is ever evaluated.
    dense.weight = weight
    if has_bias:
        dense.bias = module["bias"].astype(mx.float32)
    return dense


def _as_float32(value: mx.array) -> mx.array:
    if value.dtype in (mx.float16, mx.bfloat16):
        return value.astype(mx.float32)
    return value
