"""MambaPool's CPU copies: get_cpu_copy and load_cpu_copy byte for byte, SGLang's forms, and bad
copies refused before anything is written."""

from __future__ import annotations

import pytest
import torch

from kvassert import STATE_K as K
from kvassert import STATE_LAYERS as LAYERS
from kvassert import assert_same_bytes, assert_states, state_params, state_tensors
from kvassert import make_state_pool as make_pool
from kvassert import slots_of as T
from kvassert import state_device  # noqa: F401 (a fixture)
from kvassert import state_snapshot as snapshot
from kvpool import MambaCacheParams, MambaCpuCopy, MambaPool, MambaStateShape

META = torch.device("meta")
SHAPE = MambaStateShape(conv=(7, 3), temporal=(2, 3, 5))
PARAMS = state_params()


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
    empty = pool.get_cpu_copy(T([], device))
    assert len(empty) == 0
    pool.load_cpu_copy(empty, T([], device))


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
