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


_UNITS = {
    "": 1,
    "k": 1000,
    "m": 1000**2,
    "g": 1000**3,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
}


def parse_memory_budget(text: str, total: int) -> int:
    """``"0.5"`` (of ``total``), ``"8GiB"``, ``"16e9"`` -> bytes.

    Raises:
        ValueError: not a fraction in (0, 1] nor a positive size.
    """
    value = text.strip().lower()
    number = value.rstrip("kmgib")
    unit = value[len(number) :]
    try:
        amount = float(number)
    except ValueError:
        amount = -1.0
    if unit not in _UNITS or amount <= 0:
        raise ValueError(f"memory_budget must be a size (8GiB, 16e9) or a fraction, got {text!r}")
    if not unit and amount <= 1:
        return int(total * amount)
    return int(amount * _UNITS[unit])


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
        prefix_cache_per_key: with several API keys, keep each key's cached prompt
            prefixes to itself, so that no key can learn from cache hits (or their speed)
            what another key's prompts were.
        allowed_origins: browser origins allowed by CORS, comma-separated, or "*" (default:
            none, no CORS headers).
        max_queue: requests that may wait for a batch slot; beyond it requests get 429 with
            Retry-After (0: no limit).
        request_timeout: seconds after which a request is aborted and answered with an
            error (0: no limit).
        max_body_bytes: largest request body; larger ones get 413 (0: no limit).
        header_timeout: seconds a connection may take to send a request's headers (from
            when it opens or its previous response ends) before it is closed (0: no limit).
        body_timeout: seconds a request body may take to arrive, from its first byte,
            before the request gets 408 (0: no limit).
        max_connections: open connections beyond which new requests get 503 (0: no
            limit).
        allowed_hosts: Host header names accepted besides the loopback ones
            (localhost, 127.0.0.1, [::1]) while the server is bound to a loopback address,
            comma-separated, or "*" for any (a browser page that rebinds its own name to
            127.0.0.1 sends its name as Host).
        max_prompt_tokens: longest prompt; longer ones get 400 (0: only the context limits
            it).
        stream_buffer_tokens: tokens a streaming client may leave unread before its request
            is aborted, so a stalled reader cannot hold the engine's memory.
        shutdown_timeout: seconds that running requests get to finish after SIGTERM/SIGINT
            before they are aborted.
        models_config: a TOML file declaring the models to serve (``[[models]]`` tables:
            source, names, context_length, max_total_tokens, tool_parser, keep_quantized,
            adapter, pinned, ttl, task).
        models_dir: a folder whose model directories and .gguf files are all served,
            each named by its folder or file name.
        max_loaded_models: most models loaded at once; loading another unloads the least
            recently used idle one (0: no limit).
        memory_budget: memory every loaded model's weights and KV pools share, in bytes
            (suffixes K, M, G, KiB, MiB, GiB) or as a fraction of the machine's memory
            (0.5); loading a model unloads idle ones until it fits (none: no budget).
        model_ttl: seconds without a request after which a model is unloaded (0: never;
            pinned models stay).
        responses_store_size: responses of /v1/responses kept in memory for
            previous_response_id and GET /v1/responses/{id}, least recently used dropped
            first (0: none kept).
        webui: serve the built-in chat page at / (its files under /webui/); --no-webui
            turns it off (404).
        allow_image_urls: fetch http(s) image URLs of vision requests (off: only inline
            data: URLs and base64 images; a URL is a 400).
        max_images_per_request: most images one request may carry (more: 400).
        max_image_bytes: largest encoded image, inline or fetched (larger: 400).
        max_image_pixels: most pixels (width x height, summed over its images) one request
            may carry (more: 400).
        image_url_timeout: seconds an image URL may take to fetch (longer: 400).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    log_level: LogLevel = "info"
    # Secrets stay out of repr(), so logging a config can never leak a key.
    api_key: str | None = field(default=None, repr=False)
    protect_metrics: bool = False
    prefix_cache_per_key: bool = True
    allowed_origins: str | None = None
    max_queue: int = 256
    request_timeout: float = 0.0
    max_body_bytes: int = 16 * 1024 * 1024
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    max_connections: int = 1000
    allowed_hosts: str | None = None
    max_prompt_tokens: int = 0
    stream_buffer_tokens: int = 2048
    shutdown_timeout: float = 30.0
    models_config: str | None = None
    models_dir: str | None = None
    max_loaded_models: int = 0
    memory_budget: str | None = None
    model_ttl: float = 0.0
    responses_store_size: int = 1000
    webui: bool = True
    allow_image_urls: bool = False
    max_images_per_request: int = 8
    max_image_bytes: int = 10 * 1024 * 1024
    max_image_pixels: int = 16 * 1024 * 1024
    image_url_timeout: float = 10.0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in (
            "max_queue",
            "max_body_bytes",
            "max_prompt_tokens",
            "max_connections",
            "max_loaded_models",
            "responses_store_size",
            "max_images_per_request",
            "max_image_bytes",
            "max_image_pixels",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in (
            "request_timeout",
            "shutdown_timeout",
            "header_timeout",
            "body_timeout",
            "model_ttl",
            "image_url_timeout",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.memory_budget is not None:
            parse_memory_budget(self.memory_budget, 1)
        if self.stream_buffer_tokens < 1:
            raise ValueError(f"stream_buffer_tokens must be >= 1, got {self.stream_buffer_tokens}")

    def memory_budget_bytes(self, total: int) -> int:
        """``memory_budget`` in bytes, a fraction of ``total`` resolved (0: no budget)."""
        if self.memory_budget is None:
            return 0
        return parse_memory_budget(self.memory_budget, total)

    def api_keys(self) -> tuple[str, ...]:
        """The accepted API keys: ``api_key``, else ``$MLXSERVE_API_KEY``; empty: no auth."""
        raw = self.api_key if self.api_key is not None else os.environ.get(API_KEY_ENV, "")
        return tuple(key.strip() for key in raw.split(",") if key.strip())

    def hosts(self) -> list[str]:
        """The extra Host names of ``allowed_hosts`` (lower case; "*": any)."""
        return [h.strip().lower() for h in (self.allowed_hosts or "").split(",") if h.strip()]

    def origins(self) -> list[str]:
        """The CORS origins of ``allowed_origins`` (empty: CORS off)."""
        return [o.strip() for o in (self.allowed_origins or "").split(",") if o.strip()]


@dataclass(frozen=True)
class ModelConfig:
    """One served model.

    Attributes:
        model: the model to serve: a .gguf file, an MLX or Hugging Face model directory, or
            a Hugging Face repo id (default: the embedded SmolLM2-135M-Instruct GGUF).
            Repeat it, or add options (SOURCE,name=ALIAS,pinned=true,ttl=S,
            context_length=N,max_total_tokens=N,tool_parser=P,keep_quantized=true,
            adapter=DIR,task=embed), to serve several models, loaded on demand.
        served_model_name: the model id clients send and /v1/models lists (default: the
            loaded model's id).
        keep_quantized: on the CPU backend, serve quantized weights as they are instead of
            dequantizing them to float32 (which is several times faster with OpenBLAS but
            takes ~4-8x the weight memory); GGUF formats MLX cannot hold exactly (Q6_K,
            Q3_K, Q2_K, IQ*) are then requantized to 8 bits, which is not exact.
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


@dataclass(frozen=True)
class DistributedConfig:
    """One model split over several processes (tensor parallelism on ``mx.distributed``).

    Attributes:
        tensor_parallel: split the model over N ranks; without --distributed, mlxserve
            starts the N-1 other ranks on this machine itself (ring backend over
            127.0.0.1). 1: one process.
        pipeline_parallel: split the model by layers over N ranks instead (each rank
            keeps a run of whole layers; for models with mlx-lm's pipeline(), e.g.
            deepseek_v3, qwen3_5, qwen3_next, ministral3); started like --tensor-parallel.
        distributed: this process is one rank of a group started by mlx.launch (which
            sets MLX_RANK and MLX_HOSTFILE); every rank runs the same command, rank 0
            serves HTTP and the others run its forwards.
        distributed_backend: the mx.distributed backend (ring: TCP; jaccl: Thunderbolt
            RDMA; mpi: Open MPI).
        distributed_timeout: seconds each rank waits for the whole group to form before it
            exits with an error.
        distributed_host: the address the other ranks reach rank 0's control channel at
            (default: rank 0's host in the ring hostfile, else JACCL's coordinator, else
            127.0.0.1).
    """

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    distributed: bool = False
    distributed_backend: Literal["ring", "jaccl", "mpi", "any"] = "ring"
    distributed_timeout: float = 60.0
    distributed_host: str | None = None

    def __post_init__(self) -> None:
        if self.tensor_parallel < 1 or self.pipeline_parallel < 1:
            raise ValueError("tensor_parallel and pipeline_parallel must be >= 1")
        if self.tensor_parallel > 1 and self.pipeline_parallel > 1:
            raise ValueError("choose --tensor-parallel or --pipeline-parallel, not both")
        if self.distributed_timeout <= 0:
            raise ValueError("distributed_timeout must be positive")
        if self.ranks > 1 and not self.distributed and self.distributed_backend != "ring":
            raise ValueError("local ranks (--tensor-parallel without --distributed) use ring")

    @property
    def ranks(self) -> int:
        """The group size asked for (1: whatever mlx.launch started)."""
        return max(self.tensor_parallel, self.pipeline_parallel)

    @property
    def split(self) -> str:
        """How the model is split: "pipeline" or "tensor"."""
        return "pipeline" if self.pipeline_parallel > 1 else "tensor"

    @property
    def enabled(self) -> bool:
        """Whether this process is one rank of a group."""
        return self.distributed or self.ranks > 1
