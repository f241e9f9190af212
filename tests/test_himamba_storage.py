"""``HiMambaRadixCache`` over a storage tier: a node's KV pages and its state snapshot are written
through to storage, and another engine (or the same one once its host copies are gone) fetches
them back, storage -> host -> device, byte for byte (``HiHybridEngine`` checks every loaded KV row
and state against what its content wrote); a prefix whose state storage lacks is never served from
its KV alone; state keys never name a page, another prefix's state or another state layout; the
integrity check covers the storage tier.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from kvassert import STATE as STATE_PARAMS
from kvassert import HiHybridEngine, file_store, seq, stalled_store
from kvpool import HybridLinearKVPool, HybridPoolHost, MambaPool
from kvpool.cache import EvictParams, MatchPrefixParams, RadixKey
from kvpool.cache.himamba_host import HOST_STATE
from kvpool.cache.storage_tier import StoragePolicy
from kvpool.errors import IntegrityError
from kvpool.pools.state_params import MambaCacheParams, MambaStateDType, MambaStateShape
from kvpool.storage import page_keys
from kvpool.storage.faults import FaultyStorage
from kvpool.storage.keys import state_geometry, state_key
from kvpool.storage.mooncake_config import import_store_class

try:
    import_store_class()
    NO_MOONCAKE = None
except ImportError as e:
    NO_MOONCAKE = str(e)

NOW = StoragePolicy(prefetch_threshold=0, background=False)


def engine(store, page=1, policy=NOW, **kw):
    extra = page > 1
    return HiHybridEngine(page, pages=96 // page, states=12, extra=extra, storage=store, storage_policy=policy, **kw)


def second(first, store, **kw):
    """Another engine over the same storage, writing the same KV and state patterns as ``first``."""
    eng = engine(store, first.page, **kw)
    eng.ids = first.ids
    return eng


def serve(eng, tokens, extra=None):
    req = eng.admit(tokens, extra)
    assert req is not None
    eng.finish(req)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("page", [1, 4])
def test_another_engine_loads_kv_and_state_from_storage_byte_for_byte(tmp_path, page, layout):
    a = engine(file_store(tmp_path / "kv"), page, layout=layout)
    prompt = seq(4 * page + 1, 300)
    serve(a, prompt)
    stats = a.cache.storage_tier.stats
    assert stats.pages_written >= 4 and stats.states_written >= 1 and stats.write_failures == stats.state_write_failures == 0
    b = second(a, file_store(tmp_path / "kv"), layout=layout)
    req = b.admit(prompt + [7] * page)  # prefetch, host, device: every loaded row and state byte checked
    want = len(prompt) // page * page
    assert b.from_storage == want and b.loaded == want and b.states_loaded == 1
    assert req.cache_protected_len == want
    b.cache.check_integrity(b.running.values())
    b.drain()
    a.drain()


def test_a_prefix_evicted_from_both_tiers_comes_back_from_storage_with_its_state(tmp_path):
    eng = engine(file_store(tmp_path / "kv"))
    prompt = seq(9, 700)
    serve(eng, prompt)
    eng.cache.evict(EvictParams(num_tokens=eng.size, mamba_num=eng.pool.size))
    eng.cache.evict_host(eng.host.kv_host.size)
    assert not eng.cache.root_node.children
    req = eng.admit(prompt + [1])
    assert eng.from_storage == 9 and eng.loaded == 9 and eng.states_loaded == 1 and req.cache_protected_len == 9
    eng.cache.check_integrity(eng.running.values())
    eng.drain()


def test_kv_pages_whose_state_storage_lacks_are_never_served(tmp_path):
    store = FaultyStorage(file_store(tmp_path / "kv"), fail_calls={"set": set(range(1, 1000))})  # every state write fails
    a = engine(store)
    prompt = seq(8, 900)
    serve(a, prompt)
    stats = a.cache.storage_tier.stats
    assert stats.pages_written == 8 and stats.states_written == 0 and stats.state_write_failures >= 1
    b = second(a, file_store(tmp_path / "kv"))
    m = b.cache.match_prefix(MatchPrefixParams(key=RadixKey(prompt)))
    b.cache.prefetch_from_storage("r", m.last_host_node, prompt)
    assert b.cache.check_prefetch_progress("r") and b.cache.pop_prefetch_loaded_tokens("r") == 0
    assert not b.cache.root_node.children and b.host.kv_host.available_size() == b.host.kv_host.size
    assert b.cache.storage_tier.stats.states_missing == 1
    req = b.admit(prompt + [1])  # computed from scratch, nothing loaded
    assert req.cache_protected_len == 0 and b.loaded == 0
    b.drain()


def test_pages_past_the_deepest_stored_state_are_dropped(tmp_path):
    a = engine(file_store(tmp_path / "kv"))
    p = seq(4, 100)
    serve(a, p)  # a state after 4 tokens
    store = FaultyStorage(file_store(tmp_path / "kv"), fail_calls={"set": set(range(1, 1000))})
    longer = engine(store)
    longer.ids = a.ids
    serve(longer, p + seq(4, 200))  # its 8 pages stored, its state after 8 tokens not
    b = second(a, file_store(tmp_path / "kv"))
    req = b.admit(p + seq(4, 200) + [1])
    assert b.from_storage == 4 and req.cache_protected_len == 4 and b.states_loaded == 1
    assert b.cache.storage_tier.stats.tokens_dropped == 4
    b.drain()


def test_state_bytes_round_trip_through_the_host_pool_and_storage_exactly(tmp_path):
    a = engine(file_store(tmp_path / "kv"))
    prompt = seq(5, 40)
    serve(a, prompt)
    node = a.cache.root_node.children[next(iter(a.cache.root_node.children))]
    slot = int(node.records[HOST_STATE].slot[0])
    want = torch.cat([b.reshape(-1) for b in a.state_bytes(int(node.mamba_value))])
    host = a.host.state_host
    assert torch.equal(host.get_data_page(slot), want)  # the device state's bytes, as the host holds them
    key = state_key(page_keys(prompt, 1)[-1], state_geometry(host))
    stored = file_store(tmp_path / "kv", host=a.host.kv_host).get(key)
    assert stored is not None and torch.equal(stored.view(torch.uint8), want)
    noise = torch.randint(0, 256, (host.slot_bytes,), dtype=torch.uint8)
    free = host.alloc(1)
    host.set_from_flat_data_page(int(free[0]), noise)
    assert torch.equal(host.get_data_page(int(free[0])), noise)
    host.free(free)
    a.drain()


def test_state_keys_name_one_prefix_in_one_state_layout():
    pool = MambaPool(size=4, cache_params=STATE_PARAMS, device="cpu")
    other = MambaCacheParams(
        MambaStateShape(conv=STATE_PARAMS.shape.conv, temporal=STATE_PARAMS.shape.temporal), STATE_PARAMS.layers,
        MambaStateDType(conv=torch.float32, temporal=torch.float32),
    )  # fmt: skip
    kv = HybridLinearKVPool(8, torch.float8_e4m3fn, 1, 2, 4, [0, 2], False, "cpu", pool, warmup=False)
    geometry = state_geometry(HybridPoolHost(kv, 1.0, 0, 1, "layer_first").state_host)
    kv2 = HybridLinearKVPool(8, torch.float8_e4m3fn, 1, 2, 4, [0, 2], False, "cpu", MambaPool(size=4, cache_params=other, device="cpu"), warmup=False)
    geometry2 = state_geometry(HybridPoolHost(kv2, 1.0, 0, 1, "layer_first").state_host)
    assert geometry != geometry2
    k = page_keys([1, 2, 3], 1)
    keys = {state_key(x, g) for x in k for g in (geometry, geometry2)}
    assert len(keys) == 6 and not keys & set(k)
    assert state_key(k[1], geometry) == state_key(page_keys([2], 1, prior_key=k[0])[0], geometry)
    with pytest.raises(ValueError, match="page_key must be a page key"):
        state_key("abc", geometry)


def test_a_stored_state_of_another_size_reads_as_a_miss(tmp_path):
    store = FaultyStorage(file_store(tmp_path / "kv"), fail_calls={"set": set(range(1, 1000))})
    a = engine(store)
    prompt = seq(6, 50)
    serve(a, prompt)
    plain = file_store(tmp_path / "kv", host=a.host.kv_host)
    key = state_key(page_keys(prompt, 1)[-1], state_geometry(a.host.state_host))
    assert plain.set(key, torch.zeros(a.host.state_host.slot_bytes - 1, dtype=torch.uint8))
    b = second(a, file_store(tmp_path / "kv"))
    req = b.admit(prompt + [1])
    assert req.cache_protected_len == 0 and b.from_storage == 0
    b.drain()


@pytest.mark.parametrize("form", [list, torch.tensor, np.array, RadixKey], ids=["list", "tensor", "numpy", "radix_key"])
def test_a_device_node_without_a_host_copy_prefetches_after_its_backed_up_ancestor(tmp_path, form):
    a = engine(file_store(tmp_path / "kv"))
    prompt = seq(8, 600)
    serve(a, prompt)
    b = second(a, file_store(tmp_path / "kv"), host_policy="write_back")
    serve(b, prompt[:4])  # on b's device, with its state, not on b's host (write_back)
    m = b.cache.match_prefix(MatchPrefixParams(key=RadixKey(prompt)))
    assert len(m.device_indices) == 4 and m.last_host_node is m.last_device_node
    b.cache.prefetch_from_storage("r", m.last_host_node, form(prompt[4:]))  # every form the tokens come in
    assert b.cache.check_prefetch_progress("r") and b.cache.pop_prefetch_loaded_tokens("r") == 4
    req = b.admit(prompt + [1])
    assert req.cache_protected_len == 8 and b.states_loaded == 1
    b.drain()


def test_the_integrity_check_covers_the_storage_tier(tmp_path):
    eng = engine(file_store(tmp_path / "kv"))
    serve(eng, seq(6, 10))
    eng.cache.check_integrity()
    eng.cache.storage_tier.prefetch_pages += 1
    with pytest.raises(IntegrityError, match="the prefetches in flight count 1 pages but have 0"):
        eng.cache.check_integrity()
    eng.cache.storage_tier.prefetch_pages -= 1
    eng.drain()


def test_reset_drops_prefetches_and_keeps_storage(tmp_path):
    a = engine(file_store(tmp_path / "kv"))
    prompt = seq(8, 321)
    serve(a, prompt)
    a.cache.evict(EvictParams(num_tokens=a.size, mamba_num=a.pool.size))
    a.cache.reset()
    assert not a.cache.storage_tier.ongoing_prefetch and a.host.state_host.available_size() == a.host.state_host.size
    req = a.admit(prompt + [2])
    assert req.cache_protected_len == 8 and a.from_storage == 8
    a.drain()


def test_bad_input_is_refused_before_anything_changes(tmp_path):
    eng = engine(file_store(tmp_path / "kv"), host_policy="write_back")
    serve(eng, seq(6, 20), extra="t")
    node = eng.cache.root_node.children[next(iter(eng.cache.root_node.children))]
    assert node.device is not None and "host" not in node.records  # on the device only (write_back)
    free = eng.host.state_host.available_size()
    for call, error, message in (
        (lambda: eng.cache.prefetch_from_storage("r", node, RadixKey([1, 2], "u")), ValueError, "extra_key must be last_host_node's 't'"),
        (lambda: eng.cache.prefetch_from_storage("r", node, 7), ValueError, "new_input_tokens must be a token list"),
        (lambda: eng.cache.prefetch_from_storage("r", object(), [1]), TypeError, "last_host_node must be a TreeNode"),
        (lambda: eng.host.state_host.set_from_flat_data_page(0, torch.zeros(3, dtype=torch.uint8)), ValueError, "must hold"),
        (lambda: eng.host.state_host.set_from_flat_data_page(0, torch.zeros(eng.host.state_host.slot_bytes)), ValueError,
         "1-D uint8 CPU tensor"),
        (lambda: eng.host.state_host.get_data_page(eng.host.state_host.size), ValueError, "index must be a host slot in"),
    ):
        with pytest.raises(error, match=message):
            call()
    assert not eng.cache.storage_tier.ongoing_prefetch and eng.host.state_host.available_size() == free
    eng.cache.check_integrity()
    eng.drain()


@pytest.mark.parametrize("policy", ["wait_complete", "timeout"])
def test_worker_threads_fetch_kv_and_state_behind_a_slow_store(tmp_path, policy):
    a = engine(file_store(tmp_path / "kv"))
    prompt = seq(10, 800)
    serve(a, prompt)
    slow = FaultyStorage(file_store(tmp_path / "kv"), delay_rate=1.0, delay_s=0.01)
    policy = StoragePolicy(prefetch_policy=policy, prefetch_threshold=0, prefetch_timeout_base_s=20.0)
    b = second(a, slow, policy=policy)
    req = b.admit(prompt + [3])  # waits until the worker has read every page and the state
    assert b.from_storage == 10 and b.states_loaded == 1 and req.cache_protected_len == 10
    assert b.cache.storage_tier.drain()
    b.drain()
    b.cache.storage_tier.close()


def test_best_effort_takes_nothing_before_the_pages_and_their_state_are_both_read(tmp_path):
    a = engine(file_store(tmp_path / "kv"))
    prompt = seq(10, 900)
    serve(a, prompt)
    slow = FaultyStorage(file_store(tmp_path / "kv"), delay_rate=1.0, delay_s=0.05)
    b = second(a, slow, policy=StoragePolicy(prefetch_policy="best_effort", prefetch_threshold=0))
    m = b.cache.match_prefix(MatchPrefixParams(key=RadixKey(prompt)))
    b.cache.prefetch_from_storage("r", m.last_host_node, prompt)
    assert b.cache.check_prefetch_progress("r") and b.cache.pop_prefetch_loaded_tokens("r") == 0  # at once: nothing yet
    assert not b.cache.root_node.children
    assert b.cache.storage_tier.drain()
    b.cache.check_integrity()
    assert b.host.kv_host.available_size() == b.host.kv_host.size
    assert b.host.state_host.available_size() == b.host.state_host.size
    b.cache.storage_tier.close()
    b.drain()


@pytest.mark.skipif(NO_MOONCAKE is not None, reason=NO_MOONCAKE or "")
def test_two_engines_share_kv_and_states_through_a_mooncake_store():
    from kvpool.storage import HiCacheStorageConfig
    from kvpool.storage.mooncake import MooncakeStore
    from kvpool.storage.mooncake_master import MooncakeMaster

    small = dict(global_segment_size=16 << 20, local_buffer_size=16 << 20, connect_timeout_s=3.0, retry_interval_s=0.5)
    with MooncakeMaster() as master:
        def client():
            return MooncakeStore(HiCacheStorageConfig(model_name="m"), master_server_address=master.master_server_address,
                                 metadata_server=master.metadata_server, **small)  # fmt: skip

        store_a, store_b = client(), client()
        try:
            a = engine(store_a, 4)
            prompt = seq(17, 400)
            serve(a, prompt)
            assert a.cache.storage_tier.stats.states_written >= 1
            b = second(a, store_b)
            req = b.admit(prompt + [1] * 4)
            assert b.from_storage == 16 and b.states_loaded == 1 and req.cache_protected_len == 16
            b.drain()
            a.drain()
        finally:
            store_a.close()
            store_b.close()


def test_a_host_tombstone_takes_the_state_storage_holds_for_it(tmp_path):
    """The tree holds a prefix's KV on the host without its state (a tombstone, its children parked):
    a prefetch that finds that state in storage gives it to the tombstone, and a match ends there."""
    a = engine(file_store(tmp_path / "kv"))
    b = second(a, file_store(tmp_path / "kv"))
    p = seq(4, 100)
    serve(b, p + [1, 2])
    serve(b, p + [3, 4])  # the node of p is a split: no state of its own
    serve(a, p)  # storage: the state after p too
    assert a.cache.storage_tier.stats.states_written == 1
    b.cache.check_hicache_events()
    b.cache.evict(EvictParams(num_tokens=b.size, mamba_num=b.pool.size))
    inner = b.cache.root_node.children[next(iter(b.cache.root_node.children))]
    assert list(inner.key.token_ids) == p and inner.device is None and HOST_STATE not in inner.records
    req = b.admit(p + [9])  # prefetch: the pages are in the tree, the state is taken by the tombstone
    assert b.cache.storage_tier.stats.states_adopted == 1 and b.from_storage == 0
    assert req.cache_protected_len == 4 and b.states_loaded == 1  # loaded back from the host, state checked
    b.cache.check_integrity(b.running.values())
    b.drain()


def test_a_host_write_that_raises_while_taking_the_fetch_leaves_both_host_pools_as_they_were(tmp_path, monkeypatch):
    a = engine(file_store(tmp_path / "kv"))
    prompt = seq(8, 555)
    serve(a, prompt)
    b = second(a, file_store(tmp_path / "kv"))
    kv_free, state_free = b.host.kv_host.available_size(), b.host.state_host.available_size()

    def broken(index, data_page):
        raise RuntimeError("host memory fault")

    monkeypatch.setattr(b.host.state_host, "set_from_flat_data_page", broken)
    b.cache.prefetch_from_storage("r", b.cache.root_node, prompt)
    with pytest.raises(RuntimeError, match="host memory fault"):
        b.cache.check_prefetch_progress("r")
    assert b.host.kv_host.available_size() == kv_free and b.host.state_host.available_size() == state_free
    assert not b.cache.root_node.children and not b.cache.storage_tier.ongoing_prefetch
    b.cache.check_integrity()
    monkeypatch.undo()
    req = b.admit(prompt + [1])  # storage still serves it
    assert req.cache_protected_len == 8 and b.from_storage == 8
    b.drain()


@pytest.mark.parametrize("pool", ["kv_host", "state_host"])
def test_a_host_page_that_cannot_be_read_for_storage_is_a_failed_write_and_no_cache_call_raises(tmp_path, monkeypatch, pool):
    """Write-through reads each host page it stores; one that raises there fails that write as a
    backend failure would (counted, the tier backs off) while the request finishes whole."""
    a = engine(file_store(tmp_path / "kv"), policy=StoragePolicy(prefetch_threshold=0, background=False, backoff_s=0.0))
    host = getattr(a.host, pool)
    real = host.get_data_page
    calls = []

    def broken(index, *args, **kwargs):
        calls.append(index)
        if len(calls) == 1:
            raise RuntimeError("host memory fault")
        return real(index, *args, **kwargs)

    monkeypatch.setattr(host, "get_data_page", broken)
    first, later = seq(8, 555), seq(8, 777)
    serve(a, first)
    stats = a.cache.storage_tier.stats
    failures = stats.write_failures if pool == "kv_host" else stats.state_write_failures
    assert calls and failures == 1
    a.cache.check_integrity(a.running.values())
    serve(a, later)  # the tier writes again after its (zero) back-off
    a.cache.check_hicache_events()
    a.cache.check_integrity(a.running.values())
    b = second(a, file_store(tmp_path / "kv"))
    req = b.admit(later + [1])
    assert req.cache_protected_len == 8 and b.from_storage == 8
    b.drain()
    req = b.admit(first + [1])  # the failed write stored nothing that could be served
    assert b.from_storage == 8
    b.drain()


@pytest.mark.parametrize("end", ["progress", "abort", "close"])
def test_a_stateless_host_node_a_prefetch_held_leaves_the_tree_when_the_prefetch_ends(tmp_path, end):
    """A prefetch continues the first half of a split (a node without a state); eviction takes its
    children while the prefetch holds it. Held, it may be a host-only leaf without a state; once
    the prefetch ends it leaves the tree, and the integrity check holds all along."""
    eng = engine(file_store(tmp_path / "kv"))
    for tokens in (seq(8, 300), seq(4, 300) + seq(4, 900)):
        serve(eng, tokens)
    cache = eng.cache
    (node,) = cache.root_node.children.values()
    assert HOST_STATE not in node.records and len(node.children) == 2
    cache.prefetch_from_storage("r", node, seq(4, 5000))  # storage has no such pages: nothing arrives
    cache.evict(EvictParams(num_tokens=eng.size, mamba_num=eng.pool.size))
    cache.evict_host(eng.host.kv_host.size)
    assert not node.children and cache.root_node.children.get(node.child_key) is node
    cache.check_integrity()
    if end == "progress":
        assert cache.check_prefetch_progress("r")
    elif end == "abort":
        cache.release_aborted_request("r")
    else:
        cache.close()
    assert not cache.root_node.children
    assert eng.host.kv_host.available_size() == eng.host.kv_host.size
    cache.check_integrity()


def test_pages_a_worker_reads_after_the_prefetch_ended_are_neither_taken_nor_counted(tmp_path):
    a = engine(file_store(tmp_path / "kv"))
    prompt = seq(9, 300)
    serve(a, prompt)
    slow, entered, gate = stalled_store(tmp_path / "kv")
    b = second(a, slow, policy=StoragePolicy(prefetch_threshold=0, background=True))
    b.cache.prefetch_from_storage("r", b.cache.root_node, prompt)
    assert entered.wait(10)  # the worker is inside its first read
    b.cache.release_aborted_request("r")
    gate.set()
    assert b.cache.storage_tier.drain()
    stats = b.cache.storage_tier.stats
    assert (stats.pages_read, stats.tokens_loaded, stats.tokens_dropped, stats.states_missing, stats.states_read) == (0, 0, 0, 0, 0)
    b.cache.check_integrity()
    b.cache.close()
