"""Admitting a request: the server's limits, then its ``n`` choices started in the engine.

``Admission`` also keeps the requests in flight, which a graceful shutdown waits for.
"""

from __future__ import annotations

import uuid
from typing import Any, Protocol

from mlxserve.scheduler.client import EngineClient
from mlxserve.scheduler.constraints import Constraint
from mlxserve.server.config import ServerConfig
from mlxserve.server.http.errors import APIError
from mlxserve.server.serving.choices import Choices
from mlxserve.server.serving.generation import Generation, GenerationError
from mlxserve.server.serving.limits import check_prompt_tokens, check_queue
from mlxserve.server.serving.prompts import resolve_max_tokens
from mlxserve.server.serving.sampling import engine_params
from mlxserve.server.serving.spec import GenerationSpec


class Target(Protocol):
    """The model a request goes to (``server.models.ServedModel`` is one)."""

    engine: EngineClient
    vocab_size: int

    @property
    def tokenizer(self) -> Any: ...

    @property
    def context_length(self) -> int: ...


class Admission:
    """Admits requests and keeps those in flight.

    Args:
        config: the server's limits (prompt tokens, queue, timeouts, stream buffers).
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        # Requests in flight (pruned as they finish): what a graceful shutdown waits for.
        self._live: set[Generation] = set()

    def live_generations(self) -> list[Generation]:
        """The requests not finished yet."""
        self._live = {gen for gen in self._live if not gen.finished}
        return list(self._live)

    def track(self, request: Generation) -> None:
        """Keep a request started elsewhere (an ``EmbeddingJob``: ``engine``, ``finished``,
        ``fail``) in flight with the others, for the drain and forced unloads."""
        self.live_generations()
        self._live.add(request)

    def fail_all(self, engine: EngineClient, message: str) -> int:
        """End every request in flight on ``engine`` with an error (a forced unload);
        returns how many."""
        failed = [gen for gen in self.live_generations() if gen.engine is engine]
        for gen in failed:
            gen.fail(GenerationError(message, status_code=503, code="model_unloaded"))
        return len(failed)

    def submit(self, target: Target, spec: GenerationSpec) -> Choices:
        """Check the limits, then start the request's ``n`` choices in the engine.

        Raises:
            APIError: 400 when the prompt is over ``max_prompt_tokens``, the request does
                not fit the context or its parameters do not fit the model, 503 when the
                engine is not running, 429 when the queue is full.
        """
        config = self.config
        prompt_ids, param = spec.prompt_ids, spec.prompt_param
        check_prompt_tokens(len(prompt_ids), config.max_prompt_tokens, param)
        # max_tokens 0 (echo only): run one token for the prompt's logprobs, then drop it.
        keep_output = spec.max_tokens != 0
        max_tokens = resolve_max_tokens(
            len(prompt_ids), spec.max_tokens if keep_output else 1, target.context_length, param
        )
        params = [
            engine_params(spec.sampling, max_tokens, target.vocab_size, i) for i in range(spec.n)
        ]
        engine = target.engine
        if not engine.is_alive:
            raise APIError(503, "The engine is not running.", type="server_error")
        stats = engine.stats()
        unfinished = stats.num_running + stats.num_waiting
        check_queue(unfinished, spec.n, engine.max_running_requests, config.max_queue)
        response_id = spec.response_id or f"{spec.kind}-{uuid.uuid4().hex}"
        generations = [
            Generation(
                engine,
                target.tokenizer,
                response_id if spec.n == 1 else f"{response_id}-{i}",
                prompt_ids,
                choice_params,
                spec.stop,
                timeout=config.request_timeout or None,
                max_buffered_tokens=config.stream_buffer_tokens,
                keep_output=keep_output,
                constraint=_matcher_of_choice(spec.constraint, i),
                cache_namespace=spec.cache_namespace,
                images=spec.images,
            )
            for i, choice_params in enumerate(params)
        ]
        choices = Choices(response_id, generations)
        choices.start()
        self.live_generations()  # prune, so the set stays as small as what runs
        self._live.update(generations)
        return choices


def _matcher_of_choice(constraint: Constraint | None, index: int) -> Constraint | None:
    """Choice 0 takes the compiled matcher, the others copies of it."""
    if constraint is None:
        return None
    return constraint if index == 0 else constraint.copy()
