"""How ``HiRadixCache``'s write-through policies back up an insert: the copies are made from the
insertion path's device slots before the tree changes, so a backup that raises leaves nothing
behind, and attached to their nodes once the insert has made them (docs/contract.md, "With a host
tier", Backups).
"""

from __future__ import annotations

from typing import Any

import torch

from kvpool.cache.key import common_prefix, encoded
from kvpool.cache.node import TreeNode
from kvpool.cache.records import HOST

#: A staged write-through backup the host had no room for.
NO_ROOM = object()


class WriteThroughInserts:
    """``RadixCache``'s insert hooks (``_stage_insert``, ``_unstage_insert``, ``_complete_insert``)
    for a cache with a host tier, mixed into ``HiRadixCache``: they use its write policy and
    ``HostTier``'s ``back_up_slots`` (a copy to new host slots) and ``write_backup`` (which attaches
    a staged copy)."""

    def _stage_insert(self, job: Any) -> Any:
        """Back up, before the tree changes, every device page of the insertion's path that the write
        policy backs up now (write-through policies, not chunked: a node whose hit count reaches the
        threshold with this insert); returns the host slots and events, root side first (None for a
        node the host had no room for). If a backup raises, the host slots taken so far are freed and
        nothing else has changed but the host-only leaves evicted for room (their slots may be written)."""
        if self.write_policy == "write_back" or job.chunked:
            return []
        due, host_only = self._due_backups(job)
        host = self.token_to_kv_pool_host
        copies: list = []
        for n in host_only:
            n.protect_host()  # the path's host-only nodes must stay while room is made for the copies
        try:
            for slots in due:
                copies.append(self.back_up_slots(slots))
        except BaseException:
            self._unstage_insert(copies)
            raise
        finally:
            for n in host_only:
                n.release_host()
        return copies

    def _unstage_insert(self, staged: Any) -> None:
        parts = [c[0] for c in staged or () if c is not None]
        if parts:
            self.token_to_kv_pool_host.free(torch.cat(parts))

    def _complete_insert(self, job: Any, staged: Any) -> int:
        """Insert, then count the insert as a hit on its path's device nodes without a host copy and
        give those due the copies ``_stage_insert`` made (locked until each copy has read its slots)."""
        cached, last = self._insert(job.enc, job.n, job.value, job.priority, job.extra)
        if self.write_policy == "write_back" or job.chunked:
            return cached // self.elem_bytes
        path = []
        node = last
        while node is not self.root_node:
            if node.device is not None and HOST not in node.records:
                path.append(node)
            node = node.parent
        copies = iter(staged)
        for node in reversed(path):
            node.hit_count += 1
            if node.hit_count < self.write_through_threshold:
                continue
            copy = next(copies, None)
            self._staged_copy = NO_ROOM if copy is None else copy
            self.write_backup(node)  # attaches the staged copy (or none: the host had no room)
        return cached // self.elem_bytes

    def _due_backups(self, job: Any) -> tuple[list[torch.Tensor], list[TreeNode]]:
        """The device slots of each part of the insertion's path that ``_complete_insert`` will back
        up (root side first), and the path's host-only nodes; reads the tree only."""
        threshold = self.write_through_threshold
        child_key = self._child_key
        enc, n, node, pos = job.enc, job.n, self.root_node, 0
        due, host_only = [], []
        while pos < n:
            child = node.children.get(child_key(enc, pos, job.extra))
            if child is None:
                break
            kb = encoded(child.key)
            whole = pos + len(kb) <= n and enc.startswith(kb, pos)
            m = len(kb) if whole else common_prefix(enc, pos, kb, min(len(kb), n - pos), self.page_bytes)
            pos += m
            if child.device is None:
                host_only.append(child)
            elif HOST not in child.records and child.hit_count + 1 >= threshold:
                due.append(child.device.value[: m // self.elem_bytes])
            if not whole:
                break
            node = child
        if pos < n and threshold <= 1:  # the new leaf, with its first hit
            due.append(job.value[pos // self.elem_bytes : n // self.elem_bytes])
        return due, host_only
