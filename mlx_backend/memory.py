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


def total_memory_bytes() -> int:
    """The memory models may use in all: Metal's recommended working set, or the
    system's RAM (``MemTotal``) on the CPU."""
    if mx.metal.is_available():
        return int(mx.device_info()["max_recommended_working_set_size"])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def plan_memory(
    layout: LayerLayout,
    max_total_tokens: int,
    max_running_requests: int,
    max_prefill_tokens: int,
    mem_fraction: float,
    context_length: int,
    prefix_cache: bool = False,
    memory_bytes: int = 0,
    quantization: KVQuantization | None = None,
    extra_bytes_per_token: int = 0,
) -> MemoryPlan:
    """Slot counts for every space the model's layers need.

    The sliding space holds, per running request, its window plus one prefill chunk; state
    slots are one per running request. A prefix cache doubles the window and the state
    slots (the window and state it keeps at a request's insert point stay locked while the
    request runs). The full space gets ``max_total_tokens``, or what is left of
    ``memory_bytes`` (0: ``mem_fraction`` of free memory) after those two. The plan's
    ``pool_bytes`` is what all the pools take. Slots are counted in the bytes the pools
    store per token: with ``quantization``, packed values, scales and biases, so the same
    budget holds more of them. ``extra_bytes_per_token`` (a draft model's pools over the
    same slots) is charged to each full slot when sizing from memory; ``pool_bytes`` counts
    this model's pools only.
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
            total = memory_bytes or int(available_memory_bytes() * mem_fraction)
            budget = total - fixed
            per_slot = per_token + extra_bytes_per_token
            full = min(budget // per_slot, max_running_requests * context_length)
            if full < 1:
                raise MemoryError(f"no room for a KV pool: {budget} bytes left for it")
    elif window and max_total_tokens:
        sliding = max(max_total_tokens, window + max_prefill_tokens)
    pool_bytes = (
        full * per_token
        + sliding * layout.bytes_per_token("sliding", quantization)
        + states * layout.bytes_per_state_slot
    )
    return MemoryPlan(
        full_tokens=full,
        sliding_tokens=sliding,
        window=window,
        state_slots=states,
        pool_bytes=pool_bytes,
    )
