"""Which node is evicted next: the policies (SGLang's names) and the queue of evictable leaves.

An evictable leaf is a node on the device, unlocked, with no child on the device. The queue keeps
them in a heap ordered by the policy's priority, with lazy invalidation: a node that is pushed again
(its priority changed, or it became evictable again) orphans its previous entry, and an entry whose
node is no longer an evictable leaf (locked, given a child) is dropped when it reaches the top. A pop
therefore costs O(log n) amortised, however large the tree, where scanning the leaves per eviction
costs O(n). The heap is rebuilt from its live entries once it has grown to twice its size after the
last rebuild, so orphaned entries cost O(1) amortised memory and time.

Priorities use the tree's logical clock (``_tick``: the last access, ``_born``: creation), which
orders operations exactly where ``time.monotonic()`` can tie.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from kvpool.cache.node import TreeNode


class EvictionStrategy(ABC):
    """Maps a node to its eviction priority: the smallest is evicted first."""

    @abstractmethod
    def get_priority(self, node: "TreeNode") -> Any: ...


class LRUStrategy(EvictionStrategy):
    """Least recently used first."""

    def get_priority(self, node: "TreeNode") -> Any:
        return node._tick


class LFUStrategy(EvictionStrategy):
    """Fewest hits first, then least recently used."""

    def get_priority(self, node: "TreeNode") -> Any:
        return (node.hit_count, node._tick)


class FIFOStrategy(EvictionStrategy):
    """Oldest first."""

    def get_priority(self, node: "TreeNode") -> Any:
        return node._born


class MRUStrategy(EvictionStrategy):
    """Most recently used first."""

    def get_priority(self, node: "TreeNode") -> Any:
        return -node._tick


class FILOStrategy(EvictionStrategy):
    """Newest first."""

    def get_priority(self, node: "TreeNode") -> Any:
        return -node._born


class PriorityStrategy(EvictionStrategy):
    """Lowest inserted priority first, then least recently used."""

    def get_priority(self, node: "TreeNode") -> Any:
        return (node.priority, node._tick)


STRATEGIES: dict[str, type[EvictionStrategy]] = {
    "lru": LRUStrategy,
    "lfu": LFUStrategy,
    "fifo": FIFOStrategy,
    "mru": MRUStrategy,
    "filo": FILOStrategy,
    "priority": PriorityStrategy,
}


def make_strategy(policy: object) -> EvictionStrategy:
    """The strategy named ``policy`` (case-insensitive).

    Raises
    ------
    ValueError
        If ``policy`` names none of ``STRATEGIES``.
    """
    cls = STRATEGIES.get(policy.lower()) if isinstance(policy, str) else None
    if cls is None:
        raise ValueError(f"eviction_policy must be one of {', '.join(map(repr, STRATEGIES))}, got {policy!r}")
    return cls()


class EvictionQueue:
    """Evictable leaves by priority (a heap with lazy invalidation).

    Parameters
    ----------
    strategy : the policy.
    is_evictable : ``f(node) -> bool``, whether a node is an evictable leaf now.
    """

    _MIN_REBUILD = 1024

    def __init__(self, strategy: EvictionStrategy, is_evictable: Callable[["TreeNode"], bool]) -> None:
        self.strategy = strategy
        self._priority = strategy.get_priority
        self._is_evictable = is_evictable
        self._heap: list[list] = []
        self._seq = 0
        self._rebuild_at = self._MIN_REBUILD

    def __len__(self) -> int:
        """Entries held, orphaned ones included (for tests of the bound)."""
        return len(self._heap)

    def push(self, node: "TreeNode") -> None:
        """``node`` is an evictable leaf now, at its current priority (replaces its earlier entry)."""
        old = node._entry
        if old is not None:
            old[2] = None
        self._seq += 1
        entry = [self._priority(node), self._seq, node]
        node._entry = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > self._rebuild_at:
            self._rebuild()

    def pop(self) -> Optional["TreeNode"]:
        """The evictable leaf of smallest priority, removed from the queue; None if there is none."""
        heap = self._heap
        while heap:
            node = heapq.heappop(heap)[2]
            if node is None:
                continue
            node._entry = None
            if self._is_evictable(node):
                return node
        return None

    def holds(self, node: "TreeNode") -> bool:
        """``node`` has a live entry at its current priority (``check_integrity``)."""
        entry = node._entry
        return entry is not None and entry[2] is node and entry[0] == self._priority(node)

    def clear(self) -> None:
        for entry in self._heap:
            if entry[2] is not None:
                entry[2]._entry = None
        self._heap = []
        self._rebuild_at = self._MIN_REBUILD

    def _rebuild(self) -> None:
        live = []
        for entry in self._heap:
            node = entry[2]
            if node is None:
                continue
            if self._is_evictable(node):
                live.append(entry)
            else:
                node._entry = None
        heapq.heapify(live)
        self._heap = live
        self._rebuild_at = max(self._MIN_REBUILD, 2 * len(live))
