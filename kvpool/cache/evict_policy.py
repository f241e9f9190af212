"""Which node is evicted next: the policies (SGLang's names) and the queue of evictable leaves.

An evictable leaf is a node on the device, unlocked, with no child on the device. The queue keeps
them ordered by the policy's priority, with lazy invalidation: a node that is pushed again (its
priority changed, or it became evictable again) orphans its previous entry (the node's record
keeps its live entry's sequence number), and an entry whose node is no longer an evictable leaf
(locked, given a child) is skipped by the queue's owner when it reaches the front. Entries that arrive in order (under LRU every new or
touched leaf: it is the most recent) go to the back of a deque, O(1); the others (a leaf unlocked or
uncovered with an older access time) into a heap, O(log n); a pop takes the smaller front. No call
scans the leaves. Both are rebuilt from their live entries once they hold twice the entries they
held after the last rebuild, so orphaned entries cost O(1) amortised memory and time.

Priorities use the tree's logical clock (``access_tick``: the last access, ``creation_tick``:
creation), which orders operations exactly where ``time.monotonic()`` can tie. A queue keeps its live
entry for a node in that node's record of the queue's tier (``queue_entry``); a node that leaves the
tier loses the record, and with it the entry.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import deque
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from kvpool.cache.node import TreeNode


class EvictionStrategy(ABC):
    """Maps a node to its eviction priority: the smallest is evicted first."""

    @abstractmethod
    def get_priority(self, node: "TreeNode") -> Any:
        """``node``'s priority: any comparable value, the smallest evicted first."""


class LRUStrategy(EvictionStrategy):
    """Least recently used first."""

    def get_priority(self, node: "TreeNode") -> Any:
        """The node's last access on the tree's clock."""
        return node.access_tick


class LFUStrategy(EvictionStrategy):
    """Fewest hits first, then least recently used."""

    def get_priority(self, node: "TreeNode") -> Any:
        """(hits, last access)."""
        return (node.hit_count, node.access_tick)


class FIFOStrategy(EvictionStrategy):
    """Oldest first."""

    def get_priority(self, node: "TreeNode") -> Any:
        """The node's creation on the tree's clock."""
        return node.creation_tick


class MRUStrategy(EvictionStrategy):
    """Most recently used first."""

    def get_priority(self, node: "TreeNode") -> Any:
        """The last access, negated: the most recent is the smallest."""
        return -node.access_tick


class FILOStrategy(EvictionStrategy):
    """Newest first."""

    def get_priority(self, node: "TreeNode") -> Any:
        """The creation, negated: the newest is the smallest."""
        return -node.creation_tick


class PriorityStrategy(EvictionStrategy):
    """Lowest inserted priority first, then least recently used."""

    def get_priority(self, node: "TreeNode") -> Any:
        """(the highest priority inserted through the node, last access)."""
        return (node.priority, node.access_tick)


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
    tier : the name of the tier record this queue keeps its live entry in (``node.records[tier]``,
        ``kvpool.cache.records``), or None for the device tier's ``node.device``.

    The queue never calls back into its owner: ``pop`` returns the node of the smallest live entry,
    and the owner, which knows what evictable means for its tier, skips it when it is not.
    """

    _MIN_REBUILD = 1024

    def __init__(self, strategy: EvictionStrategy, tier: Optional[str] = None) -> None:
        self._tier = tier
        self.strategy = strategy
        self._priority = strategy.get_priority
        self._heap: list[tuple] = []
        self._in_order: deque[tuple] = deque()
        self._seq = 0
        self._rebuild_at = self._MIN_REBUILD

    def __len__(self) -> int:
        """Entries held, orphaned ones included (for tests of the bound)."""
        return len(self._heap) + len(self._in_order)

    def _record(self, node: "TreeNode") -> Any:
        return node.device if self._tier is None else node.records.get(self._tier)

    def push(self, node: "TreeNode") -> None:
        """``node`` is an evictable leaf now, at its current priority (orphans its earlier entry)."""
        self._seq += 1
        priority = self._priority(node)
        self._record(node).queue_entry = (priority, self._seq)
        item = (priority, self._seq, node)
        in_order = self._in_order
        if not in_order or in_order[-1][0] <= priority:
            in_order.append(item)  # in order already (LRU's new and touched leaves): O(1) both ways
        else:
            heapq.heappush(self._heap, item)
        if len(self._heap) + len(in_order) > self._rebuild_at:
            self._rebuild()

    def pop(self) -> Optional["TreeNode"]:
        """The node of the smallest live entry, its entry removed; None when none is left. It was an
        evictable leaf when pushed: the caller checks that it still is (and pops again if not)."""
        heap, in_order = self._heap, self._in_order
        while heap or in_order:
            if in_order and (not heap or in_order[0] < heap[0]):
                item = in_order.popleft()
            else:
                item = heapq.heappop(heap)
            node = item[2]
            if self._live(item):
                self._record(node).queue_entry = None
                return node
        return None

    def holds(self, node: "TreeNode") -> bool:
        """``node`` has a live entry at its current priority (``check_integrity``)."""
        record = self._record(node)
        entry = None if record is None else record.queue_entry
        return entry is not None and entry[0] == self._priority(node)

    def clear(self) -> None:
        """Drop every entry (and each node's record of it): an empty queue."""
        for _, _, node in (*self._heap, *self._in_order):
            record = self._record(node)
            if record is not None:
                record.queue_entry = None
        self._heap = []
        self._in_order = deque()
        self._rebuild_at = self._MIN_REBUILD

    def _live(self, item: tuple) -> bool:
        """The item is its node's entry (not orphaned by a later push, and the node still in the tier)."""
        record = self._record(item[2])
        return record is not None and record.queue_entry is not None and record.queue_entry[1] == item[1]

    def _rebuild(self) -> None:
        self._heap = [item for item in self._heap if self._live(item)]
        heapq.heapify(self._heap)
        self._in_order = deque(item for item in self._in_order if self._live(item))  # stays in order
        self._rebuild_at = max(self._MIN_REBUILD, 2 * (len(self._heap) + len(self._in_order)))
