"""How ``HiMambaRadixCache`` moves a node's records between its tiers: a state backed up beside its
node's host KV copy, a node moved to the host or taken out of the tree with its host records and the
host-only nodes below it (every step undoable until the eviction's ``free`` has succeeded), and the
check of both tiers. Mixed into ``HiMambaRadixCache`` (``kvpool.cache.himamba_radix_cache``), whose
pools, queues and tier bookkeeping it uses.
"""

from __future__ import annotations

from typing import Optional

import torch

from kvpool.cache.himamba_host import HOST_STATE, HostState
from kvpool.cache.node import TreeNode
from kvpool.cache.records import HOST, STATE, HostCopy
from kvpool.cache.tree import Undo


class Taken:
    """What one eviction takes out of the tree, to free once it is done."""

    def __init__(self) -> None:
        self.kv: list[torch.Tensor] = []
        self.states: list[torch.Tensor] = []
        self.host_kv: list[torch.Tensor] = []
        self.host_states: list[torch.Tensor] = []
        self.moved: list[HostCopy] = []
        self.moved_nodes: list[TreeNode] = []
        self.backed_up = False


class HybridTierMoves:
    """The tier moves of ``HiMambaRadixCache`` (see the module)."""

    def _back_up_state(self, node: TreeNode, lock: bool = False) -> bool:
        """Copy ``node``'s device state to a new host state slot (evicting host-only leaves for
        room); False when the host has none. With ``lock`` the node stays locked until the copy has
        read its slot. If the copy raises, the host slot is freed again."""
        host = self.mamba_pool_host
        slot = host.alloc(1)
        if slot is None:
            self.evict_host(1)
            slot = host.alloc(1)
            if slot is None:
                return False
        try:
            device_slot = node.records[STATE].slot.to(self.mamba_pool.device)  # a snapshot given on the CPU too
            event = host.backup_from_device_all_layer(self.mamba_pool, slot, device_slot, self.io_backend)
        except BaseException:
            host.free(slot)
            raise
        node.records[HOST_STATE] = HostState(slot)
        if self.storage_tier is not None:
            self.storage_tier.state_backed_up(node, event)  # written through once the copy is complete
        if event is not None and lock:
            self.inc_lock_ref(node)
            self.ongoing_write_through.append((node, event))
        return True

    def _evict_node(self, node: TreeNode, out: Taken, undo: Undo) -> int:
        """Evict a popped evictable device leaf (see ``evict``); returns its device tokens freed."""
        try:
            keeps = STATE in node.records or node.children  # a tombstone leaf is not worth a copy
            if HOST not in node.records and self.write_policy == "write_back" and keeps:
                if self.write_backup(node, write_back=True) > 0:
                    out.backed_up = True
                    undo.add(lambda node=node: self.token_to_kv_pool_host.free(node.records.pop(HOST).slots))
            if HOST in node.records and STATE in node.records and HOST_STATE not in node.records:
                if self._back_up_state(node):
                    out.backed_up = True
                    undo.add(lambda node=node: self.mamba_pool_host.free(node.records.pop(HOST_STATE).slot))
        except BaseException:
            self._queue.push(node)  # popped, still an evictable leaf
            raise
        if HOST in node.records and (node.children or HOST_STATE in node.records):
            tokens = len(node.device.value)
            out.kv.append(node.device.value)
            if STATE in node.records:
                out.states.append(self._forget_state(node, undo))
            self._drop_device(node, undo)
            copy = node.records[HOST]
            copy.holds += 1
            out.moved.append(copy)
            out.moved_nodes.append(node)
            if self._is_evictable(node.parent):
                self._queue.push(node.parent)
            if self.is_host_evictable(node):
                self._host_queue.push(node)
            return tokens
        self._detach_host_below(node, out, undo)
        freed = 0
        while True:
            freed += len(node.device.value)
            out.kv.append(node.device.value)
            if STATE in node.records:
                out.states.append(self._forget_state(node, undo))
            self._take_host_records(node, out, undo)
            self._remove_leaf(node, undo)
            node = node.parent
            if node is self.root_node or node.children or STATE in node.records or node.lock_ref:
                return freed

    def _drop_host_leaf(self, node: TreeNode, out: Taken) -> int:
        """Take the unheld host-only leaf ``node`` out of the tree with its host records (into
        ``out``), and the unheld host-only parents without a state that it leaves as leaves; the
        first parent that stays is queued as it now is. Returns the host tokens taken."""
        count = 0
        while True:
            count += len(node.records[HOST].slots)
            self._take_host_records(node, out, None)
            parent = node.parent
            del parent.children[node.child_key]
            node = parent
            if node.device is not None or node.parent is None or node.children:
                break
            if HOST_STATE in node.records or node.records[HOST].holds > 0:
                break  # a host leaf with its state now, or held (its holder drops it if need be)
        if self.is_host_evictable(node):
            self._host_queue.push(node)
        elif self._is_evictable(node):
            self._queue.push(node)
        return count

    def _take_host_state(self, node: TreeNode, out: Taken, undo: Optional[Undo]) -> None:
        parked = node.records.pop(HOST_STATE, None)
        if parked is not None:
            out.host_states.append(parked.slot)
            if undo is not None:
                undo.add(lambda: node.records.__setitem__(HOST_STATE, parked))

    def _take_host_records(self, node: TreeNode, out: Taken, undo: Optional[Undo]) -> None:
        """Take ``node``'s host KV copy and host state out of it (their slots into ``out``)."""
        copy = node.records.pop(HOST, None)
        if copy is not None:
            out.host_kv.append(copy.slots)
            if undo is not None:
                undo.add(lambda: node.records.__setitem__(HOST, copy))
        self._take_host_state(node, out, undo)

    def _detach_host_below(self, node: TreeNode, out: Taken, undo: Undo) -> None:
        """Detach the host-only nodes below ``node``; their host slots go into ``out``."""
        saved = []
        stack = list(node.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            saved.append((n, dict(n.records), n.children))
            self._take_host_records(n, out, None)
            n.children = {}
        children, node.children = node.children, {}

        def reattach() -> None:
            node.children = children
            for n, records, below in saved:
                n.records, n.children = records, below
                if self.is_host_evictable(n):
                    self._host_queue.push(n)

        undo.add(reattach)

    def _free_host(self, out: Taken) -> None:
        if out.host_kv:
            self.token_to_kv_pool_host.free(torch.cat(out.host_kv))
        if out.host_states:
            self.mamba_pool_host.free(torch.cat(out.host_states))

    def _tier_problems(self) -> list[str]:
        # the host KV copies, then the device states, whose tombstone-leaf check gives way to the one below
        problems = [p for p in super()._tier_problems() if "tombstone leaf" not in p]
        parked = []
        for node in self._nodes():
            if node is self.root_node:
                continue
            where = f"node {node.id}"
            if HOST_STATE in node.records:
                parked += node.records[HOST_STATE].slot.tolist()
                if HOST not in node.records:
                    problems.append(f"{where} has a host state but no host KV copy")
            if node.device is None:
                if STATE in node.records:
                    problems.append(f"{where} is on the host only but has a device state")
                held = HOST in node.records and node.records[HOST].holds > 0  # a prefetch's holder drops it
                if HOST_STATE not in node.records and not node.children and not held:
                    problems.append(f"{where} is a host-only leaf without a state (a tombstone leaf) that no prefetch holds")
            else:
                if HOST_STATE in node.records and STATE not in node.records:
                    problems.append(f"{where} is on the device with its state on the host only")
                if STATE not in node.records and not node.children and node.lock_ref == 0 and not self._queue.holds(node):
                    problems.append(f"{where} is a tombstone leaf missing from the eviction queue")
        if len(set(parked)) != len(parked):
            problems.append(f"{len(parked) - len(set(parked))} host state slots held by two nodes")
        host = self.mamba_pool_host
        allocated = host.size - host.available_size()
        if allocated != len(parked):
            problems.append(f"the host state pool has {allocated} slots allocated but the nodes hold {len(parked)}")
        return problems
