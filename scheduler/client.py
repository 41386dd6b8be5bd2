"""The EngineClient protocol: everything the server may ask of an engine.

``scheduler.engine.Engine`` implements it; the server is typed against this protocol only,
so test doubles (a scripted engine) need no casts, and another engine (a distributed one,
a remote one) can stand in for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from mlxserve.scheduler.constraints import Constraint, GrammarSpec
from mlxserve.scheduler.multimodal import MultimodalPrompt
from mlxserve.scheduler.outputs import FinishReason, RequestOutput
from mlxserve.scheduler.sampling_params import SamplingParams
from mlxserve.scheduler.stats import EngineStats, StatsObserver


class EngineClient(Protocol):
    """A running engine, seen from other threads. Every method is thread-safe.

    Attributes:
        max_context_len: the longest prompt + completion a request may have (the model's
            context, capped by the KV pool).
        observer: receives request timings on the engine thread (the server's metrics).
        max_running_requests: rows of a batch: requests beyond them wait for one.
    """

    max_context_len: int
    observer: StatsObserver | None
    max_running_requests: int

    @property
    def is_alive(self) -> bool:
        """The engine thread runs and serves."""
        ...

    @property
    def error(self) -> BaseException | None:
        """Why the engine thread died (None while it is fine)."""
        ...

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
        """Queue a request; ``on_output`` gets its events on the engine thread. It reuses
        only prefixes cached by requests of the same ``cache_namespace``. With ``embed``
        the prompt is only run: its one, finished event carries the embedding
        (``RequestOutput.embedding``). ``images`` are a vision model's prompt images (the
        features of their placeholder tokens, explicit positions).

        Raises:
            ValueError: ``grammar`` is invalid; an engine that only embeds (an encoder)
                got a generation request.
        """
        ...

    def compile_grammar(self, spec: GrammarSpec) -> Constraint:
        """A compiled matcher for ``spec`` (blocking: call it off the event loop).

        Raises:
            ValueError: the grammar is invalid.
        """
        ...

    def abort(self, request_id: str, reason: FinishReason = "abort") -> None:
        """Stop a request and free its slots in the next step (idempotent)."""
        ...

    def stats(self) -> EngineStats:
        """The engine's state as of its last step."""
        ...

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Block until no request is queued or running; False on timeout."""
        ...

    def shutdown(self) -> None:
        """Stop the engine thread (idempotent)."""
        ...
