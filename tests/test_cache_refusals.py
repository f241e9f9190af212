"""A refused prefix-cache call changes nothing: each bad input or failing step below raises an error
naming its argument, and the tree, its sizes, the allocator, the request table, the state and host
pools are as they were (``kvassert.cache_snapshot``). One test per defect, on the smallest setup
that shows it."""

from __future__ import annotations

import pytest
import torch

from kvassert import (
    Engine,
    FailingBackup,
    FailingFree,
    HybridEngine,
    InjectedFault,
    SimReq,
    assert_unchanged,
    cache_snapshot,
    seq,
)
from kvpool import IntegrityError, PagedTokenToKVPoolAllocator, ReqToTokenPool
from kvpool.cache import CacheInitParams, EvictParams, InsertParams, MatchPrefixParams, RadixCache, RadixKey


def radix(page: int = 4, pages: int = 16, **kw) -> tuple[RadixCache, PagedTokenToKVPoolAllocator]:
    alloc = PagedTokenToKVPoolAllocator(pages * page, page, validate=True)
    table = ReqToTokenPool(4, max_context_len=pages * page, device="cpu")
    params = CacheInitParams(disable=False, req_to_token_pool=table, token_to_kv_pool_allocator=alloc, page_size=page, **kw)
    return RadixCache(params), alloc


def refused(cache, call, exc, match: str) -> None:
    """``call()`` raises ``exc`` matching ``match`` and ``cache`` is as it was."""
    before = cache_snapshot(cache)
    with pytest.raises(exc, match=match):
        call()
    assert_unchanged(before, cache_snapshot(cache), match)


# --- insert: the slots it is given ---------------------------------------------------------------


@pytest.mark.parametrize(
    "what, slots",
    [
        ("never handed out", lambda got: torch.arange(40, 48)),
        ("negative", lambda got: torch.arange(-8, 0)),
        ("the reserved page 0", lambda got: torch.cat((torch.arange(0, 4), got[:4]))),
        ("past the pool", lambda got: torch.arange(200, 208)),
        ("one page twice", lambda got: torch.cat((got[:4], got[:4]))),
    ],
)
def test_insert_refuses_slots_the_allocator_did_not_hand_out(what, slots):
    cache, alloc = radix()
    got = alloc.alloc(8)
    refused(cache, lambda: cache.insert(InsertParams(key=RadixKey(seq(8)), value=slots(got))), ValueError, "value")


def test_insert_refuses_slots_the_tree_holds_under_other_tokens():
    cache, alloc = radix()
    got = alloc.alloc(8)
    cache.insert(InsertParams(key=RadixKey(seq(8)), value=got))
    refused(cache, lambda: cache.insert(InsertParams(key=RadixKey(seq(8, 50)), value=got)), ValueError, "already in the tree")
    assert cache.insert(InsertParams(key=RadixKey(seq(8)), value=got)).prefix_len == 8  # its own slots, same tokens


@pytest.mark.parametrize("priority", [None, 1.5, "x", True])
def test_insert_refuses_a_priority_that_is_not_an_int(priority):
    cache = RadixCache.create_simulated(eviction_policy="priority")
    cache.insert(InsertParams(key=RadixKey([1, 2]), priority=1))
    refused(cache, lambda: cache.insert(InsertParams(key=RadixKey([1, 3]), priority=priority)), TypeError, "priority")


def test_a_bool_is_not_a_token_id():
    cache = RadixCache.create_simulated()
    cache.insert(InsertParams(key=RadixKey([1, 2])))
    refused(cache, lambda: cache.insert(InsertParams(key=RadixKey([True, 2]))), TypeError, "key.token_ids")
    refused(cache, lambda: cache.match_prefix(MatchPrefixParams(key=RadixKey([1, False]))), TypeError, "key.token_ids")


def test_an_unhashable_extra_key_is_named():
    cache = RadixCache.create_simulated()
    refused(cache, lambda: cache.insert(InsertParams(key=RadixKey([1, 2], ["lora"]))), TypeError, "extra_key must be hashable")
    refused(cache, lambda: cache.match_prefix(MatchPrefixParams(key=RadixKey([1], {}))), TypeError, "extra_key must be hashable")


# --- evict and the request calls: a step that fails -----------------------------------------------


def test_evict_puts_its_nodes_back_when_the_free_raises():
    cache, alloc = radix()
    for start in (100, 300):
        cache.insert(InsertParams(key=RadixKey(seq(8, start)), value=alloc.alloc(8)))
    wrapper = FailingFree(alloc)
    cache.token_to_kv_pool_allocator = wrapper
    wrapper.arm()
    refused(cache, lambda: cache.evict(EvictParams(num_tokens=8)), InjectedFault, "injected")
    cache.check_integrity()
    assert cache.evict(EvictParams(num_tokens=8)).num_tokens_evicted == 8  # the nodes are evictable again


def test_cache_finished_req_checks_last_node_before_anything():
    eng = Engine("paged", 4, pages=16)
    eng.finish(eng.admit(seq(9, 100)))
    req = eng.admit(seq(9, 100) + seq(4, 500))
    other = RadixCache.create_simulated(page_size=4)
    other.insert(InsertParams(key=RadixKey(seq(4))))
    req.last_node = other.match_prefix(MatchPrefixParams(key=RadixKey(seq(4)))).last_device_node
    refused(eng.cache, lambda: eng.cache.cache_finished_req(req), ValueError, "last_node")


def test_cache_finished_req_frees_before_the_tree_changes():
    eng = Engine("paged", 4, pages=16)
    eng.finish(eng.admit(seq(9, 100)))
    req = eng.admit(seq(9, 100) + seq(5, 500))
    wrapper = FailingFree(eng.cache.token_to_kv_pool_allocator)
    eng.cache.token_to_kv_pool_allocator = wrapper
    wrapper.arm()
    refused(eng.cache, lambda: eng.cache.cache_finished_req(req), InjectedFault, "injected")
    eng.cache.check_integrity([req])


def test_check_integrity_reports_an_evicted_last_node():
    eng = Engine("token", 1, pages=32)
    eng.finish(eng.admit(seq(6)))
    req = eng.admit(seq(6) + [1])
    eng.cache.dec_lock_ref(req.last_node)
    eng.cache.evict(EvictParams(num_tokens=100))
    with pytest.raises(IntegrityError, match=f"its last_node {req.last_node.id} is evicted"):
        eng.cache.check_integrity([req])


# --- the host tier ---------------------------------------------------------------------------------


def test_a_host_backup_that_raises_frees_its_host_slots_and_changes_nothing():
    eng = Engine("paged", 4, pages=16, host_policy="write_through")
    req = eng.admit(seq(9, 100))
    slots = eng.table.req_to_token[req.req_pool_idx, :8].to(torch.int64)
    backup = FailingBackup(eng.host)
    backup.arm()
    refused(eng.cache, lambda: eng.cache.insert(InsertParams(key=RadixKey(seq(8, 100)), value=slots)), InjectedFault, "injected")
    assert eng.host.available_size() == eng.host.size
    eng.cache.check_integrity([req])


def test_a_write_back_eviction_whose_backup_raises_changes_nothing():
    eng = Engine("paged", 4, pages=16, host_policy="write_back")
    eng.finish(eng.admit(seq(9, 100)))
    eng.finish(eng.admit(seq(9, 300)))
    backup = FailingBackup(eng.host)
    backup.arm()
    refused(eng.cache, lambda: eng.cache.evict(EvictParams(num_tokens=8)), InjectedFault, "injected")
    eng.cache.check_integrity()
    assert eng.cache.evict(EvictParams(num_tokens=8)).num_tokens_evicted == 8


# --- the hybrid cache ------------------------------------------------------------------------------


def hybrid_with_a_snapshot() -> tuple[HybridEngine, SimReq]:
    eng = HybridEngine(1, pages=64, states=12)
    eng.finish(eng.admit(seq(6, 100)))
    req = SimReq(-1, seq(6, 100) + [9])
    del req.req_pool_idx
    req.mamba_pool_idx = None
    req.mamba_last_track_seqlen = None
    eng.table.alloc([req])
    return eng, req


def test_a_copy_on_write_match_takes_an_int_state_slot():
    eng, req = hybrid_with_a_snapshot()
    slot = int(req.mamba_pool_idx)
    req.mamba_pool_idx = slot
    m = eng.cache.match_prefix(MatchPrefixParams(key=RadixKey(req.origin_input_ids), cow_mamba=True, req=req))
    assert len(m.device_indices) == 6
    src = int(m.last_device_node.mamba_value[0])
    for t in (*eng.pool.conv, eng.pool.temporal):
        assert torch.equal(t[:, slot].view(torch.uint8), t[:, src].view(torch.uint8))


def test_a_copy_on_write_match_refuses_a_free_state_slot():
    eng, req = hybrid_with_a_snapshot()
    free = next(s for s in range(1, eng.pool.size + 1) if not eng.pool.is_held(s))
    req.mamba_pool_idx = torch.tensor(free)
    call = lambda: eng.cache.match_prefix(MatchPrefixParams(key=RadixKey(req.origin_input_ids), cow_mamba=True, req=req))  # noqa: E731
    refused(eng.cache, call, ValueError, "req.mamba_pool_idx")


@pytest.mark.parametrize(
    "what, state",
    [("on meta", lambda s: s.to("meta")), ("slot 0", lambda s: torch.tensor([0])), ("out of range", lambda s: torch.tensor([10**6]))],
)
def test_a_hybrid_insert_refuses_a_bad_state_slot(what, state):
    eng, req = hybrid_with_a_snapshot()
    kv = eng.alloc.alloc(4)
    own = torch.tensor([int(req.mamba_pool_idx)])
    params = InsertParams(key=RadixKey(seq(4, 900)), value=kv, mamba_value=state(own))
    refused(eng.cache, lambda: eng.cache.insert(params), ValueError, "mamba_value")


def test_a_hybrid_insert_refuses_a_state_slot_the_tree_holds():
    eng, _ = hybrid_with_a_snapshot()
    held = eng.cache.all_mamba_values_flatten()[:1]
    params = InsertParams(key=RadixKey(seq(4, 900)), value=eng.alloc.alloc(4), mamba_value=held)
    refused(eng.cache, lambda: eng.cache.insert(params), ValueError, "mamba_value")


def test_a_hybrid_finished_request_with_an_unlocked_last_node_changes_nothing():
    eng, req = hybrid_with_a_snapshot()
    node = eng.cache.match_prefix(MatchPrefixParams(key=RadixKey(seq(6, 100)))).last_device_node
    assert node.lock_ref == 0
    req.kv_committed_len = 0
    req.last_node = node
    refused(eng.cache, lambda: eng.cache.cache_finished_req(req), ValueError, "last_node")
