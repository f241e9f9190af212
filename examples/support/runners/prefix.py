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
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from kvpool.cache import CacheInitParams, EvictParams, MambaRadixCache, MatchPrefixParams, RadixCache, RadixKey
from kvpool.pools.hybrid_req_pool import HybridReqToTokenPool
from support import cache_requests


def caching(scheduler_cls: type) -> type:
    """``scheduler_cls`` on a prefix cache."""
    return type(f"Caching{scheduler_cls.__name__}", (PrefixCaching, scheduler_cls), {})


class PrefixCaching:
    """Mixed into support.runners.scheduler's ``Scheduler`` (or a subclass): the prefix cache's admission,
    insertion, eviction and release. ``prompt_tokens`` and ``cached_tokens`` count what admitted
    requests needed and what the tree held of it."""

    def __init__(self, pool: Any, *args: Any, **kwargs: Any) -> None:
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
        self.cache = MambaRadixCache(params, mamba_cache_chunk_size=self.page_size) if self.hybrid else RadixCache(params)
        self.prompt_tokens = 0
        self.cached_tokens = 0

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
        self.peak_running = max(self.peak_running, len(self.running))
        return out

    def _match(self, r: Any, free: int) -> Optional[int]:
        """Admit ``r`` on its cached prefix if its pages fit in ``free``: returns the pages it takes
        (those it will fill, and those the match locked), or None with nothing held."""
        if not cache_requests.take_row(self.table, self.cache, r):
            return None
        room = self.room()
        key = RadixKey(r.prompt[:-1])
        m = self.cache.match_prefix(MatchPrefixParams(key=key, cow_mamba=self.hybrid, req=r if self.hybrid else None))
        self.cache.inc_lock_ref(m.last_device_node)
        start = m.device_indices.numel()
        need = self.pages(r.final_kv_len) - start // self.page_size + (room - self.room()) // self.page_size
        if need > free:
            self.cache.dec_lock_ref(m.last_device_node)
            cache_requests.give_back_row(self.table, r)
            return None
        if start:
            self.table.write((r.row, slice(0, start)), m.device_indices.to(torch.int32))
        r.kv_len, r.cache_protected_len, r.prefix_indices = start, start, m.device_indices
        r.last_node, r.mamba_last_track_seqlen = m.last_device_node, None
        self.prompt_tokens += len(r.prompt)
        self.cached_tokens += start
        return need

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
        """Tree, allocator, request table and running requests together (``IntegrityError``)."""
        self.cache.check_integrity(self.running)

    def leaked_slots(self) -> int:
        """Empty the tree, then count the slots still held."""
        if self.hybrid:
            self.cache.evict(EvictParams(num_tokens=self.cache.evictable_size(), mamba_num=self.cache.mamba_evictable_size()))
        else:
            self.cache.evict(EvictParams(num_tokens=self.cache.evictable_size()))
        return self.settled_slots_in_use()
