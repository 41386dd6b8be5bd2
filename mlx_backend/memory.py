"""How much memory the KV pool may take: from free device memory, after the model loaded."""

from __future__ import annotations

import os

import mlx.core as mx

from mlxserve.mlx_backend.kv.layer_layout import LayerLayout
from mlxserve.mlx_backend.kv.quantization import KVQuantization
from mlxserve.scheduler.memory_plan import MemoryPlan


def available_memory_bytes() -> int:
    """Memory the KV pool could still use.

    Metal: the recommended working set minus what MLX already holds. CPU: the system's
    available memory (``MemAvailable``), since MLX's CPU arrays live in ordinary RAM.
    """
    if mx.metal.is_available():
        info = mx.device_info()
        return int(info["max_recommended_working_set_size"]) - mx.get_active_memory()
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def plan_memory(
    layout: LayerLayout,
    max_total_tokens: int,
    max_running_requests: int,
    max_prefill_tokens: int,
    mem_fraction: float,
    context_length: int,
    prefix_cache: bool = False,
    quantization: KVQuantization | None = None,
    available_bytes: int | None = None,
) -> MemoryPlan:
    """Slot counts for every space the model's layers need.

    The sliding space holds, per running request, its window plus one prefill chunk; state
    slots are one per running request. A prefix cache doubles the window and the state
    slots (the window and state it keeps at a request's insert point stay locked while the
    request runs). The full space gets ``max_total_tokens``, or what is left of
    ``mem_fraction`` of free memory (or of ``available_bytes``) after those two. Slots are
    counted in the bytes the pools store per token: with ``quantization``, packed values,
    scales and biases, so the same budget holds more of them.
    """
    window = layout.sliding_window
    copies = 2 if prefix_cache else 1
    sliding = max_running_requests * (copies * window + max_prefill_tokens) if window else 0
    states = max_running_requests * copies if layout.recurrent else 0
    full = 0
    per_token = layout.bytes_per_token("full", quantization)
    if per_token:
        full = max_total_tokens
        if not full:
            fixed = sliding * layout.bytes_per_token("sliding", quantization)
            fixed += states * layout.bytes_per_state_slot
            available = available_memory_bytes() if available_bytes is None else available_bytes
            budget = int(available * mem_fraction) - fixed
            full = min(budget // per_token, max_running_requests * context_length)
            if full < 1:
                raise MemoryError(f"no room for a KV pool: {budget} bytes left for it")
    elif window and max_total_tokens:
        sliding = max(max_total_tokens, window + max_prefill_tokens)
    return MemoryPlan(full_tokens=full, sliding_tokens=sliding, window=window, state_slots=states)
