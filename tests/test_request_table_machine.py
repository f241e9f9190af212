"""A state machine for the request tables' lifecycles (HybridReqToTokenPool, and the ReqToTokenPool
it is), driven as SGLang's scheduler and a prefix cache drive them, against a plain-Python model:
requests admitted with request objects, chunked (keeping their row and slots), their states freed
ahead of their rows and after them, by request and by row, states and track slots handed to a cache,
``req_to_token`` rows written and checked entry for entry, and bad calls that must raise and change
nothing. CI runs a bounded profile; ``KVPOOL_LONG_TESTS=1`` a long one (``KVPOOL_LONG_STEPS``).
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvassert import machine_test, state_params
from kvpool import HybridReqToTokenPool

PARAMS = state_params(conv=(3, 2), temporal=(1, 2, 3), layers=(1,))
COLUMNS = 6


class Req:
    """The attributes SGLang's scheduler keeps on a request."""

    def __init__(self):
        self.req_pool_idx = None
        self.mamba_pool_idx = None
        self.mamba_ping_pong_track_buffer = None
        self.mamba_next_track_idx = None


class RequestTableMachine(RuleBasedStateMachine):
    @initialize(rows=st.integers(1, 4), slots=st.integers(1, 10), extra=st.booleans(), spec=st.booleans())
    def setup(self, rows, slots, extra, spec):
        self.t = HybridReqToTokenPool(
            size=rows, mamba_size=slots, max_context_len=COLUMNS, device="cpu", cache_params=PARAMS,
            enable_mamba_extra_buffer=extra, speculative_num_draft_tokens=2 if spec else None,
        )  # fmt: skip
        self.per = 1 + self.t.track_slots_per_request
        self.reqs: dict[int, tuple[Req, tuple[int, ...]]] = {}  # running row -> (request, its slots)
        self.stateless: dict[int, Req] = {}  # running rows whose state was freed (a resumed request)
        self.pending: dict[int, tuple[Req, tuple[int, ...]]] = {}  # freed rows whose state is not freed yet
        self.cache: set[int] = set()  # slots a prefix cache took over
        self.table = [[0] * COLUMNS for _ in range(rows)]  # req_to_token
        self.t.req_to_token.zero_()

    # --- helpers ---------------------------------------------------------------------------------

    def slots_of(self, row: int) -> tuple[int, ...]:
        return (self.t.mamba_slot(row), *self.t.track_slots(row))

    def snapshot(self):
        t = self.t
        tensors = [t.req_to_token, t.req_index_to_mamba_index_mapping, *t.mamba_pool.conv, t.mamba_pool.temporal]
        return (list(t.free_slots), t.mamba_pool.held_slots(), list(t.mamba_pool._slots._free),
                [self.slots_of(r) for r in range(t.size)], [x.view(torch.uint8).clone() for x in tensors],
                [(r.req_pool_idx, r.mamba_pool_idx) for r, _ in (*self.reqs.values(), *self.pending.values())])  # fmt: skip

    def refused(self, call, what: str) -> None:
        before = self.snapshot()
        with pytest.raises((ValueError, IndexError, TypeError)):
            call()
        after = self.snapshot()
        assert after[:4] == before[:4] and after[5] == before[5], f"{what} changed the bookkeeping"
        assert all(torch.equal(a, b) for a, b in zip(after[4], before[4])), f"{what} changed a tensor"

    def free_rows(self) -> int:
        return len(self.t.free_slots)

    # --- the scheduler ---------------------------------------------------------------------------

    @rule(n=st.integers(0, 3), chunked=st.data())
    def admit(self, n, chunked):
        """New requests, and with them the next chunk of some running ones and resumed ones."""
        new = [Req() for _ in range(n)]
        kept = chunked.draw(st.lists(st.sampled_from(sorted(self.reqs)), unique=True, max_size=2)) if self.reqs else []
        resumed = chunked.draw(st.lists(st.sampled_from(sorted(self.stateless)), unique=True, max_size=2)) if self.stateless else []
        batch = [*new, *(self.reqs[r][0] for r in kept), *(self.stateless[r] for r in resumed)]
        fits = n <= self.free_rows() and (n + len(resumed)) * self.per <= self.t.mamba_pool.available_size()
        before = self.snapshot()
        held_before = set(self.t.mamba_pool.held_slots())
        model_held = {s for _, v in (*self.reqs.values(), *self.pending.values()) for s in v} | self.cache
        got = self.t.alloc(batch)
        if not fits:
            assert got is None
            assert self.snapshot()[:4] == before[:4]
            return
        assert got[n:] == [*kept, *resumed], "a request that has a row keeps it"
        for r in kept:
            assert self.slots_of(r) == self.reqs[r][1], "and its slots"
        assert len(set(got)) == len(got) and not set(got[:n]) & {*self.reqs, *self.stateless}, "new rows were free"
        for req, row in zip([*new, *(self.stateless[r] for r in resumed)], [*got[:n], *resumed]):
            slots = self.slots_of(row)
            assert len(slots) == self.per and int(req.mamba_pool_idx) == slots[0] and req.req_pool_idx == row
            assert len(set(slots)) == self.per and set(slots).isdisjoint(held_before | model_held), (
                f"alloc gave row {row} slots {list(slots)}, not all free before"
            )
            held_before |= set(slots)
            _, dropped = self.pending.pop(row, (None, ()))
            self.cache |= set(dropped)  # a new request took the row: that state is nobody's (the test frees it)
            self.reqs[row] = (req, slots)
        for r in resumed:
            del self.stateless[r]

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), order=st.sampled_from(["state-first", "row-first"]), by=st.sampled_from(["request", "row"]))
    def finish(self, data, order, by):
        row = data.draw(st.sampled_from(sorted(self.reqs)))
        req, slots = self.reqs.pop(row)
        free_row = lambda: self.t.free(req if by == "request" else row)  # noqa: E731
        free_state = lambda: self.t.free_mamba_cache(req if by == "request" else row)  # noqa: E731
        if order == "state-first":
            free_state()
            assert req.mamba_pool_idx is None
            free_row()
        else:
            free_row()
            self.pending[row] = (req, slots)
            if data.draw(st.booleans()):  # later, or never before the row is taken again
                free_state()
                del self.pending[row]

    @precondition(lambda self: self.pending)
    @rule(data=st.data(), by=st.sampled_from(["request", "row"]))
    def free_a_pending_state(self, data, by):
        row = data.draw(st.sampled_from(sorted(self.pending)))
        req, _ = self.pending.pop(row)
        self.t.free_mamba_cache(req if by == "request" else row)
        assert req.mamba_pool_idx is None

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def retract_state(self, data):
        """The state goes (freed), the row stays: the request resumes later with a fresh state."""
        row = data.draw(st.sampled_from(sorted(self.reqs)))
        req, _ = self.reqs.pop(row)
        self.t.free_mamba_cache(req)
        self.stateless[row] = req

    @precondition(lambda self: self.stateless)
    @rule(data=st.data())
    def drop_stateless(self, data):
        row = data.draw(st.sampled_from(sorted(self.stateless)))
        self.t.free(self.stateless.pop(row))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), keep=st.integers(0, 1))
    def cache_takes_the_state(self, data, keep):
        """A prefix cache takes a finished request's state slot (as MambaRadixCache does: the request
        forgets it, the row is freed by number), or with track slots keeps one of them."""
        row = data.draw(st.sampled_from(sorted(self.reqs)))
        req, slots = self.reqs.pop(row)
        if self.per == 1:
            req.mamba_pool_idx = None
            self.cache.add(slots[0])
        else:
            keep = min(keep, self.per - 2)
            self.t.free_mamba_cache(req, mamba_ping_pong_track_buffer_to_keep=keep)
            self.cache.add(slots[1 + keep])
        self.t.free(row)

    @precondition(lambda self: self.cache)
    @rule()
    def evict(self):
        self.t.mamba_pool.free(sorted(self.cache))
        self.cache = set()

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def write(self, data):
        row = data.draw(st.sampled_from(sorted(self.reqs)))
        start = data.draw(st.integers(0, COLUMNS - 1))
        values = data.draw(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=COLUMNS - start))
        dtype = data.draw(st.sampled_from([torch.int32, torch.int64]))
        self.t.write((row, slice(start, start + len(values))), torch.tensor(values, dtype=dtype))
        self.table[row][start : start + len(values)] = values

    # --- bad calls -------------------------------------------------------------------------------

    @rule(data=st.data())
    def bad_call(self, data):
        t = self.t
        free_rows = list(t.free_slots)
        running = sorted(self.reqs)
        calls = [
            ("alloc -1", lambda: t.alloc(-1)),
            ("alloc 1.5", lambda: t.alloc(1.5)),
            ("alloc None", lambda: t.alloc(None)),
            ("alloc True", lambda: t.alloc(True)),
            ("alloc an int among requests", lambda: t.alloc([Req(), 7])),
            ("free past the end", lambda: t.free(t.size)),
            ("free a bool", lambda: t.free(True)),
            ("free a request without a row", lambda: t.free(Req())),
            ("state of a request without one", lambda: t.free_mamba_cache(Req())),
            ("state of a row past the end", lambda: t.free_mamba_cache(t.size)),
            ("keep index True", lambda: t.free_mamba_cache(running[0] if running else 0, True)),
            ("keep index past the track slots", lambda: t.free_mamba_cache(running[0] if running else 0, 2)),
            ("other track index 5", lambda: t.get_mamba_ping_pong_other_idx(5)),
            ("mamba_slot -1", lambda: t.mamba_slot(-1)),
            ("track_slots past the end", lambda: t.track_slots(t.size)),
            ("write a row past the end", lambda: t.write((t.size, 0), torch.tensor(1, dtype=torch.int32))),
            ("write floats", lambda: t.write((0, slice(0, 2)), torch.tensor([1.0, 2.0]))),
            ("write bools", lambda: t.write((0, slice(0, 2)), torch.tensor([True, False]))),
            ("write int16", lambda: t.write((0, slice(0, 2)), torch.tensor([1, 2], dtype=torch.int16))),
            ("write past int32", lambda: t.write((0, 0), torch.tensor([2**31]))),
            ("write a column past the end", lambda: t.write((0, [0, COLUMNS]), torch.tensor([1, 2], dtype=torch.int32))),
        ]
        if free_rows:
            f = free_rows[0]
            calls += [
                ("free a free row", lambda: t.free([f])),
                ("keep a free row", lambda: t.alloc([_with(Req(), req_pool_idx=f)])),
            ]
            if f not in self.pending:
                calls.append(("state of a free row", lambda: t.free_mamba_cache(f)))
        if running:
            r0 = running[0]
            req0, slots0 = self.reqs[r0]
            calls += [
                ("two requests keep one row", lambda: t.alloc([_with(Req(), req_pool_idx=r0), _with(Req(), req_pool_idx=r0)])),
                ("a running row's state slot", lambda: t.alloc([_with(Req(), mamba_pool_idx=torch.tensor(slots0[0]))])),
                ("a row with another slot", lambda: t.alloc([_with(Req(), req_pool_idx=r0, mamba_pool_idx=torch.tensor(-5))])),
                ("free one row twice", lambda: t.free([r0, r0])),
            ]
            if self.per > 1:
                calls.append(("a running row's track slot",
                              lambda: t.alloc([_with(Req(), mamba_ping_pong_track_buffer=torch.tensor(slots0[1:] * 2)[: self.per - 1])])))  # fmt: skip
        unheld = [s for s in range(1, t.mamba_pool.size + 1) if not t.mamba_pool.is_held(s)]
        if unheld:
            calls.append(("a slot never handed out", lambda: t.alloc([_with(Req(), mamba_pool_idx=unheld[0])])))
        name, call = data.draw(st.sampled_from(calls))
        self.refused(call, name)

    # --- after every step ------------------------------------------------------------------------

    @invariant()
    def matches_the_model(self):
        if not hasattr(self, "t"):
            return
        t = self.t
        t.check_integrity(external_slots=sorted(self.cache))
        attached = {s for _, v in (*self.reqs.values(), *self.pending.values()) for s in v}
        assert set(t.mamba_pool.held_slots()) == attached | self.cache
        running = {*self.reqs, *self.stateless}
        assert sorted(t.free_slots) == sorted(set(range(t.size)) - running)
        for row, (req, slots) in self.reqs.items():
            assert self.slots_of(row) == slots and req.req_pool_idx == row
            assert t.req_index_to_mamba_index_mapping[row].item() == slots[0]
        for row in self.stateless:
            assert self.slots_of(row)[0] == 0
        for row, (req, slots) in self.pending.items():
            assert int(req.mamba_pool_idx) == slots[0] and self.slots_of(row) == slots
        for row in running:
            assert t.req_to_token[row].tolist() == self.table[row]
        assert t.available_size() == min(len(t.free_slots), t.mamba_pool.available_size() // self.per)


def _with(req, **attrs):
    for k, v in attrs.items():
        setattr(req, k, v)
    return req


TestRequestTableMachine = machine_test(RequestTableMachine, examples=40, steps=40, seed=35)
