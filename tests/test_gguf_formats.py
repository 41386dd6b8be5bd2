"""GGUF block formats and the file reader, against gguf-py (llama.cpp's own package).

Random blocks (random bytes with finite float16 scale fields) of every format are decoded
by our converters and compared with ``gguf.quants.dequantize``: the exactly mapped formats
through MLX's own ``mx.dequantize`` of our packed representation, bit for bit.
"""

from __future__ import annotations

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from mlxserve.mlx_backend.loading.gguf.affine_formats import AFFINE_FORMATS
from mlxserve.mlx_backend.loading.gguf.float_formats import FLOAT_DECODED, decode_to_float32
from mlxserve.mlx_backend.loading.gguf.packing import pack_rows
from mlxserve.mlx_backend.loading.gguf.reader import GGUFError, GGUFFile
from mlxserve.mlx_backend.loading.gguf.tensor_convert import convert_tensor
from tests.gguf_quantizers import K_QUANTIZERS

T = gguf.GGMLQuantizationType
# Byte offsets of each format's float16 scale fields (random bytes there could be inf/nan).
F16_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2],
    "Q5_K": [0, 2], "Q6_K": [208], "Q3_K": [108], "Q2_K": [80, 82], "MXFP4": [],
}  # fmt: skip


def random_blocks(name: str, n: int = 48, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    _, type_size = GGML_QUANT_SIZES[T[name]]
    blocks = rng.integers(0, 256, size=(n, type_size), dtype=np.uint8)
    for start in F16_FIELDS.get(name, []):
        scale = (rng.standard_normal((n, 1)) * 0.02).astype(np.float16)
        blocks[:, start : start + 2] = scale.view(np.uint8)
    if name == "MXFP4":
        blocks[:, 0] = rng.integers(100, 140, size=n)  # E8M0 exponents near 2**0
    return blocks


class TestExactFormats:
    @pytest.mark.parametrize("name", sorted(AFFINE_FORMATS))
    def test_mlx_dequantizes_our_packing_to_gguf_py_values(self, name):
        fmt = AFFINE_FORMATS[name]
        blocks = random_blocks(name)
        decoded = fmt.decode(blocks)
        biases = None if decoded.biases is None else mx.array(decoded.biases)
        ours = mx.dequantize(
            mx.array(pack_rows(decoded.q, fmt.bits)),
            mx.array(decoded.scales),
            biases,
            group_size=32,
            bits=fmt.bits,
            mode=fmt.mode,
            dtype=mx.float32,
        )
        ref = dequantize(blocks, T[name]).reshape(blocks.shape[0], -1)
        diff = np.abs(np.array(ours) - ref).max()
        assert np.array_equal(np.array(ours), ref), f"{name}: differs from gguf-py by {diff}"


class TestFloatFormats:
    @pytest.mark.parametrize("name", ["Q6_K", "Q3_K", "Q2_K"])
    def test_our_decoders_equal_gguf_py(self, name):
        blocks = random_blocks(name)
        ref = dequantize(blocks, T[name]).reshape(blocks.shape[0], -1)
        ours = decode_to_float32(name, blocks)
        assert np.array_equal(ours, ref), f"{name}: differs by {np.abs(ours - ref).max()}"

    def test_every_gguf_py_type_is_converted_or_named(self):
        from mlxserve.mlx_backend.loading.gguf.tensor_convert import SUPPORTED_TYPES

        refused = {t.name for t in T} - SUPPORTED_TYPES
        # Activation-only formats, integer tensors and formats gguf-py cannot decode.
        assert refused == {"Q8_1", "Q8_K", "I8", "I16", "I32", "I64", "Q1_0"}, refused
        assert FLOAT_DECODED >= {"IQ1_S", "IQ2_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "TQ2_0"}


class TestPacking:
    @pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
    def test_matches_mlx_dequantize(self, bits):
        rng = np.random.default_rng(bits)
        q = rng.integers(0, 2**bits, size=(3, 64), dtype=np.uint8)
        scales = rng.random((3, 2), dtype=np.float32)
        biases = rng.random((3, 2), dtype=np.float32)
        w = mx.dequantize(
            mx.array(pack_rows(q, bits)), mx.array(scales), mx.array(biases), group_size=32,
            bits=bits,
        )  # fmt: skip
        want = np.repeat(scales, 32, 1) * q + np.repeat(biases, 32, 1)
        assert np.allclose(np.array(w), want, rtol=0, atol=0), f"{bits}-bit packing"


class TestKQuantEncoders:
    @pytest.mark.parametrize("name", sorted(K_QUANTIZERS))
    def test_encoded_values_are_what_gguf_py_decodes(self, name):
        x = np.random.default_rng(1).standard_normal((4, 512)).astype(np.float32) * 0.05
        raw, values = K_QUANTIZERS[name](x)
        decoded = dequantize(raw, T[name])
        assert np.array_equal(decoded, values), f"{name}: the encoder's values disagree"
        assert np.abs(values - x).max() < 0.02, f"{name}: encoding error too large"


def write_file(path, tensors: dict[str, tuple[np.ndarray, str]], arch: str = "llama") -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    for name, (data, kind) in tensors.items():
        raw = None if kind in ("F32", "F16") else T[kind]
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


class TestConvertTensor:
    def test_bf16_stays_exact_and_bfloat16_off_the_cpu(self, tmp_path):
        x = np.array([[1.0, -2.5, 65504.0 * 4, 3e-39] * 8], dtype=np.float32)
        bf16 = gguf.quants.quantize(x, T.BF16)
        write_file(tmp_path / "b.gguf", {"w": (bf16, "BF16")})
        with GGUFFile(str(tmp_path / "b.gguf")) as gf:
            info = gf.tensors["w"]
            as_float = convert_tensor(
                gf, info, quantizable=True, inexact_as_float=True, float_dtype=mx.float32
            )
            native = convert_tensor(
                gf, info, quantizable=True, inexact_as_float=True, float_dtype=None
            )
        want = dequantize(bf16, T.BF16)
        assert np.array_equal(np.array(as_float.weight), want), "BF16 -> float32 is not exact"
        assert native.weight.dtype == mx.bfloat16, f"kept as {native.weight.dtype}"
        assert np.isfinite(np.array(as_float.weight)).all(), "values over 65504 must not be inf"

    def test_q6_k_requantized_only_when_asked(self, tmp_path):
        x = np.random.default_rng(2).standard_normal((4, 256)).astype(np.float32)
        raw, values = K_QUANTIZERS["Q6_K"](x)
        write_file(tmp_path / "q.gguf", {"w": (raw, "Q6_K")})
        with GGUFFile(str(tmp_path / "q.gguf")) as gf:
            exact = convert_tensor(
                gf, gf.tensors["w"], quantizable=True, inexact_as_float=True, float_dtype=None
            )
            kept = convert_tensor(
                gf, gf.tensors["w"], quantizable=True, inexact_as_float=False, float_dtype=None
            )
        assert exact.handling == "dequantized" and np.array_equal(np.array(exact.weight), values)
        assert kept.handling == "requantized" and kept.quantization["bits"] == 8, kept.quantization


class TestReader:
    def test_truncated_file_is_refused_with_the_tensor_named(self, tmp_path):
        x = np.ones((8, 64), dtype=np.float32)
        write_file(tmp_path / "t.gguf", {"a": (x, "F32"), "b": (x, "F32")})
        data = (tmp_path / "t.gguf").read_bytes()
        (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 100])
        with pytest.raises(GGUFError, match="truncated.*'b'"):
            GGUFFile(str(tmp_path / "cut.gguf"))

    def test_truncated_header_is_refused(self, tmp_path):
        x = np.ones((8, 64), dtype=np.float32)
        write_file(tmp_path / "t.gguf", {"a": (x, "F32")})
        (tmp_path / "cut.gguf").write_bytes((tmp_path / "t.gguf").read_bytes()[:40])
        with pytest.raises(GGUFError, match="truncated"):
            GGUFFile(str(tmp_path / "cut.gguf"))

    def test_not_a_gguf_file(self, tmp_path):
        (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04" + b"\0" * 64)
        with pytest.raises(GGUFError, match="not a GGUF file"):
            GGUFFile(str(tmp_path / "x.gguf"))

    def test_unknown_type_id_is_kept_and_named(self, tmp_path):
        # A type id gguf-py does not know (MLX's reader silently drops such tensors and all
        # that follow): the reader lists it, the converter refuses it by name.
        from mlxserve.mlx_backend.loading.gguf.tensor_convert import (
            UnsupportedTensorType,
            check_supported,
        )

        x = np.ones((2, 32), dtype=np.float32)
        write_file(tmp_path / "u.gguf", {"a": (x, "F32"), "b": (x, "F32")})
        data = bytearray((tmp_path / "u.gguf").read_bytes())
        # The tensor table entry of "a": name, n_dims=2, dims, then the u32 type (0 = F32).
        at = data.index(b"\x01\x00\x00\x00\x00\x00\x00\x00a") + 9 + 4 + 16
        data[at : at + 4] = (77).to_bytes(4, "little")
        (tmp_path / "u.gguf").write_bytes(bytes(data))
        with GGUFFile(str(tmp_path / "u.gguf")) as gf:
            assert list(gf.tensors) == ["a", "b"], "a tensor after the unknown type was dropped"
            with pytest.raises(UnsupportedTensorType, match="'a'.*type 77"):
                check_supported(gf.tensors["a"])

    def test_metadata_values(self, tmp_path):
        writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "qwen3")
        writer.add_uint32("qwen3.block_count", 7)
        writer.add_float32("qwen3.rope.freq_base", 1e6)
        writer.add_array("tokenizer.ggml.tokens", ["a", "é", "<|x|>"])
        writer.add_array("qwen3.attention.head_count_kv", [0, 2, 0])
        writer.add_bool("tokenizer.ggml.add_bos_token", True)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with GGUFFile(str(tmp_path / "m.gguf")) as gf:
            md = gf.metadata
        assert md["general.architecture"] == "qwen3" and md["qwen3.block_count"] == 7, md
        assert md["qwen3.rope.freq_base"] == pytest.approx(1e6), md
        assert md["tokenizer.ggml.tokens"] == ["a", "é", "<|x|>"], md
        assert md["qwen3.attention.head_count_kv"] == [0, 2, 0], md
        assert md["tokenizer.ggml.add_bos_token"] is True, md
