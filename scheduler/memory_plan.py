"""How many slots of each kind the engine has: the numpy side's view of the model layout."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryPlan:
    """Slot counts, decided once after the model is loaded.

    Attributes:
        full_tokens: token slots of the full-attention space (0: no full-attention layer).
        sliding_tokens: token slots of the sliding-window space (0: no sliding layer).
        window: the widest sliding window (None without sliding layers).
        state_slots: recurrent-state slots (0: no recurrent layer).
        pool_bytes: the memory all the pools take (0: not known).
        ragged_attention: every attention layer reads each row's own keys in place (the
            backend's native op), so a decode row costs its own context, not the batch's
            longest: decode rows need no split by context (``row_groups.py``).
    """

    full_tokens: int
    sliding_tokens: int = 0
    window: int | None = None
    state_slots: int = 0
    pool_bytes: int = 0
    ragged_attention: bool = False

    @property
    def packed(self) -> bool:
        """Rows of any length share one forward without padding (the backend packs them
        into one-token rows): decode rows and prefill chunks run as one step."""
        return self.ragged_attention and not self.recurrent

    @property
    def recurrent(self) -> bool:
        """Recurrent layers cannot skip padding, so their prefill rows must be equal-length."""
        return self.state_slots > 0


@dataclass(frozen=True)
class PoolRequest:
    """What the engine asks the executor to size its pools for.

    Attributes:
        max_total_tokens: token slots of the full-attention space (0: from free memory).
        max_running_requests: request rows (one state slot, one window each).
        max_prefill_tokens: the largest prefill chunk (sliding windows hold one more).
        mem_fraction: share of free memory the pools may take when sized automatically.
        context_length: the longest sequence a request may reach.
        prefix_cache: the prefix cache is on (it keeps extra windows and state snapshots).
        memory_bytes: bytes the pools may take when sized automatically (0:
            ``mem_fraction`` of free memory).
        kv_bits: quantize the K/V pools to this many bits (None: float pools).
        kv_group_size: values per scale and bias of a quantized K/V row.
        extra_bytes_per_token: bytes another model's pools take per full-attention slot
            (a draft model's, which shares the slots), counted when sizing automatically.
    """

    max_total_tokens: int
    max_running_requests: int
    max_prefill_tokens: int
    mem_fraction: float
    context_length: int
    prefix_cache: bool
    memory_bytes: int = 0
    kv_bits: int | None = None
    kv_group_size: int = 64
    extra_bytes_per_token: int = 0


@dataclass(frozen=True)
class MemoryStats:
    """The backend's memory, in bytes: held by arrays now, the most ever held, and cached
    for reuse."""

    active: int = 0
    peak: int = 0
    cache: int = 0
