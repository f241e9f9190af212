"""MambaPool's CPU copies: get_cpu_copy and load_cpu_copy byte for byte, SGLang's forms, and bad
copies refused before anything is written."""

from __future__ import annotations

import pytest
import torch

from kvassert import STATE_LAYERS as LAYERS
from kvassert import assert_same_bytes, assert_states, poison_, state_tensors
from kvassert import make_state_pool as make_pool
from kvassert import slots_of as T
from kvassert import state_device  # noqa: F401 (a fixture)
from kvassert import state_snapshot as snapshot
from kvpool import MambaCacheParams, MambaCpuCopy, MambaStateShape

META = torch.device("meta")
SHAPE = MambaStateShape(conv=(7, 3), temporal=(2, 3, 5))


@pytest.fixture
def device(state_device):
    return state_device


def test_cpu_copy_round_trip_is_exact(device):
    pool = make_pool(device)
    copy = pool.get_cpu_copy(T([4, 1, 9], device))
    assert isinstance(copy, MambaCpuCopy) and len(copy) == 3 and copy.layers == LAYERS
    assert copy.conv[0].shape == (3, 3, 7, 3) and copy.temporal.shape == (3, 3, 2, 3, 5)
    assert copy.temporal.device.type == "cpu" and copy.temporal.is_pinned() == (device == "cuda")
    before = snapshot(pool)
    assert_same_bytes(copy.temporal.view(torch.uint8), before[1][:, [4, 1, 9]], "get_cpu_copy")
    pool.load_cpu_copy(copy, T([2, 3, -1], device))  # the last row is padding
    for b in before:
        b[:, [2, 3]] = b[:, [4, 1]]
    assert_states(pool, before)


def test_an_empty_cpu_copy_holds_nothing_and_loads_nothing(device):
    pool = make_pool(device)
    for t in state_tensors(pool):
        poison_(t)
    states = snapshot(pool)
    empty = pool.get_cpu_copy(T([], device))
    assert len(empty) == 0 and empty.conv[0].shape == (3, 0, 7, 3) and empty.temporal.shape == (3, 0, 2, 3, 5)
    pool.load_cpu_copy(empty, T([], device))
    assert_states(pool, states, "every byte unchanged")


@pytest.mark.parametrize("bad", [[10], [-1]], ids=["past-the-end", "negative"])
def test_get_cpu_copy_checks_every_index(bad):
    pool = make_pool()
    with pytest.raises(IndexError, match=r"indices\[0\] = -?\d+ is out of range: slots are 0..9"):
        pool.get_cpu_copy(T(bad))


def _bad_copy(case: str) -> tuple[object, str]:
    pool = make_pool()
    copy = pool.get_cpu_copy(T([1, 2]))
    other = make_pool(size=4, params=MambaCacheParams(SHAPE, (1, 2))).get_cpu_copy(T([1, 2]))
    cases = {
        "type": ((copy.temporal,), "mamba_cache_cpu must be a MambaCpuCopy"),
        "layers": (other, r"must hold layers \[1, 2, 5\], got \[1, 2\]"),
        "length": (pool.get_cpu_copy(T([1])), r"mamba_cache_cpu.conv\[0\] must have shape \(3, 2, 7, 3\)"),
        "dtype": (MambaCpuCopy(copy.conv, copy.temporal.view(torch.int32), LAYERS), "mamba_cache_cpu.temporal must be torch.float32"),
        "convs": (MambaCpuCopy((), copy.temporal, LAYERS), "must hold 1 convolution states per layer, got 0"),
        "device": (MambaCpuCopy(copy.conv, copy.temporal.to(META), LAYERS), "mamba_cache_cpu.temporal must be in host memory"),
    }
    return cases[case]


@pytest.mark.parametrize("case", ["type", "layers", "length", "dtype", "convs", "device"])
def test_load_cpu_copy_rejects_a_mismatched_copy(case):
    pool = make_pool()
    bad, match = _bad_copy(case)
    before = snapshot(pool)
    with pytest.raises((TypeError, ValueError), match=match):
        pool.load_cpu_copy(bad, T([3, 4]))
    assert_states(pool, before, "nothing written")


# --- the speculative commit -------------------------------------------------------------------------


# --- SGLang's forms, and slots checked before anything is written ----------------------------------


def test_sglangs_conv_temporal_pair_and_mamba_indices(device):
    pool = make_pool(device)
    before = snapshot(pool)
    copy = pool.get_cpu_copy(mamba_indices=T([4, 1], device))
    assert_same_bytes(copy.temporal.view(torch.uint8), before[1][:, [4, 1]], "get_cpu_copy(mamba_indices=)")
    pool.load_cpu_copy((list(copy.conv), copy.temporal), mamba_indices=T([2, 3], device))
    pool.load_cpu_copy((copy.conv[0][:, :1], copy.temporal[:, :1]), T([5], device))  # a bare conv tensor
    for b in before:
        b[:, [2, 3, 5]] = b[:, [4, 1, 4]]
    assert_states(pool, before)


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda p, c: p.load_cpu_copy(MambaCpuCopy(c.conv, c.temporal.transpose(2, 3).contiguous().transpose(2, 3), LAYERS), T([3, 4])),
         ValueError, r"mamba_cache_cpu.temporal must have contiguous \[n, ...\] blocks per layer"),
        (lambda p, c: p.load_cpu_copy(MambaCpuCopy(c.conv, c.temporal[..., :4], LAYERS), T([3, 4])),
         ValueError, r"mamba_cache_cpu.temporal must have shape"),
        (lambda p, c: p.load_cpu_copy((c.temporal,), T([3, 4])), TypeError, r"a \(conv, temporal\) pair, got tuple of 1"),
        (lambda p, c: p.load_cpu_copy((c.conv, "x"), T([3, 4])), TypeError, "mamba_cache_cpu.temporal must be a torch.Tensor, got str"),
        (lambda p, c: p.load_cpu_copy((5, c.temporal), T([3, 4])), TypeError, r"mamba_cache_cpu\[0\] \(conv\) must be a tensor"),
        (lambda p, c: p.load_cpu_copy(c, T([3, 4]), mamba_indices=T([3, 4])), TypeError, "exactly one of them"),
        (lambda p, c: p.load_cpu_copy(c), TypeError, "exactly one of them"),
        (lambda p, c: p.get_cpu_copy(), TypeError, "exactly one of them"),
        (lambda p, c: p.load_cpu_copy(c, T([3, 8])), ValueError, r"indices\[1\] = 8 is not a slot handed out"),
        (lambda p, c: p.load_cpu_copy(c, mamba_indices=T([3, 8.0], dtype=torch.float32)), ValueError, "mamba_indices must be int32 or int64"),
        (lambda p, c: p.get_cpu_copy(T([8])), ValueError, r"indices\[0\] = 8 is not a slot handed out"),
        (lambda p, c: p.get_cpu_copy(mamba_indices=T([10])), IndexError, r"mamba_indices\[0\] = 10 is out of range"),
    ],
    ids=["not-contiguous", "shape", "one-tensor", "temporal-type", "conv-type", "both-indices", "no-indices",
         "get-no-indices", "load-free-slot", "mamba-indices-dtype", "get-free-slot", "get-mamba-indices-range"],  # fmt: skip
)
def test_cpu_copies_refuse_bad_copies_and_slots_naming_the_argument(call, exc, match):
    pool = make_pool(hold=False)
    pool.alloc_slots(7)
    copy = pool.get_cpu_copy(T([1, 2]))
    states = snapshot(pool)
    with pytest.raises(exc, match=match):
        call(pool, copy)
    assert_states(pool, states, "nothing written")
