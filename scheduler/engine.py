"""The engine thread: one loop of schedule -> forward -> process, fed by a thread-safe inbox."""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import mlx.core as mx
from mlx.utils import tree_flatten

from mlxserve.mlx_backend.executor import Executor
from mlxserve.mlx_backend.kv.layer_layout import probe_layout
from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.mlx_backend.memory import plan_memory
from mlxserve.scheduler.batch import ForwardBatch
from mlxserve.scheduler.config import EngineConfig
from mlxserve.scheduler.constraints import ConstraintCompiler, GrammarSpec
from mlxserve.scheduler.outputs import FinishReason, RequestOutput
from mlxserve.scheduler.request import Request
from mlxserve.scheduler.sampling_params import SamplingParams
from mlxserve.scheduler.scheduler import Scheduler
from mlxserve.scheduler.stats import EngineStats, StatsObserver, engine_stats

logger = logging.getLogger(__name__)


class Engine:
    """Owns MLX (through the executor) on one thread; everything else talks to it through
    ``add_request`` / ``abort``, which are thread-safe.

    Args:
        loaded: the model and tokenizer.
        config: pool sizes and limits.
    """

    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.loaded = loaded
        self.config = config
        self.scheduler: Scheduler | None = None
        self.executor: Executor | None = None
        self.max_context_len = 0
        self.error: BaseException | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._requests: dict[str, Request] = {}
        self._audit_pending = False
        self._stop = threading.Event()
        self._ready = threading.Event()
        # Requests submitted and not yet finished (any thread reads it for wait_idle).
        self._unfinished = 0
        self._unfinished_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._constraints: ConstraintCompiler | None = None
        self._constraints_lock = threading.Lock()
        # Request timings go to the observer (the server's metrics) on the engine thread.
        self.observer: StatsObserver | None = None
        # Replaced (never mutated) by the engine thread after each step: any thread reads it.
        self._stats = EngineStats()

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the engine thread and wait until its pools are allocated.

        Raises:
            RuntimeError: the engine failed to set up (the cause is chained).
        """
        # NOTE: MLX streams are per thread. A lazy array the model built at load time (e.g.
        # a slope table kept in a private attribute) evaluated on the engine thread fails
        # with "There is no Stream(cpu, 0) in current thread", so materialize every array
        # reachable from the model here, on the thread that built it.
        mx.eval([a for _, a in tree_flatten(self.loaded.model) if isinstance(a, mx.array)])
        self._thread = threading.Thread(target=self._run, name="mlxserve-engine", daemon=True)
        self._thread.start()
        # NOTE: an engine thread still running MLX work while the interpreter finalizes
        # aborts the process ("terminate called without an active exception", status 134);
        # stopping it at exit keeps a forgotten shutdown() from turning into a crash.
        atexit.register(self.shutdown)
        self._ready.wait()
        if self.error is not None:
            raise RuntimeError(f"engine failed to start: {self.error}") from self.error

    def shutdown(self) -> None:
        """Stop the engine thread (idempotent); requests still queued are not served."""
        self._stop.set()
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout=30)
            _wait_for_native_exit(self._thread.native_id)
        atexit.unregister(self.shutdown)

    @property
    def is_alive(self) -> bool:
        return (
            self._thread is not None
            and self._thread.is_alive()
            and self.error is None
            and self._ready.is_set()
        )

    # ----------------------------------------------------------------- API (any thread)
    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        on_output: Callable[[RequestOutput], None],
        grammar: GrammarSpec | None = None,
    ) -> None:
        """Queue a request. ``on_output`` is called from the engine thread with each step's
        new tokens; exactly one call has ``finished=True``.

        Raises:
            ValueError: ``grammar`` is invalid (the message says why).
        """
        constraint = self.constraint_compiler().compile(grammar) if grammar else None
        req = Request(request_id, list(prompt_ids), params, on_output, constraint=constraint)
        with self._unfinished_lock:
            self._unfinished += 1
        self._inbox.put(("add", req))

    def constraint_compiler(self) -> ConstraintCompiler:
        """The grammar compiler for this model's tokenizer, built on first use (~1 s; any
        thread, after ``start``)."""
        with self._constraints_lock:
            if self._constraints is None:
                eos = sorted(getattr(self.loaded.tokenizer, "eos_token_ids", None) or [])
                self._constraints = ConstraintCompiler(
                    self.loaded.tokenizer, self.executor.vocab_size, eos
                )
            return self._constraints

    def abort(self, request_id: str, reason: FinishReason = "abort") -> None:
        """Stop a request and free its slots in the next step (idempotent).

        ``reason`` is the finish reason of its last event: "abort", or "stop" when the
        server ended it on a stop string (so metrics count it as a stop).
        """
        self._inbox.put(("abort", (request_id, reason)))

    def stats(self) -> EngineStats:
        """The engine's state as of its last step, waiting counting requests still in the
        inbox (thread-safe)."""
        snap = self._stats
        waiting = max(self._unfinished - snap.num_running, 0)
        return snap if waiting == snap.num_waiting else replace(snap, num_waiting=waiting)

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Block until no request is queued or running; False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._unfinished == 0:
                return True
            if not self.is_alive:
                return False
            time.sleep(0.01)
        return False

    def check_integrity(self) -> None:
        """Assert no slot leaked. Call only when idle (``wait_idle``)."""
        assert self.scheduler is not None, "engine not started"
        assert not self.scheduler.has_work(), "check_integrity needs an idle engine"
        self.scheduler.check_integrity()

    # ----------------------------------------------------------------- engine thread
    def _setup(self) -> None:
        """Size the pools from the model's real cache shapes; build executor + scheduler."""
        model = self.loaded.model
        layout = probe_layout(model)
        cfg = self.config
        plan = plan_memory(
            layout,
            cfg.max_total_tokens,
            cfg.max_running_requests,
            cfg.max_prefill_tokens,
            cfg.mem_fraction,
            self.loaded.context_length,
            prefix_cache=not cfg.disable_prefix_cache,
        )
        context = self.loaded.context_length
        self.max_context_len = min(context, plan.full_tokens) if plan.full_tokens else context
        self.executor = Executor(model, plan, layout, seed=cfg.seed)
        eos = set(getattr(self.loaded.tokenizer, "eos_token_ids", None) or [])
        self.scheduler = Scheduler(cfg, plan, self.max_context_len, eos)
        mib = 2**-20
        logger.info(
            "KV pools: %d full-attention slots (%.1f MiB), %d sliding-window slots "
            "(window %s, %.1f MiB), %d recurrent-state slots (%.1f MiB); %d request rows, "
            "context %d, prefill chunk %d",
            plan.full_tokens,
            plan.full_tokens * layout.bytes_per_token("full") * mib,
            plan.sliding_tokens,
            plan.window,
            plan.sliding_tokens * layout.bytes_per_token("sliding") * mib,
            plan.state_slots,
            plan.state_slots * layout.bytes_per_state_slot * mib,
            cfg.max_running_requests,
            self.max_context_len,
            cfg.max_prefill_tokens,
        )

    def _run(self) -> None:
        try:
            self._setup()
        except BaseException as e:  # noqa: BLE001 - reported through start()
            self.error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                self.step()
        except BaseException as e:
            logger.exception("engine thread died")
            self.error = e
            self._fail_everything(f"engine died: {e}")
        finally:
            self._release_mlx()

    def _release_mlx(self) -> None:
        """Free the pools on the thread that made them, and wait for MLX to finish."""
        self.executor = None
        mx.synchronize()

    def step(self) -> None:
        """One engine step: take inbox messages, then schedule -> forward -> process."""
        sched = self.scheduler
        idle = not sched.has_work()
        if idle and self._audit_pending:
            self._audit_slots()
        self._drain_inbox(block=idle)
        batch = sched.schedule()
        if batch is not None:
            self._run_batch(batch)
        self._stats = engine_stats(sched, self._unfinished, _mlx_memory())

    def _run_batch(self, batch: ForwardBatch) -> None:
        sched = self.scheduler
        self._audit_pending = True
        now = time.monotonic()
        for request_id in batch.request_ids:
            self._requests[request_id].stats.mark_scheduled(now)
        try:
            out = self.executor.forward(batch)
        except Exception as e:
            logger.exception("forward failed; failing %d requests", batch.batch_size)
            for req in sched.fail_in_flight():
                self._deliver(req, sched.make_event(req, [], "error", error=str(e)))
            return
        for event in sched.process(batch, out):
            self._deliver(self._requests[event.request_id], event)

    def _audit_slots(self) -> None:
        """Each time the engine goes idle, every slot must be free again (DESIGN.md)."""
        self._audit_pending = False
        try:
            self.scheduler.check_integrity()
        except AssertionError as e:
            logger.error("KV slot accounting is broken: %s", e)

    def _drain_inbox(self, block: bool) -> None:
        try:
            msg = self._inbox.get(timeout=0.1) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*msg)
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, payload) -> None:
        sched = self.scheduler
        if kind == "add":
            req: Request = payload
            if req.request_id in self._requests:
                self._deliver(req, sched.make_event(req, [], "error", error="duplicate id"))
                return
            try:
                sched.add(req)
            except ValueError as e:
                self._deliver(req, sched.make_event(req, [], "error", error=str(e)))
                return
            if req.constraint is not None and sched.constraints is None:
                sched.constraints = self.constraint_compiler()
            self._requests[req.request_id] = req
        elif kind == "abort":
            request_id, reason = payload
            req = sched.abort(request_id)
            if req is not None:
                self._deliver(req, sched.make_event(req, [], reason))

    def _deliver(self, req: Request, event: RequestOutput) -> None:
        """Hand an event to the request's consumer; a consumer that raises fails only its
        own request."""
        if self.observer is not None:
            self._observe(req, event)
        if event.finished:
            if self._requests.get(req.request_id) is req:
                del self._requests[req.request_id]
            with self._unfinished_lock:
                self._unfinished -= 1
        try:
            req.on_output(event)
        except Exception as e:
            logger.exception("output callback of %s failed", req.request_id)
            if not event.finished:
                self.scheduler.abort(req.request_id)
                self._requests.pop(req.request_id, None)
                with self._unfinished_lock:
                    self._unfinished -= 1
                try:
                    req.on_output(self.scheduler.make_event(req, [], "error", error=str(e)))
                except Exception:
                    pass

    def _observe(self, req: Request, event: RequestOutput) -> None:
        try:
            req.stats.record(event, req.params.max_tokens, time.monotonic(), self.observer)
        except Exception:
            # Metrics must never take a request (or the engine) down with them.
            logger.exception("stats observer failed; metrics are off from now on")
            self.observer = None

    def _fail_everything(self, message: str) -> None:
        for req in list(self._requests.values()):
            try:
                req.on_output(self.scheduler.make_event(req, [], "error", error=message))
            except Exception:
                pass
        self._requests.clear()
        with self._unfinished_lock:
            self._unfinished = 0


def _mlx_memory() -> tuple[int, int, int]:
    return mx.get_active_memory(), mx.get_peak_memory(), mx.get_cache_memory()


def _wait_for_native_exit(native_id: int | None, timeout: float = 5.0) -> None:
    """Wait until the OS thread is gone, not just its Python part.

    NOTE: ``join`` returns before the thread's C++ thread-locals are destroyed; MLX's
    per-thread compile cache then takes the GIL to drop Python references. If the
    interpreter is finalizing by then, that thread is killed mid-unwind and the process
    aborts (status 134). Sleeping here releases the GIL so the destructor can finish.
    """
    task = f"/proc/self/task/{native_id}"
    if native_id is None or not os.path.isdir("/proc/self/task"):
        time.sleep(0.1)
        return
    deadline = time.monotonic() + timeout
    while os.path.exists(task) and time.monotonic() < deadline:
        time.sleep(0.005)
