"""The server's memory of Responses: a bounded in-memory store, least recently used out.

A stored response keeps the response object as it was sent, the input items of its
request, and its whole conversation (the conversation it continued, its input, its
output), so that ``previous_response_id`` rebuilds the conversation from one entry even
after the earlier ones were evicted. The items are shared, not copied, between the
conversations of a chain. The store lives on the event loop (no locking) and holds at most
``capacity`` responses (``--responses-store-size``; 0 keeps none).
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
    """

    response: dict[str, Any]
    input_items: tuple[dict[str, Any], ...]
    conversation: tuple[dict[str, Any], ...]


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

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response (now the most recently used), or None."""
        stored = self._entries.get(response_id)
        if stored is not None:
            self._entries.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        """Forget a response; whether it was there."""
        return self._entries.pop(response_id, None) is not None
