"""``MambaRadixCache`` with a ``HybridReqToTokenPool`` as a state machine against the reference model
(``kvassert.RefCache`` with a state per page): after every step the tree's pages, slots, locks and
state snapshots are the model's, every KV slot reads back the tag of its token prefix
(``KVTags``), every snapshot and every request's state slot the tag of the state after exactly its
tokens (``StateTags``, through copy-on-write forks too), the state pool holds exactly the tree's and
the running requests' state slots, and ``check_integrity`` passes. Random bad calls must raise and
change nothing, so must an eviction or a finished request whose allocator ``free`` raises
(``FailingFree``); exhausted KV and state pools are refused or evicted for."""

from __future__ import annotations

import random
from typing import Any, Optional

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvassert import (
    FailingFree,
    InjectedFault,
    KVTags,
    RefCache,
    SimReq,
    StateTags,
    assert_unchanged,
    cache_bad_calls,
    cache_snapshot,
    device_nodes,
    device_pages,
    known_bad,
    machine_test,
    prefix_contents,
)
from kvpool import HybridReqToTokenPool, MambaCacheParams, MambaStateShape, MHATokenToKVPool, PagedTokenToKVPoolAllocator
from kvpool import TokenToKVPoolAllocator
from kvpool.cache import CacheInitParams, EvictParams, InsertParams, MambaRadixCache, MatchPrefixParams, RadixCache, RadixKey

STATE = MambaCacheParams(MambaStateShape(conv=(4, 3), temporal=(2, 2, 3)), layers=(0, 2))
#: (page size, track slots): page 1 on the request's own state, page 4 with the extra buffer.
SETUPS = [(1, False, 48), (4, True, 12)]


class MambaModelMachine(RuleBasedStateMachine):
    @initialize(setup=st.sampled_from(SETUPS), states=st.integers(6, 14), seed=st.integers(0, 7))
    def setup(self, setup, states, seed):
        page, extra, pages = setup
        size = page * pages
        self.page, self.size, self.extra = page, size, extra
        self.kind_name = f"mamba-page-{page}"
        self.pool = MHATokenToKVPool(size, page, torch.float32, 1, 1, 1, "cpu", fused="never", warmup=False)
        self.alloc = FailingFree(TokenToKVPoolAllocator(size, kvcache=self.pool, validate=True) if page == 1
                                 else PagedTokenToKVPoolAllocator(size, page, kvcache=self.pool, validate=True))  # fmt: skip
        self.table = HybridReqToTokenPool(size=4, mamba_size=states, max_context_len=size + page, device="cpu",
                                          cache_params=STATE, enable_mamba_extra_buffer=extra)  # fmt: skip
        self.states = self.table.mamba_pool
        self.cache = MambaRadixCache(CacheInitParams(
            disable=False, req_to_token_pool=self.table, token_to_kv_pool_allocator=self.alloc, page_size=page,
            enable_mamba_extra_buffer=extra,
        ), mamba_cache_chunk_size=page)  # fmt: skip
        self.ref = RefCache(page)
        self.kv, self.st = KVTags(self.pool), StateTags(self.states)
        self.running: dict[int, SimReq] = {}
        self.gone: list = []
        rng = random.Random(seed)
        self.stems = [[rng.randrange(1, 4) for _ in range(2 * page + 2)] for _ in range(2)]
        other = RadixCache.create_simulated(page_size=page)
        other.insert(InsertParams(key=RadixKey(list(range(page)))))
        self.foreign = other.match_prefix(MatchPrefixParams(key=RadixKey(list(range(page))))).last_device_node

    def tokens(self, data) -> list:
        stem = data.draw(st.sampled_from(self.stems))
        return stem[: data.draw(st.integers(0, len(stem)))] + data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=self.page + 2))

    def pick(self, data) -> SimReq:
        return self.running[data.draw(st.sampled_from(sorted(self.running)))]

    # --- the reference's states ------------------------------------------------------------------

    def deepest_state(self, extra: Any, tokens: list) -> int:
        """Tokens of the longest cached prefix of ``tokens`` that ends on a snapshot."""
        best = 0
        for k in self.ref.keys(extra, tokens):
            page = self.ref.pages.get(k)
            if page is None:
                break
            if page.state is not None:
                best = len(k[1])
        return best

    def lock(self, extra: Any, tokens: list, delta: int) -> None:
        self.ref.lock(extra, tokens, delta)
        if tokens:
            page = self.ref.pages[(extra, tuple(tokens))]
            if page.state is not None and (delta > 0 or page.state_lock > 0):
                page.state_lock += delta

    def absorb(self, again: Optional[dict] = None) -> tuple[int, int]:
        """Check what left the tree since the reference was last updated (pages, snapshots) and drop it
        from the reference; returns (pages, snapshots) gone. ``again``: pages the call inserted from a
        request's own slots, by key (its slots for the page): one found with those slots left the tree
        first (a snapshot evicted with its leaf for a fork's room) and came back, it is gone here."""
        now = device_pages(self.cache)
        again = again or {}
        gone = {k for k, pg in self.ref.pages.items() if k not in now or (now[k][0] != pg.slots and now[k][0] == again.get(k))}
        pages = 0
        freed_states = []
        for k in list(self.ref.pages):
            page = self.ref.pages[k]
            if k in gone:
                assert page.lock == 0, f"evicted a locked page {k}"
                assert all(d in gone for d in self.ref.below(k)), f"evicted page {k} but kept a page below it"
                if page.state is not None:
                    assert page.state_lock == 0, f"evicted a locked snapshot at {k}"
                    freed_states.append(page.state)
                self.ref.drop(k)
                pages += 1
                continue
            assert now[k][0] == page.slots, f"page {k} moved"
            if page.state is not None and now[k][2] is None:
                assert page.state_lock == 0, f"evicted a locked snapshot at {k}"
                freed_states.append(page.state)
                page.state = None
        reused = self.live_states() | {v[2] for v in now.values() if v[2] is not None}  # a fork may take a freed slot
        for s in freed_states:
            assert not self.states.is_held(s) or s in reused, f"the evicted snapshot's slot {s} is not free"
        return pages, len(freed_states)

    def live_states(self) -> set:
        out = {pg.state for pg in self.ref.pages.values() if pg.state is not None}
        for req in self.running.values():
            out |= self.req_states(req)
        return out

    def req_states(self, req: SimReq) -> set:
        out = set()
        if req.mamba_pool_idx is not None:
            out.add(int(req.mamba_pool_idx))
        if self.extra and getattr(req, "mamba_ping_pong_track_buffer", None) is not None:
            out |= {int(s) for s in req.mamba_ping_pong_track_buffer.tolist()}
        return out

    # --- requests ----------------------------------------------------------------------------

    def _alloc(self, n: int, prefix: int, last: int) -> Optional[torch.Tensor]:
        if self.page == 1:
            return self.alloc.alloc(n)
        one = torch.ones(1, dtype=torch.int64)
        pre, seq = prefix * one, (prefix + n) * one
        return self.alloc.alloc_extend(pre, pre.clone(), seq, seq.clone(), last * one, n)

    def compute(self, req: SimReq, start: int) -> None:
        """The model ran tokens start.. of req: its state slot holds the state after all of them, and
        (extra buffer) its track slots snapshotted it at each whole page passed."""
        tokens = req.fill_ids
        if self.extra:
            for end in range((start // self.page + 1) * self.page, len(tokens) + 1, self.page):
                self.st.write(int(req.mamba_ping_pong_track_buffer[req.mamba_next_track_idx]), (req.extra_key, tuple(tokens[:end])))
                req.mamba_last_track_seqlen = end
                req.mamba_next_track_idx = 1 - req.mamba_next_track_idx
        self.st.write(int(req.mamba_pool_idx), (req.extra_key, tuple(tokens)))

    def evict(self, n: int, states: int = 0) -> None:
        nodes = device_nodes(self.cache)
        got = self.cache.evict(EvictParams(num_tokens=n, mamba_num=states))
        pages, snapshots = self.absorb()
        assert (got.num_tokens_evicted, got.mamba_num_evicted) == (pages * self.page, snapshots)
        self.gone = ([nd for nd in nodes if nd.value is None] + self.gone)[:8]

    @rule(data=st.data(), extra=st.sampled_from([None, "tenant"]))
    def admit(self, data, extra):
        tokens = self.tokens(data)
        req = SimReq(-1, list(tokens), extra)
        del req.req_pool_idx
        req.mamba_pool_idx = None
        req.mamba_last_track_seqlen = None
        if self.table.alloc([req]) is None:
            self.evict(0, 2)
            if self.table.alloc([req]) is None:
                return
        m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens[:-1], extra), cow_mamba=True, req=req))
        self.absorb()  # a fork may evict a snapshot for room (none here: the request has its slot)
        self.ref.match(extra, tokens[:-1])
        p = self.deepest_state(extra, tokens[:-1])
        assert m.device_indices.tolist() == (self.ref.slots_of(extra, tokens[:p]) if p else [])
        self.kv.check(m.device_indices.tolist(), prefix_contents(extra, tokens, 0, p), "a match")
        if p:
            self.st.check(int(req.mamba_pool_idx), (extra, tuple(tokens[:p])), "a copy-on-write fork")
        self.cache.inc_lock_ref(m.last_device_node)
        self.lock(extra, tokens[:p], 1)
        new = self._alloc(len(tokens) - p, p, int(m.device_indices[-1]) if p else -1)
        if new is None:
            self.evict(len(tokens) - p + self.page)
            new = self._alloc(len(tokens) - p, p, int(m.device_indices[-1]) if p else -1)
        if new is None:
            self.cache.dec_lock_ref(m.last_device_node)
            self.lock(extra, tokens[:p], -1)
            self.table.free_mamba_cache(req)
            self.table.free(req)
            return
        row = req.req_pool_idx
        self.table.write((row, slice(0, len(tokens))), torch.cat((m.device_indices, new)).to(torch.int32))
        self.kv.write(new.tolist(), prefix_contents(extra, tokens, p, len(tokens)))
        req.last_node, req.cache_protected_len, req.prefix_indices = m.last_device_node, p, m.device_indices
        req.kv_committed_len = req.kv_allocated_len = len(tokens)
        self.compute(req, p)
        self.running[row] = req

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(1, 3))
    def decode(self, data, token):
        req = self.pick(data)
        n = req.kv_committed_len
        if n + 1 > self.table.max_context_len:
            return
        if self.page == 1:
            got = self.alloc.alloc(1)
        else:
            seq = torch.tensor([n + 1])
            got = self.alloc.alloc_decode(seq, seq.clone(), torch.tensor([int(self.table.req_to_token[req.req_pool_idx, n - 1])]))
        if got is None:
            return
        req.output_ids.append(token)
        self.table.req_to_token[req.req_pool_idx, n] = int(got[0])
        self.kv.write([int(got[0])], [(req.extra_key, tuple(req.fill_ids))])
        req.kv_committed_len = req.kv_allocated_len = n + 1
        self.compute(req, n)

    def known(self, req: SimReq, length: int) -> tuple[int, Optional[int]]:
        """(tokens whose state is known, the slot holding it)."""
        if not self.extra:
            return length, int(req.mamba_pool_idx)
        if req.mamba_last_track_seqlen is None:
            return 0, None
        return req.mamba_last_track_seqlen, int(req.mamba_ping_pong_track_buffer[1 - req.mamba_next_track_idx])

    @precondition(lambda self: self.running)
    @rule(data=st.data(), insert=st.booleans())
    def finish(self, data, insert):
        self.finish_req(self.pick(data), insert)

    def finish_req(self, req: SimReq, insert: bool) -> None:
        before = self.before_finish(req)
        self.cache.cache_finished_req(req, is_insert=insert)
        self.after_finish(req, insert, before)

    def before_finish(self, req: SimReq) -> tuple:
        tokens = req.fill_ids[: req.kv_committed_len]
        return (tokens, req.extra_key, req.cache_protected_len, *self.known(req, len(tokens)))

    def after_finish(self, req: SimReq, insert: bool, before: tuple) -> None:
        """The model follows a ``cache_finished_req`` of ``req`` made, and the request leaves."""
        tokens, extra, cpl, known, state = before
        if insert and known:
            row = self.table.req_to_token[req.req_pool_idx, :known].tolist()
            self.ref.insert(extra, tokens[:known], row, 0)
            end = self.ref.pages[(extra, tuple(tokens[:known]))]
            if end.state is None:
                end.state = state
        self.lock(extra, tokens[:cpl], -1)
        self.table.free(req)
        del self.running[[r for r, q in self.running.items() if q is req][0]]

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def chunk(self, data):
        req = self.pick(data)
        tokens, extra, cpl, old = req.fill_ids, req.extra_key, req.cache_protected_len, req.last_node
        known, _ = self.known(req, len(tokens))
        row = self.table.req_to_token[req.req_pool_idx, : len(tokens)].tolist()
        self.cache.cache_unfinished_req(req)
        mine = {k: tuple(row[len(k[1]) - self.page : len(k[1])]) for k in self.ref.keys(extra, tokens[:known])}
        self.absorb(mine)  # a fork may evict a snapshot for room, with its leaf: the insert then takes the request's slots
        if known == 0 or known == cpl or req.cache_protected_len != known:
            return  # nothing new to cache, or no state slot for the copy
        self.ref.insert(extra, tokens[:known], row[:known], 0)
        self.ref.match(extra, tokens[:known])
        end = self.ref.pages[(extra, tuple(tokens[:known]))]
        if end.state is None:
            end.state = device_pages(self.cache)[(extra, tuple(tokens[:known]))][2]
        self.lock(extra, tokens[:known], 1)
        self.lock(extra, tokens[:cpl], -1)
        assert req.last_node is not old and req.prefix_indices.tolist() == self.ref.slots_of(extra, tokens[:known]) + row[known:]

    @rule(n=st.integers(0, 100), states=st.integers(0, 4))
    def evict_some(self, n, states):
        self.evict(n, states)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), extra=st.sampled_from([None, "tenant"]))
    def admit_with_no_state_slot_free(self, data, extra):
        """Every state slot is taken: an admission evicts snapshots for room or is refused."""
        hog = self.states.alloc(self.states.available_size()) if self.states.available_size() else None
        try:
            self.admit(data, extra)
        finally:
            if hog is not None:
                self.states.free(hog)

    def with_failing_free(self, call, what: str) -> None:
        """``call()`` with the allocator's next free raising: it raises that, and changes nothing, or
        frees nothing and completes (then the model follows it)."""
        before = cache_snapshot(self.cache)
        self.alloc.arm()
        try:
            call()
        except InjectedFault:
            assert_unchanged(before, cache_snapshot(self.cache), f"{what} with a free that raises")
            return True
        finally:
            self.alloc.armed = False
        return False

    @precondition(lambda self: self.ref.pages and not known_bad(self.kind_name, "failing free in evict"))
    @rule(n=st.integers(1, 40))
    def free_fails_in_evict(self, n):
        if not self.with_failing_free(lambda: self.cache.evict(EvictParams(num_tokens=n)), "evict"):
            self.absorb()  # nothing was evictable: nothing freed

    @precondition(lambda self: self.running and not known_bad(self.kind_name, "failing free in cache_finished_req"))
    @rule(data=st.data())
    def free_fails_in_finish(self, data):
        req = self.pick(data)
        before = self.before_finish(req)
        if not self.with_failing_free(lambda: self.cache.cache_finished_req(req), "cache_finished_req"):
            self.after_finish(req, True, before)  # nothing to free: it went through

    @rule(data=st.data())
    def bad_call(self, data):
        calls = {k: v for k, v in cache_bad_calls(self).items() if not known_bad(self.kind_name, k)}
        name = data.draw(st.sampled_from(sorted(calls)))
        call, exc, msg = calls[name]
        before = cache_snapshot(self.cache)
        with pytest.raises(exc, match=msg):
            call()
        assert_unchanged(before, cache_snapshot(self.cache), name)

    # --- invariants ----------------------------------------------------------------------------

    @invariant()
    def tree_is_the_model(self):
        if not hasattr(self, "cache"):
            return
        pages = device_pages(self.cache)
        assert {k: (v[0], v[1]) for k, v in pages.items()} == {k: (pg.slots, pg.lock) for k, pg in self.ref.pages.items()}
        for k, (_, _, state, state_lock) in pages.items():
            page = self.ref.pages[k]
            assert (state, state_lock) == (page.state, page.state_lock), f"snapshot at {k}"
        leaves = set(self.ref.pages) - self.ref.with_children()
        assert all(self.ref.pages[k].state is not None for k in leaves), "a leaf without a snapshot"
        for (extra, tokens), page in self.ref.pages.items():
            self.kv.check(page.slots, prefix_contents(extra, tokens, len(tokens) - self.page, len(tokens)), "a tree page")
            if page.state is not None:
                self.st.check(page.state, (extra, tokens), "a snapshot")
        for req in self.running.values():
            row = self.table.req_to_token[req.req_pool_idx, : req.kv_committed_len].tolist()
            self.kv.check(row, prefix_contents(req.extra_key, req.fill_ids, 0, len(row)), "a running request")
            self.st.check(int(req.mamba_pool_idx), (req.extra_key, tuple(req.fill_ids)), "a running request's state")
        assert set(self.states.held_slots()) == self.live_states(), "state slots held by neither the tree nor a request"
        self.cache.check_integrity(self.running.values())

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        for req in list(self.running.values()):
            self.finish_req(req, True)
        self.evict(self.size, self.states.size)
        assert self.cache.total_size() == (0, 0) and self.alloc.available_size() == self.size
        assert self.states.available_size() == self.states.size
        self.cache.check_integrity()


TestMambaModelMachine = machine_test(MambaModelMachine, examples=40, steps=50)
