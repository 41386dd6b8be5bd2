"""Read a GGUF file: header, metadata and tensor table parsed in Python, tensor data mapped.

Nothing but the header is read up front: each tensor's bytes are a view into one memory
map, decoded by the caller one tensor at a time and then released (``release``), so the
pages of a tensor already converted do not stay in the process's resident memory.

Layout (GGUF v2/v3, little-endian)::

    "GGUF" u32 version | u64 n_tensors | u64 n_kv
    n_kv x   (string key, u32 value type, value)
    n_tensors x (string name, u32 n_dims, u64 dims[n_dims] innermost first, u32 type, u64 offset)
    padding to general.alignment (default 32), then the tensor data; offsets are relative to it
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

# GGUF metadata value types (gguf.GGUFValueType) -> numpy dtypes of fixed-size scalars.
_SCALARS: dict[int, np.dtype] = {
    0: np.dtype("<u1"),
    1: np.dtype("<i1"),
    2: np.dtype("<u2"),
    3: np.dtype("<i2"),
    4: np.dtype("<u4"),
    5: np.dtype("<i4"),
    6: np.dtype("<f4"),
    7: np.dtype("?"),
    10: np.dtype("<u8"),
    11: np.dtype("<i8"),
    12: np.dtype("<f8"),
}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4
_DEFAULT_ALIGNMENT = 32
_PAGE = mmap.PAGESIZE
_U64 = struct.Struct("<Q")


class GGUFError(ValueError):
    """The file is not a GGUF file we can read; the message names what and where."""


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table.

    Attributes:
        name: GGUF tensor name, e.g. ``blk.0.attn_q.weight``.
        type_id: the ggml type id as stored.
        type_name: its name (``Q4_K``) or ``type <id>`` when the id is unknown.
        dims: GGUF dims, innermost (contiguous) first.
        offset: absolute byte offset of the data in the file.
        nbytes: bytes of data (0 when the type is unknown).
    """

    name: str
    type_id: int
    type_name: str
    dims: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The numpy / MLX shape (outermost first)."""
        return tuple(reversed(self.dims))

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n


def ggml_type_name(type_id: int) -> str:
    """``Q4_K`` for 12; ``type 99`` for an id gguf-py does not know."""
    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"type {type_id}"


class GGUFFile:
    """A GGUF file opened for reading.

    Use as a context manager (or call ``close``); ``metadata`` and ``tensors`` are read on
    open, tensor bytes on demand with ``tensor_bytes``.

    Raises:
        GGUFError: not a GGUF file, an unsupported version, or a truncated / corrupt
            header or tensor table (a tensor whose data lies past the end of the file).
        OSError: the file cannot be opened.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._file = open(path, "rb")  # noqa: SIM115 - closed in close()
        try:
            size = os.fstat(self._file.fileno()).st_size
            if size < 24:
                raise GGUFError(f"{path} is not a GGUF file (only {size} bytes)")
            self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
            self.size = size
            self.metadata, self.tensors = self._parse()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Unmap and close the file (idempotent)."""
        mapped = getattr(self, "_map", None)
        if mapped is not None:
            try:
                mapped.close()
            except BufferError:
                # A caller still holds a view; the map goes when the view does.
                pass
            self._map = None
        self._file.close()

    @property
    def architecture(self) -> str | None:
        value = self.metadata.get("general.architecture")
        return value if isinstance(value, str) else None

    def tensor_bytes(self, info: TensorInfo) -> np.ndarray:
        """The raw bytes of one tensor as a read-only uint8 view into the map (no copy)."""
        return np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def release(self, info: TensorInfo) -> None:
        """Drop the tensor's pages from this process's resident memory (they stay in the
        page cache and are read again if touched)."""
        if self._map is None or info.nbytes == 0 or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = info.offset - info.offset % _PAGE
        end = min(self.size, info.offset + info.nbytes)
        self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    # -- parsing ---------------------------------------------------------------------------

    def _parse(self) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
        buf, path = self._map, self.path
        if buf[:4] != b"GGUF":
            raise GGUFError(f"{path} is not a GGUF file (magic {bytes(buf[:4])!r})")
        (version,) = struct.unpack_from("<I", buf, 4)
        if version not in (2, 3):
            if version & 0xFFFF == 0 and version >> 16 in (2, 3):
                raise GGUFError(f"{path} is a big-endian GGUF file; only little-endian is read")
            raise GGUFError(f"{path}: GGUF version {version} is not supported (need 2 or 3)")
        n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
        cursor = _Cursor(buf, 24, path)
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cursor.string()
            metadata[key] = cursor.value(cursor.u32())
        raw_infos = []
        for _ in range(n_tensors):
            name = cursor.string()
            n_dims = cursor.u32()
            if not 1 <= n_dims <= _MAX_DIMS:
                raise GGUFError(f"{path}: tensor {name!r} has {n_dims} dimensions")
            dims = tuple(int(d) for d in cursor.array_of("<u8", n_dims))
            raw_infos.append((name, dims, cursor.u32(), cursor.u64()))
        alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"{path}: general.alignment {alignment} is not a power of two")
        data_start = -(-cursor.pos // alignment) * alignment
        tensors: dict[str, TensorInfo] = {}
        for name, dims, type_id, offset in raw_infos:
            info = self._tensor_info(name, dims, type_id, data_start + offset)
            if name in tensors:
                raise GGUFError(f"{path}: tensor {name!r} is listed twice")
            tensors[name] = info
        return metadata, tensors

    def _tensor_info(self, name: str, dims: tuple[int, ...], type_id: int, offset: int):
        type_name = ggml_type_name(type_id)
        nbytes = 0
        if type_name in GGMLQuantizationType.__members__:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
            if any(d <= 0 for d in dims):
                raise GGUFError(f"{self.path}: tensor {name!r} has dims {dims}")
            if dims[0] % block:
                raise GGUFError(
                    f"{self.path}: tensor {name!r} ({type_name}) has rows of {dims[0]} values, "
                    f"not a multiple of its block of {block}"
                )
            n = 1
            for d in dims:
                n *= d
            nbytes = n // block * type_size
            if offset + nbytes > self.size:
                raise GGUFError(
                    f"{self.path} is truncated: tensor {name!r} needs bytes {offset}.."
                    f"{offset + nbytes} but the file has {self.size}"
                )
        return TensorInfo(name, type_id, type_name, dims, offset, nbytes)


class _Cursor:
    """Reads GGUF values from a buffer, raising ``GGUFError`` at the end of the data."""

    def __init__(self, buf: mmap.mmap, pos: int, path: str) -> None:
        self.buf, self.pos, self.path = buf, pos, path

    def _take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > len(self.buf):
            raise GGUFError(
                f"{self.path} is truncated or corrupt: the header runs past the end of the "
                f"file (byte {start} + {n} of {len(self.buf)})"
            )
        self.pos = start + n
        return start

    def u32(self) -> int:
        return struct.unpack_from("<I", self.buf, self._take(4))[0]

    def u64(self) -> int:
        return struct.unpack_from("<Q", self.buf, self._take(8))[0]

    def string(self) -> str:
        n = self.u64()
        start = self._take(n)
        try:
            return self.buf[start : start + n].decode("utf-8")
        except UnicodeDecodeError:
            # Some vocabularies hold invalid UTF-8 pieces; keep them readable, never fail.
            return self.buf[start : start + n].decode("utf-8", "replace")

    def strings(self, count: int) -> list[str]:
        """``count`` strings in a row (vocabularies: ~10x the speed of ``string`` calls)."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        unpack = _U64.unpack_from
        out = []
        append = out.append
        for _ in range(count):
            if pos + 8 > end:
                break
            (n,) = unpack(buf, pos)
            pos += 8
            if pos + n > end:
                break
            append(buf[pos : pos + n].decode("utf-8", "replace"))
            pos += n
        self.pos = pos
        if len(out) < count:
            self._take(end + 1 - pos)  # raises the truncation error
        return out

    def array_of(self, dtype: str | np.dtype, count: int) -> np.ndarray:
        dt = np.dtype(dtype)
        start = self._take(dt.itemsize * count)
        return np.frombuffer(self.buf, dtype=dt, count=count, offset=start).copy()

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.array_of(_SCALARS[vtype], 1)[0].item()
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.u32(), self.u64()
            if etype in _SCALARS:
                return self.array_of(_SCALARS[etype], count).tolist()
            if etype == _STRING:
                return self.strings(count)
            if etype == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
        raise GGUFError(f"{self.path}: unknown GGUF metadata value type {vtype} at byte {self.pos}")
