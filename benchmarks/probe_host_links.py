"""What the host link gives each way of moving bytes, measured on one GPU (issue 12's ceilings).

The host tier's targets compare its backends with one large copy-engine copy. This probe asks what
the pieces can reach on their own, outside the pool:

* ``ce``: the copy engine moving 512 MiB as segments of 64 KiB to 4 MiB at shuffled host offsets
  (the direct backend's copies), issued round robin over 1, 2 or 4 streams, each direction; and
  one 1 GiB copy each way, and both ways at once (the ceilings the benchmark uses);
* ``sm``: the row-copy kernel between device memory and pinned host memory (the kernel backend),
  rows of 1 KiB (a Llama-3-8B FP8 layer row) and of 64 KiB, contiguous or shuffled, on 8, 16, 32
  programs and on the whole GPU: whether any SM-driven copy reaches the copy engine's rate;
* ``both``: both directions at once: SM both ways, copy engine both ways (segments), and the SM
  backing up while the copy engine loads.

Prints one JSON line per measurement and writes them all to ``OUT/probe_host_links.json``.
``--cpu-smoke`` runs every code path once on small CPU tensors without timing anything.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from kvpool.kernels import copy_rows as rows

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import event_ms  # noqa: E402

GiB, MiB, KiB = 1 << 30, 1 << 20, 1 << 10


def _segments(total: int, seg: int, gen: torch.Generator) -> list[tuple[int, int]]:
    """(host offset, device offset) of each segment: device in order, host shuffled."""
    n = total // seg
    perm = torch.randperm(n, generator=gen).tolist()
    return [(perm[i] * seg, i * seg) for i in range(n)]


def ce_copies(host, dev, segs, seg, streams, to_host: bool):
    def run():
        for i, (h, d) in enumerate(segs):
            with torch.cuda.stream(streams[i % len(streams)]):
                if to_host:
                    host[h : h + seg].copy_(dev[d : d + seg], non_blocking=True)
                else:
                    dev[d : d + seg].copy_(host[h : h + seg], non_blocking=True)

    return run


def pool_both_ways(args, emit) -> None:
    """The host tier's own backup and load (8k tokens each way, Llama-3-8B FP8, page 16, layer_first,
    kernel backend), timed on the device only: a sleep kernel holds the GPU while the host queues
    everything, so the host's enqueue time is left out. The load also as one launch over every
    layer (no per-layer events), to see what the per-layer launches cost beside a backup."""
    from kvpool import MHATokenToKVPool
    from kvpool.host import MHATokenToKVPoolHost

    tokens, page, slots = 8192, 16, 36864
    pool = MHATokenToKVPool(slots, page, torch.float8_e4m3fn, 8, 128, 32, "cuda", warmup=False)
    for b in pool.k_buffer + pool.v_buffer:
        b.view(torch.uint8).random_(0, 256)
    host = MHATokenToKVPoolHost(pool, 1.0, 0, page, "layer_first")
    gen = torch.Generator().manual_seed(3)

    def pages(n):
        p = torch.randperm(slots // page - 1, generator=gen)[: n // page] + 1
        return (p[:, None] * page + torch.arange(page)).reshape(-1).cuda()

    h_out, h_in = host.alloc(tokens), host.alloc(tokens)
    h_out = h_out.view(-1, page)[torch.randperm(tokens // page, generator=gen)].reshape(-1)
    h_in = h_in.view(-1, page)[torch.randperm(tokens // page, generator=gen)].reshape(-1)
    d_out, d_in = pages(tokens), pages(tokens)
    h_in_dev = h_in.cuda()
    host.backup_from_device_all_layer(pool, h_in, d_in, "kernel")
    streams = [host.backup_stream, host.load_stream]

    def device_ms(fn):  # the GPU sleeps about 10 ms while the host queues everything
        return event_ms(fn, args.reps, streams, hold_cycles=20_000_000)

    backup = lambda: host.backup_from_device_all_layer(pool, h_out, d_out, "kernel")  # noqa: E731
    load = lambda: host.load_to_device_all_layer(pool, h_in, d_in, "kernel")  # noqa: E731

    def load_once():  # every layer in one launch, on the load stream, after the current stream's work
        host.load_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(host.load_stream):
            rows.copy_rows(pool.row_table, d_in, host.row_table, h_in_dev, max_programs=host.kernel_programs)

    nbytes = tokens * 32 * 2 * 1024
    for name, fn, moved in (
        ("backup", backup, nbytes), ("load, per layer", load, nbytes), ("load, one launch", load_once, nbytes),
        ("both, per-layer load", lambda: (backup(), load()), 2 * nbytes),
        ("both, one-launch load", lambda: (backup(), load_once()), 2 * nbytes),
    ):
        ms = device_ms(fn)
        emit(kind="pool", case=name, device_ms=ms, gbs=moved / ms / 1e6)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="probe_out")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cpu-smoke", action="store_true", help="run each path once on the CPU, time nothing")
    p.add_argument("--pool", action="store_true", help="only the host tier's own transfers, both ways, device time")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = []

    def emit(**rec):
        results.append(rec)
        print(json.dumps(rec), flush=True)

    if args.cpu_smoke:
        host = torch.zeros(64 * KiB, dtype=torch.uint8)
        dev = torch.arange(64 * KiB, dtype=torch.int64).to(torch.uint8)
        gen = torch.Generator().manual_seed(0)
        segs = _segments(64 * KiB, 4 * KiB, gen)
        for h, d in segs:
            host[h : h + 4 * KiB].copy_(dev[d : d + 4 * KiB])
        src = rows.RowTable.of([dev.view(-1, KiB)])
        dst = rows.RowTable.of([host.view(-1, KiB)])
        idx = torch.randperm(64, generator=gen)
        rows.copy_rows(dst, idx, src, idx)
        emit(kind="smoke", ok=bool(torch.equal(host, dev)))
        return

    if args.pool:
        host = torch.empty(GiB, dtype=torch.uint8, pin_memory=True)
        dev = torch.randint(0, 255, (GiB,), dtype=torch.uint8, device="cuda")
        d2h = event_ms(lambda: host.copy_(dev, non_blocking=True), args.reps, [])
        h2d = event_ms(lambda: dev.copy_(host, non_blocking=True), args.reps, [])
        emit(kind="ceiling", d2h_gbs=GiB / d2h / 1e6, h2d_gbs=GiB / h2d / 1e6)
        del host, dev
        pool_both_ways(args, emit)
        with open(os.path.join(args.out, "probe_host_pool.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "results": results}, f, indent=1)
        return

    dev_total = 512 * MiB
    gen = torch.Generator().manual_seed(0)
    host = torch.empty(GiB, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(GiB, dtype=torch.uint8, pin_memory=True)
    dev = torch.randint(0, 255, (GiB,), dtype=torch.uint8, device="cuda")
    dev2 = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    host.copy_(dev.cpu())
    streams = [torch.cuda.Stream() for _ in range(4)]
    cur = torch.cuda.current_stream()
    reps = args.reps

    # Ceilings: one 1 GiB copy each way, and both at once on two streams.
    d2h = event_ms(lambda: host2.copy_(dev, non_blocking=True), reps, [])
    h2d = event_ms(lambda: dev2.copy_(host, non_blocking=True), reps, [])

    def both_ce():
        with torch.cuda.stream(streams[0]):
            host2.copy_(dev, non_blocking=True)
        with torch.cuda.stream(streams[1]):
            dev2.copy_(host, non_blocking=True)

    both = event_ms(both_ce, reps, streams[:2])
    ceil_d2h, ceil_h2d = GiB / d2h / 1e6, GiB / h2d / 1e6
    emit(kind="ceiling", d2h_gbs=ceil_d2h, h2d_gbs=ceil_h2d, both_gbs=2 * GiB / both / 1e6)

    # Copy engine, segments at shuffled host offsets.
    for seg in (64 * KiB, 256 * KiB, 1 * MiB, 2 * MiB, 4 * MiB):
        segs = _segments(dev_total, seg, gen)
        for n_streams in (1, 2, 4):
            for to_host in (True, False):
                fn = ce_copies(host2 if to_host else host, dev if to_host else dev2, segs, seg, streams[:n_streams], to_host)
                t0 = time.perf_counter()
                fn()
                issue_ms = (time.perf_counter() - t0) * 1e3
                torch.cuda.synchronize()
                ms = event_ms(fn, reps, streams[:n_streams])
                gbs = dev_total / ms / 1e6
                emit(
                    kind="ce", seg_kib=seg // KiB, streams=n_streams, direction="d2h" if to_host else "h2d",
                    gbs=gbs, pct=100 * gbs / (ceil_d2h if to_host else ceil_h2d), copies=len(segs), host_issue_ms=issue_ms,
                )  # fmt: skip

    # SM path: the row-copy kernel between device and pinned host rows.
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    def tables(row: int):
        """Row tables over the first 512 MiB of each buffer: (device source, host destination, host
        source, device destination, rows in order, rows shuffled)."""
        n = dev_total // row
        views = [rows.RowTable.of([b[:dev_total].view(n, row)]) for b in (dev, host2, host, dev2)]
        return (*views, torch.arange(n, device="cuda"), torch.randperm(n, generator=gen).cuda())

    for row in (1 * KiB, 64 * KiB):
        dtab, htab, htab_src, dtab_dst, ordered, shuffled = tables(row)
        for order, hidx in (("contiguous", ordered), ("shuffled", shuffled)):
            for programs in (8, 16, 32, sms * rows.PROGRAMS_PER_SM):
                for to_host in (True, False):
                    if to_host:
                        fn = lambda: rows.copy_rows(htab, hidx, dtab, ordered, max_programs=programs)  # noqa: E731
                    else:
                        fn = lambda: rows.copy_rows(dtab_dst, ordered, htab_src, hidx, max_programs=programs)  # noqa: E731
                    ms = event_ms(fn, reps, [])
                    gbs = dev_total / ms / 1e6
                    emit(
                        kind="sm", row_bytes=row, order=order, programs=programs, direction="d2h" if to_host else "h2d",
                        gbs=gbs, pct=100 * gbs / (ceil_d2h if to_host else ceil_h2d),
                    )  # fmt: skip

    # Both ways at once (512 MiB each way).
    dtab, htab_dst, htab_src, dtab_dst, ordered, shuffled = tables(KiB)

    def sm_backup(programs):
        return lambda: rows.copy_rows(htab_dst, shuffled, dtab, ordered, max_programs=programs)

    def sm_load(programs):
        return lambda: rows.copy_rows(dtab_dst, ordered, htab_src, shuffled, max_programs=programs)

    def pair(a, b):
        def run():
            with torch.cuda.stream(streams[0]):
                a()
            with torch.cuda.stream(streams[1]):
                b()

        return run

    for bp, lp in ((8, 8), (8, 16), (16, 16), (32, 32)):
        ms = event_ms(pair(sm_backup(bp), sm_load(lp)), reps, streams[:2])
        emit(kind="both", backup="sm", load="sm", backup_programs=bp, load_programs=lp, gbs=2 * dev_total / ms / 1e6)
    for seg in (1 * MiB, 2 * MiB, 4 * MiB):
        segs = _segments(dev_total, seg, gen)
        for n_streams in (1, 2):
            ce_b = ce_copies(host2, dev, segs, seg, streams[2 : 2 + n_streams], True)
            # copy engine both ways: backups on streams[2:], loads on their own streams
            def ce_both(ce_b=ce_b, segs=segs, seg=seg, n_streams=n_streams):
                ce_b()
                for i, (h, d) in enumerate(segs):
                    with torch.cuda.stream(streams[i % n_streams]):
                        dev2[d : d + seg].copy_(host[h : h + seg], non_blocking=True)

            ms = event_ms(ce_both, reps, streams)
            emit(kind="both", backup="ce", load="ce", seg_kib=seg // KiB, streams=n_streams, gbs=2 * dev_total / ms / 1e6)
            for bp in (8, 16):
                def sm_ce(bp=bp, segs=segs, seg=seg, n_streams=n_streams):
                    with torch.cuda.stream(streams[3]):
                        sm_backup(bp)()
                    for i, (h, d) in enumerate(segs):
                        with torch.cuda.stream(streams[i % n_streams]):
                            dev2[d : d + seg].copy_(host[h : h + seg], non_blocking=True)

                ms = event_ms(sm_ce, reps, streams)
                emit(
                    kind="both", backup="sm", load="ce", backup_programs=bp, seg_kib=seg // KiB, streams=n_streams,
                    gbs=2 * dev_total / ms / 1e6,
                )  # fmt: skip
    cur.synchronize()
    with open(os.path.join(args.out, "probe_host_links.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
