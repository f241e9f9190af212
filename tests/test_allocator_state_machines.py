"""The slot allocators as hypothesis state machines against a plain-Python model: no slot handed out
twice, slot 0 never handed out, counts agree, a failed alloc changes nothing, backup and restore
round-trip, free groups apply at their end, ``check_integrity`` passes after every step; and the
same machines with the counts a free leaves on the device copied back rather than read (as on a
GPU), landing at once or never: ``available_size()`` at most what is free, exact once read.
"""

from __future__ import annotations

from typing import Optional

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvassert import allocator_snapshot, counts_copied_back, dec, ext, held_slots
from kvpool.errors import IntegrityError
from kvpool.pools.allocator import AllocatorState, PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from kvpool.pools.allocator.state import integrity_problems

T = torch.tensor


# --- state machines --------------------------------------------------------------------------------


class TokenAllocatorMachine(RuleBasedStateMachine):
    """TokenToKVPoolAllocator against a model: the set of free slots and the groups handed out."""

    @initialize(
        size=st.integers(1, 24), need_sort=st.booleans(), validate=st.booleans()
    )
    def setup(self, size, need_sort, validate):
        self.a = TokenToKVPoolAllocator(size, need_sort=need_sort, validate=validate)
        self.size = size
        self.free = set(range(1, size + 1))  # available now
        self.owned: set[int] = set()
        self.pending: set[int] = set()  # freed inside the open group
        self.in_group = False
        self.saved: list[tuple[AllocatorState, tuple]] = []

    def model(self) -> tuple:
        return (frozenset(self.free), frozenset(self.owned), frozenset(self.pending))

    @rule(n=st.integers(0, 26))
    def alloc(self, n):
        before = allocator_snapshot(self.a)
        got = self.a.alloc(n)
        if n > len(self.free):
            assert got is None
            assert allocator_snapshot(self.a) == before
            return
        slots = got.tolist()
        assert len(slots) == n and len(set(slots)) == n
        assert set(slots) <= self.free, f"handed out {set(slots) - self.free}, which are not free"
        assert 0 not in slots
        self.free -= set(slots)
        self.owned |= set(slots)

    @precondition(lambda self: self.owned)
    @rule(data=st.data(), as_list=st.booleans())
    def free_some(self, data, as_list):
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.owned)), min_size=1, max_size=6, unique=True))
        self.a.free(chosen if as_list else T(chosen))
        self.owned -= set(chosen)
        (self.pending if self.in_group else self.free).update(chosen)

    @rule(data=st.data())
    def bad_free(self, data):
        not_owned = sorted(set(range(-2, self.size + 3)) - self.owned)
        bad = data.draw(st.sampled_from(not_owned))
        batch = [bad] + (sorted(self.owned)[:1] if self.owned else [])
        before = allocator_snapshot(self.a)
        if self.a.validate:
            with pytest.raises(ValueError, match=f"got slot {bad} at position 0"):
                self.a.free(T(batch))
            assert allocator_snapshot(self.a) == before
        else:
            self.a.free(T(batch))  # the bad entry is dropped, the good one freed
            for s in batch[1:]:
                self.owned.discard(s)
                (self.pending if self.in_group else self.free).add(s)

    @precondition(lambda self: not self.in_group)
    @rule()
    def group_begin(self):
        self.a.free_group_begin()
        self.in_group = True

    @precondition(lambda self: self.in_group)
    @rule()
    def group_end(self):
        self.a.free_group_end()
        self.in_group = False
        self.free |= self.pending
        self.pending = set()

    @rule()
    def backup(self):
        self.saved.append((self.a.backup_state(), self.model()))

    @precondition(lambda self: self.saved)
    @rule(data=st.data())
    def restore(self, data):
        """Inside or outside a group, either way round: the allocator_snapshot's pending frees stay pending only
        if a group is open now."""
        state, model = data.draw(st.sampled_from(self.saved))
        self.a.restore_state(state)
        free, owned, pending = model
        self.free, self.owned = set(free), set(owned)
        if self.in_group:
            self.pending = set(pending)
        else:
            self.free |= pending
            self.pending = set()

    @rule()
    def clear(self):
        self.a.clear()
        self.free, self.owned, self.pending, self.in_group = set(range(1, self.size + 1)), set(), set(), False

    @invariant()
    def counts_agree_and_integrity_holds(self):
        assert self.a.available_size() == len(self.free)
        assert held_slots(self.a) == self.owned
        self.a.check_integrity()


class PagedAllocatorMachine(RuleBasedStateMachine):
    """PagedTokenToKVPoolAllocator against a model of requests (slot lists in token order), loose
    owned slots, and free pages; alloc_extend/alloc_decode outputs are checked position by position."""

    @initialize(
        page_size=st.sampled_from([1, 2, 4]), pages=st.integers(1, 8), spare=st.integers(0, 3),
        need_sort=st.booleans(), validate=st.booleans(), host_checks=st.booleans(),
    )  # fmt: skip
    def setup(self, page_size, pages, spare, need_sort, validate, host_checks):
        spare = spare % page_size
        self.p = page_size
        self.n = pages
        size = pages * page_size + spare
        self.a = PagedTokenToKVPoolAllocator(size, page_size, need_sort=need_sort, validate=validate)
        # host_checks=False runs the allocator as on a GPU, where device arguments are not read
        # without validate, so that the masking of stray slots is exercised here too.
        self.a._cheap_device_checks = host_checks
        self.arg_checks = validate or host_checks
        self.requests: dict[int, list[int]] = {}
        self.loose: set[int] = set()  # owned slots no request continues from
        self.pending: set[int] = set()  # pages released inside the open group
        self.in_group = False
        self.next_rid = 0
        self.saved: list[tuple[AllocatorState, tuple]] = []

    # model helpers
    def owned(self) -> set[int]:
        out = set(self.loose)
        for slots in self.requests.values():
            out.update(slots)
        return out

    def free_pages(self) -> set[int]:
        held = {s // self.p for s in self.owned()}
        return set(range(1, self.n + 1)) - held - self.pending

    def after_free(self, held_before: set[int]) -> None:
        released = held_before - {s // self.p for s in self.owned()}
        if self.in_group:
            self.pending |= released

    def check_new_slots(self, out: list[int], requests: list[tuple[int, int, int, int]]) -> None:
        """requests: (prefix_len, seq_len, last_loc, first output index) per request."""
        free_before = self.free_pages()
        owned = self.owned()
        assert len(set(out)) == len(out), "a slot handed out twice in one call"
        fresh_pages_by_request = []
        for pre, seq, last, start in requests:
            fresh: set[int] = set()
            held_end = -(-pre // self.p) * self.p
            for k, pos in enumerate(range(pre, seq)):
                s = out[start + k]
                assert s not in owned and s >= self.p, f"slot {s} is owned or on page 0"
                assert s % self.p == pos % self.p, f"position {pos} landed at page offset {s % self.p}"
                if pos < held_end:
                    assert s == last + 1 + k
                else:
                    assert s // self.p in free_before, f"page {s // self.p} was not free"
                    fresh.add(s // self.p)
                    if pos % self.p:
                        assert s == out[start + k - 1] + 1, "a page's slots must be consecutive"
            assert len(fresh) == -(-seq // self.p) - -(-pre // self.p)
            fresh_pages_by_request.append(fresh)
        all_fresh = [pg for f in fresh_pages_by_request for pg in f]
        assert len(all_fresh) == len(set(all_fresh)), "two requests got the same fresh page"

    def state(self) -> tuple:
        return ({r: list(s) for r, s in self.requests.items()}, set(self.loose), set(self.pending))

    # rules
    @rule(data=st.data(), width=st.integers(0, 3))
    def extend(self, data, width):
        rids = []
        if self.requests:
            rids = data.draw(st.lists(st.sampled_from(sorted(self.requests)), unique=True, max_size=width))
        batch = [(r, len(self.requests[r])) for r in rids]
        batch += [(None, 0)] * data.draw(st.integers(0, 2))
        grows = [data.draw(st.integers(0, 2 * self.p + 1)) for _ in batch]
        prefix = [pre for _, pre in batch]
        seq = [pre + g for (_, pre), g in zip(batch, grows)]
        last = [self.requests[r][-1] if r is not None and self.requests[r] else -1 for r, _ in batch]
        need = sum(-(-s // self.p) - -(-q // self.p) for q, s in zip(prefix, seq))
        before = allocator_snapshot(self.a)
        got = ext(self.a, prefix, seq, last)
        if need > len(self.free_pages()):
            assert got is None
            assert allocator_snapshot(self.a) == before
            return
        out = got.tolist()
        assert len(out) == sum(grows)
        starts = [sum(grows[:i]) for i in range(len(batch))]
        self.check_new_slots(out, [(q, s, l, st_) for q, s, l, st_ in zip(prefix, seq, last, starts)])
        for (r, _), g, start in zip(batch, grows, starts):
            if r is None:
                r = self.next_rid
                self.next_rid += 1
                self.requests[r] = []
            self.requests[r] += out[start : start + g]

    @precondition(lambda self: any(self.requests.values()))
    @rule(data=st.data())
    def decode(self, data):
        live = sorted(r for r, s in self.requests.items() if s)
        rids = data.draw(st.lists(st.sampled_from(live), unique=True, min_size=1, max_size=4))
        seq = [len(self.requests[r]) + 1 for r in rids]
        last = [self.requests[r][-1] for r in rids]
        need = sum(1 for s in seq if (s - 1) % self.p == 0)
        before = allocator_snapshot(self.a)
        got = dec(self.a, seq, last)
        if need > len(self.free_pages()):
            assert got is None
            assert allocator_snapshot(self.a) == before
            return
        out = got.tolist()
        self.check_new_slots(out, [(s - 1, s, l, i) for i, (s, l) in enumerate(zip(seq, last))])
        for r, s in zip(rids, out):
            self.requests[r].append(s)

    @rule(k=st.integers(0, 3))
    def alloc_pages(self, k):
        free = self.free_pages()
        before = allocator_snapshot(self.a)
        got = self.a.alloc(k * self.p)
        if k > len(free):
            assert got is None
            assert allocator_snapshot(self.a) == before
            return
        slots = got.tolist()
        assert {s // self.p for s in slots} <= free and len(set(slots)) == len(slots) == k * self.p
        self.loose |= set(slots)

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), how=st.sampled_from(["whole", "suffix", "scattered"]))
    def free_request(self, data, how):
        r = data.draw(st.sampled_from(sorted(self.requests)))
        slots = self.requests[r]
        held_before = {s // self.p for s in self.owned()}
        if how == "whole" or not slots:
            chosen = list(slots)
            del self.requests[r]
        elif how == "suffix":
            k = data.draw(st.integers(1, len(slots)))
            chosen = slots[-k:]
            self.requests[r] = slots[:-k]
        else:
            chosen = data.draw(st.lists(st.sampled_from(slots), unique=True, min_size=1))
            self.loose |= set(slots) - set(chosen)
            del self.requests[r]
        self.a.free(T(chosen, dtype=torch.int64))
        self.after_free(held_before)

    @precondition(lambda self: self.loose)
    @rule(data=st.data())
    def free_loose(self, data):
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.loose)), unique=True, min_size=1))
        held_before = {s // self.p for s in self.owned()}
        self.a.free(chosen)
        self.loose -= set(chosen)
        self.after_free(held_before)

    @rule(data=st.data())
    def bad_free(self, data):
        owned = self.owned()
        bad = data.draw(st.sampled_from(sorted(set(range(-1, (self.n + 2) * self.p)) - owned)))
        before = allocator_snapshot(self.a)
        if self.a.validate:
            with pytest.raises(ValueError, match=f"got slot {bad} at position 0"):
                self.a.free(T([bad]))
        else:
            self.a.free(T([bad, bad]))
        assert allocator_snapshot(self.a) == before

    @precondition(lambda self: not self.in_group)
    @rule()
    def group_begin(self):
        self.a.free_group_begin()
        self.in_group = True

    @precondition(lambda self: self.in_group)
    @rule()
    def group_end(self):
        self.a.free_group_end()
        self.in_group = False
        self.pending = set()

    @rule()
    def backup(self):
        self.saved.append((self.a.backup_state(), self.state()))

    @precondition(lambda self: self.saved)
    @rule(data=st.data())
    def restore(self, data):
        state, (requests, loose, pending) = data.draw(st.sampled_from(self.saved))
        self.a.restore_state(state)
        self.requests = {r: list(s) for r, s in requests.items()}
        self.loose = set(loose)
        self.pending = set(pending) if self.in_group else set()

    # misuse: each call is undone with restore_state, after checking what it did

    def continuing(self, data, rem: Optional[int] = None, besides: Optional[int] = None) -> Optional[int]:
        """A request (not ``besides``) whose last page is partial (``rem`` tokens on it, if given);
        one is started if there is none and a page is free."""
        partial = sorted(
            r for r, s in self.requests.items() if len(s) % self.p and r != besides and rem in (None, len(s) % self.p)
        )
        if partial:
            return data.draw(st.sampled_from(partial))
        if self.p == 1 or not self.free_pages():
            return None
        n = rem if rem is not None else data.draw(st.integers(1, self.p - 1))
        out = ext(self.a, [0], [n], [-1]).tolist()
        self.check_new_slots(out, [(0, n, -1, 0)])
        self.requests[self.next_rid] = out
        self.next_rid += 1
        return self.next_rid - 1

    def damaged(self, new_slots: list[int]) -> bool:
        """Whether check_integrity must fail once ``new_slots`` gained a holder: one is outside the
        recorded range, already held (or listed twice), or on a page that is not held."""
        owned, n_slots = self.owned(), (self.n + 1) * self.p
        held_pages = {s // self.p for s in owned}
        return len(set(new_slots)) < len(new_slots) or any(
            not self.p <= s < n_slots or s in owned or s // self.p not in held_pages for s in new_slots
        )

    def undo(self, state: AllocatorState, before: tuple, new_slots: list[int]) -> None:
        if self.damaged(new_slots):
            with pytest.raises(IntegrityError):
                self.a.check_integrity()
        else:
            self.a.check_integrity()
        self.a.restore_state(state)
        assert allocator_snapshot(self.a) == before

    @rule(data=st.data(), kind=st.sampled_from(["other-request", "other-page", "misaligned", "outside"]))
    def wrong_last_loc(self, data, kind):
        """alloc_decode with a last_loc that is not the request's last slot. Another request's last
        slot passes even validate (the allocator does not know which request holds a page); the two
        collide when that request continues."""
        p, n_slots = self.p, (self.n + 1) * self.p
        r = self.continuing(data)
        if r is None:
            return
        slots = self.requests[r]
        rem, own = len(slots) % p, slots[-1]
        if kind == "other-request":
            other = self.continuing(data, rem=rem, besides=r)
            if other is None:
                return
            wrong = self.requests[other][-1]
        elif kind == "other-page":
            wrong = data.draw(st.integers(1, self.n)) * p + rem - 1
        elif kind == "misaligned":
            wrong = data.draw(st.integers(p, n_slots - 1).filter(lambda s: (s + 1) % p != rem))
        else:
            wrong = data.draw(st.sampled_from([-1, 0, p - 1, n_slots, n_slots + rem, 10**6]))
        owned = self.owned()
        if kind == "other-page" and wrong == own:
            return  # that is the right last_loc
        state, before = self.a.backup_state(), allocator_snapshot(self.a)
        error = None
        if self.arg_checks and kind in ("misaligned", "outside"):
            error = IndexError if kind == "outside" else ValueError
        elif self.a.validate and (wrong not in owned or wrong + 1 in owned):
            error = ValueError  # not the holder's last slot (or its page is not held), or runs onto a held slot
        if error is not None:
            with pytest.raises(error, match="last_loc\\[0\\]|request 0"):
                dec(self.a, [len(slots) + 1], [wrong])
            assert allocator_snapshot(self.a) == before
            return
        assert dec(self.a, [len(slots) + 1], [wrong]).tolist() == [wrong + 1]
        self.undo(state, before, [wrong + 1])

    @rule(data=st.data(), op=st.sampled_from(["decode", "extend"]))
    def batch_sharing_a_page(self, data, op):
        """One request listed twice in a batch: both entries continue onto the same slots."""
        r = self.continuing(data)
        if r is None:
            return
        slots = self.requests[r]
        n, own = len(slots), slots[-1]
        grows = [1, 1] if op == "decode" else [data.draw(st.integers(1, 2 * self.p)) for _ in range(2)]
        state, before = self.a.backup_state(), allocator_snapshot(self.a)
        if self.a.validate:
            with pytest.raises(ValueError, match="requests 0 and 1 would both continue on slot"):
                ext(self.a, [n, n], [n + g for g in grows], [own, own])
            assert allocator_snapshot(self.a) == before
            return
        need = sum(-(-(n + g) // self.p) - -(-n // self.p) for g in grows)
        got = ext(self.a, [n, n], [n + g for g in grows], [own, own])
        if need > len(self.free_pages()):
            assert got is None
            assert allocator_snapshot(self.a) == before
            return
        assert got.tolist()[0] == got.tolist()[grows[0]] == own + 1
        self.undo(state, before, got.tolist())

    @rule()
    def clear(self):
        self.a.clear()
        self.requests, self.loose, self.pending, self.in_group = {}, set(), set(), False

    @invariant()
    def counts_agree_and_integrity_holds(self):
        assert self.a.available_size() == len(self.free_pages()) * self.p
        assert held_slots(self.a) == self.owned()
        self.a.check_integrity()


TestTokenAllocatorMachine = TokenAllocatorMachine.TestCase
TestPagedAllocatorMachine = PagedAllocatorMachine.TestCase
TestPagedAllocatorMachine.settings = settings(TestPagedAllocatorMachine.settings, stateful_step_count=40)


# --- the same machines, counts copied back ----------------------------------------------------------


class CopiedBackCounts:
    """Mixed into a state machine: the allocator runs with counts copied back, landing at once or
    never. Between reads ``available_size()`` is at most what is free and the device state is
    consistent; ``errors()`` makes the count exact."""

    @invariant()
    def counts_agree_and_integrity_holds(self):
        assert self.a.available_size() <= self.expected_available()
        assert held_slots(self.a) == self.owned_slots()
        assert integrity_problems(self.a.backup_state()) == []

    @rule()
    def read_counts(self):
        self.a.errors()
        assert self.a.available_size() == self.expected_available()
        self.a.check_integrity()


class CopiedBackTokenMachine(CopiedBackCounts, TokenAllocatorMachine):
    @initialize(size=st.integers(1, 24), need_sort=st.booleans(), validate=st.booleans(), lands=st.booleans())
    def setup(self, size, need_sort, validate, lands):
        TokenAllocatorMachine.setup(self, size, need_sort, validate)
        counts_copied_back(self.a, lands)

    def expected_available(self) -> int:
        return len(self.free)

    def owned_slots(self) -> set[int]:
        return self.owned


class CopiedBackPagedMachine(CopiedBackCounts, PagedAllocatorMachine):
    @initialize(
        page_size=st.sampled_from([1, 2, 4]), pages=st.integers(1, 8), spare=st.integers(0, 3),
        need_sort=st.booleans(), validate=st.booleans(), host_checks=st.booleans(), lands=st.booleans(),
    )  # fmt: skip
    def setup(self, page_size, pages, spare, need_sort, validate, host_checks, lands):
        PagedAllocatorMachine.setup(self, page_size, pages, spare, need_sort, validate, host_checks)
        counts_copied_back(self.a, lands)

    def expected_available(self) -> int:
        return len(self.free_pages()) * self.p

    def owned_slots(self) -> set[int]:
        return self.owned()


TestCopiedBackTokenMachine = CopiedBackTokenMachine.TestCase
TestCopiedBackTokenMachine.settings = settings(max_examples=50)
TestCopiedBackPagedMachine = CopiedBackPagedMachine.TestCase
TestCopiedBackPagedMachine.settings = settings(max_examples=50, stateful_step_count=40)
