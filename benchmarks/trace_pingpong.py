"""Where a ping-pong of kvpool transfers spends its time: the timeline bench_transfer.py measures.

Two ranks (cuda:0 and cuda:1, NCCL), Llama-3-8B FP8 pools as in bench_transfer.py. Rank 0 sends a
request's rows and receives them back; rank 1 receives and sends back, ``--legs`` times each way
(the benchmark's pattern, one-way time = round time / (2 legs)). After two warm-up rounds, one round is
timed without the profiler and one with it (torch.profiler, CUDA activity plus the host spans of
the ``send``/``recv`` calls). Each rank writes its GPU timeline (kernel and memcpy name, stream,
start and duration in microseconds from the round's first event) and its host spans to
``DIR/pingpong_rank{r}.json`` and prints the one-way time of both rounds and, over the profiled
round, how long the transport's send/recv kernels ran against the span from the first to the last
(the rest is time the link sat idle).

Usage (two GPUs): python benchmarks/trace_pingpong.py --out DIR [--tokens 32768] [--legs 3]
``--cpu-smoke --tokens 64`` runs it on CPU pools over gloo (checks the script only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pair import free_port, init_pair  # noqa: E402

from kvpool import KVReceiver, KVSender, MHATokenToKVPool  # noqa: E402

LAYERS, HEADS, HEAD_DIM = 32, 8, 128
TOKEN_BYTES = LAYERS * 2 * HEADS * HEAD_DIM


def run(rank: int, port: int, out: str, tokens: int, legs: int, smoke: bool) -> None:
    dev = init_pair(rank, port, smoke)  # smoke: CPU pools over gloo, checks the script only
    sync = torch.cuda.synchronize if not smoke else (lambda: None)
    report: dict = {"tokens": tokens, "legs": legs}
    try:
        size = 2 * tokens + 64
        pool = MHATokenToKVPool(size, 1, torch.float8_e4m3fn, HEADS, HEAD_DIM, LAYERS, dev, warmup=False)
        for b in pool.k_buffer + pool.v_buffer:
            b.view(torch.uint8).random_()
        g = torch.Generator().manual_seed(11)
        slots = torch.randperm(size - 1, generator=g)[: 2 * tokens] + 1
        out_loc, back_loc = (slots[:tokens], slots[tokens:]) if rank == 0 else (slots[:tokens], slots[:tokens])
        sender, receiver = KVSender(pool), KVReceiver(pool)
        peer = 1 - rank

        def leg_out() -> None:
            with torch.profiler.record_function("kvpool.send"):
                sender.send(out_loc, peer).wait()

        def leg_back() -> None:
            with torch.profiler.record_function("kvpool.recv"):
                receiver.recv(back_loc, peer).wait()

        def round_trip() -> float:
            sync()
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            for _ in range(legs):
                if rank == 0:
                    leg_out()
                    leg_back()
                else:
                    leg_back()
                    leg_out()
            sync()
            return (time.perf_counter() - t0) / (2 * legs) * 1e6

        for _ in range(2):
            round_trip()
        report["one_way_us_unprofiled"] = round(round_trip(), 1)
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([] if smoke else [ProfilerActivity.CUDA])
        with profile(activities=activities) as prof:
            report["one_way_us_profiled"] = round(round_trip(), 1)
        gpu, host = [], []
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                gpu.append((e.time_range.start, e.time_range.elapsed_us(), e.name[:50], getattr(e, "device_resource_id", -1)))
            elif e.name in ("kvpool.send", "kvpool.recv"):
                host.append((e.time_range.start, e.time_range.elapsed_us(), e.name))
        t0 = min(s for s, *_ in gpu + host) if gpu + host else 0
        report["gpu"] = sorted((round(s - t0, 1), round(d, 1), n, sid) for s, d, n, sid in gpu if "sleep" not in n)
        report["host"] = sorted((round(s - t0, 1), round(d, 1), n) for s, d, n in host)
        # Only the transport's kernels: the barrier before the round is an NCCL all-reduce.
        nccl = [(s, s + d) for s, d, n, _ in report["gpu"] if n.startswith("ncclDevKernel_SendRecv")]
        busy, end = 0.0, None
        for s, e in nccl:
            if end is None or s >= end:
                busy += e - s
                end = e
            elif e > end:
                busy += e - end
                end = e
        span = (nccl[-1][1] - nccl[0][0]) if nccl else 0.0
        report["nccl_busy_us"], report["nccl_span_us"] = round(busy, 1), round(span, 1)
        print(f"[rank {rank}] one way: {report['one_way_us_unprofiled']:.0f} us unprofiled, "
              f"{report['one_way_us_profiled']:.0f} us profiled; NCCL kernels busy {busy:.0f} of {span:.0f} us "
              f"from the first to the last", flush=True)  # fmt: skip
    finally:
        with open(os.path.join(out, f"pingpong_rank{rank}.json"), "w") as f:
            json.dump(report, f)
        dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench_out")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--legs", type=int, default=3)
    p.add_argument("--cpu-smoke", action="store_true", help="CPU pools over gloo: checks the script")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    mp.spawn(run, args=(free_port(), a.out, a.tokens, a.legs, a.cpu_smoke), nprocs=2, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
