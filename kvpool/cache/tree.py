"""``RadixTree``: the radix tree's structure and its walks, under ``RadixCache``'s API.

Nodes hold whole pages of key elements as bytes (``kvpool.cache.key``); a walk compares a node with
one ``bytes.startswith`` and searches inside a node only where a match or an insertion leaves it.
Evictable leaves wait in an ``EvictionQueue``; every change that makes a node an evictable leaf, or
changes the priority of one, pushes it.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from kvpool.cache.events import MEDIUM_GPU, removed_event, stored_events
from kvpool.cache.evict_policy import EvictionQueue, EvictionStrategy
from kvpool.cache.key import BIGRAM_BYTES, TOKEN_BYTES, RadixKey, child_key_fn, common_prefix
from kvpool.cache.node import TreeNode


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
        self._elem = BIGRAM_BYTES if is_eagle else TOKEN_BYTES
        self._page_bytes = page_size * self._elem
        self._child_key = child_key_fn(page_size, is_eagle)
        self._queue = EvictionQueue(strategy, self._is_evictable)
        self._clock = 0

    def _reset_tree(self) -> None:
        self._queue.clear()
        root = TreeNode(priority=-(2**62))
        root.key = RadixKey([], None)
        root.value = torch.empty(0, dtype=torch.int64, device=self.device)
        root.host_value = torch.empty(0, dtype=torch.int64)
        root.lock_ref = 1
        root.hash_value = []
        self.root_node = root
        self.evictable_size_ = 0
        self.protected_size_ = 0

    def _is_evictable(self, node: TreeNode) -> bool:
        """On the device, unlocked, and no child on the device (host-only children may remain)."""
        return node.lock_ref == 0 and node.value is not None and node._dev_children == 0 and node.parent is not None

    def _stamp(self) -> tuple[int, float]:
        self._clock += 1
        return self._clock, time.monotonic()

    def _match(self, enc: bytes, n: int, extra: Any) -> tuple[list[torch.Tensor], TreeNode]:
        """The values along the longest page-aligned prefix of ``enc[:n]`` and its last node."""
        tick, now = self._stamp()
        child_key = self._child_key
        node = self.root_node
        values = []
        pos = 0
        while pos < n:
            child = node.children.get(child_key(enc, pos, extra))
            if child is None:
                break
            kb = child.key._enc
            end = pos + len(kb)
            if end <= n and enc.startswith(kb, pos):
                node, pos = child, end
            else:  # the match ends inside the child: only its first part was accessed
                node = self._split(child, common_prefix(enc, pos, kb, min(len(kb), n - pos), self._page_bytes))
                pos = n
            node._tick, node.last_access_time = tick, now
            node.hit_count += 1
            values.append(node.value)
        if self._is_evictable(node):
            self._queue.push(node)  # its priority changed
        return values, node

    def _insert(self, enc: bytes, n: int, value: torch.Tensor, priority: int, extra: Any) -> tuple[int, TreeNode]:
        """Add ``enc[:n]`` with slots ``value``; returns the bytes the tree held on the device already
        and the last node. A node on the path that is on the host only takes the caller's slots for
        its tokens (they hold the same KV, computed again)."""
        tick, now = self._stamp()
        child_key = self._child_key
        node = self.root_node
        pos = held = 0
        while pos < n:
            child = node.children.get(child_key(enc, pos, extra))
            if child is None:
                break
            kb = child.key._enc
            end = pos + len(kb)
            if end <= n and enc.startswith(kb, pos):
                node, pos, split = child, end, False
            else:  # the key leaves the child part-way: split it there
                m = common_prefix(enc, pos, kb, min(len(kb), n - pos), self._page_bytes)
                node, pos, split = self._split(child, m), pos + m, True
            node._tick, node.last_access_time = tick, now
            node.priority = max(node.priority, priority)
            if node.value is None:
                self._adopt(node, value[(pos - len(node.key._enc)) // self._elem : pos // self._elem])
            else:
                held = pos
            if split:
                break
        if pos == n:
            if self._is_evictable(node):
                self._queue.push(node)
            return held, node
        leaf = TreeNode(priority=priority)
        leaf.parent = node
        leaf.key = RadixKey.from_encoded(enc[pos:n], extra, self.is_eagle)
        leaf.value = value[pos // self._elem : n // self._elem].to(torch.int64, copy=True)
        leaf._ck = child_key(enc, pos, extra)
        leaf._tick = leaf._born = tick
        node.children[leaf._ck] = leaf
        node._dev_children += 1
        self.evictable_size_ += len(leaf.value)
        self._queue.push(leaf)
        if self.enable_kv_cache_events:
            self.kv_event_queue.extend(stored_events(leaf, self.root_node, self.page_size, self._elem, MEDIUM_GPU))
        return held, leaf

    def _adopt(self, node: TreeNode, slots: torch.Tensor) -> None:
        """A host-only node is on the device again, at ``slots`` (unlocked: it was evictable)."""
        node.value = slots.to(torch.int64, copy=True)
        node.parent._dev_children += 1
        self.evictable_size_ += len(node.value)
        if self._is_evictable(node):
            self._queue.push(node)
        if self.enable_kv_cache_events:
            self.kv_event_queue.extend(stored_events(node, self.root_node, self.page_size, self._elem, MEDIUM_GPU))

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Cut ``child`` after ``m`` bytes (whole pages); returns the new node holding the first part."""
        kb, extra = child.key._enc, child.key.extra_key
        t = m // self._elem
        new = TreeNode(priority=child.priority)
        new.parent, new.lock_ref, new._ck = child.parent, child.lock_ref, child._ck
        new.hit_count, new._tick, new._born = child.hit_count, child._tick, child._born
        new.last_access_time, new.creation_time = child.last_access_time, child.creation_time
        new.key = RadixKey.from_encoded(kb[:m], extra, self.is_eagle)
        child.key = RadixKey.from_encoded(kb[m:], extra, self.is_eagle)
        if child.value is not None:
            new.value, child.value = child.value[:t].clone(), child.value[t:].clone()
        if child.host_value is not None:
            new.host_value, child.host_value = child.host_value[:t].clone(), child.host_value[t:].clone()
        if child.hash_value is not None:
            pages = t // self.page_size
            new.hash_value, child.hash_value = child.hash_value[:pages], child.hash_value[pages:]
        child._ck = self._child_key(kb, m, extra)
        child.parent = new
        new._dev_children = 0 if child.value is None else 1
        new.children = {child._ck: child}
        new.parent.children[new._ck] = new
        return new

    def _evict_leaves(self, num_tokens: int) -> list[torch.Tensor]:
        """Detach evictable leaves in the policy's order until ``num_tokens`` are gone (or none is
        left); returns their slots, now the caller's to free."""
        freed: list[torch.Tensor] = []
        count = 0
        while count < num_tokens:
            node = self._queue.pop()
            if node is None:
                break
            freed.append(node.value)
            count += len(node.value)
            self._remove_leaf(node)
        return freed

    def _remove_leaf(self, node: TreeNode) -> None:
        """Take an evictable leaf off the device and out of the tree (its slots are the caller's to
        free now)."""
        self._drop_device(node)
        del node.parent.children[node._ck]

    def _drop_device(self, node: TreeNode) -> None:
        """Take an evictable leaf off the device (its slots are the caller's to free now); it stays
        in the tree, its parent may become an evictable leaf."""
        parent = node.parent
        self.evictable_size_ -= len(node.value)
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(removed_event(node, self.root_node, self.page_size, self._elem, MEDIUM_GPU))
        node.value = None
        parent._dev_children -= 1
        if self._is_evictable(parent):
            self._queue.push(parent)

    def _path(self, node: Any, what: str) -> list[TreeNode]:
        """``node`` and its ancestors below the root, checked to be attached to this tree."""
        if not isinstance(node, TreeNode):
            raise TypeError(f"{what}: node must be a TreeNode, got {type(node).__name__}")
        root = self.root_node
        path = []
        while node is not root:
            parent = node.parent
            if parent is None or node.value is None or parent.children.get(node._ck) is not node:
                raise ValueError(
                    f"{what}: node must be a node of this tree, got node {node.id}, which is "
                    + ("evicted" if node.value is None else "not attached to it (another tree, or reset)")
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
