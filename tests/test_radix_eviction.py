"""Locks and eviction in ``RadixCache``: what a lock protects, the order each policy evicts in, and
the eviction queue's bound."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvassert import RefCache, device_pages, free_recorder, insert, match, seq, sim
from kvpool.cache import EvictParams, EvictResult


def test_locks_protect_the_node_and_its_ancestors():
    alloc, freed = free_recorder()
    cache = sim(1, mock_allocator=alloc)
    insert(cache, [1, 2, 3, 4], [10, 20, 30, 40])
    insert(cache, [1, 2, 5, 6], [10, 20, 50, 60])
    node = match(cache, [1, 2, 3, 4]).last_device_node
    assert cache.inc_lock_ref(node) == -4  # [1, 2] and [3, 4] became protected
    assert (cache.protected_size(), cache.evictable_size()) == (4, 2)
    assert cache.inc_lock_ref(node) == 0
    result = cache.evict(EvictParams(num_tokens=100))
    assert isinstance(result, EvictResult) and result.num_tokens_evicted == 2
    assert freed == [[50, 60]]
    assert match(cache, [1, 2, 3, 4]).device_indices.tolist() == [10, 20, 30, 40]
    assert cache.dec_lock_ref(node) == 0
    assert cache.dec_lock_ref(node) == 4
    assert cache.evict(EvictParams(num_tokens=100)).num_tokens_evicted == 4
    assert freed[1] == [30, 40, 10, 20]  # the leaf, then its parent once it became a leaf: one free call
    assert cache.total_size() == 0


@pytest.mark.parametrize(
    "policy, expect",
    [("lru", ["c", "a", "b"]), ("mru", ["b", "a", "c"]), ("fifo", ["a", "b", "c"]), ("filo", ["c", "b", "a"]),
     ("lfu", ["c", "b", "a"]), ("priority", ["b", "c", "a"])],
)  # fmt: skip
def test_eviction_order_follows_the_policy(policy, expect):
    alloc, freed = free_recorder()
    cache = sim(1, mock_allocator=alloc, eviction_policy=policy)
    names = {}
    for name, start, prio in (("a", 100, 5), ("b", 200, 0), ("c", 300, 1)):
        insert(cache, seq(3, start), seq(3, start), priority=prio)
        names[start] = name
    for _ in range(3):
        match(cache, seq(3, 100))  # a: three hits
    match(cache, seq(3, 200))  # b: one hit, the latest
    order = []
    for _ in range(3):
        cache.evict(EvictParams(num_tokens=1))
        order.append(names[freed[-1][0]])
    assert order == expect


def test_a_parent_whose_last_child_goes_is_evicted_at_its_own_priority():
    alloc, freed = free_recorder()
    cache = sim(1, mock_allocator=alloc)
    insert(cache, [1, 2, 3], [1, 2, 3])
    insert(cache, [1, 2, 4], [1, 2, 4])  # [1, 2] is shared: an inner node
    insert(cache, [9, 9], [8, 8])
    match(cache, [1, 2])  # the inner node is the most recent; its leaves are older than [9, 9]
    for _ in range(3):
        cache.evict(EvictParams(num_tokens=1))
    assert freed == [[3], [4], [8, 8]]  # [1, 2] became a leaf after [4], but is newer than [9, 9]


@settings(max_examples=40, deadline=None)
@given(
    policy=st.sampled_from(["lru", "lfu", "priority", "mru", "fifo", "filo"]),
    ops=st.lists(st.tuples(st.sampled_from(["insert", "match", "lock", "unlock", "evict"]),
                           st.lists(st.integers(1, 3), min_size=1, max_size=6), st.integers(0, 3)), max_size=40),
)  # fmt: skip
def test_each_eviction_takes_an_evictable_leaf_of_least_priority(policy, ops):
    """Against the reference model (``kvassert.RefCache``, the policies as the contract defines them):
    whichever way leaves became evictable (inserted, touched, unlocked, uncovered by their last
    child's eviction), the node evicted holds only unlocked pages with nothing cached below them, and
    ranks least among the model's evictable leaves."""
    alloc, _ = free_recorder()
    cache = sim(1, mock_allocator=alloc, eviction_policy=policy)
    ref = RefCache(1, policy)
    held: list[tuple] = []
    for op, tokens, prio in ops:
        if op == "insert":
            values = list(range(len(tokens)))
            assert insert(cache, tokens, values, priority=prio) == ref.insert(None, tokens, values, prio)
        elif op == "match":
            assert match(cache, tokens).device_indices.tolist() == ref.match(None, tokens)
        elif op == "lock":
            node = match(cache, tokens).last_device_node
            n = len(ref.match(None, tokens))
            if n:
                cache.inc_lock_ref(node)
                ref.lock(None, tokens[:n], 1)
                held.append((node, tokens[:n]))
        elif op == "unlock" and held:
            node, locked = held.pop(prio % len(held))
            cache.dec_lock_ref(node)
            ref.lock(None, locked, -1)
        elif op == "evict":
            leaves = {k for k, page in ref.pages.items() if page.lock == 0} - ref.with_children()
            if not leaves:
                continue
            least = min(ref.rank(ref.pages[k]) for k in leaves)
            assert cache.evict(EvictParams(num_tokens=1)).num_tokens_evicted >= 1
            gone = [k for k in ref.pages if k not in device_pages(cache)]
            assert gone and all(ref.pages[k].lock == 0 and set(ref.below(k)) <= set(gone) for k in gone)
            assert any(k in leaves and ref.rank(ref.pages[k]) == least for k in gone), "not a least-ranked leaf"
            assert len({ref.rank(ref.pages[k]) for k in gone}) == 1, "more than one node evicted"
            for k in gone:
                ref.drop(k)
        assert {k: v[:2] for k, v in device_pages(cache).items()} == {k: (pg.slots, pg.lock) for k, pg in ref.pages.items()}
        cache.sanity_check()


def test_the_eviction_queue_stays_bounded_under_repeated_hits():
    cache = sim(1)
    for i in range(50):
        insert(cache, [i, i + 1, i + 2])
    for _ in range(40):
        for i in range(50):
            match(cache, [i, i + 1, i + 2])
    assert len(cache._queue) <= 2048  # 2000 pushes, rebuilt at twice the live entries (min 1024)
    cache.sanity_check()


def test_evict_frees_nothing_when_everything_is_locked():
    alloc, freed = free_recorder()
    cache = sim(1, mock_allocator=alloc)
    insert(cache, [1, 2], [1, 2])
    cache.inc_lock_ref(match(cache, [1, 2]).last_device_node)
    assert cache.evict(EvictParams(num_tokens=5)).num_tokens_evicted == 0
    assert freed == [] and cache.total_size() == 2
