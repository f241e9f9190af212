"""A refused or failing call on a prefix cache changes nothing: faults injected into the allocator's
``free`` and the host pool's backup, a priority that is not an int under the priority policy, and a
copy-on-write match with an int or a free state slot."""

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
    device_pages,
    known_bad,
    seq,
)
from kvpool.cache import EvictParams, InsertParams, MatchPrefixParams, RadixCache, RadixKey


def cases(name: str, kinds: list) -> list:
    """``kinds`` as parameters, each a strict expected failure while ``name`` is known to fail on it."""
    out = []
    for kind in kinds:
        reason = known_bad(kind, name)
        out.append(pytest.param(kind, marks=[pytest.mark.xfail(strict=True, reason=reason)] if reason else [], id=str(kind)))
    return out


def engine(kind: str):
    if kind == "mamba":
        return HybridEngine(1, pages=64, states=12)
    if kind == "hiradix":
        return Engine("paged", 4, pages=16, host_policy="write_through")
    return Engine("paged", 4, pages=16)


def failing_free(eng) -> FailingFree:
    wrapper = FailingFree(eng.cache.token_to_kv_pool_allocator)
    eng.cache.token_to_kv_pool_allocator = wrapper
    return wrapper


KINDS = ["radix", "hiradix", "mamba"]


@pytest.mark.parametrize("kind", cases("failing free in evict", KINDS))
def test_a_free_that_raises_in_evict_leaves_the_tree_as_it_was(kind):
    eng = engine(kind)
    eng.finish(eng.admit(seq(9, 100)))
    eng.finish(eng.admit(seq(9, 300)))
    wrapper = failing_free(eng)
    before = cache_snapshot(eng.cache)
    wrapper.arm()
    with pytest.raises(InjectedFault):
        eng.cache.evict(EvictParams(num_tokens=100))
    assert_unchanged(before, cache_snapshot(eng.cache), "evict with a free that raises")
    eng.cache.check_integrity()


@pytest.mark.parametrize("kind", cases("failing free in cache_finished_req", KINDS))
def test_a_free_that_raises_in_cache_finished_req_changes_nothing(kind):
    eng = engine(kind)
    one = eng.admit(seq(9, 100))
    two = eng.admit(seq(9, 100))  # both computed the same pages: the second's copies go back
    eng.finish(one)
    wrapper = failing_free(eng)
    before = cache_snapshot(eng.cache)
    wrapper.arm()
    with pytest.raises(InjectedFault):
        eng.cache.cache_finished_req(two)
    assert_unchanged(before, cache_snapshot(eng.cache), "cache_finished_req with a free that raises")
    eng.cache.check_integrity([two])


@pytest.mark.parametrize("kind", cases("failing free in cache_unfinished_req", KINDS))
def test_a_free_that_raises_in_cache_unfinished_req_changes_nothing(kind):
    eng = engine(kind)
    one = eng.admit(seq(9, 100))
    two = eng.admit(seq(9, 100))  # both computed the same pages: the second's copies go back
    eng.finish(one)
    wrapper = failing_free(eng)
    before = cache_snapshot(eng.cache)
    wrapper.arm()
    with pytest.raises(InjectedFault):
        eng.cache.cache_unfinished_req(two)
    assert_unchanged(before, cache_snapshot(eng.cache), "cache_unfinished_req with a free that raises")
    eng.cache.check_integrity([two])


@pytest.mark.parametrize("kind", cases("failing free in a write-back evict that made host room", ["hiradix"]))
def test_a_free_that_raises_after_write_back_filled_the_host_changes_nothing(kind):
    """Two leaves, host room for one: the first is written back, the second's backup finds no room
    (the first stays on the host for the rest of the call), then the allocator's free raises. Nothing
    changed: both leaves are back on the device, the first's new copy dropped."""
    eng = Engine("paged", 4, pages=16, host_policy="write_back", host_ratio=0.125)  # 8 host slots
    eng.finish(eng.admit(seq(9, 100)))
    eng.finish(eng.admit(seq(9, 300)))
    wrapper = failing_free(eng)
    before = cache_snapshot(eng.cache)
    wrapper.arm()
    with pytest.raises(InjectedFault):
        eng.cache.evict(EvictParams(num_tokens=100))
    assert_unchanged(before, cache_snapshot(eng.cache), "evict with a free that raises after write-back filled the host")
    eng.cache.check_integrity()
    eng.drain()


@pytest.mark.parametrize("kind", cases("failing host backup", ["hiradix"]))
def test_a_host_backup_that_raises_leaves_nothing_behind(kind):
    eng = engine(kind)
    req = eng.admit(seq(9, 100))
    backup = FailingBackup(eng.host)
    slots = eng.table.req_to_token[req.req_pool_idx, :8].to(torch.int64)
    before = cache_snapshot(eng.cache)
    backup.arm()
    with pytest.raises(InjectedFault):
        eng.cache.insert(InsertParams(key=RadixKey(seq(8, 100)), value=slots))
    assert_unchanged(before, cache_snapshot(eng.cache), "insert with a host backup that raises")
    eng.cache.check_integrity([req])


def host_only_rows(snapshot: dict) -> list:
    """The rows of ``snapshot``'s tree dump of nodes on the host only (no device slots, a host copy)."""
    return [row for row in snapshot["tree"] if row[1] is not None and row[4] is None and row[5] is not None]


def without_host_only_leaves(snapshot: dict, gone: list, host_size: int) -> dict:
    """``snapshot`` as it is once the host-only nodes ``gone`` (rows of its tree dump) have left the
    tree and their host slots are free: a host holding no other copy (the cases below fill it)."""
    want = dict(snapshot)
    want["tree"] = [row for row in snapshot["tree"] if row not in gone]
    want["host pool"] = (host_size, [], None)
    return want


@pytest.mark.parametrize("kind", cases("failing host backup after making host room", ["hiradix"]))
def test_a_host_backup_that_raises_after_making_host_room_leaves_only_the_room_made(kind):
    """The host is full of a host-only leaf: the write-through backup of a new insert evicts it for
    room, then raises. The contract: the host-only leaf evicted for room stays evicted (the copy may
    have written its host slots); nothing else changed."""
    eng = Engine("paged", 4, pages=16, host_policy="write_through", host_ratio=0.125)  # 8 host slots
    eng.finish(eng.admit(seq(9, 100)))
    eng.cache.evict(EvictParams(num_tokens=100))  # on the host only, filling it
    req = eng.admit(seq(9, 300))
    slots = eng.table.req_to_token[req.req_pool_idx, :8].to(torch.int64)
    backup = FailingBackup(eng.host)
    before = cache_snapshot(eng.cache)
    gone = host_only_rows(before)
    assert [len(row[5]) for row in gone] == [8] and eng.host.available_size() == 0
    backup.arm()
    with pytest.raises(InjectedFault):
        eng.cache.insert(InsertParams(key=RadixKey(seq(8, 300)), value=slots))
    want = without_host_only_leaves(before, gone, eng.host.size)
    assert_unchanged(want, cache_snapshot(eng.cache), "insert with a host backup that raises after making room")
    eng.cache.check_integrity([req])


@pytest.mark.parametrize("kind", cases("failing free after a backup made host room", ["hiradix"]))
def test_a_free_that_raises_after_a_backup_made_host_room_in_cache_finished_req_leaves_only_the_room_made(kind):
    """As above, in ``cache_finished_req``: the write-through copy of the request's pages evicts the
    host-only leaf for room, then the allocator's ``free`` raises. The host-only leaf stays evicted;
    nothing else changed (the request still holds its slots and its lock)."""
    eng = Engine("paged", 4, pages=16, host_policy="write_through", host_ratio=0.125)  # 8 host slots
    eng.finish(eng.admit(seq(9, 100)))
    eng.cache.evict(EvictParams(num_tokens=100))
    req = eng.admit(seq(9, 300))
    wrapper = failing_free(eng)
    before = cache_snapshot(eng.cache)
    gone = host_only_rows(before)
    assert [len(row[5]) for row in gone] == [8] and eng.host.available_size() == 0
    wrapper.arm()
    with pytest.raises(InjectedFault):
        eng.cache.cache_finished_req(req)
    want = without_host_only_leaves(before, gone, eng.host.size)
    assert_unchanged(want, cache_snapshot(eng.cache), "cache_finished_req with a free that raises after making room")
    eng.cache.check_integrity([req])


@pytest.mark.parametrize("priority", cases("priority policy: a priority that is not an int", [None, 1.5, "x", [1]]))
def test_a_bad_priority_under_the_priority_policy_changes_nothing(priority):
    cache = RadixCache.create_simulated(eviction_policy="priority")
    cache.insert(InsertParams(key=RadixKey([1, 2]), priority=1))
    before = cache_snapshot(cache)
    with pytest.raises((TypeError, ValueError), match="priority"):
        cache.insert(InsertParams(key=RadixKey([1, 3]), priority=priority))
    assert_unchanged(before, cache_snapshot(cache), f"insert with priority {priority!r}")


def hybrid_request(eng: HybridEngine, tokens: list) -> SimReq:
    req = SimReq(-1, list(tokens))
    del req.req_pool_idx
    req.mamba_pool_idx = None
    req.mamba_last_track_seqlen = None
    eng.table.alloc([req])
    return req


def test_a_copy_on_write_match_takes_an_int_state_slot():
    eng = HybridEngine(1, pages=64, states=8)
    eng.finish(eng.admit(seq(5)))
    req = hybrid_request(eng, seq(5) + [1])
    req.mamba_pool_idx = int(req.mamba_pool_idx)
    m = eng.cache.match_prefix(MatchPrefixParams(key=RadixKey(seq(5)), cow_mamba=True, req=req))
    assert len(m.device_indices) == 5
    eng.check_state(req.mamba_pool_idx, (None, tuple(seq(5))))  # the snapshot's copy


def test_a_copy_on_write_match_refuses_a_free_state_slot():
    eng = HybridEngine(1, pages=64, states=8)
    eng.finish(eng.admit(seq(5)))
    req = hybrid_request(eng, seq(5) + [1])
    req.mamba_pool_idx = torch.tensor([s for s in range(1, 9) if not eng.pool.is_held(s)][0])
    before = cache_snapshot(eng.cache)
    with pytest.raises(ValueError, match="mamba_pool_idx"):
        eng.cache.match_prefix(MatchPrefixParams(key=RadixKey(seq(5)), cow_mamba=True, req=req))
    assert_unchanged(before, cache_snapshot(eng.cache), "a copy-on-write match into a free slot")


def test_a_free_that_raises_after_write_back_made_host_room_puts_back_a_node_that_had_a_host_copy():
    """A loaded-back leaf (on the device and on the host) and a newer leaf without a copy, host room
    for one: the evict drops the first to the host, the second's write-back backup needs room, then
    the allocator's free raises. Nothing may change: the first is back on the device with its host
    copy, in the tree, and later calls find it there."""
    eng = Engine("paged", 4, pages=16, host_policy="write_back", host_ratio=0.125)  # 8 host slots
    eng.finish(eng.admit(seq(9, 100)))
    eng.cache.evict(EvictParams(num_tokens=100))  # written back: on the host only, filling it
    eng.finish(eng.admit(seq(9, 100)))  # loaded back: on the device and on the host
    eng.cache.check_hicache_events()  # the load is done: unlocked
    eng.finish(eng.admit(seq(9, 300)))  # newer, on the device only
    assert eng.host.available_size() == 0
    wrapper = failing_free(eng)
    before = cache_snapshot(eng.cache)
    wrapper.arm()
    with pytest.raises(InjectedFault):
        eng.cache.evict(EvictParams(num_tokens=100))
    assert_unchanged(before, cache_snapshot(eng.cache), "evict with a free that raises after a backup needed room")
    eng.cache.check_integrity()
    eng.drain()
