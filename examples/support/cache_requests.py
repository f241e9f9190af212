"""What the examples' schedulers on a prefix cache share (support/sim/prefix.py, support/runners/prefix.py): the
attributes the cache reads and writes on a request, under SGLang's ``Req`` names
(``kvpool.cache.requests``), and the request-table calls around it: a row with its state slots, the
room the tree gives up, a hybrid request's state copied into its track slot, and a match that
fetches from a storage tier first."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from kvpool.cache import EvictParams, MatchPrefixParams, RadixCache
from kvpool.pools.hybrid_req_pool import HybridReqToTokenPool


#: Seconds an admission waits for its prefetch from storage before the run is called stuck.
PREFETCH_WAIT_S = 60.0


@dataclass(kw_only=True, eq=False)
class CacheRequest:
    """Mixed into a request dataclass with ``row`` (its table row) and ``kv_len`` (its tokens with
    K/V); the request adds ``origin_input_ids``, ``output_ids`` and ``fill_ids``."""

    last_node: Any = None  # the node its cached prefix ends on, locked while it runs
    cache_protected_len: int = 0  # its leading slots that belong to the tree
    prefix_indices: Optional[torch.Tensor] = None
    mamba_pool_idx: Optional[torch.Tensor] = None  # a hybrid model's state slot, and its track slots
    mamba_ping_pong_track_buffer: Optional[torch.Tensor] = None
    mamba_next_track_idx: int = 0
    mamba_last_track_seqlen: Optional[int] = None

    @property
    def req_pool_idx(self) -> Optional[int]:
        return self.row  # type: ignore[attr-defined]

    @req_pool_idx.setter
    def req_pool_idx(self, row: Optional[int]) -> None:
        self.row = row

    @property
    def kv_committed_len(self) -> int:
        return self.kv_len  # type: ignore[attr-defined]

    @property
    def kv_allocated_len(self) -> int:
        return self.kv_len  # type: ignore[attr-defined]


def take_row(table: Any, cache: RadixCache, r: Any) -> bool:
    """A row of ``table`` for ``r`` (from a ``HybridReqToTokenPool`` with its state and track slots,
    the tree giving snapshots up for them); False, nothing taken, when there is none."""
    if not table.free_slots:
        return False
    if not isinstance(table, HybridReqToTokenPool):
        r.row = table.alloc(1)[0]
        return True
    if table.alloc([r]) is None:
        cache.evict(EvictParams(mamba_num=1 + table.track_slots_per_request))
        if table.alloc([r]) is None:
            return False
    return True


def give_back_row(table: Any, r: Any) -> None:
    """Undo ``take_row``."""
    if isinstance(table, HybridReqToTokenPool) and r.mamba_pool_idx is not None:
        table.free_mamba_cache(r)
    table.free(r.row)
    r.row = None


def make_room(cache: RadixCache, allocator: Any, tokens: int) -> None:
    """Evict from the tree what ``allocator`` lacks of ``tokens`` free slots (an ``SWARadixCache``:
    what each part lacks, full KV from leaves and SWA KV from any unlocked node)."""
    if cache.supports_swa():
        full, swa = tokens - allocator.full_available_size(), tokens - allocator.swa_available_size()
        if full > 0 or swa > 0:
            cache.evict(EvictParams(num_tokens=max(full, 0), swa_num_tokens=max(swa, 0)))
        return
    short = tokens - allocator.available_size()
    if short > 0:
        cache.evict(EvictParams(num_tokens=short))


def track(table: HybridReqToTokenPool, reqs: Sequence[Any], lengths: Sequence[int], slots: torch.Tensor) -> None:
    """Each request's state (in ``slots``, [len(reqs)] int64 on the device) is the state after its
    first ``lengths[i]`` tokens: copy it into its next track slot, for the cache to take."""
    dst = [table.track_slots(r.row)[r.mamba_next_track_idx] for r in reqs]
    table.mamba_pool.copy_from(slots, torch.tensor(dst, dtype=torch.int64, device=slots.device))
    for r, n in zip(reqs, lengths):
        r.mamba_last_track_seqlen = n
        r.mamba_next_track_idx = table.get_mamba_ping_pong_other_idx(r.mamba_next_track_idx)


def match_with_storage(cache: Any, rid: Any, params: MatchPrefixParams) -> tuple[Any, int]:
    """``params``' match and the tokens fetched from storage for it. With a storage tier, what
    follows the match's host part is prefetched first (the request waits for every page, as under
    SGLang's ``wait_complete``) and the key matched again; otherwise (0 fetched) the plain match."""
    m = cache.match_prefix(params)
    if not getattr(cache, "enable_storage", False):
        return m, 0
    node, depth = m.last_host_node, 0
    while node is not cache.root_node:
        depth, node = depth + len(node.key), node.parent
    cache.prefetch_from_storage(rid, m.last_host_node, list(params.key.token_ids[depth:]))
    deadline = time.monotonic() + PREFETCH_WAIT_S
    while not cache.check_prefetch_progress(rid):
        if time.monotonic() > deadline:
            raise RuntimeError(f"request {rid}'s prefetch from storage did not finish within {PREFETCH_WAIT_S} s")
        time.sleep(0.0005)
    fetched = cache.pop_prefetch_loaded_tokens(rid)
    return (cache.match_prefix(params) if fetched else m), fetched
