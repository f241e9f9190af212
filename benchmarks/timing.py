"""The benchmarks' timers and the ceilings they share: CUDA-graph replays, cold L2, wall time.

* ``graph_us(fn, calls, flush)`` captures ``calls`` invocations ``fn(i)`` in one CUDA graph and
  returns the median replay time per call, so host launch cost never leaks into device time. With
  ``flush`` (a buffer larger than L2) every call is preceded by a memset of it and a flush-only
  graph's time is subtracted: the call runs with a cold L2, as a layer's write does in a forward pass.
* ``event_ms(fn, reps, streams, hold_cycles)``: the device time of what ``fn()`` queues on several
  streams, optionally with the GPU held while the host queues it (device time alone).
* ``wall_ms(fn, reps)``: from the call to the completion of everything it queued (host included).
* ``GpuClock`` bundles the write benchmarks' three measurements (cold device time, per call in a
  graph, eager wall time) and the 2 GiB device-copy ceiling; ``same_bytes_copy_gbps`` is the copy
  kernel moving a write's bytes, timed like the write. ``DryClock`` has ``GpuClock``'s interface on
  the CPU (every function runs, no figure means anything), so a smoke run exercises every code
  path but the timing.

Every timer takes medians and never times the first call.
"""

from __future__ import annotations

import statistics
import time
import warnings

import torch

L2_FLUSH_BYTES = 96 << 20  # larger than the L2 of the GPUs kvpool targets


def flush_buffer() -> torch.Tensor:
    return torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")


def _capture(body) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # first runs outside capture: lazy allocations, compilation
        body()
        body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph


def _replay_ms(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_us(fn, calls: int, flush: torch.Tensor | None = None, reps: int = 25) -> float:
    """Median device microseconds per ``fn(i)`` inside a replayed CUDA graph of ``calls`` calls."""

    def body():
        for i in range(calls):
            if flush is not None:
                flush.zero_()
            fn(i)

    total = _replay_ms(_capture(body), reps)
    if flush is not None:

        def flush_only():
            for _ in range(calls):
                flush.zero_()

        total -= _replay_ms(_capture(flush_only), reps)
    return total * 1e3 / calls


def event_ms(fn, reps: int, streams=(), hold_cycles: int = 0) -> float:
    """Median milliseconds of the device work ``fn()`` queues, from a start event on the current
    stream until the current stream and every stream in ``streams`` (made to wait for the start) are
    through it; one untimed call first. The host's enqueue time counts only where the device waits
    for it; ``hold_cycles`` > 0 keeps the GPU in a sleep kernel that long before the start event, so
    the host can queue all of ``fn``'s work first and only device time counts."""
    cur = torch.cuda.current_stream()
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if hold_cycles:
            torch.cuda._sleep(hold_cycles)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(cur)
        for s in streams:
            s.wait_stream(cur)
        fn()
        if hold_cycles and start.query():  # the sleep ended before the host had queued fn's work
            warnings.warn(f"event_ms: hold_cycles={hold_cycles} was shorter than the host's enqueue time; "
                          "this repetition counts host time too", stacklevel=2)
        for s in streams:
            cur.wait_stream(s)
        end.record(cur)
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def wall_ms(fn, reps: int, warmup: int = 1) -> float:
    """Median milliseconds from the call to the completion of everything it queued (host included);
    CPU work is timed as it runs."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def same_bytes_copy_gbps(clock, nbytes: int, device, calls: int = 10) -> float:
    """A copy kernel moving a write's bytes (half read, half written), timed like the writes
    (``clock.device_us``, L2 flushed): what any kernel of that size can reach."""
    n = max(1, nbytes // 8)
    src = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device=device)
    dst = torch.empty_like(src)
    us = clock.device_us(lambda i: torch.bitwise_not(src, out=dst), calls, cold=True)
    return 8 * n / (us * 1e-6) / 1e9


class GpuClock:
    """The measurements of the benchmarks, on the current CUDA device. Medians throughout."""

    dry = False

    def __init__(self) -> None:
        self.flush = flush_buffer()

    def sync(self) -> None:
        torch.cuda.synchronize()

    def device_us(self, fn, calls: int, cold: bool) -> float:
        """Device microseconds per ``fn(i)``, replayed in a CUDA graph of ``calls`` calls; ``cold``:
        L2 flushed before each call (flush time subtracted)."""
        return graph_us(fn, calls, self.flush if cold else None)

    def wall_us(self, fn, calls: int, runs: int, warm: int = 10) -> float:
        """Host-inclusive microseconds per ``fn(i)`` issued eagerly back to back: the median over
        ``runs`` runs of ``calls`` calls, each run ended by a synchronisation (what an eager decode
        pays, host launch cost included)."""
        for i in range(warm):
            fn(i)
        torch.cuda.synchronize()
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            for i in range(calls):
                fn(i)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) / calls * 1e6)
        return statistics.median(times)

    def copy_ceiling_gbps(self) -> float:
        """The device-to-device copy ceiling: a 2 GiB ``copy_`` timed eagerly with CUDA events (read +
        write counted). Eager on purpose: inside a CUDA graph a D2D memcpy becomes a memcpy node, which
        can run markedly slower than the eager copy."""
        n = 2 << 30
        src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(12):
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        del src, dst
        return 2 * n / (statistics.median(times[2:]) * 1e-3) / 1e9


class DryClock:
    """``GpuClock``'s interface on the CPU for smoke runs: every function runs once, every
    figure returned is a host wall time that means nothing."""

    dry = True

    def sync(self) -> None:
        pass

    def device_us(self, fn, calls: int, cold: bool) -> float:
        return self._run(fn, 1)

    def wall_us(self, fn, calls: int, runs: int, warm: int = 10) -> float:
        return self._run(fn, 1)

    def copy_ceiling_gbps(self) -> float:
        src = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8)
        dst = torch.empty_like(src)
        t0 = time.perf_counter()
        dst.copy_(src)
        return 2 * src.numel() / (time.perf_counter() - t0) / 1e9

    @staticmethod
    def _run(fn, n: int) -> float:
        t0 = time.perf_counter()
        for i in range(n):
            fn(i)
        return (time.perf_counter() - t0) / n * 1e6
