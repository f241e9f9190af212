"""ReqToTokenPool, the request table: rows handed out and taken back, writes checked first; deliberate
examples and a state machine against a plain-Python model."""

from __future__ import annotations

import doctest

import hypothesis.strategies as st
import pytest
import torch
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvpool.pools.req_to_token as req_to_token_module
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


@pytest.mark.parametrize(
    "values, message",
    [
        (torch.tensor([1.5, 2.0]), "values must be int32 or int64 \\(slots\\), got torch.float32"),
        (torch.tensor([1, 2], dtype=torch.float64), "got torch.float64"),
        (torch.tensor([1, 2], dtype=torch.uint64) if hasattr(torch, "uint64") else None, "got torch.uint64"),
        (torch.tensor([True, False]), "got torch.bool"),
        (torch.tensor([1, 2], dtype=torch.int16), "got torch.int16"),
        (torch.tensor([1, 2], dtype=torch.uint8), "got torch.uint8"),
        (1.0, "values must be an int or an int32/int64 tensor, got float"),
        (True, "values must be an int or an int32/int64 tensor, got bool"),
        ([1, 2], "values must be an int or an int32/int64 tensor, got list"),
    ],
    ids=["float32", "float64", "uint64", "bool", "int16", "uint8", "python-float", "python-bool", "list"],
)
def test_write_refuses_values_that_are_not_int32_or_int64(values, message):
    """torch stores a float, bool or uint64 tensor converted (1.5 becomes 1): the table refuses it."""
    if values is None:
        pytest.skip("this torch has no uint64")
    t = ReqToTokenPool(4, 6, "cpu")
    t.req_to_token.copy_(torch.arange(24, dtype=torch.int32).view(4, 6))
    before = t.req_to_token.clone()
    with pytest.raises(ValueError, match=message):
        t.write((1, slice(0, 2)), values)
    assert torch.equal(t.req_to_token, before)


def test_sglangs_request_forms_of_alloc_and_free():
    class Req:
        req_pool_idx = None

    t = ReqToTokenPool(4, 4, "cpu")
    a, b = Req(), Req()
    assert t.alloc([a, b]) == [0, 1] and (a.req_pool_idx, b.req_pool_idx) == (0, 1)
    c = Req()
    assert t.alloc([c, a]) == [2, 0], "a chunked request keeps its row"
    assert t.alloc([Req(), Req()]) is None and t.available_size() == 1, "too few rows: nothing changes"
    t.free(a)
    assert a.req_pool_idx is None and t.available_size() == 2
    with pytest.raises(ValueError, match="the request has no req_pool_idx"):
        t.free(a)
    t.check_integrity()


def test_one_request_is_checked_alike_with_rows_free_and_with_none():
    """A single request that refuses ``req_pool_idx`` is refused whether or not a row is free (the
    common one-request step takes a direct path while rows are free), and nothing changes."""
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Frozen:
        req_pool_idx: object = None

    for free_rows in (2, 0):
        t = ReqToTokenPool(2, 4, "cpu")
        t.alloc(2 - free_rows)
        before = list(t.free_slots)
        with pytest.raises(ValueError, match=r"reqs\[0\] must accept assignment of req_pool_idx \(alloc sets it\)"):
            t.alloc([Frozen()])
        assert t.free_slots == before
        t.check_integrity()
