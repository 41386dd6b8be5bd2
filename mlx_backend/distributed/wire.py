"""The control channel's wire format: typed messages of numpy arrays over a TCP socket.

Rank 0 tells the other ranks what to run (plan, allocate, forward, close) with these
messages; nothing is pickled. A frame is a fixed header and the arrays one after another::

    header : magic "MXSV" | version u8 | kind u8 | array count u16 | payload bytes u64
    array  : dtype code u8 | ndim u8 | ndim x u64 dims | raw little-endian bytes

A ``ForwardBatch`` travels as a fixed list of its index arrays (``encode_batch``); the
sampling parameters stay on rank 0, which is the only rank that samples.
"""

from __future__ import annotations

import enum
import socket
import struct
from dataclasses import dataclass

import numpy as np

from mlxserve.scheduler.batch import ForwardBatch, SamplingArrays
from mlxserve.scheduler.memory_plan import MemoryPlan, PoolRequest

MAGIC = b"MXSV"
VERSION = 1
_HEADER = struct.Struct("<4sBBHQ")
_ARRAY = struct.Struct("<BB")
# Larger than any batch of index arrays: a frame announcing more is not ours.
MAX_PAYLOAD = 1 << 30
_DTYPES = (np.bool_, np.uint8, np.int32, np.int64, np.uint64, np.float32, np.float64)
_CODES = {np.dtype(t): i for i, t in enumerate(_DTYPES)}


class Kind(enum.IntEnum):
    """What a message asks for (rank 0 -> worker) or answers (worker -> rank 0)."""

    HELLO = 1  # worker: [rank, token]
    PLAN = 2  # rank 0: a PoolRequest
    PLANNED = 3  # worker: its MemoryPlan
    ALLOCATE = 4  # rank 0: the MemoryPlan every rank allocates
    ALLOCATED = 5  # worker: pools allocated
    FORWARD = 6  # rank 0: a ForwardBatch
    CLOSE = 7  # rank 0: free the pools and exit
    FAILED = 8  # worker: it cannot go on (utf-8 reason)


class WireError(RuntimeError):
    """A frame that is not a well-formed message of this format."""


class PeerClosed(ConnectionError):
    """The other end closed the channel (its process ended)."""


@dataclass(frozen=True)
class Message:
    kind: Kind
    arrays: tuple[np.ndarray, ...]


def encode(kind: Kind, arrays: list[np.ndarray] | tuple[np.ndarray, ...] = ()) -> bytes:
    """One frame holding ``arrays`` (each of a supported dtype, any shape)."""
    parts = []
    for a in arrays:
        a = np.ascontiguousarray(a)
        code = _CODES.get(a.dtype)
        if code is None:
            raise WireError(f"dtype {a.dtype} cannot be sent")
        parts.append(_ARRAY.pack(code, a.ndim) + struct.pack(f"<{a.ndim}Q", *a.shape))
        parts.append(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes())
    payload = b"".join(parts)
    return _HEADER.pack(MAGIC, VERSION, int(kind), len(arrays), len(payload)) + payload


def send(sock: socket.socket, kind: Kind, arrays: list[np.ndarray] | tuple = ()) -> None:
    sock.sendall(encode(kind, arrays))


def recv(sock: socket.socket) -> Message:
    """Block until a whole message arrives.

    Raises:
        PeerClosed: the peer closed the channel.
        WireError: the bytes are not a message of this format.
    """
    magic, version, kind, count, size = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if magic != MAGIC or version != VERSION:
        raise WireError(f"not an mlxserve control frame (magic {magic!r}, version {version})")
    if size > MAX_PAYLOAD:
        raise WireError(f"frame of {size} bytes is larger than {MAX_PAYLOAD}")
    try:
        kind = Kind(kind)
    except ValueError as e:
        raise WireError(f"unknown message kind {kind}") from e
    return Message(kind, decode_arrays(_recv_exact(sock, size), count))


def decode_arrays(payload: bytes, count: int) -> tuple[np.ndarray, ...]:
    """The ``count`` arrays of a frame's payload."""
    arrays = []
    view = memoryview(payload)
    at = 0
    for _ in range(count):
        if at + _ARRAY.size > len(view):
            raise WireError("truncated array descriptor")
        code, ndim = _ARRAY.unpack_from(view, at)
        at += _ARRAY.size
        if code >= len(_DTYPES) or at + 8 * ndim > len(view):
            raise WireError(f"bad array descriptor (dtype code {code}, ndim {ndim})")
        shape = struct.unpack_from(f"<{ndim}Q", view, at)
        at += 8 * ndim
        dtype = np.dtype(_DTYPES[code]).newbyteorder("<")
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if at + nbytes > len(view):
            raise WireError(f"array of shape {shape} runs past the frame")
        arrays.append(np.frombuffer(view[at : at + nbytes], dtype).reshape(shape).copy())
        at += nbytes
    if at != len(view):
        raise WireError(f"{len(view) - at} bytes left over after {count} arrays")
    return tuple(arrays)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise PeerClosed("the peer closed the control channel")
        got += k
    return bytes(buf)


# ---------------------------------------------------------------- typed payloads
_BATCH_FIELDS = (
    "input_ids",
    "computed_lens",
    "extend_lens",
    "write_slots",
    "read_slots",
    "sliding_write_slots",
    "sliding_read_slots",
    "sliding_read_start",
    "state_slots",
    "fresh_rows",
    "sample_rows",
    "state_copies_in",
    "state_snapshots",
)


def encode_batch(batch: ForwardBatch) -> list[np.ndarray]:
    """The arrays a worker needs to run ``batch``'s forward (not its sampling)."""
    groups = [np.asarray(g, np.int64) for g in batch.row_groups]
    embed = batch.embed_rows
    spec = batch.spec_lens
    meta = np.array([batch.phase == "prefill", embed is not None, spec is not None], np.int64)
    return [
        meta,
        *(np.asarray(getattr(batch, name)) for name in _BATCH_FIELDS),
        np.zeros(0, np.bool_) if embed is None else np.asarray(embed, np.bool_),
        # Rows with proposals change how the forward runs (packed, several positions).
        np.zeros(0, np.int32) if spec is None else np.asarray(spec, np.int32),
        np.array([len(g) for g in groups], np.int64),
        np.concatenate(groups) if groups else np.zeros(0, np.int64),
    ]


def decode_batch(arrays: tuple[np.ndarray, ...]) -> ForwardBatch:
    """The ``ForwardBatch`` of ``encode_batch``, with greedy sampling (workers do not
    sample: their tokens are thrown away, only their K/V writes and collectives count)."""
    if len(arrays) != len(_BATCH_FIELDS) + 5:
        raise WireError(f"a forward carries {len(_BATCH_FIELDS) + 5} arrays, got {len(arrays)}")
    meta, *fields = arrays[: len(_BATCH_FIELDS) + 1]
    if len(meta) != 3:
        raise WireError(f"a forward's header has 3 flags, got {len(meta)}")
    embed, spec, lengths, rows = arrays[len(_BATCH_FIELDS) + 1 :]
    values = dict(zip(_BATCH_FIELDS, fields, strict=True))
    b = int(values["input_ids"].shape[0])
    if int(lengths.sum()) != len(rows):
        raise WireError("row groups do not add up")
    groups = tuple(np.split(rows, np.cumsum(lengths)[:-1])) if len(lengths) else ()
    greedy = SamplingArrays(
        temperature=np.zeros(b, np.float32),
        top_p=np.ones(b, np.float32),
        top_k=np.zeros(b, np.int32),
        min_p=np.zeros(b, np.float32),
    )
    return ForwardBatch(
        phase="prefill" if meta[0] else "decode",
        request_ids=[f"row{i}" for i in range(b)],
        sampling=greedy,
        row_groups=groups,
        embed_rows=embed if meta[1] else None,
        spec_lens=spec if meta[2] else None,
        **values,
    )


def encode_pool_request(r: PoolRequest) -> list[np.ndarray]:
    ints = [r.max_total_tokens, r.max_running_requests, r.max_prefill_tokens]
    ints += [r.context_length, int(r.prefix_cache), r.memory_bytes]
    ints += [0 if r.kv_bits is None else r.kv_bits, r.kv_group_size]
    return [np.array(ints, np.int64), np.array([r.mem_fraction], np.float64)]


def decode_pool_request(arrays: tuple[np.ndarray, ...]) -> PoolRequest:
    total, running, prefill, context, prefix, memory, bits, group = (int(v) for v in arrays[0])
    return PoolRequest(
        max_total_tokens=total,
        max_running_requests=running,
        max_prefill_tokens=prefill,
        mem_fraction=float(arrays[1][0]),
        context_length=context,
        prefix_cache=bool(prefix),
        memory_bytes=memory,
        kv_bits=bits or None,
        kv_group_size=group,
    )


def encode_plan(p: MemoryPlan) -> list[np.ndarray]:
    window = -1 if p.window is None else p.window
    fields = [p.full_tokens, p.sliding_tokens, window, p.state_slots, p.pool_bytes]
    return [np.array([*fields, int(p.ragged_attention)])]


def decode_plan(arrays: tuple[np.ndarray, ...]) -> MemoryPlan:
    full, sliding, window, states, pool_bytes, ragged = (int(v) for v in arrays[0])
    window = None if window < 0 else window
    return MemoryPlan(full, sliding, window, states, pool_bytes, bool(ragged))


def encode_text(text: str) -> list[np.ndarray]:
    return [np.frombuffer(text.encode("utf-8", "replace"), np.uint8)]


def decode_text(arrays: tuple[np.ndarray, ...]) -> str:
    return arrays[0].tobytes().decode("utf-8", "replace") if arrays else ""
