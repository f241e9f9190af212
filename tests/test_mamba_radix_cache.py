"""``MambaRadixCache``: KV returned only with its state snapshot, branching points, hybrid requests,
copy-on-write forks, state eviction apart from KV, bad input, and a state machine."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvassert import HybridEngine, seq, SimReq, int_tensor as T, tree_state
from kvpool.cache import EvictParams, InsertParams, MambaRadixCache, MatchPrefixParams, RadixKey


def test_a_match_returns_kv_only_up_to_a_state_snapshot():
    cache = MambaRadixCache.create_simulated()
    cache.insert(InsertParams(key=RadixKey([1, 2, 3, 4]), value=T([10, 11, 12, 13]), mamba_value=T([7])))
    cache.insert(InsertParams(key=RadixKey([1, 2, 5]), value=T([10, 11, 15]), mamba_value=T([8])))
    # [1, 2] is now a node without a state: a match ending there returns nothing
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 9])))
    assert len(m.device_indices) == 0 and m.last_device_node is cache.root_node
    assert m.mamba_branching_seqlen is None  # 2 tokens aligned down to the 64-token chunk: 0, no branching point
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4, 9])))
    assert m.device_indices.tolist() == [10, 11, 12, 13] and int(m.last_device_node.mamba_value) == 7
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3])))  # ends inside [3, 4]: its state is after 4
    assert len(m.device_indices) == 0
    assert cache.total_size() == (5, 2)
    result = cache.insert(InsertParams(key=RadixKey([1, 2]), value=T([10, 11]), mamba_value=T([9])))
    assert (result.prefix_len, result.mamba_exist) == (2, False)  # the state-less node takes it
    assert cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 9]))).device_indices.tolist() == [10, 11]
    assert cache.insert(InsertParams(key=RadixKey([1, 2]), value=T([10, 11]), mamba_value=T([6]))).mamba_exist
    cache.sanity_check()


def test_the_branching_point_is_the_match_aligned_to_the_chunk():
    cache = MambaRadixCache.create_simulated(enable_mamba_extra_buffer=True, page_size=2)
    cache.mamba_cache_chunk_size = 4
    cache.insert(InsertParams(key=RadixKey(seq(10)), value=T(seq(10)), mamba_value=T([3])))
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(seq(9))))  # 8 tokens deep, no state there
    assert len(m.device_indices) == 0 and m.mamba_branching_seqlen == 8
    assert cache.match_prefix(MatchPrefixParams(key=RadixKey(seq(10)))).mamba_branching_seqlen is None


@pytest.mark.parametrize("page, extra", [(1, False), (1, True), (16, True)])
def test_hybrid_requests_share_prefixes_with_their_states(page, extra):
    eng = HybridEngine(page, pages=12 if page > 1 else 96, states=16, extra=extra)
    system = seq(2 * page + 3, 500)
    a = eng.admit(system + [1, 2])
    for t in range(page + 1):
        assert eng.decode(a, 70 + t)
    eng.cache.check_integrity(eng.running.values())
    eng.finish(a)
    b = eng.admit(system + [1, 2] + [70 + t for t in range(page + 1)] + [9, 9])
    cached = len(system) + 2 + page + 1 if not extra else (len(system) + 2 + page + 1) // page * page
    assert b.cache_protected_len == cached  # up to the finished request's state
    eng.cache.check_integrity(eng.running.values())
    eng.chunk(b)
    eng.cache.check_integrity(eng.running.values())
    eng.finish(b)
    eng.drain()


def test_the_fork_is_copy_on_write():
    eng = HybridEngine(1, pages=64, states=8)
    eng.finish(eng.admit(seq(6)))
    req = eng.admit(seq(6) + [1])
    node = req.last_node
    snapshot = [b.clone() for b in eng.state_bytes(int(node.mamba_value))]
    eng.write_state(int(req.mamba_pool_idx), ("overwritten", ()))  # the request's state moves on
    assert all(torch.equal(a, b) for a, b in zip(snapshot, eng.state_bytes(int(node.mamba_value))))
    assert int(req.mamba_pool_idx) != int(node.mamba_value)
    eng.cache.check_integrity(eng.running.values())


def test_states_are_evicted_apart_from_kv_and_tombstones_go_with_their_last_leaf():
    eng = HybridEngine(1, pages=64, states=12)
    cache = eng.cache
    eng.finish(eng.admit(seq(4)))
    eng.finish(eng.admit(seq(4) + seq(3, 900)))  # [1000..1003] then [900..902]: two snapshots on a path
    assert cache.total_size() == (7, 2)
    inner = cache.match_prefix(MatchPrefixParams(key=RadixKey(seq(4)))).last_device_node
    assert inner.mamba_value is not None and inner.children
    # the least recently used state first: the inner one; its node stays as a tombstone
    cache.match_prefix(MatchPrefixParams(key=RadixKey(seq(4) + seq(3, 900))))
    result = cache.evict(EvictParams(num_tokens=0, mamba_num=1))
    assert (result.num_tokens_evicted, result.mamba_num_evicted) == (0, 1)
    assert inner.mamba_value is None and cache.total_size() == (7, 1)
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(seq(4) + [5])))
    assert len(m.device_indices) == 0  # the KV is there, its state is not
    cache.check_integrity()
    result = cache.evict(EvictParams(num_tokens=1))
    assert result.num_tokens_evicted == 7 and result.mamba_num_evicted == 1  # the leaf, then the tombstone
    assert cache.total_size() == (0, 0) and eng.pool.available_size() == 12
    cache.check_integrity()


def test_a_locked_snapshot_is_never_evicted():
    eng = HybridEngine(1, pages=64, states=8)
    eng.finish(eng.admit(seq(5)))
    req = eng.admit(seq(5) + [1])  # holds the snapshot after 5 tokens
    assert eng.cache.evict(EvictParams(num_tokens=100, mamba_num=8)).mamba_num_evicted == 0
    assert eng.cache.mamba_protected_size() == 1
    eng.finish(req)
    eng.drain()


def test_bad_hybrid_input():
    cache = MambaRadixCache.create_simulated()
    before = tree_state(cache)
    with pytest.raises(ValueError, match="mamba_value must have 1 entries"):
        cache.insert(InsertParams(key=RadixKey([1, 2]), value=T([1, 2]), mamba_value=T([1, 2])))
    with pytest.raises(TypeError, match="mamba_value must be a torch.Tensor, got NoneType"):
        cache.insert(InsertParams(key=RadixKey([1, 2]), value=T([1, 2])))
    with pytest.raises(TypeError, match="params must be an InsertParams"):
        cache.insert(RadixKey([1, 2]), T([1, 2]))
    with pytest.raises(ValueError, match="mamba_num must be a non-negative int"):
        cache.evict(EvictParams(num_tokens=0, mamba_num=-1))
    with pytest.raises(ValueError, match="swa_num_tokens must be 0"):
        cache.evict(EvictParams(swa_num_tokens=1))
    assert tree_state(cache) == before
    with pytest.raises(ValueError, match="page_size must be 1 without enable_mamba_extra_buffer"):
        MambaRadixCache.create_simulated(page_size=16)


class HybridMachine(RuleBasedStateMachine):
    """Hybrid requests over a MambaRadixCache, KV and states evicted apart: after every step the
    tree, the allocator and the hybrid request table agree (KV slots and state slots), and every
    match returns KV only with the state after exactly that KV's tokens."""

    @initialize(
        setup=st.sampled_from([(1, False), (1, True), (16, True)]), pages=st.integers(4, 8),
        states=st.integers(4, 12), seed=st.integers(0, 3),
    )  # fmt: skip
    def setup(self, setup, pages, states, seed):
        page, extra = setup
        self.eng = HybridEngine(page, pages if page > 1 else pages * 8, states, extra=extra)
        rng = random.Random(seed)
        self.stems = [[rng.randrange(1, 6) for _ in range(2 * page + 2)] for _ in range(2)]

    def pick(self, data) -> SimReq:
        return data.draw(st.sampled_from(sorted(self.eng.running.values(), key=lambda r: r.req_pool_idx)))

    @rule(data=st.data(), extra=st.sampled_from([None, "tenant"]))
    def admit(self, data, extra):
        stem = data.draw(st.sampled_from(self.stems))
        tail = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=self.eng.page + 2))
        self.eng.admit(stem[: data.draw(st.integers(0, len(stem)))] + tail, extra)

    @precondition(lambda self: self.eng.running)
    @rule(data=st.data(), steps=st.integers(1, 3))
    def decode(self, data, steps):
        req = self.pick(data)
        for _ in range(steps):
            if req.kv_committed_len + 1 > self.eng.table.max_context_len or not self.eng.decode(req, data.draw(st.integers(1, 3))):
                break

    @precondition(lambda self: self.eng.running)
    @rule(data=st.data())
    def chunk(self, data):
        self.eng.chunk(self.pick(data))

    @precondition(lambda self: self.eng.running)
    @rule(data=st.data(), insert=st.booleans())
    def finish_or_retract(self, data, insert):
        self.eng.finish(self.pick(data), insert)

    @rule(n=st.integers(0, 100), states=st.integers(0, 4))
    def evict(self, n, states):
        cache = self.eng.cache
        locked = [(nd, nd.mamba_value) for nd in cache._nodes() if nd.mamba_lock_ref > 0]
        before = (cache.full_evictable_size(), cache.mamba_evictable_size(), self.eng.pool.available_size())
        got = cache.evict(EvictParams(num_tokens=n, mamba_num=states))
        assert got.num_tokens_evicted >= min(n, before[0]) or got.mamba_num_evicted
        assert self.eng.pool.available_size() == before[2] + got.mamba_num_evicted
        for nd, slot in locked:
            assert nd.mamba_value is not None and torch.equal(nd.mamba_value, slot), "a locked state was evicted"

    @invariant()
    def everything_agrees(self):
        self.eng.cache.check_integrity(self.eng.running.values())

    def teardown(self):
        if hasattr(self, "eng"):
            self.eng.drain()


TestHybridMachine = HybridMachine.TestCase
TestHybridMachine.settings = settings(TestHybridMachine.settings, stateful_step_count=30)
