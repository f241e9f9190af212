"""Bad input to the state pool and the request tables, as a matrix: every public call of MambaPool,
HybridReqToTokenPool and ReqToTokenPool with each kind of wrong argument (type, dtype, shape, device,
range, a slot or row not handed out or another's), each expecting a clear error that names the
argument, and no change to any size, list or tensor."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch

from kvassert import make_state_pool, slots_of, state_params
from kvpool import HybridReqToTokenPool, ReqToTokenPool

META = torch.device("meta")
T = slots_of

# --- MambaPool: index arguments -------------------------------------------------------------------

#: Wrong index tensors, each with the words its error must carry after the argument's name.
BAD_INDEX = {
    "float32": (lambda: torch.tensor([1.0]), ValueError, "must be int32 or int64, got torch.float32"),
    "float64": (lambda: torch.tensor([1.0], dtype=torch.float64), ValueError, "must be int32 or int64, got torch.float64"),
    "bool": (lambda: torch.tensor([True]), ValueError, "must be int32 or int64, got torch.bool"),
    "int16": (lambda: torch.tensor([1], dtype=torch.int16), ValueError, "must be int32 or int64, got torch.int16"),
    "uint8": (lambda: torch.tensor([1], dtype=torch.uint8), ValueError, "must be int32 or int64, got torch.uint8"),
    "2-d": (lambda: T([[1]]), ValueError, r"must be 1-D \[\w+\], got shape \(1, 1\)"),
    "0-d": (lambda: T(1), ValueError, r"must be 1-D \[\w+\], got shape \(\)"),
    "list": (lambda: [1], TypeError, "must be a torch.Tensor, got list"),
    "int": (lambda: 1, TypeError, "must be a torch.Tensor, got int"),
    "meta-device": (lambda: T([1]).to(META), ValueError, "must be on cpu, got meta"),
}

#: (call, position of the argument, its name, the other arguments).
INDEX_ARGS = {
    "copy_from.src_index": ("copy_from", 0, "src_index", lambda p: [T([1]), T([2])]),
    "copy_from.dst_index": ("copy_from", 1, "dst_index", lambda p: [T([1]), T([2])]),
    "clear_slots.indices": ("clear_slots", 0, "indices", lambda p: [T([1])]),
    "fork_from.src_index": ("fork_from", 0, "src_index", lambda p: [T([1])]),
    "get_cpu_copy.indices": ("get_cpu_copy", 0, "indices", lambda p: [T([1])]),
    "load_cpu_copy.indices": ("load_cpu_copy", 1, "indices", lambda p: [p.get_cpu_copy(T([1])), T([1])]),
    "commit.slots": ("commit", 0, "slots", lambda p: [T([1]), T([1]), T([2]), T([1])]),
    "commit.accepted_steps": ("commit", 1, "accepted_steps", lambda p: [T([1]), T([1]), T([2]), T([1])]),
    "commit.track_slots": ("commit", 2, "track_slots", lambda p: [T([1]), T([1]), T([2]), T([1])]),
    "commit.track_steps": ("commit", 3, "track_steps", lambda p: [T([1]), T([1]), T([2]), T([1])]),
}

INDEX_CASES = [
    pytest.param(arg, kind, id=f"{arg}-{kind}")
    for arg in INDEX_ARGS
    for kind in BAD_INDEX
    if not (arg == "fork_from.src_index" and kind == "0-d")  # covered with its own message below
]


def _pool():
    pool = make_state_pool(size=6, hold=False)
    pool.alloc_slots(4)  # slots 1..4 handed out, 5 and 6 free
    return pool


def _pool_state(pool):
    tensors = [*pool.conv, pool.temporal, *pool.intermediate_conv_window, pool.intermediate_ssm]
    return (pool.held_slots(), list(pool._slots._free), [t.view(torch.uint8).clone() for t in tensors])


def _assert_same(before, after):
    assert before[:-1] == after[:-1], "bookkeeping changed"
    assert all(torch.equal(a, b) for a, b in zip(before[-1], after[-1])), "a tensor changed"


def _refused(state, target, call, exc, match):
    before = state(target)
    with pytest.raises(exc, match=match):
        call(target)
    _assert_same(before, state(target))
    target.check_integrity()


@pytest.mark.parametrize("arg, kind", INDEX_CASES)
def test_mamba_pool_index_arguments(arg, kind):
    method, pos, name, good = INDEX_ARGS[arg]
    make, exc, words = BAD_INDEX[kind]
    if name == "src_index" and method == "fork_from" and kind == "2-d":
        words = r"must be 1-D \[1\], got shape \(1, 1\)"

    def call(pool):
        args = good(pool)
        args[pos] = make()
        getattr(pool, method)(*args)

    _refused(_pool_state, _pool(), call, exc, f"{name} {words}")


#: Index values a call refuses: (call, the error, the words naming the argument).
VALUE_CASES = {
    "copy_from-dst-past-the-end": (lambda p: p.copy_from(T([1]), T([7])), IndexError, r"dst_index\[0\] = 7 is out of range: slots are 0..6"),
    "copy_from-src-past-the-end": (lambda p: p.copy_from(T([7]), T([1])), IndexError, r"src_index\[0\] = 7 is out of range"),
    "copy_from-dst-free": (lambda p: p.copy_from(T([1]), T([5])), ValueError, r"dst_index\[0\] = 5 is not a slot handed out"),
    "copy_from-src-free": (lambda p: p.copy_from(T([1, 6]), T([2, 3])), ValueError, r"src_index\[1\] = 6 is not a slot handed out"),
    "copy_from-lengths": (lambda p: p.copy_from(T([1, 2]), T([3])), ValueError, r"src_index must have as many entries as dst_index \(1\), got 2"),
    "clear-past-the-end": (lambda p: p.clear_slots(T([2, 9])), IndexError, r"indices\[1\] = 9 is out of range"),
    "clear-free": (lambda p: p.clear_slots(T([6])), ValueError, r"indices\[0\] = 6 is not a slot handed out"),
    "fork-slot-0": (lambda p: p.fork_from(T([0])), ValueError, r"src_index\[0\] is slot 0"),
    "fork-free": (lambda p: p.fork_from(T([5])), ValueError, r"src_index\[0\] = 5 is not a slot handed out"),
    "fork-past-the-end": (lambda p: p.fork_from(T([7])), IndexError, r"src_index\[0\] = 7 is out of range"),
    "fork-negative": (lambda p: p.fork_from(T([-1])), IndexError, r"src_index\[0\] = -1 is out of range"),
    "fork-0-d": (lambda p: p.fork_from(T(1)), ValueError, r"src_index must be 1-D \[1\], got shape \(\)"),
    "fork-two": (lambda p: p.fork_from(T([1, 2])), ValueError, r"src_index must have 1 entries"),
    "get_cpu_copy-negative": (lambda p: p.get_cpu_copy(T([-1])), IndexError, r"indices\[0\] = -1 is out of range"),
    "get_cpu_copy-past-the-end": (lambda p: p.get_cpu_copy(T([7])), IndexError, r"indices\[0\] = 7 is out of range"),
    "get_cpu_copy-free": (lambda p: p.get_cpu_copy(T([1, 5])), ValueError, r"indices\[1\] = 5 is not a slot handed out"),
    "get_cpu_copy-mamba_indices-free": (lambda p: p.get_cpu_copy(mamba_indices=T([5])), ValueError, r"mamba_indices\[0\] = 5"),
    "get_cpu_copy-both": (lambda p: p.get_cpu_copy(T([1]), mamba_indices=T([1])), TypeError, "indices or as mamba_indices"),
    "load-past-the-end": (lambda p: p.load_cpu_copy(p.get_cpu_copy(T([1])), T([7])), IndexError, r"indices\[0\] = 7 is out of range"),
    "load-free": (lambda p: p.load_cpu_copy(p.get_cpu_copy(T([1])), T([6])), ValueError, r"indices\[0\] = 6 is not a slot handed out"),
    "load-length": (lambda p: p.load_cpu_copy(p.get_cpu_copy(T([1])), T([1, 2])), ValueError, r"mamba_cache_cpu.conv\[0\] must have shape"),
    "load-neither": (lambda p: p.load_cpu_copy(p.get_cpu_copy(T([1]))), TypeError, "indices or as mamba_indices"),
    "load-not-a-copy": (lambda p: p.load_cpu_copy(torch.zeros(3), T([1])), TypeError, "mamba_cache_cpu must be a MambaCpuCopy"),
    "load-three-tensors": (lambda p: p.load_cpu_copy((torch.zeros(1),) * 3, T([1])), TypeError, "mamba_cache_cpu must be a MambaCpuCopy"),
    "load-pair-wrong-dtype": (lambda p: p.load_cpu_copy((p.get_cpu_copy(T([1])).conv, p.get_cpu_copy(T([1])).temporal.double()), T([1])),
                              ValueError, "mamba_cache_cpu.temporal must be torch.float32, got torch.float64"),
    "load-pair-conv-count": (lambda p: p.load_cpu_copy(([], p.get_cpu_copy(T([1])).temporal), T([1])), ValueError,
                             "mamba_cache_cpu must hold 1 convolution states per layer, got 0"),
    "commit-steps-past-K": (lambda p: p.commit(T([1]), T([4])), ValueError, r"accepted_steps\[0\] = 4 must be a step count in 0..3"),
    "commit-steps-negative": (lambda p: p.commit(T([1, 2]), T([0, -1])), ValueError, r"accepted_steps\[1\] = -1 must be a step count"),
    "commit-track-steps-past-K": (lambda p: p.commit(T([1]), T([1]), T([2]), T([9])), ValueError, r"track_steps\[0\] = 9"),
    "commit-slot-past-the-end": (lambda p: p.commit(T([7]), T([1])), IndexError, r"slots\[0\] = 7 is out of range"),
    "commit-slot-free": (lambda p: p.commit(T([5]), T([1])), ValueError, r"slots\[0\] = 5 is not a slot handed out"),
    "commit-track-free": (lambda p: p.commit(T([1]), T([1]), T([6]), T([1])), ValueError, r"track_slots\[0\] = 6 is not a slot handed out"),
    "commit-track-alone": (lambda p: p.commit(T([1]), T([1]), T([2])), ValueError, "track_slots and track_steps must be given together"),
    "commit-too-many": (lambda p: p.commit(T([1] * 6), T([0] * 6)), ValueError, r"slots must have at most spec_state_size \+ 1 = 5"),
    "commit-lengths": (lambda p: p.commit(T([1, 2]), T([1])), ValueError, r"accepted_steps must have as many entries as slots"),
    "free-slot-0": (lambda p: p.free([0]), ValueError, r"free_index\[0\] is slot 0"),
    "free-free": (lambda p: p.free([1, 5]), ValueError, r"free_index\[1\] = 5 is not handed out"),
    "free-twice": (lambda p: p.free([2, 2]), ValueError, r"free_index\[1\] = 2 is listed twice"),
    "free-past-the-end": (lambda p: p.free(T([7])), ValueError, r"free_index\[0\] = 7 is out of range"),
    "free-float": (lambda p: p.free(torch.tensor([1.0])), ValueError, "free_index must be an integer tensor"),
    "free-bool": (lambda p: p.free(True), ValueError, "free_index must be an int"),
    "free-str": (lambda p: p.free("1"), ValueError, "free_index must be an int"),
    "alloc-negative": (lambda p: p.alloc(-1), ValueError, "need_size must be a non-negative int, got -1"),
    "alloc-float": (lambda p: p.alloc(1.5), ValueError, "need_size must be a non-negative int, got 1.5"),
    "alloc-bool": (lambda p: p.alloc(True), ValueError, "need_size must be a non-negative int, got True"),
    "alloc-none": (lambda p: p.alloc(None), ValueError, "need_size must be a non-negative int, got None"),
    "alloc_slots-str": (lambda p: p.alloc_slots("2"), ValueError, "need_size must be a non-negative int"),
    "layer-id-str": (lambda p: p.get_ssm_state("1"), TypeError, "layer_id must be an int, got str"),
    "layer-id-full-attention": (lambda p: p.get_conv_state(3), ValueError, "layer_id 3 is not a linear-attention layer"),
    "mamba2_layer_cache-past-the-end": (lambda p: p.mamba2_layer_cache(3), IndexError, "layer_idx must be a dense index in 0..2"),
}


@pytest.mark.parametrize("case", list(VALUE_CASES))
def test_mamba_pool_values(case):
    call, exc, match = VALUE_CASES[case]
    _refused(_pool_state, _pool(), call, exc, match)


# --- HybridReqToTokenPool -------------------------------------------------------------------------


def _table():
    t = HybridReqToTokenPool(size=4, mamba_size=10, max_context_len=6, device="cpu", cache_params=state_params(layers=(0, 2)),
                             enable_mamba_extra_buffer=True)  # fmt: skip
    reqs = [SimpleNamespace(req_pool_idx=None, mamba_pool_idx=None, mamba_ping_pong_track_buffer=None) for _ in range(2)]
    t.alloc(reqs)  # rows 0 and 1; state slots 1 and 4, track slots (2, 3) and (5, 6)
    t.reqs = reqs
    return t


def _table_state(t):
    tensors = [t.req_to_token, t.req_index_to_mamba_index_mapping, t.req_index_to_mamba_ping_pong_track_buffer_mapping,
               *t.mamba_pool.conv, t.mamba_pool.temporal]  # fmt: skip
    return (list(t.free_slots), t.mamba_pool.held_slots(), list(t.mamba_pool._slots._free),
            [(t.mamba_slot(r), t.track_slots(r)) for r in range(t.size)],
            [(r.req_pool_idx, r.mamba_pool_idx if r.mamba_pool_idx is None else int(r.mamba_pool_idx)) for r in t.reqs],
            dict(t._owner), [id(r) for r in t._row_req],  # which row holds each slot, which request each row
            [x.view(torch.uint8).clone() for x in tensors])  # fmt: skip


@dataclass(frozen=True)
class Frozen:
    """A request that refuses every attribute assignment."""

    req_pool_idx: Optional[int] = None


@dataclass(frozen=True)
class FrozenHybrid:
    req_pool_idx: Optional[int] = None
    mamba_pool_idx: Any = None
    mamba_ping_pong_track_buffer: Any = None


class Slotted:
    """A request with a row attribute only (``__slots__``): it cannot take a state slot."""

    __slots__ = ("req_pool_idx",)

    def __init__(self):
        self.req_pool_idx = None


def R(**attrs):
    """A request as SGLang's scheduler keeps it."""
    return SimpleNamespace(**{"req_pool_idx": None, "mamba_pool_idx": None, "mamba_ping_pong_track_buffer": None, **attrs})


HYBRID_CASES = {
    "alloc-negative": (lambda t: t.alloc(-1), ValueError, "need_size must be a non-negative int, got -1"),
    "alloc-float": (lambda t: t.alloc(1.5), ValueError, "need_size must be a non-negative int or a list of requests, got 1.5"),
    "alloc-none": (lambda t: t.alloc(None), ValueError, "need_size must be a non-negative int or a list of requests, got None"),
    "alloc-bool": (lambda t: t.alloc(True), ValueError, "need_size must be .* got True"),
    "alloc-str": (lambda t: t.alloc("ab"), ValueError, "need_size must be .* got 'ab'"),
    "alloc-tensor": (lambda t: t.alloc(torch.tensor(2)), ValueError, "need_size must be .* got tensor"),
    "alloc-an-int-request": (lambda t: t.alloc([R(), 2]), ValueError, r"reqs\[1\] must be a request object"),
    "alloc-none-request": (lambda t: t.alloc([None]), ValueError, r"reqs\[0\] must be a request object"),
    "alloc-row-free": (lambda t: t.alloc([R(req_pool_idx=3)]), ValueError, r"reqs\[0\].req_pool_idx = 3 is not a row handed out"),
    "alloc-row-past-the-end": (lambda t: t.alloc([R(req_pool_idx=4)]), ValueError, r"reqs\[0\].req_pool_idx = 4 is not a row"),
    "alloc-row-negative": (lambda t: t.alloc([R(req_pool_idx=-1)]), ValueError, r"reqs\[0\].req_pool_idx = -1 is not a row"),
    "alloc-row-float": (lambda t: t.alloc([R(req_pool_idx=0.0)]), ValueError, r"reqs\[0\].req_pool_idx = 0.0 is not a row"),
    "alloc-row-bool": (lambda t: t.alloc([R(req_pool_idx=False)]), ValueError, r"reqs\[0\].req_pool_idx = False is not a row"),
    "alloc-row-twice": (lambda t: t.alloc([R(req_pool_idx=0), R(req_pool_idx=0)]), ValueError, r"reqs\[1\].req_pool_idx = 0 is kept by reqs\[0\]"),
    "alloc-slot-never-handed-out": (lambda t: t.alloc([R(mamba_pool_idx=9)]), ValueError, r"reqs\[0\].mamba_pool_idx = 9 is not a state slot handed out"),
    "alloc-slot-0": (lambda t: t.alloc([R(mamba_pool_idx=0)]), ValueError, r"reqs\[0\].mamba_pool_idx = 0 is not a state slot"),
    "alloc-slot-of-a-running-row": (lambda t: t.alloc([R(mamba_pool_idx=4)]), ValueError, r"reqs\[0\].mamba_pool_idx holds slot 4, a state slot of running row 1"),
    "alloc-slot-not-the-rows": (lambda t: t.alloc([R(req_pool_idx=0, mamba_pool_idx=4)]), ValueError, r"reqs\[0\].mamba_pool_idx = 4, but its row 0 holds state slot 1"),
    "alloc-slot-float": (lambda t: t.alloc([R(mamba_pool_idx=torch.tensor(1.0))]), ValueError, r"reqs\[0\].mamba_pool_idx must be an integer tensor"),
    "alloc-slot-two": (lambda t: t.alloc([R(mamba_pool_idx=torch.tensor([1, 4]))]), ValueError, r"reqs\[0\].mamba_pool_idx must hold one slot"),
    "alloc-slot-str": (lambda t: t.alloc([R(mamba_pool_idx="1")]), ValueError, r"reqs\[0\].mamba_pool_idx must be an int or a one-entry"),
    "alloc-track-never-handed-out": (lambda t: t.alloc([R(mamba_ping_pong_track_buffer=T([8, 9]))]), ValueError,
                                     r"reqs\[0\].mamba_ping_pong_track_buffer\[0\] = 8 is not a state slot handed out"),
    "alloc-track-of-a-running-row": (lambda t: t.alloc([R(mamba_ping_pong_track_buffer=T([5, 6]))]), ValueError,
                                     r"reqs\[0\].mamba_ping_pong_track_buffer holds slot 5, a state slot of running row 1"),
    "alloc-track-length": (lambda t: t.alloc([R(mamba_ping_pong_track_buffer=T([2]))]), ValueError,
                           r"reqs\[0\].mamba_ping_pong_track_buffer must hold 2 track slots"),
    "alloc-track-not-the-rows": (lambda t: t.alloc([R(req_pool_idx=0, mamba_ping_pong_track_buffer=T([5, 6]))]), ValueError,
                                 r"reqs\[0\].mamba_ping_pong_track_buffer = \[5, 6\], but its row 0 holds track slots \[2, 3\]"),
    "alloc-track-float": (lambda t: t.alloc([R(mamba_ping_pong_track_buffer=torch.tensor([1.0, 2.0]))]), ValueError,
                          r"reqs\[0\].mamba_ping_pong_track_buffer must be an integer tensor"),
    "alloc-same-request-twice": (lambda t: t.alloc([R()] * 2), ValueError, r"reqs\[1\] is the same request object as reqs\[0\]"),
    "alloc-same-running-request-twice": (lambda t: t.alloc([t.reqs[0], t.reqs[1], t.reqs[0]]), ValueError,
                                         r"reqs\[2\] is the same request object as reqs\[0\]"),
    "alloc-frozen-request": (lambda t: t.alloc([Frozen()]), ValueError,
                             r"reqs\[0\] must accept assignment of req_pool_idx \(alloc sets it\), got FrozenInstanceError"),
    "alloc-frozen-running-request": (lambda t: t.alloc([FrozenHybrid(req_pool_idx=1, mamba_pool_idx=torch.tensor(4))]),
                                     ValueError, r"reqs\[0\] must accept assignment of req_pool_idx"),
    "alloc-slotted-request": (lambda t: t.alloc([R(), Slotted()]), ValueError,
                              r"reqs\[1\] must accept assignment of mamba_pool_idx .* got AttributeError"),
    "alloc-one-slot-two-requests": (lambda t: t.alloc([R(req_pool_idx=0), R(mamba_pool_idx=1)]), ValueError,
                                    r"reqs\[1\].mamba_pool_idx holds slot 1, a state slot of running row 0"),
    "free-free-row": (lambda t: t.free(3), ValueError, "free_index must hold rows that are handed out"),
    "free-past-the-end": (lambda t: t.free(4), ValueError, r"free_index must hold rows in 0..3, got 4"),
    "free-twice": (lambda t: t.free([0, 0]), ValueError, "free_index must hold rows that are handed out, once each"),
    "free-float": (lambda t: t.free(0.0), ValueError, "free_index must be an int, a sequence of ints, an integer tensor or a request"),
    "free-request-without-row": (lambda t: t.free(R()), ValueError, "free: the request has no req_pool_idx"),
    "free-frozen-request": (lambda t: t.free(FrozenHybrid(req_pool_idx=0)), ValueError,
                            r"req must accept assignment of req_pool_idx \(free sets it\), got FrozenInstanceError"),
    "free-stale-request": (lambda t: t.free(R(req_pool_idx=0)), ValueError, r"req.req_pool_idx = 0 is the row of another request"),
    "free_mamba_cache-frozen-request": (lambda t: t.free_mamba_cache(FrozenHybrid(req_pool_idx=0, mamba_pool_idx=1)), ValueError,
                                        r"req must accept assignment of mamba_pool_idx \(free_mamba_cache sets it\)"),
    "free_mamba_cache-free-row": (lambda t: t.free_mamba_cache(3), ValueError, "req must be a row that holds a state, got row 3"),
    "free_mamba_cache-row-past-the-end": (lambda t: t.free_mamba_cache(4), ValueError, "req must be a row that holds a state, got row 4"),
    "free_mamba_cache-row-negative": (lambda t: t.free_mamba_cache(-1), ValueError, "req must be a row that holds a state, got row -1"),
    "free_mamba_cache-bool": (lambda t: t.free_mamba_cache(True), ValueError, r"req must be a row \(an int\) or a request, got True"),
    "free_mamba_cache-request-without-state": (lambda t: t.free_mamba_cache(R()), ValueError, "the request has no mamba_pool_idx"),
    "free_mamba_cache-request-another-rows-slot": (lambda t: t.free_mamba_cache(R(req_pool_idx=0, mamba_pool_idx=4)), ValueError,
                                                    r"req.mamba_pool_idx = 4 is the state slot of row 1"),
    "free_mamba_cache-request-a-track-slot": (lambda t: t.free_mamba_cache(R(mamba_pool_idx=2)), ValueError,
                                               r"req.mamba_pool_idx = 2 is a track slot of row 0"),
    "free_mamba_cache-request-free-slot": (lambda t: t.free_mamba_cache(R(mamba_pool_idx=9)), ValueError,
                                           r"req's state slot 9 is not handed out"),
    "free_mamba_cache-keep-bool": (lambda t: t.free_mamba_cache(0, True), ValueError,
                                   r"mamba_ping_pong_track_buffer_to_keep must be an int in 0..1 or None, got True"),
    "free_mamba_cache-keep-2": (lambda t: t.free_mamba_cache(0, 2), ValueError, r"mamba_ping_pong_track_buffer_to_keep must be an int in 0..1"),
    "free_mamba_cache-keep-negative": (lambda t: t.free_mamba_cache(0, -1), ValueError, r"mamba_ping_pong_track_buffer_to_keep .* got -1"),
    "free_mamba_cache-keep-float": (lambda t: t.free_mamba_cache(0, 0.0), ValueError, r"mamba_ping_pong_track_buffer_to_keep .* got 0.0"),
    "other-idx-5": (lambda t: t.get_mamba_ping_pong_other_idx(5), ValueError, r"mamba_next_track_idx must be an int in 0..1, got 5"),
    "other-idx-negative": (lambda t: t.get_mamba_ping_pong_other_idx(-1), ValueError, r"mamba_next_track_idx .* got -1"),
    "other-idx-bool": (lambda t: t.get_mamba_ping_pong_other_idx(True), ValueError, r"mamba_next_track_idx .* got True"),
    "other-idx-none": (lambda t: t.get_mamba_ping_pong_other_idx(None), ValueError, r"mamba_next_track_idx .* got None"),
    "mamba_slot-negative": (lambda t: t.mamba_slot(-1), IndexError, r"row must be in 0..3, got -1"),
    "mamba_slot-past-the-end": (lambda t: t.mamba_slot(4), IndexError, r"row must be in 0..3, got 4"),
    "mamba_slot-bool": (lambda t: t.mamba_slot(True), ValueError, r"row must be an int, got True"),
    "track_slots-negative": (lambda t: t.track_slots(-1), IndexError, r"row must be in 0..3, got -1"),
    "track_slots-tensor": (lambda t: t.track_slots(torch.tensor(0)), ValueError, r"row must be an int"),
    "mamba2_layer_cache-not-linear": (lambda t: t.mamba2_layer_cache(1), ValueError, "layer_id 1 is not a linear-attention layer"),
    "write-floats": (lambda t: t.write((0, slice(0, 2)), torch.tensor([1.0, 2.0])), ValueError, r"values must be int32 or int64"),
}


@pytest.mark.parametrize("case", list(HYBRID_CASES))
def test_hybrid_request_table(case):
    call, exc, match = HYBRID_CASES[case]
    _refused(_table_state, _table(), call, exc, match)


def test_hybrid_one_freed_rows_slot_named_by_two_requests():
    t = _table()
    t.free(0)  # by row number: the state stays attached to freed row 0, which either request may carry on
    _refused(_table_state, t, lambda t: t.alloc([R(mamba_pool_idx=1), R(mamba_pool_idx=1)]), ValueError,
             r"reqs\[1\] names state slot 1, which reqs\[0\] holds too")


# --- ReqToTokenPool -------------------------------------------------------------------------------


def _rtt():
    t = ReqToTokenPool(4, 6, "cpu")
    t.alloc(2)
    t.req_to_token.copy_(torch.arange(24, dtype=torch.int32).view(4, 6))
    return t


def _rtt_state(t):
    return (list(t.free_slots), list(t._is_free), [t.req_to_token.clone()])


I32 = torch.int32
RTT_CASES = {
    "alloc-negative": (lambda t: t.alloc(-1), ValueError, "need_size must be a non-negative int or a list of requests, got -1"),
    "alloc-float": (lambda t: t.alloc(1.5), ValueError, "need_size must be .* got 1.5"),
    "alloc-bool": (lambda t: t.alloc(True), ValueError, "need_size must be .* got True"),
    "alloc-none": (lambda t: t.alloc(None), ValueError, "need_size must be .* got None"),
    "alloc-an-int-request": (lambda t: t.alloc([SimpleNamespace(req_pool_idx=None), 1]), ValueError, r"reqs\[1\] must be a request object"),
    "alloc-row-free": (lambda t: t.alloc([SimpleNamespace(req_pool_idx=2)]), ValueError, r"reqs\[0\].req_pool_idx = 2 is not a row handed out"),
    "alloc-row-twice": (lambda t: t.alloc([SimpleNamespace(req_pool_idx=1), SimpleNamespace(req_pool_idx=1)]), ValueError,
                        r"reqs\[1\].req_pool_idx = 1 is kept by reqs\[0\]"),
    "alloc-same-request-twice": (lambda t: t.alloc([SimpleNamespace(req_pool_idx=None)] * 2), ValueError,
                                 r"reqs\[1\] is the same request object as reqs\[0\]"),
    "alloc-same-kept-request-twice": (lambda t: t.alloc([SimpleNamespace(req_pool_idx=1)] * 2), ValueError,
                                      r"reqs\[1\] is the same request object as reqs\[0\]"),
    "alloc-frozen-request": (lambda t: t.alloc([SimpleNamespace(req_pool_idx=None), Frozen()]), ValueError,
                             r"reqs\[1\] must accept assignment of req_pool_idx \(alloc sets it\), got FrozenInstanceError"),
    "alloc-row-bool": (lambda t: t.alloc([SimpleNamespace(req_pool_idx=True)]), ValueError, r"reqs\[0\].req_pool_idx = True is not a row"),
    "free-request-without-row": (lambda t: t.free(SimpleNamespace(req_pool_idx=None)), ValueError, "the request has no req_pool_idx"),
    "free-frozen-request": (lambda t: t.free(Frozen(req_pool_idx=0)), ValueError,
                            r"req must accept assignment of req_pool_idx \(free sets it\), got FrozenInstanceError"),
    "free-request-free-row": (lambda t: t.free(SimpleNamespace(req_pool_idx=3)), ValueError, "free_index must hold rows that are handed out"),
    "free-free-row": (lambda t: t.free(3), ValueError, "free_index must hold rows that are handed out"),
    "free-past-the-end": (lambda t: t.free([0, 4]), ValueError, r"free_index must hold rows in 0..3, got 4 at position 1"),
    "free-negative": (lambda t: t.free(-1), ValueError, r"free_index must hold rows in 0..3, got -1"),
    "free-twice": (lambda t: t.free([1, 1]), ValueError, "which is listed twice"),
    "free-float": (lambda t: t.free(1.0), ValueError, "free_index must be an int or a sequence of ints, got 1.0"),
    "free-float-tensor": (lambda t: t.free(torch.tensor([0.0])), ValueError, "free_index must be an integer tensor"),
    "free-2-d": (lambda t: t.free(torch.tensor([[0]])), ValueError, r"free_index must be 0-D or 1-D"),
    "write-values-float32": (lambda t: t.write((0, slice(0, 2)), torch.tensor([1.5, 2.0])), ValueError, "values must be int32 or int64 \\(slots\\), got torch.float32"),
    "write-values-float64": (lambda t: t.write(0, torch.zeros(6, dtype=torch.float64)), ValueError, "values must be int32 or int64 .* got torch.float64"),
    "write-values-bool": (lambda t: t.write(0, torch.ones(6, dtype=torch.bool)), ValueError, "values must be int32 or int64 .* got torch.bool"),
    "write-values-uint8": (lambda t: t.write(0, torch.ones(6, dtype=torch.uint8)), ValueError, "values must be int32 or int64 .* got torch.uint8"),
    "write-values-int16": (lambda t: t.write(0, torch.ones(6, dtype=torch.int16)), ValueError, "values must be int32 or int64 .* got torch.int16"),
    "write-values-python-float": (lambda t: t.write((0, 0), 1.5), ValueError, "values must be an int or an int32/int64 tensor, got float"),
    "write-values-list": (lambda t: t.write((0, slice(0, 2)), [1, 2]), ValueError, "values must be an int or an int32/int64 tensor, got list"),
    "write-values-none": (lambda t: t.write((0, 0), None), ValueError, "values must be an int or an int32/int64 tensor, got NoneType"),
    "write-values-past-int32": (lambda t: t.write((0, 0), torch.tensor([2**31])), ValueError, "values must fit int32 .* got 2147483648"),
    "write-values-below-int32": (lambda t: t.write((0, 0), -(2**31) - 1), ValueError, "values must fit int32 .* got -2147483649"),
    "write-row-past-the-end": (lambda t: t.write((4, 0), torch.tensor(1, dtype=I32)), IndexError, r"indices\[0\] = 4 is out of range: rows are 0..3"),
    "write-row-too-negative": (lambda t: t.write((-5, 0), torch.tensor(1, dtype=I32)), IndexError, r"indices\[0\] = -5 is out of range"),
    "write-column-past-the-end": (lambda t: t.write((0, 6), torch.tensor(1, dtype=I32)), IndexError, r"indices\[1\] = 6 is out of range: columns are 0..5"),
    "write-rows-tensor": (lambda t: t.write(torch.tensor([0, 9]), torch.tensor(1, dtype=I32)), IndexError, r"indices\[1\] = 9 is out of range"),
    "write-columns-list": (lambda t: t.write((1, [0, 7]), torch.tensor([1, 2], dtype=I32)), IndexError, r"indices\[1\]\[1\] = 7 is out of range"),
}


@pytest.mark.parametrize("case", list(RTT_CASES))
def test_req_to_token_pool(case):
    call, exc, match = RTT_CASES[case]
    _refused(_rtt_state, _rtt(), call, exc, match)


def test_the_matrix_is_large():
    assert len(INDEX_CASES) + len(VALUE_CASES) + len(HYBRID_CASES) + len(RTT_CASES) >= 120
