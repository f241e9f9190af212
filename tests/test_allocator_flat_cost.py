"""The allocators' calls cost what the request moves, not what the pool holds: every tensor op that
``alloc``, ``free``, ``alloc_extend``, ``alloc_decode`` and the free-group calls run, and the size of
every tensor it makes, is the same on a pool of 4k slots as on one of 1M. An op over the whole free
list (a concatenation, a copy, a sort) would make a tensor the size of the pool and differ.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from kvassert import dec, ext
from kvpool.pools.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator

SMALL, LARGE = 1 << 12, 1 << 20
IN_PLACE_OPERATORS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__ifloordiv__", "__iand__", "__ior__"}


class OpRecorder(TorchFunctionMode):
    """Records each torch function called and the element counts of the tensors it returns (in-place
    ops, which return their argument, as such)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, object]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", repr(func))
        in_place = name.endswith("_") and not name.endswith("__")
        if in_place or name in IN_PLACE_OPERATORS or (args and out is args[0]):
            self.ops.append((name, "in place"))
        else:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            self.ops.append((name, tuple(t.numel() for t in outs if isinstance(t, torch.Tensor))))
        return out


def recorded(call) -> list[tuple[str, object]]:
    with OpRecorder() as rec:
        call()
    return rec.ops


def steady_token(size: int, deferred: bool) -> TokenToKVPoolAllocator:
    """A token allocator that has handed out and taken back slots before (its free list wrapped)."""
    a = TokenToKVPoolAllocator(size)
    a._lists.eager = not deferred  # as on a GPU: counts copied back, not read
    for _ in range(3):
        a.free(a.alloc(size // 2 + 64))
    return a


@pytest.mark.parametrize("deferred", [False, True], ids=["counts-read", "counts-copied-back"])
def test_token_alloc_and_free_run_the_same_ops_on_any_pool_size(deferred):
    def calls(size):
        a = steady_token(size, deferred)
        held = []
        ops = recorded(lambda: held.append(a.alloc(64)))
        ops += recorded(lambda: a.free(held[0]))
        ops += recorded(lambda: a.free(held[0]))  # a double free: dropped, same cost
        a.free_group_begin()
        got = a.alloc(64)
        ops += recorded(lambda: (a.free(got[:32]), a.free(got[32:]), a.free_group_end()))
        return ops

    small, large = calls(SMALL), calls(LARGE)
    assert small == large
    biggest = max((n for _, sizes in small if isinstance(sizes, tuple) for n in sizes), default=0)
    assert biggest < SMALL // 8, f"an op made a tensor of {biggest} elements from a 64-slot request"


@pytest.mark.parametrize("deferred", [False, True], ids=["counts-read", "counts-copied-back"])
def test_paged_extend_decode_and_free_run_the_same_ops_on_any_pool_size(deferred):
    def calls(size):
        a = PagedTokenToKVPoolAllocator(size, 16)
        a._lists.eager = not deferred
        a._cheap_device_checks = False  # as on a GPU: device arguments are not read
        for _ in range(3):
            a.free(a.alloc(size // 2))
        out = []
        ops = recorded(lambda: out.append(ext(a, [0, 0], [40, 300], [-1, -1])))
        slots = out[0].tolist()
        ops += recorded(lambda: out.append(dec(a, [41, 301], [slots[39], slots[-1]])))
        ops += recorded(lambda: a.free(torch.cat((out[0][:40], out[1][:1]))))
        ops += recorded(lambda: a.free(torch.cat((out[0][40:], out[1][1:]))))
        return ops

    small, large = calls(SMALL), calls(LARGE)
    assert small == large
    biggest = max((n for _, sizes in small if isinstance(sizes, tuple) for n in sizes), default=0)
    assert biggest < SMALL // 8
