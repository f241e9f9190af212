"""Prefetches left open across every other cache call, under random scheduling, for ``HiRadixCache``
and ``HiMambaRadixCache`` over a store that fails, raises and cuts calls short (``FaultyStorage``).
A plain cache's prefetches read straight into host pages they hold from their start whenever the
host has room for them; with deferred workers the reads run only when the machine says, so a
prefetch ends (taken, aborted, closed, reset) before or while its worker still has to read.

A second engine writes prefixes to the shared store; the engine under test starts prefetches from
its matches and leaves them open (their holds on host copies stay) while it serves, evicts from the
device and the host, wipes both tiers, resets or closes its storage; the prefetches end by progress,
abort or termination in any order. After every step the cache's integrity check passes (the storage
tier's holds and page counts included) and the host slots allocated are exactly those of the tree
and of the prefetches; at the end, with every prefetch ended, the workers done and both tiers
evicted, every device slot, host slot and host state slot is free again and no prefetch is counted.
"""

from __future__ import annotations

import random
import tempfile

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvassert import Engine, HiHybridEngine, file_store, machine_test
from kvpool.cache import EvictParams, MatchPrefixParams, RadixKey
from kvpool.cache.records import HOST
from kvpool.cache.storage_tier import StoragePolicy
from kvpool.storage.faults import FaultyStorage

NOW = StoragePolicy(prefetch_threshold=0, background=False, backoff_s=0.0)


class DeferredWorkers:
    """The storage tier's workers with the jobs submitted while ``holding`` queued until ``run_one``
    (first in, first out), the others run at once (after the queued ones: each kind's jobs run in
    order); ``drain`` and ``stop`` run all that are queued, and after ``stop`` jobs run at once."""

    background = False

    def __init__(self):
        self.jobs, self.stopped, self.holding = [], False, False

    def submit(self, kind, job):
        if self.holding and not self.stopped:
            self.jobs.append(job)
        else:
            self.drain()
            job()

    def run_one(self):
        self.jobs.pop(0)()

    def drain(self, timeout_s=30.0):
        while self.jobs:
            self.run_one()
        return True

    def threads(self):
        return []

    def stop(self, timeout_s):
        self.drain()
        self.stopped = True
        return []


def tree_host_slots(root):
    """Host slots the tree's nodes hold (the root's empty copy aside)."""
    count, todo = 0, list(root.children.values())
    while todo:
        node = todo.pop()
        count += len(node.records[HOST].slots) if HOST in node.records else 0
        todo.extend(node.children.values())
    return count


class OpenPrefetchMachine(RuleBasedStateMachine):
    @initialize(
        hybrid=st.booleans(), page=st.sampled_from([1, 4]), policy=st.sampled_from(["best_effort", "wait_complete", "timeout"]),
        host=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
        host_ratio=st.sampled_from([0.5, 1.0, 2.0]), seed=st.integers(0, 3), deferred=st.booleans(),
    )  # fmt: skip
    def setup(self, hybrid, page, policy, host, host_ratio, seed, deferred):
        self.dir = tempfile.TemporaryDirectory()
        self.store = FaultyStorage(file_store(self.dir.name, max_bytes=1 << 22), seed=seed, fail_rate=0.05,
                                   raise_rate=0.05, short_rate=0.05)  # fmt: skip
        policy = StoragePolicy(prefetch_policy=policy, prefetch_threshold=0, background=False, backoff_s=0.0,
                               prefetch_timeout_base_s=0.0)  # fmt: skip
        if hybrid:
            make = lambda **kw: HiHybridEngine(page, pages=96 // page, states=12, extra=page > 1, **kw)  # noqa: E731
        else:
            make = lambda **kw: Engine("paged", page, pages=64 // page, **kw)  # noqa: E731
        self.eng = make(host_policy=host, host_ratio=host_ratio, storage=self.store, storage_policy=policy)
        self.writer = make(host_policy="write_through", storage=file_store(self.dir.name, max_bytes=1 << 22), storage_policy=NOW)
        self.writer.ids = self.eng.ids  # the same KV (and state) patterns for the same content
        self.hybrid, self.page = hybrid, page
        self.deferred = DeferredWorkers() if deferred else None
        if deferred:
            self.cache.storage_tier.workers = self.deferred
        assert (self.cache.storage_tier.host_reads is None) == hybrid  # a hybrid cache reads states beside its pages
        rng = random.Random(seed)
        self.stems = [[rng.randrange(1, 4) for _ in range(12)] for _ in range(3)]
        self.written: list[list[int]] = []
        self.open: list[str] = []
        self.next_id = 0

    @property
    def cache(self):
        return self.eng.cache

    def tokens(self, data):
        stem = data.draw(st.sampled_from(self.stems))
        tail = data.draw(st.lists(st.integers(1, 2), min_size=1, max_size=2 * self.page + 1))
        return stem[: data.draw(st.integers(0, len(stem)))] + tail

    def evict_all(self, eng):
        eng.cache.check_hicache_events()
        eng.cache.evict(EvictParams(num_tokens=eng.size, mamba_num=eng.pool.size) if self.hybrid else EvictParams(num_tokens=eng.size))
        eng.cache.evict_host((eng.host.kv_host if self.hybrid else eng.host).size)

    @rule(data=st.data())
    def serve(self, data):
        tokens = self.tokens(data)
        req = self.eng.admit(tokens)
        if req is not None:
            self.eng.finish(req)
            self.written.append(tokens)  # a prefetch continuing it starts below the root

    @rule(data=st.data())
    def another_engine_writes(self, data):
        tokens = self.tokens(data)
        req = self.writer.admit(tokens)
        if req is not None:
            self.writer.finish(req)
            self.writer.cache.check_hicache_events()
            self.written.append(tokens[: len(tokens) // self.page * self.page])

    @precondition(lambda self: self.cache.enable_storage)
    @rule(data=st.data())
    def prefetch(self, data):
        if self.written and data.draw(st.booleans()):
            tokens = data.draw(st.sampled_from(self.written)) + [2] * data.draw(st.integers(0, 2 * self.page))
        else:
            tokens = self.tokens(data) + [1] * (2 * self.page)
        m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
        node, depth = m.last_host_node, 0
        while node is not self.cache.root_node:
            depth, node = depth + len(node.key), node.parent
        rid = f"r{self.next_id}"
        self.next_id += 1
        if self.deferred is not None:
            self.deferred.holding = True  # (the engine's own prefetches, in serve, run at once)
        try:
            self.cache.prefetch_from_storage(rid, m.last_host_node, RadixKey(tokens[depth:]))
        finally:
            if self.deferred is not None:
                self.deferred.holding = False
        op = self.cache.storage_tier.ongoing_prefetch.get(rid)
        if op is not None:
            self.open.append(rid)
            if not self.hybrid and op.slots is None:  # read into pages of its own only without host room
                assert op.finished or self.eng.host.available_size() < len(op.keys) * self.page

    @precondition(lambda self: self.deferred is not None and self.deferred.jobs)
    @rule()
    def a_worker_runs_a_job(self):
        self.deferred.run_one()

    @precondition(lambda self: self.open)
    @rule(data=st.data(), how=st.sampled_from(["progress", "abort", "terminate"]))
    def end_one(self, data, how):
        rid = data.draw(st.sampled_from(self.open))
        if how == "progress":
            if self.cache.check_prefetch_progress(rid):
                self.open.remove(rid)
                self.cache.pop_prefetch_loaded_tokens(rid)
        elif how == "abort":
            self.cache.release_aborted_request(rid)
            self.open.remove(rid)
        else:
            self.cache.terminate_prefetch(rid)

    @rule(n=st.integers(0, 40), states=st.integers(0, 3))
    def evict(self, n, states):
        self.cache.evict(EvictParams(num_tokens=n, mamba_num=states) if self.hybrid else EvictParams(num_tokens=n))

    @rule(n=st.integers(0, 30))
    def evict_host(self, n):
        self.cache.evict_host(n)

    @precondition(lambda self: self.hybrid)
    @rule()
    def drop_every_state(self):
        """Every unlocked state snapshot leaves the device: the nodes keep their KV without one."""
        self.cache.evict(EvictParams(num_tokens=0, mamba_num=self.eng.pool.size))

    @rule()
    def wipe(self):
        self.evict_all(self.eng)

    @precondition(lambda self: not self.eng.running)
    @rule()
    def reset(self):
        self.cache.reset()
        self.open.clear()
        self.eng.alloc.clear()
        if self.hybrid:
            self.eng.table.clear()

    @precondition(lambda self: self.cache.enable_storage)
    @rule()
    def close(self):
        self.cache.close()
        self.open.clear()

    @invariant()
    def the_cache_agrees_with_itself(self):
        if hasattr(self, "eng"):
            self.cache.check_hicache_events()
            self.cache.check_integrity(self.eng.running.values())
            host = self.eng.host.kv_host if self.hybrid else self.eng.host
            held = sum(len(s) for s in self.cache.storage_tier.held_host_slots())
            assert host.size - host.available_size() == tree_host_slots(self.cache.root_node) + held

    def teardown(self):
        if not hasattr(self, "eng"):
            return
        try:
            for rid in list(self.open):
                self.cache.release_aborted_request(rid)
            assert self.cache.storage_tier.drain()  # the workers done: the pages they held are free
            self.evict_all(self.eng)
            tier, eng = self.cache.storage_tier, self.eng
            host = eng.host.kv_host if self.hybrid else eng.host
            assert host.available_size() == host.size, "host slots held after every prefetch ended and both tiers were evicted"
            if self.hybrid:
                assert eng.host.state_host.available_size() == eng.host.state_host.size, "host state slots held"
            assert eng.alloc.available_size() == eng.size // eng.page * eng.page, "device slots held"
            assert tier.prefetch_pages == 0 and not tier.ongoing_prefetch
        finally:
            self.cache.close()
            self.writer.cache.close()
            self.dir.cleanup()


TestOpenPrefetchMachine = machine_test(OpenPrefetchMachine, examples=40, steps=50)
