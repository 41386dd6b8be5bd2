"""A declared model and where it stands (``ModelEntry``), the loader the registry drives
(``ModelLoader``), and the errors a request for a model can meet."""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from mlxserve.server.http.errors import APIError
from mlxserve.server.models.declarations import ModelDeclaration, Task
from mlxserve.server.models.served_model import ServedModel


class ModelStatus(str, enum.Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"


class NoRoom(Exception):
    """Loading a model needs memory that unloading idle models cannot free."""


class ModelLoader(Protocol):
    """Loads and unloads models (the composition root implements it)."""

    def load(self, entry: ModelEntry, room: Callable[[int], int]) -> ServedModel:
        """Load ``entry``'s model (blocking, on a worker thread). Once the weights are in,
        ``room(weight_bytes)`` makes room for them and returns the bytes left for the KV
        pools (raising ``NoRoom`` when there are not enough); ``entry.resident_bytes``
        must then hold what the model takes in all."""
        ...

    def unload(self, model: ServedModel) -> None:
        """Stop the model's engine and free it (blocking)."""
        ...


@dataclass(eq=False)
class ModelEntry:
    """One declared model and where it stands.

    Attributes:
        declaration: what was declared.
        names: the names it is served under.
        status: loaded, loading or unloaded.
        served: the loaded model (None unless loaded).
        error: why its last load failed.
        users: requests holding it between ``acquire`` and their submission.
        waiting: requests waiting for it to load (it is not unloaded under them).
        last_used: monotonic time of its last ``acquire`` or release.
        resident_bytes: memory its own weights and pools take while loaded.
        shared_bytes: weights it shares with other models (a base under LoRA adapters),
            by key; the budget counts each key once, however many models hold it.
        loads: how many times it was loaded.
    """

    declaration: ModelDeclaration
    names: tuple[str, ...]
    status: ModelStatus = ModelStatus.UNLOADED
    served: ServedModel | None = None
    error: str | None = None
    users: int = 0
    waiting: int = 0
    last_used: float = field(default_factory=time.monotonic)
    resident_bytes: int = 0
    shared_bytes: dict[str, int] = field(default_factory=dict)
    loads: int = 0
    # Being unloaded on request: new requests are refused until it is.
    draining: bool = False
    _loaded: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def name(self) -> str:
        return self.names[0]

    def busy(self) -> bool:
        """Requests hold it: waiting for it, being prepared, queued or running."""
        if self.users or self.waiting:
            return True
        if self.served is None:
            return False
        stats = self.served.engine.stats()
        return stats.num_running + stats.num_waiting > 0


def check_task(entry: ModelEntry, task: Task | None) -> None:
    """Raises: APIError 400 when ``entry``'s model does not serve ``task`` (None: any)."""
    if task is None or entry.declaration.task == task:
        return
    if task == "embed":
        message = (
            f"The model '{entry.name}' is not an embedding model: it generates text "
            "(chat, completions, messages, responses) and does not serve /v1/embeddings. "
            "Declare an embedding model with task=embed."
        )
    else:
        message = (
            f"The model '{entry.name}' is an embedding model: it serves /v1/embeddings only "
            "and cannot generate text."
        )
    raise APIError(400, message, param="model", code="model_task_mismatch")


def not_loaded(entry: ModelEntry) -> APIError:
    detail = f": {entry.error}" if entry.error else ""
    return APIError(
        503,
        f"The model '{entry.name}' is not loaded{detail}",
        type="server_error",
        code="model_not_loaded",
    )


def overloaded(entry: ModelEntry, reason: str) -> APIError:
    return APIError(
        503,
        f"The model '{entry.name}' cannot be loaded now: {reason}. Please retry later.",
        type="server_error",
        code="model_overloaded",
        headers={"Retry-After": "5"},
    )
