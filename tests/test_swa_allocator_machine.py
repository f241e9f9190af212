"""A state machine for ``SWATokenToKVPoolAllocator`` against a plain-Python model of requests: each
request's full slots in token order, how many of its oldest tokens left the window, and the SWA slot
of every token still in it. Requests arrive (``alloc`` or ``alloc_extend``), grow (``alloc_extend``,
``alloc_decode``), slide their window (``free_swa``) and finish (``free``); snapshots are taken and
restored; bad calls must raise and change nothing. Page sizes 1 and 4, with and without
``need_sort``, on the CPU path (with and without ``validate``, which also refuses frees of slots
nobody holds) and on the GPU path run on the CPU (counts copied back, landing or not).

After every step: in each part the free pages plus the held pages are all its pages, the held
slots are the model's, the mapping is the model's, and ``check_integrity`` passes.

CI runs a bounded profile; ``KVPOOL_LONG_TESTS=1`` a long one (``KVPOOL_LONG_STEPS`` steps).
"""

from __future__ import annotations

import copy

import hypothesis.strategies as st
import pytest
import torch
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvassert import dec, ext, machine_test, swa_allocator_snapshot, swa_as_on_gpu
from kvpool import SWATokenToKVPoolAllocator



def T(xs):
    return torch.tensor(xs, dtype=torch.int64)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class SWAAllocatorMachine(RuleBasedStateMachine):
    @initialize(
        page=st.sampled_from([1, 4]), full_pages=st.integers(2, 8), swa_pages=st.integers(1, 6),
        need_sort=st.booleans(), path=st.sampled_from(["cpu", "validate", "gpu", "gpu-busy"]),
    )  # fmt: skip
    def setup(self, page, full_pages, swa_pages, need_sort, path):
        self.p = page
        size, size_swa = full_pages * page, swa_pages * page
        a = SWATokenToKVPoolAllocator(size, size_swa, page, need_sort=need_sort, validate=path == "validate")
        if path.startswith("gpu"):
            swa_as_on_gpu(a, lands=path == "gpu")
        self.a, self.checked, self.validate = a, not path.startswith("gpu"), path == "validate"
        self.reqs: dict[int, dict] = {}  # id -> {"full": [slots], "gone": tokens out of the window, "swa": {slot: swa}}
        self.next_id = 0
        self.saved = None

    # --- the model ---------------------------------------------------------------------------------

    def held_pages(self, part: str) -> set[int]:
        if part == "full":
            slots = [s for r in self.reqs.values() for s in r["full"]]
        else:
            slots = [s for r in self.reqs.values() for s in r["swa"].values()]
        return {s // self.p for s in slots}

    def free_pages(self, part: str) -> int:
        a = self.a.full_attn_allocator if part == "full" else self.a.swa_attn_allocator
        return a.num_pages - len(self.held_pages(part))

    def fits(self, fresh: int) -> bool:
        return fresh <= self.free_pages("full") and fresh <= self.free_pages("swa")

    def check_new_slots(self, r: dict, full: list[int], start: int) -> None:
        """Slots for tokens ``start..`` of request ``r``: fresh in both parts, at their positions' page
        offsets, continuing the request's pages."""
        p = self.p
        swa = self.a.translate_loc_from_full_to_swa(T(full)).tolist()
        held_full = {s for q in self.reqs.values() for s in q["full"]}
        held_swa = {s for q in self.reqs.values() for s in q["swa"].values()}
        assert len(set(full)) == len(full) and not set(full) & held_full
        assert len(set(swa)) == len(swa) and not set(swa) & held_swa and min(swa, default=p) >= p
        for k, (f, s) in enumerate(zip(full, swa)):
            pos = start + k
            assert f % p == pos % p and s % p == pos % p, "a slot at another offset than its token's"
            if pos % p:  # on the page of the token before it
                prev_f = full[k - 1] if k else r["full"][-1]
                prev_s = swa[k - 1] if k else r["swa"][r["full"][-1]]
                assert (f, s) == (prev_f + 1, prev_s + 1)
        r["full"] += full
        r["swa"].update(zip(full, swa))

    # --- requests ------------------------------------------------------------------------------------

    @rule(n=st.integers(1, 9))
    def arrive(self, n):
        p = self.p
        n = n if p > 1 else n
        r = {"full": [], "gone": 0, "swa": {}}
        if p == 1:
            got = self.a.alloc(n)
        else:
            got = ext(self.a, [0], [n], [-1])
        if not self.fits(ceil_div(n, p)):
            assert got is None
            return
        assert got is not None and got.numel() == n
        self.check_new_slots(r, got.tolist(), 0)
        self.reqs[self.next_id] = r
        self.next_id += 1

    @precondition(lambda self: self.p > 1 and self.reqs)
    @rule(data=st.data(), k=st.integers(1, 6))
    def grow(self, data, k):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        r = self.reqs[rid]
        n = len(r["full"])
        fresh = ceil_div(n + k, self.p) - ceil_div(n, self.p)
        got = ext(self.a, [n], [n + k], [r["full"][-1]])
        if not self.fits(fresh):
            assert got is None
            return
        self.check_new_slots(r, got.tolist(), n)

    @precondition(lambda self: self.p > 1 and self.reqs)
    @rule(data=st.data())
    def decode(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        r = self.reqs[rid]
        n = len(r["full"])
        got = dec(self.a, [n + 1], [r["full"][-1]])
        if not self.fits(1 if n % self.p == 0 else 0):
            assert got is None
            return
        self.check_new_slots(r, got.tolist(), n)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), k=st.integers(1, 8), again=st.booleans())
    def slide(self, data, k, again):
        """The oldest ``k`` tokens in the window leave it (the last token always stays); with
        ``again``, tokens already out of it are named too, which changes nothing."""
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        r = self.reqs[rid]
        k = min(k, len(r["full"]) - 1 - r["gone"])
        lo = 0 if again else r["gone"]
        self.a.free_swa(T(r["full"][lo : r["gone"] + k]))
        for s in r["full"][r["gone"] : r["gone"] + k]:
            del r["swa"][s]
        r["gone"] += k

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), as_list=st.booleans())
    def finish(self, data, as_list):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        slots = self.reqs.pop(rid)["full"]
        self.a.free(slots if as_list else T(slots))

    # --- snapshots ---------------------------------------------------------------------------------

    @rule()
    def backup(self):
        self.saved = (self.a.backup_state(), copy.deepcopy(self.reqs))

    @precondition(lambda self: self.saved is not None)
    @rule()
    def restore(self):
        state, reqs = self.saved
        self.a.restore_state(state)
        self.reqs = copy.deepcopy(reqs)

    # --- bad calls -----------------------------------------------------------------------------------

    @rule(which=st.integers(0, 7))
    def bad_call(self, which):
        a, p = self.a, self.p
        one = T([1])
        calls = [
            (lambda: a.alloc(-p), ValueError),
            (lambda: a.alloc(p + 1) if p > 1 else a.alloc(1.5), ValueError),
            (lambda: a.free(torch.tensor([1.5])), ValueError),
            (lambda: a.free_swa("x"), ValueError),
            (lambda: a.restore_state(None), ValueError),
            (lambda: a.translate_loc_from_full_to_swa([1]), ValueError),
            (lambda: a.alloc_extend(one, one, 2 * one, 2 * one, one, 5), ValueError if p > 1 else NotImplementedError),
            (lambda: a.alloc_decode(one, one, T([1, 2])), ValueError if p > 1 else NotImplementedError),
        ]  # fmt: skip
        if self.checked and p > 1 and self.reqs:
            r = self.reqs[min(self.reqs)]
            n = len(r["full"])
            if n % p:  # a last_loc one slot off the request's page offset
                calls[which % 2] = (lambda: ext(a, [n], [n + 1], [r["full"][-1] - 1]), (ValueError, IndexError))
            elif r["gone"] == 0 and n > 1:  # the token before last: wrong offset for a new page's start
                calls[which % 2] = (lambda: ext(a, [n - 1], [n], [r["full"][-1] + 1]), (ValueError, IndexError))
        held = {s for r in self.reqs.values() for s in r["full"]}
        unheld = [s for s in range(p, a.size_full + p) if s not in held]
        if self.validate and unheld:  # a full slot nobody holds: a double free or one never allocated
            held_one = sorted(held)[:1]
            calls[2 + which % 2] = (lambda: a.free(T(held_one + unheld[:1])), ValueError)
        call, error = calls[which]
        before = swa_allocator_snapshot(a)
        with pytest.raises(error):
            call()
        assert swa_allocator_snapshot(a) == before

    # --- after every step ------------------------------------------------------------------------------

    @invariant()
    def matches_the_model(self):
        if not hasattr(self, "a"):
            return
        a, p = self.a, self.p
        for part, alloc in (("full", a.full_attn_allocator), ("swa", a.swa_attn_allocator)):
            state = alloc.backup_state()
            free = state.free_pages.tolist() + state.release_pages.tolist()
            held = set((state.owners.nonzero().flatten() // p).tolist())
            assert held == self.held_pages(part), f"{part}: held pages differ from the model's"
            assert len(set(free)) == len(free) and not set(free) & held
            assert len(free) + len(held) == alloc.num_pages, f"{part}: free + held is not every page"
            assert alloc.available_size() <= len(free) * p
            if self.checked:
                assert alloc.available_size() == len(free) * p
        mapping = a.full_to_swa_index_mapping.tolist()
        want = [0] * (len(mapping) - 1) + [-1]
        for r in self.reqs.values():
            for f, s in r["swa"].items():
                want[f] = s
        assert mapping == want, "the mapping differs from the model's"
        a.check_integrity()
        assert a.errors().rejected_frees == 0 and a.errors().unrecorded == 0


TestSWAAllocatorMachine = machine_test(SWAAllocatorMachine, examples=30, steps=30, seed=37)
