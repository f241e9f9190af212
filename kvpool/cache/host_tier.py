"""What the caches with a host tier share (``HiRadixCache``, ``HiMambaRadixCache``): a node's KV
copy to new host slots and its attachment (``write_backup``), the nodes a backup or load keeps locked
until its copy completes (``writing_check``, ``loading_check``, ``check_hicache_events``), device
slots made by eviction (``alloc_device``), and the tree's hooks for nodes on the host only (which are
evictable, how one comes back on the device, what the integrity check asks of them and of the host
pool). Mixed into both caches before their device cache (``RadixCache``, ``MambaRadixCache``), whose
tree, queues and locks it uses; each cache keeps its own matches, evictions and loads.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from kvpool.cache.evict_policy import EvictionQueue
from kvpool.cache.node import TreeNode
from kvpool.cache.params import EvictParams
from kvpool.cache.records import HOST, DeviceSlots, HostCopy
from kvpool.cache.write_through import NO_ROOM


class HostTier:
    """The host tier's bookkeeping of a cache whose nodes can live on in ``token_to_kv_pool_host``
    (see the module); the cache sets ``token_to_kv_pool_host``, ``kv_cache``, ``io_backend`` and
    ``storage_tier`` and defines ``evict`` and ``evict_host``."""

    # --- SGLang's API ---------------------------------------------------------------------------

    def write_backup(self, node: TreeNode, write_back: bool = False) -> int:
        """Back up a device node to new host slots (evicting host-only leaves for room); returns its
        tokens, or 0 when the host has no room. Unless ``write_back``, the node stays locked until
        the backup has read its slots (``writing_check``). If the backup raises, its host slots are
        freed again and the node stays without a host copy. (An insert's write-through backups are
        copied before the tree changes and handed to this call to attach.)"""
        staged, self._staged_copy = self._staged_copy, None
        copy = self.back_up_slots(node.device.value) if staged is None else staged
        if copy is NO_ROOM or copy is None:
            return 0
        slots, event = copy
        node.records[HOST] = HostCopy(slots)
        if self.storage_tier is not None:
            self.storage_tier.backed_up(node, event)  # written through once the copy is complete
        if event is not None and not write_back:
            self.inc_lock_ref(node)
            self.ongoing_write_through.append((node, event))
        return len(node.device.value)

    def writing_check(self, write_back: bool = False) -> None:
        """Unlock the nodes whose backup has completed."""
        self.ongoing_write_through = self._release_done(self.ongoing_write_through)

    def loading_check(self) -> None:
        """Unlock the nodes whose load has completed."""
        self.ongoing_load_back = self._release_done(self.ongoing_load_back)

    def check_hicache_events(self) -> None:
        """``writing_check()`` and ``loading_check()`` (SGLang's scheduler calls it every step), and
        the storage writes of host copies completed since."""
        self.writing_check()
        self.loading_check()
        if self.storage_tier is not None:
            self.storage_tier.poll()

    # --- what the cache's other rooms use -------------------------------------------------------

    def back_up_slots(self, device_slots: torch.Tensor) -> Optional[tuple[torch.Tensor, Any]]:
        """Copy ``device_slots`` (Tensor [N] int64) to new host slots, evicting host-only leaves for
        room: (host slots, the copy's event or None), or None when the host has no room. The host
        slots are the caller's to attach or free; they are freed again if the copy raises."""
        host = self.token_to_kv_pool_host
        n = len(device_slots)
        slots = host.alloc(n)
        if slots is None:
            self.evict_host(n)
            slots = host.alloc(n)
            if slots is None:
                return None
        try:
            event = host.backup_from_device_all_layer(self.kv_cache, slots, device_slots, self.io_backend)
        except BaseException:
            host.free(slots)
            raise
        return slots, event

    def alloc_device(self, n: int) -> Optional[torch.Tensor]:
        """``n`` device KV slots from the allocator, evicting for room; None if there are not."""
        allocator = self.token_to_kv_pool_allocator
        slots = allocator.alloc(n)
        if slots is None:
            self.evict(EvictParams(num_tokens=n))
            slots = allocator.alloc(n)
        return slots

    def is_host_evictable(self, node: TreeNode) -> bool:
        """Whether ``node`` is a host-only leaf (not the root): what host eviction may take."""
        return node.device is None and HOST in node.records and not node.children and node.parent is not None

    def hold_released(self, node: TreeNode) -> None:
        """The storage tier's last hold on ``node``'s host copy is gone (a prefetch ended): nothing to
        do here, the node stays as host eviction finds it; a cache whose host-only leaves need more
        than a host copy drops ``node`` if it can no longer stay."""

    # --- the tree's hooks -----------------------------------------------------------------------

    def _reset_host(self) -> None:
        """Forget the host tier's bookkeeping and free every host page (the tree has just been reset)."""
        self._host_queue = EvictionQueue(self.eviction_strategy, HOST)
        self.root_node.records[HOST] = HostCopy(torch.empty(0, dtype=torch.int64))  # ends every walk up
        self.ongoing_write_through: list[tuple[TreeNode, Any]] = []
        self.ongoing_load_back: list[tuple[TreeNode, Any]] = []
        self._pending_loads: list[tuple] = []
        self._loads_started = 0
        self._staged_copy: Any = None  # a write-through copy made before an insert, for write_backup
        self.token_to_kv_pool_host.clear()

    def _is_evictable(self, node: TreeNode) -> bool:
        """On the device, unlocked, not the root, and no child on the device (host-only children may
        remain)."""
        device = node.device
        if device is None or device.lock_ref or node.parent is None:
            return False
        return all(c.device is None for c in node.children.values())

    def _touched(self, node: TreeNode) -> None:
        super()._touched(node)
        if self.is_host_evictable(node):
            self._host_queue.push(node)

    def _refill(self, node: TreeNode, slots: torch.Tensor) -> None:
        """A host-only node is on the device again, at ``slots`` (unlocked: it was evictable)."""
        node.device = DeviceSlots(slots.to(torch.int64, copy=True))
        self.evictable_size_ += len(slots)
        if self._is_evictable(node):
            self._queue.push(node)
        self._stored(node)

    def _off_device_problems(self, node: TreeNode) -> list[str]:
        problems = []
        if HOST not in node.records:
            problems.append(f"node {node.id} is evicted with no host copy but still in the tree")
        on_device = sum(c.device is not None for c in node.children.values())
        if on_device:
            problems.append(f"node {node.id} is on the host only but has {on_device} children on the device")
        return problems

    def _tier_problems(self) -> list[str]:
        """The host copies' problems and the storage tier's, then those of the cache's other tiers."""
        host = self.token_to_kv_pool_host
        parts = [n.records[HOST].slots for n in self._nodes() if n is not self.root_node and HOST in n.records]
        if self.storage_tier is not None:
            parts += self.storage_tier.held_host_slots()  # read into by prefetches, not in the tree yet
        slots = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        problems = []
        if torch.unique(slots).numel() != slots.numel():
            problems.append(f"{slots.numel() - torch.unique(slots).numel()} host slots held by two nodes")
        allocated = host.size - host.available_size()
        if allocated != slots.numel():
            problems.append(f"the host pool has {allocated} slots allocated but the nodes hold {slots.numel()}")
        for node in self._nodes():
            if self.is_host_evictable(node) and not self._host_queue.holds(node):
                problems.append(f"node {node.id} is a host-only leaf missing from the host eviction queue")
        if self.storage_tier is not None:
            problems += self.storage_tier.problems(self._nodes())
        return problems + super()._tier_problems()

    def _release_done(self, ongoing: list[tuple[TreeNode, Any]]) -> list[tuple[TreeNode, Any]]:
        left = []
        for node, event in ongoing:
            if event is None or event.query():
                self.dec_lock_ref(node)
            else:
                left.append((node, event))
        return left
