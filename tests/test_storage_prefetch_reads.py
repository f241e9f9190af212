"""What a prefetch reads from storage: only the pages the tree lacks. Pages the device or the host
holds already below ``last_host_node`` are neither looked up nor read again (every storage call is
recorded by key), for plain keys and for a hybrid model's cache; with EAGLE's bigram keys the
prefetch works from plain tokens or bigrams, under the page keys of the bigrams the tree stores,
and loads them byte for byte.
"""

from __future__ import annotations

import numpy as np
import pytest
from kvassert import Engine, HiHybridEngine, file_store, seq, stalled_store

from kvpool.cache import EvictParams, RadixKey
from kvpool.cache.records import HOST, STATE
from kvpool.cache.storage_tier import StoragePolicy
from kvpool.storage import page_keys
from kvpool.storage.faults import FaultyStorage

NOW = StoragePolicy(prefetch_threshold=0, background=False)


class CountingStorage(FaultyStorage):
    """``storage`` with the keys of every ``batch_exists`` and page read (``get``, ``batch_get_regions``) recorded."""

    def __init__(self, storage):
        super().__init__(storage)
        self.looked_up: list[list[str]] = []
        self.read: list[str] = []

    def batch_exists(self, keys, extra_info=None):
        self.looked_up.append(list(keys))
        return super().batch_exists(keys, extra_info)

    def get(self, key, target_location=None, target_sizes=None):
        self.read.append(key)
        return super().get(key, target_location, target_sizes)

    def batch_get_regions(self, keys, regions):
        self.read.extend(keys)
        return super().batch_get_regions(keys, regions)


def engine(store, host_policy="write_through", **kw):
    return Engine("paged", 4, pages=16, host_policy=host_policy, storage=store, storage_policy=NOW, **kw)


def computed_without_storage(eng, tokens):
    """``eng`` serves ``tokens`` computing every page itself (its scheduler skips the prefetch)."""
    eng.cache.enable_storage = False
    eng.finish(eng.admit(tokens))
    eng.cache.enable_storage = True


@pytest.mark.parametrize("held", ["device", "host"])
def test_a_prefetch_reads_only_the_pages_the_tree_lacks(tmp_path, held):
    prompt = seq(17, 500)
    a = engine(file_store(tmp_path / "kv"))
    a.finish(a.admit(prompt))  # storage: all four pages
    store = CountingStorage(file_store(tmp_path / "kv"))
    b = engine(store, "write_through_selective" if held == "device" else "write_through")
    b.ids = a.ids
    computed_without_storage(b, prompt[:9])  # the first two pages
    if held == "host":
        b.cache.evict(EvictParams(num_tokens=b.size))
    (node,) = b.cache.root_node.children.values()
    assert (node.device is not None, HOST in node.records) == ((True, False) if held == "device" else (False, True))
    keys = page_keys(prompt[:16], 4)
    b.cache.prefetch_from_storage("r", b.cache.root_node, prompt[:16])
    assert store.looked_up == [keys[2:]] and store.read == keys[2:]
    assert b.cache.check_prefetch_progress("r") and b.cache.pop_prefetch_loaded_tokens("r") == 8
    assert b.cache.storage_tier.stats.tokens_dropped == 0
    b.cache.check_integrity()
    b.cache.prefetch_from_storage("s", b.cache.root_node, prompt[:16])  # the tree holds every page now
    assert store.looked_up == [keys[2:]] and "s" not in b.cache.storage_tier.ongoing_prefetch
    req = b.admit(prompt)  # loads back what the host holds: Engine checks every loaded slot's bytes
    assert req.cache_protected_len == 16 and store.read == keys[2:]
    b.cache.check_integrity(b.running.values())
    b.finish(req)
    b.drain()


def bigrams(tokens):
    return list(zip(tokens[:-1], tokens[1:]))


def test_eagle_bigram_keys_prefetch_the_pages_of_the_bigrams_the_tree_stores(tmp_path):
    prompt = seq(17, 500)
    a = engine(file_store(tmp_path / "kv"), is_eagle=True)
    a.finish(a.admit(prompt))  # the tree stores the 16 bigrams of the 17 tokens: four pages
    keys = page_keys(np.array(bigrams(prompt)), 4)
    plain = page_keys(prompt[:16], 4)
    written = file_store(tmp_path / "kv", a.host)
    assert a.cache.storage_tier.stats.pages_written == 4
    assert [written.exists(k) for k in keys] == [True] * 4 and not any(written.exists(k) for k in plain)
    store = CountingStorage(file_store(tmp_path / "kv"))
    b = engine(store, is_eagle=True)
    b.ids = a.ids
    req = b.admit(prompt)  # plain tokens: 15 bigrams of the 16 before the last, three whole pages
    assert store.read == keys[:3] and b.from_storage == 12 and b.loaded == 12 and req.cache_protected_len == 12
    b.cache.check_integrity(b.running.values())
    b.finish(req)
    b.drain()
    c = engine(file_store(tmp_path / "kv"), is_eagle=True)
    c.ids = a.ids
    c.cache.prefetch_from_storage("r", c.cache.root_node, RadixKey(bigrams(prompt), is_bigram=True))
    assert c.cache.check_prefetch_progress("r") and c.cache.pop_prefetch_loaded_tokens("r") == 16
    c.cache.check_integrity()


def test_bigrams_are_refused_by_a_cache_of_plain_keys(tmp_path):
    eng = engine(file_store(tmp_path / "kv"))
    with pytest.raises(ValueError, match=r"new_input_tokens must be tokens like the tree's keys \(is_eagle=False\), got shape \(4, 2\)"):
        eng.cache.prefetch_from_storage("r", eng.cache.root_node, RadixKey(bigrams(seq(5, 1)), is_bigram=True))
    assert eng.cache.storage_tier.ongoing_prefetch == {}


def test_a_hybrid_prefetch_reads_only_the_pages_past_the_state_the_tree_holds(tmp_path):
    prompt = seq(8, 300)
    a = HiHybridEngine(1, pages=96, states=12, storage=file_store(tmp_path / "kv"), storage_policy=NOW)
    a.finish(a.admit(prompt))  # storage: eight pages, and the state after them
    store = CountingStorage(file_store(tmp_path / "kv"))
    b = HiHybridEngine(1, pages=96, states=12, storage=store, storage_policy=NOW)
    b.ids = a.ids
    b.cache.enable_storage = False
    b.finish(b.admit(prompt[:4]))  # the first four tokens, with their state
    b.cache.enable_storage = True
    (node,) = b.cache.root_node.children.values()
    assert len(node.key) == 4 and node.device is not None and STATE in node.records
    keys = page_keys(prompt, 1)
    b.cache.prefetch_from_storage("r", b.cache.root_node, prompt)
    assert store.looked_up == [keys[4:]] and [k for k in store.read if k in keys] == keys[4:]
    assert b.cache.check_prefetch_progress("r") and b.cache.pop_prefetch_loaded_tokens("r") == 4
    b.cache.check_integrity()
    b.drain()
    a.drain()


@pytest.mark.parametrize("end", ["abort", "progress"])
def test_a_page_that_arrives_after_its_prefetch_ended_is_neither_taken_nor_counted(tmp_path, end):
    """Every page counted as read is counted as loaded or dropped, when the prefetch ends while a
    worker is inside a read."""
    first = engine(file_store(tmp_path / "kv"))
    first.finish(first.admit(seq(13, 500)))
    slow, entered, gate = stalled_store(tmp_path / "kv", "batch_get_regions", 2)
    eng = Engine("paged", 4, pages=16, host_policy="write_through", storage=slow,
                 storage_policy=StoragePolicy(prefetch_threshold=0, background=True))  # fmt: skip
    eng.ids = first.ids
    cache = eng.cache
    cache.prefetch_from_storage("r", cache.root_node, seq(12, 500))
    assert entered.wait(10)  # the first page is read; the worker is inside the second read
    if end == "abort":
        cache.release_aborted_request("r")
    else:
        assert cache.check_prefetch_progress("r")
    gate.set()
    assert cache.storage_tier.drain()
    s = cache.storage_tier.stats
    assert s.pages_read == 1 and s.pages_read * 4 == s.tokens_loaded + s.tokens_dropped
    assert s.tokens_loaded == (4 if end == "progress" else 0)
    cache.check_integrity(eng.running.values())
    cache.close()
