"""What the parts of ``bench/kv_quant.py`` share: the pools compared, an engine over a
chosen pool and attention path, and a run of prompts through it."""

from __future__ import annotations

import threading
import time
from typing import Any

BITS = (None, 8, 4)
GROUP_SIZE = 64


def pool_name(bits: int | None, path: str | None = None) -> str:
    if bits is None:
        return "off"
    return f"{bits}-bit" + (f" {path}" if path else "")


def quant(bits: int | None):  # noqa: ANN202
    from mlxserve.mlx_backend.kv.quantization import KVQuantization

    return None if bits is None else KVQuantization(bits, GROUP_SIZE)


def make_engine(loaded: Any, bits: int | None, path: str | None, **config: Any) -> Any:
    from mlxserve.mlx_backend.executor import MLXExecutor
    from mlxserve.scheduler.config import EngineConfig
    from mlxserve.scheduler.engine import Engine

    cfg = EngineConfig(kv_bits=bits, kv_group_size=GROUP_SIZE, **config)
    executor = MLXExecutor(loaded.model, seed=cfg.seed, kv_attention=path)
    return Engine(executor, cfg, context_length=loaded.context_length, tokenizer=loaded.tokenizer)


def serve(engine: Any, prompts: list[list[int]], params: Any, timeout_s: float) -> dict:
    """Run ``prompts`` to the end; returns tokens per request and each forward's
    (phase, rows, seconds)."""
    steps: list[tuple[str, int, float]] = []
    forward = engine.executor.forward

    def timed(batch: Any) -> Any:
        start = time.perf_counter()
        out = forward(batch)
        steps.append((batch.phase, batch.batch_size, time.perf_counter() - start))
        return out

    engine.executor.forward = timed
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    done = threading.Event()
    left = [len(prompts)]
    lock = threading.Lock()

    def on_output(i: int):  # noqa: ANN202
        def callback(event: Any) -> None:
            tokens[i].extend(event.new_token_ids)
            if event.finished:
                with lock:
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()

        return callback

    engine.start()
    try:
        for i, ids in enumerate(prompts):
            engine.add_request(f"r{i}", ids, params, on_output(i))
        finished = done.wait(timeout_s)
    finally:
        engine.shutdown()
    return {"finished": finished, "tokens": tokens, "steps": steps}


def corpus(loaded: Any, requests: int) -> list[list[int]]:
    from bench.corpus import chat_ids, make_prompts

    return [chat_ids(loaded.tokenizer, p) for p in make_prompts(0, requests)]
