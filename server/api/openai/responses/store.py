"""The server's memory of Responses: a bounded in-memory store, least recently used out.

A stored response keeps the response object as it was sent, the input items of its
request, and its whole conversation (the conversation it continued, its input, its
output), so that ``previous_response_id`` rebuilds the conversation from one entry even
after the earlier ones were evicted. The items are shared, not copied, between the
conversations of a chain. The store lives on the event loop (no locking) and holds at most
``capacity`` responses (``--responses-store-size``; 0 keeps none).

Each response belongs to the tenant (API key) that created it: with several keys, another
key's id is not found (404), as it would be on OpenAI, so the store never shows one tenant's
conversation to another (the prefix cache is partitioned the same way).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    """One stored response.

    Attributes:
        response: the response object, as sent.
        input_items: its request's input items (with their ids), in order.
        conversation: every item of the conversation up to and including its output.
        tenant: the tenant that created it (None: one key, or none).
    """

    response: dict[str, Any]
    input_items: tuple[dict[str, Any], ...]
    conversation: tuple[dict[str, Any], ...]
    tenant: str | None = None


class ResponseStore:
    """Responses by id, at most ``capacity`` of them.

    Args:
        capacity: the most responses kept (0: none).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, stored: StoredResponse) -> None:
        """Keep ``stored`` (the least recently used goes when the store is full)."""
        if self.capacity == 0:
            return
        response_id = stored.response["id"]
        self._entries[response_id] = stored
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str, tenant: str | None = None) -> StoredResponse | None:
        """``tenant``'s stored response (now the most recently used), or None (unknown, or
        another tenant's)."""
        stored = self._entries.get(response_id)
        if stored is None or stored.tenant != tenant:
            return None
        self._entries.move_to_end(response_id)
        return stored

    def delete(self, response_id: str, tenant: str | None = None) -> bool:
        """Forget ``tenant``'s response; whether it was there (another tenant's is not)."""
        if self.get(response_id, tenant) is None:
            return False
        del self._entries[response_id]
        return True
