"""Server and model configuration: frozen dataclasses whose field defaults are the CLI
defaults (``ServerConfig``: how the server is exposed and limited; ``ModelConfig``: what one
served model is and how it is served)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from mlxserve.server.serving.tool_parsers import check_tool_parser_name

LogLevel = Literal["debug", "info", "warning", "error"]

API_KEY_ENV = "MLXSERVE_API_KEY"


@dataclass(frozen=True)
class ServerConfig:
    """How the HTTP server is exposed.

    Attributes:
        host: address to bind.
        port: TCP port to bind.
        log_level: logging level of the server and of uvicorn.
        api_key: API keys, comma-separated, one of which every /v1/*, /tokenize and
            /detokenize request must send as "Authorization: Bearer KEY" (default: the
            MLXSERVE_API_KEY environment variable; unset: no authentication).
        protect_metrics: require an API key for /metrics, /health and /version too.
        allowed_origins: browser origins allowed by CORS, comma-separated, or "*" (default:
            none, no CORS headers).
        max_queue: requests that may wait for a batch slot; beyond it requests get 429 with
            Retry-After (0: no limit).
        request_timeout: seconds after which a request is aborted and answered with an
            error (0: no limit).
        max_body_bytes: largest request body; larger ones get 413 (0: no limit).
        max_prompt_tokens: longest prompt; longer ones get 400 (0: only the context limits
            it).
        stream_buffer_tokens: tokens a streaming client may leave unread before its request
            is aborted, so a stalled reader cannot hold the engine's memory.
        shutdown_timeout: seconds that running requests get to finish after SIGTERM/SIGINT
            before they are aborted.
        responses_store_size: responses of /v1/responses kept in memory for
            previous_response_id and GET /v1/responses/{id}, least recently used dropped
            first (0: none kept).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    log_level: LogLevel = "info"
    # Secrets stay out of repr(), so logging a config can never leak a key.
    api_key: str | None = field(default=None, repr=False)
    protect_metrics: bool = False
    allowed_origins: str | None = None
    max_queue: int = 256
    request_timeout: float = 0.0
    max_body_bytes: int = 16 * 1024 * 1024
    max_prompt_tokens: int = 0
    stream_buffer_tokens: int = 2048
    shutdown_timeout: float = 30.0
    responses_store_size: int = 1000

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("max_queue", "max_body_bytes", "max_prompt_tokens", "responses_store_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("request_timeout", "shutdown_timeout"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.stream_buffer_tokens < 1:
            raise ValueError(f"stream_buffer_tokens must be >= 1, got {self.stream_buffer_tokens}")

    def api_keys(self) -> tuple[str, ...]:
        """The accepted API keys: ``api_key``, else ``$MLXSERVE_API_KEY``; empty: no auth."""
        raw = self.api_key if self.api_key is not None else os.environ.get(API_KEY_ENV, "")
        return tuple(key.strip() for key in raw.split(",") if key.strip())

    def origins(self) -> list[str]:
        """The CORS origins of ``allowed_origins`` (empty: CORS off)."""
        return [o.strip() for o in (self.allowed_origins or "").split(",") if o.strip()]


@dataclass(frozen=True)
class ModelConfig:
    """One served model.

    Attributes:
        model: the model to serve: a .gguf file, an MLX or Hugging Face model directory, or
            a Hugging Face repo id (default: the embedded SmolLM2-135M-Instruct GGUF).
        served_model_name: the model id clients send and /v1/models lists (default: the
            loaded model's id).
        keep_quantized: on the CPU backend, serve quantized weights as they are instead of
            dequantizing them to float32 (which is several times faster with OpenBLAS but
            takes ~4-8x the weight memory).
        tool_parser: how tool calls are read from the output: "auto" (the parser mlx-lm
            gives the model's tokenizer, else "hermes"), "hermes" (<tool_call> JSON
            </tool_call>, the default format), or one of mlx-lm's parsers (json_tools,
            mistral, pythonic, qwen3_coder, glm47, ...).
    """

    model: str | None = None
    served_model_name: str | None = None
    keep_quantized: bool = False
    tool_parser: str = "auto"

    def __post_init__(self) -> None:
        check_tool_parser_name(self.tool_parser)
