"""``HiRadixCache``: evicted pages park on the host and come back byte for byte, the write policies,
host eviction, load-back decisions, in-flight locks, construction."""

from __future__ import annotations

import pytest
import torch

from kvassert import Engine, match, seq
from kvpool import MHATokenToKVPool, MHATokenToKVPoolHost, PagedTokenToKVPoolAllocator
from kvpool.cache import (
    CacheInitParams,
    EvictParams,
    HiRadixCache,
    InsertParams,
    MatchPrefixParams,
    RadixKey,
)


HOST_POLICIES = ["write_through", "write_through_selective", "write_back"]


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("host_policy", HOST_POLICIES)
def test_evicted_pages_come_back_from_the_host_byte_for_byte(host_policy, page, layout):
    eng = Engine("paged", page, pages=12 if page > 1 else 96, host_policy=host_policy, layout=layout)
    prompt = seq(3 * page + 2, 300)
    cached = len(prompt) // page * page
    eng.finish(eng.admit(prompt))
    if host_policy == "write_through_selective":  # a second use backs the pages up
        eng.finish(eng.admit(prompt))
    cache = eng.cache
    backed = sum(len(n.host_value) for n in cache._nodes() if n is not cache.root_node and n.host_value is not None)
    assert backed == (0 if host_policy == "write_back" else cached)
    assert cache.evict(EvictParams(num_tokens=eng.size)).num_tokens_evicted == cached
    assert cache.total_size() == 0 and eng.alloc.available_size() == eng.size
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(prompt)))
    assert len(m.device_indices) == 0 and m.host_hit_length == cached and m.last_device_node is cache.root_node
    eng.cache.check_integrity()
    again = eng.admit(prompt)  # loads the pages back (checked against the KV written at first)
    assert eng.loaded == again.cache_protected_len == (len(prompt) - 1) // page * page
    cache.check_hicache_events()
    cache.check_integrity(eng.running.values())
    eng.drain()


def test_selective_write_through_backs_up_only_what_is_used_twice():
    eng = Engine("paged", 4, pages=16, host_policy="write_through_selective")
    eng.finish(eng.admit(seq(9, 100)))
    once = [n for n in eng.cache._nodes() if n is not eng.cache.root_node]
    assert all(n.host_value is None for n in once)
    eng.finish(eng.admit(seq(9, 100)))
    assert all(n.host_value is not None for n in eng.cache._nodes() if n is not eng.cache.root_node)
    eng.cache.evict(EvictParams(num_tokens=64))
    eng.finish(eng.admit(seq(9, 100)))
    assert eng.loaded == 8
    eng.drain()


def test_a_full_host_evicts_host_only_leaves_in_order_then_drops_what_it_cannot_keep():
    eng = Engine("paged", 4, pages=16, host_policy="write_through", host_ratio=0.5)  # 32 host slots
    cache = eng.cache
    prompts = [seq(9, 1000 * (i + 1)) for i in range(5)]  # 8 cached tokens each
    for p in prompts[:4]:
        eng.finish(eng.admit(p))
    assert eng.host.available_size() == 0
    cache.evict(EvictParams(num_tokens=64))  # all four on the host only
    eng.finish(eng.admit(prompts[4]))  # its backup makes room: the oldest host leaf goes
    assert match(cache, prompts[0][:8]).host_hit_length == 0
    assert all(match(cache, p[:8]).host_hit_length == 8 for p in prompts[1:4])
    cache.check_integrity()
    for n in cache._nodes():
        if n is not cache.root_node and n.host_value is not None and n.value is None:
            n.protect_host()  # held (say, by a storage write): the host cannot make room
    eng.finish(eng.admit(seq(9, 9000)))
    fresh = match(cache, seq(8, 9000)).last_device_node
    assert fresh.host_value is None  # no room: it stays on the device only
    cache.evict(EvictParams(num_tokens=64))
    assert len(match(cache, seq(8, 9000)).device_indices) == 0 and match(cache, seq(8, 9000)).host_hit_length == 0
    for n in cache._nodes():
        while n.host_ref_counter:
            n.release_host()
    cache.check_integrity()
    eng.drain()


def test_inserting_host_only_pages_again_takes_the_new_slots():
    eng = Engine("paged", 4, pages=16, host_policy="write_through")
    eng.finish(eng.admit(seq(9, 100)))
    eng.cache.evict(EvictParams(num_tokens=64))
    slots = eng.alloc.alloc(8)
    eng.record(slots.tolist(), [(None, tuple(seq(i + 1, 100))) for i in range(8)])
    assert eng.cache.insert(InsertParams(key=RadixKey(seq(8, 100)), value=slots)).prefix_len == 0
    m = match(eng.cache, seq(8, 100))
    assert m.device_indices.tolist() == slots.tolist() and m.host_hit_length == 0
    assert m.last_device_node.host_value is not None  # the host copy stays
    eng.cache.check_integrity()
    eng.drain()


def test_load_back_below_the_threshold_or_beyond_the_quota_is_declined():
    eng = Engine("paged", 4, pages=16, host_policy="write_through")
    cache = eng.cache
    eng.finish(eng.admit(seq(9, 100)))
    cache.evict(EvictParams(num_tokens=64))
    node = match(cache, seq(8, 100)).last_host_node
    cache.load_back_threshold = 9
    assert (len(cache.init_load_back(node)[0]), cache.init_load_back(node)[1]) == (0, cache.root_node)
    cache.load_back_threshold = 0
    slots, last = cache.init_load_back(node, 8, mem_quota=7)
    assert len(slots) == 0 and last is cache.root_node and eng.alloc.available_size() == 64
    slots, last = cache.init_load_back(node, 8, mem_quota=8)
    assert len(slots) == 8 and last is node and node.lock_ref == 1  # held until the load completes
    assert cache.ready_to_load_host_cache() == 0 and cache.ready_to_load_host_cache() == -1
    cache.check_hicache_events()
    assert node.lock_ref == 0
    cache.check_integrity()


def test_nodes_stay_locked_while_their_backup_or_load_is_in_flight(monkeypatch):
    class Pending:
        done = False

        def query(self):
            return self.done

    eng = Engine("paged", 4, pages=16, host_policy="write_through")
    cache, host = eng.cache, eng.host
    event = Pending()
    backup = host.backup_from_device_all_layer
    monkeypatch.setattr(host, "backup_from_device_all_layer", lambda *a, **k: (backup(*a, **k), event)[1])
    eng.finish(eng.admit(seq(9, 100)))
    node = match(cache, seq(8, 100)).last_device_node
    assert node.lock_ref == 1 and cache.evict(EvictParams(num_tokens=64)).num_tokens_evicted == 0
    cache.check_hicache_events()
    assert node.lock_ref == 1
    event.done = True
    cache.check_hicache_events()
    assert node.lock_ref == 0 and cache.evict(EvictParams(num_tokens=64)).num_tokens_evicted == 8
    cache.check_integrity()


def test_hiradix_takes_sglangs_server_args():
    from types import SimpleNamespace

    pool = MHATokenToKVPool(64, 4, torch.bfloat16, 2, 8, 2, "cpu")
    alloc = PagedTokenToKVPoolAllocator(64, 4, kvcache=pool)
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=4)
    args = SimpleNamespace(hicache_ratio=1.5, hicache_size=0, hicache_mem_layout="page_first", hicache_write_policy="write_back",
                           hicache_io_backend="direct", hicache_storage_backend=None)  # fmt: skip
    cache = HiRadixCache(params, args)
    assert (cache.write_policy, cache.io_backend, cache.token_to_kv_pool_host.layout) == ("write_back", "direct", "page_first")
    assert cache.token_to_kv_pool_host.size == 96 and pool.layer_transfer_counter is cache.token_to_kv_pool_host.layer_transfer_counter
    with pytest.raises(ValueError, match="hicache_storage_backend must be 'file', 'mooncake' or None"):
        HiRadixCache(params, SimpleNamespace(**{**vars(args), "hicache_storage_backend": "nixl"}))


@pytest.mark.parametrize(
    "kwargs, exc, msg",
    [
        (dict(write_policy="write_around"), ValueError, "write_policy must be one of write_through"),
        (dict(io_backend="dma"), ValueError, "io_backend must be one of kernel, direct"),
        (dict(other_pool=True), ValueError, "host_pool must be built over the allocator's device pool"),
        (dict(other_page=True), ValueError, "host_pool's page_size must be the cache's 4, got 8"),
        (dict(no_kvcache=True), ValueError, "allocator built with kvcache="),
        (dict(no_host=True), ValueError, "needs host_pool= or SGLang's server_args"),
    ],
)  # fmt: skip
def test_bad_hiradix_construction(kwargs, exc, msg):
    pool = MHATokenToKVPool(64, 4, torch.bfloat16, 2, 8, 2, "cpu")
    alloc = PagedTokenToKVPoolAllocator(64, 4, kvcache=None if kwargs.pop("no_kvcache", False) else pool)
    host_of = MHATokenToKVPool(64, 8, torch.bfloat16, 2, 8, 2, "cpu") if kwargs.pop("other_pool", False) else pool
    host = MHATokenToKVPoolHost(host_of, 2.0, 0, 8 if kwargs.pop("other_page", False) else 4, "layer_first")
    if kwargs.pop("no_host", False):
        host = None
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=4)
    with pytest.raises(exc, match=msg):
        HiRadixCache(params, host_pool=host, **kwargs)


def test_hiradix_bad_load_back_input():
    eng = Engine("paged", 4, pages=16, host_policy="write_through")
    with pytest.raises(TypeError, match="last_node must be a TreeNode, got str"):
        eng.cache.init_load_back("node")
    with pytest.raises(ValueError, match="num_tokens must be a non-negative int"):
        eng.cache.evict_host(-1)
    other = Engine("paged", 4, pages=16, host_policy="write_through")
    other.finish(other.admit(seq(9)))
    with pytest.raises(ValueError, match="not attached to it"):
        eng.cache.init_load_back(match(other.cache, seq(8)).last_device_node)


@pytest.mark.gpu
@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
def test_gpu_load_back_arrives_layer_by_layer_through_the_getters(io_backend):
    dev = "cuda"
    pool = MHATokenToKVPool(1024, 16, torch.float8_e4m3fn, 8, 128, 4, dev)
    alloc = PagedTokenToKVPoolAllocator(1024, 16, device=dev, kvcache=pool)
    host = MHATokenToKVPoolHost(pool, 2.0, 0, 16, "layer_first")
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=16)
    cache = HiRadixCache(params, host_pool=host, io_backend=io_backend, load_back_threshold=0)
    slots = alloc.alloc(256)
    g = torch.Generator(device=dev).manual_seed(0)
    for layer in range(4):
        for buf in (pool.k_buffer[layer], pool.v_buffer[layer]):
            buf.view(torch.uint8)[slots] = torch.randint(0, 256, (256, 8, 128), dtype=torch.uint8, device=dev, generator=g)
    want = [(pool.get_key_buffer(i)[slots].view(torch.uint8).clone(), pool.get_value_buffer(i)[slots].view(torch.uint8).clone()) for i in range(4)]
    cache.insert(InsertParams(key=RadixKey(seq(256)), value=slots))
    node = match(cache, seq(256)).last_device_node
    assert node.lock_ref == 1  # the backup is in flight
    torch.cuda.synchronize()
    cache.check_hicache_events()
    assert node.lock_ref == 0
    cache.evict(EvictParams(num_tokens=256))
    m = match(cache, seq(256))
    new, last = cache.init_load_back(m.last_host_node, m.host_hit_length)
    assert len(new) == 256 and last.lock_ref == 1
    cache.ready_to_load_host_cache()
    for i in range(4):  # the getters make the stream wait for the layer's load
        assert torch.equal(pool.get_key_buffer(i)[new].view(torch.uint8), want[i][0])
        assert torch.equal(pool.get_value_buffer(i)[new].view(torch.uint8), want[i][1])
    torch.cuda.synchronize()
    cache.check_hicache_events()
    assert last.lock_ref == 0
    cache.check_integrity()


def test_a_match_through_host_only_nodes_requeues_the_device_leaf_it_passes():
    eng = Engine("token", 1, pages=24, host_policy="write_through", host_ratio=0.5)  # 12 host slots
    cache = eng.cache
    long = [1, 2, 4, 3, 1, 1, 1]
    cache.insert(InsertParams(key=RadixKey(long, "tenant"), value=eng.alloc.alloc(7)))
    match(cache, long[:1], "tenant")  # splits the node after [1]
    assert cache.evict(EvictParams(num_tokens=2)).num_tokens_evicted == 6  # the rest is on the host only
    other = eng.alloc.alloc(1)
    cache.insert(InsertParams(key=RadixKey([3], "tenant"), value=other))  # a device leaf used after [1]
    m = match(cache, long[:2], "tenant")  # [1] on the device, then a host-only part: [1] is used last
    assert m.device_indices.numel() == 1 and m.host_hit_length == 1
    head = m.last_device_node
    cache.check_integrity()
    assert cache.evict(EvictParams(num_tokens=1)).num_tokens_evicted == 1
    assert head.value is not None  # the least recently used leaf went: [3]
    assert match(cache, [3], "tenant").host_hit_length == 1
    cache.check_integrity()
