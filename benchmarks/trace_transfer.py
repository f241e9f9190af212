"""Where a kvpool transfer's time goes: a profiler timeline of one 8k-token transfer on two GPUs.

Two ranks (cuda:0 sends, cuda:1 receives, NCCL), Llama-3-8B FP8 pools as in bench_transfer.py. After
warm-up it times, on the receiver, from a barrier to the end of the transfer (median of 5):

* ``nccl 1 x 512 MiB``: one contiguous send of the request's bytes;
* ``nccl 32 x 16 MiB`` / ``nccl 4 x 128 MiB``: the same bytes as back-to-back sends from one stream;
* ``kvpool default``: ``KVSender.send`` / ``KVReceiver.recv`` with the default settings;
* ``kvpool chunk C MiB, P programs beside NCCL``: other staging sizes and grids of the copies that
  run beside the transport.

Then it profiles one default transfer on both ranks after 50 ms of busy compute stream on the sender
(torch.profiler, CUDA activity) and writes each rank's GPU timeline (kernel and memcpy name, stream,
start and duration in microseconds from the first event) to ``DIR/trace_rank{r}.json``, and prints
a summary per stream. Whether the sender's gathers start after the busy compute stream ends shows
there too.

Usage (two GPUs): python benchmarks/trace_transfer.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pair import free_port, init_pair  # noqa: E402

from kvpool import KVReceiver, KVSender, MHATokenToKVPool  # noqa: E402

LAYERS, HEADS, HEAD_DIM = 32, 8, 128
TOKENS = 8192
SIZE = 2 * 32768
TOKEN_BYTES = LAYERS * 2 * HEADS * HEAD_DIM


def timed(fn, reps: int = 5) -> float:
    times = []
    for _ in range(reps + 1):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e6


def run(rank: int, port: int, out: str) -> None:
    dev = init_pair(rank, port, smoke=False)
    report: dict = {"times_us": {}}
    try:
        pool = MHATokenToKVPool(SIZE, 1, torch.float8_e4m3fn, HEADS, HEAD_DIM, LAYERS, dev, warmup=False)
        for b in pool.k_buffer + pool.v_buffer:
            b.view(torch.uint8).random_()
        g = torch.Generator().manual_seed(3 + rank)
        loc = torch.randperm(SIZE, generator=g)[:TOKENS] + 1
        nbytes = TOKENS * TOKEN_BYTES
        buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)

        def nccl(pieces: int):
            n = nbytes // pieces

            def go():
                works = []
                for i in range(pieces):
                    part = buf[i * n : (i + 1) * n]
                    works.append(dist.isend(part, 1) if rank == 0 else dist.irecv(part, 0))
                for w in works:
                    w.wait()

            return go

        for label, pieces in (("nccl 1 x 512 MiB", 1), ("nccl 4 x 128 MiB", 4), ("nccl 32 x 16 MiB", 32)):
            report["times_us"][label] = timed(nccl(pieces))
        configs = [("kvpool default", None, None)]
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        for chunk, programs in ((64, 32), (128, 66), (128, 2 * sms), (256, 32)):
            configs.append((f"kvpool chunk {chunk} MiB, {programs} programs beside NCCL", chunk << 20, programs))
        for label, chunk_bytes, programs in configs:
            ep = KVSender(pool, chunk_bytes=chunk_bytes, max_programs=programs) if rank == 0 else KVReceiver(
                pool, chunk_bytes=chunk_bytes, max_programs=programs)  # fmt: skip
            ep._alone_programs = None  # fill and drain on the whole GPU, as the default endpoint's
            move = (lambda: ep.send(loc, 1).wait()) if rank == 0 else (lambda: ep.recv(loc, 0).wait())
            move()
            report["times_us"][label] = timed(move)
            print(f"[rank {rank}] {label}: {report['times_us'][label]:.0f} us", flush=True)
            del ep
        report["times_us"] = {k: round(v, 1) for k, v in report["times_us"].items()}
        report["nbytes"] = nbytes

        # One profiled default transfer; the sender's compute stream is busy for ~50 ms first.
        ep = KVSender(pool) if rank == 0 else KVReceiver(pool)
        (ep.send(loc, 1) if rank == 0 else ep.recv(loc, 0)).wait()
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            if rank == 0:
                torch.cuda._sleep(100_000_000)  # ~50 ms at 2 GHz
            h = ep.send(loc, 1) if rank == 0 else ep.recv(loc, 0)
            report["completed_right_after"] = h.is_completed()
            h.wait()
            torch.cuda.synchronize()
        events = []
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                events.append((e.name[:60], getattr(e, "device_resource_id", -1), e.time_range.start, e.time_range.elapsed_us()))
        cpu = [(e.name[:60], e.time_range.start, e.time_range.elapsed_us()) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CPU and ("c10d" in e.name or "nccl" in e.name.lower()
                                                                     or "record_param" in e.name)]  # fmt: skip
        t0 = min([s for _, _, s, _ in events] + [s for _, s, _ in cpu]) if events else 0
        timeline = sorted((round(s - t0, 1), round(d, 1), n, sid) for n, sid, s, d in events)
        report["timeline"] = timeline
        report["cpu"] = sorted((round(s - t0, 1), round(d, 1), n) for n, s, d in cpu)
        print(f"[rank {rank}] completed right after the call: {report['completed_right_after']}", flush=True)
        by_stream: dict = {}
        for s, d, n, sid in timeline:
            by_stream.setdefault(sid, []).append((s, d, n))
        for sid, evs in by_stream.items():
            first, last = evs[0][0], max(s + d for s, d, _ in evs)
            names = {}
            for _, d, n in evs:
                names[n.split("(")[0][:40]] = names.get(n.split("(")[0][:40], 0) + d
            print(f"[rank {rank}] stream {sid}: {len(evs)} ops, {first:.0f}..{last:.0f} us; "
                  + "; ".join(f"{k} {v:.0f} us" for k, v in sorted(names.items(), key=lambda x: -x[1])[:5]), flush=True)  # fmt: skip
        # Host cost of the calls themselves: cProfile over three transfers (device work is async).
        import cProfile
        import io
        import pstats

        prof_host = cProfile.Profile()
        prof_host.enable()
        for _ in range(3):
            (ep.send(loc, 1) if rank == 0 else ep.recv(loc, 0)).wait()
        prof_host.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof_host, stream=text).sort_stats("cumulative").print_stats(30)
        report["host_profile"] = text.getvalue()
        print(f"[rank {rank}] host profile of 3 transfers:\n" + "\n".join(text.getvalue().splitlines()[:45]), flush=True)
    finally:
        with open(os.path.join(out, f"trace_rank{rank}.json"), "w") as f:
            json.dump(report, f)
        dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench_out")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    mp.spawn(run, args=(free_port(), a.out), nprocs=2, join=True)
    r1 = json.load(open(os.path.join(a.out, "trace_rank1.json")))
    for label, us in r1.get("times_us", {}).items():
        print(f"{label}: {us:.0f} us one way ({r1['nbytes'] / us / 1e3:.0f} GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
