"""Bad input to ``RadixCache``: a clear error, and the tree as it was."""

from __future__ import annotations

import pytest
import torch

from kvassert import Engine, free_recorder, insert, match, seq, sim, int_tensor as T, tree_state
from kvpool import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from kvpool.cache import (
    CacheInitParams,
    EvictParams,
    InsertParams,
    MatchPrefixParams,
    RadixCache,
    RadixKey,
)


def populated(**kwargs) -> RadixCache:
    cache = sim(2, **kwargs)
    insert(cache, [1, 2, 3, 4], [10, 11, 12, 13])
    insert(cache, [1, 2, 5, 6], [10, 11, 14, 15])
    return cache


@pytest.mark.parametrize(
    "call, exc, msg",
    [
        (lambda c: c.insert(InsertParams(key=[1, 2])), TypeError, "key must be a RadixKey, got list"),
        (lambda c: c.match_prefix(MatchPrefixParams(key=(1, 2))), TypeError, "key must be a RadixKey, got tuple"),
        (lambda c: c.match_prefix([1, 2]), TypeError, "key must be a RadixKey, got list"),
        (lambda c: c.insert(InsertParams(key=RadixKey([1, 2.5]), value=T([1, 2]))), TypeError,
         r"key.token_ids must hold ints in the int64 range, got 2.5 \(float\) at position 1"),
        (lambda c: c.insert(InsertParams(key=RadixKey("ab"), value=T([1, 2]))), TypeError, "sequence of ints, got str"),
        (lambda c: c.match_prefix(MatchPrefixParams(key=RadixKey([1, 2**64]))), TypeError, "int64 range"),
        (lambda c: c.insert(InsertParams(key=RadixKey([7, 8, 9]), value=T([1, 2]))), ValueError,
         r"value must have one slot per key token \(3\), got 2"),
        (lambda c: c.insert(InsertParams(key=RadixKey([7, 8]), value=torch.tensor([1.0, 2.0]))), ValueError,
         "value must be int32 or int64, got torch.float32"),
        (lambda c: c.insert(InsertParams(key=RadixKey([7, 8]), value=T([[1, 2]]))), ValueError, "value must be 1-D"),
        (lambda c: c.insert(InsertParams(key=RadixKey([7, 8]), value=[1, 2])), TypeError, "value must be a torch.Tensor, got list"),
        (lambda c: c.insert(InsertParams(key=RadixKey([7, 8]), value=T([1, 2]).to("meta"))), ValueError, "value must be on cpu, got meta"),
        (lambda c: c.insert(InsertParams(key=RadixKey([(7, 8)], is_bigram=True), value=T([1]))), ValueError, "is_eagle=False"),
        (lambda c: c.dec_lock_ref(c.root_node.children[(1, 2)]), ValueError, r"not locked \(lock_ref = 0\)"),
        (lambda c: c.dec_lock_ref("node"), TypeError, "node must be a TreeNode, got str"),
        (lambda c: c.inc_lock_ref(populated().root_node.children[(1, 2)]), ValueError, "not attached to it"),
        (lambda c: c.evict(EvictParams(num_tokens=-1)), ValueError, "num_tokens must be a non-negative int, got -1"),
        (lambda c: c.evict(EvictParams(num_tokens=True)), ValueError, "num_tokens must be a non-negative int, got True"),
        (lambda c: c.evict(2.0), ValueError, "num_tokens must be a non-negative int, got 2.0"),
        (lambda c: c.evict(EvictParams(num_tokens=2, swa_num_tokens=2)), ValueError, "swa_num_tokens must be 0"),
        (lambda c: c.evict(EvictParams(num_tokens=2, mamba_num=1)), ValueError, "mamba_num must be 0"),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)  # fmt: skip
def test_bad_input_raises_and_leaves_the_tree_as_it_was(call, exc, msg):
    cache = populated(enable_kv_cache_events=True)
    before = tree_state(cache)
    with pytest.raises(exc, match=msg):
        call(cache)
    assert tree_state(cache) == before
    cache.sanity_check()


def test_locking_an_evicted_node_raises():
    alloc, _ = free_recorder()
    cache = sim(1, mock_allocator=alloc)
    insert(cache, [1, 2], [1, 2])
    node = match(cache, [1, 2]).last_device_node
    cache.evict(EvictParams(num_tokens=2))
    with pytest.raises(ValueError, match="evicted"):
        cache.inc_lock_ref(node)


def test_evicting_from_a_disabled_cache_raises():
    cache = sim(1, disable=True)
    with pytest.raises(ValueError, match="disable=True and holds nothing to evict"):
        cache.evict(EvictParams(num_tokens=1))


def test_a_cache_with_an_allocator_needs_the_slots():
    cache = RadixCache(None, TokenToKVPoolAllocator(8), 1)
    with pytest.raises(ValueError, match="value must be the key's device slots"):
        cache.insert(InsertParams(key=RadixKey([1, 2])))
    assert cache.total_size() == 0


def test_validate_checks_that_each_page_is_one_aligned_page():
    alloc = PagedTokenToKVPoolAllocator(64, 4)
    assert alloc.alloc(16).tolist() == list(range(4, 20))
    cache = RadixCache(None, alloc, 4, validate=True)
    with pytest.raises(ValueError, match=r"whole aligned pages of 4 consecutive slots, got \[9, 10, 11, 12\] for page 1"):
        cache.insert(InsertParams(key=RadixKey(seq(8)), value=T([4, 5, 6, 7, 9, 10, 11, 12])))
    assert cache.total_size() == 0
    assert cache.insert(InsertParams(key=RadixKey(seq(9)), value=T([4, 5, 6, 7, 12, 13, 14, 15, 16]))).prefix_len == 0


@pytest.mark.parametrize(
    "kwargs, msg",
    [
        (dict(page_size=0), "page_size must be a positive int, got 0"),
        (dict(page_size=1, eviction_policy="lru2"), "eviction_policy must be one of 'lru', 'lfu'"),
        (dict(page_size=4, token_to_kv_pool_allocator=PagedTokenToKVPoolAllocator(64, 16)),
         "page_size must be the allocator's page_size = 16, got 4"),
        (dict(page_size=1, sliding_window_size=128), "sliding_window_size must be None"),
        (dict(page_size=1, cache_ttl_seconds=5.0), "cache_ttl_seconds must be None"),
        (dict(page_size=1, enable_mamba_extra_buffer=True), "enable_mamba_extra_buffer must be False"),
    ],
)  # fmt: skip
def test_bad_construction(kwargs, msg):
    kwargs = {"disable": False, "req_to_token_pool": None, "token_to_kv_pool_allocator": None, **kwargs}
    with pytest.raises(ValueError, match=msg):
        RadixCache(CacheInitParams(**kwargs))


def test_a_request_protecting_more_than_it_committed_is_refused():
    eng = Engine("token", 1, pages=16)
    req = eng.admit(seq(4))
    req.cache_protected_len = 6
    before = (tree_state(eng.cache), eng.alloc.available_size())
    with pytest.raises(ValueError, match=r"req.cache_protected_len must be in 0..4 .*, got 6"):
        eng.cache.cache_finished_req(req)
    assert (tree_state(eng.cache), eng.alloc.available_size()) == before
