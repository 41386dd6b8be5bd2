"""Server configuration: one frozen dataclass whose field defaults are the CLI defaults."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LogLevel = Literal["debug", "info", "warning", "error"]


@dataclass(frozen=True)
class ServerConfig:
    """How the HTTP server is exposed.

    Attributes:
        model: the model to serve: a .gguf file, an MLX or Hugging Face model directory, or
            a Hugging Face repo id (default: the embedded SmolLM2-135M-Instruct GGUF).
        served_model_name: the model id clients send and /v1/models lists (default: the
            loaded model's id).
        host: address to bind.
        port: TCP port to bind.
        log_level: logging level of the server and of uvicorn.
    """

    model: str | None = None
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: LogLevel = "info"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
