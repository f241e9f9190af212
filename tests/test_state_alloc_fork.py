"""MambaPool's slots: the allocator (examples and a state machine), fork, copy and clear, each
against a plain-torch model of the bytes, on every path (the reference path, the row-copy kernel
through Triton's interpreter on CPU, the kernel on CUDA)."""

from __future__ import annotations

import warnings

import hypothesis.strategies as st
import pytest
import torch
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvpool.kernels.copy_rows as C
from kvassert import assert_states, gpu, poison_, state_params, state_tensors
from kvassert import make_state_pool as make_pool
from kvassert import slots_of as T
from kvassert import state_device  # noqa: F401 (a fixture)
from kvassert import state_snapshot as snapshot
from kvpool import IntegrityError, MambaPool

META = torch.device("meta")
PARAMS = state_params()


@pytest.fixture
def device(state_device):
    return state_device


# --- the slot allocator -----------------------------------------------------------------------------


def test_alloc_hands_out_one_to_size_never_slot_0(device):
    pool = MambaPool(size=5, cache_params=PARAMS, device=device)
    got = pool.alloc(3)
    assert got.dtype == torch.int64 and got.device.type == device and got.tolist() == [1, 2, 3]
    assert pool.alloc_slots(2) == [4, 5] and pool.available_size() == 0
    assert pool.alloc(1) is None and pool.alloc_slots(1) is None
    pool.free(got)  # a device tensor
    pool.free([4])
    pool.free(5)
    assert pool.alloc(5).tolist() == [1, 2, 3, 4, 5]  # first in, first out
    pool.check_integrity()
    pool.clear()
    assert pool.available_size() == 5 and pool.held_slots() == []


@pytest.mark.parametrize(
    "bad, match",
    [
        ([0], r"free_index\[0\] is slot 0, the padding slot"),
        ([2, 6], r"free_index\[1\] = 6 is out of range: slots are 1..5"),
        ([2, 2], r"free_index\[1\] = 2 is listed twice"),
        ([3], r"free_index\[0\] = 3 is not handed out \(a double free, or never allocated\)"),
        (torch.tensor([1.0]), "free_index must be an integer tensor, got torch.float32"),
        (torch.tensor([[1]]), r"free_index must be 0-D or 1-D, got shape \(1, 1\)"),
        (True, "free_index must be an int, a sequence of ints or an integer tensor, got True"),
        (["1"], "free_index must be an int"),
    ],
    ids=["slot-0", "out-of-range", "twice", "double-free", "float", "2-d", "bool", "str"],
)
def test_bad_frees_raise_and_free_nothing(bad, match):
    pool = MambaPool(size=5, cache_params=PARAMS, device="cpu")
    pool.alloc_slots(2)
    with pytest.raises(ValueError, match=match):
        pool.free(bad)
    assert pool.available_size() == 3 and pool.held_slots() == [1, 2]
    pool.check_integrity()


def test_alloc_rejects_bad_counts():
    pool = MambaPool(size=5, cache_params=PARAMS, device="cpu")
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="need_size must be a non-negative int"):
            pool.alloc(bad)
    assert pool.alloc(0).tolist() == [] and pool.available_size() == 5


def test_check_integrity_reports_corruption():
    pool = MambaPool(size=5, cache_params=PARAMS, device="cpu")
    pool.alloc_slots(2)
    pool._slots._free.append(3)  # corrupt the bookkeeping on purpose: slot 3 listed free twice
    pool._slots._held[1] = False  # and slot 1 neither free nor held
    with pytest.raises(IntegrityError, match=r"1 slots listed free more than once.*1 slots neither free nor held"):
        pool.check_integrity()


class SlotMachine(RuleBasedStateMachine):
    """The slot allocator against a model: the free slots in order, and the held ones."""

    @initialize(size=st.integers(1, 12))
    def setup(self, size):
        self.pool = MambaPool(size=size, cache_params=PARAMS, device="cpu")
        self.free = list(range(1, size + 1))
        self.held: set[int] = set()

    @rule(n=st.integers(0, 14), as_tensor=st.booleans())
    def alloc(self, n, as_tensor):
        got = self.pool.alloc(n) if as_tensor else self.pool.alloc_slots(n)
        if n > len(self.free):
            assert got is None
            return
        slots = got.tolist() if as_tensor else got
        assert slots == self.free[:n]
        self.free, self.held = self.free[n:], self.held | set(slots)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), form=st.sampled_from(["list", "tensor", "int"]))
    def free_some(self, data, form):
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.held)), min_size=1, max_size=4, unique=True))
        arg = chosen[0] if form == "int" else (T(chosen, dtype=torch.int32) if form == "tensor" else chosen)
        self.pool.free(arg)
        chosen = chosen[:1] if form == "int" else chosen
        self.free += chosen
        self.held -= set(chosen)

    @rule(data=st.data())
    def bad_free(self, data):
        candidates = [0, -1, self.pool.size + 1] + [s for s in range(1, self.pool.size + 1) if s not in self.held]
        bad = data.draw(st.sampled_from(candidates))
        good = sorted(self.held)[:1]
        with pytest.raises(ValueError):
            self.pool.free(good + [bad])

    @precondition(lambda self: self.held)
    @rule()
    def free_twice_in_one_call(self):
        s = min(self.held)
        with pytest.raises(ValueError, match="listed twice"):
            self.pool.free([s, s])

    @rule()
    def clear(self):
        self.pool.clear()
        self.free, self.held = list(range(1, self.pool.size + 1)), set()

    @invariant()
    def matches_the_model(self):
        if hasattr(self, "pool"):
            assert self.pool.available_size() == len(self.free)
            assert self.pool.held_slots() == sorted(self.held)
            self.pool.check_integrity()


TestSlotMachine = SlotMachine.TestCase


# --- fork and clear ---------------------------------------------------------------------------------


FORKS = {
    "fork": ([3], [7]),
    "two-forks-of-one": ([3, 3], [6, 8]),
    "cycle": ([1, 2, 3], [2, 3, 1]),
    "chain": ([4, 5, 6], [5, 6, 7]),
    "padding-negative-and-slot-0": ([-1, 2, 0, 4], [5, -1, 6, 0]),
}


def expected_copy(before: list[torch.Tensor], src: list[int], dst: list[int], rows: int) -> list[torch.Tensor]:
    out = [b.clone() for b in before]
    for s, d in zip(src, dst):
        if 0 <= s < rows and 0 <= d < rows:
            for o, b in zip(out, before):
                o[:, d] = b[:, s]  # every source read from the state before the copy
    return out


@pytest.mark.parametrize("name", list(FORKS))
def test_copy_from_matches_the_model(device, name):
    pool = make_pool(device)
    src, dst = FORKS[name]
    expected = expected_copy(snapshot(pool), src, dst, pool.size + 1)
    pool.copy_from(T(src, device), T(dst, device, torch.int32))
    assert_states(pool, expected)


def test_fork_from_allocates_and_copies(device):
    pool = make_pool(device, size=3, hold=False)
    src = pool.alloc(1)
    before = snapshot(pool)
    dst = pool.fork_from(src)
    assert dst.tolist() == [2]
    assert_states(pool, expected_copy(before, [1], [2], 4))
    pool.alloc(1)
    assert pool.fork_from(src) is None and pool.available_size() == 0


def _synchronisations(call) -> int:
    """How many times ``call`` waits for the device (torch's sync debug mode, as warnings)."""
    torch.cuda.synchronize()
    old = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode(old)
    # Only torch's report of a wait counts ("called a synchronizing CUDA operation"), not the notice
    # that setting the debug mode itself may print (its text speaks of synchronizing operations too).
    return sum("called a synchronizing CUDA operation" in str(w.message) for w in seen)


@gpu
def test_fork_from_reads_its_source_once_and_get_cpu_copy_its_indices_once():
    pool = make_pool("cuda", size=6, hold=False)
    src = pool.alloc(2)
    pool.fork_from(src[:1]), pool.get_cpu_copy(src)  # warm-up
    assert _synchronisations(lambda: pool.fork_from(src[:1])) == 1, "one read of the source"
    assert _synchronisations(lambda: pool.get_cpu_copy(src)) == 2, "one read of the indices, one wait for the copy"


def test_clear_slots_zeroes_only_the_named_slots(device):
    pool = make_pool(device)
    before = snapshot(pool)
    pool.clear_slots(T([2, -1, 7, 0], device, torch.int32))  # negative entries are padding; slot 0 is cleared
    for b in before:
        b[:, [2, 7, 0]] = 0
    assert_states(pool, before)


def test_the_row_copy_under_the_pool_never_touches_slots_past_the_end(device):
    """What guards the pool's last row where nothing reads the indices (a device pool without
    ``validate``): the row copy itself skips negative entries and entries past the end."""
    pool = make_pool(device)
    src, dst = [-1, 2, 10, 4], [5, -1, 6, 11]
    expected = expected_copy(snapshot(pool), src, dst, pool.size + 1)
    C.checked_copy(pool.row_table, T(dst, device), pool.row_table, T(src, device), None, False, ("dst_index", "src_index"))
    assert_states(pool, expected)


def test_copies_validate_names_the_slot():
    pool = make_pool(validate=True)
    before = snapshot(pool)
    with pytest.raises(IndexError, match=r"dst_index\[1\] = 10 is out of range"):
        pool.copy_from(T([1, 2]), T([3, 10]))
    with pytest.raises(IndexError, match=r"indices\[0\] = 11 is out of range: slots are 0..9"):
        pool.clear_slots(T([11]))
    assert_states(pool, before, "nothing written")


# --- every slot named is checked before anything changes --------------------------------------------


def _bookkeeping(pool):
    return pool.available_size(), pool.held_slots()


@pytest.mark.parametrize(
    "src, exc, match",
    [
        (lambda: torch.tensor([1.0]), ValueError, "src_index must be int32 or int64, got torch.float32"),
        (lambda: T(1), ValueError, r"src_index must be 1-D \[1\], got shape \(\)"),
        (lambda: [1], TypeError, "src_index must be a torch.Tensor, got list"),
        (lambda: T([1, 2]), ValueError, r"src_index must have 1 entries \(the source slot\), got 2"),
        (lambda: T([1]).to(META), ValueError, "src_index must be on cpu, got meta"),
        (lambda: T([0]), ValueError, r"src_index\[0\] is slot 0, the padding slot"),
        (lambda: T([3]), ValueError, r"src_index\[0\] = 3 is not a slot handed out \(it is free\)"),
        (lambda: T([6]), IndexError, r"src_index\[0\] = 6 is out of range: slots are 0..5"),
        (lambda: T([-1]), IndexError, r"src_index\[0\] = -1 is out of range"),
    ],
    ids=["float", "0-d", "list", "two-entries", "device", "slot-0", "free-slot", "past-the-end", "negative"],
)
def test_fork_from_checks_its_source_before_allocating(src, exc, match):
    pool = make_pool(size=5, hold=False)
    pool.alloc_slots(2)
    before, states = _bookkeeping(pool), snapshot(pool)
    with pytest.raises(exc, match=match):
        pool.fork_from(src())
    assert _bookkeeping(pool) == before, "no slot taken"
    assert_states(pool, states, "nothing written")
    pool.check_integrity()


def test_fork_from_gives_the_new_slot_back_when_the_copy_fails(monkeypatch):
    pool = make_pool(size=5, hold=False)
    src = pool.alloc(1)
    before = _bookkeeping(pool)

    def broken(*args):
        raise RuntimeError("injected: the copy kernel failed")

    monkeypatch.setattr(pool, "copy_from", broken)
    with pytest.raises(RuntimeError, match="injected"):
        pool.fork_from(src)
    assert _bookkeeping(pool) == before
    pool.check_integrity()


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda p: p.copy_from(T([1]), T([4])), r"dst_index\[0\] = 4 is not a slot handed out"),
        (lambda p: p.copy_from(T([4]), T([1])), r"src_index\[0\] = 4 is not a slot handed out"),
        (lambda p: p.clear_slots(T([2, 5])), r"indices\[1\] = 5 is not a slot handed out"),
    ],
    ids=["copy-into-a-free-slot", "copy-from-a-free-slot", "clear-a-free-slot"],
)
def test_copies_refuse_slots_not_handed_out(call, match):
    pool = make_pool(size=5, hold=False)
    pool.alloc_slots(3)
    states = snapshot(pool)
    with pytest.raises(ValueError, match=match):
        call(pool)
    assert_states(pool, states, "nothing written")


def test_copies_refuse_slots_past_the_end_of_a_host_pool():
    pool = make_pool()
    states = snapshot(pool)
    with pytest.raises(IndexError, match=r"dst_index\[1\] = 10 is out of range: slots are 0..9"):
        pool.copy_from(T([1, 2]), T([3, 10]))
    assert_states(pool, states, "nothing written")


def test_an_empty_copy_and_an_empty_clear_write_nothing(device):
    pool = make_pool(device)
    for t in state_tensors(pool):
        poison_(t)
    states = snapshot(pool)
    pool.copy_from(T([], device), T([], device))
    pool.clear_slots(T([], device, torch.int32))
    assert_states(pool, states, "every byte unchanged")
