"""``HiMambaRadixCache``: evicted nodes park on the host with their states and come back byte for
byte, a prefix is never served from KV without its state, one host budget for KV pages and state
slots, state and host eviction, inserts through parked nodes, failures that leave the tiers
consistent, the integrity check over both tiers, and bad input."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from kvassert import STATE as STATE_PARAMS
from kvassert import HiHybridEngine, assert_unchanged, cache_snapshot, seq, int_tensor as T
from kvassert import state_device  # noqa: F401 (a fixture)
from kvpool import HybridLinearKVPool, HybridPoolHost, HybridReqToTokenPool, MHATokenToKVPoolHost, TokenToKVPoolAllocator
from kvpool.cache import CacheInitParams, EvictParams, HiMambaRadixCache, InsertParams, MatchPrefixParams, RadixKey
from kvpool.cache.himamba_host import HOST_STATE
from kvpool.cache.node import TreeNode
from kvpool.cache.records import STATE, StateSnapshot
from kvpool.cache.storage_tier import StoragePolicy
from kvpool.errors import IntegrityError

POLICIES = ["write_through", "write_through_selective", "write_back"]


def nodes(cache):
    out, stack = [], list(cache.root_node.children.values())
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children.values())
    return out


def node_of(cache, tokens, extra=None):
    """The node whose prefix is exactly ``tokens`` (walking children by their keys)."""
    node, pos = cache.root_node, 0
    while pos < len(tokens):
        node = next(c for c in node.children.values() if list(c.key.token_ids) == tokens[pos : pos + len(c.key)])
        pos += len(node.key)
    return node


def host_state_bytes(host, slot: int) -> list[torch.Tensor]:
    """A host state slot's bytes per kind, [layers, bytes], whatever the host layout."""
    out = []
    for t in (*host.conv, host.temporal):
        rows = t[:, slot] if host.layout == "layer_first" else t[slot]
        out.append(rows.reshape(rows.shape[0], -1).view(torch.uint8))
    return out


def serve(eng, tokens, decode=0, extra=None):
    """Admit ``tokens``, decode ``decode`` tokens, finish; returns the tokens cached."""
    req = eng.admit(tokens, extra)
    for t in range(decode):
        assert eng.decode(req, 70 + t)
    out = req.fill_ids[: req.kv_committed_len]
    eng.finish(req)
    return out


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("page, extra", [(1, False), (4, True)])
@pytest.mark.parametrize("host_policy", POLICIES)
def test_evicted_nodes_come_back_from_the_host_with_their_states_byte_for_byte(host_policy, page, extra, layout):
    eng = HiHybridEngine(page, pages=24 if page > 1 else 96, states=12, extra=extra, host_policy=host_policy, layout=layout)
    cache = eng.cache
    tokens = serve(eng, seq(3 * page + 2, 300), decode=page)
    if host_policy == "write_through_selective":  # a second use backs the path up
        serve(eng, tokens + [9] * (page + 1), decode=page)
    cached = len(tokens) // page * page
    end = node_of(cache, tokens[:cached])
    state_before = [b.clone() for b in eng.state_bytes(int(end.mamba_value))]
    cache.evict(EvictParams(num_tokens=eng.size))
    assert cache.total_size() == (0, 0) and eng.alloc.available_size() == eng.size
    assert eng.pool.available_size() == eng.pool.size  # every device state slot is free
    assert end.device is None and HOST_STATE in end.records  # parked with its state
    for got, want in zip(host_state_bytes(eng.host.state_host, int(end.records[HOST_STATE].slot)), state_before):
        assert torch.equal(got, want)
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens + [5])))
    assert len(m.device_indices) == 0 and m.host_hit_length == cached and m.last_host_node is end
    cache.check_integrity()
    again = eng.admit(tokens + [5])  # loads KV and state back, each byte checked against what was written
    assert eng.loaded == again.cache_protected_len == cached and eng.states_loaded == 1
    cache.check_hicache_events()
    cache.check_integrity(eng.running.values())
    eng.drain()


def test_a_node_whose_state_finds_no_host_room_leaves_the_tree_rather_than_park_without_it():
    eng = HiHybridEngine(1, pages=64, states=12, state_ratio=1.5 / 12)
    cache, host = eng.cache, eng.host
    assert host.state_host.size == 1
    a = serve(eng, seq(6, 100))
    b = serve(eng, seq(6, 200))
    assert HOST_STATE in node_of(cache, a).records  # the one host state slot
    assert node_of(cache, b).host_value is not None and HOST_STATE not in node_of(cache, b).records
    cache.evict(EvictParams(num_tokens=eng.size))
    assert cache.match_prefix(MatchPrefixParams(key=RadixKey(b + [1]))).host_hit_length == 0
    assert len(cache.root_node.children) == 1  # b left the tree with its host KV copy
    assert host.kv_host.available_size() == host.kv_host.size - 6
    assert cache.match_prefix(MatchPrefixParams(key=RadixKey(a + [1]))).host_hit_length == 6
    cache.check_integrity()
    eng.drain()


def test_a_parked_node_without_its_state_is_a_path_the_match_never_ends_on():
    eng = HiHybridEngine(1, pages=64, states=12, state_ratio=2.5 / 12)  # two host state slots
    cache = eng.cache
    p = seq(4, 100)
    a = serve(eng, p + [1, 2])
    b = serve(eng, p + [3, 4])
    serve(eng, p)  # the inner node takes a state; the host has no room for its copy
    inner = node_of(cache, p)
    assert inner.mamba_value is not None and HOST_STATE not in inner.records
    cache.evict(EvictParams(num_tokens=eng.size))
    assert inner.device is None and HOST_STATE not in inner.records  # a host tombstone: a path to a and b
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(p + [9])))
    assert len(m.device_indices) == 0 and m.host_hit_length == 0 and m.last_host_node is cache.root_node
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(a + [9])))
    assert m.host_hit_length == 6 and m.last_host_node is node_of(cache, a)
    cache.check_integrity()
    req = eng.admit(a + [9])  # the tombstone's KV and a's KV and state come back together
    assert req.cache_protected_len == 6 and eng.states_loaded == 1
    assert inner.device is not None and inner.mamba_value is None
    cache.check_integrity(eng.running.values())
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(b + [9])))  # the device tombstone, then b parked
    assert len(m.device_indices) == 0 and m.host_hit_length == 6 and m.last_host_node is node_of(cache, b)
    eng.drain()


def test_a_load_returns_the_device_tombstones_above_the_parked_part_too():
    eng = HiHybridEngine(1, pages=64, states=12)
    cache = eng.cache
    p = seq(4, 100)
    a = serve(eng, p + [1, 2])
    serve(eng, p + [3, 4])  # p is a device tombstone now
    leaf = node_of(cache, a)
    cache.inc_lock_ref(node_of(cache, p + [3, 4]))  # keeps p on the device
    cache.evict(EvictParams(num_tokens=2))
    assert leaf.device is None and node_of(cache, p).device is not None
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(a + [9])))
    assert len(m.device_indices) == 0 and m.host_hit_length == 6  # p's 4 tokens on the device, 2 parked
    new, node = cache.init_load_back(m.last_host_node, m.host_hit_length)
    assert node is leaf and new.tolist() == node_of(cache, p).value.tolist() + leaf.value.tolist()
    cache.ready_to_load_host_cache()
    eng.check_kv_bytes(new.tolist(), [(None, tuple(a[: i + 1])) for i in range(6)])
    eng.check_state_bytes(int(leaf.mamba_value), (None, tuple(a)))
    cache.dec_lock_ref(node_of(cache, p + [3, 4]))
    cache.check_hicache_events()
    cache.check_integrity()
    eng.drain()


@pytest.fixture
def device(state_device):
    return state_device


@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
def test_a_round_trip_through_the_host_is_exact_on_every_device(device, io_backend):
    table = HybridReqToTokenPool(size=2, mamba_size=4, max_context_len=16, device=device, cache_params=STATE_PARAMS)
    mamba = table.mamba_pool
    kv = HybridLinearKVPool(16, torch.float8_e4m3fn, 1, 2, 4, [0, 2], False, device, mamba, warmup=False)
    alloc = TokenToKVPoolAllocator(16, device=device, kvcache=kv)
    host = HybridPoolHost(kv, 2.0, 0, 1, "page_first")
    params = CacheInitParams(disable=False, req_to_token_pool=table, token_to_kv_pool_allocator=alloc, page_size=1)
    cache = HiMambaRadixCache(params, host_pool=host, io_backend=io_backend, load_back_threshold=0)
    slots, state = alloc.alloc(5), mamba.alloc(1)
    kv_bufs = [b.view(torch.uint8) for b in kv.full_kv_pool.k_buffer + kv.full_kv_pool.v_buffer]
    state_bufs = [t.view(torch.uint8) for t in (*mamba.conv, mamba.temporal)]
    g = torch.Generator().manual_seed(3)
    for buf in kv_bufs + state_bufs:
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=g).to(device))
    kv_before = [b[slots].cpu() for b in kv_bufs]
    state_before = [t[:, state].cpu() for t in state_bufs]
    cache.insert(InsertParams(key=RadixKey(seq(5)), value=slots, mamba_value=state))  # backed up, KV and state
    if device == "cuda":
        torch.cuda.synchronize()  # the backups done: a node still being backed up stays locked on the device
    cache.check_hicache_events()
    cache.evict(EvictParams(num_tokens=16))
    for buf in kv_bufs + state_bufs:
        buf.zero_()  # the freed slots' next owners write after the backups read them
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(seq(5) + [9])))
    new, node = cache.init_load_back(m.last_host_node, m.host_hit_length)
    assert len(new) == 5 and node is m.last_host_node
    cache.ready_to_load_host_cache()
    host.wait_for_loads()
    for b, before in zip(kv_bufs, kv_before):
        assert torch.equal(b[new].cpu(), before)
    for t, before in zip(state_bufs, state_before):
        assert torch.equal(t[:, node.mamba_value].cpu(), before)
    if device == "cuda":
        torch.cuda.synchronize()
    cache.check_hicache_events()
    assert not cache.ongoing_write_through and not cache.ongoing_load_back
    cache.check_integrity()


@pytest.mark.parametrize("why", ["threshold", "quota", "no state slot", "no kv room"])
def test_a_load_back_refused_changes_nothing_and_ends_on_the_device_part(why):
    eng = HiHybridEngine(1, pages=64, states=4)
    cache = eng.cache
    a = serve(eng, seq(6, 100))
    cache.evict(EvictParams(num_tokens=eng.size))
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(a + [1])))
    held = []
    if why == "threshold":
        cache.load_back_threshold = 7
    elif why == "no state slot":  # every state slot held by the table, none in the tree to evict
        held = [eng.pool.alloc(1) for _ in range(eng.pool.available_size())]
    elif why == "no kv room":
        kv_held = eng.alloc.alloc(eng.alloc.available_size())
    before = cache_snapshot(cache)
    new, node = cache.init_load_back(m.last_host_node, m.host_hit_length, mem_quota=5 if why == "quota" else None)
    assert len(new) == 0 and node is cache.root_node
    assert_unchanged(before, cache_snapshot(cache), "a refused load")
    for slot in held:
        eng.pool.free(slot)
    if why == "no kv room":
        eng.alloc.free(kv_held)
    cache.load_back_threshold = 0
    req = eng.admit(a + [1])
    assert req.cache_protected_len == 6 and eng.states_loaded == 1
    eng.drain()


def test_one_host_budget_is_split_between_kv_pages_and_state_slots_in_the_device_proportion():
    eng = HiHybridEngine(4, pages=24, states=12, extra=True)
    full, mamba = eng.kv.full_kv_pool, eng.pool
    budget = 3 * (sum(b.nbytes for b in full.k_buffer + full.v_buffer) + sum(t.nbytes for t in (*mamba.conv, mamba.temporal)))
    args = SimpleNamespace(hicache_size=budget / 1e9, hicache_ratio=99.0, hicache_mem_layout="page_first")
    cache = HiMambaRadixCache(eng.cache_params(), args)
    kv_host, state_host = cache.token_to_kv_pool_host, cache.mamba_pool_host
    used = kv_host.size * kv_host.get_size_per_token() + state_host.size * state_host.get_size_per_token()
    assert used <= budget and used > 0.9 * budget
    k, v = full.get_kv_size_bytes()
    ratio = budget / (k + v + mamba.size * mamba.cache_params.bytes_per_slot)  # the same ratio of each device pool
    assert (kv_host.size, state_host.size) == (int(full.size * ratio) // 4 * 4, int(mamba.size * ratio))
    cache = HiMambaRadixCache(eng.cache_params(), SimpleNamespace(hicache_ratio=2.0, hicache_size=0))
    assert (cache.token_to_kv_pool_host.size, cache.mamba_pool_host.size) == (2 * full.size, 2 * mamba.size)


def test_a_state_evicted_from_an_inner_node_leaves_a_tombstone_on_both_tiers():
    eng = HiHybridEngine(1, pages=64, states=12)
    cache, state_host = eng.cache, eng.host.state_host
    p = seq(4, 100)
    a, b = serve(eng, p + [1, 2]), serve(eng, p + [3, 4])
    serve(eng, p)
    inner = node_of(cache, p)
    assert HOST_STATE in inner.records and state_host.available_size() == state_host.size - 3
    for leaf in (a, b):
        cache.inc_lock_ref(node_of(cache, leaf))
    assert cache.evict(EvictParams(num_tokens=0, mamba_num=1)).mamba_num_evicted == 1
    assert inner.mamba_value is None and HOST_STATE not in inner.records
    assert state_host.available_size() == state_host.size - 2
    for leaf in (a, b):
        cache.dec_lock_ref(node_of(cache, leaf))
    cache.check_integrity()
    eng.drain()


@pytest.mark.parametrize("host_policy", ["write_through", "write_back"])
def test_an_insert_through_a_parked_node_takes_the_new_state_and_drops_the_parked_one(host_policy):
    eng = HiHybridEngine(1, pages=64, states=12, host_policy=host_policy)
    cache, state_host = eng.cache, eng.host.state_host
    a = serve(eng, seq(6, 100))
    cache.evict(EvictParams(num_tokens=eng.size))
    node = node_of(cache, a)
    assert node.device is None and state_host.available_size() == state_host.size - 1
    slots, state = eng.alloc.alloc(6), eng.pool.alloc(1)
    eng.write_state(int(state[0]), (None, ("another",)))
    result = cache.insert(InsertParams(key=RadixKey(a), value=slots, mamba_value=state))
    assert (result.prefix_len, result.mamba_exist) == (0, False)  # nothing was on the device
    assert node.value.tolist() == slots.tolist() and int(node.mamba_value) == int(state[0])
    if host_policy == "write_back":
        assert HOST_STATE not in node.records and state_host.available_size() == state_host.size
    else:  # the new state is backed up beside the host KV copy the node kept
        got = host_state_bytes(state_host, int(node.records[HOST_STATE].slot))
        assert all(torch.equal(g, w) for g, w in zip(got, eng.state_pattern((None, ("another",)))))
    cache.check_integrity()
    eng.drain()


def test_host_eviction_takes_leaves_with_their_states_and_the_tombstones_they_leave():
    eng = HiHybridEngine(1, pages=64, states=12)
    cache, host = eng.cache, eng.host
    p = seq(4, 100)
    serve(eng, p + [1, 2])
    serve(eng, p + [3, 4, 5])
    cache.evict(EvictParams(num_tokens=eng.size))
    assert node_of(cache, p).device is None  # a host tombstone above two parked leaves
    first = cache.evict_host(1)
    assert first in (2, 3) and len(node_of(cache, p).children) == 1
    assert host.state_host.available_size() == host.state_host.size - 1
    assert cache.evict_host(1) == 5 - first + 4  # the last leaf, and the tombstone left a leaf
    assert not cache.root_node.children
    assert host.kv_host.available_size() == host.kv_host.size and host.state_host.available_size() == host.state_host.size
    cache.check_integrity()


def test_a_host_tombstone_emptied_for_room_during_an_eviction_goes_when_the_eviction_ends():
    eng = HiHybridEngine(1, pages=64, states=12, host_policy="write_back", state_ratio=2.5 / 12)  # two host states
    cache, host = eng.cache, eng.host
    p = seq(4, 100)
    a, b = serve(eng, p + [1, 2]), serve(eng, p + [3, 4])
    cache.evict(EvictParams(num_tokens=4))  # both leaves parked with their states, p a device tombstone
    assert node_of(cache, p).device is not None and host.state_host.available_size() == 0
    later = [serve(eng, seq(3, 500 + 10 * i)) for i in range(2)]  # used after p: evicted after it
    cache.evict(EvictParams(num_tokens=eng.size))  # p moves first; each later state evicts a parked leaf for room
    assert not any(n.key.token_ids[:4] == p for n in cache.root_node.children.values())
    for tokens in later:
        assert cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens + [1]))).host_hit_length == 3
    assert host.kv_host.available_size() == host.kv_host.size - 6
    cache.check_integrity()
    eng.drain()


def test_reset_frees_every_host_page_and_state_slot():
    eng = HiHybridEngine(1, pages=64, states=12)
    cache, host = eng.cache, eng.host
    serve(eng, seq(6, 100))
    cache.evict(EvictParams(num_tokens=eng.size))
    assert host.kv_host.available_size() < host.kv_host.size and host.state_host.available_size() < host.state_host.size
    cache.reset()
    assert not cache.root_node.children and cache.total_size() == (0, 0)
    assert host.kv_host.available_size() == host.kv_host.size and host.state_host.available_size() == host.state_host.size
    cache.check_integrity()


def _fail(*args, **kwargs):
    raise RuntimeError("injected")


@pytest.mark.parametrize("host_policy", POLICIES)
@pytest.mark.parametrize("what", ["allocator free", "state backup"])
def test_a_failing_eviction_puts_every_node_back_as_it_was(monkeypatch, host_policy, what):
    eng = HiHybridEngine(1, pages=64, states=12, host_policy=host_policy)
    cache = eng.cache
    p = seq(4, 100)
    serve(eng, p + [1, 2])
    serve(eng, p + [3, 4])
    serve(eng, p)
    target = (eng.alloc, "free") if what == "allocator free" else (eng.host.state_host, "backup_from_device_all_layer")
    if what == "state backup":  # the states must be copied at eviction: none of them is on the host yet
        for n in nodes(cache):
            parked = n.records.pop(HOST_STATE, None)
            if parked is not None:
                eng.host.state_host.free(parked.slot)
    before = cache_snapshot(cache)
    monkeypatch.setattr(*target, _fail)
    with pytest.raises(RuntimeError, match="injected"):
        cache.evict(EvictParams(num_tokens=eng.size))
    assert_unchanged(before, cache_snapshot(cache), "a failed eviction")
    monkeypatch.undo()
    cache.check_integrity()
    eng.drain()


@pytest.mark.parametrize("what", ["kv", "state"])
def test_a_failing_write_through_leaves_the_insert_and_no_half_copy(monkeypatch, what):
    eng = HiHybridEngine(1, pages=64, states=12)
    cache, host = eng.cache, eng.host
    req = eng.admit(seq(6, 100))
    monkeypatch.setattr(host.kv_host if what == "kv" else host.state_host, "backup_from_device_all_layer", _fail)
    with pytest.raises(RuntimeError, match="injected"):
        cache.cache_finished_req(req)
    eng.table.free(req)
    del eng.running[[r for r, q in eng.running.items() if q is req][0]]
    node = node_of(cache, seq(6, 100))
    assert node.value is not None and node.mamba_value is not None and HOST_STATE not in node.records
    assert (node.host_value is None) == (what == "kv")
    assert host.state_host.available_size() == host.state_host.size
    assert host.kv_host.available_size() == host.kv_host.size - (0 if what == "kv" else 6)
    cache.check_integrity()
    monkeypatch.undo()
    eng.drain()


def test_the_integrity_check_covers_the_host_states():
    eng = HiHybridEngine(1, pages=64, states=12)
    cache, state_host = eng.cache, eng.host.state_host
    a = serve(eng, seq(6, 100))
    cache.evict(EvictParams(num_tokens=eng.size))
    cache.check_integrity()
    leaked = state_host.alloc(1)
    with pytest.raises(IntegrityError, match="host state pool has 2 slots allocated but the nodes hold 1"):
        cache.check_integrity()
    state_host.free(leaked)
    node = node_of(cache, a)
    parked = node.records.pop(HOST_STATE)
    with pytest.raises(IntegrityError, match=f"node {node.id} is a host-only leaf without a state"):
        cache.check_integrity()
    node.records[HOST_STATE] = parked
    node.records[STATE] = StateSnapshot(T([0]))
    with pytest.raises(IntegrityError, match=f"node {node.id} is on the host only but has a device state"):
        cache.check_integrity()
    del node.records[STATE]
    cache.check_integrity()


@pytest.mark.parametrize("page, extra", [(1, False), (4, True)])
@pytest.mark.parametrize("host_policy", POLICIES)
def test_a_busy_multi_turn_scheduler_serves_host_hits_with_their_states(host_policy, page, extra):
    eng = HiHybridEngine(page, pages=12 if page > 1 else 24, states=10, extra=extra, host_policy=host_policy, host_ratio=3.0)
    rng = random.Random(7)
    systems = [seq(2 * page + 1, 1000 * (i + 1)) for i in range(3)]
    history: list[list] = []  # finished conversations, continued by later turns
    for _ in range(50):
        if eng.running and (rng.random() < 0.4 or len(eng.running) >= 3):
            req = rng.choice(list(eng.running.values()))
            insert = rng.random() < 0.9
            tokens = req.fill_ids[: req.kv_committed_len]
            eng.finish(req, insert=insert)
            if insert and len(tokens) < 3 * eng.size // 4:
                history.append(tokens)
        else:
            base = rng.choice(history) if history and rng.random() < 0.6 else rng.choice(systems)
            req = eng.admit(base + [rng.randrange(5)])
            for t in range(rng.randrange(page + 1) if req is not None else 0):
                if not eng.decode(req, t):
                    break
        eng.cache.check_hicache_events()
        eng.cache.check_integrity(eng.running.values())
    assert eng.loaded > 0 and eng.states_loaded > 0  # host hits were served, every byte checked
    eng.drain()


# --- bad input ------------------------------------------------------------------------------------


def test_construction_refuses_what_does_not_fit():
    eng = HiHybridEngine(1, pages=16, states=6)
    params = eng.cache_params()
    with pytest.raises(ValueError, match="req_to_token_pool must be a HybridReqToTokenPool"):
        HiMambaRadixCache.create_simulated()
    with pytest.raises(ValueError, match=r"kvcache=<a HybridLinearKVPool>, got NoneType"):
        HiMambaRadixCache(CacheInitParams(disable=False, req_to_token_pool=eng.table, page_size=1,
                                          token_to_kv_pool_allocator=TokenToKVPoolAllocator(16)), host_pool=eng.host)  # fmt: skip
    other = HybridLinearKVPool(16, torch.float8_e4m3fn, 1, 2, 4, [0, 2], False, "cpu", eng.pool, warmup=False)
    cases = [
        (dict(host_pool=HybridPoolHost(other, 1.0, 0, 1, "layer_first")), "host_pool must be built over the allocator's"),
        (dict(host_pool=MHATokenToKVPoolHost(eng.kv.full_kv_pool, 1.0, 0, 1, "layer_first")), "must be a HybridPoolHost, got MHA"),
        (dict(host_pool=eng.host, write_policy="sometimes"), "write_policy must be one of"),
        (dict(host_pool=eng.host, io_backend="dma"), "io_backend must be one of"),
        (dict(host_pool=eng.host, server_args=SimpleNamespace(hicache_storage_backend="redis")),
         "hicache_storage_backend must be 'file', 'mooncake' or None .* got 'redis'"),
        (dict(host_pool=eng.host, storage=object()), "storage must be a kvpool.storage.HiCacheStorage, got object"),
        (dict(host_pool=eng.host, storage_policy=StoragePolicy()), "storage_policy needs a storage backend"),
        (dict(server_args=SimpleNamespace(hicache_size=-1)), r"hicache_size must be a number of GB .* got -1"),
        (dict(server_args=SimpleNamespace(hicache_ratio=0)), "hicache_ratio must be a positive number, got 0"),
        ({}, "needs host_pool= or SGLang's server_args"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            HiMambaRadixCache(params, **kwargs)


def test_refused_calls_change_nothing():
    eng = HiHybridEngine(1, pages=64, states=12)
    cache = eng.cache
    p = seq(4, 100)
    serve(eng, p + [1, 2])
    serve(eng, p + [3, 4])
    cache.evict(EvictParams(num_tokens=eng.size))
    inner = node_of(cache, p)
    slots = eng.alloc.alloc(4)
    before = cache_snapshot(cache)
    calls = [
        (lambda: cache.init_load_back("node"), TypeError, "last_node must be a TreeNode, got str"),
        (lambda: cache.init_load_back(inner), ValueError, f"must have its state on the host .* node {inner.id}"),
        (lambda: cache.init_load_back(TreeNode()), ValueError, "must be a node of this tree"),
        (lambda: cache.evict(-1), ValueError, "num_tokens"),
        (lambda: cache.evict(EvictParams(num_tokens=0, mamba_num=-2)), ValueError, "mamba_num"),
        (lambda: cache.evict(EvictParams(num_tokens=1, swa_num_tokens=1)), ValueError, "swa_num_tokens must be 0"),
        (lambda: cache.evict_host(-1), ValueError, "num_tokens"),
        (lambda: cache.evict_host("3"), ValueError, "num_tokens"),
        (lambda: cache.inc_lock_ref(inner), ValueError, "evicted"),
        (lambda: cache.insert(InsertParams(key=RadixKey(p), value=slots, mamba_value=T([0, 1]))), ValueError, "mamba_value"),
        (lambda: cache.match_prefix(MatchPrefixParams(key=RadixKey(p), cow_mamba=True, req=SimpleNamespace(mamba_pool_idx="x"))),
         TypeError, "mamba_pool_idx"),
    ]  # fmt: skip
    for call, exc, message in calls:
        with pytest.raises(exc, match=message):
            call()
        assert_unchanged(before, cache_snapshot(cache), message)
    eng.alloc.free(slots)
    cache.check_integrity()
