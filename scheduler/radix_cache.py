"""Prefix cache: a radix tree over token ids whose nodes own token slots and state snapshots.

Each edge holds a run of token ids and, per slot space, the slot id of every position in
it (the K/V the model wrote for that token with that prefix). A node may also hold a
recurrent-state snapshot: the state of every recurrent layer after the node's last token.

Invariants the tree keeps:
- A slot id in the tree is owned by the tree: only eviction frees it. Running requests
  point at tree slots through their rows and hold a lock on the deepest node they use;
  a lock counts on every node up to the root, so a locked node is never evicted.
- Full-space slots are held for every position of every node. Sliding-space slots are held
  only where an inserting request still had them (0 elsewhere): the window behind the
  insert point.
- A match may stop at position ``m`` only if a request can continue from there exactly:
  the recurrent state at ``m`` is a snapshot (models with recurrent layers), and the
  sliding-window K/V of positions ``m - window + 1 .. m - 1`` is held (sliding models).
- Only unlocked leaves are evicted, least recently used first; a parent that becomes an
  unlocked leaf is next in line.
- Sequences live in namespaces (a tenant, a ``cache_salt``): each namespace has a root of
  its own, and a sequence only ever matches what was inserted in its namespace. A root
  other than the default one goes away with its last child, so namespaces clients invent
  cost nothing once their nodes are evicted.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from mlxserve.kvpool import SlotAllocator, StateSlotAllocator


@dataclass(eq=False)
class TreeNode:
    key: np.ndarray  # int32 token ids of the edge into this node
    slots: dict[str, np.ndarray]  # per space, int32 slot id of each key position (0: none)
    parent: TreeNode | None = None
    children: dict[int, TreeNode] = field(default_factory=dict)
    state_slot: int | None = None
    lock_ref: int = 0
    last_access: int = 0

    def held(self, space: str) -> int:
        return int(np.count_nonzero(self.slots[space]))


@dataclass(frozen=True)
class PrefixMatch:
    """The usable cached prefix of a sequence: its length, the node ending there (to lock),
    and the slots of positions ``0..length-1`` in each space (0 where not held)."""

    length: int
    node: TreeNode
    slots: dict[str, np.ndarray]


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class RadixCache:
    """The tree and its slot accounting.

    Args:
        allocators: the token slot allocator of each space ("full", "sliding").
        state_allocator: the state slot allocator (models with recurrent layers), else None.
        window: the sliding window (models with a sliding space), else None.
    """

    def __init__(
        self,
        allocators: dict[str, SlotAllocator],
        state_allocator: StateSlotAllocator | None,
        window: int | None,
    ) -> None:
        self.allocators = allocators
        self.state_allocator = state_allocator
        self.window = window
        # Namespace -> its root ("" is the default namespace, always present).
        self.roots: dict[str, TreeNode] = {"": self._new_root()}
        self._clock = itertools.count(1)
        # Slots held by unlocked (evictable) and locked (protected) nodes, per space.
        self.evictable = dict.fromkeys(allocators, 0)
        self.protected = dict.fromkeys(allocators, 0)
        self.num_evicted_tokens = 0

    def _new_root(self) -> TreeNode:
        empty = {s: np.zeros(0, np.int32) for s in self.allocators}
        return TreeNode(np.zeros(0, np.int32), empty, lock_ref=1)

    @property
    def root(self) -> TreeNode:
        """The default namespace's root."""
        return self.roots[""]

    # ----------------------------------------------------------------- lookup
    def match(self, ids: np.ndarray, max_len: int, namespace: str = "") -> PrefixMatch:
        """The longest usable cached prefix of ``ids[:max_len]`` in ``namespace``.

        A match ending inside an edge splits it so that the match ends at a node.
        """
        ids = np.asarray(ids, np.int32)[:max_len]
        path: list[TreeNode] = []
        root = self.roots.get(namespace)
        if root is None:  # nothing was ever inserted there
            return PrefixMatch(0, self.root, self._path_slots([]))
        node, pos, partial = root, 0, 0
        while pos < len(ids):
            child = node.children.get(int(ids[pos]))
            if child is None:
                break
            common = common_prefix_len(child.key, ids[pos:])
            if common < len(child.key):
                path.append(child)
                partial = common
                break
            path.append(child)
            pos += len(child.key)
            node = child
        # Candidate stops, deepest first: inside the last edge, then at each node end.
        now = next(self._clock)
        for n in path:
            n.last_access = now
        ends = list(itertools.accumulate(len(n.key) for n in path))
        if partial:
            ends[-1] = ends[-1] - len(path[-1].key) + partial
        for depth in range(len(path), -1, -1):
            length = ends[depth - 1] if depth else 0
            nodes = path[:depth]
            cut = partial if (partial and depth == len(path)) else None
            if not self._usable(nodes, cut, length):
                continue
            if cut is not None:
                nodes[-1] = self._split(nodes[-1], cut)
            end = nodes[-1] if nodes else root
            return PrefixMatch(length, end, self._path_slots(nodes))
        raise AssertionError("length 0 is always usable")

    def _usable(self, nodes: list[TreeNode], cut: int | None, length: int) -> bool:
        if length == 0:
            return True
        if self.state_allocator is not None:
            # A snapshot is the state after a node's last token: never mid-edge.
            if cut is not None or nodes[-1].state_slot is None:
                return False
        if self.window is not None:
            sliding = self._path_slots(nodes)["sliding"][:length]
            if not sliding[max(length - self.window + 1, 0) :].all():
                return False
        return True

    def _path_slots(self, nodes: list[TreeNode]) -> dict[str, np.ndarray]:
        return {
            s: np.concatenate([n.slots[s] for n in nodes]) if nodes else np.zeros(0, np.int32)
            for s in self.allocators
        }

    # ----------------------------------------------------------------- insertion
    def insert(
        self,
        ids: np.ndarray,
        slots: dict[str, np.ndarray],
        state_slot: int | None,
        namespace: str = "",
    ) -> tuple[TreeNode, dict[str, np.ndarray]]:
        """Give the tree a sequence's slots (and the state snapshot at its end), in
        ``namespace``.

        Positions the tree already holds keep the tree's slot and the caller's duplicate is
        freed; sliding positions the tree lacks adopt the caller's slot. The snapshot is
        adopted, or freed when the end node already has one.

        Returns:
            the node ending at ``len(ids)`` and the tree's slots for every position, which
            replace the caller's in its row.
        """
        ids = np.asarray(ids, np.int32)
        if namespace not in self.roots:
            self.roots[namespace] = self._new_root()
        node, pos = self.roots[namespace], 0
        now = next(self._clock)
        nodes: list[TreeNode] = []
        while pos < len(ids):
            child = node.children.get(int(ids[pos]))
            if child is None:
                leaf = TreeNode(
                    ids[pos:].copy(),
                    {s: slots[s][pos:].copy() for s in self.allocators},
                    parent=node,
                )
                node.children[int(ids[pos])] = leaf
                self._account(leaf, +1)
                node, pos = leaf, len(ids)
                node.last_access = now
                nodes.append(node)
                break
            common = common_prefix_len(child.key, ids[pos:])
            if common < len(child.key):
                child = self._split(child, common)
            self._merge(child, slots, pos)
            child.last_access = now
            nodes.append(child)
            node, pos = child, pos + len(child.key)
        if state_slot is not None:
            if node.parent is None or node.state_slot is not None:
                self.state_allocator.free([state_slot])
            else:
                node.state_slot = state_slot
        return node, self._path_slots(nodes)

    def _merge(self, node: TreeNode, slots: dict[str, np.ndarray], pos: int) -> None:
        """Reconcile the caller's slots for ``node``'s positions with the tree's."""
        for space, tree in node.slots.items():
            mine = slots[space][pos : pos + len(tree)]
            duplicate = (mine != 0) & (tree != 0) & (mine != tree)
            if duplicate.any():
                self.allocators[space].free(mine[duplicate])
            adopt = (mine != 0) & (tree == 0)
            if adopt.any():
                tree[adopt] = mine[adopt]
                self._count(node, space, int(adopt.sum()))

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Cut ``node``'s edge after ``at`` tokens; returns the new upper node."""
        upper = TreeNode(
            node.key[:at].copy(),
            {s: a[:at].copy() for s, a in node.slots.items()},
            parent=node.parent,
            lock_ref=node.lock_ref,
            last_access=node.last_access,
        )
        upper.children[int(node.key[at])] = node
        node.parent.children[int(node.key[0])] = upper
        node.parent = upper
        node.key = node.key[at:].copy()
        node.slots = {s: a[at:].copy() for s, a in node.slots.items()}
        return upper

    # ----------------------------------------------------------------- locks
    def lock(self, node: TreeNode) -> None:
        while node.parent is not None:
            if node.lock_ref == 0:
                self._move(node, to_protected=True)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node.parent is not None:
            assert node.lock_ref > 0, "unlock without lock"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._move(node, to_protected=False)
            node = node.parent

    # ----------------------------------------------------------------- eviction
    def evict(self, enough: Callable[[], bool]) -> int:
        """Evict unlocked leaves, least recently used first, until ``enough()``.

        Returns:
            the number of nodes evicted.
        """
        leaves = [(n.last_access, id(n), n) for n in self._nodes() if self._evictable_leaf(n)]
        heapq.heapify(leaves)
        evicted = 0
        while leaves and not enough():
            _, _, node = heapq.heappop(leaves)
            parent = node.parent
            self._account(node, -1)
            for space, slots in node.slots.items():
                held = slots[slots != 0]
                self.allocators[space].free(held)
                self.num_evicted_tokens += len(held) if space == "full" else 0
            if node.state_slot is not None:
                self.state_allocator.free([node.state_slot])
            del parent.children[int(node.key[0])]
            evicted += 1
            if self._evictable_leaf(parent):
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
        self._drop_empty_roots()
        return evicted

    def _drop_empty_roots(self) -> None:
        for namespace, root in list(self.roots.items()):
            if namespace and not root.children:
                del self.roots[namespace]

    def _evictable_leaf(self, node: TreeNode) -> bool:
        return node.parent is not None and not node.children and node.lock_ref == 0

    # ----------------------------------------------------------------- accounting
    def _count(self, node: TreeNode, space: str, n: int) -> None:
        bucket = self.protected if node.lock_ref else self.evictable
        bucket[space] += n

    def _account(self, node: TreeNode, sign: int) -> None:
        for space in node.slots:
            self._count(node, space, sign * node.held(space))

    def _move(self, node: TreeNode, to_protected: bool) -> None:
        src, dst = (
            (self.evictable, self.protected) if to_protected else (self.protected, self.evictable)
        )
        for space in node.slots:
            n = node.held(space)
            src[space] -= n
            dst[space] += n

    def _nodes(self):
        stack = [child for root in self.roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def node_count(self) -> int:
        return sum(1 for _ in self._nodes())

    def owned_slots(self, space: str) -> list[np.ndarray]:
        """Every slot of ``space`` the tree holds (for the integrity check)."""
        return [n.slots[space][n.slots[space] != 0] for n in self._nodes()]

    def owned_states(self) -> list[int]:
        return [n.state_slot for n in self._nodes() if n.state_slot is not None]

    def check_integrity(self) -> None:
        """Assert the counters agree with the nodes and no node is left locked (idle)."""
        for space in self.allocators:
            held = sum(n.held(space) for n in self._nodes())
            locked = sum(n.held(space) for n in self._nodes() if n.lock_ref)
            assert self.evictable[space] + self.protected[space] == held, (
                f"prefix cache {space} counters {self.evictable[space]}+"
                f"{self.protected[space]} != {held} held"
            )
            assert self.protected[space] == locked, "protected counter disagrees with locks"
