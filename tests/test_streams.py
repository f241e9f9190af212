"""``kvpool.streams`` on a GPU (skipped without a CUDA device): ``OnStream`` makes a stream current and
restores the caller's (also when the block raises, and when nested), ``StreamMark`` orders one
stream after another's work so far, and ``HostIntUploads`` brings host ints to the device exactly
without waiting for it.
"""

from __future__ import annotations

import pytest
import torch
from kvassert import gpu

from kvpool.streams import HostIntUploads, OnStream, StreamMark


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


@gpu
def test_host_ints_arrive_as_written_without_a_wait_while_the_gpu_is_busy():
    """Lists copied through the staging halves arrive as written, call after call, across the halves'
    ends, while the GPU still sleeps on work queued before them (so a half is wanted again before
    its copies have run: such a list goes through pinned memory of its own, never over bytes a
    queued copy still reads), a list longer than a half among them, and on a second stream."""
    up = HostIntUploads(torch.device("cuda"), half=8)
    want, got = [], []
    side = torch.cuda.Stream()
    torch.cuda._sleep(SLEEP_CYCLES)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(40):
            values = list(range(100 * i, 100 * i + (9 if i == 17 else i % 5 + 1)))
            if i >= 30:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    got.append(up(values))
            else:
                got.append(up(values))
            want.append(values)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert [g.tolist() for g in got] == want
