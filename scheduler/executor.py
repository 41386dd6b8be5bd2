"""The Executor protocol: what the engine needs from a backend (numpy in, numpy out).

The engine thread owns the executor: every call but ``materialize`` is made on it. The MLX
implementation is ``mlx_backend.executor.MLXExecutor``; tests drive the engine with fakes.

An executor may also have ``launch(batch, after=None, after_rows=None)``: start a decode
step without waiting and return a handle whose ``result()`` gives its ``ForwardOutput``
(given ``after``, a handle not yet collected, the batch's rows feed the tokens ``after``
samples for its rows ``after_rows``), and ``overlaps_by_default``: whether doing so pays
on its device. The engine then overlaps decode steps (``scheduler/lookahead.py``,
``EngineConfig.overlap``); without ``launch`` every step is a ``forward``.
"""

from __future__ import annotations

from typing import Protocol

from mlxserve.scheduler.batch import ForwardBatch, ForwardOutput
from mlxserve.scheduler.memory_plan import MemoryPlan, MemoryStats, PoolRequest


class Executor(Protocol):
    """Runs a model over slot-indexed pools, one ``ForwardBatch`` at a time."""

    @property
    def vocab_size(self) -> int:
        """The width of the model's logits (token ids ``0..vocab_size-1`` can be sampled)."""
        ...

    def materialize(self) -> None:
        """Finish whatever the model left lazy, on the thread that loaded it (called before
        the engine thread starts)."""
        ...

    def plan(self, request: PoolRequest) -> MemoryPlan:
        """Slot counts for the model's layers: how many token slots of each space and how
        many recurrent-state slots fit.

        Raises:
            MemoryError: not even one slot fits.
        """
        ...

    def allocate(self, plan: MemoryPlan) -> None:
        """Allocate the pools of ``plan`` (once, before the first ``forward``)."""
        ...

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """Feed the batch's tokens, write their K/V and states to the batch's slots, and
        sample one token per row.

        Raises:
            ExecutorFailed: the executor can run nothing more (``scheduler/outputs.py``);
                the engine fails every request and stops.
            Exception: the forward failed; the engine fails the batch's requests.
        """
        ...

    def memory(self) -> MemoryStats:
        """The backend's memory now (any thread)."""
        ...

    def close(self) -> None:
        """Free the pools and wait for outstanding device work (engine thread, at exit)."""
        ...
