"""``SWAWindows``: the books of an ``SWARadixCache``'s sliding-window tier: which nodes hold SWA KV
(an ``SWAWindow`` record; a node without one is a tombstone), the window locks, the SWA sizes and
the SWA eviction queue (any node with unlocked SWA KV, leaf or not).

A lock's window: from the locked node towards the root, whole nodes until ``window`` tokens are
covered; the node it ends on carries an id (``uuid``) that the unlock stops at. The cache owns the
tree and decides what to evict; these books change only the SWA records and their counts.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterable, Optional

from kvpool.cache.evict_policy import EvictionQueue, EvictionStrategy
from kvpool.cache.node import TreeNode
from kvpool.cache.records import SWA, SWAWindow
from kvpool.cache.tree import Undo


class SWAWindows:
    """The SWA tier of a tree whose nodes are all on the device.

    Parameters
    ----------
    strategy : the eviction policy (the cache's).

    Attributes
    ----------
    evictable_size, protected_size : SWA tokens of live nodes outside and inside a window lock.
    queue : the SWA eviction queue.
    """

    def __init__(self, strategy: EvictionStrategy) -> None:
        self.queue = EvictionQueue(strategy, SWA)
        self.evictable_size = 0
        self.protected_size = 0
        self._uuids = itertools.count(1)

    def evictable(self, node: TreeNode) -> bool:
        """``node`` has SWA KV that no window lock holds (and is not the root)."""
        window = node.records.get(SWA)
        return window is not None and window.lock_ref == 0 and node.parent is not None and node.device is not None

    def push(self, nodes: Iterable[TreeNode]) -> None:
        """The evictable ones of ``nodes`` take their current priorities, in the order given (on a
        tie the first given is evicted first)."""
        for node in nodes:
            if self.evictable(node):
                self.queue.push(node)

    def add(self, node: TreeNode) -> None:
        """``node``'s slots have SWA KV now (the tree's)."""
        node.records[SWA] = SWAWindow()
        self.evictable_size += len(node.device.value)

    def drop(self, node: TreeNode, undo: Undo) -> None:
        """Take an unlocked node's SWA KV (its SWA slots are the caller's to free now); ``undo`` puts
        it back."""
        window = node.records.pop(SWA)
        size = len(node.device.value)
        self.evictable_size -= size

        def back() -> None:
            node.records[SWA] = window
            self.evictable_size += size
            self.push((node,))

        undo.add(back)

    def window_of(self, path: list[TreeNode], node: TreeNode, window: int, what: str) -> tuple[list[TreeNode], bool]:
        """The nodes of ``path`` (``node`` first, towards the root) a lock's window of ``window``
        tokens holds (key elements for EAGLE keys: one KV slot each), and whether they cover it.

        Raises
        ------
        ValueError
            If a tombstone lies within the window. Nothing changes.
        """
        held, nodes = 0, []
        for n in path:
            if held >= window:
                break
            if SWA not in n.records:
                raise ValueError(
                    f"{what}: node must have SWA KV for its last sliding_window_size = {window} tokens, got node "
                    f"{node.id}, whose window reaches tombstone node {n.id} (its SWA KV was freed)"
                )
            nodes.append(n)
            held += len(n.device.value)
        return nodes, held >= window

    def lock(self, nodes: list[TreeNode], whole: bool) -> Optional[int]:
        """Lock the SWA KV of ``nodes`` (from ``window_of``); returns the id of the last one when the
        window is ``whole`` (None otherwise)."""
        for n in nodes:
            record = n.records[SWA]
            if record.lock_ref == 0:
                size = len(n.device.value)
                self.evictable_size -= size
                self.protected_size += size
            record.lock_ref += 1
        if not whole:
            return None
        end = nodes[-1].records[SWA]
        if end.uuid is None:
            end.uuid = next(self._uuids)
        return end.uuid

    def unlock_span(self, path: list[TreeNode], node: Any, uuid: Optional[int], what: str) -> list[TreeNode]:
        """The nodes of ``path`` an unlock with ``uuid`` releases (up to the node of that id; all for
        None), checked to be locked there; changes nothing.

        Raises
        ------
        ValueError
            For an id no node of the path has, or a node of the window that is not locked in it.
        """
        if uuid is None:
            nodes = path
        else:
            ends = [i for i, n in enumerate(path) if n.swa_uuid == uuid]
            if not ends:
                raise ValueError(
                    f"{what}: swa_uuid_for_lock must be the id inc_lock_ref(node) returned for node {node.id} (or None), "
                    f"got {uuid!r}, which no node on its path has"
                )
            nodes = path[: ends[0] + 1]
        for n in nodes:
            if n.swa_lock_ref < 1:
                raise ValueError(
                    f"{what}: node {n.id} must be locked in its window (swa_lock_ref >= 1) to unlock it, got swa_lock_ref = "
                    f"{n.swa_lock_ref}{' (a tombstone)' if SWA not in n.records else ''}"
                )
        return nodes

    def unlock(self, nodes: list[TreeNode]) -> None:
        """Release one window lock of ``nodes`` (from ``unlock_span``, the locked node first); the
        nodes it leaves unlocked are queued nearer the root first, so that on a tie the upper one is
        evicted first."""
        freed = []
        for n in nodes:
            record = n.records[SWA]
            record.lock_ref -= 1
            if record.lock_ref == 0:
                size = len(n.device.value)
                self.evictable_size += size
                self.protected_size -= size
                freed.append(n)
        for n in reversed(freed):
            self.queue.push(n)

    def problems(self, nodes: Iterable[TreeNode]) -> list[str]:
        """What is wrong with the SWA records of ``nodes`` (the tree's, root excluded): a tombstone
        leaf, a window lock outside 0..lock_ref, an evictable window not queued, the sizes."""
        problems = []
        evictable = protected = 0
        for node in nodes:
            if node.device is None:
                continue
            window = node.records.get(SWA)
            if window is None:
                if not node.children:
                    problems.append(f"node {node.id} is a tombstone leaf (no SWA KV and no children)")
                continue
            size = len(node.device.value)
            if not 0 <= window.lock_ref <= node.device.lock_ref:
                problems.append(f"node {node.id} has swa_lock_ref {window.lock_ref} outside 0..lock_ref = {node.device.lock_ref}")
            if window.lock_ref:
                protected += size
            else:
                evictable += size
                if not self.queue.holds(node):
                    problems.append(f"node {node.id}'s SWA KV is evictable but missing from the SWA eviction queue")
        if (evictable, protected) != (self.evictable_size, self.protected_size):
            problems.append(
                f"SWA evictable/protected sizes are recorded as {self.evictable_size}/{self.protected_size} but the nodes "
                f"hold {evictable}/{protected}"
            )
        return problems
