"""Loading the model behind a live HTTP server: stages, progress, warm-up, start-up log.

The server answers as soon as it is bound; the model loads on a background thread::

    weights (read) -> conversion (backend) -> engine (KV pools) -> warm-up (1 request)
    0 ................ 0.6 .................. 0.75 ................ 0.9 ............... 1

``/health`` reports the stage and the fraction done (503) until the engine is warm (200).
On a terminal the same progress is drawn as a bar.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.client import EngineClient
from mlxserve.scheduler.config import EngineConfig
from mlxserve.scheduler.engine import Engine
from mlxserve.scheduler.outputs import RequestOutput
from mlxserve.scheduler.sampling_params import SamplingParams
from mlxserve.server.lifecycle.engines import build_engine

logger = logging.getLogger(__name__)

# Where each stage starts on the 0..1 scale (weights dominate the time of a cold start).
STAGE_STARTS = {
    "starting": 0.0,
    "weights": 0.0,
    "conversion": 0.6,
    "engine": 0.75,
    "warmup": 0.9,
    "ready": 1.0,
}
WARMUP_TIMEOUT_S = 600.0


class LoadProgress:
    """How far loading is; written by the loading thread, read by ``/health`` (thread-safe).

    Args:
        show_bar: draw a progress bar on stderr (default: when stderr is a terminal).
    """

    def __init__(self, show_bar: bool | None = None) -> None:
        self._lock = threading.Lock()
        self.stage = "starting"
        self.fraction = 0.0
        self.error: str | None = None
        self.ready = False
        if show_bar is None:
            show_bar = sys.stderr.isatty()
        self._bar = _make_bar() if show_bar else None

    def begin(self, stage: str) -> None:
        """Enter ``stage`` (one of ``STAGE_STARTS``)."""
        with self._lock:
            self.stage = stage
            self.fraction = STAGE_STARTS[stage]
        if self._bar is not None:
            self._bar.set_description_str(f"loading: {stage}")
            self._bar.update(round(self.fraction * 100) - self._bar.n)
        else:
            logger.info("loading: %s", stage)

    def finish(self) -> None:
        """Loading is done: the server is ready."""
        with self._lock:
            self.stage, self.fraction, self.ready = "ready", 1.0, True
        self._close_bar("ready")

    def fail(self, error: str) -> None:
        """Loading failed with ``error`` (one line)."""
        with self._lock:
            self.error = error
        self._close_bar("failed")

    def snapshot(self) -> dict[str, Any]:
        """``{"status": "loading"|"ready"|"failed", "stage", "progress"}`` for ``/health``."""
        with self._lock:
            status = "failed" if self.error else "ready" if self.ready else "loading"
            body: dict[str, Any] = {
                "status": status,
                "stage": self.stage,
                "progress": round(self.fraction, 3),
            }
            if self.error:
                body["detail"] = self.error
            return body

    def _close_bar(self, label: str) -> None:
        if self._bar is not None:
            self._bar.set_description_str(f"loading: {label}")
            self._bar.update(100 - self._bar.n if label == "ready" else 0)
            self._bar.close()
            self._bar = None


def _make_bar() -> Any:
    from tqdm import tqdm

    return tqdm(
        total=100,
        file=sys.stderr,
        bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}",
        desc="loading",
        leave=True,
    )


def convert_for_backend(loaded: LoadedModel) -> str | None:
    """The conversion stage on the CPU backend: a model whose quantized layers the native
    quantized matmul serves stays quantized (its half-precision scales and norms widened to
    float32; faster than float32 weights through OpenBLAS up to a batch of ~32 and a fifth of
    the memory, ``mlx_backend/quantized_matmul.py``); any other quantized model becomes
    float32 when memory allows (``mlx_backend/loading/dequantize.py``). Returns a one-line
    note for the log."""
    from mlxserve.mlx_backend.loading.dequantize import dequantize_for_cpu, widen_half_precision
    from mlxserve.mlx_backend.quantized_matmul import layers_served

    served = layers_served(loaded.model)
    if served:
        widen_half_precision(loaded.model)
        return f"kept quantized: the native quantized matmul serves its {served} quantized layers"
    return dequantize_for_cpu(loaded.model).reason


def keep_quantized_note(loaded: LoadedModel) -> str:
    """The conversion stage under ``--keep-quantized``: the weights stay as loaded; on the
    CPU backend half-precision scales, biases and norms become float32, which the native
    quantized matmul takes."""
    from mlxserve.mlx_backend.loading.dequantize import widen_half_precision

    if widen_half_precision(loaded.model):
        return "weights kept as loaded (--keep-quantized); half-precision parameters in float32"
    return "weights kept as loaded (--keep-quantized)"


def warm_up(engine: EngineClient, loaded: LoadedModel, embed: bool = False) -> None:
    """Run one tiny request (a prefill and a decode step; for an embedding model, one
    embedding) so the first client does not pay for MLX's first-use costs.

    Raises:
        RuntimeError: the request failed or did not finish in time.
    """
    prompt = list(loaded.tokenizer.encode("Hello"))[:4] or [0]
    done = threading.Event()
    final: list[RequestOutput] = []

    def on_output(event: RequestOutput) -> None:
        if event.finished:
            final.append(event)
            done.set()

    params = SamplingParams(max_tokens=2, temperature=0.0)
    embed = embed or loaded.kind == "encoder"
    engine.add_request(f"warmup-{uuid.uuid4().hex}", prompt, params, on_output, embed=embed)
    if not done.wait(WARMUP_TIMEOUT_S):
        raise RuntimeError(f"warm-up request did not finish in {WARMUP_TIMEOUT_S:g} s")
    if final[0].finish_reason == "error":
        raise RuntimeError(f"warm-up request failed: {final[0].error}")


class BackgroundLoader:
    """Loads the model, starts its engine and warms it up on a daemon thread.

    Args:
        load: returns the loaded model (the "weights" stage).
        engine_config: the engine's sizes.
        progress: where stages are reported.
        on_ready: called on the loading thread with the model and its started engine.
        on_failed: called on the loading thread with the error when any stage failed.
        convert: the conversion stage (None: skipped).
        warmup: run the warm-up request.
        build: makes the engine (``build_engine``; a tensor-parallel rank 0 binds its
            group into it).
    """

    def __init__(
        self,
        load: Callable[[], LoadedModel],
        engine_config: EngineConfig,
        progress: LoadProgress,
        on_ready: Callable[[LoadedModel, EngineClient], None],
        on_failed: Callable[[BaseException], None] | None = None,
        convert: Callable[[LoadedModel], str | None] | None = convert_for_backend,
        warmup: bool = True,
        build: Callable[[LoadedModel, EngineConfig], Engine] = build_engine,
    ) -> None:
        self._build = build
        self._load = load
        self._engine_config = engine_config
        self._progress = progress
        self._on_ready = on_ready
        self._on_failed = on_failed
        self._convert = convert
        self._warmup = warmup
        self.engine: Engine | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="mlxserve-loader", daemon=True)

    def start(self) -> BackgroundLoader:
        self._thread.start()
        return self

    def join(self, timeout: float | None = None) -> bool:
        """Wait for loading to end; False if it is still running after ``timeout``."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            loaded, self.engine = load_stages(
                self._load,
                lambda _: self._engine_config,
                self._progress,
                self._convert,
                self._warmup,
                build=self._build,
            )
            self._on_ready(loaded, self.engine)
            self._progress.finish()
        except BaseException as e:  # noqa: BLE001 - reported through progress and on_failed
            self.error = e
            self._progress.fail(str(e))
            logger.error("loading failed: %s", e)
            if self._on_failed is not None:
                self._on_failed(e)


def load_stages(
    load: Callable[[], LoadedModel],
    engine_config_for: Callable[[int], EngineConfig],
    progress: LoadProgress,
    convert: Callable[[LoadedModel], str | None] | None = convert_for_backend,
    warmup: bool = True,
    embed: bool = False,
    build: Callable[[LoadedModel, EngineConfig], Engine] = build_engine,
) -> tuple[LoadedModel, Engine]:
    """Load a model and start its engine, stage by stage (weights, conversion, engine,
    warm-up), reporting each to ``progress``.

    Args:
        load: returns the loaded model.
        engine_config_for: the engine's sizes, given the weights' bytes after conversion
            (a memory budget sizes the pools from what the weights leave).
        progress: where stages are reported (``finish`` is the caller's).
        convert: the conversion stage (None: skipped).
        warmup: run the warm-up request.
        embed: the model serves embeddings (its warm-up is an embedding request).
        build: makes the engine from the model and its sizes.

    Raises:
        Exception: a stage failed (an engine already started is shut down).
    """
    started = time.monotonic()
    progress.begin("weights")
    loaded = load()
    note = None
    if convert is not None:
        progress.begin("conversion")
        note = convert(loaded)
    progress.begin("engine")
    engine = build(loaded, engine_config_for(weight_bytes(loaded.model)))
    engine.start()
    try:
        if warmup:
            progress.begin("warmup")
            warm_up(engine, loaded, embed)
    except BaseException:
        engine.shutdown()
        raise
    log_model(loaded, note, time.monotonic() - started)
    return loaded, engine


def weight_bytes(model: Any) -> int:
    """Bytes of a model's parameters (0 for a model without them, e.g. a test double)."""
    if model is None:
        return 0
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


# ----------------------------------------------------------------- start-up log
def backend_name() -> str:
    """Where MLX runs by default: "metal" or "cpu"."""
    import mlx.core as mx

    return "metal" if mx.default_device().type == mx.gpu and mx.metal.is_available() else "cpu"


def blas_line() -> str:
    """Which BLAS serves MLX's CPU matmuls, in one line."""
    if backend_name() == "metal":
        return "not used (Metal)"
    from mlxserve.mlx_backend.cpu.blas import blas_status

    status = blas_status()
    if status is None:
        # server.cli.main() calls enable_fast_blas() before MLX is imported; embedders may not.
        return "MLX's bundled BLAS (enable_fast_blas() was not called)"
    if status.active:
        return f"{status.path} ({status.reason})"
    return f"MLX's bundled BLAS ({status.reason})"


def attention_line() -> str:
    """Which attention path serves the pool views, in one line (per-layer fallbacks are
    logged when a model's pools are allocated)."""
    if backend_name() == "metal":
        return "MLX SDPA over gathered K/V (Metal)"
    from mlxserve.mlx_backend.attention.native import native_status

    status = native_status()
    if status.active:
        return status.describe()
    return f"MLX SDPA over gathered K/V ({status.reason})"


def native_ops_line() -> str:
    """Which path serves the models' elementwise ops (swiglu, rope, RMS norm), in one line
    (which of them a model reaches is logged when its pools are allocated)."""
    if backend_name() == "metal":
        return "MLX's (Metal)"
    from mlxserve.mlx_backend.native_ops import describe

    return describe()


def describe_weights(model: Any) -> str:
    """dtype and size of a model's parameters, e.g. "float32, 4-bit quantized (210 layers),
    95 MiB"."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    by_dtype: dict[str, int] = {}
    total = 0
    for _, value in tree_flatten(model.parameters()):
        total += value.nbytes
        if mx.issubdtype(value.dtype, mx.floating):
            name = str(value.dtype).removeprefix("mlx.core.")
            by_dtype[name] = by_dtype.get(name, 0) + value.nbytes
    dtype = max(by_dtype, key=by_dtype.__getitem__) if by_dtype else "unknown"
    # nn.QuantizedLinear, nn.QuantizedEmbedding, mlx-lm's QuantizedSwitchLinear, ...
    quantized = [m for _, m in model.named_modules() if type(m).__name__.startswith("Quantized")]
    parts = [dtype]
    if quantized:
        bits = "/".join(str(b) for b in sorted({getattr(m, "bits", 0) for m in quantized}))
        parts.append(f"{bits}-bit quantized ({len(quantized)} layers)")
    parts.append(f"{total / 2**20:.0f} MiB")
    return ", ".join(parts)


def log_model(loaded: LoadedModel, conversion: str | None, seconds: float) -> None:
    """The start-up log's model line(s)."""
    logger.info(
        "model %s loaded in %.1f s: %s, context %d",
        loaded.model_id,
        seconds,
        describe_weights(loaded.model),
        loaded.context_length,
    )
    if conversion:
        logger.info("conversion: %s", conversion)
