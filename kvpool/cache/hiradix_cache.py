"""``HiRadixCache``: the prefix cache with kvpool's host tier below the device (SGLang's HiCache).

A node's KV is on the device (its ``DeviceSlots``, ``value``), on the host (its ``HostCopy`` record,
``host_value``), or both: the host tier is this room, with ``kvpool.cache.host_tier`` for what it
shares with the hybrid models' cache (the tree below keeps device nodes only, and asks the host tier
about the others: ``_refill``, ``_off_device_problems``). Nodes are backed up to host slots when
inserted (``write_through``), when reused (``write_through_selective``: a second hit) or when
evicted (``write_back``). Evicting a backed-up node frees its device slots and keeps it in the tree,
host only; a match that reaches such nodes reports them (``host_hit_length``, ``last_host_node``),
``init_load_back`` gives them device slots again and ``ready_to_load_host_cache`` loads them through
the host pool, layer by layer as the model reads them (the cache registers the host pool's
layer-transfer counter on the device pool). Host-only leaves are evicted from the host when the host
pool runs out (``evict_host``). Every copy is the host tier's, byte for byte.

A backup or load in flight keeps its nodes locked until ``check_hicache_events()`` (or
``writing_check``/``loading_check``) sees it complete; a write-back eviction orders the compute
stream after its backups (``wait_for_backups``), so the freed slots' next owners write after the
backup read them. With a storage backend, host copies are written through to it and a match's
remainder is prefetched from it: that room is ``kvpool.cache.storage_tier``.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from kvpool.cache.host_setup import host_tier_setup
from kvpool.cache.host_tier import HostTier
from kvpool.cache.node import TreeNode
from kvpool.cache.params import CacheInitParams, EvictParams, EvictResult, MatchPrefixParams, MatchResult
from kvpool.cache.radix_cache import RadixCache
from kvpool.cache.records import HOST, DeviceSlots, HostCopy
from kvpool.cache.storage_calls import StorageCalls
from kvpool.cache.storage_setup import storage_for
from kvpool.cache.storage_tier import StoragePolicy
from kvpool.cache.tree import Undo
from kvpool.cache.write_through import WriteThroughInserts
from kvpool.checks import non_negative_int


class HiRadixCache(WriteThroughInserts, StorageCalls, HostTier, RadixCache):
    """A ``RadixCache`` whose evicted nodes can live on in a host pool and be loaded back.

    Parameters
    ----------
    params : CacheInitParams (or its fields by keyword, as for ``RadixCache``); the allocator must
        have its device pool as ``kvcache`` (``get_kvcache()``).
    server_args : SGLang's server arguments, read for ``hicache_ratio``, ``hicache_size``,
        ``hicache_mem_layout``, ``hicache_write_policy`` and ``hicache_io_backend`` when
        ``host_pool`` is not given, and ``hicache_storage_backend`` (``"file"``) with
        ``hicache_storage_prefetch_policy`` when ``storage`` is not.
    host_pool : an ``MHATokenToKVPoolHost``/``MLATokenToKVPoolHost`` over the allocator's device
        pool, with the cache's page size (instead of building one from ``server_args``).
    write_policy : ``"write_through"`` (default), ``"write_through_selective"`` or ``"write_back"``.
    io_backend : the host pool's backend, ``"kernel"`` (default) or ``"direct"``.
    load_back_threshold : host tokens below which ``init_load_back`` recomputes instead of loading.
    storage : a ``kvpool.storage.HiCacheStorage`` below the host tier (None: none).
    storage_policy : a ``kvpool.cache.storage_tier.StoragePolicy`` (prefetch policy, threshold,
        back-off), with ``storage``.
    validate : as for ``RadixCache``.

    Raises
    ------
    ValueError
        For a missing allocator or device pool, a host pool over another device pool or page size,
        an unknown write policy or backend, a storage backend other than ``"file"`` named in
        ``server_args``, a bad ``storage`` or ``storage_policy``, and as ``RadixCache``.
    """

    def __init__(
        self, params: Optional[CacheInitParams] = None, server_args: Any = None, *, host_pool: Any = None,
        write_policy: Optional[str] = None, io_backend: Optional[str] = None, load_back_threshold: int = 10,
        storage: Any = None, storage_policy: Optional[StoragePolicy] = None, validate: bool = False,
        **legacy_fields: Any,
    ) -> None:  # fmt: skip
        super().__init__(params, validate=validate, **legacy_fields)
        setup = host_tier_setup(self.token_to_kv_pool_allocator, self.page_size, server_args, host_pool, write_policy, io_backend)
        device_pool, host_pool, policy, backend = setup
        self.token_to_kv_pool_host = host_pool
        self.kv_cache = device_pool
        self.write_policy = policy
        self.io_backend = backend
        self.load_back_threshold = non_negative_int(load_back_threshold, "load_back_threshold")
        self.write_through_threshold = 1 if policy == "write_through" else 2
        rank_fields = (("tp_cache_group", None), ("pp_rank", 0), ("pp_size", 1))  # they name the storage namespace
        group, pp_rank, pp_size = (getattr(params, k, d) if params is not None else legacy_fields.get(k, d) for k, d in rank_fields)
        ranks = (group, (pp_rank, pp_size))
        make_tier = storage_for(server_args, storage, storage_policy, host_pool, *ranks)  # checked before any change
        if hasattr(device_pool, "register_layer_transfer_counter"):
            device_pool.register_layer_transfer_counter(host_pool.layer_transfer_counter)
        self._reset_host()  # the cache owns every host page from now on
        self.storage_tier = None if make_tier is None else make_tier(self)
        self.enable_storage = self.storage_tier is not None

    # --- SGLang's API ---------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget every node, and free every host page (the device slots are not freed); prefetches
        in flight are dropped (storage keeps its pages)."""
        super().reset()
        self._reset_host()
        if self.storage_tier is not None:
            self.storage_tier.reset()

    def match_prefix(self, params: Union[MatchPrefixParams, Any], **kwargs: Any) -> MatchResult:
        """As ``RadixCache.match_prefix``, through host-only nodes too: ``device_indices`` and
        ``last_device_node`` cover the part on the device, ``host_hit_length`` the tokens after it
        that are on the host only, ``last_host_node`` the last node of the match with a host copy."""
        walked = self._match_key(params)
        if walked is None:
            return self._empty_match()
        path, node = walked
        device = [n.device.value for n in path if n.device is not None]
        indices = torch.cat(device) if device else self._empty_match().device_indices
        last_device, host_hit = node, 0
        while last_device.device is None:
            host_hit += len(last_device.records[HOST].slots)
            last_device = last_device.parent
        last_host = node
        while HOST not in last_host.records:
            last_host = last_host.parent
        if self.is_host_evictable(node):
            self._host_queue.push(node)  # its priority changed
        if last_device is not node and self._is_evictable(last_device):  # stamped by the walk too
            self._queue.push(last_device)
        return MatchResult(indices, last_device, last_host, host_hit_length=host_hit)

    def evict(self, params: Union[EvictParams, int]) -> EvictResult:
        """Free at least ``num_tokens`` device tokens, unlocked device leaves first in the policy's
        order: a backed-up node stays in the tree on the host; under ``write_back`` a node without a
        host copy is backed up first (when the host has room); any other leaf leaves the tree, with
        the host-only nodes below it. The device slots go back in one ``free`` call, before the host
        slots of the nodes that left. A node the call moves to the host stays there for the rest of
        the call: its backups make room from the host-only leaves of before the call only.

        Raises
        ------
        ValueError
            As ``RadixCache.evict``; nothing changes. If a write-back backup or the allocator's
            ``free`` raises, the nodes go back as they were (host-only leaves of before the call
            evicted to make room stay evicted) and the error propagates; if the host pool's ``free``
            raises after that, the device part stands.
        """
        num = self._evict_amount(params)
        host = self.token_to_kv_pool_host
        undo = Undo()
        moved: list[HostCopy] = []  # the copies of the nodes this call moved to the host: held till it ends
        freed: list[torch.Tensor] = []
        host_freed: list[torch.Tensor] = []
        count = 0
        written_back = False
        try:
            while count < num:
                node = self._pop_evictable()
                if node is None:
                    break
                if HOST not in node.records and self.write_policy == "write_back":
                    try:
                        backed = self.write_backup(node, write_back=True) > 0
                    except BaseException:
                        self._queue.push(node)  # popped, still an evictable leaf
                        raise
                    if backed:
                        written_back = True
                        undo.add(lambda node=node: host.free(node.records.pop(HOST).slots))  # the call's copy
                freed.append(node.device.value)
                count += len(node.device.value)
                if HOST in node.records:
                    self._drop_device(node, undo)
                    copy = node.records[HOST]
                    copy.holds += 1
                    moved.append(copy)
                    if self._is_evictable(node.parent):
                        self._queue.push(node.parent)
                    if self.is_host_evictable(node):
                        self._host_queue.push(node)
                else:
                    host_freed += self._detach_host_subtree(node, undo)
                    self._remove_leaf(node, undo)
            if written_back:
                host.wait_for_backups()  # the slots' next writers come after the reads
            if freed:
                self.token_to_kv_pool_allocator.free(torch.cat(freed) if len(freed) > 1 else freed[0])
        except BaseException:
            undo.run()  # the nodes go back on the device, and the backups of this call are dropped
            raise
        finally:
            for copy in moved:
                copy.holds -= 1
        if host_freed:
            host.free(torch.cat(host_freed))
        return EvictResult(num_tokens_evicted=count)

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host tokens of host-only leaves (unheld: ``host_ref_counter``
        0), in the policy's order; they leave the tree. Returns the host tokens freed."""
        num = non_negative_int(num_tokens, "num_tokens")
        freed: list[torch.Tensor] = []
        protected: list[TreeNode] = []
        count = 0
        while count < num:
            node = self._host_queue.pop()
            if node is None:
                break
            if not self.is_host_evictable(node):
                continue
            copy = node.records[HOST]
            if copy.holds > 0:
                protected.append(node)
                continue
            freed.append(copy.slots)
            count += len(copy.slots)
            del node.records[HOST]
            parent = node.parent
            del parent.children[node.child_key]
            if self.is_host_evictable(parent):
                self._host_queue.push(parent)
        for node in protected:
            self._host_queue.push(node)
        if freed:
            self.token_to_kv_pool_host.free(torch.cat(freed))
        return count

    def init_load_back(
        self, last_node: TreeNode, host_hit_length: int = 0, mem_quota: Optional[int] = None
    ) -> tuple[torch.Tensor, TreeNode]:
        """Device slots for the host-only nodes from ``last_node`` up to its first ancestor on the
        device, all or none; the load itself starts at ``ready_to_load_host_cache()``.

        Returns
        -------
        (Tensor [L] int64 device slots of the loaded tokens, in order; the node the device part now
        ends on): ``last_node`` when loaded, else its first ancestor on the device with no slots (the
        host part is below ``load_back_threshold``, beyond ``mem_quota``, or the device has no room
        even after eviction). ``last_node`` stays locked until the load completes.

        Raises
        ------
        TypeError, ValueError
            If ``last_node`` is not a node of this tree.
        """
        if not isinstance(last_node, TreeNode):
            raise TypeError(f"init_load_back: last_node must be a TreeNode, got {type(last_node).__name__}")
        empty = self._empty_match().device_indices
        if last_node.device is not None:
            self._path(last_node, "init_load_back")
            return empty, last_node
        chain = []
        node = last_node
        while node.device is None:
            if node.parent is None or node.parent.children.get(node.child_key) is not node:
                raise ValueError(f"init_load_back: last_node must be a node of this tree, got node {last_node.id}")
            chain.append(node)
            node = node.parent
        chain.reverse()
        ancestor = node
        host_slots = torch.cat([n.records[HOST].slots for n in chain])
        total = len(host_slots)
        delta = self.inc_lock_ref(ancestor)  # nothing above the chain may go while room is made
        for n in chain:
            n.protect_host()  # nor the chain's host copies, should room be made on the host
        try:
            device = None
            if total >= self.load_back_threshold and (mem_quota is None or total <= mem_quota + delta):
                device = self.alloc_device(total)
        finally:
            for n in chain:
                n.release_host()
            self.dec_lock_ref(ancestor)
        if device is None:
            return empty, ancestor
        offset = 0
        for n in chain:
            tokens = len(n.records[HOST].slots)
            self._refill(n, device[offset : offset + tokens])
            offset += tokens
        self.inc_lock_ref(last_node)
        self._pending_loads.append((host_slots, device, last_node))
        return device, last_node

    def ready_to_load_host_cache(self) -> int:
        """Start every load ``init_load_back`` prepared, in one layer-by-layer transfer; returns its
        number (-1 when there was none). The device pool's getters wait for each layer."""
        if not self._pending_loads:
            return -1
        host = self.token_to_kv_pool_host
        host_slots = torch.cat([h for h, _, _ in self._pending_loads])
        device = torch.cat([d for _, d, _ in self._pending_loads])
        host.load_to_device_all_layer(self.kv_cache, host_slots, device, self.io_backend)
        event = None
        if host.load_stream is not None:
            event = torch.cuda.Event()
            event.record(host.load_stream)
        self.ongoing_load_back.extend((node, event) for _, _, node in self._pending_loads)
        self._pending_loads = []
        self._loads_started += 1
        return self._loads_started - 1

    # --- internals ------------------------------------------------------------------------------

    def _detach_host_subtree(self, node: TreeNode, undo: Undo) -> list[torch.Tensor]:
        """Detach the host-only nodes below ``node``; returns their host slots, the caller's to free."""
        freed = []
        saved = []
        stack = list(node.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            copy = n.records.pop(HOST)
            saved.append((n, copy, n.children))
            freed.append(copy.slots)
            n.children = {}
        children, node.children = node.children, {}
        undo.add(lambda: self._reattach_host_subtree(node, children, saved))
        return freed

    def _reattach_host_subtree(self, node: TreeNode, children: dict, saved: list) -> None:
        node.children = children
        for n, copy, below in saved:
            n.records[HOST], n.children = copy, below
            if self.is_host_evictable(n):
                self._host_queue.push(n)
