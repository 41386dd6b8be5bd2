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
    """

    full_tokens: int
    sliding_tokens: int = 0
    window: int | None = None
    state_slots: int = 0

    @property
    def recurrent(self) -> bool:
        """Recurrent layers cannot skip padding, so their prefill rows must be equal-length."""
        return self.state_slots > 0
