"""Messages into the engine thread: typed, one dataclass per kind, never string tags."""

from __future__ import annotations

from dataclasses import dataclass

from mlxserve.scheduler.outputs import FinishReason
from mlxserve.scheduler.request import Request


@dataclass(frozen=True)
class AddRequest:
    """Queue ``request`` (already checked: its grammar compiled, its ids valid)."""

    request: Request


@dataclass(frozen=True)
class AbortRequest:
    """Stop a request and free its slots; its last event finishes with ``reason``."""

    request_id: str
    reason: FinishReason = "abort"


@dataclass(frozen=True)
class Wake:
    """Nothing to do: makes a blocked engine thread look at its stop flag."""


@dataclass(frozen=True)
class ExecutorLost:
    """The executor reported it can no longer run (from any thread): the engine stops."""

    reason: str


InboxMessage = AddRequest | AbortRequest | Wake | ExecutorLost
