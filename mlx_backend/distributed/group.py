"""Forming the group: ``mx.distributed.init`` within a deadline, then the control channel.

MLX's collectives carry the forward's activations; the commands (what to run next) go over
a plain TCP connection from each worker to rank 0, which is also how an idle worker sleeps:
blocked in ``recv``, where a collective would busy-wait a core.

Rendezvous, once, right after ``init``::

    rank 0: listen on (its address, any port); all_sum([port, ip, token]) ; accept N-1
    rank r: all_sum(zeros) -> rank 0's port, ip, token ; connect ; HELLO [r, token]
"""

from __future__ import annotations

import faulthandler
import ipaddress
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlxserve.mlx_backend.distributed import wire

logger = logging.getLogger(__name__)


class GroupTimeout(TimeoutError):
    """The ranks did not all join within the deadline."""


@dataclass
class Group:
    """This process's place in the group and its control channel.

    Attributes:
        group: the MLX group (collectives).
        rank: this process's rank.
        size: number of ranks.
        workers: on rank 0, one socket per other rank (index ``r - 1``); empty elsewhere.
        leader: on the other ranks, the socket to rank 0; None on rank 0.
    """

    group: mx.distributed.Group
    rank: int
    size: int
    workers: list[socket.socket]
    leader: socket.socket | None
    # f(bytes) -> seconds of one all_sum (measure_all_sum), for the metrics' estimate.
    all_sum_seconds: Callable[[int], float] | None = None
    # How the model is split over the ranks: "tensor" (shard()) or "pipeline" (pipeline()).
    split: str = "tensor"


def init_group(backend: str, timeout: float) -> mx.distributed.Group:
    """``mx.distributed.init(strict=True)``; the process exits (status 1, a "Timeout"
    line and the stack on stderr) if the group has not formed after ``timeout`` seconds.

    NOTE: ``mx.distributed.init`` blocks in accept/connect while holding the GIL (measured:
    a thread calling it stops every other Python thread), so no Python-level timeout can
    fire; faulthandler's watchdog is a C thread that needs no GIL. The caller cancels it
    (``faulthandler.cancel_dump_traceback_later``) once the control channel is up.

    Raises:
        RuntimeError: the backend is not available.
    """
    faulthandler.dump_traceback_later(timeout, exit=True)
    try:
        return mx.distributed.init(strict=True, backend=backend)
    except RuntimeError as e:
        faulthandler.cancel_dump_traceback_later()
        raise RuntimeError(f"mx.distributed.init(backend={backend!r}): {e}") from e


def rank0_address(explicit: str | None) -> str:
    """The IPv4 address the other ranks reach rank 0's control channel at: ``explicit``,
    else rank 0's host in the ring hostfile (``MLX_HOSTFILE``) or JACCL's coordinator,
    else 127.0.0.1 (one machine)."""
    if explicit:
        return socket.gethostbyname(explicit)
    path = os.environ.get("MLX_HOSTFILE")
    if path and os.path.exists(path):
        with open(path) as f:
            hosts = json.load(f)
        first = hosts[0][0] if isinstance(hosts[0], list) else hosts[0]
        if isinstance(first, str) and ":" in first:
            return socket.gethostbyname(first.rsplit(":", 1)[0])
    coordinator = os.environ.get("MLX_JACCL_COORDINATOR")
    if coordinator:
        return socket.gethostbyname(coordinator.rsplit(":", 1)[0])
    return "127.0.0.1"


def connect_group(group: mx.distributed.Group, timeout: float, address: str | None = None) -> Group:
    """Open the control channel between rank 0 and every other rank.

    Raises:
        GroupTimeout: a rank did not connect within ``timeout`` seconds.
        ConnectionError: a connection failed or presented the wrong token.
    """
    rank, size = group.rank(), group.size()
    deadline = time.monotonic() + timeout
    listener = None
    info = np.zeros(7, np.int32)
    if rank == 0:
        host = rank0_address(address)
        listener = socket.create_server((host, 0))
        token = secrets.randbits(48)
        ip = ipaddress.IPv4Address(host).packed
        info[:] = [listener.getsockname()[1], *ip, token >> 24, token & 0xFFFFFF]
    total = mx.distributed.all_sum(mx.array(info), group=group, stream=mx.cpu)
    port, a, b, c, d, high, low = (int(v) for v in np.array(total))
    token = (high << 24) | low
    if rank == 0:
        try:
            workers = _accept_workers(listener, size, token, deadline)
        finally:
            listener.close()
        return Group(group, rank, size, workers, None)
    host = f"{a}.{b}.{c}.{d}"
    try:
        leader = socket.create_connection((host, port), timeout=max(deadline - time.monotonic(), 1))
    except OSError as e:
        raise ConnectionError(f"rank {rank}: cannot reach rank 0 at {host}:{port}: {e}") from e
    leader.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    wire.send(leader, wire.Kind.HELLO, [np.array([rank, token], np.int64)])
    leader.settimeout(None)
    return Group(group, rank, size, [], leader)


def _accept_workers(
    listener: socket.socket, size: int, token: int, deadline: float
) -> list[socket.socket]:
    workers: list[socket.socket | None] = [None] * (size - 1)
    while any(w is None for w in workers):
        left = deadline - time.monotonic()
        if left <= 0:
            missing = [r + 1 for r, w in enumerate(workers) if w is None]
            raise GroupTimeout(f"ranks {missing} did not open the control channel in time")
        listener.settimeout(left)
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        conn.settimeout(max(deadline - time.monotonic(), 1))
        try:
            hello = wire.recv(conn)
        except (OSError, wire.WireError) as e:
            logger.warning("dropping a control connection: %s", e)
            conn.close()
            continue
        peer, got = (int(v) for v in hello.arrays[0]) if hello.arrays else (-1, -1)
        if hello.kind != wire.Kind.HELLO or got != token or not 0 < peer < size:
            logger.warning("dropping a control connection that is not one of our ranks")
            conn.close()
            continue
        conn.settimeout(None)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        workers[peer - 1] = conn
    return workers  # type: ignore[return-value]


def measure_all_sum(group: mx.distributed.Group, repeats: int = 8, chain: int = 16):  # noqa: ANN201
    """Time all_sums of a few sizes on every rank (collectives: all ranks call it).

    Each timing evaluates ``chain`` dependent all_sums in one graph, as a forward does
    (one eval per all_sum would mostly time the eval's own overhead).

    Returns:
        ``f(nbytes) -> seconds`` of one all_sum, a latency + bytes / bandwidth fit of the
        fastest runs, for the metrics' estimate of the time a step spends in collectives.
        NOTE: the fastest, not the median: on a loaded CPU one run in a few pays a
        scheduler time slice (measured 115 us, then 9.8 ms, on 2 busy cores), so the
        estimate is the floor the link allows.
    """
    points = []
    for nbytes in (64, 1 << 18, 1 << 22):
        x = mx.ones((nbytes // 4,), mx.float32)
        times = []
        for i in range(repeats + 1):
            y = x
            for _ in range(chain):
                y = mx.distributed.all_sum(y, group=group) * (1.0 / group.size())
            start = time.perf_counter()
            mx.eval(y)
            if i:  # the first one warms up
                times.append((time.perf_counter() - start) / chain)
        points.append((nbytes, min(times)))
    latency = points[0][1]
    per_byte = max((points[-1][1] - latency) / (points[-1][0] - points[0][0]), 0.0)
    logger.info(
        "all_sum over %d ranks: %.0f us latency, %.2f GB/s",
        group.size(),
        latency * 1e6,
        (1 / per_byte / 1e9) if per_byte else float("inf"),
    )
    return lambda n: latency + n * per_byte
