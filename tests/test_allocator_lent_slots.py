"""A token allocator's ``alloc`` lends a view of its free list and launches nothing; the slots it lent
are recorded held by the next launch that happens anyway (a free's give-back kernel) or before
anything reads the books. Call by call its answers, counts and rejected frees are those of an
allocator that records each allocation at once, and so are its books whenever they are read: double
frees right after an alloc, frees of slots never handed out, snapshots taken and restored between an
alloc and the next free, free groups, compactions of the free list into a fresh buffer. Views handed
out keep their values through all of it, and writing into one changes nothing the allocator keeps.

``path``: the PyTorch path on a CPU allocator, or the bookkeeping kernels (compiled on CUDA,
interpreted on the CPU); the reference is the same allocator on the same path recording at once.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvassert import DEVICE, INTERPRETER, AllocatorLaunches, allocator_snapshot, counts_copied_back, records_at_once
from kvpool.kernels.allocator import launcher as allocator_kernels
from kvpool.pools.allocator import TokenToKVPoolAllocator
from kvpool.pools.allocator import freelist
from kvpool.pools.allocator.free_queue import PageQueue
from kvpool.pools.allocator.state import AllocatorErrors

PATHS = ["kernels"] if DEVICE == "cuda" else ["pytorch", "kernels"]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    if request.param == "kernels" and DEVICE == "cpu":
        if not INTERPRETER:
            pytest.skip("the kernels on CPU tensors need TRITON_INTERPRET=1")
        monkeypatch.setattr(allocator_kernels, "kernel_on_cpu", True)
    return request.param


def _as_on_gpu(a):
    """A CPU allocator's counts copied back rather than read, as on a GPU (no-op on a GPU)."""
    return counts_copied_back(a) if a.device.type == "cpu" else a


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


# --- what alloc and free launch -------------------------------------------------------------------


def test_alloc_launches_nothing_and_the_next_free_records_its_slots_in_its_one_launch(path, monkeypatch):
    a = _as_on_gpu(TokenToKVPoolAllocator(1024, device=DEVICE))
    a.free(a.alloc(100))  # the kernels compiled, the free list taken from and given back to
    launches = AllocatorLaunches(monkeypatch)
    if DEVICE == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        with launches:
            got = [a.alloc(64), a.alloc(1), a.alloc(0)]
        assert launches.ops == [] and launches.kernels == [], "an alloc launched something"
        launches.clear()
        with launches:
            a.free(got[0])
        if path == "kernels":
            assert launches.kernels == ["give_back"] and launches.ops == [], "a free is one launch"
        with launches:
            a.free(got[0])  # a double free right after: caught, since the slots were recorded first
    finally:
        if DEVICE == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    assert a.errors() == AllocatorErrors(rejected_frees=64, unrecorded=0)
    assert a.backup_state().owners.nonzero().flatten().tolist() == got[1].tolist()
    assert a.available_size() == 1023
    a.check_integrity()


def test_the_slots_lent_are_held_for_every_reader_of_the_books(path):
    """Every call that reads or replaces the books first records the slots lent: a snapshot, the
    integrity check, ``free_pages`` assigned, a merge, an allocation of another kind."""
    a = _as_on_gpu(TokenToKVPoolAllocator(16, device=DEVICE, need_sort=True))
    lent = a.alloc(5)
    assert a.backup_state().owners.nonzero().flatten().tolist() == lent.tolist()
    a.check_integrity()
    more = a.alloc(3)
    a.free_pages = a.free_pages  # the same list, assigned: the slots lent stay held
    a.check_integrity()
    a.free(lent[:2])
    a.merge_and_sort_free()
    again = a.alloc(2)
    a.check_integrity()
    held = set(lent[2:].tolist()) | set(more.tolist()) | set(again.tolist())
    assert set(a.backup_state().owners.nonzero().flatten().tolist()) == held
    a.restore_state(a.backup_state())
    a.check_integrity()


def test_a_large_lent_range_is_recorded_before_the_free_that_meets_it(path, monkeypatch):
    """More lent pages than the give-back kernel records itself: PyTorch operations record them first,
    and the free then sees them held."""
    monkeypatch.setattr(freelist, "MARK_MAX", 8)
    a = _as_on_gpu(TokenToKVPoolAllocator(64, device=DEVICE))
    ref = _as_on_gpu(records_at_once(TokenToKVPoolAllocator(64, device=DEVICE)))
    for alloc in (a, ref):
        got = alloc.alloc(40)
        alloc.free(torch.cat((got[:5], got[:2])))
    assert allocator_snapshot(a) == allocator_snapshot(ref)
    assert a.errors() == ref.errors() == AllocatorErrors(rejected_frees=2, unrecorded=0)


# --- views handed out keep their values ---------------------------------------------------------------


def test_views_handed_out_keep_their_values_through_compactions_and_restores(path):
    a = TokenToKVPoolAllocator(12, device=DEVICE)
    compactions = []
    compact = PageQueue.compact
    real = a._lists.queue

    def counted() -> None:
        compactions.append(1)
        compact(real)

    held: list[tuple[torch.Tensor, list[int]]] = []
    rng = random.Random(5)
    for step in range(60):
        if a._lists.queue is not real:  # a restore or merge made a new queue object: count its compactions too
            real = a._lists.queue
        real.compact = counted
        n = rng.randint(0, min(5, a.available_size()))
        state = a.backup_state() if step in (10, 50) else None
        got = a.alloc(n)
        held.append((got, got.tolist()))
        if step % 5 == 0:
            got += 100  # a caller writing into its view: nothing the allocator keeps changes
            held[-1] = (got, got.tolist())
        if state is not None:
            a.restore_state(state)  # the slots are free again; the view still says what was lent
        else:
            a.free(torch.tensor(held[-1][1], dtype=torch.int64, device=DEVICE) - (100 if step % 5 == 0 else 0))
        a.check_integrity()
    assert compactions, "the free list never moved to a fresh buffer"
    for view, values in held:
        assert view.tolist() == values


# --- lent and recorded at once, call by call ------------------------------------------------------------


class Pair:
    """The same token allocator twice: ``lazy`` lends (the default), ``eager`` records each
    allocation at once. ``call`` makes one call on both and compares what it returns and the host
    counts, without reading the books (which would record the lent slots)."""

    def __init__(self, slots: int, need_sort: bool) -> None:
        self.lazy = _as_on_gpu(TokenToKVPoolAllocator(slots, device=DEVICE, need_sort=need_sort))
        self.eager = _as_on_gpu(records_at_once(TokenToKVPoolAllocator(slots, device=DEVICE, need_sort=need_sort)))

    def call(self, what: str, fn) -> object:
        got = [_outcome(lambda: fn(a)) for a in (self.lazy, self.eager)]
        assert got[0] == got[1], f"{what}: lent {got[0]}, recorded at once {got[1]}"
        _sync()
        assert self.lazy.available_size() == self.eager.available_size(), what
        assert self.lazy.rejected_frees == self.eager.rejected_frees, what
        return got[0]

    def books(self, what: str) -> None:
        """The books of both, read (the lazy one records its lent slots first), and checked."""
        assert allocator_snapshot(self.lazy) == allocator_snapshot(self.eager), what
        assert self.lazy.errors() == self.eager.errors(), what
        self.lazy.check_integrity()


def _outcome(fn) -> object:
    out = fn()
    return out.tolist() if isinstance(out, torch.Tensor) else out


@pytest.mark.parametrize("need_sort", [False, True])
def test_lent_books_match_books_recorded_at_once_call_by_call(path, need_sort):
    steps = 40 if path == "kernels" and DEVICE == "cpu" else 120
    for seed in range(2):
        rng = random.Random(seed)
        pair = Pair(16, need_sort)
        held: list[int] = []  # by the lazy allocator's answers (the same as the eager one's)
        for step in range(steps):
            op = rng.choice(["alloc", "alloc", "free", "double free", "foreign free", "snapshot", "group", "books"])
            what = f"seed {seed} step {step}: {op}"
            on = lambda xs: torch.tensor(xs, dtype=torch.int64, device=DEVICE)  # noqa: E731
            if op == "alloc":
                n = rng.randint(0, 6)
                got = pair.call(f"{what}({n})", lambda a: a.alloc(n))
                held += got or []
            elif op == "free" and held:
                rng.shuffle(held)
                k = rng.randint(1, len(held))
                chosen, held = held[:k], held[k:]
                pair.call(f"{what}({chosen})", lambda a: a.free(on(chosen)))
            elif op == "double free":  # freed right after it was lent, then again
                n = rng.randint(1, 4)
                got = pair.call(f"{what} alloc({n})", lambda a: a.alloc(n)) or []
                again = got + got[:1]
                pair.call(f"{what}({got})", lambda a: a.free(on(got)))
                pair.call(f"{what} again({again})", lambda a: a.free(on(again)))
            elif op == "foreign free":  # never handed out, already free, slot 0, out of range
                chosen = [rng.randint(-2, 19) for _ in range(rng.randint(1, 5))]
                pair.call(f"{what}({chosen})", lambda a: a.free(on(chosen)))
            elif op == "snapshot":  # taken right after an alloc, restored before the next free
                n = rng.randint(0, 4)
                states = []
                got = pair.call(f"{what} alloc({n})", lambda a: a.alloc(n)) or []
                pair.call(f"{what} backup", lambda a: states.append(a.backup_state()))
                m = rng.randint(0, 4)
                pair.call(f"{what} alloc({m})", lambda a: a.alloc(m))
                lazy_state, eager_state = states
                pair.call(f"{what} restore", lambda a: a.restore_state(lazy_state if a is pair.lazy else eager_state))
                held += got
            elif op == "group":
                end = rng.random() < 0.5
                pair.call(f"{what} end={end}", lambda a: a.free_group_end() if end else a.free_group_begin())
            elif op == "books":
                pair.books(what)
        pair.call("end of group", lambda a: a.free_group_end())
        pair.books(f"seed {seed}: the end")
