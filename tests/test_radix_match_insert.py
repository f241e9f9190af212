"""The prefix cache's keys, nodes, insert and match (``kvpool.cache``): SGLang's ``RadixCache``
API, page-aligned matching, splits, namespaces, call forms, reset."""

from __future__ import annotations

import doctest
import unittest.mock

import pytest
import torch

from kvassert import insert, match, seq, sim, int_tensor as T
from kvpool.cache import (
    AllBlocksCleared,
    CacheInitParams,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    RadixCache,
    RadixKey,
    TreeNode,
)


PAGE_SIZES = [1, 16, 64]


@pytest.mark.parametrize("module", ["key", "node", "radix_cache"])
def test_docstring_examples_run(module):
    import importlib

    result = doctest.testmod(importlib.import_module(f"kvpool.cache.{module}"))
    assert result.attempted > 0 and result.failed == 0


# --- keys and nodes -----------------------------------------------------------------------------------


def test_radix_key_slices_iterates_and_keeps_its_namespace():
    key = RadixKey([5, 6, 7, 8], "lora-3")
    assert len(key) == 4 and list(key) == [5, 6, 7, 8]
    assert key[1:3].token_ids == [6, 7] and key[1:3].extra_key == "lora-3"
    assert key[-1].token_ids == [8] and key[-1].extra_key == "lora-3"
    assert "extra_key='lora-3'" in repr(key) and "[5, 6, 7, 8]" in repr(key)
    assert "..." in repr(RadixKey(list(range(11))))
    with pytest.raises(IndexError):
        key[9]


def test_tree_node_fields_and_host_holds():
    node = TreeNode()
    assert (node.lock_ref, node.hit_count, node.host_ref_counter) == (0, 0, 0)
    assert node.evicted and not node.backuped
    node.value, node.host_value = T([1]), T([2])
    assert not node.evicted and node.backuped
    node.protect_host()
    node.release_host()
    with pytest.raises(RuntimeError, match="host copy is not held"):
        node.release_host()
    a, b = TreeNode(), TreeNode()
    a.parent, a.hash_value, b.parent, b.hash_value = None, ["h1"], a, ["h2", "h3"]
    chain = b.get_prefix_hash_values(b)
    assert chain == ["h1", "h2", "h3"] and b.get_prefix_hash_values(b) is not chain
    assert b.get_last_hash_value() == "h3"


# --- insert and match ---------------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGE_SIZES)
def test_match_is_the_longest_whole_page_prefix(page):
    cache = sim(page)
    tokens = seq(3 * page + page // 2)  # three pages and (page size > 1) a partial one
    assert insert(cache, tokens, seq(len(tokens), 10)) == 0
    assert cache.total_size() == cache.evictable_size() == 3 * page  # the partial page is not taken
    for n in (0, 1, page, 2 * page + 1, len(tokens)):
        got = match(cache, tokens[:n] + [7] * 5).device_indices  # the cached tokens hold no 7
        assert got.tolist() == seq(len(tokens), 10)[: min(n // page, 3) * page], n
        assert got.dtype == torch.int64
    # A query that leaves the cached key inside a page matches only the pages before it.
    diverge = tokens[: page + page // 2] + [1] + tokens[page + page // 2 + 1 :]
    assert len(match(cache, diverge).device_indices) == page


@pytest.mark.parametrize("page", PAGE_SIZES)
def test_insert_returns_what_the_tree_held_and_takes_only_the_rest(page):
    cache = sim(page)
    a = seq(4 * page)
    b = a[: 2 * page] + seq(2 * page, start=5000)
    assert insert(cache, a, seq(4 * page, 100)) == 0
    assert insert(cache, b, seq(4 * page, 900)) == 2 * page
    assert cache.total_size() == 6 * page
    # b's first two pages keep a's slots; its own copies of them stay the caller's
    assert match(cache, b).device_indices.tolist() == seq(2 * page, 100) + seq(4 * page, 900)[2 * page :]
    assert insert(cache, a, seq(4 * page, 1)) == 4 * page
    assert cache.total_size() == 6 * page


def test_a_match_ending_inside_a_node_splits_it_and_returns_that_node():
    cache = sim(2)
    insert(cache, [1, 2, 3, 4, 5, 6], [10, 20, 30, 40, 50, 60])
    m = match(cache, [1, 2, 3, 4, 9, 9])
    assert m.device_indices.tolist() == [10, 20, 30, 40]
    node = m.last_device_node
    assert node.key.token_ids == [1, 2, 3, 4] and node.value.tolist() == [10, 20, 30, 40]
    (child,) = node.children.values()
    assert child.key.token_ids == [5, 6] and child.parent is node
    assert set(cache.root_node.children) == {(1, 2)} and set(node.children) == {(5, 6)}
    assert m.last_host_node is node and cache.total_size() == 6
    cache.sanity_check()


def test_children_are_filed_under_sglangs_child_keys():
    for page, extra, want in ((1, None, 7), (2, None, (7, 8)), (1, "t", ("t", 7)), (2, "t", ("t", (7, 8)))):
        cache = sim(page)
        insert(cache, [7, 8, 9, 10], extra=extra)
        assert list(cache.root_node.children) == [want]


def test_extra_keys_never_share_a_prefix():
    cache = sim(1)
    for extra, base in ((None, 10), ("lora-1", 40), ("tenant-b", 70)):
        assert insert(cache, [1, 2, 3], [base, base + 1, base + 2], extra=extra) == 0
    assert match(cache, [1, 2, 3], "lora-1").device_indices.tolist() == [40, 41, 42]
    assert match(cache, [1, 2, 3], "tenant-b").device_indices.tolist() == [70, 71, 72]
    assert match(cache, [1, 2, 3]).device_indices.tolist() == [10, 11, 12]
    assert len(match(cache, [1, 2, 3], "other").device_indices) == 0
    assert cache.total_size() == 9


def test_token_ids_may_be_lists_tuples_arrays_ranges_and_tensors():
    from array import array

    cache = sim(1)
    insert(cache, [3, 4, 5, 6], [1, 2, 3, 4])
    for tokens in ([3, 4, 5], (3, 4, 5), array("q", [3, 4, 5]), range(3, 6), torch.tensor([3, 4, 5])):
        assert cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens))).device_indices.tolist() == [1, 2, 3]
    big = 2**40 + 7  # token ids are compared as int64, not truncated
    insert(cache, [big, 1], [9, 9])
    assert len(match(cache, [2**40 + 8, 1]).device_indices) == 0


def test_sglangs_earlier_call_forms():
    """RadixCache(req_to_token_pool=..., ...), insert(key, value) -> int, match_prefix(key), evict(n)."""
    alloc = unittest.mock.Mock()
    alloc.device = torch.device("cpu")
    cache = RadixCache(None, alloc, 1, eviction_policy="lru")
    assert cache.insert(RadixKey([1, 2, 3]), T([7, 8, 9])) == 0
    assert cache.insert(RadixKey([1, 2, 4]), T([7, 8, 5])) == 2
    assert cache.match_prefix(RadixKey([1, 2, 3, 4])).device_indices.tolist() == [7, 8, 9]
    assert cache.evict(1).num_tokens_evicted == 1
    alloc.free.assert_called_once()
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=None, page_size=4)
    assert RadixCache(params).page_size == 4
    result = RadixCache(params).insert(InsertParams(key=RadixKey(seq(9))))
    assert isinstance(result, InsertResult) and result.prefix_len == 0
    with pytest.raises(TypeError, match="unexpected keyword argument 'slide'"):
        RadixCache(req_to_token_pool=None, token_to_kv_pool_allocator=None, page_size=1, slide=2)
    with pytest.raises(TypeError, match="missing argument 'page_size'"):
        RadixCache(req_to_token_pool=None, token_to_kv_pool_allocator=None)


def test_empty_keys_match_the_root_and_insert_nothing():
    cache = sim(4)
    assert insert(cache, []) == 0 and insert(cache, [1, 2, 3]) == 0  # shorter than a page
    m = match(cache, [1, 2, 3])
    assert len(m.device_indices) == 0 and m.last_device_node is cache.root_node and cache.total_size() == 0


def test_a_disabled_cache_holds_nothing():
    cache = sim(1, disable=True)
    assert insert(cache, [1, 2, 3], [4, 5, 6]) == 0
    m = match(cache, [1, 2, 3])
    assert len(m.device_indices) == 0 and m.last_device_node is cache.root_node
    assert cache.total_size() == 0 and cache.inc_lock_ref(cache.root_node) == 0


def test_eagle_keys_are_bigrams_of_the_tokens():
    cache = sim(1, is_eagle=True)
    assert insert(cache, [1, 2, 3, 4], [10, 20, 30, 40]) == 0
    assert cache.total_size() == 3  # (1,2), (2,3), (3,4)
    assert match(cache, [1, 2, 3, 4]).device_indices.tolist() == [10, 20, 30]
    assert match(cache, [1, 2]).device_indices.tolist() == [10]
    assert list(cache.root_node.children) == [(1, 2)]
    paged = sim(2, is_eagle=True)
    insert(paged, [1, 2, 3], [10, 20, 30])
    assert paged.total_size() == 2 and len(match(paged, [1, 2]).device_indices) == 0


def test_reset_forgets_every_node():
    cache = sim(1, enable_kv_cache_events=True)
    insert(cache, [1, 2, 3], [4, 5, 6])
    cache.take_events()
    cache.reset()
    assert cache.total_size() == cache.evictable_size() == cache.protected_size() == 0
    assert len(match(cache, [1, 2, 3]).device_indices) == 0
    assert isinstance(cache.take_events()[0], AllBlocksCleared)
    cache.check_integrity()


def test_pretty_print_and_all_values(capsys):
    cache = sim(1)
    insert(cache, [1, 2], [10, 20])
    insert(cache, [3, 4], [30, 40])
    cache.pretty_print()
    out = capsys.readouterr().out
    assert "#tokens: 4" in out and "[1, 2]" in out and "r=0" in out
    assert sorted(cache.all_values_flatten().tolist()) == [10, 20, 30, 40]
