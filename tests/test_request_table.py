"""ReqToTokenPool and HybridReqToTokenPool (a state slot per request): deliberate examples and
state machines against plain-Python models."""

from __future__ import annotations

import doctest

import hypothesis.strategies as st
import pytest
import torch
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvpool.pools.hybrid_req_pool as hybrid_req_pool_module
import kvpool.pools.req_to_token as req_to_token_module
from kvpool import HybridReqToTokenPool, MambaCacheParams, MambaStateShape
from kvpool.errors import IntegrityError
from kvpool.pools.req_to_token import ReqToTokenPool


def test_docstring_examples_run():
    assert doctest.testmod(req_to_token_module).failed == 0


def test_table_shape_dtype_device_and_zeroed():
    t = ReqToTokenPool(3, 10, "cpu")
    assert t.req_to_token.shape == (3, 10) and t.req_to_token.dtype == torch.int32
    assert t.req_to_token.device.type == "cpu" and not t.req_to_token.any()
    assert (t.size, t.max_context_len, t.available_size()) == (3, 10, 3)


def test_alloc_in_order_then_none_when_short():
    t = ReqToTokenPool(3, 4, "cpu")
    assert t.alloc(2) == [0, 1]
    assert t.alloc(2) is None
    assert t.available_size() == 1
    assert t.alloc(0) == []
    assert t.alloc(1) == [2]


@pytest.mark.parametrize("bad", [-1, 1.5, True, None])
def test_alloc_rejects_bad_sizes(bad):
    with pytest.raises(ValueError, match="need_size must be a non-negative int"):
        ReqToTokenPool(3, 4, "cpu").alloc(bad)


def test_free_int_list_and_tensor():
    t = ReqToTokenPool(4, 4, "cpu")
    t.alloc(4)
    t.free(2)
    t.free([0, 3])
    t.free(torch.tensor([1]))
    assert sorted(t.alloc(4)) == [0, 1, 2, 3]
    t.check_integrity()


@pytest.mark.parametrize(
    "index, message",
    [
        (1, "row 1 at position 0, which is already free"),
        ([0, 0], "row 0 at position 1, which is listed twice"),
        (5, "rows in 0..3, got 5 at position 0"),
        (-1, "rows in 0..3, got -1"),
        (1.0, "free_index must be an int or a sequence of ints, got 1.0"),
        (torch.tensor([0.0]), "free_index must be an integer tensor, got torch.float32"),
    ],
)
def test_bad_free_raises_and_changes_nothing(index, message):
    t = ReqToTokenPool(4, 4, "cpu")
    t.alloc(1)  # row 0 handed out, 1..3 free
    before = (list(t.free_slots), list(t._is_free))
    with pytest.raises(ValueError, match=message):
        t.free(index)
    assert (t.free_slots, t._is_free) == before


@pytest.mark.parametrize(
    "indices, values, error, message",
    [
        (torch.tensor([0, 1, 7]), torch.tensor(3, dtype=torch.int32), IndexError,
         r"indices\[2\] = 7 is out of range: rows are 0..3 \(negative entries count from the end\)"),
        ((torch.tensor([0, 1, -5]), 0), torch.tensor([1, 2, 3], dtype=torch.int32), IndexError, r"indices\[0\]\[2\] = -5 is out of range: rows are 0..3"),
        ((4, slice(0, 2)), torch.tensor([1, 2], dtype=torch.int32), IndexError, r"indices\[0\] = 4 is out of range: rows are 0..3"),
        ((1, [0, 6]), torch.tensor([1, 2], dtype=torch.int32), IndexError, r"indices\[1\]\[1\] = 6 is out of range: columns are 0..5"),
        ((0, slice(0, 2)), torch.tensor([7, 2**33 + 5]), ValueError, r"values must fit int32 .*got 8589934597 at flat position 1"),
        (1, 2**40, ValueError, "values must fit int32"),
    ],
    ids=["rows-tensor", "rows-of-a-pair", "row-int", "columns-list", "int64-values", "int-value"],
)
def test_write_checks_first_and_writes_nothing_on_error(indices, values, error, message):
    """Torch's own indexing writes the rows before an out-of-range one, then raises; and it stores
    int64 slots beyond int32 truncated. The table checks first, naming the argument."""
    t = ReqToTokenPool(4, 6, "cpu")
    t.req_to_token.copy_(torch.arange(24, dtype=torch.int32).view(4, 6))
    before = t.req_to_token.clone()
    with pytest.raises(error, match=message):
        t.write(indices, values)
    assert torch.equal(t.req_to_token, before)
    t.write((torch.tensor([0, -1]), 0), torch.tensor([100, 101], dtype=torch.int32))  # negatives wrap, as in torch
    t.write((2, slice(4, 9)), torch.tensor([7, 8]))  # int64 values that fit; slices clip
    assert t.req_to_token[:, 0].tolist() == [100, 6, 12, 101] and t.req_to_token[2, 4:].tolist() == [7, 8]


def test_write_is_plain_indexing():
    t = ReqToTokenPool(2, 6, "cpu")
    r = t.alloc(1)[0]
    t.write((r, slice(0, 3)), torch.tensor([4, 5, 6], dtype=torch.int32))
    t.write((torch.tensor([r]), torch.tensor([5])), torch.tensor([9], dtype=torch.int32))
    assert t.req_to_token[r].tolist() == [4, 5, 6, 0, 0, 9]


def test_clear_and_sglang_keyword():
    t = ReqToTokenPool(3, 4, "cpu", enable_memory_saver=False)
    t.alloc(3)
    t.clear()
    assert t.available_size() == 3 and t.alloc(3) == [0, 1, 2]


@pytest.mark.parametrize("args, message", [((0, 4), "size must be a positive int, got 0"),
                                           ((2, 0), "max_context_len must be a positive int, got 0")])
def test_constructor_errors(args, message):
    with pytest.raises(ValueError, match=message):
        ReqToTokenPool(*args, "cpu")


def test_check_integrity_reports_corruption():
    t = ReqToTokenPool(4, 4, "cpu")
    t.alloc(2)
    t.free_slots.append(2)
    with pytest.raises(IntegrityError, match="1 rows listed free more than once"):
        t.check_integrity()


class ReqTableMachine(RuleBasedStateMachine):
    @initialize(size=st.integers(1, 12))
    def setup(self, size):
        self.t = ReqToTokenPool(size, 5, "cpu")
        self.size = size
        self.free: set[int] = set(range(size))
        self.rows: dict[int, list[int]] = {}  # row -> what was written into it

    @rule(n=st.integers(0, 14))
    def alloc(self, n):
        before = list(self.t.free_slots)
        got = self.t.alloc(n)
        if n > len(self.free):
            assert got is None and self.t.free_slots == before
            return
        assert len(got) == len(set(got)) == n and set(got) <= self.free
        self.free -= set(got)
        for r in got:
            values = [(r * 7 + i) % 100 for i in range(5)]
            self.t.write(r, torch.tensor(values, dtype=torch.int32))
            self.rows[r] = values

    @precondition(lambda self: self.rows)
    @rule(data=st.data(), form=st.sampled_from(["int", "list", "tensor"]))
    def free(self, data, form):
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.rows)), unique=True, min_size=1, max_size=3))
        if form == "int":
            chosen = chosen[:1]
        arg = chosen[0] if form == "int" else (chosen if form == "list" else torch.tensor(chosen))
        self.t.free(arg)
        for r in chosen:
            del self.rows[r]
            self.free.add(r)

    @rule(data=st.data())
    def bad_free(self, data):
        bad = data.draw(st.sampled_from(sorted(set(range(-1, self.size + 1)) - set(self.rows))))
        before = (list(self.t.free_slots), list(self.t._is_free))
        with pytest.raises(ValueError):
            self.t.free([bad])
        assert (self.t.free_slots, self.t._is_free) == before

    @rule()
    def clear(self):
        self.t.clear()
        self.free, self.rows = set(range(self.size)), {}

    @invariant()
    def agrees(self):
        assert self.t.available_size() == len(self.free)
        assert set(self.t.free_slots) == self.free
        for r, values in self.rows.items():
            assert self.t.req_to_token[r].tolist() == values
        self.t.check_integrity()


TestReqTableMachine = ReqTableMachine.TestCase


def test_memory_saver_is_refused_as_the_pools_refuse_it():
    with pytest.raises(ValueError, match="enable_memory_saver must be False"):
        ReqToTokenPool(4, 8, "cpu", enable_memory_saver=True)
    assert ReqToTokenPool(4, 8, "cpu", enable_memory_saver=False).available_size() == 4


# --- HybridReqToTokenPool: a row and a state slot per request --------------------------------------

STATE = MambaCacheParams(MambaStateShape(conv=(6, 3), temporal=(2, 3, 4)), layers=(0, 2))


class Req:
    """The attributes SGLang's scheduler keeps on a request."""

    def __init__(self):
        self.req_pool_idx = None
        self.mamba_pool_idx = None
        self.mamba_ping_pong_track_buffer = None
        self.mamba_next_track_idx = None


def hybrid(size=4, mamba_size=12, extra=False, spec=None):
    t = HybridReqToTokenPool(
        size=size, mamba_size=mamba_size, max_context_len=8, device="cpu", cache_params=STATE,
        enable_mamba_extra_buffer=extra, speculative_num_draft_tokens=spec,
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
    t.check_integrity(external_slots=[1, 2, 3])  # a's state outlives its row until freed
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
        (lambda t, r: t.free_mamba_cache(r[0], mamba_ping_pong_track_buffer_to_keep=2), r"must be in 0..1 or None, got 2"),
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
    states freed ahead of their rows, and rows freed ahead of their states, never leak or double up."""

    @initialize(size=st.integers(1, 5), mamba_size=st.integers(1, 12), extra=st.booleans())
    def setup(self, size, mamba_size, extra):
        self.t = hybrid(size=size, mamba_size=mamba_size, extra=extra)
        self.per = 3 if extra else 1
        self.live: dict[int, tuple[int, ...]] = {}  # row -> its slots (state first)
        self.rows_only: set[int] = set()  # rows whose state was freed
        self.orphans: set[int] = set()  # slots of freed rows, owned by the test (a prefix cache)

    @rule(n=st.integers(0, 3))
    def alloc(self, n):
        free_rows = self.t.size - len(self.live) - len(self.rows_only)
        fits = n <= free_rows and n * self.per <= self.t.mamba_pool.available_size()
        got = self.t.alloc(n)
        if not fits:
            assert got is None
            return
        assert got is not None and len(got) == n
        for r in got:
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
            self.orphans |= set(slots)
        else:
            self.t.free_mamba_cache(r)
            self.rows_only.add(r)

    @precondition(lambda self: self.rows_only)
    @rule()
    def free_row(self):
        self.t.free(self.rows_only.pop())

    @precondition(lambda self: self.orphans)
    @rule()
    def evict(self):
        self.t.mamba_pool.free(sorted(self.orphans))
        self.orphans = set()

    @invariant()
    def consistent(self):
        if hasattr(self, "t"):
            self.t.check_integrity(external_slots=sorted(self.orphans))
            owned = {s for slots in self.live.values() for s in slots} | self.orphans
            assert set(self.t.mamba_pool.held_slots()) == owned


TestHybridTableMachine = HybridTableMachine.TestCase
