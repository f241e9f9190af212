"""``RadixTree``: the radix tree's structure, its walks and its own consistency check, under the
caches' API.

Nodes hold whole pages of key elements as bytes (``kvpool.cache.key``); a walk compares a node with
one ``bytes.startswith`` and searches inside a node only where a match or an insertion leaves it.
Every node of the tree is on the device (has a ``DeviceSlots`` record) unless a tier below keeps it
(the host tier's room, ``HiRadixCache``, says so through ``_refill`` and ``_off_device_problems``).
Evictable leaves wait in an ``EvictionQueue``; every change that makes a node an evictable leaf, or
changes the priority of one, pushes it.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch

from kvpool.cache.events import MEDIUM_GPU, removed_event, stored_events
from kvpool.cache.evict_policy import EvictionQueue, EvictionStrategy
from kvpool.cache.key import BIGRAM_BYTES, TOKEN_BYTES, RadixKey, child_key_fn, common_prefix, encoded
from kvpool.cache.node import TreeNode
from kvpool.cache.records import DeviceSlots
from kvpool.errors import IntegrityError


class Undo:
    """The steps a call has taken, to take back (newest first) when a later step of it raises: an
    eviction detaches nodes before the allocator's ``free``, and puts them back if that raises."""

    def __init__(self) -> None:
        self.steps: list[Callable[[], None]] = []

    def add(self, step: Callable[[], None]) -> None:
        """Record how to take back the step just taken."""
        self.steps.append(step)

    def run(self) -> None:
        """Take every recorded step back, the last one first."""
        for step in reversed(self.steps):
            step()
        self.steps = []


class RadixTree:
    """The tree of a prefix cache: nodes, sizes, the eviction queue and the logical clock.

    Parameters
    ----------
    page_size : elements per page; every node holds a whole number of pages.
    is_eagle : elements are EAGLE bigrams (16 bytes each) rather than tokens.
    strategy : the eviction policy.
    device : where the root's (empty) value lives.
    """

    enable_kv_cache_events = False
    kv_event_queue: list

    def __init__(self, page_size: int, is_eagle: bool, strategy: EvictionStrategy, device: torch.device) -> None:
        self.page_size = page_size
        self.is_eagle = is_eagle
        self.device = device
        self.elem_bytes = BIGRAM_BYTES if is_eagle else TOKEN_BYTES
        self.page_bytes = page_size * self.elem_bytes
        self._child_key = child_key_fn(page_size, is_eagle)
        self._queue = EvictionQueue(strategy)
        self._clock = 0

    def _reset_tree(self) -> None:
        self._queue.clear()
        root = TreeNode(priority=-(2**62))
        root.key = RadixKey([], None)
        root.device = DeviceSlots(torch.empty(0, dtype=torch.int64, device=self.device), lock_ref=1)
        root.hash_value = []
        self.root_node = root
        self.evictable_size_ = 0
        self.protected_size_ = 0

    def _is_evictable(self, node: TreeNode) -> bool:
        """On the device, unlocked, a leaf, not the root."""
        device = node.device
        return device is not None and device.lock_ref == 0 and not node.children and node.parent is not None

    def _stamp(self) -> tuple[int, float]:
        self._clock += 1
        return self._clock, time.monotonic()

    def _match(self, enc: bytes, n: int, extra: Any) -> tuple[list[TreeNode], TreeNode]:
        """The nodes along the longest page-aligned prefix of ``enc[:n]``, and its last node (the
        root for none); each counts a hit and becomes the most recently used."""
        tick, now = self._stamp()
        child_key = self._child_key
        node = self.root_node
        path = []
        pos = 0
        while pos < n:
            child = node.children.get(child_key(enc, pos, extra))
            if child is None:
                break
            kb = encoded(child.key)
            end = pos + len(kb)
            if end <= n and enc.startswith(kb, pos):
                node, pos = child, end
            else:  # the match ends inside the child: split there; both parts count as accessed (SGLang's LRU)
                child.access_tick, child.last_access_time = tick, now
                node = self._split(child, common_prefix(enc, pos, kb, min(len(kb), n - pos), self.page_bytes))
                pos = n
                self._touched(child)
            node.access_tick, node.last_access_time = tick, now
            node.hit_count += 1
            path.append(node)
        if self._is_evictable(node):
            self._queue.push(node)  # its priority changed
        return path, node

    def _insert(self, enc: bytes, n: int, value: torch.Tensor, priority: int, extra: Any) -> tuple[int, TreeNode]:
        """Add ``enc[:n]`` with slots ``value``; returns the bytes the tree had on the device already
        and the last node. A node on the path that is not on the device is given the caller's slots
        for its tokens (``_refill``)."""
        tick, now = self._stamp()
        child_key = self._child_key
        node = self.root_node
        pos = cached = 0
        while pos < n:
            child = node.children.get(child_key(enc, pos, extra))
            if child is None:
                break
            kb = encoded(child.key)
            end = pos + len(kb)
            if end <= n and enc.startswith(kb, pos):
                node, pos, split = child, end, False
            else:  # the key leaves the child part-way: split it there (both parts count as accessed)
                child.access_tick, child.last_access_time = tick, now
                m = common_prefix(enc, pos, kb, min(len(kb), n - pos), self.page_bytes)
                node, pos, split = self._split(child, m), pos + m, True
                self._touched(child)
            node.access_tick, node.last_access_time = tick, now
            node.priority = max(node.priority, priority)
            if node.device is None:
                self._refill(node, value[(pos - len(encoded(node.key))) // self.elem_bytes : pos // self.elem_bytes])
            else:
                cached = pos
            if split:
                break
        if pos == n:
            if self._is_evictable(node):
                self._queue.push(node)
            return cached, node
        leaf = TreeNode(priority=priority)
        leaf.parent = node
        leaf.key = RadixKey.from_encoded(enc[pos:n], extra, self.is_eagle)
        leaf.device = DeviceSlots(value[pos // self.elem_bytes : n // self.elem_bytes].to(torch.int64, copy=True))
        leaf.child_key = child_key(enc, pos, extra)
        self._clock += 1  # made after the walk stamped the path (SGLang's leaf is created after it too)
        leaf.access_tick = leaf.creation_tick = self._clock
        node.children[leaf.child_key] = leaf
        self.evictable_size_ += len(leaf.device.value)
        self._queue.push(leaf)
        self._stored(leaf)
        return cached, leaf

    def _touched(self, node: TreeNode) -> None:
        """``node``'s access stamp changed outside the walked path (the second part of a split):
        every queue that holds it takes its new priority (a tier with its own queue adds to this)."""
        if self._is_evictable(node):
            self._queue.push(node)

    def _refill(self, node: TreeNode, slots: torch.Tensor) -> None:
        """Give a node of the tree that is not on the device the slots ``slots`` (a tier that keeps
        such nodes overrides this; in a device-only tree there are none)."""
        raise IntegrityError(f"node {node.id} is in the tree but not on the device")

    def _stored(self, node: TreeNode) -> None:
        if self.enable_kv_cache_events:
            self.kv_event_queue.extend(stored_events(node, self.root_node, self.page_size, self.elem_bytes, MEDIUM_GPU))

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Cut ``child`` after ``m`` bytes (whole pages); returns the new node holding the first part.
        Each tier record of ``child`` is split by its own ``split``."""
        kb, extra = encoded(child.key), child.key.extra_key
        t = m // self.elem_bytes
        new = TreeNode(priority=child.priority)
        new.parent, new.child_key = child.parent, child.child_key
        new.hit_count, new.access_tick, new.creation_tick = child.hit_count, child.access_tick, child.creation_tick
        new.last_access_time, new.creation_time = child.last_access_time, child.creation_time
        new.key = RadixKey.from_encoded(kb[:m], extra, self.is_eagle)
        child.key = RadixKey.from_encoded(kb[m:], extra, self.is_eagle)
        if child.device is not None:
            new.device = child.device.split(t)
        for name, record in child.records.items():
            head = record.split(t)
            if head is not None:
                new.records[name] = head
        if child.hash_value is not None:
            pages = t // self.page_size
            new.hash_value, child.hash_value = child.hash_value[:pages], child.hash_value[pages:]
        child.child_key = self._child_key(kb, m, extra)
        child.parent = new
        new.children = {child.child_key: child}
        new.parent.children[new.child_key] = new
        return new

    def branch_point(self, enc: bytes, n: int, extra: Any) -> tuple[TreeNode, int]:
        """Where a leaf for ``enc[:n]`` would hang: the deepest node whose prefix the tree holds (on
        any tier) and how many bytes of ``enc`` that prefix is (whole pages). A node the key leaves
        part-way is split there when the key goes on past it, so the leaf can hang below the split;
        no stamps or counts change. (The storage tier hangs fetched pages with it.)"""
        node, pos, child, m = self.deepest_held(self.root_node, 0, enc, n, extra)
        if child is None:
            return node, pos
        if pos + m < n:
            return self._split(child, m), pos + m
        return child, pos + m

    def deepest_held(self, node: TreeNode, pos: int, enc: bytes, n: int, extra: Any) -> tuple[TreeNode, int, Optional[TreeNode], int]:
        """The walk down from ``node`` (whose prefix ends at byte ``pos`` of ``enc``) along
        ``enc[:n]``, on any tier, reading the tree only: the deepest node whose whole key it holds
        and where that node ends, then the child the key goes into part-way (None: none) and how
        many bytes of that child's key it shares (whole pages)."""
        child_key = self._child_key
        while pos < n:
            child = node.children.get(child_key(enc, pos, extra))
            if child is None:
                break
            kb = encoded(child.key)
            if pos + len(kb) <= n and enc.startswith(kb, pos):
                node, pos = child, pos + len(kb)
                continue
            return node, pos, child, common_prefix(enc, pos, kb, min(len(kb), n - pos), self.page_bytes)
        return node, pos, None, 0

    def _evict_leaves(self, num_tokens: int, undo: Undo) -> list[torch.Tensor]:
        """Detach evictable leaves in the policy's order until ``num_tokens`` are gone (or none is
        left); returns their slots, now the caller's to free (``undo`` puts the leaves back)."""
        freed: list[torch.Tensor] = []
        count = 0
        while count < num_tokens:
            node = self._pop_evictable()
            if node is None:
                break
            freed.append(node.device.value)
            count += len(node.device.value)
            self._remove_leaf(node, undo)
        return freed

    def _pop_evictable(self) -> Optional[TreeNode]:
        """The device queue's next evictable leaf (entries of nodes no longer evictable are dropped)."""
        while True:
            node = self._queue.pop()
            if node is None or self._is_evictable(node):
                return node

    def _remove_leaf(self, node: TreeNode, undo: Optional[Undo] = None) -> None:
        """Take an evictable leaf off the device and out of the tree (its slots are the caller's to
        free now); its parent may become an evictable leaf."""
        self._drop_device(node, undo)
        parent = node.parent
        del parent.children[node.child_key]
        if undo is not None:
            undo.add(lambda: parent.children.__setitem__(node.child_key, node))
        if self._is_evictable(parent):
            self._queue.push(parent)

    def _drop_device(self, node: TreeNode, undo: Optional[Undo] = None) -> None:
        """Take an unlocked node's device record (its slots are the caller's to free now)."""
        device = node.device
        self.evictable_size_ -= len(device.value)
        events = len(self.kv_event_queue)
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(removed_event(node, self.root_node, self.page_size, self.elem_bytes, MEDIUM_GPU))
        node.device = None
        if undo is not None:
            undo.add(lambda: self._restore_device(node, device, events))

    def _restore_device(self, node: TreeNode, device: DeviceSlots, events: int) -> None:
        node.device = device
        self.evictable_size_ += len(device.value)
        del self.kv_event_queue[events:]
        if self._is_evictable(node):
            self._queue.push(node)

    def _peek(self, enc: bytes, n: int, extra: Any) -> tuple[int, list[torch.Tensor], Optional[TreeNode]]:
        """What ``_insert`` of ``enc[:n]`` would find, changing nothing: the bytes the tree holds on
        the device already, those slots, and the node that ends exactly at ``n`` (None if none does:
        the insert will make it)."""
        child_key = self._child_key
        node = self.root_node
        pos = cached = 0
        slots = []
        end = None
        while pos < n:
            child = node.children.get(child_key(enc, pos, extra))
            if child is None:
                break
            kb = encoded(child.key)
            whole = pos + len(kb) <= n and enc.startswith(kb, pos)
            m = len(kb) if whole else common_prefix(enc, pos, kb, min(len(kb), n - pos), self.page_bytes)
            pos += m
            if child.device is not None:
                slots.append(child.device.value[: m // self.elem_bytes])
                cached = pos
            if not whole:
                break
            node = child
            if pos == n:
                end = child
        return cached, slots, end

    def _path(self, node: Any, what: str) -> list[TreeNode]:
        """``node`` and its ancestors below the root, checked to be attached to this tree."""
        if not isinstance(node, TreeNode):
            raise TypeError(f"{what}: node must be a TreeNode, got {type(node).__name__}")
        root = self.root_node
        path = []
        while node is not root:
            parent = node.parent
            if parent is None or node.device is None or parent.children.get(node.child_key) is not node:
                raise ValueError(
                    f"{what}: node must be a node of this tree, got node {node.id}, which is "
                    + ("evicted" if node.device is None else "not attached to it (another tree, or reset)")
                )
            path.append(node)
            node = parent
        return path

    def _nodes(self) -> list[TreeNode]:
        """Every node, the root first, parents before children."""
        out, stack = [], [self.root_node]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    # --- the tree's own consistency -------------------------------------------------------------

    def tree_problems(self) -> tuple[list[str], list[torch.Tensor]]:
        """What is wrong with the tree itself (structure, keys, device records, locks, sizes and the
        eviction queue), and the device slot tensors of its nodes (for the ownership check)."""
        problems: list[str] = []
        root, p, elem = self.root_node, self.page_size, self.elem_bytes
        evictable = protected = 0
        values: list[torch.Tensor] = []
        for ck, child in root.children.items():
            if child.parent is not root or child.child_key != ck:
                problems.append(f"node {child.id} is filed under {ck!r} in the root but records parent/key {child.child_key!r}")
        stack: list[tuple[TreeNode, Any]] = [(child, child.key.extra_key) for child in root.children.values()]
        while stack:
            node, extra = stack.pop()
            for ck, child in node.children.items():
                if child.parent is not node or child.child_key != ck:
                    problems.append(f"node {child.id} is filed under {ck!r} in node {node.id} but records otherwise")
                stack.append((child, extra))
            key = node.key
            enc = encoded(key)
            n = len(enc) // elem
            where = f"node {node.id}"
            if n == 0 or n % p:
                problems.append(f"{where} holds {n} tokens, not a positive multiple of page_size = {p}")
            if key.extra_key != extra or key.is_bigram != self.is_eagle:
                problems.append(f"{where} has extra_key {key.extra_key!r} below a node of extra_key {extra!r}")
            if node.child_key != self._child_key(enc, 0, key.extra_key):
                problems.append(f"{where} is filed under {node.child_key!r}, not its first page's key")
            device = node.device
            if device is None:
                problems += self._off_device_problems(node)
                continue
            value = device.value
            if value.shape != (n,) or value.dtype != torch.int64:
                problems.append(f"{where} has value of shape {tuple(value.shape)} {value.dtype} for {n} tokens")
            values.append(value)
            if device.lock_ref < 0:
                problems.append(f"{where} has lock_ref {device.lock_ref} < 0")
            below = sum(c.lock_ref for c in node.children.values())
            if device.lock_ref < below:
                problems.append(f"{where} has lock_ref {device.lock_ref}, below its children's total {below}")
            if device.lock_ref:
                protected += n
            else:
                evictable += n
            if self._is_evictable(node) and not self._queue.holds(node):
                problems.append(f"{where} is an evictable leaf missing from the eviction queue")
        if (evictable, protected) != (self.evictable_size_, self.protected_size_):
            problems.append(
                f"evictable/protected sizes are recorded as {self.evictable_size_}/{self.protected_size_} but the "
                f"nodes hold {evictable}/{protected}"
            )
        return problems, values

    def _off_device_problems(self, node: TreeNode) -> list[str]:
        """What is wrong with a node of the tree that is not on the device (a tier that keeps such
        nodes overrides this)."""
        return [f"node {node.id} is evicted but still in the tree"]
