"""Load a llama.cpp GGUF file as an mlx-lm model.

``mx.load`` already decodes GGUF Q4_0 / Q4_1 / Q8_0 blocks into MLX's affine
quantized layout (``name.weight`` packed uint32, ``name.scales``, ``name.biases``,
group size 32), so this module only has to rename the tensors to mlx-lm's names,
undo llama.cpp's RoPE row permutation of the q/k projections, and quantize the
mlx-lm model per layer with the bit widths the file uses.
"""

from __future__ import annotations

import mmap
import re
import struct
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama

SUPPORTED_ARCHITECTURES = ("llama",)

# ggml_type ids (ggml.h) -> names, so that errors can say what the file holds.
GGML_TYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
    23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M",
    30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}  # fmt: skip
# MLX keeps these quantized (or float); any other type it would either reject or
# silently dequantize to float16, losing the memory savings, so we refuse it.
SUPPORTED_GGML_TYPES = frozenset({0, 1, 2, 3, 8})
# Q4_0, Q4_1 and Q8_0 all quantize blocks of 32 values.
GGUF_GROUP_SIZE = 32

# GGUF metadata value types -> struct format of fixed-size scalars.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q"}
_SCALAR_FORMATS.update({11: "q", 12: "d"})
_GGUF_STRING, _GGUF_ARRAY = 8, 9

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_TENSOR_RE = re.compile(r"^(?:blk\.(\d+)\.)?(\w+)\.(weight|bias|scales|biases)$")


def read_gguf_tensor_info(path: str) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Read the tensor table of a GGUF file without loading any data.

    ``mx.load`` does not report the on-disk type of a tensor, so this parses the
    header (memory-mapped, so the multi-megabyte vocabulary is skipped cheaply).

    Args:
        path: the GGUF file.

    Returns:
        ``{tensor name: (ggml type id, dims)}``; dims in GGUF order (innermost first).

    Raises:
        ValueError: if the file is not a GGUF v2/v3 file.
    """
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                return _parse_tensor_info(buf, path)
            except struct.error as e:
                raise ValueError(f"{path} is a truncated or corrupt GGUF file ({e})") from e


def _parse_tensor_info(buf: mmap.mmap, path: str) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Walk the GGUF header in ``buf``: skip the metadata, collect the tensor table."""
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version < 2:
        raise ValueError(f"GGUF version {version} of {path} is not supported (need >= 2)")
    pos = 24

    def read_string(pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, pos)
        return buf[pos + 8 : pos + 8 + n].decode("utf-8", "replace"), pos + 8 + n

    def skip_value(vtype: int, pos: int) -> int:
        if vtype in _SCALAR_FORMATS:
            return pos + struct.calcsize(_SCALAR_FORMATS[vtype])
        if vtype == _GGUF_STRING:
            return pos + 8 + struct.unpack_from("<Q", buf, pos)[0]
        if vtype == _GGUF_ARRAY:
            etype, count = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if etype in _SCALAR_FORMATS:
                return pos + count * struct.calcsize(_SCALAR_FORMATS[etype])
            for _ in range(count):
                pos = skip_value(etype, pos)
            return pos
        raise ValueError(f"Unknown GGUF metadata value type {vtype} in {path}")

    for _ in range(n_kv):
        _, pos = read_string(pos)
        (vtype,) = struct.unpack_from("<I", buf, pos)
        pos = skip_value(vtype, pos + 4)

    infos: dict[str, tuple[int, tuple[int, ...]]] = {}
    for _ in range(n_tensors):
        name, pos = read_string(pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        ggml_type, _offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        infos[name] = (ggml_type, tuple(dims))
    return infos


def metadata_value(metadata: dict, key: str, default: Any = None) -> Any:
    """A GGUF metadata entry as a plain Python value (``mx.load`` gives 0-d arrays).

    Args:
        metadata: the metadata dict from ``mx.load(..., return_metadata=True)``.
        key: the GGUF key, e.g. ``"llama.context_length"``.
        default: returned when the key is absent.

    Returns:
        A str / int / float / bool / list, or ``default``.
    """
    value = metadata.get(key, default)
    if isinstance(value, mx.array):
        return value.item() if value.ndim == 0 else value.tolist()
    return value


def _float32_value(x: float) -> float:
    # GGUF stores these as float32; 7 significant digits give back the intended
    # value (1e-05 rather than 9.999999747378752e-06) for config.json.
    return float(f"{float(x):.7g}")


def gguf_config(metadata: dict, n_vocab: int | None = None) -> dict:
    """Build an HF ``config.json``-shaped dict from GGUF metadata.

    Args:
        metadata: GGUF metadata (from ``mx.load``).
        n_vocab: vocabulary size to fall back on when the metadata has none.

    Returns:
        The config dict (without the ``quantization`` entry).

    Raises:
        ValueError: if ``general.architecture`` is not supported.
    """
    arch = metadata_value(metadata, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise ValueError(f"Unsupported GGUF architecture {arch!r} (supported: {supported})")

    def get(key: str, default: Any = None) -> Any:
        return metadata_value(metadata, f"{arch}.{key}", default)

    def require(key: str) -> int:
        if (value := get(key)) is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return int(value)

    n_heads = require("attention.head_count")
    hidden = require("embedding_length")
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab_size = get("vocab_size") or (len(tokens) if tokens else n_vocab)
    config: dict[str, Any] = {
        "model_type": arch,
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": require("block_count"),
        "intermediate_size": require("feed_forward_length"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", n_heads)),
        "head_dim": int(get("attention.key_length", hidden // n_heads)),
        "rms_norm_eps": _float32_value(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _float32_value(get("rope.freq_base", 10000.0)),
        "vocab_size": int(vocab_size),
        "max_position_embeddings": int(get("context_length", 2048)),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
    }
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ValueError(f"Unsupported GGUF rope scaling type {scaling!r}")
        config["rope_scaling"] = {"type": "linear", "factor": float(get("rope.scaling.factor"))}
    for key, gguf_key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
    ):
        if (value := metadata_value(metadata, gguf_key)) is not None:
            config[key] = int(value)
    return config


def _mlx_name(gguf_name: str) -> str:
    """Map a GGUF tensor name onto the mlx-lm parameter name."""
    match = _TENSOR_RE.match(gguf_name)
    if match is not None:
        layer, base, suffix = match.groups()
        if layer is not None and base in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[base]}.{suffix}"
        if layer is None and base in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[base]}.{suffix}"
    raise ValueError(f"Unsupported GGUF tensor {gguf_name!r} (no llama mapping)")


def _unpermute(w: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's ``permute`` of q/k rows (HF half-split RoPE -> interleaved).

    llama.cpp reorders each head's rows from ``[first half, second half]`` into
    interleaved pairs so its RoPE kernel can rotate adjacent values; mlx-lm's
    llama uses the HF (non-traditional) RoPE, so the rows must go back. Rows are
    independent of the quantization groups (those run along the columns), so the
    same permutation applies to packed weights, scales and biases.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf_weights(path: str) -> tuple[dict[str, mx.array], dict, dict]:
    """Read a GGUF file into mlx-lm named weights plus config and metadata.

    Args:
        path: the GGUF file.

    Returns:
        ``(weights, config, metadata)``: weights under mlx-lm names with float
        tensors in float32; config in HF shape including a ``quantization`` entry
        when any layer is quantized; the raw GGUF metadata.

    Raises:
        ValueError: unsupported architecture, tensor type, tensor name or bit width.
    """
    infos = read_gguf_tensor_info(path)
    for name, (ggml_type, _) in infos.items():
        if ggml_type not in SUPPORTED_GGML_TYPES:
            type_name = GGML_TYPE_NAMES.get(ggml_type, f"type {ggml_type}")
            raise ValueError(
                f"Unsupported GGUF tensor type {type_name} (tensor {name!r}); supported: "
                "F32, F16, Q4_0, Q4_1, Q8_0"
            )
    try:
        raw, metadata = mx.load(path, return_metadata=True)
    except RuntimeError as e:  # MLX reports unreadable tensor data this way
        raise ValueError(f"Cannot read GGUF file {path}: {e}") from e
    config = gguf_config(metadata, n_vocab=infos.get("token_embd.weight", (0, (0, 0)))[1][-1])
    n_heads, n_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]

    weights: dict[str, mx.array] = {}
    for gguf_name, value in raw.items():
        name = _mlx_name(gguf_name)
        if value.dtype != mx.uint32:
            # GGUF keeps scales/biases in float16; on MLX's CPU backend float16
            # math is ~40x slower than float32, so the whole model runs in float32.
            value = value.astype(mx.float32)
        if ".self_attn.q_proj." in name:
            value = _unpermute(value, n_heads)
        elif ".self_attn.k_proj." in name:
            value = _unpermute(value, n_kv_heads)
        weights[name] = value

    if "lm_head.weight" in weights:
        config["tie_word_embeddings"] = False
    if any(name.endswith(".bias") and "self_attn" in name for name in weights):
        config["attention_bias"] = True

    quantization = _layer_quantization(weights, infos)
    if quantization:
        config["quantization"] = quantization
        config["quantization_config"] = quantization
    return weights, config, metadata


def _layer_quantization(
    weights: dict[str, mx.array], infos: dict[str, tuple[int, tuple[int, ...]]]
) -> dict[str, Any]:
    """Per-layer ``{"group_size", "bits"}`` of the quantized weights, mlx-lm config style.

    The bit width follows from the packed width: ``in_dims`` values packed into
    ``weight.shape[-1]`` uint32 words; the group size from the scales' width.
    """
    gguf_in_dims = {_mlx_name(n).rsplit(".", 1)[0]: dims[0] for n, (_, dims) in infos.items()}
    per_layer: dict[str, dict[str, int]] = {}
    for name, scales in weights.items():
        if not name.endswith(".scales"):
            continue
        layer = name[: -len(".scales")]
        in_dims = gguf_in_dims.get(layer, scales.shape[-1] * GGUF_GROUP_SIZE)
        bits = weights[f"{layer}.weight"].shape[-1] * 32 // in_dims
        if bits not in (2, 3, 4, 5, 6, 8):
            raise ValueError(f"Unsupported quantization of {layer}: {bits} bits")
        per_layer[layer] = {"group_size": in_dims // scales.shape[-1], "bits": bits}
    if not per_layer:
        return {}
    # The most common setting is the default; layers that differ are listed by path.
    settings = [tuple(sorted(q.items())) for q in per_layer.values()]
    default = dict(max(set(settings), key=settings.count))
    quantization: dict[str, Any] = {**default, "mode": "affine"}
    for layer, q in per_layer.items():
        if q != default:
            quantization[layer] = q
    # Float layers in a quantized file must stay float when mlx-lm reloads it.
    for name in weights:
        layer = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and layer not in per_layer and "norm" not in layer:
            quantization[layer] = False
    return quantization


def load_gguf_model(path: str) -> tuple[nn.Module, dict, dict]:
    """Load a GGUF file as an mlx-lm model computing in float32.

    Args:
        path: the GGUF file (architecture ``llama``; tensors F32/F16/Q4_0/Q4_1/Q8_0).

    Returns:
        ``(model, config, metadata)``: the mlx-lm ``llama.Model`` with its weights
        loaded and evaluated, the HF-shaped config (with ``quantization`` when the
        file is quantized), and the raw GGUF metadata.

    Raises:
        ValueError: unsupported architecture, tensor type or tensor name.
        FileNotFoundError: if ``path`` does not exist.
    """
    weights, config, metadata = load_gguf_weights(path)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    quantization = config.get("quantization", {})

    def class_predicate(p: str, m: nn.Module) -> bool | dict:
        if p in quantization:
            return quantization[p]
        if not hasattr(m, "to_quantized") or f"{p}.scales" not in weights:
            return False
        return {"group_size": quantization["group_size"], "bits": quantization["bits"]}

    if quantization:
        nn.quantize(model, class_predicate=class_predicate)
    model.eval()
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model, config, metadata
