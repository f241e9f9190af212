"""Is a kvpool transfer held back by the host? Host cost of each step of the pipeline, and copy grids.

Two ranks (cuda:0 sends, cuda:1 receives, NCCL), Llama-3-8B FP8 pools as in bench_transfer.py. For
8k- and 32k-token requests it measures, after warm-up:

* ``bare``: host microseconds of one ``dist.isend`` / ``dist.irecv`` call of 64 KiB (the call only,
  not the transfer), median of 200;
* ``steps``: host microseconds spent in each step of ``send`` / ``recv`` (the header exchange, each
  chunk's copy launch, each ``isend``/``irecv`` call, ``Work.wait``, the checks, the pipeline),
  summed per transfer, and
  the whole call, against the transfer's device time (barrier to completion, median of 5);
* ``grid``: the transfer's time with the gather/scatter grid capped at 16, 32, 66 and 264 programs
  (``max_programs``, which also caps the first gather and the last scatter), against one contiguous
  NCCL send of the same bytes.

If the host's time per chunk approaches the link's time per chunk, the device waits for the host.
The whole run is made twice: with torch's defaults, and with the NCCL flight recorder off
(``TORCH_NCCL_TRACE_BUFFER_SIZE=0``), which records every NCCL call's Python stack by default.

Usage (two GPUs): python benchmarks/probe_transfer_host.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pair import free_port, init_pair  # noqa: E402
from trace_transfer import HEAD_DIM, HEADS, LAYERS, SIZE, TOKEN_BYTES, timed  # noqa: E402  (same pools, same clock)

from kvpool import KVReceiver, KVSender, MHATokenToKVPool  # noqa: E402
from kvpool.transfer import endpoint  # noqa: E402

REQUESTS = {"8k": 8192, "32k": 32768}


class HostClock:
    """Host microseconds spent inside wrapped callables, per label (reset per transfer)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, label: str, fn):
        def timed_call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[label] += (time.perf_counter() - t0) * 1e6
                self.calls[label] += 1

        return timed_call

    def reset(self) -> None:
        self.spent.clear()
        self.calls.clear()


def install(clock: HostClock) -> None:
    """Wrap the steps a transfer takes (the library is not changed on disk, only in this process)."""
    dist.isend = clock.wrap("isend", dist.isend)
    dist.irecv = clock.wrap("irecv", dist.irecv)
    endpoint.exchange = clock.wrap("handshake", endpoint.exchange)
    endpoint.Endpoint._copy = clock.wrap("copy launch", endpoint.Endpoint._copy)
    for name in ("_check_peer", "_check_backend", "_check_loc", "_move"):
        setattr(endpoint.Endpoint, name, clock.wrap(name, getattr(endpoint.Endpoint, name)))
    for cls in (KVSender, KVReceiver):
        cls._pipeline = clock.wrap("_pipeline", cls._pipeline)
    endpoint.KVTransfer.wait = clock.wrap("KVTransfer.wait", endpoint.KVTransfer.wait)
    work = torch._C._distributed_c10d.Work
    work.wait = clock.wrap("Work.wait", work.wait)


def run(rank: int, port: int, out: str, tag: str) -> None:
    dev = init_pair(rank, port, smoke=False)
    peer = 1 - rank
    report: dict = {"tag": tag, "bare_us": {}, "steps": {}, "grid": {}}
    try:
        pool = MHATokenToKVPool(SIZE, 1, torch.float8_e4m3fn, HEADS, HEAD_DIM, LAYERS, dev, warmup=False)
        for b in pool.k_buffer + pool.v_buffer:
            b.view(torch.uint8).random_()
        g = torch.Generator().manual_seed(3 + rank)
        perm = torch.randperm(SIZE - 1, generator=g) + 1
        buf = torch.empty(REQUESTS["32k"] * TOKEN_BYTES, dtype=torch.uint8, device=dev)

        # 1. One bare isend/irecv call's host cost (64 KiB), the call alone.
        small = buf[: 1 << 16]
        costs = []
        for i in range(220):
            t0 = time.perf_counter()
            w = dist.isend(small, peer) if rank == 0 else dist.irecv(small, peer)
            costs.append((time.perf_counter() - t0) * 1e6)
            w.wait()
            if i % 20 == 19:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        report["bare_us"]["isend" if rank == 0 else "irecv"] = statistics.median(costs[20:])

        clock = HostClock()
        install(clock)
        ep = KVSender(pool) if rank == 0 else KVReceiver(pool)
        for name, tokens in REQUESTS.items():
            loc = perm[:tokens]
            nbytes = tokens * TOKEN_BYTES
            move = (lambda: ep.send(loc, 1).wait()) if rank == 0 else (lambda: ep.recv(loc, 0).wait())
            move()
            torch.cuda.synchronize()
            # 2. Host time per step over 5 transfers (each after a barrier and a drained device).
            rows = []
            for _ in range(5):
                dist.barrier()
                torch.cuda.synchronize()
                clock.reset()
                t0 = time.perf_counter()
                move()
                host = (time.perf_counter() - t0) * 1e6
                torch.cuda.synchronize()
                total = (time.perf_counter() - t0) * 1e6
                rows.append({"call_us": host, "device_done_us": total, **{f"{k}_us": v for k, v in clock.spent.items()},
                             **{f"{k}_calls": c for k, c in clock.calls.items()}})  # fmt: skip
            report["steps"][name] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            # 3. Copy grids, and the contiguous NCCL ceiling of the same bytes.
            flat = buf[:nbytes].view(torch.int64)
            grid = {"nccl_us": timed(lambda: (dist.send(flat, 1) if rank == 0 else dist.recv(flat, 0)))}
            for programs in (16, 32, 66, 264):
                e = KVSender(pool, max_programs=programs) if rank == 0 else KVReceiver(pool, max_programs=programs)
                go = (lambda: e.send(loc, 1).wait()) if rank == 0 else (lambda: e.recv(loc, 0).wait())
                go()
                grid[f"{programs}_us"] = timed(go)
                del e
            grid["default_us"] = timed(move)
            report["grid"][name] = grid
            if rank == 1:
                s = report["steps"][name]
                print(f"[{tag}] {name}: call {s['call_us']:.0f} us host, done {s['device_done_us']:.0f} us; "
                      + ", ".join(f"{k} {v:.0f}" for k, v in s.items() if k.endswith("_us") and k not in ("call_us", "device_done_us")),
                      flush=True)  # fmt: skip
                print(f"[{tag}] {name}: " + ", ".join(
                    f"{k[:-3]} {nbytes / v / 1e3:.0f} GB/s ({100 * grid['nccl_us'] / v:.1f}%)" for k, v in grid.items()), flush=True)  # fmt: skip
        torch.cuda.synchronize()
        dist.barrier()
    finally:
        with open(os.path.join(out, f"probe_transfer_host_{tag}_rank{rank}.json"), "w") as f:
            json.dump(report, f, indent=1)
        dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench_out")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    mp.spawn(run, args=(free_port(), a.out, "default"), nprocs=2, join=True)
    os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] = "0"
    mp.spawn(run, args=(free_port(), a.out, "no_flight_recorder"), nprocs=2, join=True)
    merged = {}
    for tag in ("default", "no_flight_recorder"):
        for r in (0, 1):
            with open(os.path.join(a.out, f"probe_transfer_host_{tag}_rank{r}.json")) as f:
                merged[f"{tag}/rank{r}"] = json.load(f)
    with open(os.path.join(a.out, "probe_transfer_host.json"), "w") as f:
        json.dump(merged, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
