"""KV events of the storage tier: a page written through to storage is announced (``BlockStored``
of the storage medium) with the same block hash, parent and tokens as its device event, once; a
page announced that a prefetch finds missing (the store evicted it, or it reads as a miss) is
withdrawn (``BlockRemoved`` of that medium); closing the tier withdraws every page it announced;
no events unless they are enabled. The medium is ``DISK`` for the file store and ``EXTERNAL`` for
Mooncake.
"""

from __future__ import annotations

import dataclasses

from kvassert import Engine, file_store, seq

from kvpool.cache import MEDIUM_DISK, MEDIUM_EXTERNAL, BlockRemoved, BlockStored, EvictParams
from kvpool.cache.storage_events import storage_medium
from kvpool.cache.storage_tier import StoragePolicy
from kvpool.storage import page_keys
from kvpool.storage.faults import FaultyStorage
from kvpool.storage.mooncake import MooncakeStore

NOW = StoragePolicy(prefetch_threshold=0, background=False)


def engine(store, policy=NOW, **kw):
    eng = Engine("paged", 4, pages=16, host_policy="write_through", storage=store, storage_policy=policy,
                 enable_kv_cache_events=True, **kw)  # fmt: skip
    eng.cache.take_events()  # the construction's AllBlocksCleared
    return eng


def on_disk(device_events):
    """The storage tier's announcement of the pages of ``device_events``."""
    return [dataclasses.replace(e, medium=MEDIUM_DISK) for e in device_events]


def hashes(events):
    return [e.block_hashes[0] for e in events]


def polled(eng):
    eng.cache.check_hicache_events()
    return eng.cache.take_events()


def forget_everywhere(eng):
    """Evict every page from the device and the host tier; returns the device's events."""
    eng.cache.evict(EvictParams(num_tokens=eng.size))
    eng.cache.evict_host(eng.host.size)
    return eng.cache.take_events()


def page_bytes_on_disk(path):
    eng = engine(file_store(path))
    eng.finish(eng.admit(seq(5, 1)))
    stats = eng.cache.storage_tier.storage.get_stats()
    return stats.bytes // stats.pages


def test_storage_events_of_write_through_eviction_prefetch_and_close(tmp_path):
    per_page = page_bytes_on_disk(tmp_path / "probe")
    store = file_store(tmp_path / "kv", max_bytes=4 * per_page + per_page // 2)  # four pages fit
    eng = engine(store)
    p1, p2 = seq(17, 500), seq(17, 900)
    eng.finish(eng.admit(p1))
    gpu1 = eng.cache.take_events()
    assert [(type(e), e.medium) for e in gpu1] == [(BlockStored, "GPU")] * 4
    assert polled(eng) == on_disk(gpu1)  # written through: the same four pages, in storage
    # gone from the device and the host, prefetched back: the device announces them again, storage holds them still
    assert forget_everywhere(eng) == [BlockRemoved(hashes(gpu1), medium="GPU")]
    eng.finish(eng.admit(p1))
    assert eng.from_storage == 16 and polled(eng) == gpu1
    # computed again and written through again: announced once already
    forget_everywhere(eng)
    eng.cache.enable_storage = False  # the scheduler skips the prefetch
    eng.finish(eng.admit(p1))
    eng.cache.enable_storage = True
    assert polled(eng) == gpu1
    # another prompt's pages make the store evict the first's, silently
    eng.finish(eng.admit(p2))
    gpu2 = eng.cache.take_events()
    assert polled(eng) == on_disk(gpu2)
    assert not any(store.exists(k) for k in page_keys(p1[:16], 4))
    # a prefetch finds the first page missing: withdrawn; recomputed, its write announces it again
    forget_everywhere(eng)
    eng.finish(eng.admit(p1))
    assert eng.from_storage == 16
    assert polled(eng) == gpu1 + [BlockRemoved(hashes(gpu1)[:1], medium=MEDIUM_DISK)] + on_disk(gpu1)[:1]
    # closing withdraws every page announced, once
    eng.cache.close()
    (gone,) = eng.cache.take_events()
    assert gone.medium == MEDIUM_DISK and sorted(gone.block_hashes) == sorted(hashes(gpu1) + hashes(gpu2))
    eng.cache.close()
    assert polled(eng) == []
    eng.drain()


def test_a_page_that_reads_as_a_miss_is_withdrawn(tmp_path):
    eng = engine(FaultyStorage(file_store(tmp_path / "kv"), fail_calls={"get": {2}, "batch_get_regions": {2}}))  # the second page read misses
    prompt = seq(17, 500)
    eng.finish(eng.admit(prompt))
    gpu = eng.cache.take_events()
    assert polled(eng) == on_disk(gpu)
    forget_everywhere(eng)
    eng.finish(eng.admit(prompt))  # the first page from storage, the rest computed and written through
    assert eng.from_storage == 4
    disk = [e for e in polled(eng) if e.medium == MEDIUM_DISK]
    assert disk == [BlockRemoved(hashes(gpu)[1:2], medium=MEDIUM_DISK)] + on_disk(gpu)[1:2]
    eng.drain()


def test_eagle_pages_are_announced_with_their_device_hashes(tmp_path):
    eng = engine(file_store(tmp_path / "kv"), is_eagle=True)
    eng.finish(eng.admit(seq(17, 500)))
    gpu = eng.cache.take_events()
    assert len(gpu) == 4 and polled(eng) == on_disk(gpu)
    eng.drain()


def test_pages_written_by_worker_threads_are_announced_at_the_next_poll_after_the_write(tmp_path):
    eng = engine(file_store(tmp_path / "kv"), StoragePolicy(prefetch_threshold=0))
    eng.finish(eng.admit(seq(17, 500)))
    gpu = eng.cache.take_events()
    assert eng.cache.storage_tier.drain()
    assert polled(eng) == on_disk(gpu)
    eng.cache.close()
    eng.drain()


def test_no_storage_events_unless_enabled(tmp_path):
    eng = Engine("paged", 4, pages=16, host_policy="write_through", storage=file_store(tmp_path / "kv"), storage_policy=NOW)
    eng.finish(eng.admit(seq(17, 500)))
    eng.cache.check_hicache_events()
    eng.cache.close()
    assert eng.cache.take_events() == [] and eng.cache.storage_tier.events.announced == {}
    eng.drain()


def test_the_medium_is_disk_for_the_file_store_and_external_for_mooncake(tmp_path):
    disk = file_store(tmp_path / "kv")
    mooncake = MooncakeStore.__new__(MooncakeStore)  # the kind is enough: no store to reach
    assert storage_medium(disk) == storage_medium(FaultyStorage(disk)) == MEDIUM_DISK == "DISK"
    assert storage_medium(mooncake) == storage_medium(FaultyStorage(FaultyStorage(mooncake))) == MEDIUM_EXTERNAL == "EXTERNAL"
