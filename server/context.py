"""What the generation routes share once the model is loaded, and how a request is admitted."""

from __future__ import annotations

import uuid

from mlx_backend.loaded_model import LoadedModel
from scheduler.engine import Engine
from server.config import ServerConfig
from server.errors import APIError
from server.generation import Generation
from server.limits import check_prompt_tokens, check_queue
from server.prompts import resolve_max_tokens
from server.schemas import GenerationRequest


class ServingContext:
    """The engine, the tokenizer, the served model's name, and the server's limits.

    Args:
        loaded: the loaded model (tokenizer, id, context length).
        engine: the engine serving it (started before requests arrive).
        config: the server configuration (served model name, limits).
    """

    def __init__(self, loaded: LoadedModel, engine: Engine, config: ServerConfig) -> None:
        self.engine = engine
        self.loaded = loaded
        self.config = config
        self.tokenizer = loaded.tokenizer
        self.model_name = config.served_model_name or loaded.model_id
        vocab = loaded.config.get("vocab_size") or len(self.tokenizer)
        # Ids past the tokenizer's vocabulary could not be decoded, past the model's not run.
        self.vocab_size = min(int(vocab), len(self.tokenizer))
        # Requests in flight (pruned as they finish): what a graceful shutdown waits for.
        self._live: set[Generation] = set()

    @property
    def context_length(self) -> int:
        """Longest prompt + completion: the model's, capped by the engine's KV pool."""
        return getattr(self.engine, "max_context_len", 0) or self.loaded.context_length

    def check_model(self, model: str) -> None:
        """Raises: APIError 404 ``model_not_found`` unless ``model`` is the served model."""
        if model != self.model_name:
            raise APIError(
                404,
                f"The model '{model}' does not exist. This server serves '{self.model_name}'.",
                param="model",
                code="model_not_found",
            )

    def live_generations(self) -> list[Generation]:
        """The requests not finished yet."""
        self._live = {gen for gen in self._live if not gen.finished}
        return list(self._live)

    def submit(
        self, kind: str, prompt_ids: list[int], body: GenerationRequest, param: str
    ) -> Generation:
        """Check the limits, then start the request in the engine.

        Args:
            kind: id prefix, "chatcmpl" or "cmpl".
            prompt_ids: the prompt's tokens.
            body: the parsed request.
            param: the request field holding the prompt, for error messages.

        Raises:
            APIError: 400 when the prompt is over ``max_prompt_tokens`` or the request does
                not fit the context, 503 when the engine is not running, 429 when the queue
                is full.
        """
        config = self.config
        check_prompt_tokens(len(prompt_ids), config.max_prompt_tokens, param)
        max_tokens = resolve_max_tokens(
            len(prompt_ids), body.requested_max_tokens(), self.context_length, param
        )
        if not self.engine.is_alive:
            raise APIError(503, "The engine is not running.", type="server_error")
        check_queue(self.engine.stats().num_waiting, config.max_queue)
        gen = Generation(
            self.engine,
            self.tokenizer,
            f"{kind}-{uuid.uuid4().hex}",
            prompt_ids,
            body.sampling_params(max_tokens),
            body.stop_strings,
            timeout=config.request_timeout or None,
            max_buffered_tokens=config.stream_buffer_tokens,
        )
        self.live_generations()  # prune, so the set stays as small as what runs
        self._live.add(gen)
        gen.start()
        return gen
