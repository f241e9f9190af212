"""State machines of scheduler traffic (admit, decode, chunk, finish, retract, evict, lock) over
``RadixCache`` and ``HiRadixCache``: tree, allocator and request table agree after every step, and
every match returns slots holding exactly the KV asked for."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvassert import Engine, machine_test, tree_state
from kvpool.cache import EvictParams, MatchPrefixParams, RadixKey, TreeNode


class PrefixCacheMachine(RuleBasedStateMachine):
    """Requests arrive with shared prefixes, decode, chunk, finish or are retracted; the test also
    evicts and takes extra locks. After every step the tree, the allocator and the request table
    agree (check_integrity: no leak, no slot owned twice), and every match returns slots holding
    exactly the KV of the tokens asked for."""

    @initialize(
        setup=st.sampled_from([("token", 1), ("paged", 1), ("paged", 16), ("paged", 64)]),
        pages=st.integers(4, 12), policy=st.sampled_from(["lru", "lfu", "priority"]), seed=st.integers(0, 3),
    )  # fmt: skip
    def setup(self, setup, pages, policy, seed):
        kind, page = setup
        self.eng = Engine(kind, page, pages, policy=policy)
        rng = random.Random(seed)
        self.stems = [[rng.randrange(1, 6) for _ in range(2 * page + 2)] for _ in range(2)]
        self.held: list[TreeNode] = []
        self.finished: list[tuple[list, Any]] = []

    def tokens(self, data) -> list:
        page = self.eng.page
        stem = data.draw(st.sampled_from(self.stems))
        cut = data.draw(st.integers(0, len(stem)))
        tail = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=page + 2))
        return stem[:cut] + tail

    @rule(data=st.data(), extra=st.sampled_from([None, "tenant"]))
    def admit(self, data, extra):
        self.eng.admit(self.tokens(data), extra)

    @precondition(lambda self: self.eng.running)
    @rule(data=st.data(), steps=st.integers(1, 3))
    def decode(self, data, steps):
        req = data.draw(st.sampled_from(sorted(self.eng.running.values(), key=lambda r: r.req_pool_idx)))
        for _ in range(steps):
            if req.kv_committed_len + 1 > self.eng.table.max_context_len or not self.eng.decode(req, data.draw(st.integers(1, 3))):
                break

    @precondition(lambda self: self.eng.running)
    @rule(data=st.data())
    def chunk(self, data):
        self.eng.chunk(data.draw(st.sampled_from(sorted(self.eng.running.values(), key=lambda r: r.req_pool_idx))))

    @precondition(lambda self: self.eng.running)
    @rule(data=st.data(), insert=st.booleans())
    def finish_or_retract(self, data, insert):
        req = data.draw(st.sampled_from(sorted(self.eng.running.values(), key=lambda r: r.req_pool_idx)))
        self.finished.append((req.fill_ids[: req.kv_committed_len] + [1], req.extra_key))
        self.eng.finish(req, insert)

    @precondition(lambda self: self.finished)
    @rule(data=st.data(), evict_first=st.booleans())
    def readmit(self, data, evict_first):
        """A request that continues a finished one (the next turn of a chat), maybe after its pages
        were evicted (with a host tier: parked there, loaded back)."""
        tokens, extra = data.draw(st.sampled_from(self.finished))
        if evict_first:
            self.evict(self.eng.size)
        self.eng.admit(tokens, extra)

    @rule(n=st.integers(0, 200))
    def evict_some(self, n):
        self.evict(n)

    def evict(self, n):
        cache = self.eng.cache
        locked = [(node, node.value.tolist()) for node in cache._nodes() if node.lock_ref > 0 and node is not cache.root_node]
        evictable, available = cache.evictable_size(), self.eng.alloc.available_size()
        got = cache.evict(EvictParams(num_tokens=n)).num_tokens_evicted
        assert got >= min(n, evictable) and cache.evictable_size() == evictable - got
        assert self.eng.alloc.available_size() == available + got
        for node, value in locked:
            assert node.value is not None and node.value.tolist() == value, "a locked node was evicted"

    @rule(data=st.data())
    def lock(self, data):
        m = self.eng.cache.match_prefix(MatchPrefixParams(key=RadixKey(self.tokens(data))))
        if m.last_device_node is not self.eng.cache.root_node:
            self.eng.cache.inc_lock_ref(m.last_device_node)
            self.held.append(m.last_device_node)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def unlock(self, data):
        node = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.eng.cache.dec_lock_ref(node)

    @rule()
    def unlock_an_unlocked_node(self):
        cache = self.eng.cache
        free = [n for n in cache._nodes() if n.lock_ref == 0 and n.value is not None and n is not cache.root_node]
        if free:
            before = tree_state(cache)
            with pytest.raises(ValueError, match="not locked"):
                cache.dec_lock_ref(free[0])
            assert tree_state(cache) == before

    @invariant()
    def tree_allocator_and_table_agree(self):
        self.eng.cache.check_integrity(self.eng.running.values())

    def teardown(self):
        if hasattr(self, "eng"):
            for node in self.held:
                self.eng.cache.dec_lock_ref(node)
            self.eng.drain()


TestPrefixCacheMachine = machine_test(PrefixCacheMachine, examples=60, steps=30)


HOST_POLICIES = ["write_through", "write_through_selective", "write_back"]


class HostTierMachine(PrefixCacheMachine):
    """The same requests over a HiRadixCache: evicted pages park on the host and come back byte for
    byte; the host pool's slots are owned by exactly the nodes holding them."""

    @initialize(
        setup=st.sampled_from([("paged", 1), ("paged", 16), ("token", 1)]), pages=st.integers(4, 10),
        host_policy=st.sampled_from(HOST_POLICIES), ratio=st.sampled_from([0.5, 1.0, 2.0]), seed=st.integers(0, 3),
    )  # fmt: skip
    def setup(self, setup, pages, host_policy, ratio, seed):
        kind, page = setup
        pages = pages if page > 1 else pages * 8
        self.eng = Engine(kind, page, pages, host_policy=host_policy, host_ratio=ratio)
        rng = random.Random(seed)
        self.stems = [[rng.randrange(1, 6) for _ in range(2 * page + 2)] for _ in range(2)]
        self.held = []
        self.finished = []

    @precondition(lambda self: self.eng.running)
    @rule(data=st.data())
    def next_turn_after_eviction(self, data):
        """A chat's turn ends, its pages are evicted to the host, and its next turn comes back."""
        req = data.draw(st.sampled_from(sorted(self.eng.running.values(), key=lambda r: r.req_pool_idx)))
        tokens = req.fill_ids[: req.kv_committed_len] + [1]
        self.eng.finish(req)
        self.evict(self.eng.size)
        self.eng.admit(tokens, req.extra_key)

    @rule(n=st.integers(0, 200))
    def evict_host(self, n):
        before = self.eng.host.available_size()
        freed = self.eng.cache.evict_host(n)
        assert self.eng.host.available_size() == before + freed

    @invariant()
    def transfers_complete(self):
        self.eng.cache.check_hicache_events()


TestHostTierMachine = machine_test(HostTierMachine, examples=60, steps=30)
