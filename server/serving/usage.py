"""Token counts of one answer, before any protocol names them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class UsageCounts:
    """What an answer used.

    Attributes:
        prompt_tokens: tokens of the prompt (counted once, whatever ``n``).
        completion_tokens: tokens generated, over every choice.
        cached_tokens: prompt tokens whose K/V came from the prefix cache.
    """

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens
