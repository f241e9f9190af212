"""A prefetch that reads straight into host pages: with a backend that reads into given memory
(``HiCacheFile``'s ``batch_get_regions``) a plain ``HiRadixCache``'s prefetch takes its host pages
when it starts and its worker reads the pages there, loaded back byte for byte as the prefetch that
reads into pages of its own (a backend without the call); the host slots allocated are the tree's
and the prefetches' at every point; pages a worker may still write into stay allocated until it
has left them, across an early end, a close and a reset; the backend call refuses bad regions.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from kvassert import Engine, file_store, seq, stalled_store

from kvpool.cache.records import HOST
from kvpool.cache.storage_tier import StoragePolicy
from kvpool.storage.faults import FaultyStorage

NOW = StoragePolicy(prefetch_threshold=0, background=False)
THREADS = StoragePolicy(prefetch_threshold=0, background=True, prefetch_policy="best_effort")


class TensorReads(FaultyStorage):
    """``storage`` with no read into given memory: prefetches read into pages of their own."""

    @property
    def reads_into_regions(self):
        return False


def engine(store, policy=NOW, **kw):
    return Engine("paged", 4, pages=16, host_policy="write_through", storage=store, storage_policy=policy, **kw)


def written(tmp_path, tokens=seq(13, 500)):
    a = engine(file_store(tmp_path / "kv"))
    a.finish(a.admit(tokens))
    return a


def tree_host_slots(cache):
    count, todo = 0, list(cache.root_node.children.values())
    while todo:
        node = todo.pop()
        count += len(node.records[HOST].slots) if HOST in node.records else 0
        todo.extend(node.children.values())
    return count


def assert_host_held(eng, prefetches: int):
    """The host slots allocated are the tree's and ``prefetches`` slots of the prefetches'."""
    held = sum(len(s) for s in eng.cache.storage_tier.held_host_slots())
    assert held == prefetches
    assert eng.host.size - eng.host.available_size() == tree_host_slots(eng.cache) + held
    eng.cache.check_integrity(eng.running.values())


@pytest.mark.parametrize("into_host", [True, False])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_both_ways_of_reading_load_the_same_bytes(tmp_path, into_host, layout):
    a = Engine("paged", 4, pages=16, host_policy="write_through", storage=file_store(tmp_path / "kv"),
               storage_policy=NOW, layout=layout)  # fmt: skip
    prompt = seq(13, 500)
    a.finish(a.admit(prompt))
    store = FaultyStorage(file_store(tmp_path / "kv")) if into_host else TensorReads(file_store(tmp_path / "kv"))
    b = Engine("paged", 4, pages=16, host_policy="write_through", storage=store, storage_policy=NOW, layout=layout)
    b.ids = a.ids
    assert (b.cache.storage_tier.host_reads is not None) == into_host
    req = b.admit(prompt)  # Engine checks every loaded slot's bytes against the KV its content wrote
    assert b.from_storage == 12 and b.loaded == 12
    assert store.calls.get("batch_get_regions" if into_host else "get") == 3
    assert store.calls.get("get" if into_host else "batch_get_regions") is None
    b.cache.check_integrity(b.running.values())
    b.finish(req)
    b.drain()


def test_a_prefetch_holds_its_host_pages_from_its_start_until_it_ends(tmp_path):
    a = written(tmp_path)
    b = engine(file_store(tmp_path / "kv"))
    b.ids = a.ids
    free = b.host.available_size()
    b.cache.prefetch_from_storage("r", b.cache.root_node, seq(12, 500))
    assert b.host.available_size() == free - 12
    assert_host_held(b, 12)
    assert b.cache.check_prefetch_progress("r") and b.cache.pop_prefetch_loaded_tokens("r") == 12
    assert_host_held(b, 0)
    b.cache.prefetch_from_storage("s", b.cache.root_node, seq(12, 500))  # the tree holds every page now
    assert b.cache.storage_tier.ongoing_prefetch == {}
    assert_host_held(b, 0)
    b.drain()


def test_a_short_read_frees_the_pages_it_did_not_deliver(tmp_path):
    a = written(tmp_path)
    flaky = FaultyStorage(file_store(tmp_path / "kv"), short_calls={"batch_get_regions": {2}})
    b = engine(flaky, StoragePolicy(prefetch_threshold=0, background=False, backoff_s=0.0))
    b.ids = a.ids
    req = b.admit(seq(13, 500))  # the first page from storage, the second reads short: computed
    assert b.from_storage == 4
    assert_host_held(b, 0)
    b.finish(req)
    b.drain()


def test_a_host_without_room_reads_into_pages_of_its_own(tmp_path):
    a = written(tmp_path)
    b = engine(file_store(tmp_path / "kv"), host_ratio=0.5)
    b.ids = a.ids
    taken = b.host.alloc(b.host.available_size())  # no room for the prefetch's pages now
    b.cache.prefetch_from_storage("r", b.cache.root_node, seq(12, 500))
    (op,) = b.cache.storage_tier.ongoing_prefetch.values()
    assert op.slots is None and len(op.pages) == 3
    b.host.free(taken)
    assert b.cache.check_prefetch_progress("r") and b.cache.pop_prefetch_loaded_tokens("r") == 12
    b.cache.check_integrity()
    b.drain()


def stalled_prefetch(tmp_path):
    """An engine whose prefetch of a 12-token prompt (3 pages) has read its first page, its worker
    held inside the second read until the returned event is set: ``(engine, cache, go)``."""
    a = written(tmp_path)
    slow, inside, go = stalled_store(tmp_path / "kv", "batch_get_regions", 2)
    b = engine(slow, THREADS)
    b.ids = a.ids
    b.cache.prefetch_from_storage("r", b.cache.root_node, seq(12, 500))
    assert inside.wait(10)
    return b, b.cache, go


@pytest.mark.parametrize("end", ["progress", "abort", "close"])
def test_pages_a_worker_still_writes_into_stay_allocated_until_it_leaves_them(tmp_path, end):
    b, cache, go = stalled_prefetch(tmp_path)
    if end == "progress":
        assert cache.check_prefetch_progress("r") and cache.pop_prefetch_loaded_tokens("r") == 4
        assert_host_held(b, 8)  # the page being read and the one after it: parked
    elif end == "abort":
        cache.release_aborted_request("r")
        assert_host_held(b, 12)
    else:
        with pytest.raises(TimeoutError):
            cache.close(timeout_s=0.1)
        assert_host_held(b, 12)
    go.set()
    if end == "close":
        cache.close()
    else:
        assert cache.storage_tier.drain()
    assert_host_held(b, 0)
    b.drain()
    cache.close()  # (its worker threads joined)


def test_a_reset_waits_for_a_read_still_writing_into_a_prefetchs_pages(tmp_path):
    b, cache, go = stalled_prefetch(tmp_path)
    opened = []
    opener = threading.Timer(0.3, lambda: (opened.append(time.monotonic()), go.set()))
    opener.start()
    cache.reset()  # the host pool is cleared: the worker must be out of its pages before reset returns
    returned = time.monotonic()
    opener.join()
    assert opened and returned >= opened[0]
    assert cache.storage_tier.held_host_slots() == [] and b.host.available_size() == b.host.size
    assert cache.storage_tier.drain()
    assert b.host.available_size() == b.host.size  # nothing freed twice or late
    cache.check_integrity()
    cache.close()


def test_the_file_backend_reads_pages_into_given_regions(tmp_path):
    a = written(tmp_path)
    store = a.cache.storage_tier.storage
    keys = a.cache.storage_tier.keys_of(next(iter(a.cache.root_node.children.values())))
    slots = a.host.alloc(4 * len(keys))
    regions = store.host_page_regions(keys, slots)
    assert store.batch_get_regions(keys + ["absent"], regions + [regions[0]])[:-1] == [True] * len(keys)
    for i, key in enumerate(keys):
        want = store.get(key)
        got = a.host.get_data_page(int(slots[4 * i])).view(torch.uint8)
        assert torch.equal(got, want)
    a.host.free(slots)
    with pytest.raises(ValueError, match="indices must hold whole pages of 4 slots, got 3 entries"):
        a.host.sync_pages_for_write(slots[:3])
    for bad, message in (
        (regions[:1], r"regions must be a list of 3 entries \(one per key\), got 1 entries"),
        ([regions[0], regions[1], "x"], r"regions\[2\] must be a list of \(address, size\) blocks, got str"),
        ([regions[0], regions[1], [(0, 8)]], r"regions\[2\]\[0\] must be an \(int address > 0, int size >= 0\) tuple, got \(0, 8\)"),
        ([regions[0], regions[1], [(8, -1)]], r"regions\[2\]\[0\] must be an \(int address > 0, int size >= 0\) tuple, got \(8, -1\)"),
    ):
        with pytest.raises(ValueError, match=message):
            store.batch_get_regions(keys, bad)
    a.drain()
