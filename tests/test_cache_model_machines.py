"""``RadixCache`` (page 1 and 64, every eviction policy) and ``HiRadixCache`` (every write policy,
host layout and io backend) as state machines against a reference model (``kvassert.RefCache``):
after every step the tree's device pages, slots and locks are the model's, every KV slot the tree or
a running request holds reads back the tag of the token prefix it belongs to, and the library's
``check_integrity`` passes. Random bad calls must raise and change nothing (``cache_snapshot``), and
injected faults (a free that raises, a host backup that raises, an exhausted allocator) must leave
the cache as it was or as the contract says."""

from __future__ import annotations

import random
from typing import Any, Optional

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvassert import (
    FailingBackup,
    FailingFree,
    InjectedFault,
    KVTags,
    RefCache,
    SimReq,
    RefPage,
    assert_unchanged,
    cache_bad_calls,
    cache_snapshot,
    device_nodes,
    device_pages,
    known_bad,
    machine_test,
    prefix_contents,
    tensor_digest,
)
from kvpool import MHATokenToKVPool, MHATokenToKVPoolHost, PagedTokenToKVPoolAllocator, ReqToTokenPool, TokenToKVPoolAllocator
from kvpool.cache import CacheInitParams, EvictParams, HiRadixCache, InsertParams, MatchPrefixParams, RadixCache, RadixKey

POLICIES = ["lru", "lfu", "fifo", "mru", "filo", "priority"]
#: (page size, allocator, pages): page 64 with few pages and short prompts, to stay cheap.
SETUPS = [(1, "token", 40), (1, "paged", 40), (64, "paged", 5)]


class RadixModelMachine(RuleBasedStateMachine):
    """Requests and direct calls on a RadixCache, mirrored on the reference model."""

    check_order = True  # the eviction order is the policy's (the host tier counts hits of its own)

    def build(self, page: int, kind: str, pages: int, policy: str, seed: int, **hi: Any) -> None:
        size = page * pages
        self.page, self.size, self.kind = page, size, kind
        self.kind_name = f"{'hiradix' if hi else 'radix'}-page-{page}"
        self.pool = MHATokenToKVPool(size, page, torch.float32, 1, 1, 1, "cpu", fused="never", warmup=False)
        inner = (TokenToKVPoolAllocator(size, kvcache=self.pool, validate=True) if kind == "token"
                 else PagedTokenToKVPoolAllocator(size, page, kvcache=self.pool, validate=True))  # fmt: skip
        self.alloc = FailingFree(inner)
        self.table = ReqToTokenPool(5, max_context_len=size + page, device="cpu")
        params = CacheInitParams(disable=False, req_to_token_pool=self.table, token_to_kv_pool_allocator=self.alloc,
                                 page_size=page, eviction_policy=policy)  # fmt: skip
        self.cache = self.make_cache(params, **hi)
        self.ref = RefCache(page, policy)
        self.tags = KVTags(self.pool)
        self.running: dict[int, SimReq] = {}
        self.held: list[tuple[Any, Any, tuple]] = []  # (node, extra, locked tokens)
        self.gone: list[Any] = []  # nodes seen leave the tree
        rng = random.Random(seed)
        self.stems = [[rng.randrange(1, 5) for _ in range(2 * page + 2)] for _ in range(2)]
        foreign = RadixCache.create_simulated(page_size=page)
        foreign.insert(InsertParams(key=RadixKey(list(range(page)))))
        self.foreign = foreign.match_prefix(MatchPrefixParams(key=RadixKey(list(range(page))))).last_device_node

    def make_cache(self, params: CacheInitParams, **hi: Any) -> RadixCache:
        return RadixCache(params)

    # --- drawing -------------------------------------------------------------------------------

    def tokens(self, data) -> list:
        stem = data.draw(st.sampled_from(self.stems))
        cut = data.draw(st.integers(0, len(stem)))
        return stem[:cut] + data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=self.page + 2))

    def pick(self, data) -> SimReq:
        return self.running[data.draw(st.sampled_from(sorted(self.running)))]

    # --- allocation and eviction ---------------------------------------------------------------

    def _alloc(self, n: int, prefix: int, last: int) -> Optional[torch.Tensor]:
        if self.kind == "token":
            return self.alloc.alloc(n)
        one = torch.ones(1, dtype=torch.int64)
        pre, seq = prefix * one, (prefix + n) * one
        return self.alloc.alloc_extend(pre, pre.clone(), seq, seq.clone(), last * one, n)

    def alloc_or_evict(self, n: int, prefix: int, last: int) -> Optional[torch.Tensor]:
        got = self._alloc(n, prefix, last)
        if got is None:
            self.evict(n + self.page)
            got = self._alloc(n, prefix, last)
        return got

    def absorb_eviction(self, order_from: Optional[set] = None) -> list[tuple]:
        """Check what left the device since the reference was last updated and drop it from the
        reference: only unlocked pages, with everything below them, and (``order_from``, the evictable
        leaves then) never one ranked after a leaf that stayed."""
        now = device_pages(self.cache)
        removed = [k for k in self.ref.pages if k not in now]
        for k, (slots, lock, _, _) in now.items():
            assert k in self.ref.pages and self.ref.pages[k].slots == slots, f"page {k} appeared or moved: {slots}"
        owners = self.alloc.backup_state().owners
        reused = {s for slots, _, _, _ in now.values() for s in slots}  # a load back may take freed slots
        for k in removed:
            page = self.ref.pages[k]
            assert page.lock == 0, f"evicted a locked page {k}"
            assert all(d in removed for d in self.ref.below(k)), f"evicted page {k} but kept a page below it"
            assert all(int(owners[s]) == 0 or s in reused for s in page.slots), f"evicted page {k}'s slots are not free"
        if order_from is not None and removed:
            worst = max(self.ref.rank(self.ref.pages[k]) for k in removed)
            for k in order_from - set(removed):
                assert self.ref.rank(self.ref.pages[k]) >= worst, f"evicted a page ranked after the kept leaf {k}"
        for k in removed:
            self.ref.drop(k)
        return removed

    def evict(self, n: int) -> int:
        nodes = device_nodes(self.cache)
        leaves = self.evictable_leaves()
        evictable, available = self.ref.unlocked_tokens(), self.alloc.available_size()
        got = self.cache.evict(EvictParams(num_tokens=n)).num_tokens_evicted
        removed = self.absorb_eviction(leaves if self.check_order else None)
        assert got == len(removed) * self.page >= min(n, evictable)
        assert self.alloc.available_size() == available + got
        self.gone = ([nd for nd in nodes if nd.value is None] + self.gone)[:8]
        return got

    # --- requests ------------------------------------------------------------------------------

    def load_back(self, m, extra: Any, tokens: list, p: int, last: Any) -> tuple[torch.Tensor, Any]:
        """The host tier's part of an admission (none here)."""
        return m.device_indices, last

    @rule(data=st.data(), extra=st.sampled_from([None, "tenant"]), priority=st.integers(0, 3))
    def admit(self, data, extra, priority):
        tokens = self.tokens(data)
        rows = self.table.alloc(1)
        if rows is None:
            return
        m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens[:-1], extra)))
        want = self.ref.match(extra, tokens[:-1])
        assert m.device_indices.tolist() == want
        self.tags.check(want, prefix_contents(extra, tokens, 0, len(want)), "a match")
        last = m.last_device_node
        self.cache.inc_lock_ref(last)
        self.ref.lock(extra, tokens[: len(want)], 1)
        prefix, last = self.load_back(m, extra, tokens, len(want), last)
        p = len(prefix)
        new = self.alloc_or_evict(len(tokens) - p, p, int(prefix[-1]) if p else -1)
        if new is None:
            self.cache.dec_lock_ref(last)
            self.ref.lock(extra, tokens[:p], -1)
            self.table.free(rows[0])
            return
        row = rows[0]
        self.table.write((row, slice(0, len(tokens))), torch.cat((prefix, new)).to(torch.int32))
        self.tags.write(new.tolist(), prefix_contents(extra, tokens, p, len(tokens)))
        self.running[row] = SimReq(row, list(tokens), extra, last_node=last, cache_protected_len=p, prefix_indices=prefix,
                                   kv_committed_len=len(tokens), kv_allocated_len=len(tokens), priority=priority)  # fmt: skip

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(1, 4))
    def decode(self, data, token):
        req = self.pick(data)
        n = req.kv_committed_len
        if n + 1 > self.table.max_context_len:
            return
        last = int(self.table.req_to_token[req.req_pool_idx, n - 1])
        if self.kind == "token":
            got = self.alloc.alloc(1)
        else:
            seq = torch.tensor([n + 1])
            got = self.alloc.alloc_decode(seq, seq.clone(), torch.tensor([last]))
        if got is None:
            return
        req.output_ids.append(token)
        self.table.req_to_token[req.req_pool_idx, n] = int(got[0])
        self.tags.write([int(got[0])], [(req.extra_key, tuple(req.fill_ids))])
        req.kv_committed_len = req.kv_allocated_len = n + 1

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def chunk(self, data):
        req = self.pick(data)
        tokens, extra, cpl = req.fill_ids, req.extra_key, req.cache_protected_len
        row = self.table.req_to_token[req.req_pool_idx, : len(tokens)].tolist()
        aligned = len(tokens) // self.page * self.page
        self.cache.cache_unfinished_req(req)
        held = self.ref.insert(extra, tokens[:aligned], row[:aligned], req.priority)
        tree = self.ref.match(extra, tokens[:aligned])
        self.ref.lock(extra, tokens[:aligned], 1)
        self.ref.lock(extra, tokens[:cpl], -1)
        self.expect_free(row[cpl:held])
        assert req.cache_protected_len == aligned and req.prefix_indices.tolist() == tree + row[aligned:]

    @precondition(lambda self: self.running)
    @rule(data=st.data(), insert=st.booleans())
    def finish(self, data, insert):
        req = self.pick(data)
        self.finish_req(req, insert)

    def finish_req(self, req: SimReq, insert: bool) -> None:
        tokens, extra, cpl = req.fill_ids[: req.kv_committed_len], req.extra_key, req.cache_protected_len
        row = self.table.req_to_token[req.req_pool_idx, : len(tokens)].tolist()
        aligned = len(tokens) // self.page * self.page
        self.cache.cache_finished_req(req, is_insert=insert)
        end = self.ref.insert(extra, tokens[:aligned], row[:aligned], req.priority) if insert and aligned else aligned
        self.ref.lock(extra, tokens[:cpl], -1)
        self.expect_free(row[cpl:end] + row[aligned:])
        self.table.free(req.req_pool_idx)
        del self.running[req.req_pool_idx]

    def expect_free(self, slots: list) -> None:
        owners = self.alloc.backup_state().owners
        held = [s for s in slots if int(owners[s])]
        assert not held, f"slots {held} should be back in the allocator"

    # --- direct calls --------------------------------------------------------------------------

    @rule(data=st.data(), extra=st.sampled_from([None, "tenant"]), priority=st.integers(0, 3))
    def insert(self, data, extra, priority):
        tokens = self.tokens(data)
        n = -(-len(tokens) // self.page) * self.page
        slots = self.alloc.alloc(n)
        if slots is None:
            return
        slots = slots[: len(tokens)] if self.kind == "token" else slots
        self.tags.write(slots.tolist()[: len(tokens)], prefix_contents(extra, tokens, 0, len(tokens)))
        got = self.cache.insert(InsertParams(key=RadixKey(tokens, extra), value=slots[: len(tokens)], priority=priority))
        aligned = len(tokens) // self.page * self.page
        held = self.ref.insert(extra, tokens[:aligned], slots.tolist()[:aligned], priority)
        assert got.prefix_len == held
        rest = torch.cat((slots[:held], slots[aligned:]))
        if rest.numel():
            self.alloc.free(rest)

    @rule(data=st.data(), extra=st.sampled_from([None, "tenant"]))
    def match(self, data, extra):
        tokens = self.tokens(data)
        m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens, extra)))
        want = self.ref.match(extra, tokens)
        assert m.device_indices.tolist() == want
        self.tags.check(want, prefix_contents(extra, tokens, 0, len(want)), "a match")

    @precondition(lambda self: self.ref.pages)
    @rule(data=st.data())
    def match_cached(self, data):
        """A match of a cached prefix (a later access than its creation: LRU and FIFO part here)."""
        extra, tokens = data.draw(st.sampled_from(sorted(self.ref.pages, key=repr)))
        tokens = list(tokens)
        m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens, extra)))
        want = self.ref.match(extra, tokens)
        assert m.device_indices.tolist() == want
        self.tags.check(want, prefix_contents(extra, tokens, 0, len(want)), "a match")

    @rule(data=st.data(), extra=st.sampled_from([None, "tenant"]))
    def lock(self, data, extra):
        tokens = self.tokens(data)
        m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens, extra)))
        want = self.ref.match(extra, tokens)
        if want:
            self.cache.inc_lock_ref(m.last_device_node)
            self.ref.lock(extra, tokens[: len(want)], 1)
            self.held.append((m.last_device_node, extra, tuple(tokens[: len(want)])))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def unlock(self, data):
        node, extra, tokens = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.cache.dec_lock_ref(node)
        self.ref.lock(extra, tokens, -1)

    def evictable_leaves(self) -> set:
        return {k for k, page in self.ref.pages.items() if page.lock == 0} - self.ref.with_children()

    @precondition(lambda self: len(self.evictable_leaves()) >= 2)
    @rule()
    def evict_one_node(self):
        """One token, with two evictable leaves or more: exactly one goes, the least in the policy's
        order."""
        self.evict(1)

    @precondition(lambda self: len(self.ref.pages) >= 3)
    @rule(pages=st.integers(0, 3), more=st.booleans())
    def evict_some(self, pages, more):
        """A few pages (the policy's order shows only when some evictable leaves stay), or many."""
        self.evict(self.page * (pages if not more else 8 * pages))

    # --- bad calls and faults ------------------------------------------------------------------

    @rule(data=st.data())
    def bad_call(self, data):
        calls = {k: v for k, v in cache_bad_calls(self).items() if not known_bad(self.kind_name, k)}
        name = data.draw(st.sampled_from(sorted(calls)))
        call, exc, msg = calls[name]
        before = cache_snapshot(self.cache)
        with pytest.raises(exc, match=msg):
            call()
        assert_unchanged(before, cache_snapshot(self.cache), name)

    @precondition(lambda self: not known_bad(self.kind_name, "failing free in evict")
                  and not (getattr(self.cache, "write_policy", None) == "write_back"
                           and known_bad(self.kind_name, "failing free in a write-back evict that made host room")))  # fmt: skip
    @rule(n=st.integers(1, 300))
    def free_fails_in_evict(self, n):
        if self.ref.unlocked_tokens() == 0:
            return
        before = self.evict_fault_snapshot()
        self.alloc.arm()
        with pytest.raises(InjectedFault):
            self.cache.evict(EvictParams(num_tokens=n))
        self.alloc.armed = False
        self.assert_evict_fault_left(before, "evict with a free that raises")

    def evict_fault_snapshot(self) -> dict:
        """What a failed evict must leave as it was: ``cache_snapshot``."""
        return cache_snapshot(self.cache)

    def assert_evict_fault_left(self, before: dict, what: str) -> None:
        """A failed evict left the cache as ``before`` (``evict_fault_snapshot``): everything, on this cache."""
        assert_unchanged(before, self.evict_fault_snapshot(), what)

    @precondition(lambda self: self.running and not known_bad(self.kind_name, "failing free in cache_finished_req"))
    @rule(data=st.data(), insert=st.booleans())
    def free_fails_in_finish(self, data, insert):
        req = self.pick(data)
        tokens, cpl = req.fill_ids[: req.kv_committed_len], req.cache_protected_len
        aligned = len(tokens) // self.page * self.page
        end = self.ref.held(req.extra_key, tokens[:aligned]) if insert else aligned
        if end == cpl and aligned == len(tokens):
            return  # nothing to free: the fault would not fire
        host = getattr(self, "host", None)
        if host is not None and host.available_size() < aligned:
            return  # the copy may evict host-only leaves for room first (kept evicted: test_cache_atomicity)
        before = cache_snapshot(self.cache)
        self.alloc.arm()
        try:
            with pytest.raises(InjectedFault):
                self.cache.cache_finished_req(req, is_insert=insert)
        finally:
            self.alloc.armed = False
        assert_unchanged(before, cache_snapshot(self.cache), "cache_finished_req with a free that raises")

    @precondition(lambda self: self.running)
    @rule(data=st.data(), extra=st.sampled_from([None, "tenant"]))
    def admit_when_exhausted(self, data, extra):
        """Every free slot is taken: an admission evicts for room or is refused; nothing leaks."""
        hog = self.alloc.alloc(self.alloc.available_size())
        try:
            self.admit(data, extra, 0)
        finally:
            if hog is not None and hog.numel():
                self.alloc.free(hog)

    # --- invariants ----------------------------------------------------------------------------

    @invariant()
    def tree_is_the_model(self):
        if not hasattr(self, "cache"):
            return
        pages = device_pages(self.cache)
        want = {k: (pg.slots, pg.lock) for k, pg in self.ref.pages.items()}
        assert {k: v[:2] for k, v in pages.items()} == want
        for (extra, tokens), page in self.ref.pages.items():
            self.tags.check(page.slots, prefix_contents(extra, tokens, len(tokens) - self.page, len(tokens)), "a tree page")
        for req in self.running.values():
            row = self.table.req_to_token[req.req_pool_idx, : req.kv_committed_len].tolist()
            self.tags.check(row, prefix_contents(req.extra_key, req.fill_ids, 0, len(row)), "a running request")
        self.cache.check_integrity(self.running.values())

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        for node, extra, tokens in self.held:
            self.cache.dec_lock_ref(node)
            self.ref.lock(extra, tokens, -1)
        for req in list(self.running.values()):
            self.finish_req(req, True)
        self.evict(self.size)
        assert self.cache.total_size() == 0 and self.alloc.available_size() == self.size
        self.cache.check_integrity()


def machine_for(policy: str) -> type:
    """The machine under one eviction policy (each policy gets its own runs)."""

    class Machine(RadixModelMachine):
        @initialize(setup=st.sampled_from(SETUPS), seed=st.integers(0, 7))
        def setup(self, setup, seed):
            page, kind, pages = setup
            self.build(page, kind, pages, policy, seed)

    Machine.__name__ = Machine.__qualname__ = f"RadixModelMachine_{policy}"
    return Machine


for _policy in POLICIES:
    globals()[f"TestRadixModelMachine_{_policy}"] = machine_test(machine_for(_policy), examples=12, steps=50)
del _policy


HOST_SETUPS = [(1, "token", 24), (4, "paged", 8)]


class HiRadixModelMachine(RadixModelMachine):
    """The same over a HiRadixCache: evicted pages may park on the host; loaded back they read the
    tags written at first (the host copy is byte for byte)."""

    check_order = False

    @initialize(
        setup=st.sampled_from(HOST_SETUPS), write_policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
        layout=st.sampled_from(["layer_first", "page_first"]), io_backend=st.sampled_from(["kernel", "direct"]),
        ratio=st.sampled_from([0.5, 1.0]), seed=st.integers(0, 7),
    )  # fmt: skip
    def setup(self, setup, write_policy, layout, io_backend, ratio, seed):
        page, kind, pages = setup
        self.build(page, kind, pages, "lru", seed, write_policy=write_policy, layout=layout, io_backend=io_backend, ratio=ratio)

    def make_cache(self, params: CacheInitParams, write_policy="write_through", layout="layer_first", io_backend="kernel", ratio=1.0):
        self.host = MHATokenToKVPoolHost(self.pool, ratio, 0, self.page, layout)
        self.backup = FailingBackup(self.host)
        return HiRadixCache(params, host_pool=self.host, write_policy=write_policy, io_backend=io_backend, load_back_threshold=0)

    def load_back(self, m, extra, tokens, p, last):
        if not m.host_hit_length:
            return m.device_indices, last
        new, node = self.cache.init_load_back(m.last_host_node, m.host_hit_length)
        loaded = [k for k in self.ref.keys(extra, tokens[: p + len(new)]) if k not in self.ref.pages]
        assert len(loaded) * self.page == len(new)
        pages = device_pages(self.cache)
        for i, k in enumerate(loaded):  # the loaded pages are the reference's now
            self.ref.pages[k] = RefPage(tuple(new.tolist()[i * self.page : (i + 1) * self.page]), self.ref.clock, self.ref.clock, 0)
            assert pages[k][0] == self.ref.pages[k].slots
        self.absorb_eviction()  # room may have been made on the device
        if not len(new):
            return m.device_indices, last
        self.cache.ready_to_load_host_cache()
        self.cache.check_hicache_events()
        self.tags.check(new.tolist(), prefix_contents(extra, tokens, p, p + len(new)), "a load from the host")
        self.cache.dec_lock_ref(last)
        self.ref.lock(extra, tokens[:p], -1)
        self.cache.inc_lock_ref(node)
        self.ref.lock(extra, tokens[: p + len(new)], 1)
        return torch.cat((m.device_indices, new)), node

    def evict_fault_snapshot(self) -> dict:
        """``cache_snapshot``, and the bytes of each node's host copy by node."""
        snap = cache_snapshot(self.cache)
        ps = self.host.page_size
        snap["host copies"] = {
            n.id: tensor_digest([self.host.get_data_page(q * ps) for q in sorted({s // ps for s in n.host_value.tolist()})])
            for n in device_nodes(self.cache) if n.host_value is not None
        }  # fmt: skip
        return snap

    def assert_evict_fault_left(self, before: dict, what: str) -> None:
        """Under write-back the contract lets host-only leaves of before the call, evicted for the
        backups' room, stay evicted (their host slots free, perhaps written by a backup): every other
        node, every copy left and the rest of the cache as they were."""
        after = self.evict_fault_snapshot()
        if self.cache.write_policy == "write_back":
            gone = [row for row in before["tree"] if row not in after["tree"]]
            assert all(row[4] is None and row[5] is not None for row in gone), f"{what} changed nodes: {gone[:2]}"
            ids, slots = {row[0] for row in gone}, {s for row in gone for s in row[5]}
            available, rows, _ = before["host pool"]
            before = dict(before, tree=[row for row in before["tree"] if row not in gone])
            before["host copies"] = {k: v for k, v in before["host copies"].items() if k not in ids}
            before["host pool"] = (available + len(slots), sorted(s for s in rows if s not in slots))
            after["host pool"] = (after["host pool"][0], sorted(after["host pool"][1]))
        assert_unchanged(before, after, what)

    @rule(n=st.integers(0, 100))
    def evict_host(self, n):
        before = self.host.available_size()
        freed = self.cache.evict_host(n)
        assert self.host.available_size() == before + freed

    @precondition(lambda self: not known_bad(self.kind_name, "failing host backup"))
    @rule(data=st.data(), extra=st.sampled_from([None, "tenant"]))
    def backup_fails(self, data, extra):
        """A host backup that raises: during an insert (write-through) or an eviction (write-back)."""
        if self.cache.write_policy == "write_back":
            if self.ref.unlocked_tokens() == 0:
                return
            before = self.evict_fault_snapshot()
            self.backup.arm()
            try:
                self.cache.evict(EvictParams(num_tokens=self.size))
            except InjectedFault:
                self.assert_evict_fault_left(before, "evict with a host backup that raises")
            else:
                self.absorb_eviction()  # every leaf it popped had a host copy: no backup ran
            finally:
                self.backup.armed = False
            return
        tokens = [9] + self.tokens(data)  # a prefix not cached yet
        aligned = len(tokens) // self.page * self.page
        if self.host.available_size() < aligned:
            return  # the copy may evict host-only leaves for room first (kept evicted: test_cache_atomicity)
        slots = self.alloc.alloc(-(-len(tokens) // self.page) * self.page)
        if slots is None or not aligned:
            if slots is not None:
                self.alloc.free(slots)
            return
        self.tags.write(slots.tolist()[: len(tokens)], prefix_contents(extra, tokens, 0, len(tokens)))
        before = cache_snapshot(self.cache)
        self.backup.arm()
        try:
            got = self.cache.insert(InsertParams(key=RadixKey(tokens, extra), value=slots[: len(tokens)]))
        except InjectedFault:
            assert_unchanged(before, cache_snapshot(self.cache), "insert with a host backup that raises")
            self.alloc.free(slots)
            return
        finally:
            self.backup.armed = False
        held = self.ref.insert(extra, tokens[:aligned], slots.tolist()[:aligned], 0)  # no backup was needed
        assert got.prefix_len == held
        rest = torch.cat((slots[:held], slots[aligned:]))  # the caller's copies of cached pages, and the tail
        if rest.numel():
            self.alloc.free(rest)

    @invariant()
    def transfers_complete(self):
        if hasattr(self, "cache"):
            self.cache.check_hicache_events()


TestHiRadixModelMachine = machine_test(HiRadixModelMachine, examples=25, steps=50)
