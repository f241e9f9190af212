"""``HiMambaRadixCache`` under random scheduling: hybrid requests admitted (host hits loaded back),
decoded, chunked, finished or retracted, KV and states evicted from the device and nodes from the
host. After every step the tree, both host pools, the allocator and the hybrid request table agree;
every match returns KV only with the state after exactly its tokens, and every loaded KV row and
state is checked byte for byte against what was written (``HiHybridEngine``)."""

from __future__ import annotations

import random

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvassert import HiHybridEngine, SimReq, machine_test
from kvpool.cache import EvictParams


class HiHybridMachine(RuleBasedStateMachine):
    @initialize(
        setup=st.sampled_from([(1, False), (4, True)]), pages=st.integers(5, 9), states=st.integers(5, 10),
        policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
        host=st.sampled_from([(2.0, None), (1.0, 0.3)]), seed=st.integers(0, 3),
    )  # fmt: skip
    def setup(self, setup, pages, states, policy, host, seed):
        page, extra = setup
        ratio, state_ratio = host
        self.eng = HiHybridEngine(page, pages if page > 1 else pages * 4, states, extra=extra, host_policy=policy,
                                  host_ratio=ratio, state_ratio=state_ratio)  # fmt: skip
        rng = random.Random(seed)
        self.stems = [[rng.randrange(1, 4) for _ in range(2 * page + 1)] for _ in range(2)]
        self.finished: list[list] = []  # conversations a later turn continues

    def pick(self, data) -> SimReq:
        return data.draw(st.sampled_from(sorted(self.eng.running.values(), key=lambda r: r.req_pool_idx)))

    @rule(data=st.data())
    def admit(self, data):
        stem = data.draw(st.sampled_from(self.stems))
        tail = data.draw(st.lists(st.integers(1, 2), min_size=1, max_size=self.eng.page + 1))
        self.eng.admit(stem[: data.draw(st.integers(0, len(stem)))] + tail)

    @precondition(lambda self: self.finished)
    @rule(data=st.data())
    def next_turn(self, data):
        tokens = data.draw(st.sampled_from(self.finished))
        self.eng.admit(tokens + data.draw(st.lists(st.integers(1, 2), min_size=1, max_size=2)))

    @precondition(lambda self: self.eng.running)
    @rule(data=st.data(), steps=st.integers(1, 3))
    def decode(self, data, steps):
        req = self.pick(data)
        for _ in range(steps):
            if req.kv_committed_len + 1 > self.eng.table.max_context_len:
                break
            if not self.eng.decode(req, data.draw(st.integers(1, 2))):
                break

    @precondition(lambda self: self.eng.running)
    @rule(data=st.data())
    def chunk(self, data):
        self.eng.chunk(self.pick(data))

    @precondition(lambda self: self.eng.running)
    @rule(data=st.data(), insert=st.booleans())
    def finish_or_retract(self, data, insert):
        req = self.pick(data)
        tokens = req.fill_ids[: req.kv_committed_len]
        self.eng.finish(req, insert)
        if insert and len(tokens) + 2 < self.eng.size // 2:
            self.finished.append(tokens)

    @rule(n=st.integers(0, 40), states=st.integers(0, 3))
    def evict(self, n, states):
        cache = self.eng.cache
        locked = [(nd, nd.mamba_value) for nd in cache._nodes() if nd.mamba_lock_ref > 0]
        free_states = self.eng.pool.available_size()
        got = cache.evict(EvictParams(num_tokens=n, mamba_num=states))
        assert self.eng.pool.available_size() == free_states + got.mamba_num_evicted
        for nd, slot in locked:
            assert nd.mamba_value is not None and torch.equal(nd.mamba_value, slot), "a locked state was evicted"

    @rule(n=st.integers(0, 20))
    def evict_host(self, n):
        host = self.eng.host.kv_host
        free = host.available_size()
        got = self.eng.cache.evict_host(n)
        assert host.available_size() == free + got

    @invariant()
    def everything_agrees(self):
        if hasattr(self, "eng"):
            self.eng.cache.check_hicache_events()
            self.eng.cache.check_integrity(self.eng.running.values())

    def teardown(self):
        if hasattr(self, "eng"):
            self.eng.drain()


TestHiHybridMachine = machine_test(HiHybridMachine, examples=8, steps=30)
