"""What the generation routes share once the model is loaded, and how a request is admitted."""

from __future__ import annotations

import uuid

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.engine import Engine
from mlxserve.server.api.openai.logprobs import TokenTexts
from mlxserve.server.api.openai.schemas import GenerationRequest
from mlxserve.server.api.openai.structured_output import OutputConstraint
from mlxserve.server.config import ServerConfig
from mlxserve.server.http.errors import APIError, invalid_request
from mlxserve.server.http.limits import check_prompt_tokens, check_queue
from mlxserve.server.serving.choices import Choices
from mlxserve.server.serving.generation import Generation
from mlxserve.server.serving.prompts import resolve_max_tokens
from mlxserve.server.serving.reasoning import is_reasoning_model
from mlxserve.server.serving.sampling import engine_params
from mlxserve.server.serving.tool_parsers import resolve_tool_format


class ServingContext:
    """The engine, the tokenizer, the served model's name, and the server's limits.

    Attributes:
        reasoning: the model's output may open with ``<think>`` reasoning.
        token_texts: token id -> text for logprobs (cached across requests).
        tool_format: how the model writes tool calls (``--tool-parser``).

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
        self.reasoning = is_reasoning_model(self.tokenizer)
        self.token_texts = TokenTexts(self.tokenizer)
        self.tool_format = resolve_tool_format(config.tool_parser, self.tokenizer)
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
        self,
        kind: str,
        prompt_ids: list[int],
        body: GenerationRequest,
        param: str,
        constraint: OutputConstraint | None = None,
    ) -> Choices:
        """Check the limits, then start the request's ``n`` choices in the engine.

        Args:
            kind: id prefix, "chatcmpl" or "cmpl".
            prompt_ids: the prompt's tokens.
            body: the parsed request.
            param: the request field holding the prompt, for error messages.
            constraint: the grammar every choice follows (each gets its own matcher).

        Raises:
            APIError: 400 when the prompt is over ``max_prompt_tokens``, the request does
                not fit the context, its parameters do not fit the model or its grammar is
                invalid, 503 when the engine is not running, 429 when the queue is full.
        """
        config = self.config
        check_prompt_tokens(len(prompt_ids), config.max_prompt_tokens, param)
        requested = body.requested_max_tokens()
        # max_tokens 0 (echo only): run one token for the prompt's logprobs, then drop it.
        keep_output = requested != 0
        max_tokens = resolve_max_tokens(
            len(prompt_ids), requested if keep_output else 1, self.context_length, param
        )
        params = [engine_params(body, max_tokens, self.vocab_size, i) for i in range(body.n)]
        if not self.engine.is_alive:
            raise APIError(503, "The engine is not running.", type="server_error")
        check_queue(self.engine.stats().num_waiting, config.max_queue)
        response_id = f"{kind}-{uuid.uuid4().hex}"
        generations = [
            Generation(
                self.engine,
                self.tokenizer,
                response_id if body.n == 1 else f"{response_id}-{i}",
                prompt_ids,
                choice_params,
                body.stop_strings,
                timeout=config.request_timeout or None,
                max_buffered_tokens=config.stream_buffer_tokens,
                keep_output=keep_output,
                grammar=constraint.spec if constraint is not None else None,
            )
            for i, choice_params in enumerate(params)
        ]
        choices = Choices(response_id, generations)
        try:
            choices.start()
        except ValueError as e:
            # Grammars are checked before (check_constraint); this is the engine's last word.
            at = constraint.param if constraint is not None else None
            raise invalid_request(f"Invalid '{at}': {e}", param=at) from e
        self.live_generations()  # prune, so the set stays as small as what runs
        self._live.update(generations)
        return choices
