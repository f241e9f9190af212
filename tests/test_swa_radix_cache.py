"""``SWARadixCache``: matches through tombstones and the window rule, SWA eviction into tombstones and
full eviction of leaves, locks on both parts, revival of tombstones, requests at page 1 and above,
EAGLE keys, reset, and what the integrity check and a failing free leave."""

from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvassert import SWAEngine, SimReq, assert_unchanged, cache_snapshot, device_nodes, int_tensor as T, seq
from kvpool import ReqToTokenPool, SWATokenToKVPoolAllocator, TokenToKVPoolAllocator
from kvpool.cache import CacheInitParams, EvictParams, InsertParams, MatchPrefixParams, RadixKey, SWARadixCache
from kvpool.cache.swa_plan import window_end
from kvpool.errors import IntegrityError


def small(window: int, page: int = 1, size: int = 64, size_swa: int = 32, **fields):
    alloc = SWATokenToKVPoolAllocator(size, size_swa, page, validate=True)
    table = ReqToTokenPool(4, max_context_len=size + page, device="cpu")
    fields.setdefault("disable", False)
    cache = SWARadixCache(CacheInitParams(req_to_token_pool=table, token_to_kv_pool_allocator=alloc, page_size=page,
                                          sliding_window_size=window, **fields))  # fmt: skip
    return cache, alloc


def put(cache, alloc, tokens, shared: int = 0):
    """Insert ``tokens``: the first ``shared`` slots from the tree's match, the rest fresh."""
    have = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens[:shared]))).device_indices
    assert len(have) == shared
    value = torch.cat((have, alloc.alloc(len(tokens) - shared)))
    cache.insert(InsertParams(key=RadixKey(tokens), value=value, prev_prefix_len=shared))
    return value


def matched(cache, tokens) -> list[int]:
    return cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens))).device_indices.tolist()


def two_branches(window: int):
    """[1, 2, 3] with children [4, 5, 6] and [7, 8, 9]; the shared node made a tombstone (built with
    a window of 3, so that locking the leaves holds their SWA KV only, then ``window``)."""
    cache, alloc = small(3)
    a = put(cache, alloc, [1, 2, 3, 4, 5, 6])
    b = put(cache, alloc, [1, 2, 3, 7, 8, 9], shared=3)
    leaves = [cache.match_prefix(MatchPrefixParams(key=RadixKey(t))).last_device_node for t in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8, 9])]
    uuids = [cache.inc_lock_ref(leaf) for leaf in leaves]
    res = cache.evict(EvictParams(num_tokens=0, swa_num_tokens=1))
    assert (res.num_tokens_evicted, res.swa_num_tokens_evicted) == (0, 3)
    for leaf, uuid in zip(leaves, uuids):
        cache.dec_lock_ref(leaf, uuid)
    cache.sliding_window_size = window
    return cache, alloc, a, b


def test_swa_eviction_makes_an_inner_node_a_tombstone_that_keeps_its_full_kv():
    cache, alloc, a, b = two_branches(window=3)
    shared = cache.root_node.children[1]
    assert shared.swa_tombstone and shared.value.tolist() == a[:3].tolist()
    assert alloc.translate_loc_from_full_to_swa(a[:3]).tolist() == [0, 0, 0]  # its SWA slots went back
    assert (alloc.full_available_size(), alloc.swa_available_size()) == (64 - 9, 32 - 6)
    assert cache.total_size() == (9, 6) and cache.swa_evictable_size() == 6 and cache.full_evictable_size() == 9
    cache.check_integrity()


@pytest.mark.parametrize("window, tokens, expect", [
    (3, [1, 2, 3, 7, 8, 9], 6),  # three live tokens after the tombstone: the window is there
    (3, [1, 2, 3, 7, 8], 0),  # two: back to before the tombstone, the root
    (2, [1, 2, 3, 7, 8], 5),
    (3, [1, 2], 0),  # ends inside the tombstone
    (4, [1, 2, 3, 4, 5, 6], 0),
])  # fmt: skip
def test_a_match_ends_only_where_its_last_window_has_swa_kv(window, tokens, expect):
    cache, alloc, a, b = two_branches(window)
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens + [99])))
    assert len(m.device_indices) == expect
    if expect:
        assert m.device_indices.tolist() == (a[:3].tolist() + (b if tokens[3] == 7 else a)[3:expect].tolist())
        assert not m.last_device_node.swa_tombstone
    else:
        assert m.last_device_node is cache.root_node
    cache.check_integrity()


def brute_window_end(pieces, window):
    """The longest piece boundary b whose last ``window`` elements are all live, or with no tombstone
    before it at all."""
    live = [ok for start, end, ok in pieces for _ in range(end - start)]
    bounds = [0] + [end for _, end, _ in pieces]
    good = [b for b in bounds if all(live[:b]) or (b >= window and all(live[b - window : b]))]
    return max(good)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 5), st.booleans()), max_size=8), st.integers(1, 9))
def test_the_window_rule_is_the_longest_boundary_with_a_live_window(shape, window):
    pieces, pos = [], 0
    for length, live in shape:
        pieces.append((pos, pos + length, live))
        pos += length
    assert window_end(pieces, window) == brute_window_end(pieces, window)


def test_full_eviction_frees_both_parts_of_a_leaf_and_the_tombstones_it_leaves_as_leaves():
    cache, alloc, a, b = two_branches(window=3)
    res = cache.evict(EvictParams(num_tokens=1))  # one leaf: its parent keeps the other child
    assert (res.num_tokens_evicted, res.swa_num_tokens_evicted) == (3, 3)
    assert cache.total_size() == (6, 3)
    res = cache.evict(EvictParams(num_tokens=1))  # the last leaf, and the tombstone above it
    assert (res.num_tokens_evicted, res.swa_num_tokens_evicted) == (6, 3)
    assert cache.total_size() == (0, 0) and not cache.root_node.children
    assert (alloc.full_available_size(), alloc.swa_available_size()) == (64, 32)
    cache.check_integrity()


def test_swa_eviction_of_a_leaf_takes_its_full_kv_too_so_no_leaf_is_a_tombstone():
    cache, alloc = small(window=2)
    put(cache, alloc, [1, 2, 3, 4])
    res = cache.evict(EvictParams(swa_num_tokens=1))
    assert (res.num_tokens_evicted, res.swa_num_tokens_evicted) == (4, 4)
    assert cache.total_size() == (0, 0) and alloc.full_available_size() == 64
    cache.check_integrity()


def test_a_lock_holds_the_full_path_and_the_swa_kv_of_its_last_window_only():
    cache, alloc = small(window=4)
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [1, 2, 3, 4, 5, 6], shared=3)
    put(cache, alloc, [1, 2, 3, 4, 5, 6, 7, 8], shared=6)
    leaf = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4, 5, 6, 7, 8]))).last_device_node
    uuid = cache.inc_lock_ref(leaf)
    middle = leaf.parent
    assert uuid is not None and middle.swa_uuid == uuid  # 2 + 3 tokens reach the window of 4
    assert cache.full_protected_size() == 8 and cache.swa_protected_size() == 5 and cache.swa_evictable_size() == 3
    assert (leaf.swa_lock_ref, middle.swa_lock_ref, middle.parent.swa_lock_ref) == (1, 1, 0)
    res = cache.evict(EvictParams(num_tokens=8, swa_num_tokens=32))  # only the node above the window can go, as a tombstone
    assert (res.num_tokens_evicted, res.swa_num_tokens_evicted) == (0, 3) and middle.parent.swa_tombstone
    cache.check_integrity()
    with pytest.raises(ValueError, match="swa_uuid_for_lock"):
        cache.dec_lock_ref(leaf, uuid + 100)
    cache.dec_lock_ref(leaf, uuid)
    assert cache.full_protected_size() == 0 and cache.swa_protected_size() == 0 and cache.swa_evictable_size() == 5
    with pytest.raises(ValueError, match="tombstone"):  # the window of [1, 2, 3] itself is gone
        cache.inc_lock_ref(middle.parent)
    cache.check_integrity()


def test_a_short_path_locks_to_the_root_and_returns_no_uuid():
    cache, alloc = small(window=10)
    put(cache, alloc, [1, 2, 3])
    node = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3]))).last_device_node
    assert cache.inc_lock_ref(node) is None and cache.inc_lock_ref(cache.root_node) is None
    assert cache.swa_protected_size() == 3
    before = cache_snapshot(cache)
    with pytest.raises(ValueError, match="swa_uuid_for_lock"):
        cache.dec_lock_ref(node, 12345)
    assert_unchanged(before, cache_snapshot(cache), "a dec_lock_ref with a foreign uuid")
    cache.dec_lock_ref(node)
    assert cache.swa_protected_size() == 0
    with pytest.raises(ValueError, match="not locked"):
        cache.dec_lock_ref(node)
    cache.check_integrity()


def test_a_match_that_splits_a_locked_node_keeps_both_locks_and_the_uuid_on_the_upper_part():
    cache, alloc = small(window=3)
    put(cache, alloc, [1, 2, 3, 4, 5, 6])
    leaf = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4, 5, 6]))).last_device_node
    uuid = cache.inc_lock_ref(leaf)
    upper = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4]))).last_device_node  # splits after 4
    assert upper.swa_uuid == uuid and leaf.swa_uuid is None and upper.swa_lock_ref == leaf.swa_lock_ref == 1
    cache.check_integrity()
    cache.dec_lock_ref(leaf, uuid)
    assert cache.swa_protected_size() == 0 and cache.full_protected_size() == 0
    cache.check_integrity()


def test_an_insert_with_swa_kv_revives_a_tombstone_and_gives_back_its_old_full_slots():
    cache, alloc, a, b = two_branches(window=3)
    fresh = alloc.alloc(5)
    res = cache.insert(InsertParams(key=RadixKey([1, 2, 3, 7, 8]), value=fresh, prev_prefix_len=0))
    assert res.prefix_len == 5
    shared = cache.root_node.children[1]
    assert not shared.swa_tombstone and shared.value.tolist() == fresh[:3].tolist()
    held = set(cache.all_values_flatten().tolist())
    assert not held & set(a[:3].tolist()) and not held & set(fresh[3:].tolist())  # old slots and duplicates went back
    assert (alloc.full_available_size(), alloc.swa_available_size()) == (64 - 9, 32 - 9)
    assert len(matched(cache, [1, 2, 3, 7, 8])) == 5
    cache.check_integrity()


def test_a_locked_tombstone_is_not_revived_since_a_request_reads_its_full_slots():
    cache, alloc, a, b = two_branches(window=3)
    leaf = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 7, 8, 9]))).last_device_node
    uuid = cache.inc_lock_ref(leaf)
    fresh = alloc.alloc(5)
    cache.insert(InsertParams(key=RadixKey([1, 2, 3, 7, 8]), value=fresh, prev_prefix_len=0))
    assert cache.root_node.children[1].swa_tombstone and alloc.full_available_size() == 64 - 9
    cache.dec_lock_ref(leaf, uuid)
    cache.check_integrity()


@pytest.mark.parametrize("page", [1, 2])
def test_tokens_whose_swa_kv_the_caller_freed_go_in_as_a_tombstone_above_a_live_leaf(page):
    cache, alloc = small(window=2, page=page)
    value = alloc.alloc(8)
    alloc.free_swa(value[:4])
    cache.insert(InsertParams(key=RadixKey(seq(8)), value=value, prev_prefix_len=0, swa_evicted_seqlen=4))
    top = cache.root_node.children[next(iter(cache.root_node.children))]
    assert top.swa_tombstone and len(top.value) == 4 and not top.children[next(iter(top.children))].swa_tombstone
    assert cache.total_size() == (8, 4)
    assert len(matched(cache, seq(8))) == 8 and len(matched(cache, seq(5))) == 0
    cache.check_integrity()
    rest = alloc.alloc(4)
    alloc.free_swa(rest)
    res = cache.insert(InsertParams(key=RadixKey(seq(4, 50)), value=rest, prev_prefix_len=0, swa_evicted_seqlen=4))
    assert res.prefix_len == 0 and cache.total_size() == (8, 4)  # all without SWA KV: no tombstone leaf, nothing taken
    alloc.free(rest)
    cache.check_integrity()


def test_slots_without_swa_kv_cannot_go_in_as_live_nor_slots_with_it_as_a_tombstone():
    cache, alloc = small(window=2)
    value = alloc.alloc(4)
    alloc.free_swa(value[:2])
    fresh = alloc.alloc(4)
    for v, e, what in ((value, 0, "must have SWA KV from swa_evicted_seqlen = 0 on"),
                       (fresh, 2, "must have no SWA KV before swa_evicted_seqlen = 2")):  # fmt: skip
        before = cache_snapshot(cache)
        with pytest.raises(ValueError, match=what):
            cache.insert(InsertParams(key=RadixKey(seq(4)), value=v, prev_prefix_len=0, swa_evicted_seqlen=e))
        assert_unchanged(before, cache_snapshot(cache), "a refused insert")
    cache.insert(InsertParams(key=RadixKey(seq(4)), value=value, prev_prefix_len=0, swa_evicted_seqlen=2))
    assert cache.total_size() == (4, 2)
    paged, _ = small(window=2, page=2)
    with pytest.raises(ValueError, match="swa_evicted_seqlen must be a multiple of page_size = 2, got 1"):
        paged.insert(InsertParams(key=RadixKey(seq(4)), value=T([2, 3, 4, 5]), swa_evicted_seqlen=1))


@pytest.mark.parametrize("page", [1, 4])
def test_requests_give_back_swa_slots_as_tokens_leave_the_window_and_share_what_the_tree_keeps(page):
    eng = SWAEngine(page, pages=48 if page > 1 else 160, swa_pages=16 if page > 1 else 40, window=2 * page)
    system = seq(3 * page, 500)
    a = eng.admit(system + [1, 2])
    for t in range(4 * page):
        assert eng.decode(a, 70 + t)
        eng.cache.check_integrity(eng.running.values())
    assert a.swa_evicted_seqlen >= 2 * page  # its own tokens out of the window have no SWA KV any more
    eng.chunk(a)  # the pages cached so far: its tombstone part included
    eng.cache.check_integrity(eng.running.values())
    tokens = a.fill_ids[: a.kv_committed_len]
    eng.finish(a)
    eng.cache.check_integrity()
    assert any(n.swa_tombstone for n in device_nodes(eng.cache))
    b = eng.admit(tokens + [9])  # the tree has the last window of these: the whole prefix is shared
    assert b.cache_protected_len == len(tokens) // page * page
    c = eng.admit(system + [1, 2, 5])  # ends inside the tombstone part: only what has its window
    eng.cache.check_integrity(eng.running.values())
    assert c.cache_protected_len < len(system)
    eng.drain()


@pytest.mark.parametrize("page", [1, 4])
def test_a_shortage_in_either_part_evicts_from_that_part(page):
    eng = SWAEngine(page, pages=40 if page > 1 else 160, swa_pages=10 if page > 1 else 40, window=page)
    for i in range(8):
        req = eng.admit(seq(2 * page + 1, 1000 * (i + 1)))
        assert req is not None, f"admission {i} found no room after evicting"
        for t in range(4 * page):
            assert eng.decode(req, t), f"decode {t} of request {i} found no room after evicting"
        eng.cache.check_integrity(eng.running.values())
        eng.finish(req)
        eng.cache.check_integrity()
    full, swa = eng.cache.total_size()
    assert full > swa and full > eng.size_swa // 2  # full KV kept after its SWA KV went: tombstones
    eng.drain()


@pytest.mark.parametrize("page", [1, 2])
def test_eagle_keys_cache_bigrams_and_keep_the_window_in_kv_slots(page):
    eng = SWAEngine(page, pages=64 if page > 1 else 128, swa_pages=32 if page > 1 else 64, window=3, is_eagle=True)
    a = eng.admit(seq(4 * page + 1, 300))
    for t in range(3):
        assert eng.decode(a, 40 + t)
    tokens = a.fill_ids[: a.kv_committed_len]
    eng.finish(a)
    elems = (len(tokens) - 1) // page * page  # a key of n tokens is n - 1 bigrams
    m = eng.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
    assert len(m.device_indices) == elems and eng.cache.total_size()[0] == elems
    eng.check_match(m.device_indices, None, tokens)
    b = eng.admit(tokens + [5])
    assert b.cache_protected_len == elems
    eng.cache.check_integrity(eng.running.values())
    eng.drain()


def test_reset_forgets_every_node_and_both_sizes():
    cache, alloc, a, b = two_branches(window=3)
    cache.reset()
    assert cache.total_size() == (0, 0) and cache.swa_evictable_size() == 0 and not cache.root_node.children
    assert matched(cache, [1, 2, 3, 7, 8, 9]) == []
    alloc.clear()
    cache.check_integrity()


def test_the_integrity_check_reports_swa_kv_freed_under_a_live_node_and_a_request_without_its_window():
    cache, alloc = small(window=2)
    value = put(cache, alloc, [1, 2, 3, 4])
    cache.check_integrity()
    alloc.free_swa(value[1:2])  # behind the tree's back
    with pytest.raises(IntegrityError, match=r"node \d+ is live but 1 of its slots map to no SWA slot"):
        cache.check_integrity()
    eng = SWAEngine(1, pages=32, swa_pages=16, window=3)
    req = eng.admit(seq(6))
    eng.cache.check_integrity(eng.running.values())
    eng.alloc.free_swa(eng.table.req_to_token[req.req_pool_idx, 5:6])
    with pytest.raises(IntegrityError, match="lacks SWA KV for 1 of its last 3 tokens"):
        eng.cache.check_integrity(eng.running.values())


def test_the_integrity_check_adds_up_each_part():
    eng = SWAEngine(1, pages=32, swa_pages=16, window=3)
    req = eng.admit(seq(6))
    eng.cache.check_integrity(eng.running.values())
    with pytest.raises(IntegrityError, match=r"full part: free 26 \+ evictable 0 \+ protected 0 \+ held by running requests 0 = 26, not its size 32"):
        eng.cache.check_integrity([])  # the request's six slots, not listed, are leaked
    eng.finish(req)
    cache = eng.cache
    node = cache.root_node.children[next(iter(cache.root_node.children))]
    node.records.pop("swa")  # a tombstone leaf whose SWA slots nobody gives back
    cache.windows.evictable_size -= 6
    with pytest.raises(IntegrityError) as err:
        cache.check_integrity()
    for what in ("tombstone leaf", "still maps 6 slots", "SWA part: free 10"):
        assert what in str(err.value)


def test_the_integrity_check_reports_an_evictable_window_missing_from_the_swa_queue():
    cache, alloc = small(window=2)
    put(cache, alloc, [1, 2, 3, 4])
    cache.check_integrity()
    assert cache.windows.queue.pop() is cache.root_node.children[1]  # taken out behind the cache's back
    with pytest.raises(IntegrityError, match=r"node \d+'s SWA KV is evictable but missing from the SWA eviction queue"):
        cache.check_integrity()


def _fail(*args, **kwargs):
    raise RuntimeError("injected fault")


def test_a_failing_free_swa_in_evict_changes_nothing(monkeypatch):
    cache, alloc, a, b = two_branches(window=3)
    put(cache, alloc, [1, 2, 3, 7, 8, 9, 10, 11], shared=6)
    before = cache_snapshot(cache)
    monkeypatch.setattr(alloc, "free_swa", _fail)
    with pytest.raises(RuntimeError, match="injected"):
        cache.evict(EvictParams(num_tokens=3, swa_num_tokens=20))
    assert_unchanged(before, cache_snapshot(cache), "an evict whose free_swa raised")
    monkeypatch.undo()
    cache.check_integrity()


def test_a_failing_free_in_evict_puts_the_nodes_back_and_keeps_the_new_tombstones(monkeypatch):
    cache, alloc = small(window=2)
    put(cache, alloc, [1, 2, 3, 4])
    put(cache, alloc, [1, 2, 3, 4, 5, 6], shared=4)
    put(cache, alloc, [1, 2, 7, 8], shared=2)
    full_before = alloc.full_available_size()
    monkeypatch.setattr(alloc, "free", _fail)
    with pytest.raises(RuntimeError, match="injected"):
        cache.evict(EvictParams(num_tokens=0, swa_num_tokens=6))
    monkeypatch.undo()
    cache.check_integrity()
    assert alloc.full_available_size() == full_before and cache.total_size()[0] == 8
    tombstones = [n for n in device_nodes(cache) if n.swa_tombstone]
    assert tombstones and cache.total_size()[1] == 8 - sum(len(n.value) for n in tombstones)


def test_a_failing_free_in_cache_finished_req_changes_nothing(monkeypatch):
    eng = SWAEngine(2, pages=32, swa_pages=16, window=2)
    req = eng.admit(seq(5))
    for t in range(4):  # 9 tokens: a partial page the request gives back
        eng.decode(req, t)
    before = cache_snapshot(eng.cache)
    monkeypatch.setattr(eng.alloc, "free", _fail)
    with pytest.raises(RuntimeError, match="injected"):
        eng.cache.cache_finished_req(req)
    assert_unchanged(before, cache_snapshot(eng.cache), "a cache_finished_req whose free raised")
    monkeypatch.undo()
    eng.cache.check_integrity(eng.running.values())
    eng.drain()


@pytest.mark.parametrize("how", ["cache_finished_req", "cache_unfinished_req"])
def test_a_request_whose_protected_slots_are_not_its_path_is_refused_with_nothing_changed(how):
    eng = SWAEngine(1, pages=32, swa_pages=16, window=2)
    eng.finish(eng.admit(seq(5)))
    req = eng.admit(seq(5) + [7, 8])
    assert req.cache_protected_len == 5
    req.last_node, req.swa_uuid_for_lock = eng.cache.root_node, None  # its five protected slots are no path of it
    before = cache_snapshot(eng.cache)
    with pytest.raises(ValueError, match="cache_protected_len"):
        getattr(eng.cache, how)(req)
    assert_unchanged(before, cache_snapshot(eng.cache), f"a refused {how}")


def test_construction_needs_an_swa_allocator_and_a_window():
    table = ReqToTokenPool(2, 16, "cpu")
    for alloc, window, what in (
        (TokenToKVPoolAllocator(8), 4, "SWATokenToKVPoolAllocator"),
        (SWATokenToKVPoolAllocator(8, 4, 1), None, "sliding_window_size must be a positive int"),
        (SWATokenToKVPoolAllocator(8, 4, 1), 0, "sliding_window_size must be a positive int"),
        (SWATokenToKVPoolAllocator(8, 4, 1), True, "sliding_window_size must be a positive int"),
        (SWATokenToKVPoolAllocator(8, 4, 2), 4, "page_size must be the allocator's"),
    ):
        with pytest.raises(ValueError, match=what):
            SWARadixCache(CacheInitParams(disable=False, req_to_token_pool=table, token_to_kv_pool_allocator=alloc,
                                          page_size=1, sliding_window_size=window))  # fmt: skip
    assert SWARadixCache.create_simulated(sliding_window_size=4).supports_swa()


def test_a_disabled_cache_holds_nothing_and_gives_a_finished_request_all_its_slots_back():
    cache, alloc = small(window=2, disable=True)
    value = alloc.alloc(4)
    assert cache.insert(InsertParams(key=RadixKey(seq(4)), value=value)).prefix_len == 0
    assert matched(cache, seq(4)) == [] and cache.inc_lock_ref(cache.root_node) is None
    with pytest.raises(ValueError, match="disable=True"):
        cache.evict(EvictParams(num_tokens=1))
    cache.req_to_token_pool.write((0, slice(0, 4)), value.to(torch.int32))
    req = SimReq(0, seq(4), kv_committed_len=4, last_node=cache.root_node)
    cache.cache_finished_req(req)
    assert alloc.full_available_size() == 64 and alloc.swa_available_size() == 32


def test_a_tombstone_partly_before_the_callers_swa_evicted_length_revives_from_there_on():
    cache, alloc = small(window=2)
    put(cache, alloc, [1, 2, 3, 4])
    put(cache, alloc, [1, 2, 3, 4, 5, 6], shared=4)
    put(cache, alloc, [1, 2, 3, 4, 7, 8], shared=4)
    top = cache.root_node.children[1]
    for leaf in list(top.children.values()):
        cache.inc_lock_ref(leaf)
    cache.evict(EvictParams(swa_num_tokens=1))
    for leaf in list(top.children.values()):
        cache.dec_lock_ref(leaf, leaf.swa_uuid)
    assert top.swa_tombstone
    old = top.value.clone()
    fresh = alloc.alloc(4)
    alloc.free_swa(fresh[:2])  # the caller's first two tokens left its window
    cache.insert(InsertParams(key=RadixKey([1, 2, 3, 4]), value=fresh, prev_prefix_len=0, swa_evicted_seqlen=2))
    upper = cache.root_node.children[1]
    lower = upper.children[3]
    assert upper.swa_tombstone and upper.value.tolist() == old[:2].tolist()  # the tree's, still without SWA KV
    assert not lower.swa_tombstone and lower.value.tolist() == fresh[2:].tolist()  # the caller's, with it
    held = set(cache.all_values_flatten().tolist())
    assert not held & {*old[2:].tolist(), *fresh[:2].tolist()}
    assert alloc.full_available_size() == 64 - 8
    cache.check_integrity()


def test_an_unfinished_request_is_not_cached_past_where_its_match_would_end():
    eng = SWAEngine(1, pages=64, swa_pages=32, window=3)
    cache = eng.cache
    a = eng.admit([1, 2, 3, 4, 5, 6, 0])
    eng.finish(a)
    b = eng.admit([1, 2, 3, 7, 8, 9, 0])  # shares [1, 2, 3]
    b_leaf_locked = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 7, 8, 9]))).last_device_node
    eng.chunk(b)
    top = cache.root_node.children[1]
    cache.evict(EvictParams(swa_num_tokens=6))  # [4, 5, 6] goes, then [1, 2, 3] becomes a tombstone
    assert top.swa_tombstone and top.lock_ref > 0 and b_leaf_locked is not None
    c = eng.admit([1, 2, 3, 10, 0])  # the window after the tombstone is too short: nothing matched
    assert c.cache_protected_len == 0
    before = dict(total=cache.total_size(), row=eng.table.req_to_token[c.req_pool_idx, :5].tolist())
    eng.chunk(c)  # caching [10, 0] below the locked tombstone would give a leaf no match reaches
    assert cache.total_size() == before["total"] and c.cache_protected_len == 0
    assert eng.table.req_to_token[c.req_pool_idx, :5].tolist() == before["row"]
    d = eng.admit([1, 2, 3, 12, 13, 14, 0])
    eng.chunk(d)  # four tokens after the tombstone: a whole window, so cached and continued from the tree
    assert d.cache_protected_len == 7 and cache.total_size()[0] == before["total"][0] + 4
    cache.check_integrity(eng.running.values())
    eng.drain()


def test_pages_above_one_token_cache_whole_pages_only_and_pretty_print_shows_both_locks(capsys):
    cache, alloc = small(window=4, page=4)
    value = alloc.alloc(8)
    assert cache.insert(InsertParams(key=RadixKey(seq(7)), value=value[:7], prev_prefix_len=0)).prefix_len == 0
    assert cache.total_size() == (4, 4) and matched(cache, seq(7)) == value[:4].tolist()
    node = cache.match_prefix(MatchPrefixParams(key=RadixKey(seq(4)))).last_device_node
    uuid = cache.inc_lock_ref(node)
    cache.pretty_print()
    out = capsys.readouterr().out
    assert "fr=1 sr=1 ts=False" in out and "#full_tokens: 4, #swa_tokens: 4" in out
    cache.dec_lock_ref(node, uuid)
    alloc.free(value[4:])
    cache.check_integrity()


def test_the_docstring_example_runs():
    import doctest

    from kvpool.cache import swa_radix_cache

    assert doctest.testmod(swa_radix_cache, extraglobs={"RadixKey": RadixKey}).failed == 0


def test_swa_eviction_takes_the_least_recently_used_window_first_and_on_a_path_the_upper_node():
    cache, alloc = small(window=1)
    for start in (10, 20, 30):
        put(cache, alloc, [start, start + 1])
    cache.match_prefix(MatchPrefixParams(key=RadixKey([10, 11])))  # [20, 21] is now the oldest
    assert cache.evict(EvictParams(swa_num_tokens=1)).swa_num_tokens_evicted == 2
    assert matched(cache, [20, 21]) == [] and len(matched(cache, [30, 31])) == 2
    put(cache, alloc, [10, 11, 12, 13], shared=2)  # one path: [10, 11] above [12, 13], touched together
    cache.match_prefix(MatchPrefixParams(key=RadixKey([10, 11, 12, 13])))
    cache.match_prefix(MatchPrefixParams(key=RadixKey([30, 31])))
    res = cache.evict(EvictParams(swa_num_tokens=1))
    assert (res.num_tokens_evicted, res.swa_num_tokens_evicted) == (0, 2)
    assert cache.root_node.children[10].swa_tombstone  # the upper node of the tie went first, as a tombstone
    assert len(matched(cache, [10, 11, 12, 13])) == 4  # window 1: the live leaf after it is enough
    cache.check_integrity()


@pytest.mark.parametrize("how", ["match", "insert"])
def test_a_split_leaves_the_upper_part_older_on_the_tie_so_swa_eviction_takes_it_first(how):
    cache, alloc = small(window=1)
    put(cache, alloc, [1, 2, 3, 4])
    put(cache, alloc, [9, 9])
    if how == "match":  # splits [1, 2, 3, 4] into [1, 2] above [3, 4], both touched together
        cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2])))
    else:  # the same split by an insert going on into a new leaf [5, 6] beside [3, 4]
        value = torch.cat((cache.root_node.children[1].value[:2], alloc.alloc(2)))
        cache.insert(InsertParams(key=RadixKey([1, 2, 5, 6]), value=value, prev_prefix_len=2))
    cache.match_prefix(MatchPrefixParams(key=RadixKey([9, 9])))
    res = cache.evict(EvictParams(swa_num_tokens=1))
    assert (res.num_tokens_evicted, res.swa_num_tokens_evicted) == (0, 2)
    assert cache.root_node.children[1].swa_tombstone  # the upper part became the tombstone; no full KV was lost
    assert len(matched(cache, [1, 2, 3, 4])) == 4
    cache.check_integrity()


class PoppingReq(SimReq):
    """SGLang's ``Req``: reading the committed length with ``pop_committed_kv_cache`` marks it freed."""

    kv_committed_freed = False

    def pop_committed_kv_cache(self) -> int:
        assert not self.kv_committed_freed, "committed KV cache already freed"
        self.kv_committed_freed = True
        return self.kv_committed_len


def test_the_integrity_check_reads_a_running_request_without_popping_its_committed_kv():
    eng = SWAEngine(1, pages=64, swa_pages=32, window=2)
    req = eng.admit(seq(5, 100))
    req.__class__ = PoppingReq
    eng.cache.check_integrity([req])
    assert not req.kv_committed_freed  # the request is still running: only cache_finished_req pops it
    eng.finish(req)
    eng.cache.check_integrity()


def test_a_simulated_cache_takes_prev_prefix_len_over_a_held_prefix_with_nothing_to_give_back():
    cache = SWARadixCache.create_simulated(sliding_window_size=2)
    cache.insert(InsertParams(key=RadixKey([1, 2, 3]), value=T([5, 6, 7]), prev_prefix_len=0))
    res = cache.insert(InsertParams(key=RadixKey([1, 2, 3, 4]), value=T([8, 9, 10, 11]), prev_prefix_len=0))
    assert res.prefix_len == 3 and matched(cache, [1, 2, 3, 4]) == [5, 6, 7, 11]
    cache.check_integrity()


def test_an_unlocked_window_keeps_the_upper_node_older_on_the_tie_so_swa_eviction_takes_it_first():
    cache, alloc = small(window=4)
    put(cache, alloc, [1, 2])
    put(cache, alloc, [1, 2, 3, 4], shared=2)  # [1, 2] above the leaf [3, 4]
    put(cache, alloc, [9, 9])
    last = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4]))).last_device_node  # touched together
    uuid = cache.inc_lock_ref(last)  # a request's window holds both
    cache.match_prefix(MatchPrefixParams(key=RadixKey([9, 9])))
    cache.dec_lock_ref(last, uuid)  # both evictable again, on the same tick
    res = cache.evict(EvictParams(swa_num_tokens=1))
    assert (res.num_tokens_evicted, res.swa_num_tokens_evicted) == (0, 2)
    assert cache.root_node.children[1].swa_tombstone and len(matched(cache, [1, 2, 3, 4])) == 0
    cache.check_integrity()
