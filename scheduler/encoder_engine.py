"""The engine of an encoder embedding model (BERT family): one thread batching inputs by length.

An encoder has no KV cache, no decode and no sampling: each request is one input, run once
through the whole model. The thread takes the oldest waiting requests (up to
``max_running_requests``), sorts them into forwards of similar length (``row_groups.py``:
padding costs as much as a real token on the CPU), each within ``max_prefill_tokens``
padded positions, and delivers each request's pooled embedding as its one, finished event.
It offers the same ``EngineClient`` protocol as the decoder engine, for embedding requests
only; it never imports MLX (the model runs behind an ``EncoderExecutor``).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from mlxserve.scheduler.config import EngineConfig
from mlxserve.scheduler.memory_plan import MemoryPlan, MemoryStats
from mlxserve.scheduler.outputs import FinishReason, RequestOutput
from mlxserve.scheduler.row_groups import plan_row_groups
from mlxserve.scheduler.sampling_params import SamplingParams
from mlxserve.scheduler.stats import EngineStats, RequestStats, StatsObserver

logger = logging.getLogger(__name__)


class EncoderExecutor(Protocol):
    """Runs an encoder model over a padded batch (numpy in, numpy out)."""

    def materialize(self) -> None:
        """Finish whatever the model left lazy, on the thread that loaded it."""
        ...

    def encode(self, input_ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """The pooled embeddings of a batch.

        Args:
            input_ids: int32 ``[B, L]``, right-padded with 0.
            lengths: int32 ``[B]``, the real tokens of each row.

        Returns:
            float32 ``[B, hidden]``, pooled as the model's pooling config says.
        """
        ...

    def memory(self) -> MemoryStats:
        """The backend's memory now (any thread)."""
        ...

    def close(self) -> None:
        """Drop the model and wait for outstanding device work (engine thread)."""
        ...


@dataclass(eq=False)
class _Input:
    request_id: str
    ids: list[int]
    on_output: Callable[[RequestOutput], None]
    stats: RequestStats = field(default_factory=RequestStats)


class EncoderEngine:
    """An ``EngineClient`` serving embedding requests of an encoder model.

    Args:
        executor: the model (``mlx_backend.encoder_executor.MLXEncoderExecutor``).
        config: ``max_running_requests`` (inputs per batch) and ``max_prefill_tokens``
            (padded positions per forward).
        context_length: the longest input the model takes (its position embeddings).
    """

    def __init__(self, executor: EncoderExecutor, config: EngineConfig, *, context_length: int):
        self.executor = executor
        self.config = config
        self.context_length = context_length
        self.max_context_len = context_length
        self.max_running_requests = config.max_running_requests
        # No KV pools: what a loaded model takes is its weights.
        self.plan: MemoryPlan | None = None
        self.observer: StatsObserver | None = None
        self.error: BaseException | None = None
        self._waiting: list[_Input] = []
        self._aborted: set[str] = set()
        self._running = 0
        self._encoded = 0
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self.executor.materialize()
        self._thread = threading.Thread(target=self._run, name="mlxserve-encoder", daemon=True)
        self._thread.start()
        # NOTE: as for the decoder engine, MLX work still running at interpreter exit
        # aborts the process; a forgotten shutdown() must not turn into a crash.
        atexit.register(self.shutdown)

    def shutdown(self) -> None:
        """Stop the thread (idempotent); requests still queued are not served."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        atexit.unregister(self.shutdown)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # ----------------------------------------------------------------- API (any thread)
    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        on_output: Callable[[RequestOutput], None],
        grammar: object = None,
        constraint: object = None,
        cache_namespace: str = "",
        embed: bool = False,
    ) -> None:
        """Queue an embedding request (``embed`` must be set; the rest is ignored).

        Raises:
            ValueError: a generation request, or an input longer than the context.
        """
        if not embed:
            raise ValueError("an encoder model only embeds: it cannot generate text")
        if not prompt_ids or len(prompt_ids) > self.max_context_len:
            raise ValueError(
                f"input of {len(prompt_ids)} tokens: an input takes 1 to "
                f"{self.max_context_len} tokens"
            )
        with self._cond:
            self._waiting.append(_Input(request_id, list(prompt_ids), on_output))
            self._cond.notify()

    def compile_grammar(self, spec: object) -> object:
        raise ValueError("an encoder model only embeds: it takes no grammar")

    def abort(self, request_id: str, reason: FinishReason = "abort") -> None:
        """Drop a request (idempotent); it ends with an ``abort`` event."""
        with self._cond:
            self._aborted.add(request_id)
            self._cond.notify()

    def stats(self) -> EngineStats:
        memory = self.executor.memory()
        with self._cond:
            waiting, running = len(self._waiting), self._running
        return EngineStats(
            num_running=running,
            num_waiting=waiting,
            prompt_tokens_computed=self._encoded,
            mlx_active_bytes=memory.active,
            mlx_peak_bytes=memory.peak,
            mlx_cache_bytes=memory.cache,
        )

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Block until no request is queued or running; False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._cond:
                if not self._waiting and not self._running:
                    return True
            if not self.is_alive:
                return False
            time.sleep(0.01)
        return False

    def check_integrity(self) -> None:
        """Nothing is held between requests: assert the engine is idle."""
        with self._cond:
            assert not self._waiting and not self._running, "check_integrity needs an idle engine"

    # ----------------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                batch = self._take()
                if batch:
                    self._encode(batch)
        except BaseException as e:
            logger.exception("encoder thread died")
            self.error = e
            with self._cond:
                failed, self._waiting = self._waiting, []
            for item in failed:
                self._deliver(
                    item,
                    RequestOutput(
                        item.request_id, finished=True, finish_reason="error", error=str(e)
                    ),
                )
        finally:
            self.executor.close()

    def _take(self) -> list[_Input]:
        """The next batch: the oldest waiting inputs, at most ``max_running_requests``;
        aborted ones are answered here."""
        with self._cond:
            if not self._waiting and not self._aborted:
                self._cond.wait(timeout=0.1)
            aborted = [i for i in self._waiting if i.request_id in self._aborted]
            self._waiting = [i for i in self._waiting if i.request_id not in self._aborted]
            self._aborted.clear()
            batch = self._waiting[: self.max_running_requests]
            del self._waiting[: len(batch)]
            self._running = len(batch)
        for item in aborted:
            self._deliver(
                item, RequestOutput(item.request_id, finished=True, finish_reason="abort")
            )
        return batch

    def _encode(self, batch: list[_Input]) -> None:
        now = time.monotonic()
        for item in batch:
            item.stats.mark_scheduled(now)
        done: set[str] = set()
        budget = self.config.max_prefill_tokens
        try:
            for group in forward_groups([len(i.ids) for i in batch], budget):
                items = [batch[k] for k in group]
                vectors = self._forward(items)
                for item, vector in zip(items, vectors, strict=True):
                    self._finish(item, vector)
                    done.add(item.request_id)
        except Exception as e:
            # Fails this batch's requests only; the engine goes on serving.
            logger.exception("encoder forward failed; failing %d requests", len(batch))
            for item in batch:
                if item.request_id not in done:
                    self._deliver(item, self._event(item, error=str(e)))
        finally:
            with self._cond:
                self._running = 0

    def _forward(self, items: list[_Input]) -> np.ndarray:
        lengths = np.array([len(i.ids) for i in items], np.int32)
        input_ids = np.zeros((len(items), int(lengths.max())), np.int32)
        for row, item in enumerate(items):
            input_ids[row, : len(item.ids)] = item.ids
        vectors = self.executor.encode(input_ids, lengths)
        self._encoded += int(lengths.sum())
        return vectors

    def _finish(self, item: _Input, vector: np.ndarray) -> None:
        with self._cond:
            aborted = item.request_id in self._aborted
            self._aborted.discard(item.request_id)
        if aborted:
            self._deliver(
                item, RequestOutput(item.request_id, finished=True, finish_reason="abort")
            )
        else:
            self._deliver(item, self._event(item, embedding=np.asarray(vector, np.float32)))

    def _event(
        self, item: _Input, embedding: np.ndarray | None = None, error: str | None = None
    ) -> RequestOutput:
        return RequestOutput(
            item.request_id,
            finished=True,
            finish_reason="error" if error else "stop",
            error=error,
            prompt_tokens=len(item.ids),
            embedding=embedding,
        )

    def _deliver(self, item: _Input, event: RequestOutput) -> None:
        if self.observer is not None:
            try:
                item.stats.record(event, 0, time.monotonic(), self.observer)
            except Exception:
                logger.exception("stats observer failed; metrics are off from now on")
                self.observer = None
        try:
            item.on_output(event)
        except Exception:
            logger.exception("output callback of %s failed", item.request_id)


def forward_groups(lengths: Iterable[int], max_tokens: int) -> list[np.ndarray]:
    """Indices of ``lengths`` split into forwards of similar length (``plan_row_groups``),
    each cut so that rows x its longest row stays within ``max_tokens`` (a row longer than
    that runs alone)."""
    lens = np.asarray(list(lengths), np.int64)
    out = []
    for group in plan_row_groups(lens):
        width = int(lens[group].max())
        per_forward = max(1, max_tokens // max(width, 1))
        out.extend(group[i : i + per_forward] for i in range(0, len(group), per_forward))
    return out
