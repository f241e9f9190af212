"""The sliding-window rows of ``bench_prefix_cache.py``: ``SWARadixCache``'s match per matched token
on the chat workload's tree, and its SWA eviction (``evict(EvictParams(swa_num_tokens=16))``) on
trees of two sizes, against SGLang's ``SWARadixCache`` from the same wheel as its ``RadixCache``.

Eviction trees: ``chains`` chains under a shared 64-token prefix, each a 16-token node of its own
with two 16-token leaves below it. One call frees 16 SWA tokens, one node: in the LRU order a
chain's first leaf goes (both parts), then its inner node becomes a tombstone (SWA KV only), then
its second leaf goes with the tombstone above it. The target: flat cost per call as the tree grows
(a scan over the nodes per call grows with it).

kvpool's cache is simulated (no allocator: nothing is freed); SGLang's needs an allocator of its
``SWATokenToKVPoolAllocator`` class, stood in for by one that counts what it is given.
"""

from __future__ import annotations

import gc
import importlib.util
import random
import statistics
import sys
import time
import types
import zipfile
from typing import Any, Callable, Optional

import torch

from kvpool.cache import EvictParams, InsertParams, MatchPrefixParams, RadixKey, SWARadixCache

WINDOW = 4096  # longer than any chat turn's tail: the chat tree has no tombstone, every match is whole


class CountingSWAAllocator:
    """Counts the slots SGLang's cache frees in each part."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.freed = self.freed_swa = 0

    def free(self, slots: torch.Tensor) -> None:
        self.freed += len(slots)

    def free_swa(self, slots: torch.Tensor) -> None:
        self.freed_swa += len(slots)


def load_sglang_swa(wheel: str, load_sglang: Callable[[str], tuple]) -> tuple[Callable[[int], Any], Any, Any, Any, Any]:
    """SGLang's ``SWARadixCache`` (a factory by page size over ``CountingSWAAllocator``) and its
    ``RadixKey``, ``InsertParams``, ``MatchPrefixParams``, ``EvictParams``: ``load_sglang`` (the
    benchmark's, which stubs the GPU-side modules and loads ``radix_cache.py``) first, then
    ``swa_radix_cache.py`` with its pool module stubbed."""
    _, SKey, SInsert, SMatch, SEvict, _ = load_sglang(wheel)
    with zipfile.ZipFile(wheel) as z:
        src = z.read("sglang/srt/mem_cache/swa_radix_cache.py").decode()
        params_src = z.read("sglang/srt/mem_cache/cache_init_params.py").decode()
    pool = types.ModuleType("sglang.srt.mem_cache.swa_memory_pool")
    pool.SWATokenToKVPoolAllocator = CountingSWAAllocator
    sys.modules[pool.__name__] = pool
    name = "sglang.srt.mem_cache.swa_radix_cache"
    mod = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    sys.modules[name] = mod
    exec(compile(src, f"{wheel}/sglang/srt/mem_cache/swa_radix_cache.py", "exec"), mod.__dict__)
    params = sys.modules["sglang.srt.mem_cache.cache_init_params"]
    assert "sliding_window_size" in params_src, "this SGLang's CacheInitParams has no sliding_window_size"

    def make(page: int) -> Any:
        cache = mod.SWARadixCache(params.CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=CountingSWAAllocator(), page_size=page,
            sliding_window_size=WINDOW,
        ))  # fmt: skip
        cache.metrics_collector = getattr(cache, "metrics_collector", None)
        return cache

    return make, SKey, SInsert, SMatch, SEvict


def kvpool_swa(page: int) -> SWARadixCache:
    return SWARadixCache.create_simulated(sliding_window_size=WINDOW, page_size=page)


def _timed(fn: Callable, *args: Any) -> tuple[Any, int]:
    t0 = time.perf_counter_ns()
    out = fn(*args)
    return out, time.perf_counter_ns() - t0


def run_swa_match(cache: Any, key: Callable, insert: Callable, match: Callable, steps: list, repeats: int) -> dict:
    """The chat workload inserted (each turn with its own slots, the caller keeping its duplicates:
    ``prev_prefix_len`` the whole key), then every conversation's history matched ``repeats`` times."""
    slots, last = 0, {}
    for conv, _, full in steps:
        cache.insert(insert(key=key(full), value=torch.arange(slots, slots + len(full), dtype=torch.int64), prev_prefix_len=len(full)))
        slots += len(full)
        last[conv] = full
    times, tokens = [], []
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            for full in last.values():
                got, dt = _timed(lambda t: len(cache.match_prefix(match(key=key(t))).device_indices), full)
                times.append(dt)
                tokens.append(got)
    finally:
        gc.enable()
    per = [t / n for t, n in zip(times, tokens) if n]
    return {"steady_matched_tokens": sum(tokens), "match_us_per_request": statistics.median(times) / 1e3,
            "match_ns_per_token": statistics.median(per) if per else float("nan")}  # fmt: skip


def run_swa_evict(cache: Any, key: Callable, insert: Callable, evict: Callable, chains: int, calls: int, seed: int) -> dict:
    """SWA eviction of 16 tokens per call on a tree of ``chains`` chains (see the module docstring)."""
    rng = random.Random(seed)
    shared = [rng.randrange(150_000) for _ in range(64)]
    slot = 0
    for i in range(chains):
        own = shared + [150_000 + i] + [rng.randrange(150_000) for _ in range(15)]
        for _ in range(2):
            k = own + [rng.randrange(150_000) for _ in range(16)]
            cache.insert(insert(key=key(k), value=torch.arange(slot, slot + len(k), dtype=torch.int64), prev_prefix_len=len(k)))
            slot += len(k)
    gc.collect()
    gc.disable()
    try:
        times, full, swa = [], 0, 0
        for _ in range(calls):
            res, dt = _timed(lambda: cache.evict(evict(num_tokens=0, swa_num_tokens=16)))
            assert res.swa_num_tokens_evicted >= 16, f"evicted {res.swa_num_tokens_evicted} SWA tokens"
            full, swa = full + res.num_tokens_evicted, swa + res.swa_num_tokens_evicted
            times.append(dt)
    finally:
        gc.enable()
    return {"chains": chains, "nodes": 3 * chains + 1, "calls": calls, "full_evicted": full, "swa_evicted": swa,
            "evict_us_median": statistics.median(times) / 1e3, "evict_us_max": max(times) / 1e3}  # fmt: skip


def swa_rows(steps: list, repeats: int, chains: list[int], seed: int, wheel: Optional[str], load_sglang: Callable, log: Callable) -> dict:
    """Both kinds of row for kvpool's ``SWARadixCache`` and, where ``wheel`` loads, SGLang's."""
    impls: list[tuple[str, Callable[[], Any], tuple]] = [
        ("kvpool", lambda: kvpool_swa(1), (RadixKey, InsertParams, MatchPrefixParams, EvictParams)),
    ]
    note = "SGLang's SWARadixCache: not measured (no --sglang-wheel given)."
    if wheel:
        try:
            make_sglang, *classes = load_sglang_swa(wheel, load_sglang)
            impls.append(("sglang", lambda: make_sglang(1), tuple(classes)))
            note = "SGLang's SWARadixCache from the same wheel, swa_radix_cache.py with its pool module stubbed by a counting allocator."
        except Exception as e:  # reported, not fatal
            note = f"SGLang's SWARadixCache could not be imported from {wheel}: {type(e).__name__}: {e}"
            log(note)
    match_rows, evict_rows = [], []
    for name, new, (key, insert, match, evict) in impls:
        log(f"swa match: {name}")
        r = run_swa_match(new(), key, insert, match, steps, repeats)
        match_rows.append({"impl": name, "page": 1, **r})
        for n in chains:
            log(f"swa evict: {name}, {n} chains")
            r = run_swa_evict(new(), key, insert, evict, n, min(400, 3 * n), seed)
            evict_rows.append({"impl": name, "page": 1, **r})
    counts = {r["impl"]: r["steady_matched_tokens"] for r in match_rows}
    if len(set(counts.values())) > 1:
        raise SystemExit(f"the SWA caches matched different token counts: {counts}")
    return {"swa_match": match_rows, "swa_evict": evict_rows, "swa_note": note}


def swa_markdown(result: dict) -> list[str]:
    lines = [
        "", "## SWARadixCache", "",
        f"Window {WINDOW} tokens (no tombstone in the chat tree). Match: the chat workload's steady state, as above.", "",
        "| impl | page | steady match us/req | steady ns/matched token |", "|---|---:|---:|---:|",
    ]  # fmt: skip
    for r in result.get("swa_match", []):
        lines.append(f"| {r['impl']} | {r['page']} | {r['match_us_per_request']:.1f} | {r['match_ns_per_token']:.2f} |")
    lines += [
        "", "SWA eviction, `evict(EvictParams(swa_num_tokens=16))` per call: chains of an inner 16-token node and two "
        "16-token leaves under a shared prefix (a call evicts a leaf with both parts, or makes the inner node a tombstone).", "",
        "| impl | chains | nodes | calls | full tokens freed | SWA tokens freed | us per call (median) | max |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for r in result.get("swa_evict", []):
        lines.append(
            f"| {r['impl']} | {r['chains']} | {r['nodes']} | {r['calls']} | {r['full_evicted']} | {r['swa_evicted']} | "
            f"{r['evict_us_median']:.1f} | {r['evict_us_max']:.1f} |"
        )
    lines += ["", "Both free the same nodes; SGLang's `num_tokens_evicted` leaves out the full tokens of the tombstones "
              "that go after a leaf in its SWA phase (its phase-one count includes them)."]
    if result.get("swa_note"):
        lines += ["", result["swa_note"]]
    return lines


def swa_targets(result: dict) -> list[dict]:
    ev = [r for r in result["swa_evict"] if r["impl"] == "kvpool"]
    if len(ev) < 2:
        return []
    growth = ev[-1]["evict_us_median"] / ev[0]["evict_us_median"]
    return [{"name": f"kvpool SWA eviction at {ev[-1]['chains']} chains / at {ev[0]['chains']}, <= 2x", "value": f"{growth:.2f}x", "met": growth <= 2}]
