"""How much memory the KV pool may take: from free device memory, after the model loaded."""

from __future__ import annotations

import os

import mlx.core as mx


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


def derive_pool_tokens(bytes_per_token: int, mem_fraction: float, cap: int) -> int:
    """Token slots that fit in ``mem_fraction`` of the available memory, at most ``cap``.

    Raises:
        MemoryError: not even one full request fits.
    """
    budget = int(available_memory_bytes() * mem_fraction)
    tokens = min(budget // max(bytes_per_token, 1), cap)
    if tokens < 1:
        raise MemoryError(
            f"no room for a KV pool: {budget} bytes available at {bytes_per_token} per token"
        )
    return tokens
