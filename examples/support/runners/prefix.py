"""The model runners' scheduler on a prefix cache (``--prefix-cache``): requests that share a prompt
prefix compute it once.

``caching(scheduler_cls)`` mixes ``PrefixCaching`` into support.runners.scheduler's ``Scheduler`` (a
``RadixCache`` over its allocator and request table) or qwen35_runner's ``HybridScheduler`` (a
``MambaRadixCache``, whose nodes carry the linear layers' state snapshots). Admission matches each
prompt but its last token (which must be computed for the first new token's logits) against the
tree, locks the match, writes its slots into the request's row and prefills only the rest, attending
over the matched rows; a hybrid request's state slot gets a copy of the snapshot at the match's end,
so a match ends only where a snapshot is. Every prefill step's whole pages go into the tree
(``cache_unfinished_req``), finished requests too (``cache_finished_req``), and allocations evict
from the tree when the pool is short.

With pages above one token a hybrid request's state is known only where a step ends, so its prefill
chunks end at page boundaries (a prompt's last partial page is a chunk of its own) and after each
step that ends on a boundary (prefill or decode) the state is copied into the request's next track
slot (SGLang's ``mamba_ping_pong_track_buffer``): the snapshots the tree caches.

With a ``HostTier`` (``--host-tier``) the cache is a ``HiRadixCache`` over a host pool: inserted
nodes are backed up to host memory (``write_through``), evicted ones live on there, and a match that
reaches them loads them back to the device before the step's forward reads them. With a storage
backend on it (``--storage``) host copies are written through to storage too, and each admission
first prefetches what follows its match's host part from storage (held until every page is read),
so another engine over the same store serves a prefix it never computed: storage -> host -> device.
For a hybrid model the tiered cache is a ``HiMambaRadixCache`` over a ``HybridPoolHost``: a node's
KV pages and its state snapshot are backed up, parked, written through to storage and loaded back
together (a prefix comes from storage only as far as a state stored with it), and after the load
the request matches again with ``cow_mamba`` to fork the loaded state into its slot. The tiered
hybrid scheduler checks the cache's integrity after every step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch

from kvpool.cache import (
    CacheInitParams, EvictParams, HiMambaRadixCache, HiRadixCache, MambaRadixCache, MatchPrefixParams, RadixCache, RadixKey,
)  # fmt: skip
from kvpool.cache.himamba_host import HOST_STATE
from kvpool.host import HybridPoolHost, MHATokenToKVPoolHost
from kvpool.pools.hybrid_req_pool import HybridReqToTokenPool
from support import cache_requests
from support.storage import storage_policy

@dataclass(frozen=True)
class HostTier:
    """The prefix cache's tiers below the device: ``host_ratio`` host slots per device slot in
    ``layout``, and a storage backend below them (a ``kvpool.storage.HiCacheStorage``, or None)."""

    host_ratio: float = 2.0
    layout: str = "layer_first"
    storage: Any = None


def caching(scheduler_cls: type) -> type:
    """``scheduler_cls`` on a prefix cache."""
    return type(f"Caching{scheduler_cls.__name__}", (PrefixCaching, scheduler_cls), {})


class PrefixCaching:
    """Mixed into support.runners.scheduler's ``Scheduler`` (or a subclass): the prefix cache's admission,
    insertion, eviction and release. ``prompt_tokens`` and ``cached_tokens`` count what admitted
    requests needed and what the tree held of it (loaded back from the host tier included:
    ``host_loaded_tokens``, of which ``storage_loaded_tokens`` had been fetched from storage for it;
    for a hybrid model ``host_loaded_states``, the state snapshots loaded back with them)."""

    def __init__(self, pool: Any, *args: Any, tiers: Optional[HostTier] = None, **kwargs: Any) -> None:
        super().__init__(pool, *args, **kwargs)  # type: ignore[call-arg]
        self.hybrid = isinstance(self.table, HybridReqToTokenPool)
        self.tracks = self.hybrid and self.page_size > 1
        params = CacheInitParams(
            disable=False, req_to_token_pool=self.table, token_to_kv_pool_allocator=self.allocator,
            page_size=self.page_size, enable_mamba_extra_buffer=self.tracks,
        )  # fmt: skip
        if self.hybrid and self.tracks != self.table.enable_mamba_extra_buffer:
            raise ValueError(
                f"a hybrid prefix cache with page_size {self.page_size} needs a request table with "
                f"enable_mamba_extra_buffer={self.tracks} (track slots), got {self.table.enable_mamba_extra_buffer}"
            )
        if tiers is None:
            self.cache = MambaRadixCache(params, mamba_cache_chunk_size=self.page_size) if self.hybrid else RadixCache(params)
        elif self.hybrid:
            host = HybridPoolHost(self.allocator.get_kvcache(), tiers.host_ratio, 0, self.page_size, tiers.layout)
            policy = storage_policy(self.page_size) if tiers.storage is not None else None
            self.cache = HiMambaRadixCache(params, host_pool=host, write_policy="write_through", load_back_threshold=0,
                                           storage=tiers.storage, storage_policy=policy,
                                           mamba_cache_chunk_size=self.page_size)  # fmt: skip
        else:
            host = MHATokenToKVPoolHost(pool, tiers.host_ratio, 0, self.page_size, tiers.layout)
            policy = storage_policy(self.page_size) if tiers.storage is not None else None
            self.cache = HiRadixCache(params, host_pool=host, write_policy="write_through", load_back_threshold=0,
                                      storage=tiers.storage, storage_policy=policy)  # fmt: skip
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.host_loaded_tokens = 0
        self.storage_loaded_tokens = 0
        self.host_loaded_states: Optional[int] = 0 if self.hybrid else None
        self.step_integrity_error: Optional[str] = None  # the first failed check after a step (tiered hybrid)
        self.steps_checked = 0
        self.fetched: dict[int, int] = {}  # per waiting request: tokens fetched from storage for it
        self.storage_drained = True
        self.storage_stats: dict[str, int] = {}

    @property
    def tiered(self) -> bool:
        return isinstance(self.cache, (HiRadixCache, HiMambaRadixCache))

    def schedule(self) -> Any:
        if self.tiered:
            self.cache.check_hicache_events()  # unlock finished backups and loads, write host copies through
        return super().schedule()  # type: ignore[misc]

    def room(self) -> int:
        return self.allocator.available_size() + self.cache.evictable_size()

    def _admit(self) -> list:
        free = self.room() // self.page_size
        free -= sum(self.pages(r.final_kv_len) - self.pages(r.kv_len) for r in self.running)
        out = []
        while self.waiting:
            r = self.waiting[0]
            matched = self._match(r, free)
            if matched is None:
                break
            self.waiting.popleft()
            self.running.append(r)
            out.append(r)
            free -= matched
        if self.tiered:
            self.cache.ready_to_load_host_cache()  # the device pool's getters wait for each layer's load
        self.peak_running = max(self.peak_running, len(self.running))
        return out

    def _match(self, r: Any, free: int) -> Optional[int]:
        """Admit ``r`` on its cached prefix if its pages fit in ``free``: returns the pages it takes
        (those it will fill, and those the match locked), or None with nothing held."""
        if not cache_requests.take_row(self.table, self.cache, r):
            return None
        room = self.room()
        key = RadixKey(r.prompt[:-1])
        params = MatchPrefixParams(key=key, cow_mamba=self.hybrid, req=r if self.hybrid else None)
        m, fetched = cache_requests.match_with_storage(self.cache, r.rid, params)
        self.fetched[r.rid] = self.fetched.get(r.rid, 0) + fetched  # a refused admission loads them when retried
        node, indices, loaded = m.last_device_node, m.device_indices, 0
        self.cache.inc_lock_ref(node)
        if self.tiered and m.host_hit_length:  # as SGLang's PrefillAdder: load back under the device prefix's lock
            states = self._parked_states(m.last_host_node) if self.hybrid else 0
            slots, loaded_node = self.cache.init_load_back(m.last_host_node, m.host_hit_length)
            if slots.numel():
                self.cache.dec_lock_ref(node)
                self.cache.inc_lock_ref(loaded_node)
                node, indices, loaded = loaded_node, torch.cat((indices, slots)), slots.numel()
                if self.hybrid:
                    self._fork_loaded(params, node, indices)
                    self.host_loaded_states += states  # type: ignore[operator]
        start = indices.numel()
        need = self.pages(r.final_kv_len) - start // self.page_size + (room - self.room()) // self.page_size
        if need > free:  # the loaded nodes stay in the tree, on the device
            self.cache.dec_lock_ref(node)
            cache_requests.give_back_row(self.table, r)
            return None
        if start:
            self.table.write((r.row, slice(0, start)), indices.to(torch.int32))
        r.kv_len, r.cache_protected_len, r.prefix_indices = start, start, indices
        r.last_node, r.mamba_last_track_seqlen = node, None
        self.prompt_tokens += len(r.prompt)
        self.cached_tokens += start
        self.host_loaded_tokens += loaded
        self.storage_loaded_tokens += min(self.fetched.pop(r.rid, 0), loaded)
        return need

    def _parked_states(self, node: Any) -> int:
        """The state snapshots parked on the host from ``node`` (a match's ``last_host_node``) up to
        its first ancestor on the device: those ``init_load_back`` loads with the KV."""
        n = 0
        while node.device is None:
            n += HOST_STATE in node.records
            node = node.parent
        return n

    def _fork_loaded(self, params: MatchPrefixParams, node: Any, indices: torch.Tensor) -> None:
        """Start the prepared loads and fork the loaded state into the request's slot: a second
        match with ``cow_mamba``, which must now end on ``node`` with ``indices``."""
        self.cache.ready_to_load_host_cache()
        again = self.cache.match_prefix(params)
        if again.last_device_node is not node or not torch.equal(again.device_indices, indices):
            raise RuntimeError(
                f"the match after a load back must end on the loaded node {node.id} with {indices.numel()} slots, got "
                f"node {again.last_device_node.id} with {again.device_indices.numel()}"
            )

    def _chunk(self, r: Any, budget: int) -> int:
        n = super()._chunk(r, budget)  # type: ignore[misc]
        if self.tracks:  # end on the last page boundary passed: the state there is tracked
            boundary = (r.kv_len + n) // self.page_size * self.page_size
            if boundary > r.kv_len:
                n = boundary - r.kv_len
        return n

    def alloc_extend(self, reqs: Any, counts: Any) -> torch.Tensor:
        grow = sum(self.pages(r.kv_len + n) - self.pages(r.kv_len) for r, n in zip(reqs, counts))
        cache_requests.make_room(self.cache, self.allocator, grow * self.page_size)
        return super().alloc_extend(reqs, counts)  # type: ignore[misc]

    def _decode(self, reqs: list) -> Any:
        need = sum(1 for r in reqs if r.kv_len % self.page_size == 0) * self.page_size
        cache_requests.make_room(self.cache, self.allocator, need)
        return super()._decode(reqs)  # type: ignore[misc]

    def advance(self, batch: Any, logits: torch.Tensor, keep_logits: bool) -> None:
        """Track the states of requests whose step ended on a page boundary, advance (finished
        requests go into the tree), then put every still running request's prefill into the tree."""
        if self.tracks:
            self._track(batch)
        super().advance(batch, logits, keep_logits)  # type: ignore[misc]
        if batch.is_prefill:
            for r in batch.requests:
                if r.row is not None:
                    self.cache.cache_unfinished_req(r, chunked=r.prefilling)
        if self.tiered and self.hybrid and self.step_integrity_error is None:
            try:
                self.check_integrity()
            except RuntimeError as e:  # kept for the end of the serve, which reports it
                self.step_integrity_error = f"after step {self.steps_checked + 1}: {e}"
            self.steps_checked += 1

    def _track(self, batch: Any) -> None:
        at = [i for i, (r, n) in enumerate(zip(batch.requests, batch.counts)) if (r.kv_len + n) % self.page_size == 0]
        if at:
            slots = batch.state_slots[torch.tensor(at, device=batch.state_slots.device)]
            reqs = [batch.requests[i] for i in at]
            cache_requests.track(self.table, reqs, [r.kv_len + batch.counts[i] for i, r in zip(at, reqs)], slots)

    def finish(self, done: Any) -> None:
        """Finished requests' pages (and states) go into the tree, which frees what it held already."""
        self.allocator.free_group_begin()
        for r in done:
            self.cache.cache_finished_req(r)
            self.table.free(r.row)
            r.row = None
            self.running.remove(r)
        self.allocator.free_group_end()
        self.finished.extend(done)

    def check_integrity(self) -> None:
        """Tree, allocator, request table and running requests together (``IntegrityError``); with
        the tiered hybrid cache also the first failure after a step."""
        if self.step_integrity_error is not None:
            raise RuntimeError(self.step_integrity_error)
        self.cache.check_integrity(self.running)

    def leaked_slots(self) -> int:
        """Empty the tree (with a host tier: once storage has every write, and the host too), then
        count the slots still held (host slots included)."""
        if self.tiered:
            return self._empty_tiers()
        if self.hybrid:
            self.cache.evict(EvictParams(num_tokens=self.cache.evictable_size(), mamba_num=self.cache.mamba_evictable_size()))
        else:
            self.cache.evict(EvictParams(num_tokens=self.cache.evictable_size()))
        return self.settled_slots_in_use()

    def _empty_tiers(self) -> int:
        cache = self.cache
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # every backup and load done: their nodes unlock
        cache.check_hicache_events()
        tier = cache.storage_tier
        if tier is not None:
            self.storage_drained = tier.drain()  # the next engine over this store reads every page written
            tier.close()
            self.storage_stats = dataclasses.asdict(tier.stats)
        if self.hybrid:
            cache.evict(EvictParams(num_tokens=cache.evictable_size(), mamba_num=cache.mamba_evictable_size()))
        else:
            cache.evict(EvictParams(num_tokens=cache.evictable_size()))
        held = self.settled_slots_in_use()
        host = cache.token_to_kv_pool_host
        cache.evict_host(host.size)
        held += host.size - host.available_size()
        if self.hybrid:
            states = cache.mamba_pool_host
            held += states.size - states.available_size()
        return held
