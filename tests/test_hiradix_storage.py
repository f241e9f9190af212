"""``HiRadixCache`` over a storage tier: host copies are written through to storage, and another
engine (or the same one after its host copies are gone) prefetches them back, storage -> host ->
device, byte for byte (every loaded slot is checked against the KV its content wrote), only for
the same prefix and ``extra_key``; the prefetch policies hold a request back as they say; storage
failures and delays lose nothing and leave the tree consistent; the integrity check covers the
storage keys.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from kvassert import Engine, file_store, seq

from kvpool import MHATokenToKVPool, PagedTokenToKVPoolAllocator
from kvpool.cache import CacheInitParams, EvictParams, HiRadixCache, MatchPrefixParams, RadixKey
from kvpool.cache.records import STORAGE
from kvpool.cache.storage_tier import StoragePolicy
from kvpool.errors import IntegrityError
from kvpool.storage import HiCacheFile, page_keys, storage_digest
from kvpool.storage.faults import FaultyStorage

NOW = StoragePolicy(prefetch_threshold=0, background=False)


def engine(store, policy=NOW, pages=16, page=4, **kw):
    return Engine("paged", page, pages=pages, host_policy=kw.pop("host_policy", "write_through"), storage=store,
                  storage_policy=policy, **kw)  # fmt: skip


def second(first, store, policy=NOW, **kw):
    """Another engine over the same storage, writing the same KV patterns as ``first``."""
    eng = engine(store, policy, **kw)
    eng.ids = first.ids
    return eng


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("page", [1, 4])
def test_another_engine_loads_the_pages_from_storage_byte_for_byte(tmp_path, layout, page):
    a = engine(file_store(tmp_path / "kv"), page=page, pages=64 // page, layout=layout)
    prompt = seq(13, 500)
    a.finish(a.admit(prompt))
    stored = (len(prompt) // page) * page // page
    assert a.cache.storage_tier.stats.pages_written == stored
    b = second(a, file_store(tmp_path / "kv"), page=page, pages=64 // page, layout=layout)
    req = b.admit(prompt)  # prefetch, host, load back: Engine checks every loaded slot's bytes
    want = (len(prompt) - 1) // page * page
    assert b.from_storage == want and b.loaded == want and req.cache_protected_len == want
    b.cache.check_integrity(b.running.values())
    b.finish(req)
    b.drain()


def test_a_host_copy_evicted_comes_back_from_storage(tmp_path):
    eng = engine(file_store(tmp_path / "kv"), host_ratio=0.5)
    prompt = seq(9, 700)
    eng.finish(eng.admit(prompt))
    eng.cache.evict(EvictParams(num_tokens=eng.size))
    assert eng.cache.evict_host(eng.host.size) == 8 and len(eng.cache.root_node.children) == 0
    eng.finish(eng.admit(prompt))
    assert eng.from_storage == 8 and eng.loaded == 8
    eng.drain()


def test_pages_of_another_extra_key_or_prefix_are_never_loaded(tmp_path):
    a = engine(file_store(tmp_path / "kv"))
    a.finish(a.admit(seq(13, 500), extra="tenant-a"))
    b = second(a, file_store(tmp_path / "kv"))
    b.finish(b.admit(seq(13, 500), extra="tenant-b"))
    b.finish(b.admit(seq(13, 500)))
    b.finish(b.admit([1] + seq(12, 501)))  # the same pages after another first token
    assert b.from_storage == 0 and b.loaded == 0
    b.finish(b.admit(seq(13, 500), extra="tenant-a"))
    assert b.from_storage == 12
    b.drain()


def test_fetched_pages_the_tree_holds_meanwhile_are_dropped(tmp_path):
    a = engine(file_store(tmp_path / "kv"))
    prompt = seq(17, 900)
    a.finish(a.admit(prompt))
    b = second(a, file_store(tmp_path / "kv"))
    cache = b.cache
    cache.prefetch_from_storage("r", cache.root_node, prompt[:16], extra_key=None)
    b.finish(b.admit(prompt[:9]))  # the first 8 tokens enter the tree (by a prefetch of its own) meanwhile
    assert b.from_storage == 8
    assert cache.check_prefetch_progress("r") and cache.pop_prefetch_loaded_tokens("r") == 8
    assert cache.storage_tier.stats.tokens_dropped == 8
    cache.check_integrity()
    b.finish(b.admit(prompt))  # the other 8 come from the host, where "r" left them
    assert b.loaded == 16 and b.from_storage == 8
    b.drain()


def test_node_splits_keep_the_storage_keys_of_their_prefix(tmp_path):
    eng = engine(file_store(tmp_path / "kv"))
    eng.finish(eng.admit(seq(17, 100)))
    eng.finish(eng.admit(seq(9, 100) + seq(8, 5000)))  # splits the first node after two pages
    eng.cache.check_integrity()  # checks every node's keys against the chain of its prefix
    fresh = second(eng, file_store(tmp_path / "kv"))
    fresh.finish(fresh.admit(seq(17, 100)))
    assert fresh.from_storage == 16
    fresh.drain()


def test_the_integrity_check_sees_wrong_storage_keys(tmp_path):
    eng = engine(file_store(tmp_path / "kv"))
    eng.finish(eng.admit(seq(9, 100)))
    node = next(iter(eng.cache.root_node.children.values()))
    node.records[STORAGE].keys[0] = "0" * 64
    with pytest.raises(IntegrityError, match=f"node {node.id}'s storage keys are not the chain of its prefix"):
        eng.cache.check_integrity()


def test_the_integrity_check_sees_keys_below_a_node_without_them_and_a_prefetch_without_its_hold(tmp_path):
    eng = engine(file_store(tmp_path / "kv"))
    eng.finish(eng.admit(seq(17, 100)))
    eng.finish(eng.admit(seq(9, 100) + seq(8, 5000)))  # a node of two pages with two children
    cache = eng.cache
    parent = next(iter(cache.root_node.children.values()))
    child = next(iter(parent.children.values()))
    keys = parent.records.pop(STORAGE)
    with pytest.raises(IntegrityError, match=f"node {child.id} has storage keys but its parent {parent.id} has none"):
        cache.check_integrity()
    parent.records[STORAGE] = keys
    cache.check_integrity()
    cache.prefetch_from_storage("r", child, seq(8, 90_000))
    child.records["host"].holds -= 1
    with pytest.raises(IntegrityError, match="a prefetch in flight does not hold the host copy of the node it continues"):
        cache.check_integrity()
    child.records["host"].holds += 1
    assert cache.check_prefetch_progress("r")
    eng.drain()


# --- prefetch policies (worker threads; the injector's sleep is a gate the test opens) -------------


def gated(tmp_path, policy):
    a = engine(file_store(tmp_path / "kv"))
    a.finish(a.admit(seq(13, 500)))
    gate = threading.Event()
    slow = FaultyStorage(file_store(tmp_path / "kv"), delay_s=1.0, delay_calls={"get": {1}, "batch_get_regions": {1}}, sleep=lambda s: gate.wait(10))
    b = second(a, slow, StoragePolicy(prefetch_threshold=0, background=True, **policy))
    cache = b.cache
    cache.prefetch_from_storage("r", cache.root_node, seq(12, 500))
    return b, cache, gate


def test_wait_complete_holds_the_request_until_every_page_is_read(tmp_path):
    b, cache, gate = gated(tmp_path, dict(prefetch_policy="wait_complete"))
    assert [cache.check_prefetch_progress("r") for _ in range(3)] == [False] * 3
    gate.set()
    deadline = time.monotonic() + 30
    while not cache.check_prefetch_progress("r"):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert cache.pop_prefetch_loaded_tokens("r") == 12
    cache.check_integrity()
    cache.storage_tier.close()
    b.drain()


def test_best_effort_lets_the_request_go_on_with_what_has_arrived(tmp_path):
    b, cache, gate = gated(tmp_path, dict(prefetch_policy="best_effort"))
    assert cache.check_prefetch_progress("r") and cache.pop_prefetch_loaded_tokens("r") == 0
    gate.set()
    assert cache.storage_tier.drain()
    cache.check_integrity()
    cache.prefetch_from_storage("s", cache.root_node, seq(12, 500))
    assert cache.storage_tier.drain()  # this time every page arrives before the request is looked at
    assert cache.check_prefetch_progress("s") and cache.pop_prefetch_loaded_tokens("s") == 12
    b.finish(b.admit(seq(13, 500)))
    assert b.loaded == 12
    cache.storage_tier.close()
    b.drain()


def test_timeout_lets_the_request_go_on_once_the_time_is_up(tmp_path):
    b, cache, gate = gated(tmp_path, dict(prefetch_policy="timeout", prefetch_timeout_base_s=0.3, prefetch_timeout_per_page_s=0.0))
    assert cache.check_prefetch_progress("r") is False
    time.sleep(0.4)
    assert cache.check_prefetch_progress("r") and cache.pop_prefetch_loaded_tokens("r") == 0
    gate.set()
    assert cache.storage_tier.drain()
    cache.check_integrity()
    assert b.host.available_size() == b.host.size  # nothing of the late pages entered the host
    cache.storage_tier.close()
    b.drain()


# --- failures ----------------------------------------------------------------------------------


def test_a_failing_or_raising_storage_loses_nothing_and_backs_off(tmp_path):
    flaky = FaultyStorage(file_store(tmp_path / "kv"), raise_calls={"batch_set": {1}}, fail_calls={"batch_set": {3}})
    eng = engine(flaky, StoragePolicy(prefetch_threshold=0, background=False, backoff_s=0.0, max_backoff_s=0.0))
    for i in range(4):
        eng.finish(eng.admit(seq(9, 1000 * (i + 1))))
        eng.cache.check_integrity()
    stats = eng.cache.storage_tier.stats
    assert (stats.write_failures, stats.pages_written) == (2, 4)
    # Every node kept its device and host copies, whatever storage did.
    assert all(n.value is not None and n.host_value is not None for n in eng.cache._nodes()[1:])
    held = FaultyStorage(file_store(tmp_path / "kv2"), fail_calls={"batch_set": {1}})
    slow = engine(held, StoragePolicy(prefetch_threshold=0, background=False, backoff_s=60.0, max_backoff_s=60.0))
    for i in range(3):
        slow.finish(slow.admit(seq(9, 1000 * (i + 1))))
    assert (slow.cache.storage_tier.stats.write_failures, slow.cache.storage_tier.stats.writes_skipped) == (1, 4)
    assert held.calls == {"batch_exists": 1, "batch_set": 1}  # backing off: neither written nor asked again
    slow.drain()
    eng.drain()


def test_prefetch_failures_and_corrupt_pages_end_the_prefetch_with_what_was_read(tmp_path):
    a = engine(file_store(tmp_path / "kv"))
    prompt = seq(17, 300)
    a.finish(a.admit(prompt))
    flaky = FaultyStorage(file_store(tmp_path / "kv"), raise_calls={"get": {3}, "batch_get_regions": {3}})
    b = second(a, flaky, StoragePolicy(prefetch_threshold=0, background=False, backoff_s=0.0, max_backoff_s=0.0))
    b.finish(b.admit(prompt))  # pages 1 and 2 arrive, the third read raises: 8 tokens from storage
    assert b.from_storage == 8 and b.loaded == 8 and b.cache.storage_tier.stats.prefetch_failures == 1
    b.cache.check_integrity()
    b.drain()
    store = file_store(tmp_path / "kv")
    c = second(a, store)
    names = [storage_digest(store.namespace, k) + ".kvpage" for k in page_keys(prompt[:16], 4)]
    flipped = sorted(names)[:2]  # two pages, wherever their names put them
    for name in flipped:
        raw = bytearray((tmp_path / "kv" / name).read_bytes())
        raw[-1] ^= 0xFF
        (tmp_path / "kv" / name).write_bytes(bytes(raw))
    c.finish(c.admit(prompt))  # the first corrupt page ends the prefix; nothing wrong is loaded
    first = min(names.index(n) for n in flipped)
    assert c.from_storage == 4 * first and store.get_stats().corrupt == 1
    c.cache.check_integrity()
    c.drain()


# --- construction ----------------------------------------------------------------------------------


def test_storage_from_sglangs_server_args(tmp_path):
    pool = MHATokenToKVPool(64, 4, torch.bfloat16, 2, 8, 2, "cpu")
    alloc = PagedTokenToKVPoolAllocator(64, 4, kvcache=pool)
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=4)
    args = SimpleNamespace(hicache_ratio=1.5, hicache_size=0, hicache_mem_layout="page_first", hicache_write_policy="write_through",
                           hicache_io_backend="direct", hicache_storage_backend="file", hicache_storage_prefetch_policy="timeout",
                           hicache_storage_backend_extra_config=f'{{"file_path": "{tmp_path / "kv"}", "max_bytes": 100000, '
                                                                '"prefetch_threshold": 64, "prefetch_timeout_per_ki_token": 0.512}',
                           model_path="org/model")  # fmt: skip
    cache = HiRadixCache(params, args)
    tier = cache.storage_tier
    assert cache.enable_storage and isinstance(tier.storage, HiCacheFile)
    assert (tier.policy.prefetch_policy, tier.policy.prefetch_threshold, tier.policy.prefetch_timeout_per_page_s) == ("timeout", 64, 0.002)
    assert tier.storage.file_path == str(tmp_path / "kv") and tier.storage.max_bytes == 100000
    assert tier.storage.storage_config.model_name == "org/model" and tier.storage.storage_config.is_page_first_layout
    for bad, msg in [
        ({"hicache_storage_backend": "nixl"}, "hicache_storage_backend must be 'file', 'mooncake' or None \\(pass other backends as storage=\\)"),
        ({"hicache_storage_prefetch_policy": "eager"}, "prefetch_policy must be one of best_effort, wait_complete, timeout"),
        ({"hicache_storage_backend_extra_config": "{oops"}, "hicache_storage_backend_extra_config must be a dict or JSON of one"),
        ({"hicache_storage_backend_extra_config": {"prefetch_threshold": -1, "file_path": str(tmp_path / "never")}},
         "prefetch_threshold must be a non-negative int, got -1"),
    ]:
        fresh = MHATokenToKVPool(64, 4, torch.bfloat16, 2, 8, 2, "cpu")
        p = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=PagedTokenToKVPoolAllocator(64, 4, kvcache=fresh), page_size=4)
        with pytest.raises(ValueError, match=msg):
            HiRadixCache(p, SimpleNamespace(**{**vars(args), **bad}))
        assert fresh.layer_transfer_counter is None  # refused before the cache touched the pool
        assert not (tmp_path / "never").exists()  # or made a directory
    with pytest.raises(ValueError, match="storage_policy needs a storage backend"):
        HiRadixCache(params, SimpleNamespace(**{**vars(args), "hicache_storage_backend": None}), storage_policy=NOW)
    with pytest.raises(ValueError, match="storage must be a kvpool.storage.HiCacheStorage, got str"):
        HiRadixCache(params, SimpleNamespace(**{**vars(args), "hicache_storage_backend": None}), storage="file")


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda c: c.prefetch_from_storage("r", object(), [1, 2, 3, 4]), TypeError, "last_host_node must be a TreeNode, got object"),
        (lambda c: c.prefetch_from_storage("r", c.root_node, [1, 2.5, 3, 4]), ValueError, r"token_ids\[1\] must be an int64 token"),
        (lambda c: c.prefetch_from_storage("r", c.root_node, [1, 2, 3, 4], extra_key=object()), ValueError, "extra_key must be None, bool"),
    ],
)
def test_bad_prefetch_arguments_change_nothing(tmp_path, call, exc, match):
    eng = engine(file_store(tmp_path / "kv"))
    eng.finish(eng.admit(seq(9, 100)))
    with pytest.raises(exc, match=match):
        call(eng.cache)
    assert eng.cache.storage_tier.ongoing_prefetch == {} and eng.cache.root_node.host_ref_counter == 0
    eng.cache.check_integrity()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_seeded_fault_run_loads_only_right_bytes_and_stays_consistent(tmp_path, seed):
    import random

    rng = random.Random(seed)
    policy = StoragePolicy(prefetch_threshold=0, background=False, backoff_s=0.0, max_backoff_s=0.0)
    engines = []
    for i in range(2):  # two engines on one directory, each behind its own faults
        flaky = FaultyStorage(file_store(tmp_path / "kv", max_bytes=40_000), seed=seed * 10 + i, fail_rate=0.15,
                              raise_rate=0.1, short_rate=0.2)  # fmt: skip
        engines.append(engine(flaky, policy, pages=12, host_ratio=0.75))
    engines[1].ids = engines[0].ids
    stems = [seq(8, 100 * (k + 1)) for k in range(4)]
    for _ in range(40):
        eng = rng.choice(engines)
        prompt = rng.choice(stems) + seq(rng.randrange(1, 9), rng.randrange(10_000, 10_004))
        req = eng.admit(prompt, extra=rng.choice([None, "t"]))  # every loaded slot's bytes are checked
        if req is not None:
            eng.finish(req)
        if rng.random() < 0.3:
            eng.cache.evict(EvictParams(num_tokens=rng.randrange(4, 32)))
        if rng.random() < 0.2:
            eng.cache.evict_host(rng.randrange(4, 32))
        eng.cache.check_hicache_events()
        eng.cache.check_integrity(eng.running.values())
    injected = {kind for e in engines for _, _, kind in e.cache.storage_tier.storage.log}
    assert injected == {"fail", "raise", "short"} and sum(e.from_storage for e in engines) > 0
    for eng in engines:
        eng.drain()


def test_an_aborted_requests_prefetch_releases_its_hold_and_takes_nothing(tmp_path):
    a = engine(file_store(tmp_path / "kv"))
    prompt = seq(17, 300)
    a.finish(a.admit(prompt))
    b = second(a, file_store(tmp_path / "kv"))
    b.finish(b.admit(prompt[:5]))  # the first page is in b's tree, on the host too
    cache = b.cache
    node = cache.match_prefix(MatchPrefixParams(key=RadixKey(prompt[:16]))).last_host_node
    assert node is not cache.root_node
    host_free = b.host.available_size()
    cache.prefetch_from_storage("r", node, prompt[4:16])
    assert node.host_ref_counter == 1
    cache.release_aborted_request("r")  # SGLang's scheduler, for a request aborted while waiting
    assert cache.storage_tier.ongoing_prefetch == {} and node.host_ref_counter == 0
    assert b.host.available_size() == host_free and cache.pop_prefetch_loaded_tokens("r") == 0
    assert cache.check_prefetch_progress("r")  # nothing left to end
    cache.check_integrity()
    cache.release_aborted_request("never-prefetched")  # nothing to release
    b.drain()  # the node leaves the host with the rest


def test_tensor_parallel_ranks_on_one_directory_never_read_each_others_pages(tmp_path):
    args = SimpleNamespace(hicache_ratio=2.0, hicache_size=0, hicache_mem_layout="layer_first", hicache_write_policy="write_through",
                           hicache_io_backend="direct", hicache_storage_backend="file", hicache_storage_prefetch_policy="best_effort",
                           hicache_storage_backend_extra_config={"file_path": str(tmp_path / "kv")}, model_path="org/model",
                           tp_size=2)  # fmt: skip

    def rank_cache(tp_cache_group):
        pool = MHATokenToKVPool(64, 4, torch.bfloat16, 2, 8, 2, "cpu")  # each rank holds its own 2 heads
        alloc = PagedTokenToKVPoolAllocator(64, 4, kvcache=pool)
        params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=4,
                                 tp_cache_group=tp_cache_group)  # fmt: skip
        return HiRadixCache(params, args)

    def group(rank, size):  # the rank's tensor-parallel process group, as SGLang passes it
        return SimpleNamespace(rank=lambda: rank, size=lambda: size)

    ranks = [rank_cache(group(r, 2)) for r in range(2)]
    stores = [c.storage_tier.storage for c in ranks]
    assert [(s.storage_config.tp_rank, s.storage_config.tp_size) for s in stores] == [(0, 2), (1, 2)]
    host = ranks[0].token_to_kv_pool_host
    (key,) = page_keys([1, 2, 3, 4], 4)
    assert stores[0].batch_set_v1([key], host.alloc(4)) == [True]
    assert stores[0].exists(key) and not stores[1].exists(key)
    with pytest.raises(ValueError, match="tp_cache_group must be the rank's tensor-parallel group .* tp_size 2, got None"):
        rank_cache(None)
    assert sorted(p.name for p in (tmp_path / "kv").iterdir()) == [storage_digest(stores[0].namespace, key) + ".kvpage"]


def test_a_node_split_before_its_backup_completes_has_both_parts_written(tmp_path):
    eng = engine(file_store(tmp_path / "kv"))

    class Pending:  # a backup still copying (a CUDA event), complete once the test says so
        done = False

        def query(self):
            return Pending.done

    real = eng.host.backup_from_device_all_layer
    eng.host.backup_from_device_all_layer = lambda *a, **kw: (real(*a, **kw), Pending())[1]
    prompt = seq(17, 100)
    eng.finish(eng.admit(prompt))
    eng.finish(eng.admit(prompt[:8] + seq(9, 5000)))  # splits the node after two pages, before the backup is done
    assert eng.cache.storage_tier.stats.pages_written == 0
    Pending.done = True
    eng.cache.check_hicache_events()
    eng.cache.check_integrity()
    fresh = second(eng, file_store(tmp_path / "kv"))
    fresh.finish(fresh.admit(prompt))
    assert fresh.from_storage == 16
    fresh.drain()
    eng.drain()


def test_writes_waiting_for_a_stalled_storage_hold_at_most_the_host_pools_size(tmp_path):
    gate = threading.Event()
    stalled = FaultyStorage(file_store(tmp_path / "kv"), delay_s=1.0, delay_calls={"batch_set": {1}}, sleep=lambda s: gate.wait(30))
    eng = engine(stalled, StoragePolicy(prefetch_threshold=0, background=True), host_ratio=4.0)
    tier = eng.cache.storage_tier
    host_pages = eng.host.size // eng.page
    for i in range(2 * host_pages):  # each insert is a new page copied out of the host for storage
        eng.finish(eng.admit(seq(5, 1000 * (i + 1))))
        eng.cache.evict(EvictParams(num_tokens=eng.size))
        eng.cache.evict_host(eng.host.size)  # room on the host: only storage's queue keeps the copies
    assert tier.stats.writes_skipped >= host_pages - 1 and tier.queued_pages <= host_pages
    gate.set()
    assert tier.drain()
    assert tier.queued_pages == 0 and tier.stats.pages_written + tier.stats.writes_skipped == 2 * host_pages
    tier.close()
    eng.drain()


def test_prefetches_in_flight_hold_at_most_the_host_pools_size(tmp_path):
    eng = engine(file_store(tmp_path / "kv"), host_ratio=2.0)
    cache, host_pages = eng.cache, eng.host.size // eng.page
    prompts = [seq(4 * (host_pages // 2 - 1), 1000 * (i + 1)) for i in range(3)]  # each a page short of half the host
    for i, prompt in enumerate(prompts):  # the pages each read into memory until its request goes on
        cache.prefetch_from_storage(f"r{i}", cache.root_node, prompt)
    assert sorted(cache.storage_tier.ongoing_prefetch) == ["r0", "r1"]  # a third would pass the host's size
    assert cache.check_prefetch_progress("r2") and cache.check_prefetch_progress("r0")
    cache.prefetch_from_storage("r2", cache.root_node, prompts[2])  # room again
    assert sorted(cache.storage_tier.ongoing_prefetch) == ["r1", "r2"]
    cache.release_aborted_request("r1")
    assert cache.check_prefetch_progress("r2") and cache.storage_tier.ongoing_prefetch == {}
    cache.prefetch_from_storage("r3", cache.root_node, prompts[0] + prompts[1] + prompts[2])  # more than the host holds
    assert cache.storage_tier.ongoing_prefetch == {}
    cache.check_integrity()
    eng.drain()
