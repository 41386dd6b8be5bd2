"""The FastAPI app: OpenAI-compatible routes over a running engine.

Each generation route does three things: parse (pydantic, in the signature), submit
(``ServingContext.submit``), and stream or return the result (``server/responses.py``).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from mlx_backend.loaded_model import LoadedModel
from scheduler.engine import Engine
from server.config import ServerConfig
from server.errors import APIError, install_error_handlers
from server.generation import Generation
from server.prompts import chat_prompt_ids, completion_prompt_ids, resolve_max_tokens
from server.responses import complete_chat, complete_text, stream_chat, stream_completion
from server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    ModelCard,
    ModelList,
)

logger = logging.getLogger(__name__)


class ServingContext:
    """What the routes share: the engine, the tokenizer, the served model's name and limits.

    Args:
        loaded: the loaded model (tokenizer, id, context length).
        engine: the engine serving it (started before requests arrive).
        config: the server configuration (served model name).
    """

    def __init__(self, loaded: LoadedModel, engine: Engine, config: ServerConfig) -> None:
        self.engine = engine
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.model_name = config.served_model_name or loaded.model_id
        vocab = loaded.config.get("vocab_size") or len(self.tokenizer)
        # Ids past the tokenizer's vocabulary could not be decoded, past the model's not run.
        self.vocab_size = min(int(vocab), len(self.tokenizer))

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

    def submit(
        self, kind: str, prompt_ids: list[int], body: GenerationRequest, param: str
    ) -> Generation:
        """Check the budget, then start the request in the engine.

        Args:
            kind: id prefix, "chatcmpl" or "cmpl".
            prompt_ids: the prompt's tokens.
            body: the parsed request.
            param: the request field holding the prompt, for error messages.

        Raises:
            APIError: 400 when the request does not fit the context, 503 when the engine
                is not running.
        """
        max_tokens = resolve_max_tokens(
            len(prompt_ids), body.requested_max_tokens(), self.context_length, param
        )
        if not self.engine.is_alive:
            raise APIError(503, "The engine is not running.", type="server_error")
        gen = Generation(
            self.engine,
            self.tokenizer,
            f"{kind}-{uuid.uuid4().hex}",
            prompt_ids,
            body.sampling_params(max_tokens),
            body.stop_strings,
        )
        gen.start()
        return gen


def create_app(loaded: LoadedModel, engine: Engine, config: ServerConfig) -> FastAPI:
    """Build the app serving ``loaded`` through ``engine`` (which the caller starts/stops).

    Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
    ``GET /v1/models/{model}``, ``GET /health``.
    """
    app = FastAPI(title="mlxserve", version="0.1.0")
    install_error_handlers(app)
    ctx = ServingContext(loaded, engine, config)
    app.state.ctx = ctx

    @app.get("/health", response_model=None)
    async def health() -> dict[str, str] | JSONResponse:
        if ctx.engine.is_alive:
            return {"status": "ok"}
        error = getattr(ctx.engine, "error", None)
        detail = f"engine is not running: {error}" if error else "engine is not running"
        return JSONResponse({"status": "unavailable", "detail": detail}, status_code=503)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[_model_card(ctx)])

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> ModelCard:
        ctx.check_model(model)
        return _model_card(ctx)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        ctx.check_model(body.model)
        prompt_ids = chat_prompt_ids(ctx.tokenizer, body.messages)
        gen = ctx.submit("chatcmpl", prompt_ids, body, param="messages")
        if body.stream:
            return stream_chat(gen, ctx.model_name, body.include_usage)
        return await complete_chat(gen, ctx.model_name, request)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        ctx.check_model(body.model)
        prompt_ids = completion_prompt_ids(ctx.tokenizer, body.prompt, ctx.vocab_size)
        gen = ctx.submit("cmpl", prompt_ids, body, param="prompt")
        if body.stream:
            return stream_completion(gen, ctx.model_name, body.include_usage)
        return await complete_text(gen, ctx.model_name, request)

    return app


def _model_card(ctx: ServingContext) -> ModelCard:
    return ModelCard(id=ctx.model_name, max_model_len=ctx.context_length)
