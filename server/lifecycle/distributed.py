"""The process side of tensor parallelism: forming the group, starting local ranks, and the
life of a rank other than 0 (load its shard, run rank 0's forwards, never bind HTTP).

``mlxserve --tensor-parallel N`` starts ranks 1..N-1 itself, as children running the same
command with ``--distributed`` (ring backend, one ``127.0.0.1`` port per rank); under
``mlx.launch`` every rank runs the command given to it. Either way each process forms the
group within ``--distributed-timeout`` or exits with status 2, so no rank hangs.
"""

from __future__ import annotations

import ctypes
import faulthandler
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mlxserve.scheduler.config import EngineConfig
from mlxserve.server.config import DistributedConfig, ModelConfig

logger = logging.getLogger(__name__)

# Exit status of a rank whose group did not form in time (or could not be reached).
GROUP_FAILED_EXIT = 2


@dataclass
class LocalRanks:
    """Ranks 1..N-1 this process started, and the hostfile they share."""

    processes: list[subprocess.Popen] = field(default_factory=list)
    hostfile: str | None = None

    def stop(self, timeout: float = 10.0) -> None:
        """Wait for the ranks to exit (they do once rank 0 closes), then make them."""
        for proc in self.processes:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if self.hostfile and os.path.exists(self.hostfile):
            os.unlink(self.hostfile)


def free_loopback_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (held together so they differ)."""
    socks = [socket.create_server(("127.0.0.1", 0)) for _ in range(n)]
    try:
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def share_cpus(ranks: int) -> None:
    """Give each of ``ranks`` local ranks its share of the CPUs for OpenBLAS (unless the
    user fixed a count); call before OpenBLAS loads. Each rank otherwise starts a thread
    per CPU, and on the CPU backend N ranks x all CPUs threads (plus a rank spinning in a
    collective) oversubscribe the cores each rank waits on."""
    if any(os.environ.get(k) for k in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS")):
        return
    os.environ["OPENBLAS_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // ranks))


def start_local_ranks(argv: Sequence[str], ranks: int) -> LocalRanks:
    """Start ranks 1..ranks-1 as children running ``argv`` with ``--distributed``, and
    make this process rank 0 of the same ring (``MLX_RANK``, ``MLX_HOSTFILE``)."""
    hosts = [[f"127.0.0.1:{p}"] for p in free_loopback_ports(ranks)]
    fd, hostfile = tempfile.mkstemp(prefix="mlxserve-ring-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(hosts, f)
    local = LocalRanks(hostfile=hostfile)
    command = [
        sys.executable,
        "-c",
        "import sys; from mlxserve.server.cli import main; sys.exit(main(sys.argv[1:]))",
        *argv,  # holds --tensor-parallel N or --pipeline-parallel N
        "--distributed",
        "--distributed-backend",
        "ring",
    ]
    for rank in range(1, ranks):
        env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": hostfile}
        local.processes.append(
            subprocess.Popen(command, env=env, preexec_fn=_die_with_parent)  # noqa: PLW1509
        )
    os.environ["MLX_RANK"] = "0"
    os.environ["MLX_HOSTFILE"] = hostfile
    logger.info("started %d local ranks (ring over %s)", ranks - 1, hostfile)
    return local


def _die_with_parent() -> None:
    """In a local rank, before exec: die when rank 0 dies, however it dies (Linux)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def form_group(config: DistributedConfig, on_exit: Callable[[], None] | None = None):  # noqa: ANN201
    """This process's rank in a formed group with its control channel.

    Exits the process when the group does not form within ``config.distributed_timeout``:
    with status 1 from the watchdog while ``mx.distributed.init`` blocks (it holds the
    GIL), with ``GROUP_FAILED_EXIT`` (after ``on_exit``: stop local ranks) when the
    control channel cannot be opened.
    """
    from mlxserve.mlx_backend.distributed.group import (
        connect_group,
        init_group,
        measure_all_sum,
    )

    rank = os.environ.get("MLX_RANK", "?")
    print(
        f"mlxserve: rank {rank}: joining the {config.distributed_backend} group; giving up "
        f"after {config.distributed_timeout:g} s",
        file=sys.stderr,
        flush=True,
    )
    try:
        # A watchdog (no GIL needed) ends the process if this does not finish in time.
        mx_group = init_group(config.distributed_backend, config.distributed_timeout)
        if config.ranks > 1 and mx_group.size() != config.ranks:
            raise RuntimeError(
                f"{config.ranks} ranks asked for but the group has {mx_group.size()}"
            )
        group = connect_group(mx_group, config.distributed_timeout, config.distributed_host)
        group.all_sum_seconds = measure_all_sum(mx_group)
        group.split = config.split
        faulthandler.cancel_dump_traceback_later()
    except (TimeoutError, ConnectionError, RuntimeError, ValueError) as e:
        logger.error("%s", e)
        print(f"mlxserve: error: {e}", file=sys.stderr, flush=True)
        if on_exit is not None:
            on_exit()
        logging.shutdown()
        os._exit(GROUP_FAILED_EXIT)
    logger.info("rank %d of %d joined the group", group.rank, group.size)
    return group


def run_rank(group, model_config: ModelConfig, engine_config: EngineConfig) -> int:  # noqa: ANN001
    """Ranks 1..N-1: load this rank's shard, then run rank 0's calls until it closes.

    Returns:
        0 when rank 0 closed the group, 1 when it went away or a step failed.
    """
    from mlxserve.mlx_backend.distributed import wire
    from mlxserve.mlx_backend.distributed.sharding import split_model
    from mlxserve.mlx_backend.distributed.worker import run_worker
    from mlxserve.mlx_backend.executor import MLXExecutor
    from mlxserve.mlx_backend.loading.loader import load_model
    from mlxserve.server.lifecycle.loading import convert_for_backend

    try:
        loaded = load_model(model_config.model, keep_quantized=model_config.keep_quantized)
        if loaded.kind == "encoder":
            raise ValueError("encoder models are not served tensor-parallel")
        if not model_config.keep_quantized:
            convert_for_backend(loaded)
        split_model(loaded.model, group.group, group.split)
    except Exception as e:  # noqa: BLE001 - told to rank 0, which fails its load too
        logger.error("rank %d cannot load its shard: %s", group.rank, e)
        try:
            wire.send(group.leader, wire.Kind.FAILED, wire.encode_text(str(e)))
        except OSError:
            pass
        return 1
    executor = MLXExecutor(loaded.model, seed=engine_config.seed)
    return run_worker(executor, group.leader, group.rank)
