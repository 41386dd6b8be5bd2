"""The engine thread: one loop of schedule -> forward -> process, fed by a thread-safe inbox.

The engine never touches MLX: it drives an ``Executor`` (``scheduler/executor.py``), and the
server talks to it through the ``EngineClient`` protocol (``scheduler/client.py``).
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from mlxserve.scheduler.batch import ForwardBatch
from mlxserve.scheduler.config import EngineConfig
from mlxserve.scheduler.constraints import Constraint, ConstraintCompiler, GrammarSpec, TokenMasks
from mlxserve.scheduler.draft import DraftModel
from mlxserve.scheduler.executor import Executor
from mlxserve.scheduler.inbox import AbortRequest, AddRequest, ExecutorLost, InboxMessage, Wake
from mlxserve.scheduler.memory_plan import MemoryPlan, PoolRequest
from mlxserve.scheduler.multimodal import MultimodalPrompt
from mlxserve.scheduler.outputs import ExecutorFailed, FinishReason, RequestOutput
from mlxserve.scheduler.request import Request
from mlxserve.scheduler.sampling_params import SamplingParams
from mlxserve.scheduler.scheduler import Scheduler
from mlxserve.scheduler.stats import EngineStats, StatsObserver, engine_stats

logger = logging.getLogger(__name__)


class Engine:
    """Runs the executor on one thread; everything else talks to it through ``add_request``
    / ``abort`` (the ``EngineClient`` protocol), which are thread-safe.

    Args:
        executor: the backend (``mlx_backend.executor.MLXExecutor``), not yet allocated.
        config: pool sizes and limits.
        context_length: the model's longest sequence (the pools may cap it further).
        eos_token_ids: tokens that end a request (unless it ignores EOS).
        tokenizer: the model's tokenizer, for grammars (None: no grammar can be compiled).
        draft: the draft model of ``--speculative-method draft`` (its executor is planned,
            allocated and closed with this engine's).
    """

    def __init__(
        self,
        executor: Executor,
        config: EngineConfig,
        *,
        context_length: int,
        eos_token_ids: Iterable[int] = (),
        tokenizer: Any = None,
        draft: DraftModel | None = None,
    ) -> None:
        self.executor = executor
        self.draft = draft
        self.config = config
        self.context_length = context_length
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.tokenizer = tokenizer
        self.max_running_requests = config.max_running_requests
        self.scheduler: Scheduler | None = None
        self.plan: MemoryPlan | None = None
        self.max_context_len = 0
        self.error: BaseException | None = None
        self._inbox: queue.Queue[InboxMessage] = queue.Queue()
        self._requests: dict[str, Request] = {}
        self._audit_pending = False
        # A decode step launched and not collected yet: (batch, executor handle, the time
        # its computing began); only with an executor that can launch (``launch``).
        self._launched: tuple[ForwardBatch, Any, float] | None = None
        self._overlap = hasattr(executor, "launch") and (
            config.overlap == "on"
            or (config.overlap == "auto" and getattr(executor, "overlaps_by_default", False))
        )
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
        self.executor.materialize()
        if self.draft is not None:
            self.draft.executor.materialize()
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
        self._inbox.put(Wake())
        if self._thread is not None:
            self._thread.join(timeout=30)
            _wait_for_native_exit(self._thread.native_id)
        atexit.unregister(self.shutdown)

    def fail(self, reason: str) -> None:
        """Stop the engine because its executor cannot run any more (any thread): every
        request ends with an error naming ``reason`` and ``is_alive`` turns False."""
        self._inbox.put(ExecutorLost(reason))

    @property
    def vocab_size(self) -> int:
        """The width of the model's logits."""
        return self.executor.vocab_size

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
        constraint: Constraint | None = None,
        cache_namespace: str = "",
        embed: bool = False,
        images: MultimodalPrompt | None = None,
    ) -> None:
        """Queue a request. ``on_output`` is called from the engine thread with each step's
        new tokens; exactly one call has ``finished=True``.

        Args:
            grammar: a grammar the output must follow, compiled here (on the caller's
                thread: several ms for a large schema).
            constraint: a grammar compiled already (``compile_grammar``), used as it is;
                each request needs a matcher of its own.
            cache_namespace: the prefix-cache namespace (a tenant, a cache salt): the
                request reuses only prefixes cached by requests of the same namespace.
            embed: an embedding request: the prompt is prefilled (batched with the others,
                through the prefix cache) and never sampled; its one event, finished,
                carries the final hidden state of the prompt's last position
                (``RequestOutput.embedding``). ``params`` are then ignored.
            images: the prompt's images (a vision model's): the features that replace the
                embeddings of their placeholder tokens, and explicit positions.

        Raises:
            ValueError: ``grammar`` is invalid (the message says why), or given to an
                embedding request.
        """
        if embed and (grammar is not None or constraint is not None):
            raise ValueError("an embedding request samples nothing: it takes no grammar")
        if grammar is not None:
            if constraint is not None:
                raise ValueError("give a request a grammar or a compiled constraint, not both")
            constraint = self.compile_grammar(grammar)
        req = Request(
            request_id,
            list(prompt_ids),
            params,
            on_output,
            constraint=constraint,
            cache_namespace=cache_namespace,
            embed=embed,
            images=images,
        )
        with self._unfinished_lock:
            self._unfinished += 1
        self._inbox.put(AddRequest(req))

    def compile_grammar(self, spec: GrammarSpec) -> Constraint:
        """A matcher for ``spec`` (any thread, after ``start``; the first call builds the
        tokenizer's grammar compiler, ~1 s).

        Raises:
            ValueError: the grammar is invalid (llguidance's reason).
        """
        return self.constraint_compiler().compile(spec)

    def constraint_compiler(self) -> ConstraintCompiler:
        """The grammar compiler for this model's tokenizer, built on first use."""
        with self._constraints_lock:
            if self._constraints is None:
                if self.tokenizer is None:
                    raise ValueError("this engine has no tokenizer to compile grammars with")
                self._constraints = ConstraintCompiler(
                    self.tokenizer, self.executor.vocab_size, self.eos_token_ids
                )
            return self._constraints

    def abort(self, request_id: str, reason: FinishReason = "abort") -> None:
        """Stop a request and free its slots in the next step (idempotent).

        ``reason`` is the finish reason of its last event: "abort", or "stop" when the
        server ended it on a stop string (so metrics count it as a stop).
        """
        self._inbox.put(AbortRequest(request_id, reason))

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
        """Size the pools from the model's real cache shapes; allocate them; build the
        scheduler over the same plan."""
        cfg = self.config
        context = self.context_length
        request = PoolRequest(
            max_total_tokens=cfg.max_total_tokens,
            max_running_requests=cfg.max_running_requests,
            max_prefill_tokens=cfg.max_prefill_tokens,
            mem_fraction=cfg.mem_fraction,
            context_length=context,
            prefix_cache=not cfg.disable_prefix_cache,
            memory_bytes=cfg.kv_memory_bytes,
            kv_bits=cfg.kv_bits,
            kv_group_size=cfg.kv_group_size,
        )
        draft = self.draft
        if draft is not None:
            extra = draft.bytes_per_token(request)
            request = replace(request, extra_bytes_per_token=extra)
        plan = self.executor.plan(request)
        self.plan = plan
        self.max_context_len = min(context, plan.full_tokens) if plan.full_tokens else context
        self.executor.allocate(plan)
        if draft is not None:
            draft.allocate(request, plan, self.executor.vocab_size)
        self.scheduler = Scheduler(
            cfg, plan, self.max_context_len, set(self.eos_token_ids), draft=draft
        )
        logger.info(
            "%d request rows, context %d, prefill chunk %d",
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
            # The pools are freed on the thread that made them.
            self.executor.close()
            if self.draft is not None:
                self.draft.close()

    def step(self) -> None:
        """One engine step: take inbox messages, then schedule -> forward -> process; a
        launched decode step is collected instead (the next one launched first)."""
        sched = self.scheduler
        idle = not sched.has_work() and self._launched is None
        if idle and self._audit_pending:
            self._audit_slots()
        self._drain_inbox(block=idle)
        if self._launched is not None:
            self._collect_launched()
        else:
            batch = sched.schedule()
            if batch is not None:
                self._run_batch(batch)
        self._stats = engine_stats(sched, self._unfinished, self.executor.memory())

    def _run_batch(self, batch: ForwardBatch) -> None:
        sched = self.scheduler
        self._audit_pending = True
        now = time.monotonic()
        self._mark_scheduled(batch, now)
        if self._overlap and sched.overlappable(batch):
            # Collected by the next step, which first launches the step after it.
            try:
                self._launched = (batch, self.executor.launch(batch), now)
            except ExecutorFailed:
                raise
            except Exception as e:
                self._fail_in_flight(e)
            return
        try:
            out = self.executor.forward(batch)
            sched.observe_step(batch, time.monotonic() - now)
        except ExecutorFailed:
            raise  # the engine thread ends: every request fails, /health turns 503
        except Exception as e:
            self._fail_in_flight(e)
            return
        for event in sched.process(batch, out):
            self._deliver(self._requests[event.request_id], event)

    def _collect_launched(self) -> None:
        """Launch the decode step after the one in flight when it can be known now
        (``scheduler/lookahead.py``), then wait for the one in flight and process it."""
        sched = self.scheduler
        batch, step, started = self._launched
        self._launched = None
        following = None
        try:
            ahead = sched.schedule_ahead(batch)
            if ahead is not None:
                next_batch, rows = ahead
                self._mark_scheduled(next_batch, time.monotonic())
                following = (next_batch, self.executor.launch(next_batch, step, rows))
            out = step.result()
        except ExecutorFailed:
            raise
        except Exception as e:
            self._fail_in_flight(e)
            return
        done = time.monotonic()
        # Overlapped, a step takes from the previous one's end to its own.
        sched.observe_step(batch, done - started)
        if following is not None:
            self._launched = (*following, done)
        for event in sched.process(batch, out):
            self._deliver(self._requests[event.request_id], event)

    def _mark_scheduled(self, batch: ForwardBatch, now: float) -> None:
        for request_id in batch.request_ids:
            self._requests[request_id].stats.mark_scheduled(now)

    def _fail_in_flight(self, error: Exception) -> None:
        """A forward failed: every request of the batches in flight fails with it."""
        failed = self.scheduler.fail_in_flight()
        self._launched = None
        logger.exception("forward failed; failing %d requests", len(failed), exc_info=error)
        for req in failed:
            self._deliver(req, self.scheduler.make_event(req, [], "error", error=str(error)))

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
            self._handle(msg)
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, msg: InboxMessage) -> None:
        sched = self.scheduler
        if isinstance(msg, AddRequest):
            req = msg.request
            if req.request_id in self._requests:
                self._deliver(req, sched.make_event(req, [], "error", error="duplicate id"))
                return
            try:
                sched.add(req)
            except ValueError as e:
                self._deliver(req, sched.make_event(req, [], "error", error=str(e)))
                return
            if req.constraint is not None and sched.constraints is None:
                sched.constraints = TokenMasks(self.executor.vocab_size)
            self._requests[req.request_id] = req
        elif isinstance(msg, ExecutorLost):
            raise ExecutorFailed(msg.reason)
        elif isinstance(msg, AbortRequest):
            req = sched.abort(msg.request_id)
            if req is not None:
                self._deliver(req, sched.make_event(req, [], msg.reason))

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
