"""``SWARadixCache`` under a scheduler (``kvassert.SWAEngine``: admissions, decodes that give back SWA
slots as tokens leave the window, chunks, finishes, retractions, evictions of each part) as a state
machine against a plain reference model: a table of the tree's pages, each with its slots, whether
it has SWA KV, and its locks. After every step the page table may only have changed as the
contract allows (a page leaves unlocked and with everything below it; it loses its SWA KV only when
no window lock holds it; its slots change only when a tombstone no lock holds comes back to life),
every match is the one the model computes page by page with the window rule, an eviction that
frees less than asked leaves nothing of that part evictable, every KV slot read back holds its
token prefix, and ``check_integrity`` passes. Random bad calls and a failing ``free_swa`` / ``free``
change nothing. Page sizes 1 and 4, plain and EAGLE keys, SWA slots given back keeping the last
window of what the tree can take or, as SGLang's scheduler does, of the committed tokens; the long profile under
``KVPOOL_LONG_TESTS=1``."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvassert import SWAEngine, assert_unchanged, cache_bad_calls, cache_snapshot, known_bad, machine_test
from kvpool.cache import EvictParams, InsertParams, MatchPrefixParams, RadixCache, RadixKey

#: (page size, full pages, SWA pages, window, EAGLE keys)
# (page, pages, SWA pages, window, EAGLE keys, SWA slots given back as SGLang's scheduler does)
SETUPS = [(1, 80, 24, 3, False, False), (1, 80, 30, 5, True, False), (4, 24, 8, 4, False, False), (4, 24, 10, 6, True, False),
          (1, 80, 24, 3, False, True), (4, 24, 10, 6, True, True)]  # fmt: skip


def page_table(cache: Any) -> dict[tuple, tuple]:
    """The tree's pages: ``{(extra_key, elements up to the page's end): (slots, has SWA KV, lock_ref,
    swa_lock_ref)}``."""
    p = cache.page_size
    out: dict[tuple, tuple] = {}
    stack = [(child, ()) for child in cache.root_node.children.values()]
    while stack:
        node, prefix = stack.pop()
        elems = prefix + tuple(node.key.token_ids)
        value = node.value.tolist()
        for i in range(0, len(value), p):
            out[(node.key.extra_key, elems[: len(prefix) + i + p])] = (
                tuple(value[i : i + p]), not node.swa_tombstone, node.lock_ref, node.swa_lock_ref,
            )  # fmt: skip
        stack.extend((child, elems) for child in node.children.values())
    return out


def model_match(table: dict, elems: list, extra: Any, page: int, window: int) -> list[int]:
    """The slots a match of ``elems`` returns by the model: the cached whole pages along it, cut by
    the window rule (the longest page boundary whose last ``window`` elements have SWA KV, or with no
    tombstone before it)."""
    pages = []
    for end in range(page, len(elems) // page * page + 1, page):
        entry = table.get((extra, tuple(elems[:end])))
        if entry is None:
            break
        pages.append(entry)
    live = [ok for _, ok, _, _ in pages for _ in range(page)]
    best = 0
    for b in range(0, len(live) + 1, page):
        if all(live[:b]) or (b >= window and all(live[b - window : b])):
            best = b
    return [s for slots, _, _, _ in pages for s in slots][:best]


class SWAModelMachine(RuleBasedStateMachine):
    @initialize(setup=st.sampled_from(SETUPS), seed=st.integers(0, 7))
    def setup(self, setup, seed):
        page, pages, swa_pages, window, eagle, sglang_slide = setup
        self.eng = SWAEngine(page, pages=pages, swa_pages=swa_pages, window=window, rows=5, is_eagle=eagle, sglang_slide=sglang_slide)
        self.cache, self.alloc = self.eng.cache, self.eng.alloc
        self.page, self.window, self.eagle = page, window, eagle
        self.kind_name = f"swa-page-{page}"
        self.stems = [[(seed + 7 * i + j) % 3 + 1 for j in range(3 * page + 1)] for i in range(2)]
        other = RadixCache.create_simulated(page_size=page)
        other.insert(InsertParams(key=RadixKey(list(range(page)))))
        self.foreign = other.match_prefix(MatchPrefixParams(key=RadixKey(list(range(page))))).last_device_node
        self.gone: list = []
        self.table = page_table(self.cache)

    def elems(self, tokens: list) -> list:
        return list(zip(tokens, tokens[1:])) if self.eagle else list(tokens)

    def tokens(self, data) -> list:
        stem = data.draw(st.sampled_from(self.stems))
        return stem[: data.draw(st.integers(0, len(stem)))] + data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=2 * self.page + 1))

    def pick(self, data):
        return self.eng.running[data.draw(st.sampled_from(sorted(self.eng.running)))]

    # --- rules -----------------------------------------------------------------------------------

    @precondition(lambda self: len(self.eng.running) < 4)
    @rule(data=st.data())
    def admit(self, data):
        tokens = self.tokens(data)
        want = model_match(page_table(self.cache), self.elems(tokens[:-1]), None, self.page, self.window)
        req = self.eng.admit(tokens)
        if req is not None:
            assert req.prefix_indices.tolist() == want, "admission matched other than the model"

    @precondition(lambda self: self.eng.running)
    @rule(data=st.data(), steps=st.integers(1, 6))
    def decode(self, data, steps):
        req = self.pick(data)
        for t in range(steps):
            if not self.eng.decode(req, 1 + t % 3):
                break

    @precondition(lambda self: self.eng.running)
    @rule(data=st.data())
    def chunk(self, data):
        self.eng.chunk(self.pick(data))

    @precondition(lambda self: self.eng.running)
    @rule(data=st.data(), insert=st.booleans())
    def finish(self, data, insert):
        req = self.pick(data)
        before = page_table(self.cache)
        self.eng.finish(req, insert=insert)
        if not insert:
            assert set(page_table(self.cache)) <= set(before), "a retraction cached pages"

    @rule(data=st.data())
    def match(self, data):
        tokens = self.tokens(data)
        want = model_match(page_table(self.cache), self.elems(tokens), None, self.page, self.window)
        m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
        assert m.device_indices.tolist() == want, "a match returned other than the model"
        self.eng.check_match(m.device_indices, None, tokens)

    @rule(full=st.integers(0, 12), swa=st.integers(0, 16))
    def evict(self, full, swa):
        res = self.cache.evict(EvictParams(num_tokens=full, swa_num_tokens=swa))
        if res.num_tokens_evicted < full:
            assert self.cache.full_evictable_size() == 0, "evicted less full KV than asked with some left"
        if res.swa_num_tokens_evicted < swa:
            assert self.cache.swa_evictable_size() == 0, "evicted less SWA KV than asked with some left"

    @rule(data=st.data())
    def bad_call(self, data):
        ctx = SimpleNamespace(cache=self.cache, alloc=self.alloc, page=self.page, size=self.eng.size,
                              running=self.eng.running, gone=self.gone, foreign=self.foreign)  # fmt: skip
        calls = {n: c for n, c in cache_bad_calls(ctx).items() if not known_bad(self.kind_name, n)}
        name = data.draw(st.sampled_from(sorted(calls)))
        call, exc, msg = calls[name]
        before = cache_snapshot(self.cache)
        try:
            call()
        except exc as e:
            assert re.search(msg, str(e)), f"{name}: {e}"
        else:
            raise AssertionError(f"{name} did not raise")
        assert_unchanged(before, cache_snapshot(self.cache), name)

    @rule(full=st.integers(1, 12), swa=st.integers(1, 16), which=st.sampled_from(["free", "free_swa"]))
    def failing_free_in_evict(self, full, swa, which):
        before = cache_snapshot(self.cache)
        table = page_table(self.cache)

        def fail(*args, **kwargs):
            raise RuntimeError("injected fault")

        setattr(self.alloc, which, fail)
        try:
            self.cache.evict(EvictParams(num_tokens=full, swa_num_tokens=swa))
        except RuntimeError:
            failed = True
        else:
            failed = False
        finally:
            delattr(self.alloc, which)
        if not failed:
            return  # nothing to give back in that part
        if which == "free_swa":
            assert_unchanged(before, cache_snapshot(self.cache), "an evict whose free_swa raised")
        else:  # the nodes are back; the ones the call made tombstones stay so
            now = page_table(self.cache)
            assert set(now) == set(table)
            for k, (slots, live, lock, swa_lock) in table.items():
                assert now[k][0] == slots and now[k][2] == lock and (now[k][1] == live or not now[k][1])

    @precondition(lambda self: self.eng.running)
    @rule(data=st.data())
    def failing_free_in_finish(self, data):
        req = self.pick(data)
        before = cache_snapshot(self.cache)

        def fail(*args, **kwargs):
            raise RuntimeError("injected fault")

        self.alloc.free = fail
        try:
            self.cache.cache_finished_req(req)
        except RuntimeError:
            assert_unchanged(before, cache_snapshot(self.cache), "a cache_finished_req whose free raised")
        else:  # nothing to give back: it finished
            self.eng.table.free(req.req_pool_idx)
            del self.eng.running[req.req_pool_idx]
        finally:
            del self.alloc.free

    # --- the model's transitions, after every step ---------------------------------------------

    @invariant()
    def pages_change_only_as_the_contract_allows(self):
        if not hasattr(self, "cache"):
            return
        prev, now = self.table, page_table(self.cache)
        for k, (slots, live, lock, swa_lock) in prev.items():
            if k not in now:
                assert lock == 0, f"page {k} left the tree while locked"
                continue
            n_slots, n_live, _, _ = now[k]
            if n_slots != slots:
                assert not live and lock == 0 and n_live, f"page {k} changed its slots other than by reviving"
            elif live and not n_live:
                assert swa_lock == 0, f"page {k} lost its SWA KV while a window lock held it"
            elif not live and n_live:
                raise AssertionError(f"page {k} got SWA KV back on the same slots")
        for k in now:
            extra, elems = k
            if len(elems) > self.page:
                assert (extra, elems[: -self.page]) in now, f"page {k} is cached without the page before it"
        self.table = now

    @invariant()
    def integrity(self):
        if hasattr(self, "cache"):
            self.cache.check_integrity(self.eng.running.values())

    def teardown(self):
        if hasattr(self, "eng"):
            self.eng.drain()


TestSWAModelMachine = machine_test(SWAModelMachine, examples=40, steps=50)
