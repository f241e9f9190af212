"""``HiMambaRadixCache`` over a storage tier that fails, raises, cuts reads and writes short and
delays (``FaultyStorage``), under random scheduling: two engines share one file store, admit
requests (prefetching from storage first: storage -> host -> device), finish them, evict from the
device and the host, and wipe their tiers so that storage alone holds a prefix. After every step
both engines' trees, host pools, allocators and request tables agree (the storage tier's part of
the integrity check included); every match returns KV only with the state after exactly its tokens
(on the device) or parked after its host part; every loaded KV row and state is checked byte for
byte against what its content wrote (``HiHybridEngine``), whichever tier it came from."""

from __future__ import annotations

import random
import tempfile

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvassert import HiHybridEngine, file_store, machine_test
from kvpool.cache import EvictParams, MatchPrefixParams, RadixKey
from kvpool.cache.himamba_host import HOST_STATE
from kvpool.cache.records import STATE
from kvpool.cache.storage_tier import StoragePolicy
from kvpool.storage.faults import FaultyStorage


def check_match_has_its_states(cache, key):
    """``key``'s match: the device part ends on a state (or the root), the host part on a parked state."""
    m = cache.match_prefix(MatchPrefixParams(key=key))
    dev, host = m.last_device_node, m.last_host_node
    depth, node = 0, dev
    while node is not cache.root_node:
        depth, node = depth + len(node.key), node.parent
    assert depth == len(m.device_indices), "the device part is not the path to last_device_node"
    assert dev is cache.root_node or STATE in dev.records, "KV returned without its state on the device"
    if m.host_hit_length:
        assert host.device is None and HOST_STATE in host.records, "a host hit ends on a node without a parked state"
    else:
        assert host is dev, "last_host_node without a host hit"


class HiHybridStorageMachine(RuleBasedStateMachine):
    @initialize(
        setup=st.sampled_from([(1, False), (4, True)]), policy=st.sampled_from(["best_effort", "wait_complete"]),
        host=st.sampled_from(["write_through", "write_through_selective", "write_back"]), seed=st.integers(0, 3),
    )  # fmt: skip
    def setup(self, setup, policy, host, seed):
        page, extra = setup
        self.dir = tempfile.TemporaryDirectory()
        self.stores = []
        self.engines = []
        for i in range(2):
            store = FaultyStorage(file_store(self.dir.name), seed=seed * 2 + i)
            self.stores.append(store)
            eng = HiHybridEngine(page, 24 // page * 4 if page == 1 else 12, 8, extra=extra, host_policy=host,
                                 host_ratio=1.0, storage=store,
                                 storage_policy=StoragePolicy(prefetch_policy=policy, prefetch_threshold=0, background=False,
                                                              backoff_s=0.0))  # fmt: skip
            if self.engines:
                eng.ids = self.engines[0].ids  # the same KV and state patterns for the same content
            self.engines.append(eng)
        rng = random.Random(seed)
        self.stems = [[rng.randrange(1, 4) for _ in range(3 * page + 1)] for _ in range(2)]
        self.page = page
        self.finished: list[list] = []

    def tokens(self, data):
        stem = data.draw(st.sampled_from(self.stems))
        tail = data.draw(st.lists(st.integers(1, 2), min_size=1, max_size=self.page + 1))
        return stem[: data.draw(st.integers(0, len(stem)))] + tail

    def serve(self, eng, tokens, finish):
        req = eng.admit(tokens)
        if req is not None and finish:
            self.finish_req(eng, req)

    def finish_req(self, eng, req):
        tokens = req.fill_ids[: req.kv_committed_len]
        eng.finish(req)
        if len(tokens) + 2 < eng.size // 4:
            self.finished.append(tokens)  # a later turn (on either engine) continues it

    @rule(data=st.data(), which=st.integers(0, 1), finish=st.booleans())
    def admit(self, data, which, finish):
        self.serve(self.engines[which], self.tokens(data), finish)

    @precondition(lambda self: self.finished)
    @rule(data=st.data(), which=st.integers(0, 1))
    def next_turn(self, data, which):
        tokens = data.draw(st.sampled_from(self.finished))
        self.serve(self.engines[which], tokens + data.draw(st.lists(st.integers(1, 2), min_size=1, max_size=2)), True)

    @precondition(lambda self: any(e.running for e in self.engines))
    @rule(data=st.data())
    def finish(self, data):
        eng = next(e for e in self.engines if e.running)
        self.finish_req(eng, data.draw(st.sampled_from(sorted(eng.running.values(), key=lambda r: r.req_pool_idx))))

    @rule(which=st.integers(0, 1), n=st.integers(0, 40), states=st.integers(0, 3))
    def evict(self, which, n, states):
        self.engines[which].cache.evict(EvictParams(num_tokens=n, mamba_num=states))

    @rule(which=st.integers(0, 1), n=st.integers(0, 20))
    def evict_host(self, which, n):
        self.engines[which].cache.evict_host(n)

    @rule(which=st.integers(0, 1))
    def wipe(self, which):
        """Everything unlocked leaves both tiers: only storage still holds it."""
        eng = self.engines[which]
        eng.cache.check_hicache_events()
        eng.cache.evict(EvictParams(num_tokens=eng.size, mamba_num=eng.pool.size))
        eng.cache.evict_host(eng.host.kv_host.size)

    @rule(which=st.integers(0, 1), rate=st.sampled_from([0.0, 0.1, 0.3]),
          kind=st.sampled_from(["fail", "raise", "short", "delay"]))  # fmt: skip
    def faults(self, which, rate, kind):
        store = self.stores[which]
        store.rates[kind] = rate
        store.delay_s = 0.0005

    @invariant()
    def everything_agrees(self):
        for eng in getattr(self, "engines", ()):
            eng.cache.check_hicache_events()
            eng.cache.check_integrity(eng.running.values())
            for stem in self.stems:
                check_match_has_its_states(eng.cache, RadixKey(stem))

    def teardown(self):
        for store in getattr(self, "stores", ()):
            store.rates.update(dict.fromkeys(store.rates, 0.0))
        for eng in getattr(self, "engines", ()):
            eng.drain()
        if hasattr(self, "dir"):
            self.dir.cleanup()


TestHiHybridStorageMachine = machine_test(HiHybridStorageMachine, examples=20, steps=40)


def test_storage_serves_hits_under_random_scheduling():
    """The machine's runs reach storage: a wiped prefix comes back from it (not a test that cannot fail:
    it counts what the engines loaded from storage over a fixed schedule)."""
    with tempfile.TemporaryDirectory() as d:
        engines = [HiHybridEngine(1, 96, 8, storage=FaultyStorage(file_store(d), seed=i, fail_rate=0.1),
                                  storage_policy=StoragePolicy(prefetch_threshold=0, background=False, backoff_s=0.0))
                   for i in range(2)]  # fmt: skip
        engines[1].ids = engines[0].ids
        rng = random.Random(6)  # a schedule whose faults (drawn per storage call) leave a wiped prefix to storage
        stems = [[rng.randrange(1, 50) for _ in range(12)] for _ in range(3)]
        for step in range(40):
            eng = engines[step % 2]
            req = eng.admit(rng.choice(stems)[: rng.randrange(4, 13)] + [rng.randrange(1, 3)])
            if req is not None:
                eng.finish(req)
            if step % 5 == 4:
                eng.cache.evict(EvictParams(num_tokens=eng.size, mamba_num=eng.pool.size))
                eng.cache.evict_host(eng.host.kv_host.size)
            eng.cache.check_integrity(eng.running.values())
            for s in stems:
                check_match_has_its_states(eng.cache, RadixKey(s))
        assert sum(e.from_storage for e in engines) > 0 and sum(e.states_loaded for e in engines) > 0
        for eng in engines:
            eng.drain()
