"""The storage tier of ``HiMambaRadixCache``: ``StorageTier`` (``kvpool.cache.storage_tier``) with
the state snapshots beside the KV pages (docs/contract.md, "With a storage tier", hybrid models).

A node's state parked on the host (its ``HostState``) is written through to storage once its host
copy is complete, as the node's KV pages are, under its own key: ``kvpool.storage.keys.state_key``
of the key of the node's last page and the state pool's geometry, so it names the state after
exactly that prefix, in exactly this state layout, and never equals a page key. A read checks the
size too (a record of another size is a miss).

A prefetch reads the KV pages storage holds (as ``StorageTier``), then looks for the deepest of
those pages whose state storage also holds, and keeps the pages up to it with that state (nothing
when there is none): the pages past it would be KV without its state, which the tree never serves,
so they count as dropped (``states_missing``). The pages and the state become visible to
``check_prefetch_progress`` together, once both are read; the fetched part then hangs in the tree as
a host-only leaf whose state is parked on the host, where ``init_load_back`` finds it like any
parked state (storage -> host -> device). When the tree holds those pages already, as far as a
host-only node without a state (a tombstone on the host) that ends exactly there, that node takes
the state.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional

import torch

from kvpool.cache.himamba_host import HOST_STATE, HostState
from kvpool.cache.key import encoded
from kvpool.cache.node import TreeNode
from kvpool.cache.records import STATE
from kvpool.cache.storage_records import PrefetchOp, StorageTierStats
from kvpool.cache.storage_tier import StorageTier
from kvpool.storage.keys import state_geometry, state_key


@dataclasses.dataclass
class StateStorageStats(StorageTierStats):
    """``StorageTierStats``, and the state snapshots: written, state writes that failed, read by
    prefetches, prefetches whose pages had no state in storage (their pages dropped), and states
    taken by a host tombstone the tree held already (``adopt``)."""

    states_written: int = 0
    state_write_failures: int = 0
    states_read: int = 0
    states_missing: int = 0
    states_adopted: int = 0


class StateStorageTier(StorageTier):
    """The storage room of one ``HiMambaRadixCache`` (made by the cache; see the module)."""

    def __init__(self, cache: Any, storage: Any, policy: Any, owns_storage: bool = False) -> None:
        super().__init__(cache, storage, policy, owns_storage)
        self.state_host = cache.mamba_pool_host
        self.geometry = state_geometry(self.state_host)
        self.state_nbytes = self.state_host.slot_bytes
        self.stats = StateStorageStats()
        self._pending_states: list[tuple[TreeNode, HostState, Any]] = []  # (node, its host state, the backup's event)

    def state_key_of(self, node: TreeNode) -> Optional[str]:
        """The key of the state after ``node``'s last token; None when its pages have no keys."""
        keys = self.keys_of(node)
        return state_key(keys[-1], self.geometry) if keys else None

    # --- write-through -----------------------------------------------------------------------------

    def state_backed_up(self, node: TreeNode, event: Any) -> None:
        """``node`` has a new host state, complete once ``event`` is (None: now); it is written to
        storage at the next ``poll`` after that (at once for None; nothing once closed)."""
        if self.closed:
            return
        self._pending_states.append((node, node.records[HOST_STATE], event))
        if event is None:
            self.write_due()

    def write_due(self) -> None:
        """``StorageTier.write_due`` (the KV pages first), then the host states whose backup
        completed, if they are still their node's; a state that cannot be read out of the host pool
        is a failed write, as a page is in ``StorageTier.write_due``."""
        super().write_due()
        if self.closed:
            self._pending_states = []
            return
        pending, self._pending_states, left = self._pending_states, [], []
        for i, (node, record, event) in enumerate(pending):
            if event is not None and not event.query():
                left.append((node, record, event))
            elif node.records.get(HOST_STATE) is record and self._attached(node):
                try:
                    self._write_state(node, record)
                except BaseException:  # an interrupt: the states after this one stay pending
                    self._pending_states = left + pending[i + 1 :] + self._pending_states
                    raise
        self._pending_states = left + self._pending_states

    def _write_state(self, node: TreeNode, record: HostState) -> None:
        key = self.state_key_of(node)
        if key is None:
            return
        with self._lock:
            if time.monotonic() < self._resume_at or self.queued_pages + 1 > self.max_queued_pages:
                self.stats.writes_skipped += 1
                return
            self.queued_pages += 1
        try:
            data = self.state_host.get_data_page(int(record.slot[0]))
        except BaseException as e:
            with self._lock:
                self.queued_pages -= 1
                if isinstance(e, Exception):
                    self.stats.state_write_failures += 1
                    self._settle(False)
            if isinstance(e, Exception):
                return
            raise
        self.workers.submit("write", lambda: self._run_state_write(key, data))

    def _run_state_write(self, key: str, data: torch.Tensor) -> None:
        try:
            ok = self.storage.set(key, data) is True
        except Exception:
            ok = False
        with self._lock:
            self.queued_pages -= 1
            if ok:
                self.stats.states_written += 1
            else:
                self.stats.state_write_failures += 1
            self._settle(ok)

    # --- prefetch ----------------------------------------------------------------------------------

    def fetch(self, op: PrefetchOp, hits: int) -> None:
        """Read ``op``'s first ``hits`` pages, then the state after the deepest of them that storage
        holds; publish those pages and that state together (nothing without a state). A storage
        error ends the reads: what was read until then is published as far as it has a state, and
        the error propagates (the tier backs off)."""
        pages: list[torch.Tensor] = []
        state, error = None, None
        try:
            for key in op.keys[:hits]:
                if op.terminated:
                    break
                page = torch.empty(self.page_nbytes, dtype=torch.uint8)
                if self.storage.get(key, page) is None:
                    self.events.missing(key)
                    break
                pages.append(page)
        except Exception as e:
            error = e
        depth = len(pages)
        try:
            while depth > 0 and not op.terminated:
                key = state_key(op.keys[depth - 1], self.geometry)
                if self.storage.exists(key):
                    buf = torch.empty(self.state_nbytes, dtype=torch.uint8)
                    if self.storage.get(key, buf) is not None:
                        state = buf
                        break
                depth -= 1
        except Exception as e:
            error = error or e
        with self._lock:
            if op.terminated:  # ended meanwhile: what it read is neither taken nor counted
                pass
            elif state is not None:
                op.beside = state
                op.pages.extend(pages[:depth])
                self.stats.states_read += 1
                self.stats.tokens_dropped += (len(pages) - depth) * self.page_size
            elif pages and state is None:
                self.stats.states_missing += 1
                self.stats.tokens_dropped += len(pages) * self.page_size
        if error is not None:
            raise error

    def held_pages(self, node: TreeNode, enc: bytes, start: int, extra: Any) -> int:
        """As ``StorageTier.held_pages``, but one page fewer when the tree has no state where the held
        part ends: that page is read again, for the state after it that storage may hold (a host
        tombstone there takes it, ``adopt``)."""
        end_node, node_end, pos = self.cache.held_below(node, enc, start, extra)
        pages = (pos - start) // self.page_enc_bytes
        if pages and not (pos == node_end and (STATE in end_node.records or HOST_STATE in end_node.records)):
            pages -= 1
        return pages

    def reserve(self, op: PrefetchOp) -> Any:
        """A host state slot holding the fetched state (evicting host-only leaves for room), or False."""
        if op.beside is None:
            return False
        host = self.state_host
        slot = host.alloc(1)
        if slot is None:
            self.cache.evict_host(1)
            slot = host.alloc(1)
            if slot is None:
                return False
        try:
            host.set_from_flat_data_page(int(slot[0]), op.beside)
        except BaseException:
            host.free(slot)
            raise
        return slot

    def release(self, reserved: Any) -> None:
        """Free the host state slot ``reserve`` took."""
        if reserved is not None:
            self.state_host.free(reserved)

    def hang(self, leaf: TreeNode, op: PrefetchOp, reserved: Any) -> None:
        """The leaf's state is parked on the host: a match reaches it as far as its state."""
        leaf.records[HOST_STATE] = HostState(reserved)

    def adopt(self, node: TreeNode, op: PrefetchOp, reserved: Any) -> bool:
        """The tree holds the fetched KV already: a host-only node without a state (a tombstone on
        the host) that ends exactly where the fetched state belongs takes it, and a match can end
        there again."""
        end = op.start + len(op.pages) * self.page_enc_bytes
        if node.device is not None or HOST_STATE in node.records or node is self.cache.root_node:
            return False
        depth, n = 0, node
        while n is not self.cache.root_node:
            depth, n = depth + len(encoded(n.key)), n.parent
        if depth != end:
            return False
        node.records[HOST_STATE] = HostState(reserved)
        self.stats.states_adopted += 1
        return True

    # --- housekeeping ------------------------------------------------------------------------------

    def reset(self) -> None:
        """``StorageTier.reset``, and the state writes pending (their host slots are free)."""
        super().reset()
        self._pending_states = []
