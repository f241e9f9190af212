"""Device timing through CUDA-graph replays, so host launch cost never leaks into device time.

``graph_us(fn, calls, flush)`` captures ``calls`` invocations ``fn(i)`` in one CUDA graph and returns
the median replay time per call. With ``flush`` (a buffer larger than L2), every call is preceded
by a memset of it and the time of a flush-only graph is subtracted: the call then runs with a cold
L2, as a layer's write does in a real forward pass.
"""

from __future__ import annotations

import statistics

import torch

L2_FLUSH_BYTES = 96 << 20  # H200 L2 is 60 MB


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
