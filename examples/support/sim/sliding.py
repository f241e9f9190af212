"""``serve_sim --model gemma3`` and ``--model gpt-oss``: the simulation on sliding-window pools.

Layer ``i`` is full attention when ``(i + 1) % N == 0`` (``SWA_MODELS``: Gemma 3's N = 6, five local
layers to one global; gpt-oss's N = 2, sliding and full alternating); the others attend over a
sliding window of the last ``--sliding-window`` tokens. Their K/V go into an ``SWAKVPool``: the
sliding layers' in its SWA part, the full layers' in its full part, both parts sized from
``--kv-budget-mib`` by ``plan_swa_pools`` at ``--swa-full-tokens-ratio``. serve_sim's scheduler
allocates with a ``SWATokenToKVPoolAllocator`` (a slot in each part per token) and, after every step,
gives back with ``free_swa`` the SWA part of each running request's whole pages whose tokens all left
the window (positions ``<= kv_len - window``, which no later query of the request reads); finishing
and retraction free the rest with ``free``. The model runner writes every layer with
``set_kv_buffer`` under its global id (the pool translates a sliding layer's slots through the
full-to-SWA mapping); ``--spec-decode`` writes the drafts into both parts with
``set_kv_buffer_prefix_valid``, compacts them with ``move_kv_cache`` and frees the rejected slots of
both parts.

With ``--prefix-cache`` the chats run on an ``SWARadixCache`` (support/sim/prefix.py builds it over
this module's parts; ``WindowsOnCache``): a step may take what both parts have free or the tree can
evict; a request gives back the SWA part of its own pages before the last window of its whole pages
(so its cached tail keeps a whole window) and records it in ``swa_evicted_seqlen``; evictions free
full KV from leaves and SWA KV from inner nodes, which become tombstones, and the summary counts them.

The byte check: a full layer's rows of every token, a sliding layer's rows of the tokens whose SWA
part it still holds (at their translated slots), each compared with what was written; a token
inside the window whose SWA slot was given back counts as a mismatch. The summary adds the most
slots each part held at a step's end, and a request's KV bytes at ``--long-context`` tokens on these
pools against a pool that keeps every layer's K/V (kvpool's sizing module, at the run's geometry and
page size).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch

from kvpool import SWAKVPool, SWATokenToKVPoolAllocator
from kvpool.pools.sizing import KVGeometry, plan_swa_pools
from support.part_counts import PathCounts
from support.sim.config import DTYPES, SWA_MODELS
from support.sim.loop import Parts, simulate
from support.sim.parking import SpecDecode
from support.sim.result import Mismatch, SimResult
from support.sim.runner import ModelRunner
from support.sim.scheduler import Scheduler

GiB = 2**30


def layer_ids(cfg: Any) -> tuple[list[int], list[int]]:
    """(sliding-window layers, full-attention layers) of ``cfg``'s model, global ids."""
    every = SWA_MODELS[cfg.model]
    full = [i for i in range(cfg.layers) if (i + 1) % every == 0]
    return [i for i in range(cfg.layers) if i not in full], full


def geometries(cfg: Any) -> tuple[KVGeometry, KVGeometry, KVGeometry]:
    """The K/V geometries of ``cfg``'s full layers, its sliding layers, and all its layers together
    (a pool that keeps every layer's K/V)."""
    swa, full = layer_ids(cfg)
    dtype = DTYPES[cfg.dtype]
    return tuple(KVGeometry(cfg.heads, cfg.head_dim, n, dtype) for n in (len(full), len(swa), cfg.layers))  # type: ignore[return-value]


def live_from(kv_len: int, window: int, page: int) -> int:
    """The first position whose SWA part a request of ``kv_len`` K/V tokens keeps: the start of the
    page of its oldest token still inside the window."""
    return max(0, kv_len - window + 1) // page * page


def kept_slots(tokens: int, window: int, page: int) -> int:
    """SWA slots a request of ``tokens`` K/V tokens holds once its whole pages that left the window
    are given back: from the page of its oldest token in the window to its last page."""
    return -(-tokens // page) * page - live_from(tokens, window, page)


class CountedSWAKVPool(SWAKVPool):
    """An ``SWAKVPool`` whose ``stats`` counts both parts' writes, as serve_sim reads a pool's."""

    @property
    def stats(self) -> PathCounts:
        return PathCounts(self)


@dataclass
class WindowStats:
    """What the sliding window did in one run (``SimResult.swa``)."""

    window: int
    size: int  # full part's slots
    size_swa: int
    full_bytes_per_token: int  # of the full layers together
    swa_bytes_per_token: int  # of the sliding layers together
    swa_peak: int = 0  # the most SWA slots held at a step's end
    full_peak: int = 0  # the most full slots held at a step's end
    given_back: int = 0  # tokens whose SWA part free_swa gave back while their request ran
    checked_tokens: int = 0  # sliding layers: tokens whose SWA rows the check compared
    lost_window: int = 0  # tokens inside the window without an SWA slot when checked


# --- the parts serve_sim's classes gain (combined with them in build) --------------------------------


class SchedulerWithWindows:
    """Allocates in both parts; after every step each running request gives back the SWA part of its
    whole pages that left the window; ``window_stats`` records what each part holds then."""

    def __init__(self, cfg: Any, pool: SWAKVPool, stats: WindowStats) -> None:
        super().__init__(cfg, pool)  # type: ignore[call-arg]
        self.window_stats, self.window = stats, cfg.sliding_window
        self.released: dict[int, int] = {}  # rid -> tokens whose SWA part was given back (a page multiple)

    def make_allocator(self, cfg: Any, pool: SWAKVPool) -> SWATokenToKVPoolAllocator:
        return SWATokenToKVPoolAllocator(
            pool.size, pool.size_swa, cfg.page_size, pool.dtype, pool.device, pool, validate=cfg.validate
        )

    def advance(self, batch: Any) -> None:
        super().advance(batch)  # type: ignore[misc]
        self.release_windows()

    def release_windows(self) -> None:
        """``free_swa`` of each running request's whole pages that left the window, then the step's
        figures."""
        a = self.allocator  # type: ignore[attr-defined]
        a.free_group_begin()
        for r in self.running:  # type: ignore[attr-defined]
            start, end = self.release_span(r)
            if end > start:
                a.free_swa(self.table.req_to_token[r.row, start:end].to(torch.int64))  # type: ignore[attr-defined]
                self.mark_released(r, end)
                self.window_stats.given_back += end - start
        a.free_group_end()
        if self.device.type == "cuda":  # type: ignore[attr-defined]
            torch.cuda.synchronize(self.device)  # type: ignore[attr-defined]  # the free counts, before reading them
        self.window_stats.swa_peak = max(self.window_stats.swa_peak, a.size_swa - a.swa_available_size())
        self.window_stats.full_peak = max(self.window_stats.full_peak, a.size_full - a.full_available_size())

    def release_span(self, r: Any) -> tuple[int, int]:
        """The positions ``[start, end)`` whose SWA part running request ``r`` gives back now: from
        what it gave back before to the page of its oldest token in the window."""
        return self.released.get(r.rid, 0), live_from(r.kv_len, self.window, self.page_size)  # type: ignore[attr-defined]

    def mark_released(self, r: Any, end: int) -> None:
        self.released[r.rid] = end

    def release(self, r: Any) -> None:
        self.released.pop(r.rid, None)  # a retracted request starts again from position 0
        super().release(r)  # type: ignore[misc]


class WindowsOnCache:
    """Mixed over serve_sim's prefix-cache scheduler on the sliding-window pools (an
    ``SWARadixCache``): a step may take what both parts have free or evictable; a request gives back
    the SWA part of its own pages (from ``cache_protected_len``) before the last window of its whole
    pages, so that its cached tail keeps a whole window and a match can end there, and records it in
    ``swa_evicted_seqlen``, which the cache reads; a retracted request starts again from nothing."""

    def room(self) -> int:
        a, c = self.allocator, self.cache  # type: ignore[attr-defined]
        return min(a.full_available_size() + c.full_evictable_size(), a.swa_available_size() + c.swa_evictable_size())

    def release_span(self, r: Any) -> tuple[int, int]:
        p = self.page_size  # type: ignore[attr-defined]
        start = max(r.swa_evicted_seqlen, r.cache_protected_len)
        return start, max(start, r.kv_len // p * p - self.window) // p * p  # type: ignore[attr-defined]

    def mark_released(self, r: Any, end: int) -> None:
        r.swa_evicted_seqlen = end

    def retract(self, r: Any) -> None:
        super().retract(r)  # type: ignore[misc]
        r.swa_evicted_seqlen, r.swa_uuid_for_lock = 0, None


def tree_nodes(cache: Any) -> list:
    """A prefix cache's nodes but the root."""
    out, stack = [], list(cache.root_node.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def live_nodes(cache: Any) -> set[int]:
    """The ids of an ``SWARadixCache``'s nodes with SWA KV."""
    return {n.id for n in tree_nodes(cache) if not n.swa_tombstone}


def new_tombstones(cache: Any, live: set[int]) -> tuple[int, int]:
    """The nodes (and their tokens) among ``live`` (``live_nodes`` before a change) that are
    tombstones now."""
    tombs = [n for n in tree_nodes(cache) if n.swa_tombstone and n.id in live]
    return len(tombs), sum(len(n.value) for n in tombs)


def on_cache(scheduler_cls: type) -> type:
    """``scheduler_cls`` (a prefix-cache scheduler over ``SchedulerWithWindows``) with ``WindowsOnCache``."""
    return _with(WindowsOnCache, scheduler_cls)

    def slots_in_use(self) -> int:
        a = self.allocator  # type: ignore[attr-defined]
        return (a.size_full - a.full_available_size()) + (a.size_swa - a.swa_available_size())


class RunnerWithWindows:
    """serve_sim's runner on an ``SWAKVPool`` (every layer under its global id); the check reads a
    sliding layer's rows at the translated SWA slots of the tokens it holds, and counts a token inside
    the window without one as a mismatch."""

    def __init__(self, cfg: Any, pool: SWAKVPool, stats: WindowStats) -> None:
        super().__init__(cfg, pool)  # type: ignore[call-arg]
        self.stats, self.window = stats, cfg.sliding_window
        self.sliding = set(pool.swa_attention_layer_ids)

    def rows_of(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        if layer not in self.sliding:
            return slots, None
        swa = self.pool.translate_loc_from_full_to_swa(slots).to(torch.int64)  # type: ignore[attr-defined]
        return swa.clamp(min=0), swa > 0

    def verify(self, r: Any, slots: torch.Tensor, start: int = 0) -> tuple[int, Optional[Mismatch]]:
        bad, first = super().verify(r, slots, start)  # type: ignore[misc]
        n = slots.shape[0]
        held = self.pool.translate_loc_from_full_to_swa(slots) > 0  # type: ignore[attr-defined]
        inside = torch.arange(start, start + n, device=slots.device) > start + n - self.window  # a later query reads them
        lost = inside & ~held
        self.stats.checked_tokens += int(held.sum())
        self.stats.lost_window += int(lost.sum())
        if bool(lost.any()) and first is None:
            first = Mismatch(r.rid, start + int(lost.nonzero()[0]), min(self.sliding), "SWA slot")
        return bad + int(lost.sum()), first


class SpecWithWindows:
    """A verify step's requests give back the pages that left the window at once (a step without a
    prefill batch has no ``advance``)."""

    def step(self) -> int:
        accepted = super().step()  # type: ignore[misc]
        self.sched.release_windows()  # type: ignore[attr-defined]
        return accepted


def _with(mixin: type, base: type) -> type:
    return type(base.__name__, (mixin, base), {})


def build(cfg: Any) -> tuple[CountedSWAKVPool, Any, SimResult, Parts]:
    """The pool, runner, result and parts of ``cfg``'s run on sliding-window pools.

    Raises
    ------
    ValueError
        If the budget does not hold the longest request plus a page in the full part, or its largest
        live window (a window and a page before it, and a step's tokens) plus a page in the SWA part.
    """
    full, swa, _ = geometries(cfg)
    p, w, longest = cfg.page_size, cfg.sliding_window, cfg.max_context_len
    budget = int(cfg.kv_budget_mib * 2**20)
    try:
        sizing = plan_swa_pools(budget, full, swa, cfg.swa_full_tokens_ratio, page_size=p)
        size, size_swa = sizing.size, sizing.size_swa
    except ValueError:  # not a page in each part
        size = size_swa = 0
    at_once = -(-min(w + p - 2 + cfg.chunk_size + cfg.spec_k, longest) // p)  # pages
    if -(-longest // p) + 1 > size // p or at_once + 1 > size_swa // p:
        raise ValueError(
            f"--kv-budget-mib must hold the longest request ({longest} tokens) plus a page in the full part and "
            f"{at_once * p} SWA slots (its live window, a page and a step's tokens) plus a page in the SWA part, at "
            f"--swa-full-tokens-ratio {cfg.swa_full_tokens_ratio:g}; got {cfg.kv_budget_mib:g} MiB = {size} full + "
            f"{size_swa} SWA slots"
        )
    sliding, full_ids = layer_ids(cfg)
    pool = CountedSWAKVPool(
        size, size_swa, p, DTYPES[cfg.dtype], cfg.heads, cfg.head_dim, sliding, full_ids, False, cfg.device
    )  # fmt: skip
    stats = WindowStats(w, size, size_swa, full.bytes_per_token, swa.bytes_per_token)
    runner = _with(RunnerWithWindows, ModelRunner)(cfg, pool, stats)
    result = SimResult(cfg, size + size_swa, full.bytes_per_token + swa.bytes_per_token, device=str(pool.device))
    result.swa = stats
    parts = Parts(
        scheduler=functools.partial(_with(SchedulerWithWindows, Scheduler), stats=stats),
        spec=_with(SpecWithWindows, SpecDecode),
    )  # fmt: skip
    return pool, runner, result, parts


def run(cfg: Any) -> SimResult:
    """serve_sim's run on the sliding-window pools."""
    pool, runner, result, parts = build(cfg)
    simulate(cfg, pool, runner, result, parts)
    return result


# --- the summary --------------------------------------------------------------------------------------


def request_bytes(cfg: Any, tokens: int) -> tuple[int, int]:
    """A request of ``tokens`` K/V tokens' bytes (whole pages) on the sliding-window pools (every
    token's in the full layers, the kept window's in the sliding ones) and on a pool that keeps every
    layer's K/V."""
    full, swa, every = geometries(cfg)
    p = cfg.page_size
    held = -(-tokens // p) * p
    return held * full.bytes_per_token + kept_slots(tokens, cfg.sliding_window, p) * swa.bytes_per_token, held * every.bytes_per_token


def summary_lines(res: SimResult) -> list[str]:
    """The sliding-window lines of serve_sim's summary."""
    cfg, s = res.config, res.swa
    n = cfg.long_context
    ours, every = request_bytes(cfg, n)
    cached = []
    if res.prefix is not None:
        cached.append(
            f"  tombstones      the SWARadixCache's evictions freed {res.prefix.evicted_swa_tokens} SWA tokens and made "
            f"{res.prefix.tombstoned_nodes} nodes ({res.prefix.tombstoned_tokens} tokens) tombstones (SWA KV freed, full KV kept)"
        )
    return [
        f"  window          {s.window} tokens; {s.given_back} tokens' SWA slots given back with free_swa as they "
        f"left it; at a step's end the SWA part held at most {s.swa_peak}/{s.size_swa} slots, the full part "
        f"{s.full_peak}/{s.size}",
        f"  long context    a request of {n:,} tokens keeps {ours / GiB:.3f} GiB of K/V on these pools, "
        f"{every / GiB:.3f} GiB on a pool that keeps every layer's ({100 * ours / every:.1f}%)",
    ] + cached


def shape_and_pool_lines(res: SimResult) -> tuple[str, str]:
    """The model's shape, and the pool line, of a sliding-window run's summary."""
    cfg, s = res.config, res.swa
    sliding, full = layer_ids(cfg)
    shape = (
        f"{cfg.heads} KV heads x {cfg.head_dim} ({cfg.model}: {len(sliding)} sliding-window layers of {s.window} "
        f"tokens, {len(full)} full-attention)"
    )
    pool = (
        f"  pool            SWAKVPool of {s.size} full + {s.size_swa} SWA slots ({s.full_bytes_per_token} + "
        f"{s.swa_bytes_per_token} B/token, {cfg.kv_budget_mib:g} MiB budget, --swa-full-tokens-ratio "
        f"{cfg.swa_full_tokens_ratio:g}), {cfg.max_running} request rows"
    )
    return shape, pool
