"""``close()`` of the caches with a storage tier: the queued writes are done, the worker threads
finish and are joined (none is left running), a prefetch in flight is dropped with its hold
released, a second call changes nothing, the device and host tiers serve on, storage work asked for
afterwards is refused with a clear error, and a backend the cache made is closed with it (one given
to it stays open). A timeout that is not a number of seconds is refused before anything closes.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from kvassert import Engine, HiHybridEngine, file_store, seq, stalled_store

from kvpool import MHATokenToKVPool, MHATokenToKVPoolHost, PagedTokenToKVPoolAllocator
from kvpool.cache import CacheInitParams, HiRadixCache
from kvpool.cache.storage_tier import StoragePolicy
from kvpool.storage import page_keys
from kvpool.storage.faults import FaultyStorage

THREADS = StoragePolicy(prefetch_threshold=0, prefetch_policy="best_effort")


def engine(store, policy=THREADS):
    return Engine("paged", 4, pages=16, host_policy="write_through", storage=store, storage_policy=policy)


def storage_threads():
    return [t for t in threading.enumerate() if t.name.startswith("kvpool-storage-")]


def test_close_writes_what_was_queued_and_joins_every_worker(tmp_path):
    slow = FaultyStorage(file_store(tmp_path / "kv"), delay_rate=1.0, delay_s=0.05)
    eng = engine(slow)
    prompt = seq(17, 500)
    eng.finish(eng.admit(prompt))  # its prefetch and its write run on workers
    workers = eng.cache.storage_tier.workers.threads()
    assert len(workers) == 2 and all(t.is_alive() for t in workers)
    eng.cache.close()
    assert not any(t.is_alive() for t in workers) and not set(workers) & set(storage_threads())
    assert eng.cache.storage_tier.stats.pages_written == 4
    assert all(file_store(tmp_path / "kv", eng.host).exists(k) for k in page_keys(prompt[:16], 4))
    eng.cache.close()  # again: nothing left to do
    eng.drain()


def test_a_prefetch_in_flight_is_dropped_and_a_worker_stuck_in_storage_is_waited_for_again(tmp_path):
    a = engine(file_store(tmp_path / "kv"), StoragePolicy(prefetch_threshold=0, background=False))
    a.finish(a.admit(seq(13, 500)))
    stuck, inside, gate = stalled_store(tmp_path / "kv", "batch_get_regions")
    b = engine(stuck)
    b.ids = a.ids
    cache = b.cache
    cache.prefetch_from_storage("r", cache.root_node, seq(12, 500))
    (worker,) = cache.storage_tier.workers.threads()
    assert inside.wait(10)  # the worker is inside its first page read
    with pytest.raises(TimeoutError, match="storage workers kvpool-storage-prefetch still run a storage call after 0.2 s"):
        cache.close(timeout_s=0.2)
    assert worker.is_alive() and cache.storage_tier.ongoing_prefetch == {} and cache.root_node.host_ref_counter == 0
    assert b.host.size - b.host.available_size() == 12  # its host pages wait for the worker to leave them
    cache.check_integrity()
    with pytest.raises(RuntimeError, match=r"prefetch_from_storage: the cache's storage tier is closed \(close\(\) was called\)"):
        cache.prefetch_from_storage("s", cache.root_node, seq(12, 500))
    gate.set()
    cache.close()
    assert not worker.is_alive()
    assert cache.check_prefetch_progress("r") and cache.pop_prefetch_loaded_tokens("r") == 0
    assert b.host.available_size() == b.host.size and not cache.root_node.children  # nothing it read was taken
    cache.check_integrity()
    b.drain()


def test_after_close_the_device_and_host_tiers_serve_on_and_storage_is_left_alone(tmp_path):
    store = file_store(tmp_path / "kv")
    eng = engine(store, StoragePolicy(prefetch_threshold=0, background=False))
    eng.finish(eng.admit(seq(9, 100)))
    eng.cache.close()
    writes = store.get_stats().writes
    assert not eng.cache.enable_storage
    req = eng.admit(seq(13, 700))  # the scheduler sees enable_storage False: no prefetch
    eng.finish(req)
    eng.cache.check_hicache_events()
    assert store.get_stats().writes == writes and eng.cache.storage_tier.stats.pages_written == 2
    with pytest.raises(RuntimeError, match="storage tier is closed"):
        eng.cache.prefetch_from_storage("r", eng.cache.root_node, seq(8, 700))
    eng.cache.check_integrity()
    eng.drain()


def test_a_hybrid_cache_closes_its_state_writes_and_workers_too(tmp_path):
    slow = FaultyStorage(file_store(tmp_path / "kv"), delay_rate=1.0, delay_s=0.02)
    eng = HiHybridEngine(1, pages=96, states=12, storage=slow, storage_policy=THREADS)
    req = eng.admit(seq(6, 300))
    eng.finish(req)
    workers = eng.cache.storage_tier.workers.threads()
    assert workers
    eng.cache.close()
    stats = eng.cache.storage_tier.stats
    assert not any(t.is_alive() for t in workers) and stats.pages_written == 6 and stats.states_written == 1
    with pytest.raises(RuntimeError, match="storage tier is closed"):
        eng.cache.prefetch_from_storage("r", eng.cache.root_node, seq(6, 300))
    eng.cache.close()
    eng.drain()


def bare_params():
    pool = MHATokenToKVPool(64, 4, torch.bfloat16, 2, 8, 2, "cpu")
    alloc = PagedTokenToKVPoolAllocator(64, 4, kvcache=pool)
    return pool, CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=4)


def test_a_backend_the_cache_made_is_closed_with_it_and_one_given_to_it_is_not(tmp_path):
    args = SimpleNamespace(hicache_ratio=2.0, hicache_size=0, hicache_mem_layout="layer_first", hicache_write_policy="write_through",
                           hicache_io_backend="direct", hicache_storage_backend="file", hicache_storage_prefetch_policy="best_effort",
                           hicache_storage_backend_extra_config={"file_path": str(tmp_path / "made")})  # fmt: skip
    made = HiRadixCache(bare_params()[1], args)
    pool, params = bare_params()
    given = file_store(tmp_path / "given")
    with_given = HiRadixCache(params, host_pool=MHATokenToKVPoolHost(pool, 2.0, 0, 4, "layer_first"), storage=given,
                              storage_policy=THREADS)  # fmt: skip
    closed = []
    made.storage_tier.storage.close = lambda: closed.append("made")
    given.close = lambda: closed.append("given")
    made.close()
    with_given.close()
    made.close()
    assert closed == ["made"]


@pytest.mark.parametrize("bad", ["30", None, True, -1.0, float("nan")])
def test_close_and_drain_refuse_a_timeout_that_is_not_seconds_before_anything_closes(tmp_path, bad):
    eng = engine(file_store(tmp_path / "kv"))
    eng.finish(eng.admit(seq(9, 100)))
    cache = eng.cache
    cache.storage_tier.drain()
    cache.prefetch_from_storage("r", cache.root_node, seq(12, 100))
    with pytest.raises(ValueError, match=f"timeout_s must be a number of seconds >= 0, got {bad!r}"):
        cache.close(timeout_s=bad)
    with pytest.raises(ValueError, match="timeout_s must be a number of seconds >= 0"):
        cache.storage_tier.close(timeout_s=bad)
    with pytest.raises(ValueError, match="timeout_s must be a number of seconds >= 0"):
        cache.storage_tier.drain(timeout_s=bad)
    tier = cache.storage_tier
    assert cache.enable_storage and not tier.closed and "r" in tier.ongoing_prefetch
    assert all(t.is_alive() for t in tier.workers.threads())
    cache.check_integrity()
    cache.close()
    assert not storage_threads()


@pytest.mark.parametrize("timeout_s", [float("inf"), 1e300])
def test_close_and_drain_wait_without_bound_for_an_infinite_timeout(tmp_path, timeout_s):
    eng = engine(file_store(tmp_path / "kv"))
    eng.finish(eng.admit(seq(9, 100)))
    tier = eng.cache.storage_tier
    assert tier.drain(timeout_s) is True
    eng.cache.close(timeout_s=timeout_s)
    assert tier.closed and not tier.workers.threads() and not storage_threads()
