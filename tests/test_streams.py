"""``kvpool.streams`` on a GPU (skipped without a CUDA device): ``OnStream`` makes a stream current and
restores the caller's (also when the block raises, and when nested), and ``StreamMark`` orders one
stream after another's work so far.
"""

from __future__ import annotations

import pytest
import torch
from kvassert import gpu

from kvpool.streams import OnStream, StreamMark


# --- kvpool.streams on a GPU: OnStream makes a stream current and restores the caller's stream (also
# when the block raises, and when nested), and StreamMark orders one stream after another's work so
# far without a host wait, each wait following the record just before it.

# About 50 ms of GPU sleep at a 2 GHz SM clock: long enough that an unordered stream would overtake it.
SLEEP_CYCLES = 100_000_000


@gpu
def test_on_stream_makes_the_stream_current_and_restores_the_callers():
    dev = torch.cuda.current_device()
    caller = torch.cuda.Stream()
    side, other = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(caller):
        with OnStream(side):
            assert torch.cuda.current_stream() == side
            with OnStream(other):
                assert torch.cuda.current_stream() == other
            assert torch.cuda.current_stream() == side
        assert torch.cuda.current_stream() == caller
        with pytest.raises(RuntimeError, match="inside"):
            with OnStream(side):
                raise RuntimeError("raised inside")
        assert torch.cuda.current_stream() == caller
        assert torch.cuda.current_device() == dev


@gpu
def test_work_queued_inside_runs_on_the_stream():
    side = torch.cuda.Stream()
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    with OnStream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        x.fill_(1.0)
    # The caller's stream did not get the sleep: it is idle while the side stream is still busy.
    assert torch.cuda.current_stream().query()
    assert not side.query()
    side.synchronize()
    assert bool((x == 1.0).all())


@gpu
def test_stream_mark_orders_the_waiter_after_the_work_so_far():
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    mark = StreamMark()
    x = torch.zeros(1 << 20, device="cuda")
    y = torch.empty_like(x)
    torch.cuda.synchronize()
    with torch.cuda.stream(first):
        torch.cuda._sleep(SLEEP_CYCLES)
        x.fill_(1.0)
    mark.order(second, first)  # no host wait: `first` is still sleeping
    assert not first.query()
    with torch.cuda.stream(second):
        y.copy_(x)
    # Recording the same event again for later work on `first` does not move the earlier wait.
    with torch.cuda.stream(first):
        torch.cuda._sleep(SLEEP_CYCLES)
        x.fill_(2.0)
    mark.order(torch.cuda.current_stream(), first)
    torch.cuda.current_stream().synchronize()
    second.synchronize()
    assert bool((y == 1.0).all()), "the copy ran before the work it was ordered after, or after later work"
    assert bool((x == 2.0).all())
