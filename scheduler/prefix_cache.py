"""The scheduler's side of the prefix cache: match at admission, insert at chunk ends and at
release, evict on demand, and the state copies that hybrid models need.

Where a sequence is inserted (the points a later request can resume from):

- full-attention models: at every prefill chunk's end and when the request leaves; a match
  may stop anywhere inside what was inserted.
- models with recurrent layers: the same points, each with a snapshot of the recurrent
  state (a copy made by the executor right after the chunk's forward); a match stops only
  at a snapshot.
- sliding-window models: where the request leaves, and one token before the end of its
  prompt, where the window behind it is still held.

So that an identical prompt (``n > 1``, a retried request, a preempted one resuming) can
reuse everything but its last token, models with recurrent or sliding layers stop their
prefill one token short: the last prompt token runs in the next decode step.
"""

from __future__ import annotations

import numpy as np

from mlxserve.kvpool import ReqToTokenPool, StateSlotAllocator
from mlxserve.scheduler.memory_plan import MemoryPlan
from mlxserve.scheduler.radix_cache import PrefixMatch, RadixCache, common_prefix_len
from mlxserve.scheduler.request import Request
from mlxserve.scheduler.token_spaces import TokenSpaces

# A waiting request that shares at least this many more tokens (or its whole prompt) with
# a request still being prefilled waits for that prefill to be inserted, instead of
# computing the same prefix twice in parallel.
DEFER_MIN_GAIN = 16


class PrefixCache:
    """Prefix reuse for the scheduler; with ``enabled=False`` every call is a no-op and
    requests own all their slots.

    Args:
        spaces: the token slot spaces.
        state_allocator: state slots (models with recurrent layers), else None.
        req_pool: request rows (free rows are kept in reserve for admission).
        plan: the memory plan (window, recurrent).
        enabled: False for ``--disable-prefix-cache``.
    """

    def __init__(
        self,
        spaces: TokenSpaces,
        state_allocator: StateSlotAllocator | None,
        req_pool: ReqToTokenPool,
        plan: MemoryPlan,
        enabled: bool,
    ) -> None:
        self.spaces = spaces
        self.state_allocator = state_allocator
        self.req_pool = req_pool
        self.recurrent = plan.recurrent
        self.sliding = spaces.sliding is not None
        self.tree: RadixCache | None = None
        if enabled:
            allocators = {s.name: s.allocator for s in spaces.spaces}
            window = plan.window if self.sliding else None
            self.tree = RadixCache(allocators, state_allocator, window)
        # Prompt tokens looked up and found (mlxserve:prefix_cache_queries/hits_total).
        self.queries = 0
        self.hits = 0
        self._copies_in: list[tuple[int, int]] = []

    @property
    def stop_short(self) -> bool:
        """Whether prefill stops one token before the end of a sequence (see module doc)."""
        return self.tree is not None and (self.recurrent or self.sliding)

    # ----------------------------------------------------------------- room
    def available(self) -> int:
        """Positions that can still be added, counting evictable cache slots as free."""
        if not self.spaces.spaces:
            return np.iinfo(np.int32).max
        evictable = self.tree.evictable if self.tree is not None else {}
        return min(
            s.allocator.available_size() + evictable.get(s.name, 0) for s in self.spaces.spaces
        )

    def make_room(self, n: int) -> None:
        """Evict cache until ``n`` positions can be allocated in every space."""
        if self.tree is not None and self.spaces.available() < n:
            self.tree.evict(lambda: self.spaces.available() >= n)

    def alloc_state(self, reserve: int = 0) -> int | None:
        """A state slot, evicting snapshots if needed while keeping ``reserve`` free;
        ``None`` when there is none."""
        alloc = self.state_allocator
        if alloc.available_size() <= reserve and self.tree is not None:
            self.tree.evict(lambda: alloc.available_size() > reserve)
        if alloc.available_size() <= reserve:
            return None
        return int(alloc.alloc(1)[0])

    # ----------------------------------------------------------------- admission
    def match(self, req: Request) -> PrefixMatch | None:
        """The cached prefix a waiting request can start from (at most all but its last
        token: the forward must see one token to produce the next)."""
        if self.tree is None or not self._may_match(req):
            return None
        found = self.tree.match(req.all_ids(), req.seq_len - 1, req.cache_namespace)
        return found if found.length else None

    @staticmethod
    def _may_match(req: Request) -> bool:
        """Prompt logprobs need the logits of every prompt position: no cached prefix."""
        return req.params.prompt_logprobs is None

    def should_defer(self, req: Request, matched: int, prefilling: list[Request]) -> bool:
        """Whether ``req`` should wait for a request still being prefilled to insert a
        longer shared prefix (two requests with the same system prompt, ``n > 1``). Only a
        request of the same namespace counts: waiting on another tenant's prefill would
        tell, by the time it takes, what that tenant's prompt is."""
        if self.tree is None or not prefilling or not self._may_match(req):
            return False
        ids = req.all_ids()
        limit = req.seq_len - 1
        for other in prefilling:
            if other.cache_namespace != req.cache_namespace:
                continue
            common = common_prefix_len(ids, other.all_ids())
            if self.recurrent or self.sliding:
                point = other.seq_len - 1  # where the other one's prefill is inserted
                gain = point - matched if point <= min(common, limit) else 0
            else:
                gain = min(common, limit) - matched
            if gain > 0 and gain >= min(DEFER_MIN_GAIN, limit - matched):
                return True
        return False

    def lock(self, found: PrefixMatch | None) -> None:
        if found is not None:
            self.tree.lock(found.node)

    def unlock(self, found: PrefixMatch | None) -> None:
        if found is not None:
            self.tree.unlock(found.node)

    def adopt(self, req: Request, found: PrefixMatch | None) -> None:
        """A request just got its row (and state slot): start it from the locked match."""
        if req.prefix_hit_len is None:
            req.prefix_hit_len = found.length if found is not None else 0
            if self.tree is not None:
                self.queries += req.prompt_len
                self.hits += req.prefix_hit_len
        if found is None:
            return
        req.tree_node = found.node
        self.spaces.adopt_prefix(req, found.length, found.slots)
        if self.recurrent:
            self._copies_in.append((found.node.state_slot, req.state_slot))

    def take_copies_in(self) -> np.ndarray:
        """State copies the next forward makes before it runs (snapshot -> request)."""
        pairs, self._copies_in = self._copies_in, []
        return np.array(pairs, np.int32).reshape(-1, 2)

    # ----------------------------------------------------------------- insertion
    def plan_snapshot(self, req: Request, chunk_end: int) -> tuple[int, int] | None:
        """For a prefill row ending at ``chunk_end``: the ``(src, dst)`` state copy that
        snapshots it for the tree, or None (no recurrent layers, not an insert point, or
        no state slot to spare)."""
        if self.tree is None or not self.recurrent or chunk_end >= req.seq_len:
            return None
        if self.sliding and chunk_end != req.seq_len - 1:
            return None
        # Free request rows keep a state slot each in reserve: snapshots never block
        # admission.
        slot = self.alloc_state(reserve=self.req_pool.available_size())
        if slot is None:
            return None
        req.pending_snapshot = slot
        return (req.state_slot, slot)

    def chunk_done(self, req: Request) -> None:
        """After a prefill chunk's forward: insert the sequence so far where that is an
        insert point."""
        snapshot, req.pending_snapshot = req.pending_snapshot, None
        if self.tree is None:
            return
        if self.sliding and req.computed_len != req.seq_len - 1:
            assert snapshot is None
            return
        if self.recurrent and snapshot is None:
            return  # a match could not stop here anyway
        self._insert(req, snapshot)

    def _insert(self, req: Request, snapshot: int | None) -> None:
        n = req.computed_len
        ids = req.all_ids()[:n]
        slots = {s.name: s.table[req.row, :n].copy() for s in self.spaces.spaces}
        node, tree_slots = self.tree.insert(ids, slots, snapshot, req.cache_namespace)
        self.tree.lock(node)
        if req.tree_node is not None:
            self.tree.unlock(req.tree_node)
        req.tree_node, req.tree_len = node, n
        self.spaces.adopt_tree_slots(req, tree_slots)

    def release(self, req: Request, keep: bool) -> None:
        """Free what a leaving request owns; with ``keep`` its sequence (and recurrent
        state) goes to the tree first."""
        if req.pending_snapshot is not None:  # its forward failed: the copy never ran
            self.state_allocator.free([req.pending_snapshot])
            req.pending_snapshot = None
        pending = [p for p in self._copies_in if p[1] == req.state_slot]
        if pending:  # admitted, never ran: its state slot was never filled
            self._copies_in.remove(pending[0])
            keep = False
        if self.tree is not None and keep and req.computed_len > 0:
            snapshot = req.state_slot if self.recurrent else None
            req.state_slot = None  # the tree owns it now (or freed it as a duplicate)
            self._insert(req, snapshot)
        self.spaces.release(req)
        if req.tree_node is not None:
            self.tree.unlock(req.tree_node)
        req.tree_node, req.tree_len = None, 0

    def held_tokens(self) -> int:
        """Token slots the tree holds in its largest space."""
        if self.tree is None:
            return 0
        return max(
            (self.tree.evictable[s] + self.tree.protected[s] for s in self.tree.evictable),
            default=0,
        )

    # ----------------------------------------------------------------- audit
    def owned_slots(self) -> dict[str, list[np.ndarray]]:
        if self.tree is None:
            return {}
        return {s.name: self.tree.owned_slots(s.name) for s in self.spaces.spaces}

    def owned_states(self) -> list[int]:
        return self.tree.owned_states() if self.tree is not None else []

    def check_integrity(self, idle: bool) -> None:
        if self.tree is None:
            return
        self.tree.check_integrity()
        if idle:
            assert not any(self.tree.protected.values()), "prefix cache nodes left locked"
