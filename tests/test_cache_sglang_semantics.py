"""Code ported from SGLang 0.5 gets SGLang's behaviour from the prefix caches: the same tokens evicted
under LRU for the same calls, ``prev_prefix_len`` freeing the duplicates as SGLang's SWA cache does,
``params=`` on every constructor, and an allocator test double whose ``device`` is not a device.

The expected evictions were read from SGLang 0.5.9's ``radix_cache.py`` run on the same calls."""

from __future__ import annotations

import inspect
import unittest.mock

import pytest
import torch

from kvassert import HybridEngine, free_recorder, seq
from kvpool import HiRadixCache, MambaRadixCache, RadixCache
from kvpool.cache import CacheInitParams, EvictParams, InsertParams, MatchPrefixParams, RadixKey


def T(xs):
    return torch.tensor(xs, dtype=torch.int64)


def lru_cache():
    alloc, freed = free_recorder()
    alloc.page_size = 1
    return RadixCache.create_simulated(mock_allocator=alloc, eviction_policy="lru"), freed


def test_a_match_that_ends_inside_a_node_refreshes_the_whole_node():
    cache, freed = lru_cache()
    cache.insert(InsertParams(key=RadixKey([1, 2, 3, 4]), value=T([10, 11, 12, 13])))
    cache.insert(InsertParams(key=RadixKey([5, 6]), value=T([20, 21])))
    cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2])))  # splits [1, 2 | 3, 4]; both parts are used now
    cache.evict(EvictParams(num_tokens=1))
    assert freed == [[20, 21]]


def test_a_new_leaf_is_more_recent_than_the_node_split_to_make_room_for_it():
    cache, freed = lru_cache()
    cache.insert(InsertParams(key=RadixKey([1, 2, 3, 4]), value=T([10, 11, 12, 13])))
    node = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4]))).last_device_node
    cache.inc_lock_ref(node)
    cache.insert(InsertParams(key=RadixKey([1, 2, 7, 8]), value=T([10, 11, 30, 31])))  # splits the locked node
    cache.dec_lock_ref(node)  # [3, 4] evictable again, stamped before the new leaf [7, 8]
    cache.evict(EvictParams(num_tokens=1))
    assert freed == [[12, 13]]


def test_prev_prefix_len_frees_the_duplicates_the_tree_held():
    cache, freed = lru_cache()
    cache.insert(InsertParams(key=RadixKey([1, 2, 3, 4]), value=T([10, 11, 12, 13])))
    result = cache.insert(InsertParams(key=RadixKey([1, 2, 3, 4, 5]), value=T([10, 11, 42, 43, 44]), prev_prefix_len=2))
    assert result.prefix_len == 4 and freed == [[42, 43]]  # the caller's copies of tokens 2 and 3
    assert cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4, 5]))).device_indices.tolist() == [10, 11, 12, 13, 44]


def test_without_prev_prefix_len_the_duplicates_stay_the_callers():
    cache, freed = lru_cache()
    cache.insert(InsertParams(key=RadixKey([1, 2]), value=T([10, 11])))
    assert cache.insert(InsertParams(key=RadixKey([1, 2, 3]), value=T([50, 51, 52]))).prefix_len == 2
    assert freed == []


@pytest.mark.parametrize("prev", [-1, 6, 1.5, True])
def test_a_prev_prefix_len_outside_the_key_is_refused(prev):
    cache, freed = lru_cache()
    with pytest.raises(ValueError, match="prev_prefix_len must be None or an int in 0..2"):
        cache.insert(InsertParams(key=RadixKey([1, 2]), value=T([10, 11]), prev_prefix_len=prev))
    assert cache.total_size() == 0 and freed == []


def test_every_cache_takes_params_by_keyword_and_shows_it():
    eng = HybridEngine(1, pages=8, states=4)
    params = CacheInitParams(disable=False, req_to_token_pool=eng.table, token_to_kv_pool_allocator=eng.alloc, page_size=1)
    assert RadixCache(params=params).page_size == 1
    assert MambaRadixCache(params=params).total_size() == (0, 0)  # SGLang's (KV tokens, states)
    for cls in (RadixCache, HiRadixCache, MambaRadixCache):
        names = list(inspect.signature(cls).parameters)
        assert names[0] == "params" and "validate" in names, (cls.__name__, names)


def test_an_allocator_whose_device_is_a_test_double():
    alloc = unittest.mock.Mock()  # alloc.device is a Mock too, as in SGLang's own tests
    cache = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=1))
    cache.insert(InsertParams(key=RadixKey(seq(3)), value=T([5, 6, 7])))
    assert cache.match_prefix(MatchPrefixParams(key=RadixKey(seq(3)))).device_indices.tolist() == [5, 6, 7]
    assert cache.evict(EvictParams(num_tokens=3)).num_tokens_evicted == 3
    assert alloc.free.call_args[0][0].tolist() == [5, 6, 7]
