"""HybridReqToTokenPool: a row and a state slot (and track slots) per request; chunked and resumed
requests keep theirs; the two frees in either order; bad requests refused before any change;
deliberate examples and a state machine against a plain-Python model."""

from __future__ import annotations

import doctest

import hypothesis.strategies as st
import pytest
import torch
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvpool.pools.hybrid_req_pool as hybrid_req_pool_module
from kvassert import gpu, no_sync
from kvpool import HybridReqToTokenPool, MambaCacheParams, MambaStateShape
from kvpool.errors import IntegrityError

STATE = MambaCacheParams(MambaStateShape(conv=(6, 3), temporal=(2, 3, 4)), layers=(0, 2))


class Req:
    """The attributes SGLang's scheduler keeps on a request."""

    def __init__(self):
        self.req_pool_idx = None
        self.mamba_pool_idx = None
        self.mamba_ping_pong_track_buffer = None
        self.mamba_next_track_idx = None


def hybrid(size=4, mamba_size=12, extra=False, spec=None, validate=False):
    t = HybridReqToTokenPool(
        size=size, mamba_size=mamba_size, max_context_len=8, device="cpu", cache_params=STATE,
        enable_mamba_extra_buffer=extra, speculative_num_draft_tokens=spec, validate=validate,
    )  # fmt: skip
    for s in (*t.mamba_pool.conv, t.mamba_pool.temporal):
        s.view(torch.uint8).fill_(0xFF)  # stale bytes a fresh request must not see
    return t


def slot_bytes(t, slot):
    return [s[:, slot].view(torch.uint8).clone() for s in (*t.mamba_pool.conv, t.mamba_pool.temporal)]


def test_hybrid_docstring_examples_run():
    assert doctest.testmod(hybrid_req_pool_module).failed == 0


def test_hybrid_alloc_gives_each_row_a_zeroed_state_slot():
    t = hybrid()
    rows = t.alloc(3)
    assert rows == [0, 1, 2] and [t.mamba_slot(r) for r in rows] == [1, 2, 3]
    assert t.req_index_to_mamba_index_mapping.tolist()[:3] == [1, 2, 3]
    assert t.get_mamba_indices(torch.tensor([2, 0])).tolist() == [3, 1]
    for slot in (1, 2, 3):
        assert not any(b.any() for b in slot_bytes(t, slot)), "a new request's state starts at zero"
    assert all(b.eq(0xFF).all() for b in slot_bytes(t, 4)), "slots not handed out are untouched"
    assert t.available_size() == 1 and t.mamba_pool.available_size() == 9
    t.check_integrity()
    short = hybrid(size=4, mamba_size=5, extra=True)  # 3 slots a request: state slots for one
    assert short.available_size() == 1 and short.alloc(1) == [0] and short.available_size() == 0


def test_hybrid_track_slots_with_the_extra_buffer():
    t = hybrid(extra=True)
    assert t.mamba_ping_pong_track_buffer_size == 2 and hybrid(extra=True, spec=3).mamba_ping_pong_track_buffer_size == 1
    rows = t.alloc(2)
    assert [t.mamba_slot(r) for r in rows] == [1, 4] and [t.track_slots(r) for r in rows] == [(2, 3), (5, 6)]
    assert t.req_index_to_mamba_ping_pong_track_buffer_mapping[:2].tolist() == [[2, 3], [5, 6]]
    assert (t.get_mamba_ping_pong_other_idx(0), t.get_mamba_ping_pong_other_idx(1)) == (1, 0)
    t.free_mamba_cache(rows[0], mamba_ping_pong_track_buffer_to_keep=1)  # a prefix cache keeps slot 3
    t.free(rows[0])
    assert t.mamba_pool.held_slots() == [3, 4, 5, 6]
    t.check_integrity(external_slots=[3])
    with pytest.raises(IntegrityError, match=r"1 state slots handed out but owned by no row and not external \(leaked; first: 3\)"):
        t.check_integrity()
    t.mamba_pool.free([3])
    t.check_integrity()


def test_hybrid_chunked_and_resumed_requests_keep_row_and_slot():
    t = hybrid(extra=True)
    a, b = Req(), Req()
    assert t.alloc([a, b]) == [0, 1]
    assert (a.req_pool_idx, int(a.mamba_pool_idx), a.mamba_ping_pong_track_buffer.tolist(), a.mamba_next_track_idx) == (0, 1, [2, 3], 0)
    t.mamba_pool.temporal[:, 1] = 7.0  # the first chunk's state
    before = slot_bytes(t, 1)
    c = Req()
    assert t.alloc([a, c]) == [0, 2], "the next chunk of a keeps its row"
    assert int(a.mamba_pool_idx) == 1 and a.mamba_ping_pong_track_buffer.tolist() == [2, 3]
    assert all(torch.equal(x, y) for x, y in zip(slot_bytes(t, 1), before)), "a kept state is not zeroed"
    assert int(c.mamba_pool_idx) == 7 and t.mamba_pool.available_size() == 3
    # a resumed request: its state was freed, its row kept; it gets a fresh zeroed state
    t.free_mamba_cache(b)
    assert b.mamba_pool_idx is None and b.mamba_ping_pong_track_buffer is None
    assert t.alloc([b]) == [1] and int(b.mamba_pool_idx) == 10 and not any(x.any() for x in slot_bytes(t, 10))
    t.free(a)
    assert a.req_pool_idx is None and len(t.free_slots) == 2 and t.available_size() == 1  # 3 state slots left
    t.check_integrity()  # a's state outlives its row, still its own, until freed
    t.free_mamba_cache(a)
    t.check_integrity()


def test_hybrid_alloc_returns_none_and_changes_nothing_when_short():
    t = hybrid(size=4, mamba_size=5, extra=True)  # 3 slots per request
    assert t.alloc(1) == [0]
    state = (list(t.free_slots), t.mamba_pool.available_size(), t.mamba_pool.held_slots())
    assert t.alloc(1) is None, "rows are free but state slots are not"
    reqs = [Req(), Req()]
    assert t.alloc(reqs) is None and all(r.req_pool_idx is None for r in reqs)
    assert (list(t.free_slots), t.mamba_pool.available_size(), t.mamba_pool.held_slots()) == state
    full = hybrid(size=1, mamba_size=8)
    full.alloc(1)
    assert full.alloc(1) is None and full.mamba_pool.available_size() == 7


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda t, r: t.alloc([_with(Req(), req_pool_idx=3)]), r"reqs\[0\].req_pool_idx = 3 is not a row handed out"),
        (lambda t, r: t.alloc([_with(Req(), mamba_pool_idx=9)]), r"reqs\[0\].mamba_pool_idx = 9 is not a state slot handed out"),
        (lambda t, r: t.free_mamba_cache(Req()), r"the request has no mamba_pool_idx \(a double free\?\)"),
        (lambda t, r: t.free_mamba_cache(3), "req must be a row that holds a state, got row 3"),
        (lambda t, r: t.free_mamba_cache(r[0], mamba_ping_pong_track_buffer_to_keep=2), r"must be an int in 0..1 or None, got 2"),
        (lambda t, r: t.free(Req()), r"the request has no req_pool_idx \(a double free\?\)"),
    ],
    ids=["row-not-held", "slot-not-held", "state-double-free", "row-without-state", "keep-index", "row-double-free"],
)
def test_hybrid_bad_calls_raise_and_change_nothing(call, match):
    t = hybrid(extra=True)
    rows = t.alloc(2)
    state = (list(t.free_slots), t.mamba_pool.held_slots(), [t.mamba_slot(r) for r in rows])
    with pytest.raises(ValueError, match=match):
        call(t, rows)
    assert (list(t.free_slots), t.mamba_pool.held_slots(), [t.mamba_slot(r) for r in rows]) == state
    t.check_integrity()


def _with(req, **attrs):
    for k, v in attrs.items():
        setattr(req, k, v)
    return req


def test_hybrid_layers_clear_and_constructor_checks():
    t = hybrid(spec=2)
    assert t.mamba_map == {0: 0, 2: 1}
    assert t.mamba2_layer_cache(2).temporal.data_ptr() == t.mamba_pool.get_ssm_state(2).data_ptr()
    with pytest.raises(ValueError, match=r"layer_id 1 is not a linear-attention layer of this pool: its layers are \[0, 2\]"):
        t.mamba2_layer_cache(1)
    assert t.get_speculative_mamba2_params_all_layers().intermediate_ssm.shape == (2, 5, 2, 2, 3, 4)
    t.alloc(3)
    t.clear()
    assert t.available_size() == 4 and t.mamba_pool.available_size() == 12 and not t.req_index_to_mamba_index_mapping.any()
    t.check_integrity()
    for kwargs, match in [
        (dict(mamba_layer_ids=[0, 1]), r"mamba_layer_ids must equal cache_params.layers \[0, 2\]"),
        (dict(enable_mamba_extra_buffer_lazy=True), "enable_mamba_extra_buffer_lazy must be False"),
        (dict(enable_mamba_extra_buffer=1), "enable_mamba_extra_buffer must be a bool"),
        (dict(mamba_size=0), "size must be a positive int"),
        (dict(enable_memory_saver=True), "enable_memory_saver must be False"),
    ]:
        with pytest.raises(ValueError, match=match):
            HybridReqToTokenPool(**{**dict(size=2, mamba_size=4, max_context_len=8, device="cpu", cache_params=STATE), **kwargs})


class HybridTableMachine(RuleBasedStateMachine):
    """Rows and state slots against a model: each live request owns a row and 1 + track slots;
    states freed ahead of their rows, rows freed ahead of their states (then the state freed by
    row), and a kept track slot handed to a prefix cache, never leak or double up."""

    @initialize(size=st.integers(1, 5), mamba_size=st.integers(1, 12), extra=st.booleans())
    def setup(self, size, mamba_size, extra):
        self.t = hybrid(size=size, mamba_size=mamba_size, extra=extra)
        self.per = 3 if extra else 1
        self.live: dict[int, tuple[int, ...]] = {}  # row -> its slots (state first)
        self.rows_only: set[int] = set()  # held rows whose state was freed
        self.states_only: dict[int, tuple[int, ...]] = {}  # freed rows whose state was not freed yet
        self.cached: set[int] = set()  # track slots a prefix cache kept
        self.dropped: set[int] = set()  # states of freed rows that a new request took: nobody's

    def _free_rows(self) -> int:
        return self.t.size - len(self.live) - len(self.rows_only)

    @rule(n=st.integers(0, 3))
    def alloc(self, n):
        fits = n <= self._free_rows() and n * self.per <= self.t.mamba_pool.available_size()
        got = self.t.alloc(n)
        if not fits:
            assert got is None
            return
        assert got is not None and len(got) == n
        for r in got:
            self.dropped |= set(self.states_only.pop(r, ()))  # a new request took the row: nobody's state
            slots = (self.t.mamba_slot(r), *self.t.track_slots(r))
            assert len(slots) == self.per and not any(x.any() for x in slot_bytes(self.t, slots[0]))
            self.live[r] = slots

    @precondition(lambda self: self.live)
    @rule(data=st.data(), row_first=st.booleans())
    def finish(self, data, row_first):
        r = data.draw(st.sampled_from(sorted(self.live)))
        slots = self.live.pop(r)
        if row_first:
            self.t.free(r)
            self.states_only[r] = slots
        else:
            self.t.free_mamba_cache(r)
            self.rows_only.add(r)

    @precondition(lambda self: self.states_only)
    @rule(data=st.data())
    def free_state_of_a_freed_row(self, data):
        r = data.draw(st.sampled_from(sorted(self.states_only)))
        self.states_only.pop(r)
        self.t.free_mamba_cache(r)
        assert self.t.mamba_slot(r) == 0

    @precondition(lambda self: self.live and self.per == 3)
    @rule(data=st.data(), keep=st.sampled_from([0, 1]))
    def finish_into_a_cache(self, data, keep):
        r = data.draw(st.sampled_from(sorted(self.live)))
        slots = self.live.pop(r)
        self.t.free_mamba_cache(r, mamba_ping_pong_track_buffer_to_keep=keep)
        self.t.free(r)
        self.cached.add(slots[1 + keep])

    @precondition(lambda self: self.rows_only)
    @rule()
    def free_row(self):
        self.t.free(self.rows_only.pop())

    @precondition(lambda self: self.cached or self.dropped)
    @rule()
    def evict(self):
        self.t.mamba_pool.free(sorted(self.cached | self.dropped))
        self.cached, self.dropped = set(), set()

    @rule(data=st.data())
    def bad_state_free(self, data):
        free_rows = [r for r in range(self.t.size) if r not in self.live and r not in self.rows_only and r not in self.states_only]
        bad = data.draw(st.sampled_from([*sorted(self.rows_only), *free_rows, -1, self.t.size]))
        before = (list(self.t.free_slots), self.t.mamba_pool.held_slots())
        with pytest.raises(ValueError):
            self.t.free_mamba_cache(bad)
        assert (list(self.t.free_slots), self.t.mamba_pool.held_slots()) == before

    @invariant()
    def consistent(self):
        if hasattr(self, "t"):
            self.t.check_integrity(external_slots=sorted(self.cached | self.dropped))
            attached = {s for v in (*self.live.values(), *self.states_only.values()) for s in v}
            assert set(self.t.mamba_pool.held_slots()) == attached | self.cached | self.dropped
            for r, slots in (*self.live.items(), *self.states_only.items()):
                assert (self.t.mamba_slot(r), *self.t.track_slots(r)) == slots


TestHybridTableMachine = HybridTableMachine.TestCase


# --- every request checked before any change; the two frees in either order -------------------------


def _state(t):
    """Every size, list and mapping the table keeps."""
    return (list(t.free_slots), t.mamba_pool.available_size(), t.mamba_pool.held_slots(),
            [(t.mamba_slot(r), t.track_slots(r)) for r in range(t.size)],
            t.req_index_to_mamba_index_mapping.clone(), t.req_index_to_mamba_ping_pong_track_buffer_mapping.clone())  # fmt: skip


def _running(t, n=2):
    reqs = [Req() for _ in range(n)]
    assert t.alloc(reqs) is not None
    return reqs


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda t, a, b: [_with(Req(), mamba_ping_pong_track_buffer=torch.tensor([9, 10]))],
         r"reqs\[0\].mamba_ping_pong_track_buffer\[0\] = 9 is not a state slot handed out"),
        (lambda t, a, b: [_with(Req(), req_pool_idx=a.req_pool_idx), _with(Req(), req_pool_idx=a.req_pool_idx)],
         r"reqs\[1\].req_pool_idx = 0 is kept by reqs\[0\] too"),
        (lambda t, a, b: [_with(Req(), mamba_pool_idx=b.mamba_pool_idx)],
         r"reqs\[0\].mamba_pool_idx holds slot 4, a state slot of running row 1"),
        (lambda t, a, b: [_with(Req(), mamba_pool_idx=torch.tensor(2))],
         r"reqs\[0\].mamba_pool_idx holds slot 2, a state slot of running row 0"),
        (lambda t, a, b: [_with(Req(), mamba_ping_pong_track_buffer=b.mamba_ping_pong_track_buffer)],
         r"mamba_ping_pong_track_buffer holds slot 5, a state slot of running row 1"),
        (lambda t, a, b: [_with(Req(), req_pool_idx=a.req_pool_idx, mamba_pool_idx=b.mamba_pool_idx)],
         r"reqs\[0\].mamba_pool_idx = 4, but its row 0 holds state slot 1"),
        (lambda t, a, b: [_with(Req(), mamba_ping_pong_track_buffer=torch.tensor([t.mamba_pool.alloc_slots(1)[0]]))],
         r"must hold 2 track slots, got \[7\]"),
        (lambda t, a, b: [Req(), 3], r"reqs\[1\] must be a request object \(SGLang's Req\), got 3"),
        (lambda t, a, b: [_with(Req(), req_pool_idx=True)], r"reqs\[0\].req_pool_idx = True is not a row handed out"),
        (lambda t, a, b: [_with(Req(), mamba_pool_idx=1.5)], r"reqs\[0\].mamba_pool_idx must be an int or a one-entry integer tensor"),
        (lambda t, a, b: [_with(Req(), mamba_pool_idx=torch.tensor([1, 2]))], r"reqs\[0\].mamba_pool_idx must hold one slot"),
        (lambda t, a, b: -1, "need_size must be a non-negative int, got -1"),
        (lambda t, a, b: 1.5, "need_size must be a non-negative int or a list of requests, got 1.5"),
        (lambda t, a, b: None, "need_size must be a non-negative int or a list of requests, got None"),
        (lambda t, a, b: True, "need_size must be a non-negative int or a list of requests, got True"),
    ],
    ids=["track-never-handed-out", "two-keep-one-row", "slot-of-another-row", "track-slot-of-another-row-as-state",
         "track-of-another-row", "slot-other-than-the-rows", "track-length", "not-a-request", "row-bool",
         "slot-float", "slot-two-entries", "count-negative", "count-float", "count-none", "count-bool"],  # fmt: skip
)
def test_hybrid_alloc_refuses_before_any_change(make, match):
    t = hybrid(extra=True)
    a, b = _running(t)
    arg = make(t, a, b)
    before = _state(t)
    with pytest.raises(ValueError, match=match):
        t.alloc(arg)
    assert all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(_state(t), before))
    t.check_integrity(external_slots=sorted(set(t.mamba_pool.held_slots()) - set(range(1, 7))))


def test_a_request_that_keeps_its_row_keeps_its_slots_without_the_attributes():
    t = hybrid(extra=True)
    a, _ = _running(t)
    t.mamba_pool.temporal[:, 1] = 3.0
    before, held = slot_bytes(t, 1), t.mamba_pool.held_slots()
    a.mamba_pool_idx = a.mamba_ping_pong_track_buffer = None  # lost by the caller, the row still holds them
    assert t.alloc([a]) == [0]
    assert int(a.mamba_pool_idx) == 1 and a.mamba_ping_pong_track_buffer.tolist() == [2, 3]
    assert t.mamba_pool.held_slots() == held, "no new slot, none leaked"
    assert all(torch.equal(x, y) for x, y in zip(slot_bytes(t, 1), before)), "the state is not zeroed"
    t.check_integrity()


@pytest.mark.parametrize("form", ["row", "request"])
@pytest.mark.parametrize("row_first", [True, False], ids=["row-first", "state-first"])
def test_the_two_frees_work_in_either_order(form, row_first):
    t = hybrid(extra=True)
    a, b = _running(t)
    held = t.mamba_pool.held_slots()
    calls = [lambda: t.free(a if form == "request" else a.req_pool_idx),
             lambda: t.free_mamba_cache(a if form == "request" else 0)]  # fmt: skip
    for call in calls if row_first else calls[::-1]:
        call()
        t.check_integrity()
    assert t.mamba_pool.held_slots() == [s for s in held if s not in (1, 2, 3)]
    assert a.mamba_pool_idx is None and t.available_size() == 3
    assert t.mamba_slot(0) == 0 and t.mamba_slot(1) == 4
    for bad in (lambda: t.free_mamba_cache(0), lambda: t.free_mamba_cache(a)):  # and a second free raises
        before = _state(t)
        with pytest.raises(ValueError, match="holds a state|no mamba_pool_idx"):
            bad()
        assert _state(t)[:4] == before[:4]


def test_a_freed_rows_state_taken_over_by_a_prefix_cache_is_not_the_rows():
    """The cache takes a finished request's state slot (``req.mamba_pool_idx = None``), then the
    scheduler frees the row by number: the slot is the cache's, not the freed row's."""
    t = hybrid()
    (a,) = _running(t, 1)
    a.mamba_pool_idx = None  # what MambaRadixCache.cache_finished_req does when the tree takes the slot
    t.free(0)
    t.check_integrity(external_slots=[1])
    with pytest.raises(ValueError, match="req must be a row that holds a state, got row 0"):
        t.free_mamba_cache(0)  # would free the tree's slot


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda t: t.free_mamba_cache(0, True), ValueError, r"must be an int in 0..1 or None, got True"),
        (lambda t: t.free_mamba_cache(0, 1.0), ValueError, r"must be an int in 0..1 or None, got 1.0"),
        (lambda t: t.free_mamba_cache(True), ValueError, "req must be a row \\(an int\\) or a request, got True"),
        (lambda t: t.get_mamba_ping_pong_other_idx(5), ValueError, r"mamba_next_track_idx must be an int in 0..1, got 5"),
        (lambda t: t.get_mamba_ping_pong_other_idx(-1), ValueError, r"must be an int in 0..1, got -1"),
        (lambda t: t.get_mamba_ping_pong_other_idx(True), ValueError, r"must be an int in 0..1, got True"),
        (lambda t: t.mamba_slot(-1), IndexError, r"row must be in 0..3, got -1"),
        (lambda t: t.mamba_slot(4), IndexError, r"row must be in 0..3, got 4"),
        (lambda t: t.track_slots(-1), IndexError, r"row must be in 0..3, got -1"),
        (lambda t: t.mamba_slot("0"), ValueError, r"row must be an int, got '0'"),
    ],
    ids=["keep-bool", "keep-float", "req-bool", "other-idx-5", "other-idx-negative", "other-idx-bool",
         "slot-negative-row", "slot-past-the-end", "track-negative-row", "slot-str"],  # fmt: skip
)
def test_hybrid_lookups_and_keep_indices_refuse_what_is_not_a_valid_index(call, exc, match):
    t = hybrid(extra=True)
    _running(t, 1)
    before = _state(t)
    with pytest.raises(exc, match=match):
        call(t)
    assert _state(t)[:4] == before[:4]


# --- a stale req_pool_idx; device indices trusted only where they cannot be another request's ----------

META = torch.device("meta")  # a device tensor on CPU: reading one raises, so a test sees whether it is read


def _stale():
    """``old`` got row 0 (state slot 1, track slots 2 and 3); its row was freed by number (its state
    still attached), then ``new`` took row 0 (slots 4, 5 and 6): ``old.req_pool_idx`` still says 0."""
    t = hybrid(size=1, extra=True)
    old, new = Req(), Req()
    assert t.alloc([old]) == [0]
    t.free(0)
    assert t.alloc([new]) == [0] and old.req_pool_idx == 0
    assert (t.mamba_slot(0), t.track_slots(0)) == (4, (5, 6))
    return t, old, new


def _to_meta(req):
    req.mamba_pool_idx = torch.tensor(int(req.mamba_pool_idx), device=META)
    req.mamba_ping_pong_track_buffer = torch.tensor(req.mamba_ping_pong_track_buffer.tolist(), device=META)


def test_the_request_that_names_a_state_its_old_row_lost_can_free_it():
    t, old, new = _stale()
    t.check_integrity(external_slots=[1, 2, 3])  # belongs to nobody but old
    t.free_mamba_cache(old)
    assert old.mamba_pool_idx is None and old.mamba_ping_pong_track_buffer is None
    assert t.mamba_pool.held_slots() == [4, 5, 6], "old's slots freed, new's kept"
    assert (t.mamba_slot(0), t.track_slots(0)) == (4, (5, 6)) and int(new.mamba_pool_idx) == 4
    t.check_integrity()


def test_a_stale_row_never_stands_for_a_device_index():
    t, old, new = _stale()
    _to_meta(old)
    before = _state(t)
    for call in (lambda: t.free_mamba_cache(old), lambda: t.alloc([old])):
        with pytest.raises(NotImplementedError, match="meta"):  # read, not taken from row 0 (new's)
            call()
        assert all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(_state(t), before))
    assert new.req_pool_idx == 0 and int(new.mamba_pool_idx) == 4
    t.check_integrity(external_slots=[1, 2, 3])


def test_a_stale_row_is_refused_by_alloc_and_free():
    t, old, new = _stale()
    before = _state(t)
    with pytest.raises(ValueError, match=r"reqs\[0\].mamba_pool_idx = 1, but its row 0 holds state slot 4"):
        t.alloc([old])
    with pytest.raises(ValueError, match=r"req.req_pool_idx = 0 is the row of another request"):
        t.free(old)
    assert all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(_state(t), before))
    assert old.req_pool_idx == 0 and new.req_pool_idx == 0
    t.check_integrity(external_slots=[1, 2, 3])


@pytest.mark.parametrize("validate", [False, True], ids=["trusted", "validate"])
def test_a_requests_own_row_stands_for_its_device_index_unless_validate(validate, monkeypatch):
    monkeypatch.delenv("KVPOOL_VALIDATE", raising=False)
    t = hybrid(extra=True, validate=validate)
    (a,) = _running(t, 1)
    _to_meta(a)
    calls = (lambda: t.alloc([a]), lambda: t.free_mamba_cache(a))
    if validate:  # every device value is read
        for call in calls:
            with pytest.raises(NotImplementedError, match="meta"):
                call()
        assert (t.mamba_slot(0), t.track_slots(0)) == (1, (2, 3)) and t.mamba_pool.held_slots() == [1, 2, 3]
        return
    assert calls[0]() == [0] and t.mamba_pool.held_slots() == [1, 2, 3]
    calls[1]()
    assert a.mamba_pool_idx is None and t.mamba_pool.held_slots() == []
    t.check_integrity()


# --- on CUDA: the calls of a scheduler's step never wait for the device -----------------------------------


@gpu
def test_the_steps_calls_never_wait_for_the_device(monkeypatch):
    monkeypatch.delenv("KVPOOL_VALIDATE", raising=False)  # validate reads device indices, as documented
    t = HybridReqToTokenPool(size=4, mamba_size=12, max_context_len=8, device="cuda", cache_params=STATE,
                             enable_mamba_extra_buffer=True)  # fmt: skip
    pool = t.mamba_pool
    a, b = Req(), Req()
    assert t.alloc([a, b]) == [0, 1]  # a: slot 1 (tracks 2, 3); b: slot 4 (tracks 5, 6)
    g = torch.Generator(device="cuda").manual_seed(3)
    for s in (*pool.conv, pool.temporal):
        raw = s[:, 1].view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device="cuda", generator=g))
    src, dst = a.mamba_pool_idx.view(1), b.mamba_pool_idx.view(1)
    host = pool.get_cpu_copy(src)  # waits for the stream, as documented
    want = [s[:, 1].view(torch.uint8).cpu() for s in (*pool.conv, pool.temporal)]
    pool.copy_from(src, dst), pool.clear_slots(dst), pool.load_cpu_copy(host, dst)  # warm-up
    with no_sync():
        pool.copy_from(src, dst)
        pool.clear_slots(dst)
        pool.load_cpu_copy(host, dst)
        rows = t.alloc([a, b])  # both keep their rows: the slots are known on the host
        t.free_mamba_cache(a)
        t.free(a)
    assert rows == [0, 1] and a.mamba_pool_idx is None and a.req_pool_idx is None
    for s, w in zip((*pool.conv, pool.temporal), want):
        assert torch.equal(s[:, 4].view(torch.uint8).cpu(), w), "b's slot holds a's state, loaded back"
    assert pool.held_slots() == [4, 5, 6] and t.free_slots[-1] == 0
    t.check_integrity()
