"""The sliding-window runners' scheduler on a prefix cache (``--prefix-cache``): ``SWAScheduler``
(support.runners.gemma3_model) over an ``SWARadixCache``, as ``support.runners.prefix`` does it for
a ``RadixCache``.

Admission matches each prompt but its last token against the tree (a match ends where the last
window of its tokens has SWA KV), locks the match (``swa_uuid_for_lock``), writes its slots into the
request's row and prefills only the rest. Every prefill step's whole pages go into the tree
(``cache_unfinished_req``), finished requests too (``cache_finished_req``: pages whose SWA part the
request gave back go in as tombstones). An allocation that finds a part short evicts from the tree:
full KV from leaves, SWA KV from any unlocked node (which becomes a tombstone, its full KV kept).

After every step each running request gives back, with ``free_swa``, the SWA part of its own whole
pages (from ``cache_protected_len`` on) before the last window of its whole pages, and records it in
``swa_evicted_seqlen``: it keeps the SWA KV of the last window of what the tree can take of it, so
its cached tail has a whole window and a later match can end there (a request that kept only its
live window, SGLang's plain rule, would leave at pages above one token a tail shorter than the
window). Every step ends with the cache's ``check_integrity`` over the running requests (tree,
allocator and table), and a check that the SWA part holds no more than a window and a page of each
running request's own plus what the tree holds.

Admission reserves, per running request, its full pages and the SWA pages it keeps alive at once
(``cached_swa_pages``: its own and those its lock holds in the tree), so an allocation always finds
what it lacks among the free and the evictable slots.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from kvpool.cache import CacheInitParams, EvictParams, MatchPrefixParams, RadixKey, SWARadixCache
from kvpool.errors import IntegrityError
from support import cache_requests
from support.runners.gemma3_model import SWAScheduler, cached_swa_pages


def swa_caching() -> type:
    """``SWAScheduler`` on an ``SWARadixCache``."""
    return type("CachingSWAScheduler", (SWAPrefixCaching, SWAScheduler), {})


def window_tokens(cache: SWARadixCache, node: Any) -> int:
    """The tokens a lock of ``node`` holds SWA KV for: whole nodes from ``node`` towards the root
    until the window is covered."""
    held = 0
    while node is not cache.root_node and held < cache.sliding_window_size:
        held += len(node.value)
        node = node.parent
    return held


def release_span(r: Any, window: int, page_size: int) -> tuple[int, int]:
    """The positions ``[start, end)`` of running request ``r`` whose SWA part it gives back now: its
    own (from ``cache_protected_len``) not given back yet (from ``swa_evicted_seqlen``), up to the
    last window of its whole pages (page-aligned)."""
    start = max(r.swa_evicted_seqlen, r.cache_protected_len)
    return start, max(start, r.kv_len // page_size * page_size - window) // page_size * page_size


class SWAPrefixCaching:
    """Mixed into ``SWAScheduler``: the ``SWARadixCache``'s admission, insertion, eviction and
    release. ``prompt_tokens`` and ``cached_tokens`` count what admitted requests needed and what the
    tree held of it; ``full_evicted`` and ``swa_evicted`` what allocations evicted from each part;
    ``tombstoned_nodes`` and ``tombstoned_tokens`` the live nodes those evictions made tombstones (SWA
    KV freed, full KV kept); ``tombstones_peak`` and ``tombstone_tokens_peak`` the most tombstones
    (and their tokens) the tree held at a step's end, those of finished requests' own freed pages
    included."""

    swa_bound_rule = "a window and a page of its own each, and the SWA KV the tree holds"

    def __init__(self, pools: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(pools, *args, **kwargs)  # type: ignore[call-arg]
        self.cache = SWARadixCache(CacheInitParams(
            disable=False, req_to_token_pool=self.table, token_to_kv_pool_allocator=self.allocator,
            page_size=self.page_size, sliding_window_size=self.window,
        ))  # fmt: skip
        self.prompt_tokens = self.cached_tokens = 0
        self.full_evicted = self.swa_evicted = 0
        self.tombstones_peak = self.tombstone_tokens_peak = 0
        self.tombstoned_nodes = self.tombstoned_tokens = 0  # live nodes the evictions made tombstones
        self.locked: dict[int, int] = {}  # rid -> tokens its admission's lock holds SWA KV for
        self.prefilled: list[Any] = []  # the requests of the step being advanced, if a prefill

    # --- admission ------------------------------------------------------------------------------

    def step_tokens(self, r: Any) -> int:
        return max(min(len(r.prompt), self.chunk_size or len(r.prompt)), self.verify_width or 1)

    def swa_pages(self, r: Any) -> int:
        return cached_swa_pages(self.window, self.page_size, self.step_tokens(r), len(r.prompt), r.final_kv_len,
                                self.locked.get(r.rid, 0))  # fmt: skip

    def full_room(self) -> int:
        return self.allocator.full_available_size() + self.cache.full_evictable_size()

    def _admit(self) -> list:
        p = self.page_size
        free = self.full_room() // p - sum(self.pages(r.final_kv_len) - self.pages(r.kv_len) for r in self.running)
        swa_free = self.swa_capacity // p - sum(self.swa_pages(r) for r in self.running)
        out = []
        while self.waiting:
            taken = self._match(self.waiting[0], free, swa_free)
            if taken is None:
                break
            r = self.waiting.popleft()
            self.running.append(r)
            out.append(r)
            free -= taken[0]
            swa_free -= taken[1]
        self.peak_running = max(self.peak_running, len(self.running))
        return out

    def _match(self, r: Any, free: int, swa_free: int) -> Optional[tuple[int, int]]:
        """Admit ``r`` on its cached prefix if its pages fit: returns the full and SWA pages it
        takes, or None with nothing held."""
        if not cache_requests.take_row(self.table, self.cache, r):
            return None
        room = self.full_room()
        m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(r.prompt[:-1])))
        node, indices = m.last_device_node, m.device_indices
        start = indices.numel()
        locked = window_tokens(self.cache, node)
        uuid = self.cache.inc_lock_ref(node)
        need = self.pages(r.final_kv_len) - start // self.page_size + (room - self.full_room()) // self.page_size
        swa_need = cached_swa_pages(self.window, self.page_size, self.step_tokens(r), len(r.prompt), r.final_kv_len, locked)
        if need > free or swa_need > swa_free:
            self.cache.dec_lock_ref(node, uuid)
            cache_requests.give_back_row(self.table, r)
            return None
        if start:
            self.table.write((r.row, slice(0, start)), indices.to(torch.int32))
        r.kv_len, r.cache_protected_len, r.prefix_indices, r.last_node = start, start, indices, node
        r.swa_uuid_for_lock, r.swa_evicted_seqlen = uuid, 0
        self.locked[r.rid] = locked
        self.prompt_tokens += len(r.prompt)
        self.cached_tokens += start
        return need, swa_need

    # --- allocation -----------------------------------------------------------------------------

    def make_room(self, tokens: int) -> None:
        """Evict from the tree what either part lacks of ``tokens`` free slots."""
        a = self.allocator
        full, swa = tokens - a.full_available_size(), tokens - a.swa_available_size()
        if full <= 0 and swa <= 0:
            return
        live = {n.id for n in self.nodes() if not n.swa_tombstone} if swa > 0 else set()
        res = self.cache.evict(EvictParams(num_tokens=max(full, 0), swa_num_tokens=max(swa, 0)))
        self.full_evicted += res.num_tokens_evicted
        self.swa_evicted += res.swa_num_tokens_evicted
        for n in self.nodes() if live else ():
            if n.swa_tombstone and n.id in live:
                self.tombstoned_nodes += 1
                self.tombstoned_tokens += len(n.value)

    def nodes(self) -> list[Any]:
        """The tree's nodes but the root."""
        out, stack = [], list(self.cache.root_node.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def alloc_extend(self, reqs: Any, counts: Any) -> torch.Tensor:
        grow = sum(self.pages(r.kv_len + n) - self.pages(r.kv_len) for r, n in zip(reqs, counts))
        self.make_room(grow * self.page_size)
        return super().alloc_extend(reqs, counts)  # type: ignore[misc]

    def _decode(self, reqs: list) -> Any:
        self.make_room(sum(1 for r in reqs if r.kv_len % self.page_size == 0) * self.page_size)
        return super()._decode(reqs)  # type: ignore[misc]

    # --- after a step ---------------------------------------------------------------------------

    def advance(self, batch: Any, logits: torch.Tensor, keep_logits: bool) -> None:
        self.prefilled = list(batch.requests) if batch.is_prefill else []
        super().advance(batch, logits, keep_logits)  # type: ignore[misc]  # finishes, then _release_windows

    def finish(self, done: Any) -> None:
        """Finished requests' pages go into the tree, which frees what it held already."""
        self.allocator.free_group_begin()
        for r in done:
            self.cache.cache_finished_req(r)
            self.table.free(r.row)
            r.row = None
            self.running.remove(r)
            self.locked.pop(r.rid, None)
        self.allocator.free_group_end()
        self.finished.extend(done)

    def _release_windows(self) -> None:
        """The step's prefill goes into the tree; each running request gives back the SWA part of its
        own whole pages before the last window of its whole pages; then the step's checks."""
        for r in self.prefilled:
            if r.row is not None:
                self.cache.cache_unfinished_req(r, chunked=r.prefilling)
        self.prefilled = []
        a, p = self.allocator, self.page_size
        a.free_group_begin()
        for r in self.running:
            start, end = release_span(r, self.window, p)
            if end > start:
                a.free_swa(self.table.req_to_token[r.row, start:end].to(torch.int64))
                r.swa_evicted_seqlen = end
        a.free_group_end()
        self._count_tombstones()
        self._end_of_step()  # type: ignore[attr-defined]

    def _count_tombstones(self) -> None:
        tombs = [n for n in self.nodes() if n.swa_tombstone]
        count, tokens = len(tombs), sum(len(n.value) for n in tombs)
        self.tombstones_peak = max(self.tombstones_peak, count)
        self.tombstone_tokens_peak = max(self.tombstone_tokens_peak, tokens)

    def swa_bound(self) -> int:
        p = self.page_size
        own = -(-self.window // p) + 1  # pages: the last window of its whole pages and the partial one after
        return len(self.running) * own * p + self.cache.total_size()[1]

    def _check_windows(self) -> None:
        """The cache's check over the running requests (tree, allocator, table; each request's last
        window with SWA KV), and no request maps a token of its own whose SWA slot it gave back."""
        self.cache.check_integrity(self.running)
        problems = []
        for r in self.running:
            lo, hi = r.cache_protected_len, r.swa_evicted_seqlen
            if hi > lo:
                full = self.table.req_to_token[r.row, lo:hi].to(torch.int64)
                if bool((self.allocator.translate_loc_from_full_to_swa(full) != 0).any()):
                    problems.append(f"request {r.rid} still maps a token whose SWA slot it gave back")
        if problems:
            raise IntegrityError("; ".join(problems))

    def check_integrity(self) -> None:
        """The step checks' first failure, then tree, allocator, request table and running requests
        together (``IntegrityError``)."""
        if self.step_error is not None:  # type: ignore[attr-defined]
            raise IntegrityError(self.step_error)  # type: ignore[attr-defined]
        self.cache.check_integrity(self.running)

    def leaked_slots(self) -> int:
        """Empty the tree, then count the slots of both parts still held."""
        self.cache.evict(EvictParams(num_tokens=self.cache.full_evictable_size(), swa_num_tokens=self.cache.swa_evictable_size()))
        return self.settled_slots_in_use()

    @property
    def memory(self) -> dict[str, int]:
        m = dict(super().memory)  # type: ignore[misc]
        m.update(
            cache_full_evicted=self.full_evicted, cache_swa_evicted=self.swa_evicted,
            tombstones_peak=self.tombstones_peak, tombstone_tokens_peak=self.tombstone_tokens_peak,
            tombstoned_nodes=self.tombstoned_nodes, tombstoned_tokens=self.tombstoned_tokens,
        )  # fmt: skip
        return m
