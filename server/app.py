"""The FastAPI app: OpenAI-compatible routes, plus /health, /metrics and /version.

Each generation route does three things: parse (pydantic, in the signature), submit
(``ServingContext.submit``), and stream or return the result (``server/api/openai/answer.py``).
Around the routes, outermost first: CORS, API keys, the body size limit, and the gate that
answers 503 while the model loads or the server shuts down (``server/lifecycle/state.py``).
"""

from __future__ import annotations

import logging
from importlib import metadata
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.middleware.cors import CORSMiddleware

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.engine import Engine
from mlxserve.server.api.openai.answer import complete_chat, complete_text
from mlxserve.server.api.openai.messages import continuation_mode, render_chat
from mlxserve.server.api.openai.openapi import install_openapi
from mlxserve.server.api.openai.response_models import ModelCard, ModelList
from mlxserve.server.api.openai.schemas import ChatCompletionRequest, CompletionRequest
from mlxserve.server.api.openai.shapers import ChatShaper, CompletionShaper
from mlxserve.server.api.openai.sse import stream_chat, stream_completion
from mlxserve.server.api.openai.structured_output import check_constraint, request_constraint
from mlxserve.server.api.openai.tokenize import add_tokenize_routes
from mlxserve.server.api.openai.tools import ToolPlan, plan_tools
from mlxserve.server.config import ServerConfig
from mlxserve.server.http.auth import APIKeyAuth
from mlxserve.server.http.errors import APIError, install_error_handlers
from mlxserve.server.http.json_body import StrictJSONRoute
from mlxserve.server.http.limits import BodySizeLimit
from mlxserve.server.lifecycle.loading import LoadProgress, backend_name
from mlxserve.server.lifecycle.state import ServerState, ServiceGate
from mlxserve.server.serving.context import ServingContext
from mlxserve.server.serving.prompts import completion_prompt_ids
from mlxserve.server.serving.reasoning import prompt_opens_reasoning

logger = logging.getLogger(__name__)


def _version() -> str:
    try:
        return metadata.version("mlxserve")
    except metadata.PackageNotFoundError:
        return "0.1.0"


VERSION = _version()


def create_app(
    loaded: LoadedModel | None,
    engine: Engine | None,
    config: ServerConfig,
    progress: LoadProgress | None = None,
) -> FastAPI:
    """Build the app serving ``loaded`` through ``engine`` (which the caller starts/stops).

    With ``loaded`` and ``engine`` None the app starts in the loading phase (``/health``
    503 with ``progress``); ``app.state.server.attach(loaded, engine)`` makes it ready.

    Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
    ``GET /v1/models/{model}``, ``POST /tokenize``, ``POST /detokenize``, ``GET /health``,
    ``GET /metrics``, ``GET /version``.
    """
    app = FastAPI(title="mlxserve", version=VERSION)
    app.router.route_class = StrictJSONRoute  # before any route is added
    install_error_handlers(app)
    install_openapi(app)
    state = ServerState(config, progress)
    app.state.server = state
    if (loaded is None) != (engine is None):
        raise ValueError("create_app needs both loaded and engine, or neither")
    if loaded is not None and engine is not None:
        state.attach(loaded, engine)

    # add_middleware puts each one outside the previous: the last added runs first.
    app.add_middleware(ServiceGate, state=state)
    app.add_middleware(BodySizeLimit, max_bytes=config.max_body_bytes)
    keys = config.api_keys()
    if keys:
        app.add_middleware(APIKeyAuth, keys=keys, protect_ops=config.protect_metrics)
    origins = config.origins()
    if origins:
        # Outermost, so that preflights (which carry no key) and 401s get CORS headers.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type"],
        )

    def ctx() -> ServingContext:
        assert state.ctx is not None, "ServiceGate lets API requests through only when ready"
        return state.ctx

    @app.get("/health", response_model=None)
    async def health() -> JSONResponse:
        status, body = state.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics", response_model=None)
    async def metrics() -> Response:
        if state.metrics is None:
            raise APIError(503, "Metrics start once the model is loaded.", type="server_error")
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/version")
    async def version() -> dict[str, str]:
        import mlx.core as mx
        import mlx_lm

        return {
            "version": VERSION,
            "mlx": mx.__version__,
            "mlx_lm": mlx_lm.__version__,
            "backend": backend_name(),
        }

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[_model_card(ctx())])

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> ModelCard:
        ctx().check_model(model)
        return _model_card(ctx())

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        c = ctx()
        c.check_model(body.model)
        add_generation_prompt, continue_final = continuation_mode(
            body.messages, body.add_generation_prompt, body.continue_final_message
        )
        tools = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, c.tool_format)
        constraint, tools = request_constraint(body, tools)
        prompt_text, prompt_ids = render_chat(
            c.tokenizer,
            body.messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final,
            template_kwargs=body.chat_template_kwargs,
            tools=tools.prompt_tools,
        )
        in_reasoning = c.reasoning and prompt_opens_reasoning(prompt_text)
        texts = c.token_texts if body.logprobs else None

        def shaper() -> ChatShaper:
            return ChatShaper(texts, body.top_logprobs or 0, c.reasoning, in_reasoning, tools)

        if constraint is not None:
            await check_constraint(c.engine, constraint)
        choices = c.submit("chatcmpl", prompt_ids, body, "messages", constraint)
        if body.stream:
            return stream_chat(choices, c.model_name, body.include_usage, shaper)
        return await complete_chat(choices, c.model_name, request, shaper)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        c = ctx()
        c.check_model(body.model)
        prompt_ids = completion_prompt_ids(c.tokenizer, body.prompt, c.vocab_size)
        echo_text = None
        if body.echo:
            prompt = body.prompt
            echo_text = prompt if isinstance(prompt, str) else c.tokenizer.decode(prompt_ids)
        texts = c.token_texts if body.logprobs is not None else None

        def shaper() -> CompletionShaper:
            return CompletionShaper(c.tokenizer, texts, body.logprobs or 0, echo_text)

        constraint, _ = request_constraint(body, ToolPlan())
        if constraint is not None:
            await check_constraint(c.engine, constraint)
        choices = c.submit("cmpl", prompt_ids, body, "prompt", constraint)
        if body.stream:
            return stream_completion(choices, c.model_name, body.include_usage, shaper)
        return await complete_text(choices, c.model_name, request, shaper)

    add_tokenize_routes(app, ctx)
    return app


def _model_card(ctx: ServingContext) -> ModelCard:
    return ModelCard(id=ctx.model_name, max_model_len=ctx.context_length)
