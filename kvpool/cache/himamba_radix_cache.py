"""``HiMambaRadixCache``: the hybrid models' prefix cache (``MambaRadixCache``) with a host tier
below the device (SGLang's name for its hierarchical cache for hybrid models).

A node's KV is on the device, on the host, or both, as in ``HiRadixCache``; its state snapshot (the
linear layers' state after its last token) is on the device (``StateSnapshot``, ``mamba_value``), on
the host beside its KV copy (``HostState``, ``kvpool.cache.himamba_host``), or on neither (a
tombstone). The tiers move together: a node on the device keeps its state on the device (a backed-up
state is a second copy, never the only one), a node on the host only keeps its state on the host,
and a match never returns KV without the state after it. The host tier is a ``HybridPoolHost``: a
node's KV pages and its state are backed up through its two halves and loaded back by one
``HybridPoolHost.load``. What this cache shares with ``HiRadixCache`` (a KV backup and its
attachment, the transfers in flight, the tree's hooks for host-only nodes) is
``kvpool.cache.host_tier``.

Backups follow ``HiRadixCache``'s write policies, made after the tree has changed (a backup that
raises leaves the node in the tree without that host copy, and propagates). Evicting a node from the
device moves its KV and its state to the host (backing the state up then, and under ``write_back``
the KV too); a match reports the host part up to the deepest parked state (``host_hit_length``,
``last_host_node``), and ``init_load_back`` / ``ready_to_load_host_cache`` bring KV and states back.
Host eviction takes host-only leaves with their states; a host-only node left without a state and
without children goes too.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import numpy as np
import torch

from kvpool.cache.himamba_host import HOST_STATE, hybrid_host_setup
from kvpool.cache.himamba_moves import HybridTierMoves, Taken
from kvpool.cache.himamba_storage import StateStorageTier
from kvpool.cache.host_tier import HostTier
from kvpool.cache.mamba_radix_cache import MambaRadixCache
from kvpool.cache import mamba_requests
from kvpool.cache.node import TreeNode
from kvpool.cache.params import CacheInitParams, EvictParams, EvictResult, InsertParams, MatchPrefixParams, MatchResult, evict_counts
from kvpool.cache.key import RadixKey
from kvpool.cache.records import HOST, STATE, StateSnapshot
from kvpool.cache.storage_calls import StorageCalls
from kvpool.cache.storage_setup import storage_for
from kvpool.cache.storage_tier import StoragePolicy
from kvpool.cache.tree import Undo
from kvpool.checks import non_negative_int


class HiMambaRadixCache(HybridTierMoves, StorageCalls, HostTier, MambaRadixCache):
    """A ``MambaRadixCache`` whose evicted nodes live on in a ``HybridPoolHost``, KV with state, and
    are loaded back together.

    Parameters
    ----------
    params : CacheInitParams (or its fields by keyword); ``req_to_token_pool`` a
        ``HybridReqToTokenPool``, the allocator built with ``kvcache=`` a ``HybridLinearKVPool`` over
        that table's ``mamba_pool``.
    server_args : SGLang's server arguments, read for ``hicache_ratio``, ``hicache_size`` (one budget
        for KV pages and state slots, see ``kvpool.cache.himamba_host``), ``hicache_mem_layout``,
        ``hicache_write_policy`` and ``hicache_io_backend`` when ``host_pool`` is not given.
    host_pool : a ``HybridPoolHost`` over the allocator's device pool with the cache's page size.
    write_policy, io_backend, load_back_threshold : as for ``HiRadixCache``.
    storage, storage_policy : a storage backend below the host tier and its policy, as for
        ``HiRadixCache`` (or ``server_args.hicache_storage_backend``); the states are stored beside
        the KV pages (``kvpool.cache.himamba_storage``).
    mamba_cache_chunk_size, validate : as for ``MambaRadixCache``.

    Raises
    ------
    ValueError
        As ``MambaRadixCache``, and for a device pool or host pool that does not fit (see
        ``hybrid_host_setup``), an unknown write policy or backend, and a storage backend or policy
        as ``HiRadixCache`` refuses it.
    """

    def __init__(
        self, params: Optional[CacheInitParams] = None, server_args: Any = None, *, host_pool: Any = None,
        write_policy: Optional[str] = None, io_backend: Optional[str] = None, load_back_threshold: int = 10,
        storage: Any = None, storage_policy: Optional[StoragePolicy] = None, mamba_cache_chunk_size: int = 64,
        validate: bool = False, **legacy_fields: Any,
    ) -> None:  # fmt: skip
        super().__init__(params, mamba_cache_chunk_size=mamba_cache_chunk_size, validate=validate, **legacy_fields)
        setup = hybrid_host_setup(
            self.token_to_kv_pool_allocator, self.mamba_pool, self.page_size, server_args, host_pool, write_policy, io_backend
        )  # fmt: skip
        device_pool, host_pool, policy, backend = setup
        rank_fields = (("tp_cache_group", None), ("pp_rank", 0), ("pp_size", 1))  # they name the storage namespace
        group, pp_rank, pp_size = (getattr(params, k, d) if params is not None else legacy_fields.get(k, d) for k, d in rank_fields)
        make_tier = storage_for(
            server_args, storage, storage_policy, host_pool.kv_host, group, (pp_rank, pp_size), StateStorageTier
        )  # checked before any change
        self.load_back_threshold = non_negative_int(load_back_threshold, "load_back_threshold")
        self.hybrid_host = host_pool
        self.token_to_kv_pool_host = host_pool.kv_host
        self.mamba_pool_host = host_pool.state_host
        self.hybrid_kv_cache = device_pool
        self.kv_cache = device_pool.full_kv_pool  # what the KV host pool copies from and to
        self.write_policy = policy
        self.io_backend = backend
        self.write_through_threshold = 1 if policy == "write_through" else 2
        device_pool.register_layer_transfer_counter(host_pool.kv_host.layer_transfer_counter)
        self._reset_host()  # the cache owns every host page and host state slot from now on
        self.storage_tier = None if make_tier is None else make_tier(self)
        self.enable_storage = self.storage_tier is not None

    # --- SGLang's API ---------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget every node, and free every host page and host state slot (device slots are not
        freed); prefetches in flight are dropped (storage keeps its pages and states)."""
        super().reset()
        self._reset_host()
        if self.storage_tier is not None:
            self.storage_tier.reset()

    def prefetch_from_storage(
        self, req_id: Any, last_host_node: TreeNode, new_input_tokens: Any, last_hash: Optional[str] = None,
        prefix_keys: Any = None, *, extra_key: Any = None,
    ) -> None:  # fmt: skip
        """As ``HiRadixCache.prefetch_from_storage``, with the states: what storage holds is fetched
        as far as its deepest state (``kvpool.cache.himamba_storage``). ``last_host_node`` may be a
        match's ``last_host_node`` on the device without a host copy yet (a write policy that has
        not backed it up): the fetch then continues its deepest ancestor with one, and the pages the
        tree holds between are not read again. Raises as ``HiRadixCache.prefetch_from_storage``."""
        if self.storage_tier is None:
            return
        if isinstance(last_host_node, TreeNode) and last_host_node is not self.root_node and HOST not in last_host_node.records:
            path = self._path(last_host_node, "prefetch_from_storage")  # leaf first; raises for a node not of this tree
            after = next((i for i, n in enumerate(path) if HOST in n.records), len(path))
            anchor = path[after] if after < len(path) else self.root_node
            extra_key = last_host_node.key.extra_key
            if isinstance(new_input_tokens, RadixKey):
                if new_input_tokens.extra_key != extra_key:
                    raise ValueError(
                        f"new_input_tokens' extra_key must be last_host_node's {extra_key!r}, got {new_input_tokens.extra_key!r}"
                    )
                new_input_tokens = new_input_tokens.token_ids
            if isinstance(new_input_tokens, (torch.Tensor, np.ndarray)):
                tokens = new_input_tokens.tolist()
            elif isinstance(new_input_tokens, (list, tuple)):
                tokens = list(new_input_tokens)
            else:
                raise ValueError(f"new_input_tokens must be a token list, tensor or numpy array, or a RadixKey, got "
                                 f"{type(new_input_tokens).__name__}")  # fmt: skip
            head = [t for n in reversed(path[:after]) for t in n.key.token_ids]
            last_host_node, new_input_tokens = anchor, head + tokens
        super().prefetch_from_storage(req_id, last_host_node, new_input_tokens, extra_key=extra_key)

    def match_prefix(self, params: Union[MatchPrefixParams, Any], **kwargs: Any) -> MatchResult:
        """As ``MambaRadixCache.match_prefix`` for the device part: ``device_indices`` and
        ``last_device_node`` end on the deepest node of the match on the device with its state there
        (``cow_mamba`` forks that state). Past it, ``last_host_node`` is the deepest node of the match
        whose state is parked on the host (``last_device_node`` when none), and ``host_hit_length``
        the tokens from ``last_device_node`` to it (device tombstones between included: their KV
        needs no load): what ``init_load_back(last_host_node)`` returns. Raises as
        ``MambaRadixCache.match_prefix``; nothing changes then."""
        cow = isinstance(params, MatchPrefixParams) and params.cow_mamba and params.req is not None
        dst = mamba_requests.request_state_slot(self.mamba_pool, params.req) if cow else None
        walked = self._match_key(params)
        if walked is None:
            return self._empty_match()
        path, _ = walked
        best = max((i for i, nd in enumerate(path) if STATE in nd.records), default=-1)
        parked = max((i for i, nd in enumerate(path) if HOST_STATE in nd.records and nd.device is None), default=-1)
        last = path[best] if best >= 0 else self.root_node
        end = max(best, parked)
        for nd in path:
            if self._is_mamba_evictable(nd):
                self._mamba_queue.push(nd)  # their priority changed (root side first on ties)
            elif self.is_host_evictable(nd):
                self._host_queue.push(nd)
            if nd.device is not None and self._is_evictable(nd):
                self._queue.push(nd)  # the last device node, above host-only ones, was stamped too
        branching = None
        if len(path) > end + 1:
            aligned = sum(map(self._tokens, path)) // self.mamba_cache_chunk_size * self.mamba_cache_chunk_size
            branching = aligned if aligned > 0 else None
        if cow and best >= 0 and not self._fork_into(last, params.req, dst):
            return self._empty_match()
        kv = [nd.device.value for nd in path[: best + 1]]
        indices = torch.cat(kv) if kv else self._empty_match().device_indices
        host_last = path[parked] if parked > best else last
        host_hit = sum(map(self._tokens, path[best + 1 : parked + 1])) if parked > best else 0
        return MatchResult(indices, last, host_last, host_hit_length=host_hit, mamba_branching_seqlen=branching)

    def insert(self, params: InsertParams, *legacy_args: Any) -> Any:
        """As ``MambaRadixCache.insert``; then the write policy's backups of the path's nodes (KV and
        state). If a backup raises, the insert stands, the node keeps no copy of what failed, and the
        error propagates."""
        self._due = []
        result = super().insert(params, *legacy_args)
        self._write_through()
        return result

    def cache_finished_req(self, req: Any, is_insert: bool = True, **kwargs: Any) -> None:
        """As ``MambaRadixCache.cache_finished_req``, then the write policy's backups (as ``insert``)."""
        self._due = []
        super().cache_finished_req(req, is_insert, **kwargs)
        self._write_through()

    def cache_unfinished_req(self, req: Any, chunked: bool = False, **kwargs: Any) -> None:
        """As ``MambaRadixCache.cache_unfinished_req``, then the write policy's backups (as ``insert``)."""
        self._due = []
        super().cache_unfinished_req(req, chunked, **kwargs)
        self._write_through()

    def evict(self, params: Union[EvictParams, int]) -> EvictResult:
        """Free at least ``num_tokens`` device KV tokens and, apart from that, at least ``mamba_num``
        device state slots, as far as there are. A device leaf (host-only nodes may hang below it)
        with a host KV copy moves to the host with its state (the state is backed up now if it has
        no host copy yet; under ``write_back`` the KV too); without room for its state it stays a
        host tombstone if it has children, else it leaves the tree like a leaf without a host copy,
        with the host-only nodes below it and the tombstones above it that become leaves. A state
        evicted from a node with device children leaves a tombstone, and its host copy goes too.
        A node the call moves to the host keeps its host copies until the call ends. Slots go back
        in one ``free`` per pool: device KV (after the call's backups have read their slots), then
        device states, host pages, host state slots. Returns both device counts.

        Raises
        ------
        ValueError
            As ``MambaRadixCache.evict``; nothing changes. If a backup or the allocator's ``free``
            raises, the nodes go back as they were (host-only leaves evicted for room stay evicted)
            and the error propagates; if a later ``free`` raises, the parts before it stand.
        """
        num, states = evict_counts(params, "HiMambaRadixCache", "it holds no sliding-window KV", "mamba_num", self.disable)
        out = Taken()
        undo = Undo()
        locked_leaves: list[TreeNode] = []
        count = 0
        try:
            while count < num:
                node = self._pop_evictable()
                if node is None:
                    break
                count += self._evict_node(node, out, undo)
            dropped = 0
            while dropped < states:
                node = self._mamba_queue.pop()
                if node is None:
                    break
                if not self._is_mamba_evictable(node):
                    continue
                if any(c.device is not None for c in node.children.values()):
                    out.states.append(self._forget_state(node, undo))  # a tombstone now, on both tiers
                    self._take_host_state(node, out, undo)
                elif node.device.lock_ref:
                    locked_leaves.append(node)  # a locked leaf keeps its state
                    continue
                else:
                    count += self._evict_node(node, out, undo)
                dropped += 1
            if out.backed_up:
                self.hybrid_host.wait_for_backups()  # the slots' next writers come after the reads
            if out.kv and self.token_to_kv_pool_allocator is not None:
                self.token_to_kv_pool_allocator.free(torch.cat(out.kv))
        except BaseException:
            undo.run()  # the nodes, snapshots and records go back; the call's backups are dropped
            raise
        finally:
            for copy in out.moved:
                copy.holds -= 1
            for node in locked_leaves:
                self._mamba_queue.push(node)
        for node in out.moved_nodes:  # a host tombstone whose children left for room while it was held
            if self.is_host_evictable(node) and HOST_STATE not in node.records and node.records[HOST].holds == 0:
                self._drop_host_leaf(node, out)
        if out.states:
            self.mamba_pool.free(torch.cat(out.states))
        self._free_host(out)
        return EvictResult(num_tokens_evicted=count, mamba_num_evicted=len(out.states))

    def hold_released(self, node: TreeNode) -> None:
        """A prefetch's hold kept ``node`` on the host while eviction took its children and its state:
        a host-only leaf without a state (a tombstone leaf) leaves the tree now, with the parents it
        leaves as such (``evict_host``'s rule)."""
        if self.is_host_evictable(node) and HOST_STATE not in node.records and node.records[HOST].holds == 0:
            out = Taken()
            self._drop_host_leaf(node, out)
            self._free_host(out)

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host tokens of unheld host-only leaves, with their host
        states, in the policy's order; a host-only parent left a leaf without a state goes too.
        Returns the host tokens freed. A device node without a state left without children by it
        stays until the next device eviction takes it."""
        num = non_negative_int(num_tokens, "num_tokens")
        out = Taken()
        protected: list[TreeNode] = []
        count = 0
        while count < num:
            node = self._host_queue.pop()
            if node is None:
                break
            if not self.is_host_evictable(node):
                continue
            if node.records[HOST].holds > 0:
                protected.append(node)
                continue
            count += self._drop_host_leaf(node, out)
        for node in protected:
            self._host_queue.push(node)
        self._free_host(out)
        return count

    def init_load_back(
        self, last_node: TreeNode, host_hit_length: int = 0, mem_quota: Optional[int] = None
    ) -> tuple[torch.Tensor, TreeNode]:
        """Device KV slots and state slots for the host-only nodes from ``last_node`` (a match's
        ``last_host_node``) up to its first ancestor on the device, all or none; the copies start at
        ``ready_to_load_host_cache()``.

        Returns
        -------
        (Tensor [L] int64, node): the device slots of the match's tokens after its ``device_indices``
        (the device tombstones' slots above the host part, then the new slots) and ``last_node``,
        whose state is on the device again; or an empty tensor and the node the device part of the
        match ends on, when the host part is below ``load_back_threshold``, beyond ``mem_quota``, or
        the device has no room for its KV or its states even after eviction. ``last_node`` stays
        locked until the load completes.

        Raises
        ------
        TypeError, ValueError
            If ``last_node`` is not a node of this tree, or is on the host only without a state.
        """
        if not isinstance(last_node, TreeNode):
            raise TypeError(f"init_load_back: last_node must be a TreeNode, got {type(last_node).__name__}")
        empty = self._empty_match().device_indices
        if last_node.device is not None:
            self._path(last_node, "init_load_back")
            return empty, last_node
        chain, node = [], last_node
        while node.device is None:
            if node.parent is None or node.parent.children.get(node.child_key) is not node:
                raise ValueError(f"init_load_back: last_node must be a node of this tree, got node {last_node.id}")
            chain.append(node)
            node = node.parent
        if HOST_STATE not in last_node.records:
            raise ValueError(
                f"init_load_back: last_node must have its state on the host (a match's last_host_node), got node "
                f"{last_node.id}, which has none"
            )
        chain.reverse()
        ancestor, served = node, [node]
        while served[-1] is not self.root_node and STATE not in served[-1].records:
            served.append(served[-1].parent)
        with_state = [n for n in chain if HOST_STATE in n.records]
        host_slots = torch.cat([n.records[HOST].slots for n in chain])
        total = len(host_slots)
        delta = self.inc_lock_ref(ancestor)  # nothing above the chain may go while room is made
        self.inc_lock_ref(served[-1])  # nor the state the device part ends on
        for n in chain:
            n.protect_host()  # nor the chain's host copies
        try:
            device = states = None
            if total >= self.load_back_threshold and (mem_quota is None or total <= mem_quota + delta):
                states = self._alloc_states(len(with_state))  # the states first: they are fewer to give back
                if states is not None:
                    device = self.alloc_device(total)
                    if device is None and len(states):
                        self.mamba_pool.free(states)
        finally:
            for n in chain:
                n.release_host()
            self.dec_lock_ref(served[-1])
            self.dec_lock_ref(ancestor)
        if device is None:
            return empty, served[-1]
        offset = 0
        for n in chain:
            tokens = len(n.records[HOST].slots)
            super()._refill(n, device[offset : offset + tokens])  # the host tier's: the parked state stays
            offset += tokens
        for i, n in enumerate(with_state):
            n.records[STATE] = StateSnapshot(states[i : i + 1].clone())
            self.mamba_evictable_size_ += 1
            if self._is_mamba_evictable(n):
                self._mamba_queue.push(n)
        self.inc_lock_ref(last_node)
        parked = [n.records[HOST_STATE].slot for n in with_state]
        state_host = torch.cat(parked) if parked else torch.empty(0, dtype=torch.int64)
        self._pending_loads.append((host_slots, device, state_host, states, last_node))
        above = [n.device.value for n in reversed(served[:-1])]  # device tombstones after the device part
        return torch.cat([*above, device]) if above else device, last_node

    def ready_to_load_host_cache(self) -> int:
        """Start every load ``init_load_back`` prepared, KV and states in one ``HybridPoolHost.load``;
        returns its number (-1 when there was none). The device pool's getters wait for each KV
        layer; the compute stream waits for the states' load before its next work."""
        if not self._pending_loads:
            return -1
        host = self.hybrid_host
        kv_host, kv_dev, state_host, state_dev = (torch.cat([p[i] for p in self._pending_loads]) for i in range(4))
        host.load(kv_host, kv_dev, state_host, state_dev, self.io_backend)
        host.state_host.wait_for_loads()
        event = None
        if host.kv_host.load_stream is not None:
            event = torch.cuda.Event()
            event.record(host.kv_host.load_stream)
        self.ongoing_load_back.extend((p[4], event) for p in self._pending_loads)
        self._pending_loads = []
        self._loads_started += 1
        return self._loads_started - 1

    # --- internals ------------------------------------------------------------------------------

    def _tokens(self, node: TreeNode) -> int:
        return len(node.device.value) if node.device is not None else len(node.records[HOST].slots)

    def _reset_host(self) -> None:
        super()._reset_host()  # the KV host pool (the hybrid host's kv_host) first
        self._due: list[TreeNode] = []
        self._chunked = False
        self.hybrid_host.state_host.clear()

    def _insert(self, enc: bytes, n: int, value: torch.Tensor, priority: int, extra: Any) -> tuple[int, TreeNode]:
        """As the tree's, noting the path's device nodes without a host copy for the write policy."""
        self._dropped = []
        cached, last = super()._insert(enc, n, value, priority, extra)
        if self._dropped:
            self.mamba_pool_host.free(torch.cat(self._dropped))
        if self.write_policy != "write_back" and not self._chunked:
            node = last
            while node is not self.root_node:
                self._due.append(node)
                node = node.parent
        return cached, last

    def _run_state_insert(self, job: Any, state: Optional[torch.Tensor]) -> Any:
        self._chunked = job.chunked  # a chunk's pages are not backed up (as HiRadixCache's)
        return super()._run_state_insert(job, state)

    def _refill(self, node: TreeNode, slots: torch.Tensor) -> None:
        """An insert gives a host-only node the caller's slots: it is on the device again without a
        state there, so its parked state goes (the insert's own state may take its place)."""
        super()._refill(node, slots)
        parked = node.records.pop(HOST_STATE, None)
        if parked is not None:
            self._dropped.append(parked.slot)

    def _write_through(self) -> None:
        """The write policy's backups after an insert: each node of its path that is on the device
        without a host copy counts a hit, and is backed up (KV, then its state) when its hits reach
        the policy's threshold; a node with a host copy and a state without one gets the state's."""
        due, self._due = self._due, []
        for node in reversed(due):  # the root side first
            if node.device is None or node.parent is None or node.parent.children.get(node.child_key) is not node:
                continue  # left the device or the tree since
            if HOST not in node.records:
                node.hit_count += 1
                if node.hit_count < self.write_through_threshold or self.write_backup(node) == 0:
                    continue
            if STATE in node.records and HOST_STATE not in node.records:
                self._back_up_state(node, lock=True)

    def _alloc_states(self, k: int) -> Optional[torch.Tensor]:
        """``k`` device state slots (an empty tensor for 0), evicting states for room; None if not."""
        pool = self.mamba_pool
        if k == 0:
            return torch.empty(0, dtype=torch.int64, device=pool.device)
        slots = pool.alloc(k)
        if slots is None:
            self.evict(EvictParams(num_tokens=0, mamba_num=k - pool.available_size()))
            slots = pool.alloc(k)
        return None if slots is None else slots.to(torch.int64)
