"""The model registry: declared models by served name, loaded on demand, unloaded by LRU.

A request's ``model`` only ever selects a declared name (404 otherwise; never a path or a
repo id to load). ``acquire`` returns the name's ``ServedModel``, loading it first when it
is not resident: one load per model however many requests ask at once (they all wait for
the same load), one load at a time per server. Loading another model may unload the least
recently used idle ones (``max_loaded`` models, and the memory budget the loader asks room
in); an idle time-out unloads too. A model with requests running, queued or being
prepared (``users``), or a pinned one, is never unloaded to make room.

The loading itself (weights, conversion, engine, warm-up) is the ``ModelLoader``'s, from
the composition root (``server/lifecycle/``); the registry only decides.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from mlxserve.server.http.errors import APIError
from mlxserve.server.models.declarations import ModelDeclaration, Task
from mlxserve.server.models.entry import (
    ModelEntry,
    ModelLoader,
    ModelStatus,
    NoRoom,
    check_task,
    not_loaded,
    overloaded,
)
from mlxserve.server.models.served_model import ServedModel

logger = logging.getLogger(__name__)


class ModelRegistry:
    """The declared models and the policy that keeps some of them loaded.

    A load that needs room another model holds waits (up to ``room_wait``) for that model's
    requests to finish, least recently used first; only when nothing could ever free the
    room (the others are pinned, or the model alone is over the budget) or the wait runs
    out is it refused.

    Args:
        loader: loads and unloads models (None: models are only ever ``add``-ed loaded).
        max_loaded: most models loaded at once (0: no limit).
        memory_budget: bytes every loaded model's weights and pools share (0: no budget).
        default_ttl: idle seconds after which an unpinned model is unloaded (0: never),
            unless its declaration sets its own.
        on_unloaded: called with a model's name after it is unloaded (metrics).
    """

    def __init__(
        self,
        loader: ModelLoader | None = None,
        *,
        max_loaded: int = 0,
        memory_budget: int = 0,
        default_ttl: float = 0.0,
        on_unloaded: Callable[[str], None] | None = None,
        room_wait: float = 120.0,
    ) -> None:
        self.loader = loader
        self.room_wait = room_wait
        self.max_loaded = max_loaded
        self.memory_budget = memory_budget
        self.default_ttl = default_ttl
        self._on_unloaded = on_unloaded
        self._entries: list[ModelEntry] = []
        self._by_name: dict[str, ModelEntry] = {}
        self._lock = threading.RLock()  # the entries' status, users and names
        self._one_load = threading.Lock()  # loads run one at a time

    def configure(
        self,
        loader: ModelLoader,
        *,
        max_loaded: int = 0,
        memory_budget: int = 0,
        default_ttl: float = 0.0,
    ) -> None:
        """Set how models are loaded and what keeps them loaded (before any is declared)."""
        self.loader = loader
        self.max_loaded = max_loaded
        self.memory_budget = memory_budget
        self.default_ttl = default_ttl

    # ----------------------------------------------------------------- declaring
    def declare(self, declaration: ModelDeclaration, names: tuple[str, ...]) -> ModelEntry:
        """Serve ``declaration`` (not loaded yet) under ``names``.

        Raises:
            ValueError: a name is taken.
        """
        entry = ModelEntry(declaration, names)
        self._register(entry)
        return entry

    def add(self, model: ServedModel) -> ModelEntry:
        """Serve an already loaded model under its name (and mark it loaded).

        Raises:
            ValueError: the name is taken by another model.
        """
        with self._lock:
            entry = self._by_name.get(model.name)
            if entry is None:
                declaration = ModelDeclaration(names=(model.name,), task=model.task)
                entry = ModelEntry(declaration, (model.name,))
                self._register(entry)
            elif entry.status is ModelStatus.LOADED:
                raise ValueError(f"a model named {model.name!r} is already served")
            self._mark_loaded(entry, model)
            return entry

    def _register(self, entry: ModelEntry) -> None:
        with self._lock:
            taken = [n for n in entry.names if n in self._by_name]
            if taken:
                raise ValueError(f"a model named {taken[0]!r} is already declared")
            self._entries.append(entry)
            self._by_name = {**self._by_name, **dict.fromkeys(entry.names, entry)}

    def _mark_loaded(self, entry: ModelEntry, model: ServedModel) -> None:
        entry.served, entry.status, entry.error = model, ModelStatus.LOADED, None
        entry.loads += 1
        entry.last_used = time.monotonic()
        entry._loaded.set()

    # ----------------------------------------------------------------- lookup
    def entry(self, name: str) -> ModelEntry:
        """The declared model served as ``name``.

        Raises:
            APIError: 404 ``model_not_found`` for any other name.
        """
        entry = self._by_name.get(name)
        if entry is None:
            served = ", ".join(f"'{n}'" for e in self._entries for n in e.names) or "no model"
            raise APIError(
                404,
                f"The model '{name}' does not exist. This server serves {served}.",
                param="model",
                code="model_not_found",
            )
        return entry

    def get(self, name: str) -> ServedModel:
        """The loaded model served as ``name``, without loading it.

        Raises:
            APIError: 404 for an undeclared name, 503 when it is not loaded.
        """
        entry = self.entry(name)
        if entry.served is None:
            raise not_loaded(entry)
        return entry.served

    def default(self) -> ServedModel:
        """The model a request that names none goes to: the first loaded one."""
        for entry in self._entries:
            if entry.served is not None:
                return entry.served
        raise APIError(503, "No model is loaded yet.", type="server_error", code="model_loading")

    def all(self) -> list[ServedModel]:
        """Every loaded model, in declaration order."""
        return [e.served for e in self._entries if e.served is not None]

    def entries(self) -> list[ModelEntry]:
        """Every declared model, in declaration order."""
        return list(self._entries)

    def __len__(self) -> int:
        """Loaded models."""
        return sum(1 for e in self._entries if e.served is not None)

    # ----------------------------------------------------------------- use
    @asynccontextmanager
    async def use(self, name: str, task: Task | None = "generate") -> AsyncIterator[ServedModel]:
        """The model served as ``name``, loaded on demand and held (never unloaded) until
        the block ends; requests submitted inside it keep it busy until they finish.
        ``task`` is what the route needs of it (None: anything)."""
        model = await self.acquire(name, task)
        try:
            yield model
        finally:
            self.release(model)

    async def acquire(self, name: str, task: Task | None = None) -> ServedModel:
        """``name``'s model, loading it (and waiting for that) if it is not resident.

        Raises:
            APIError: 404 for an undeclared name; 400 when it does not serve ``task``
                (checked before anything loads); 503 when it cannot be loaded (no room,
                a failed load).
        """
        entry = self.entry(name)
        check_task(entry, task)
        with self._lock:
            entry.waiting += 1
        try:
            while True:
                with self._lock:
                    if entry.draining:
                        raise APIError(
                            503,
                            f"The model '{entry.name}' is being unloaded. Please retry later.",
                            type="server_error",
                            code="model_unloading",
                            headers={"Retry-After": "5"},
                        )
                    if entry.status is ModelStatus.LOADED and entry.served is not None:
                        entry.users += 1
                        entry.last_used = time.monotonic()
                        return entry.served
                await asyncio.to_thread(self.load, entry)
        finally:
            with self._lock:
                entry.waiting -= 1

    def release(self, model: ServedModel) -> None:
        """A request that held ``model`` was submitted (or gave up)."""
        with self._lock:
            for entry in self._entries:
                if entry.served is model:
                    entry.users = max(entry.users - 1, 0)
                    entry.last_used = time.monotonic()

    # ----------------------------------------------------------------- loading
    def load(self, entry: ModelEntry) -> None:
        """Make ``entry`` loaded (blocking; returns at once if it is). Concurrent calls
        for one model wait for the same load.

        Raises:
            APIError: 503 when there is no room for it or the load failed.
        """
        with self._lock:
            if entry.status is ModelStatus.LOADED:
                return
            if entry.status is ModelStatus.LOADING:
                waiter = entry._loaded
            else:
                waiter = None
                entry.status, entry.error = ModelStatus.LOADING, None
                entry._loaded.clear()
        if waiter is not None:
            waiter.wait()
            if entry.status is ModelStatus.UNLOADED and entry.error is not None:
                raise not_loaded(entry)
            return  # loaded (or loaded and unloaded again: the caller tries again)
        try:
            with self._one_load:
                self._make_room_for_one(entry)
                if self.loader is None:
                    raise RuntimeError("this server cannot load models")
                started = time.monotonic()
                model = self.loader.load(entry, lambda weights: self._room(entry, weights))
                logger.info("model %s loaded in %.1f s", entry.name, time.monotonic() - started)
        except BaseException as e:
            with self._lock:
                entry.status, entry.error = ModelStatus.UNLOADED, str(e)
                entry.resident_bytes, entry.shared_bytes = 0, {}
                entry._loaded.set()
            if isinstance(e, NoRoom):
                raise overloaded(entry, str(e)) from e
            raise not_loaded(entry) from e
        with self._lock:
            self._mark_loaded(entry, model)

    def _make_room_for_one(self, entry: ModelEntry) -> None:
        """Unload idle models until one more fits ``max_loaded``.

        Raises:
            NoRoom: the others are all busy or pinned.
        """
        while self.max_loaded:
            loaded = [e for e in self._entries if e.served is not None and e is not entry]
            if len(loaded) < self.max_loaded:
                return
            if not self._evict_one(exclude=entry):
                raise NoRoom(
                    f"{len(loaded)} models are loaded (--max-loaded-models "
                    f"{self.max_loaded}) and none of them is idle and unpinned"
                )

    def _room(self, entry: ModelEntry, weight_bytes: int) -> int:
        """Room for ``weight_bytes`` of weights: unload idle models while the budget lacks
        them; returns the bytes left for the pools (0 without a budget: the loader sizes
        them from free memory).

        Raises:
            NoRoom: idle models cannot free enough.
        """
        if not self.memory_budget:
            return 0
        while True:
            used = self.memory_in_use(loading=entry)
            left = self.memory_budget - used - weight_bytes
            if left > 0:
                return left
            if not self._evict_one(exclude=entry):
                raise NoRoom(
                    f"the model's weights ({weight_bytes / 2**20:.0f} MiB) do not fit the "
                    f"memory budget ({self.memory_budget / 2**20:.0f} MiB, "
                    f"{used / 2**20:.0f} MiB taken by models that are busy or pinned)"
                )

    def memory_in_use(self, loading: ModelEntry | None = None) -> int:
        """Bytes the loaded models take (their own, plus each shared weight set once),
        with the shared weights ``loading`` will hold counted already."""
        holders = [e for e in self._entries if e.served is not None and e is not loading]
        shared: dict[str, int] = {}
        for e in [*holders, *([loading] if loading is not None else [])]:
            shared.update(e.shared_bytes)
        return sum(e.resident_bytes for e in holders) + sum(shared.values())

    def _evict_one(self, exclude: ModelEntry) -> bool:
        """Unload the least recently used idle, unpinned model, waiting for busy ones to
        finish their requests; False when none is unpinned or the wait ran out."""
        deadline = time.monotonic() + self.room_wait
        while True:
            with self._lock:
                unpinned = [
                    e
                    for e in self._entries
                    if e is not exclude
                    and e.status is ModelStatus.LOADED
                    and not e.declaration.pinned
                ]
                idle = [e for e in unpinned if not e.busy()]
                if idle:
                    victim = min(idle, key=lambda e: e.last_used)
                    model = self._detach(victim)
                    break
            if not unpinned or time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        self._finish_unload(victim, model)
        logger.info("unloaded %s to make room for another model", victim.name)
        return True

    # ----------------------------------------------------------------- unloading
    def unload(self, entry: ModelEntry) -> None:
        """Unload ``entry`` now (blocking; a no-op unless it is loaded). The caller has
        made sure nothing uses it (or ended what did)."""
        with self._lock:
            if entry.status is not ModelStatus.LOADED:
                return
            model = self._detach(entry)
        self._finish_unload(entry, model)

    async def unload_when_idle(
        self, entry: ModelEntry, abort: Callable[[ServedModel], None] | None = None
    ) -> None:
        """Unload ``entry`` once its requests are done; with ``abort``, end them first
        (``abort(model)`` fails every request it runs). New requests are refused
        meanwhile."""
        with self._lock:
            if entry.status is not ModelStatus.LOADED or entry.draining:
                return
            entry.draining = True
        try:
            if abort is not None and entry.served is not None:
                abort(entry.served)
            while entry.busy():
                await asyncio.sleep(0.05)
            await asyncio.to_thread(self.unload, entry)
        finally:
            entry.draining = False

    def _detach(self, entry: ModelEntry) -> ServedModel | None:
        """Take ``entry`` out of service (under the lock: no new request gets it)."""
        model = entry.served
        entry.served, entry.status, entry.resident_bytes = None, ModelStatus.UNLOADED, 0
        entry.shared_bytes = {}
        entry._loaded.clear()
        return model

    def _finish_unload(self, entry: ModelEntry, model: ServedModel | None) -> None:
        """Stop a detached model's engine and free it (outside the lock: it blocks)."""
        if model is not None and self.loader is not None:
            self.loader.unload(model)
        if self._on_unloaded is not None:
            self._on_unloaded(entry.name)

    def ttl_of(self, entry: ModelEntry) -> float:
        ttl = entry.declaration.ttl
        return self.default_ttl if ttl is None else ttl

    def unload_idle(self, now: float | None = None) -> list[str]:
        """Unload every unpinned model idle for longer than its time-out; their names."""
        now = time.monotonic() if now is None else now
        done = []
        with self._lock:
            for entry in self._entries:
                ttl = self.ttl_of(entry)
                if (
                    ttl
                    and entry.status is ModelStatus.LOADED
                    and not entry.declaration.pinned
                    and not entry.busy()
                    and now - entry.last_used > ttl
                ):
                    done.append((entry, self._detach(entry)))
        for entry, model in done:
            self._finish_unload(entry, model)
            logger.info("unloaded %s after its idle time-out", entry.name)
        return [entry.name for entry, _ in done]
