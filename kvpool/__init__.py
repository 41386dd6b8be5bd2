"""Numpy bookkeeping of KV memory: which request owns which token slots. No MLX here."""

from mlxserve.kvpool.req_to_token_pool import ReqToTokenPool
from mlxserve.kvpool.token_allocator import (
    SlotAllocator,
    StateSlotAllocator,
    TokenToKVPoolAllocator,
)

__all__ = ["ReqToTokenPool", "SlotAllocator", "StateSlotAllocator", "TokenToKVPoolAllocator"]
