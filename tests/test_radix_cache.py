"""The radix tree on its own (numpy only): matching, splitting, locking, eviction order,
duplicate slots, and the rules for where hybrid and sliding-window matches may stop."""

from __future__ import annotations

import numpy as np
import pytest

from mlxserve.kvpool import StateSlotAllocator, TokenToKVPoolAllocator
from mlxserve.scheduler.radix_cache import RadixCache


def make_tree(size=64, states=0, window=None):
    allocators = {"full": TokenToKVPoolAllocator(size)}
    if window is not None:
        allocators["sliding"] = TokenToKVPoolAllocator(size)
    state = StateSlotAllocator(states) if states else None
    return RadixCache(allocators, state, window), allocators, state


def insert(tree, allocators, ids, state=None, sliding_from=0):
    """Insert ``ids`` with freshly allocated slots (sliding ones only from
    ``sliding_from``, as a request that already freed the rest would)."""
    slots = {name: a.alloc(len(ids)) for name, a in allocators.items()}
    if "sliding" in slots:
        allocators["sliding"].free(slots["sliding"][:sliding_from])
        slots["sliding"][:sliding_from] = 0
    return tree.insert(np.array(ids), slots, state), slots


def audit(tree, allocators, states=None):
    for name, a in allocators.items():
        a.check_integrity(tree.owned_slots(name))
    if states is not None:
        states.check_integrity([tree.owned_states()])
    tree.check_integrity()


class TestMatchAndInsert:
    def test_match_returns_the_inserted_slots_and_splits_mid_edge(self):
        tree, allocators, _ = make_tree()
        (_, tree_slots), slots = insert(tree, allocators, [1, 2, 3, 4, 5])
        assert np.array_equal(tree_slots["full"], slots["full"])
        found = tree.match(np.array([1, 2, 3, 9]), max_len=4)
        assert found.length == 3
        assert np.array_equal(found.slots["full"], slots["full"][:3])
        # The edge was split so the match ends at a node that can be locked.
        assert len(found.node.key) == 3 and len(found.node.children) == 1
        audit(tree, allocators)

    def test_max_len_caps_the_match(self):
        tree, allocators, _ = make_tree()
        insert(tree, allocators, [1, 2, 3, 4])
        assert tree.match(np.array([1, 2, 3, 4]), max_len=3).length == 3

    def test_duplicate_slots_of_a_second_insert_are_freed(self):
        tree, allocators, _ = make_tree()
        (_, first), _ = insert(tree, allocators, [1, 2, 3])
        (_, second), mine = insert(tree, allocators, [1, 2, 3, 4, 5])
        # The shared positions keep the tree's slots; the caller's copies went back.
        assert np.array_equal(second["full"][:3], first["full"])
        assert np.array_equal(second["full"][3:], mine["full"][3:])
        assert allocators["full"].available_size() == 64 - 5
        audit(tree, allocators)


class TestLocksAndEviction:
    def test_locked_paths_survive_and_lru_leaves_go_first(self):
        tree, allocators, _ = make_tree()
        (old, _), _ = insert(tree, allocators, [1, 2, 3])
        (new, _), _ = insert(tree, allocators, [7, 8, 9])
        (kept, _), _ = insert(tree, allocators, [4, 5, 6])
        tree.lock(kept)
        tree.match(np.array([7, 8, 9]), max_len=3)  # touch: now more recent than [1, 2, 3]
        assert tree.evictable["full"] == 6 and tree.protected["full"] == 3
        evicted = tree.evict(lambda: allocators["full"].available_size() >= 64 - 6)
        assert evicted == 1
        assert tree.match(np.array([1, 2, 3]), 3).length == 0, "least recently used goes first"
        assert tree.match(np.array([7, 8, 9]), 3).length == 3
        tree.evict(lambda: False)  # everything evictable
        assert tree.match(np.array([4, 5, 6]), 3).length == 3, "locked nodes stay"
        tree.unlock(kept)
        assert tree.protected["full"] == 0
        audit(tree, allocators)
        del old, new

    def test_evicting_a_leaf_exposes_its_parent(self):
        tree, allocators, _ = make_tree()
        insert(tree, allocators, [1, 2, 3])
        insert(tree, allocators, [1, 2, 3, 4, 5])
        tree.evict(lambda: False)
        assert allocators["full"].available_size() == 64
        audit(tree, allocators)


class TestHybridAndSliding:
    def test_recurrent_matches_stop_only_at_snapshots(self):
        tree, allocators, states = make_tree(states=4)
        snap = int(states.alloc(1)[0])
        insert(tree, allocators, [1, 2, 3, 4], state=snap)
        insert(tree, allocators, [1, 2, 3, 4, 5, 6])  # no snapshot at 6
        assert tree.match(np.array([1, 2, 3, 4, 5, 6, 7]), 7).length == 4
        assert tree.match(np.array([1, 2, 3, 9]), 4).length == 0, "no snapshot mid-edge"
        audit(tree, allocators, states)

    def test_a_second_snapshot_at_the_same_point_is_freed(self):
        tree, allocators, states = make_tree(states=4)
        insert(tree, allocators, [1, 2], state=int(states.alloc(1)[0]))
        insert(tree, allocators, [1, 2], state=int(states.alloc(1)[0]))
        assert states.available_size() == 3
        audit(tree, allocators, states)

    @pytest.mark.parametrize("length,usable", [(10, True), (9, False), (3, False)])
    def test_sliding_match_needs_the_window_behind_it(self, length, usable):
        # Inserted by a request that held only positions 6..9 (window 5 at position 10).
        tree, allocators, _ = make_tree(window=5)
        insert(tree, allocators, list(range(1, 11)), sliding_from=6)
        found = tree.match(np.arange(1, 12), max_len=length)
        assert found.length == (length if usable else 0)
        audit(tree, allocators)

    def test_sliding_slots_the_tree_lacks_are_adopted(self):
        tree, allocators, _ = make_tree(window=3)
        insert(tree, allocators, [1, 2, 3, 4, 5, 6], sliding_from=4)
        (_, slots), mine = insert(tree, allocators, [1, 2, 3, 4, 5, 6, 7], sliding_from=2)
        assert np.array_equal(slots["sliding"][2:4], mine["sliding"][2:4]), "adopted"
        assert tree.match(np.arange(1, 9), max_len=4).length == 4
        audit(tree, allocators)


class TestNamespaces:
    def test_a_sequence_matches_only_its_own_namespace(self):
        tree, allocators, _ = make_tree()
        slots = {"full": allocators["full"].alloc(4)}
        node, _ = tree.insert(np.array([1, 2, 3, 4]), slots, None, namespace="tenant-a")
        assert tree.match(np.array([1, 2, 3, 4, 5]), 5, "tenant-a").length == 4
        assert tree.match(np.array([1, 2, 3, 4, 5]), 5, "tenant-b").length == 0
        assert tree.match(np.array([1, 2, 3, 4, 5]), 5).length == 0, "nor the shared one"
        # The same tokens in another namespace get slots (and a node) of their own.
        other = {"full": allocators["full"].alloc(4)}
        _, kept = tree.insert(np.array([1, 2, 3, 4]), other, None, namespace="tenant-b")
        assert np.array_equal(kept["full"], other["full"]), "no slot shared across tenants"
        audit(tree, allocators)

    def test_an_emptied_namespace_goes_away(self):
        tree, allocators, _ = make_tree(size=8)
        for salt in ("s1", "s2", "s3"):
            slots = {"full": allocators["full"].alloc(2)}
            tree.insert(np.array([7, 8]), slots, None, namespace=salt)
        assert set(tree.roots) == {"", "s1", "s2", "s3"}
        tree.evict(lambda: allocators["full"].available_size() == 8)
        assert set(tree.roots) == {""}, "invented namespaces cost nothing once evicted"
        audit(tree, allocators)
