"""The protocol-neutral embedding pipeline: an ``EmbeddingSpec`` in, normalized vectors out.

An adapter (OpenAI's ``/v1/embeddings``) tokenizes its inputs into an ``EmbeddingSpec``;
``submit_embedding`` checks it against the model (non-empty inputs, ids in the vocabulary,
each within the context and ``--max-prompt-tokens``, ``dimensions`` within what the model
allows), submits every input to the model's engine as an embedding request (decoders: a
prefill-only row through batching and the prefix cache; encoders: their own thread,
batched by length) and returns each input's vector, L2-normalized, truncated first to
``dimensions`` for Matryoshka models. The inputs of one request are one ``EmbeddingJob``
in the admission's live set, so a drain waits for it and a forced unload ends it.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from mlxserve.scheduler.client import EngineClient
from mlxserve.scheduler.outputs import RequestOutput
from mlxserve.scheduler.sampling_params import SamplingParams
from mlxserve.server.http.errors import APIError, invalid_request
from mlxserve.server.serving.admission import Admission
from mlxserve.server.serving.generation import GenerationError
from mlxserve.server.serving.limits import check_prompt_tokens, check_queue

# OpenAI's limit on the inputs of one request.
MAX_INPUTS = 2048
# Ignored by the engine for embedding requests; one valid value to hand it.
_NO_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)


@dataclass(frozen=True)
class EmbeddingSpec:
    """One embedding request, tokenized.

    Attributes:
        inputs: each input's token ids.
        dimensions: the vector length asked for (None: the model's).
        param: the request field holding the inputs, named in errors.
        cache_namespace: the prefix-cache namespace (``cache_namespace.py``; "": shared).
    """

    inputs: list[list[int]]
    dimensions: int | None = None
    param: str = "input"
    cache_namespace: str = ""


@dataclass(frozen=True)
class Embeddings:
    """The vectors of an ``EmbeddingSpec`` (float32, unit length) in input order, and the
    tokens they took (``cached_tokens``: of those, served by the prefix cache)."""

    vectors: list[np.ndarray]
    prompt_tokens: int
    cached_tokens: int = 0


class EmbeddingTarget(Protocol):
    """The model asked (``server.models.ServedModel`` is one)."""

    name: str
    engine: EngineClient
    vocab_size: int
    embedding_dims: int
    matryoshka_dims: tuple[int, ...] | None

    @property
    def context_length(self) -> int: ...


def normalized(vector: np.ndarray, dimensions: int | None = None) -> np.ndarray:
    """``vector`` truncated to ``dimensions`` (Matryoshka), then scaled to unit length."""
    v = np.asarray(vector, np.float32)[:dimensions]
    return v / max(float(np.linalg.norm(v)), 1e-12)


def check_dimensions(target: EmbeddingTarget, dimensions: int | None) -> None:
    """Raises: APIError 400 when ``dimensions`` is not a length the model gives."""
    if dimensions is None or dimensions == target.embedding_dims:
        return
    allowed = target.matryoshka_dims
    if dimensions < 1:
        raise invalid_request("'dimensions' must be at least 1.", param="dimensions")
    if dimensions > target.embedding_dims:
        raise invalid_request(
            f"'dimensions' is {dimensions}, more than the model's {target.embedding_dims}.",
            param="dimensions",
        )
    if allowed is None:
        raise invalid_request(
            f"The model '{target.name}' does not support 'dimensions': its embeddings "
            f"have {target.embedding_dims} dimensions and are not Matryoshka "
            "representations (declare it with matryoshka=true if they are).",
            param="dimensions",
        )
    if allowed and dimensions not in allowed:
        raise invalid_request(
            f"The model '{target.name}' gives embeddings of {list(allowed)} dimensions, "
            f"not {dimensions}.",
            param="dimensions",
        )


class EmbeddingJob:
    """The inputs of one request in the engine: submitted together, awaited together,
    failed together. Create and await it on the event loop.

    Attributes:
        engine: the engine it runs on (a forced unload fails the jobs of its engine).
        finished: every input has its event, or the job failed.
    """

    def __init__(
        self,
        engine: EngineClient,
        inputs: list[list[int]],
        namespace: str = "",
        timeout: float = 0.0,
    ) -> None:
        self.engine = engine
        self.timeout = timeout or None
        self.finished = False
        self._loop = asyncio.get_running_loop()
        self._ids = [f"embd-{uuid.uuid4().hex}" for _ in inputs]
        self._inputs = inputs
        self._namespace = namespace
        self._results: list[RequestOutput | None] = [None] * len(inputs)
        self._left = len(inputs)
        self._done: asyncio.Future[None] = self._loop.create_future()

    def start(self) -> None:
        for index, (request_id, ids) in enumerate(zip(self._ids, self._inputs, strict=True)):
            self.engine.add_request(
                request_id,
                ids,
                _NO_SAMPLING,
                self._callback(index),
                cache_namespace=self._namespace,
                embed=True,
            )

    def _callback(self, index: int):  # noqa: ANN202 - Callable[[RequestOutput], None]
        def on_output(event: RequestOutput) -> None:
            # Runs on the engine thread: only hand the event over to the loop.
            try:
                self._loop.call_soon_threadsafe(self._push, index, event)
            except RuntimeError:
                pass  # the loop is closed: nobody is listening any more

        return on_output

    def _push(self, index: int, event: RequestOutput) -> None:
        if self._done.done() or not event.finished:
            return
        if event.finish_reason != "stop" or event.embedding is None:
            message = event.error or f"the input ended with '{event.finish_reason}'"
            self.fail(GenerationError(f"Embedding failed: {message}"))
            return
        self._results[index] = event
        self._left -= 1
        if self._left == 0:
            self.finished = True
            self._done.set_result(None)

    def fail(self, error: GenerationError) -> None:
        """End the job with ``error`` (its inputs still in the engine are aborted)."""
        if self._done.done():
            return
        self.finished = True
        self.abort()
        self._done.set_exception(error)

    def abort(self) -> None:
        for request_id, result in zip(self._ids, self._results, strict=True):
            if result is None:
                self.engine.abort(request_id)

    async def embeddings(self, dimensions: int | None = None) -> Embeddings:
        """Every input's vector, in input order, normalized (cut to ``dimensions`` first).

        Raises:
            GenerationError: an input failed, the job was ended, or it timed out.
        """
        events = await self.results()
        return Embeddings(
            vectors=[normalized(e.embedding, dimensions) for e in events],
            prompt_tokens=sum(e.prompt_tokens for e in events),
            cached_tokens=sum(e.cached_tokens for e in events),
        )

    async def results(self) -> list[RequestOutput]:
        """Every input's finished event, in input order (cancelling it aborts them).

        Raises:
            GenerationError: an input failed, the job was ended, or it timed out.
        """
        try:
            await asyncio.wait_for(asyncio.shield(self._done), self.timeout)
        except asyncio.TimeoutError:
            self.fail(
                GenerationError(
                    f"The request timed out after {self.timeout:g} s and was aborted.",
                    status_code=408,
                    type="timeout_error",
                    code="request_timeout",
                )
            )
        except asyncio.CancelledError:
            self.fail(GenerationError("The client went away."))
            raise
        self._done.result()
        return [r for r in self._results if r is not None]


def submit_embedding(
    admission: Admission, target: EmbeddingTarget, spec: EmbeddingSpec
) -> EmbeddingJob:
    """Check ``spec`` against the model and ``admission``'s limits, then start its inputs
    in the model's engine (the job is then in the live set, which the drain and a forced
    unload see). Await ``job.embeddings(spec.dimensions)`` for the vectors.

    Raises:
        APIError: 400 for inputs or ``dimensions`` the model cannot take, 429 when the
            queue is full, 503 when its engine is not running.
    """
    config = admission.config
    check_inputs(target, spec, config.max_prompt_tokens)
    check_dimensions(target, spec.dimensions)
    engine = target.engine
    if not engine.is_alive:
        raise APIError(503, "The engine is not running.", type="server_error")
    stats = engine.stats()
    # NOTE: an embedding request counts as one in the queue: its inputs are small rows that
    # a batch takes many of, and clients send them by the hundred.
    unfinished = stats.num_running + stats.num_waiting
    check_queue(unfinished, 1, engine.max_running_requests, config.max_queue)
    job = EmbeddingJob(engine, spec.inputs, spec.cache_namespace, config.request_timeout)
    try:
        job.start()
    except ValueError as e:  # the engine refused an input (e.g. an encoder's length)
        job.abort()
        raise invalid_request(str(e), param=spec.param) from e
    admission.track(job)
    return job


def check_inputs(target: EmbeddingTarget, spec: EmbeddingSpec, max_prompt_tokens: int) -> None:
    """Raises: APIError 400 for no input, an empty one, a token id outside the vocabulary
    or an input too long for the model (or ``--max-prompt-tokens``)."""
    param = spec.param
    if not spec.inputs:
        raise invalid_request(f"'{param}' must not be empty.", param=param)
    if len(spec.inputs) > MAX_INPUTS:
        raise invalid_request(
            f"'{param}' has {len(spec.inputs)} inputs; at most {MAX_INPUTS} are allowed.",
            param=param,
        )
    context = target.context_length
    for index, ids in enumerate(spec.inputs):
        where = f"{param}[{index}]" if len(spec.inputs) > 1 else param
        if not ids:
            raise invalid_request(f"'{where}' must not be empty.", param=param)
        bad = next((t for t in ids if not 0 <= t < target.vocab_size), None)
        if bad is not None:
            raise invalid_request(
                f"Token id {bad} in '{where}' is outside the vocabulary [0, {target.vocab_size}).",
                param=param,
            )
        if len(ids) > context:
            raise invalid_request(
                f"'{where}' has {len(ids)} tokens, more than the model's context of "
                f"{context} tokens. Please shorten it.",
                param=param,
                code="context_length_exceeded",
            )
        check_prompt_tokens(len(ids), max_prompt_tokens, param)
