"""The FastAPI app: the protocol adapters' routes over the served models, plus /health,
/metrics, /version and the chat page at / (``server/webui/``).

Routes come from the adapters (``server/api/openai/``, ``server/api/anthropic/``); around
them, outermost first: CORS, API keys, the body size limit, and the gate that answers 503
while the model loads or the server shuts down. Errors are answered in the shape of the
route's protocol (``server/http/errors.py``).
"""

from __future__ import annotations

import logging
from importlib import metadata

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.middleware.cors import CORSMiddleware

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.client import EngineClient
from mlxserve.server.api.admin import add_admin_routes
from mlxserve.server.api.anthropic.errors import MESSAGES_PREFIX, anthropic_error_shape
from mlxserve.server.api.anthropic.openapi import document_anthropic
from mlxserve.server.api.anthropic.routes import add_anthropic_routes
from mlxserve.server.api.openai.embeddings import add_embedding_routes
from mlxserve.server.api.openai.openapi import install_openapi
from mlxserve.server.api.openai.responses.openapi import document_responses
from mlxserve.server.api.openai.responses.routes import add_responses_routes
from mlxserve.server.api.openai.responses.store import ResponseStore
from mlxserve.server.api.openai.routes import add_openai_routes
from mlxserve.server.api.openai.tokenize import add_tokenize_routes
from mlxserve.server.config import ModelConfig, ServerConfig
from mlxserve.server.http.auth import APIKeyAuth, is_loopback
from mlxserve.server.http.errors import APIError, ErrorShapes, install_error_handlers
from mlxserve.server.http.gate import ServiceGate
from mlxserve.server.http.hosts import LoopbackHostOnly
from mlxserve.server.http.json_body import StrictJSONRoute
from mlxserve.server.http.limits import BodySizeLimit
from mlxserve.server.http.slow_clients import BodyReadTimeout
from mlxserve.server.lifecycle.loading import (
    LoadProgress,
    attention_line,
    backend_name,
    native_ops_line,
)
from mlxserve.server.lifecycle.state import ServerState
from mlxserve.server.webui.routes import add_webui_routes, is_webui_path

logger = logging.getLogger(__name__)


def _version() -> str:
    try:
        return metadata.version("mlxserve")
    except metadata.PackageNotFoundError:
        return "0.1.0"


VERSION = _version()


def create_app(
    loaded: LoadedModel | None,
    engine: EngineClient | None,
    config: ServerConfig,
    progress: LoadProgress | None = None,
    model_config: ModelConfig | None = None,
) -> FastAPI:
    """Build the app serving ``loaded`` through ``engine`` (which the caller starts/stops).

    With ``loaded`` and ``engine`` None the app starts in the loading phase (``/health``
    503 with ``progress``); ``app.state.server.attach(loaded, engine)`` makes it ready.

    Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/embeddings``,
    ``POST /v1/responses``,
    ``GET`` / ``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``,
    ``POST /v1/messages``, ``POST /v1/messages/count_tokens``, ``GET /v1/models``,
    ``GET /v1/models/{model}``,
    ``POST /tokenize``, ``POST /detokenize``, ``GET /health``, ``GET /metrics``,
    ``GET /version``; unless ``config.webui`` is off, the chat page ``GET /`` and its files
    ``GET /webui/{file}``.
    """
    app = FastAPI(title="mlxserve", version=VERSION)
    app.router.route_class = StrictJSONRoute  # before any route is added
    shapes = ErrorShapes()
    shapes.register(MESSAGES_PREFIX, anthropic_error_shape)
    install_error_handlers(app, shapes)
    install_openapi(app, patches=(document_responses, document_anthropic))
    state = ServerState(config, progress, model_config)
    app.state.server = state
    if (loaded is None) != (engine is None):
        raise ValueError("create_app needs both loaded and engine, or neither")
    if loaded is not None and engine is not None:
        state.attach(loaded, engine)

    # add_middleware puts each one outside the previous: the last added runs first.
    webui_open = is_webui_path if config.webui else (lambda path: False)
    app.add_middleware(ServiceGate, refusal=state.refusal, shapes=shapes, is_open=webui_open)
    app.add_middleware(BodyReadTimeout, seconds=config.body_timeout, shapes=shapes)
    app.add_middleware(BodySizeLimit, max_bytes=config.max_body_bytes, shapes=shapes)
    keys = config.api_keys()
    if keys:
        app.add_middleware(
            APIKeyAuth,
            keys=keys,
            protect_ops=config.protect_metrics,
            shapes=shapes,
            tenants=config.prefix_cache_per_key,
            x_api_key_prefixes=(MESSAGES_PREFIX,),
        )
    origins = config.origins()
    if origins:
        # Outermost, so that preflights (which carry no key) and 401s get CORS headers.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
            allow_headers=[
                "Authorization",
                "Content-Type",
                "x-api-key",
                "anthropic-version",
                "anthropic-beta",
            ],
        )
    hosts = config.hosts()
    if is_loopback(config.host) and "*" not in hosts:
        # Outermost: a rebound page's request is refused before anything else sees it.
        app.add_middleware(LoopbackHostOnly, extra=hosts, shapes=shapes)

    @app.get("/health", response_model=None)
    async def health() -> JSONResponse:
        status, body = state.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics", response_model=None)
    async def metrics() -> Response:
        if not state.metrics_ready:
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
            "attention": attention_line(),
            "elementwise": native_ops_line(),
        }

    add_openai_routes(app, state.models, state.admission)
    add_embedding_routes(app, state.models, state.admission)
    add_admin_routes(app, state.models, state.admission)
    app.state.responses = ResponseStore(config.responses_store_size)
    add_responses_routes(app, state.models, state.admission, app.state.responses)
    add_anthropic_routes(app, state.models, state.admission)
    add_tokenize_routes(app, state.models)
    if config.webui:
        add_webui_routes(app)
    return app
