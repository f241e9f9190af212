"""Where a small transfer's time goes: host steps of a 1-token (and 0-token) ping-pong, both ranks.

Two ranks (cuda:0 and cuda:1, NCCL), Llama-3-8B FP8 pools as in bench_transfer.py. Runs the
benchmark's latency ping-pong (rank 0 sends 1 token and receives it back, rank 1 the mirror, each
handle waited on the caller's stream) and records, on both ranks, the host time spent in each step
of every call: the checks, each key-value store operation of the handshake, the data movement's
launches and NCCL calls, and the time between calls. ``time.perf_counter`` is CLOCK_MONOTONIC on
Linux, one clock for both processes, so the report also says how long each rank waited in the
handshake for the other.

Then the same ping-pong under cProfile (top functions by own time, per rank), and the store's bare
round trip (``get`` of an existing key).

Usage (two GPUs): python benchmarks/probe_transfer_latency.py --out DIR [--legs 200]
Writes DIR/probe_transfer_latency.json and prints a summary. ``--cpu-smoke``: CPU pools over gloo.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pair import free_port, init_pair  # noqa: E402

from kvpool import KVReceiver, KVSender, MHATokenToKVPool  # noqa: E402
from kvpool.transfer import endpoint  # noqa: E402

LAYERS, HEADS, HEAD_DIM = 32, 8, 128
SIZE = 4096


class Steps:
    """Host seconds per label, accumulated per leg."""

    def __init__(self) -> None:
        self.legs: list[dict[str, float]] = []
        self.cur: dict[str, float] = defaultdict(float)
        self.marks: list[tuple[str, float, float]] = []  # (label, enter, exit) of the handshakes

    def wrap(self, label: str, fn, mark: bool = False):
        def timed_call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                t1 = time.perf_counter()
                self.cur[label] += t1 - t0
                if mark:
                    self.marks.append((label, t0, t1))

        return timed_call

    def next_leg(self) -> None:
        self.legs.append(dict(self.cur))
        self.cur.clear()


class TimedStore:
    """The default store with each operation timed."""

    def __init__(self, store, steps: Steps) -> None:
        self._store = store
        for name in ("set", "get", "compare_set", "delete_key"):
            setattr(self, name, steps.wrap(f"store.{name}", getattr(store, name)))


def install(steps: Steps) -> None:
    store = TimedStore(endpoint._default_store(), steps)
    endpoint._default_store = lambda: store
    dist.isend = steps.wrap("dist.isend", dist.isend)
    dist.irecv = steps.wrap("dist.irecv", dist.irecv)
    E = endpoint.Endpoint
    E._start = steps.wrap("call", E._start, mark=True)
    endpoint.exchange = steps.wrap("handshake", endpoint.exchange, mark=True)
    for name in ("_check_peer", "_check_backend", "_check_loc", "_move", "_copy"):
        setattr(E, name, steps.wrap(name, getattr(E, name)))
    for cls in (KVSender, KVReceiver):
        cls._pipeline = steps.wrap("_pipeline", cls._pipeline)
    endpoint.KVTransfer.wait = steps.wrap("KVTransfer.wait", endpoint.KVTransfer.wait)
    work = torch._C._distributed_c10d.Work
    work.wait = steps.wrap("Work.wait", work.wait)
    endpoint.agree = steps.wrap("agree", endpoint.agree)
    # Inside _move and _pipeline: the pieces whose cost is not the library's own Python.
    E._tables_for = steps.wrap("_tables_for", E._tables_for)
    endpoint.chunk_plan = steps.wrap("chunk_plan", endpoint.chunk_plan)
    endpoint.launch_copy_rows = steps.wrap("launch_copy_rows", endpoint.launch_copy_rows)
    for name in ("pin_memory", "is_pinned", "copy_"):
        setattr(torch.Tensor, name, steps.wrap(f"Tensor.{name}", getattr(torch.Tensor, name)))
    torch.cuda.Event.record = steps.wrap("Event.record", torch.cuda.Event.record)
    torch.cuda.Stream.wait_stream = steps.wrap("Stream.wait_stream", torch.cuda.Stream.wait_stream)
    torch.cuda.current_stream = steps.wrap("cuda.current_stream", torch.cuda.current_stream)
    original_on_side = E._on_side

    def on_side(self):
        t0 = time.perf_counter()
        cm = original_on_side(self)
        cm.__enter__()
        steps.cur["_on_side enter"] += time.perf_counter() - t0

        class Exit:
            def __enter__(self_inner):
                return None

            def __exit__(self_inner, *exc):
                t1 = time.perf_counter()
                try:
                    return cm.__exit__(*exc)
                finally:
                    steps.cur["_on_side exit"] += time.perf_counter() - t1

        return Exit()

    E._on_side = on_side


def run(rank: int, port: int, out: str, legs: int, smoke: bool) -> None:
    dev = init_pair(rank, port, smoke)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    peer = 1 - rank
    report: dict = {"rank": rank, "legs": legs}
    try:
        pool = MHATokenToKVPool(SIZE, 1, torch.float8_e4m3fn, HEADS, HEAD_DIM, LAYERS, dev, warmup=False)
        sender, receiver = KVSender(pool), KVReceiver(pool)
        store = endpoint._default_store()
        store.set(f"probe/{rank}", b"x")
        dist.barrier()
        rt = []
        for _ in range(200):
            t0 = time.perf_counter()
            store.get(f"probe/{peer}")
            rt.append(time.perf_counter() - t0)
        report["store_get_us"] = statistics.median(rt) * 1e6

        def pingpong(tokens: int, n: int, hook=None) -> float:
            loc = torch.tensor([5 + rank] * tokens, dtype=torch.int64)

            def out() -> None:
                sender.send(loc, peer).wait()

            def back() -> None:
                receiver.recv(loc, peer).wait()

            sync()
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            for _ in range(n):
                for f in ((out, back) if rank == 0 else (back, out)):
                    f()
                    if hook:
                        hook()
            sync()
            return (time.perf_counter() - t0) / (2 * n)

        for tokens in (1, 0):
            pingpong(tokens, 20)
        report["plain_leg_us"] = {t: pingpong(t, legs // 2) * 1e6 for t in (1, 0)}

        prof = cProfile.Profile()
        prof.enable()
        t_leg = pingpong(1, legs // 2)
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
        report["cprofile_leg_us"] = t_leg * 1e6
        report["cprofile"] = s.getvalue()

        steps = Steps()
        install(steps)
        for tokens in (1, 0):
            steps.legs.clear()
            steps.marks.clear()
            t_leg = pingpong(tokens, legs // 2, steps.next_leg)
            labels = sorted({k for leg in steps.legs for k in leg})
            per = {k: statistics.median(leg.get(k, 0.0) for leg in steps.legs) * 1e6 for k in labels}
            report[f"steps_{tokens}"] = {"leg_us": t_leg * 1e6, "median_us_per_leg": per,
                                         "marks": steps.marks[-40:]}  # fmt: skip

        sync()
        dist.barrier()
    finally:
        with open(os.path.join(out, f"probe_transfer_latency_rank{rank}.json"), "w") as f:
            json.dump(report, f, indent=1)
        dist.destroy_process_group()


def summary(ranks: list[dict]) -> str:
    lines = []
    for r in ranks:
        lines.append(f"rank {r['rank']}: store get {r['store_get_us']:.1f} us; plain legs: "
                     + ", ".join(f"{t} tokens {v:.1f} us" for t, v in r["plain_leg_us"].items()))  # fmt: skip
        for tokens in (1, 0):
            st = r[f"steps_{tokens}"]
            parts = ", ".join(f"{k} {v:.1f}" for k, v in sorted(st["median_us_per_leg"].items(), key=lambda kv: -kv[1]))
            lines.append(f"  {tokens} tokens, instrumented leg {st['leg_us']:.1f} us: {parts}")
    # Cross-rank: each handshake's entry and exit on both ranks (one clock).
    m0 = [m for m in ranks[0]["steps_1"]["marks"] if m[0] == "handshake"]
    m1 = [m for m in ranks[1]["steps_1"]["marks"] if m[0] == "handshake"]
    for a, b in list(zip(m0, m1))[-6:]:
        first = min(a[1], b[1])
        lines.append(f"  handshake: rank0 in {1e6 * (a[1] - first):.0f} out {1e6 * (a[2] - first):.0f}, "
                     f"rank1 in {1e6 * (b[1] - first):.0f} out {1e6 * (b[2] - first):.0f} us")  # fmt: skip
    for r in ranks:
        lines.append(f"rank {r['rank']} cProfile (leg {r['cprofile_leg_us']:.0f} us under the profiler):")
        lines += r["cprofile"].splitlines()[:45]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench_out")
    p.add_argument("--legs", type=int, default=200)
    p.add_argument("--cpu-smoke", action="store_true")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    mp.spawn(run, args=(free_port(), a.out, a.legs, a.cpu_smoke), nprocs=2, join=True)
    ranks = []
    for r in (0, 1):
        with open(os.path.join(a.out, f"probe_transfer_latency_rank{r}.json")) as f:
            ranks.append(json.load(f))
    with open(os.path.join(a.out, "probe_transfer_latency.json"), "w") as f:
        json.dump(ranks, f, indent=1)
    print(summary(ranks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
