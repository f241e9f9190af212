"""The host tier on a GPU: KV backup and load between an FP8 device pool and pinned host memory.

Shapes: Llama-3-8B with an FP8 KV cache (32 layers, 8 KV heads, head_dim 128: 64 KiB per token over
all layers), 8k and 32k tokens, device pages in random order, page sizes 1, 16 and 64, both host
layouts, both backends (``kernel``: copy_rows on a grid of 8 programs; ``direct``: the copy engine).
Host pages in two orders (``--host-orders``): ``shuffled`` (the pages a host pool hands out after
long churn: every page on its own) and ``allocated`` (as ``alloc`` hands them out from a fresh host
pool: consecutive, so the direct backend's copies are a layer's whole run).

Ceilings, measured in the same run: the copy engine moving one 1 GiB pinned buffer each way and
both ways at once; the copy engine moving pieces of one host page (what the direct backend copies
when pages are shuffled; device time); a 2 GiB device copy.

Stages (``--stages``):

1. ``transfers``: backup (all layers) and load (all layers: one launch for the kernel backend, since
   nothing waits per layer; the same load layer by layer, with the layer-transfer counter
   registered, beside it), wall time from the call to completion (medians, the host's enqueue
   counts, as it does for a scheduler), and the kernel backend (and the direct one on consecutive
   pages) on device time alone (the GPU held in a sleep kernel while the host queues the call);
2. ``bidirectional``: backup and load at once, 8k tokens each way, page 16;
3. ``overlap``: a per-layer load of 32 layers beside 32 layers of a stand-in attention (bf16
   matmuls per layer sized to take as long as that layer's load, reading the loaded rows through
   the getters), queued by the call or by the host pool's worker thread (``background=True``);
   the ratio of both together to the longer alone;
4. ``device_gather``: copy_rows device-to-device (32k tokens over 64 buffers) against the device copy.

Targets: the better backend >= 95% of the copy-engine ceiling each way, the kernel backend >= 90%,
both ways at once >= 90 GB/s, the overlapped load within 1.1x of the longer alone. Direct-backend
cases that would need more than ``--max-copies`` copy-engine calls are reported as skipped.

Usage (on a GPU): python benchmarks/bench_host_tier.py --out DIR [--quick]
``--cpu-smoke`` runs the transfers, both-ways and device-gather stages on small CPU pools.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402
from timing import event_ms, gbps, wall_ms  # noqa: E402

from kvpool import MHATokenToKVPool  # noqa: E402
from kvpool.host import MHATokenToKVPoolHost, direct_backend  # noqa: E402
from kvpool.host.kernel_backend import HOST_KERNEL_PROGRAMS as KERNEL_PROGRAMS  # noqa: E402
from kvpool.kernels.copy_rows import launcher as C  # noqa: E402

LAYERS, HEADS, HEAD_DIM = 32, 8, 128
TOKEN_BYTES = LAYERS * 2 * HEADS * HEAD_DIM  # FP8: 64 KiB per token, K and V of every layer
TOKENS = [8192, 32768]
PAGE_SIZES = [1, 16, 64]
LAYOUTS = ["layer_first", "page_first"]
BACKENDS = ["kernel", "direct"]
HOST_ORDERS = ["shuffled", "allocated"]
STAGES = ["transfers", "bidirectional", "overlap", "device_gather"]
DEVICE_SLOTS = 36864  # holds 32k tokens plus room
DEVICE = "cuda"
FP8 = torch.float8_e4m3fn
#: Sleep-kernel cycles before a device-time measurement starts (milliseconds): longer than any
#: call's host time, so the host has queued the whole call when the GPU reaches it.
HOLD = 20_000_000
PIECES_BYTES = 256 << 20  # the piece ceiling copies at most this many bytes (and 256 pieces) per case


def configure_smoke() -> None:
    """--cpu-smoke: CPU pools of a few layers and tokens (the shapes' names no longer apply)."""
    global LAYERS, HEADS, HEAD_DIM, TOKEN_BYTES, TOKENS, PAGE_SIZES, DEVICE_SLOTS, DEVICE, PIECES_BYTES
    LAYERS, HEADS, HEAD_DIM, TOKENS, PAGE_SIZES, DEVICE_SLOTS, DEVICE = 3, 2, 16, [64], [1, 16], 512, "cpu"
    TOKEN_BYTES, PIECES_BYTES = LAYERS * 2 * HEADS * HEAD_DIM, 1 << 16


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def host_ms(fn, reps: int) -> float:
    """Median milliseconds until ``fn()`` returns (what it costs the calling thread), each call
    starting on an idle device."""
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        sync()
    return statistics.median(times)


def device_ms(fn, reps: int, streams=()) -> float:
    """Device time alone (the GPU held while the host queues ``fn``); wall time on the CPU."""
    return event_ms(fn, reps, streams, hold_cycles=HOLD) if DEVICE == "cuda" else wall_ms(fn, reps)


# --- ceilings ---------------------------------------------------------------------------------------


def copy_engine_ceiling(reps: int) -> dict:
    """One 1 GiB pinned copy each way, and both at once on two streams (bytes counted once each)."""
    n = 1 << 30
    host_a = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host_b = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev_a = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev_b = torch.empty(n, dtype=torch.uint8, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    h2d = wall_ms(lambda: dev_a.copy_(host_a, non_blocking=True), reps)
    d2h = wall_ms(lambda: host_b.copy_(dev_b, non_blocking=True), reps)

    def both():
        s1.wait_stream(torch.cuda.current_stream())
        s2.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s1):
            dev_a.copy_(host_a, non_blocking=True)
        with torch.cuda.stream(s2):
            host_b.copy_(dev_b, non_blocking=True)

    bidir = wall_ms(both, reps)
    out = {"h2d_gbps": gbps(n, h2d), "d2h_gbps": gbps(n, d2h), "bidir_gbps": gbps(2 * n, bidir)}
    # The same copies on device time (the device-time figures of the transfers are against these).
    out["h2d_device_gbps"] = gbps(n, device_ms(lambda: dev_a.copy_(host_a, non_blocking=True), reps))
    out["d2h_device_gbps"] = gbps(n, device_ms(lambda: host_b.copy_(dev_b, non_blocking=True), reps))
    del host_a, host_b, dev_a, dev_b
    return out


def piece_bytes(page_size: int, layout: str) -> int:
    """Bytes of one host page of one K or V buffer as the direct backend copies it: a layer's rows
    (``layer_first``) or every layer's (``page_first``)."""
    row = HEADS * HEAD_DIM  # FP8: one byte per element
    return page_size * row * (LAYERS if layout == "page_first" else 1)


def piece_ceiling(piece: int, reps: int, gen: torch.Generator) -> dict:
    """The copy engine moving pieces of ``piece`` bytes between device memory in order and pinned
    host memory at shuffled offsets, each way, on device time (GB/s)."""
    n = max(1, min(256, PIECES_BYTES // piece))
    pin = DEVICE == "cuda"
    host = torch.empty(n * piece, dtype=torch.uint8, pin_memory=pin)
    dev = torch.randint(0, 256, (n * piece,), dtype=torch.uint8, device=DEVICE)
    offsets = (torch.randperm(n, generator=gen) * piece).tolist()

    def d2h():
        for i, h in enumerate(offsets):
            host[h : h + piece].copy_(dev[i * piece : (i + 1) * piece], non_blocking=pin)

    def h2d():
        for i, h in enumerate(offsets):
            dev[i * piece : (i + 1) * piece].copy_(host[h : h + piece], non_blocking=pin)

    return {"piece_bytes": piece, "pieces": n, "d2h_gbps": gbps(n * piece, device_ms(d2h, reps)),
            "h2d_gbps": gbps(n * piece, device_ms(h2d, reps))}  # fmt: skip


def device_copy_ceiling(reps: int) -> float:
    n = 2 << 30
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = wall_ms(lambda: dst.copy_(src), reps)
    del src, dst
    return gbps(2 * n, ms)  # read + write


# --- fixtures ---------------------------------------------------------------------------------------


def make_device_pool(page_size: int) -> MHATokenToKVPool:
    pool = MHATokenToKVPool(DEVICE_SLOTS, page_size, FP8, HEADS, HEAD_DIM, LAYERS, DEVICE, warmup=False)
    gen = torch.Generator(device=DEVICE).manual_seed(page_size)
    for b in pool.k_buffer + pool.v_buffer:
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, device=DEVICE, generator=gen))  # never time zeros
    return pool


def random_device_pages(tokens: int, page_size: int, gen: torch.Generator) -> torch.Tensor:
    pages = torch.randperm(DEVICE_SLOTS // page_size - 1, generator=gen)[: tokens // page_size] + 1
    return (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1).to(DEVICE)


def host_pages(host: MHATokenToKVPoolHost, tokens: int, gen: torch.Generator, order: str) -> torch.Tensor:
    """``tokens`` host slots from ``alloc``: in its order (``allocated``), or its pages shuffled.
    ``allocated`` starts from a fresh free list when nothing is allocated, so the pages are
    consecutive (after shuffled pages were freed, ``alloc`` hands them out in their shuffled order)."""
    if order == "allocated" and host.available_size() == host.size:
        host.clear()
    slots = host.alloc(tokens)
    if order == "allocated":
        return slots
    pages = slots.view(-1, host.page_size)
    return pages[torch.randperm(pages.shape[0], generator=gen)].reshape(-1)


def direct_copies(host: MHATokenToKVPoolHost, slots: torch.Tensor, direction: str) -> int:
    """Copy-engine calls the direct backend makes for this transfer (its host-side cost)."""
    runs = direct_backend.runs(slots.numpy())[0].shape[0]
    if host.layout == "page_first" and direction == "load":
        return 2 * runs  # all layers travel together
    return 2 * runs * (LAYERS if host.layout == "layer_first" else 1)


# --- the measurements -------------------------------------------------------------------------------


def bench_pieces(args, rep: report.Report) -> None:
    gen = torch.Generator().manual_seed(5)
    measured: dict = {}
    for page_size in PAGE_SIZES:
        for layout in LAYOUTS:
            piece = piece_bytes(page_size, layout)
            if piece not in measured:
                measured[piece] = piece_ceiling(piece, args.reps, gen)
                rep.log(f"copy engine, {_size(piece)} pieces: d2h {measured[piece]['d2h_gbps']:.1f} GB/s, "
                        f"h2d {measured[piece]['h2d_gbps']:.1f} GB/s")  # fmt: skip
            rep.result["pieces"].append(dict(page_size=page_size, layout=layout, **measured[piece]))


def bench_transfers(args, rep: report.Report) -> None:
    ceiling, records = rep.result["ceiling"], rep.result["transfers"]
    gen = torch.Generator().manual_seed(0)
    for page_size in PAGE_SIZES:
        pool = make_device_pool(page_size)
        for layout in LAYOUTS:
            host = MHATokenToKVPoolHost(pool, 1.0, 0, page_size, layout)
            host.k_buffer.fill_(0x3C)  # touch every host page once before timing
            host.v_buffer.fill_(0xC3)
            for tokens, order in [(t, o) for t in args.tokens for o in args.host_orders]:
                if rep.over_budget(f"transfers {tokens} tokens page {page_size} {layout} {order}"):
                    continue
                h = host_pages(host, tokens, gen, order)
                d = random_device_pages(tokens, page_size, gen)
                nbytes = tokens * TOKEN_BYTES
                for backend in args.backends:
                    for direction in ("backup", "load"):
                        rec = dict(tokens=tokens, page_size=page_size, layout=layout, backend=backend,
                                   direction=direction, bytes=nbytes, host_order=order)  # fmt: skip
                        case = f"{tokens:>6} tok page {page_size:>2} {layout:<11} {order:<9} {backend:<6} {direction:<6}"
                        copies = direct_copies(host, h, direction) if backend == "direct" else 0
                        if copies > args.max_copies:
                            rec["skipped"] = f"{copies} copy-engine calls"
                            records.append(rec)
                            rep.log(f"{case} skipped ({copies} copies)")
                            continue
                        if direction == "backup":
                            fn = lambda: host.backup_from_device_all_layer(pool, h, d, backend)  # noqa: E731
                        else:
                            # A new index tensor each call, as a scheduler's next load has: the host pool
                            # reuses a previous call's checked slots when handed the same tensor again
                            # (what a layer-by-layer controller does), which would hide a load's checks
                            # and index upload from its host time.
                            fn = lambda: host.load_to_device_all_layer(pool, h.clone(), d, backend)  # noqa: E731
                        ms = wall_ms(fn, args.reps)
                        ceil = ceiling["d2h_gbps"] if direction == "backup" else ceiling["h2d_gbps"]
                        rec.update(ms=ms, gbps=gbps(nbytes, ms), of_ceiling=gbps(nbytes, ms) / ceil, copies=copies,
                                   host_ms=host_ms(fn, args.reps))  # fmt: skip
                        if (backend == "kernel" or order == "allocated") and DEVICE == "cuda":
                            dev_ms = device_ms(fn, args.reps, (host.backup_stream, host.load_stream))
                            dev_ceil = ceiling["d2h_device_gbps"] if direction == "backup" else ceiling["h2d_device_gbps"]
                            rec.update(device_ms=dev_ms, device_of_ceiling=gbps(nbytes, dev_ms) / dev_ceil)
                        if direction == "load" and backend == "kernel":
                            # The same load with the counter registered: layer by layer, as a model
                            # waiting for each layer gets it (without, it is one launch).
                            pool.register_layer_transfer_counter(host.layer_transfer_counter)
                            per_layer = wall_ms(fn, args.reps)
                            pool.register_layer_transfer_counter(None)
                            rec.update(per_layer_ms=per_layer, per_layer_of_ceiling=gbps(nbytes, per_layer) / ceil)
                        records.append(rec)
                        rep.log(f"{case} {ms:8.2f} ms {rec['gbps']:6.1f} GB/s ({100 * rec['of_ceiling']:5.1f}%), host {rec['host_ms']:.2f} ms"
                                + (f", device time {100 * rec['device_of_ceiling']:5.1f}%" if "device_ms" in rec else "")
                                + (f"; layer by layer {100 * rec['per_layer_of_ceiling']:5.1f}%" if "per_layer_ms" in rec else ""))  # fmt: skip
                host.free(h)
                rep.save()
            del host
        del pool
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


def bench_bidirectional(args, rep: report.Report) -> None:
    ceiling, records = rep.result["ceiling"], rep.result["bidirectional"]
    gen = torch.Generator().manual_seed(2)
    tokens = TOKENS[0]  # 8k tokens each way
    pool = make_device_pool(16)
    for layout, order in [(lay, o) for lay in LAYOUTS for o in args.host_orders]:
        host = MHATokenToKVPoolHost(pool, 1.0, 0, 16, layout)
        h_out, h_in = host_pages(host, tokens, gen, order), host_pages(host, tokens, gen, order)
        d_out, d_in = random_device_pages(tokens, 16, gen), random_device_pages(tokens, 16, gen)
        host.backup_from_device_all_layer(pool, h_in, d_in, "kernel")  # something to load
        # The direct backend on shuffled pages is one copy per page and layer (page 16: 16 KiB
        # pieces), tens of thousands of copy-engine calls: timed on allocated pages only.
        runs = [(b, b) for b in args.backends if b == "kernel" or order == "allocated"]
        if order == "allocated" and set(BACKENDS) <= set(args.backends):
            runs += [("kernel", "direct"), ("direct", "kernel")]  # each direction on its own engine
        for backup_backend, load_backend in runs:

            def both():
                host.backup_from_device_all_layer(pool, h_out, d_out, backup_backend)  # enqueued first: runs alongside
                host.load_to_device_all_layer(pool, h_in, d_in, load_backend)

            ms = wall_ms(both, args.reps)
            rate = gbps(2 * tokens * TOKEN_BYTES, ms)
            backend = backup_backend if backup_backend == load_backend else f"{backup_backend} backup, {load_backend} load"
            records.append(dict(layout=layout, backend=backend, tokens=tokens, ms=ms, gbps=rate, of_ceiling=rate / ceiling["bidir_gbps"],
                                backup_programs=host.kernel_programs, load_programs=host.kernel_programs, host_order=order))  # fmt: skip
            rep.log(f"both ways {layout:<11} {order:<9} {backend:<22} {ms:8.2f} ms {rate:6.1f} GB/s together")
        del host
    del pool
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def bench_overlap(args, rep: report.Report) -> None:
    """Per-layer loads of 32 layers against 32 layers of a stand-in attention that reads each
    layer's loaded rows through the getters (waiting for that layer's event) and runs matmuls."""
    gen = torch.Generator().manual_seed(3)
    tokens = 8192
    pool = make_device_pool(16)
    # page_first direct loads move every layer together (nothing to overlap layer by layer); the
    # direct backend on shuffled pages is a copy per page and layer (hundreds of ms a load).
    layouts = {"layer_first": ("kernel", "direct"), "page_first": ("kernel",)}
    cases = [(layout, backend, programs, order, background)
             for layout in args.overlap_layouts for backend in layouts[layout] if backend in args.backends
             for programs in (args.overlap_programs if backend == "kernel" else [KERNEL_PROGRAMS])
             for order in args.host_orders if backend == "kernel" or order == "allocated"
             for background in args.overlap_background]  # fmt: skip
    for layout, backend, programs, order, background in cases:
        if rep.over_budget(f"overlap {layout} {backend} {order}"):
            continue
        host = MHATokenToKVPoolHost(pool, 1.0, 0, 16, layout, kernel_programs=programs)
        h = host_pages(host, tokens, gen, order)
        d = random_device_pages(tokens, 16, gen)
        host.backup_from_device_all_layer(pool, h, d, "kernel")
        rec = overlap_case(args, pool, host, h, d, backend, background)
        rec.update(layout=layout, backend=backend, tokens=tokens, programs=host.kernel_programs, host_order=order, background=background)
        rep.result["overlap"].append(rec)
        rep.log(f"overlap {layout:<11} {order:<9} {backend:<6} {'worker' if background else 'call  '} {host.kernel_programs} programs: "
                f"load {rec['load_ms']:7.2f} ms, compute {rec['compute_ms']:7.2f} ms ({rec['matmuls_per_layer']} matmuls/layer), "
                f"both {rec['overlapped_ms']:7.2f} ms: {rec['ratio']:.3f}x of the longer; matmul {rec.get('matmul_us', 0):.0f} us "
                f"beside the load, model starts {rec.get('model_start_us', 0):.0f} us after it")  # fmt: skip
        host.free(h)
        del host
        rep.save()
    del pool
    torch.cuda.empty_cache()


def overlap_case(args, pool, host, h: torch.Tensor, d: torch.Tensor, backend: str, background: bool) -> dict:
    # The counter is registered throughout: the load alone moves layer by layer as the overlapped
    # one does (without it, nothing waits per layer and the kernel backend takes one launch).
    pool.register_layer_transfer_counter(host.layer_transfer_counter)
    load = lambda: host.load_to_device_all_layer(pool, h, d, backend, background=background)  # noqa: E731
    # Alone, the load is timed until its work is queued and done (wait_for_loads: the host waits for
    # the worker thread to finish queueing; a synchronisation alone could come before that).
    t_load = wall_ms(lambda: (load(), host.wait_for_loads()), args.reps)
    # Matmuls per layer taking about as long as that layer's load (the hardest case to hide), sized
    # from the device time of a run of 20 (a single call's wall time includes its launch).
    x = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    one = event_ms(lambda: [torch.mm(x, w) for _ in range(20)], args.reps) / 20
    reps_per_layer = max(1, round(t_load / LAYERS / one))
    kbuf = torch.empty(d.shape[0], HEADS, HEAD_DIM, dtype=torch.uint8, device="cuda")

    def compute():
        y = x
        for layer in range(LAYERS):
            k, _ = pool.get_kv_buffer(layer)  # waits for this layer's load, on the GPU
            torch.index_select(k.view(torch.uint8), 0, d, out=kbuf)
            for _ in range(reps_per_layer):
                y = torch.mm(x, w)
        return y

    t_comp = wall_ms(compute, args.reps)

    def both():
        load()
        compute()

    t_both = wall_ms(both, args.reps)
    # One more overlapped run under the profiler: how long the matmuls take beside the copies, and
    # when the model's first kernel starts (after the host has queued the load).
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        both()
        torch.cuda.synchronize()
    path = os.path.join(args.out, f".overlap-trace-{os.getpid()}.json")
    prof.export_chrome_trace(path)
    stats = trace_stats(path)
    os.remove(path)
    pool.register_layer_transfer_counter(None)
    return dict(load_ms=t_load, compute_ms=t_comp, overlapped_ms=t_both, ratio=t_both / max(t_load, t_comp),
                matmuls_per_layer=reps_per_layer, **stats)  # fmt: skip


def trace_stats(path: str) -> dict:
    """Median matmul and copy kernel durations (us) in a profiled overlapped run, and when the first
    model kernel started after the load's first device work (a copy kernel or a copy-engine copy)."""
    with open(path) as f:
        trace = [e for e in json.load(f)["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy")]
    events = [e for e in trace if e["cat"] == "kernel"]
    if not events:
        return {}
    t0 = min(e["ts"] for e in trace)
    copies = [e for e in events if "copy_rows" in e["name"]]
    model = [e for e in events if "copy_rows" not in e["name"]]
    mm = [e for e in model if "gather" not in e["name"] and "index" not in e["name"].lower()]  # not index_select
    out = {}
    if mm:
        out["matmul_us"] = statistics.median(e["dur"] for e in mm)
    if copies:
        out["copy_us"] = statistics.median(e["dur"] for e in copies)
    if model:
        out["model_start_us"] = min(e["ts"] for e in model) - t0
    return out


def bench_device_gather(args, rep: report.Report) -> None:
    pool = make_device_pool(1)
    tokens = min(32768, DEVICE_SLOTS - 1)
    staging = [torch.empty(tokens, HEADS, HEAD_DIM, dtype=torch.uint8, device=DEVICE) for _ in range(2 * LAYERS)]
    table = C.RowTable.of(staging)
    d = random_device_pages(tokens, 1, torch.Generator().manual_seed(4))
    pos = torch.arange(tokens, device=DEVICE)
    ms = wall_ms(lambda: C.copy_rows(table, pos, pool.row_table, d), args.reps)
    rate = gbps(2 * tokens * TOKEN_BYTES, ms)  # read + write, as the ceiling
    ceiling = rep.result["device_ceiling_gbps"]
    rep.result["device_gather"].append(dict(tokens=tokens, buffers=2 * LAYERS, ms=ms, gbps=rate, of_ceiling=rate / ceiling))
    rep.log(f"device gather {tokens} tokens x {2 * LAYERS} buffers: {ms:.3f} ms, {rate:.0f} GB/s ({100 * rate / ceiling:.1f}% of a device copy)")


# --- report -----------------------------------------------------------------------------------------


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB" if nbytes >= 1 << 10 else f"{nbytes} B"


def _pct_range(values: list) -> str:
    return f"{100 * min(values):.1f}-{100 * max(values):.1f}%"


def _key(r: dict) -> tuple:
    return (r["tokens"], r["page_size"], r["layout"], r.get("host_order", "shuffled"), r["direction"])


def verdicts(res: dict) -> list[str]:
    """The targets, judged on what this run measured (a stage or backend that did not run is said to
    be not measured, never judged), for each host page order that ran."""
    out = []
    rows = [r for r in res["transfers"] if "gbps" in r]
    for order in [o for o in HOST_ORDERS if any(r.get("host_order", "shuffled") == o for r in rows)]:
        mine = [r for r in rows if r.get("host_order", "shuffled") == order]
        backends = sorted({r["backend"] for r in mine})
        best, kern = [], []
        for key in sorted({_key(r) for r in mine}):
            case = [r for r in mine if _key(r) == key]
            best.append(max(r["of_ceiling"] for r in case))
            kern.append(max((r["of_ceiling"] for r in case if r["backend"] == "kernel"), default=0.0))
        which = "" if set(backends) == set(BACKENDS) else f" (only the {', '.join(backends)} backend timed)"
        out.append(f"host pages {order}: better backend >= 95% of the ceiling in every case{which}: "
                   f"{'met' if min(best) >= 0.95 else 'missed'} (best per case {_pct_range(best)})")  # fmt: skip
        if "kernel" in backends:
            out.append(f"host pages {order}: kernel backend (8 programs) >= 90% in every case: "
                       f"{'met' if min(kern) >= 0.90 else 'missed'} ({_pct_range(kern)})")  # fmt: skip
        for backend in backends:
            device = [r["device_of_ceiling"] for r in mine if r["backend"] == backend and "device_of_ceiling" in r]
            if device:
                out.append(f"host pages {order}: {backend} backend on device time alone: {_pct_range(device)} of the copy engine's device time")
    c = res["ceiling"]
    if "h2d_device_gbps" in c and min(c["h2d_device_gbps"] / c["h2d_gbps"], c["d2h_device_gbps"] / c["d2h_gbps"]) < 0.95:
        # The same 1 GiB copies timed two ways differ only by launch latency; a gap means the link
        # was disturbed while one of them ran.
        out.append(f"WARNING: the ceiling's device-time copies ({c['h2d_device_gbps']:.1f} / {c['d2h_device_gbps']:.1f} GB/s) ran "
                   f"below its wall-time copies ({c['h2d_gbps']:.1f} / {c['d2h_gbps']:.1f}): this run's device-time percentages are void")  # fmt: skip
    for name, records, rank, line in (
        ("backup and load at once", res["bidirectional"], lambda r: -r["gbps"],
         lambda t: f">= 90 GB/s: best {t['gbps']:.1f} GB/s ({t['backend']}, {t['layout']}), {'met' if t['gbps'] >= 90 else 'missed'}"),
        ("overlapped per-layer load", res["overlap"], lambda r: r["ratio"],
         lambda t: f"within 1.1x of the longer alone: best {t['ratio']:.3f}x ({t['backend']}, {t['layout']}"
                   f"{', queued by the worker thread' if t.get('background') else ''}), {'met' if t['ratio'] <= 1.1 else 'missed'}"),
    ):  # fmt: skip
        for order in HOST_ORDERS:
            mine = [r for r in records if r.get("host_order", "shuffled") == order]
            if mine:
                out.append(f"host pages {order}: {name} {line(min(mine, key=rank))}")
    return out


def markdown(res: dict) -> str:
    c = res["ceiling"]
    pieces = {(p["page_size"], p["layout"]): p for p in res.get("pieces", [])}
    lines = [
        "Llama-3-8B FP8 KV (32 layers, H=8, D=128, 64 KiB per token); random device pages; host pages shuffled or as "
        "allocated; wall time from the call to completion, medians.",
        "",
        f"Copy-engine ceiling (1 GiB pinned): host-to-device {c['h2d_gbps']:.1f} GB/s, device-to-host {c['d2h_gbps']:.1f} GB/s, "
        f"both at once {c['bidir_gbps']:.1f} GB/s; on device time {c.get('h2d_device_gbps', float('nan')):.1f} / "
        f"{c.get('d2h_device_gbps', float('nan')):.1f} GB/s. Device copy {res['device_ceiling_gbps']:.0f} GB/s.",
    ]
    if pieces:
        lines += ["", "Copy engine in pieces of one host page (device time, d2h / h2d GB/s): " + ", ".join(
            f"{_size(b)} {p['d2h_gbps']:.1f} / {p['h2d_gbps']:.1f}" for b, p in sorted({p["piece_bytes"]: p for p in pieces.values()}.items()))]  # fmt: skip
    lines += ["", "## Targets", "", *[f"- {v}" for v in verdicts(res)], ""]
    lines += [
        "## Backup (device to host) and load (host to device), GB/s (% of the ceiling)", "",
        "| tokens | page | layout | host pages | direction | kernel | kernel, layer by layer | direct | host ms (kernel) "
        "| kernel, device time | direct, device time |" + (" copy engine, one-page pieces |" if pieces else ""),
        "|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if pieces else ""),
    ]  # fmt: skip
    for key in sorted({_key(r) for r in res["transfers"]}):
        cells, host, per_layer, device = [], "-", "-", {b: "-" for b in BACKENDS}
        for backend in BACKENDS:
            found = [r for r in res["transfers"] if _key(r) == key and r["backend"] == backend]
            if not found:
                cells.append("-")
                continue
            r = found[0]
            cells.append(f"skipped ({r['skipped']})" if "skipped" in r else f"{r['gbps']:.1f} ({100 * r['of_ceiling']:.1f}%)")
            if "device_ms" in r:
                device[backend] = f"{gbps(r['bytes'], r['device_ms']):.1f} ({100 * r['device_of_ceiling']:.1f}%)"
            if backend == "kernel":
                host = f"{r['host_ms']:.2f}" if "host_ms" in r else "-"
                if "per_layer_ms" in r:
                    per_layer = f"{gbps(r['bytes'], r['per_layer_ms']):.1f} ({100 * r['per_layer_of_ceiling']:.1f}%)"
        p = pieces.get((key[1], key[2]))
        piece = (f" {p['d2h_gbps' if key[4] == 'backup' else 'h2d_gbps']:.1f} |" if p else " - |") if pieces else ""
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {key[4]} | {cells[0]} | {per_layer} | {cells[1]} | {host} "
                     f"| {device['kernel']} | {device['direct']} |{piece}")  # fmt: skip
    if res["bidirectional"]:
        lines += ["", "## Both directions at once (8k tokens each way, page 16)", "",
                  "| layout | host pages | backend | GB/s together | of the copy engine both ways |", "|---|---|---|---:|---:|"]  # fmt: skip
        lines += [f"| {r['layout']} | {r.get('host_order', 'shuffled')} | {r['backend']} | {r['gbps']:.1f} | {100 * r['of_ceiling']:.1f}% |"
                  for r in res["bidirectional"]]  # fmt: skip
    if res["overlap"]:
        lines += ["", "## Per-layer load overlapped with a stand-in attention (8k tokens, 32 layers)", "",
                  "| layout | host pages | backend | load queued by | load ms | compute ms (matmuls) | both ms | ratio "
                  "| matmul us beside the load | model starts (us after the load) |",
                  "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in res["overlap"]:
        backend = r["backend"] + (f", {r['programs']} programs" if r["backend"] == "kernel" and "programs" in r else "")
        lines.append(f"| {r['layout']} | {r.get('host_order', 'shuffled')} | {backend} | {'worker thread' if r.get('background') else 'the call'} "
                     f"| {r['load_ms']:.2f} | {r['compute_ms']:.2f} ({r['matmuls_per_layer']}/layer) | {r['overlapped_ms']:.2f} | {r['ratio']:.3f} "
                     f"| {r.get('matmul_us', 0):.0f} | {r.get('model_start_us', 0):.0f} |")  # fmt: skip
    for r in res["device_gather"]:
        lines += ["", f"copy_rows device gather, {r['tokens']} tokens x {r['buffers']} buffers: {r['gbps']:.0f} GB/s "
                  f"({100 * r['of_ceiling']:.1f}% of a device copy)"]  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(res: dict, fig) -> None:
    """Each case's share of the copy-engine ceiling, kernel and direct backends, backup and load."""
    rows = [r for r in res["transfers"] if "gbps" in r]
    orders = [o for o in HOST_ORDERS if any(r.get("host_order", "shuffled") == o for r in rows)]
    axes = fig.subplots(1, len(orders), sharey=True, squeeze=False)[0]
    for ax, order in zip(axes, orders):
        keys = sorted({_key(r)[:3] for r in rows if r.get("host_order", "shuffled") == order})
        for i, (backend, direction) in enumerate([(b, d) for b in BACKENDS for d in ("backup", "load")]):
            vals = []
            for key in keys:
                found = [r for r in rows if _key(r)[:3] == key and r.get("host_order", "shuffled") == order
                         and r["backend"] == backend and r["direction"] == direction]  # fmt: skip
                vals.append(100 * found[0]["of_ceiling"] if found else 0)
            ax.bar([x + (i - 1.5) * 0.2 for x in range(len(keys))], vals, 0.2, label=f"{backend} {direction}")
        ax.axhline(100, color="k", linestyle="--", linewidth=0.8)
        ax.set_xticks(range(len(keys)), [f"{t // 1024}k, page {p}\n{lay}" for t, p, lay in keys], fontsize=6)
        ax.set_title(f"host pages {order}", fontsize=9)
    axes[0].set_ylabel("% of the 1 GiB copy-engine ceiling (wall time)")
    axes[0].set_ylim(0, 110)
    axes[0].legend(fontsize=7, loc="lower left")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    report.add_common_arguments(parser, "host-tier")
    parser.add_argument("--quick", action="store_true", help="8k tokens only, 3 repetitions")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per measurement (default 5, quick 3)")
    parser.add_argument("--max-copies", type=int, default=40_000, help="skip direct cases needing more copy-engine calls")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated io backends to time")
    parser.add_argument("--host-orders", default=",".join(HOST_ORDERS), help="comma-separated host page orders")
    parser.add_argument("--stages", default=",".join(STAGES), help="comma-separated stages to run")
    parser.add_argument("--overlap-programs", default=str(KERNEL_PROGRAMS), metavar="N,...",
                        help="kernel backend grids for the overlap stage (default: the host pool's default)")
    parser.add_argument("--overlap-layouts", default=",".join(LAYOUTS), help="host layouts for the overlap stage")
    parser.add_argument("--overlap-background", default="off,on", metavar="off,on",
                        help="overlap stage: the load queued by the call (off), by the host pool's worker thread (on)")
    args = parser.parse_args()
    args.backends = [b for b in args.backends.split(",") if b]
    args.host_orders = [o for o in args.host_orders.split(",") if o]
    stages = [s for s in args.stages.split(",") if s]
    for name, values, allowed in (("backends", args.backends, BACKENDS), ("host-orders", args.host_orders, HOST_ORDERS),
                                  ("stages", stages, STAGES)):  # fmt: skip
        if not values or set(values) - set(allowed):
            parser.error(f"--{name} must name some of {', '.join(allowed)}, got {values}")
    modes = [x for x in args.overlap_background.split(",") if x]
    if not modes or set(modes) - {"off", "on"}:
        parser.error(f"--overlap-background must be off, on or off,on, got {args.overlap_background!r}")
    args.overlap_background = [m == "on" for m in modes]
    args.overlap_programs = [int(x) for x in args.overlap_programs.split(",") if x]
    args.overlap_layouts = [x for x in args.overlap_layouts.split(",") if x]
    if args.cpu_smoke:
        configure_smoke()
        stages = [s for s in stages if s != "overlap"]  # the stand-in attention needs CUDA matmuls and a profiler
    elif not torch.cuda.is_available():
        parser.error("needs a CUDA device (--cpu-smoke checks the script on the CPU)")
    args.tokens = [8192] if args.quick else TOKENS
    args.reps = args.reps or (3 if args.quick or args.cpu_smoke else 5)
    rep = report.Report(args, "bench_host_tier", "Host tier", markdown, plot)
    if DEVICE == "cuda":
        ceiling, device_ceiling = copy_engine_ceiling(args.reps), device_copy_ceiling(args.reps)
    else:  # nothing to compare with: every rate is its own ceiling's multiple
        ceiling, device_ceiling = {"h2d_gbps": 1.0, "d2h_gbps": 1.0, "bidir_gbps": 1.0}, 1.0
    rep.result.update(ceiling=ceiling, device_ceiling_gbps=device_ceiling, pieces=[], transfers=[], bidirectional=[],
                      overlap=[], device_gather=[])  # fmt: skip
    rep.log(f"ceiling: h2d {ceiling['h2d_gbps']:.1f} GB/s, d2h {ceiling['d2h_gbps']:.1f} GB/s, both {ceiling['bidir_gbps']:.1f} GB/s; "
            f"device copy {device_ceiling:.0f} GB/s")  # fmt: skip
    run = {"transfers": bench_transfers, "bidirectional": bench_bidirectional, "overlap": bench_overlap,
           "device_gather": bench_device_gather}  # fmt: skip
    if "transfers" in stages:
        stages = ["pieces", *stages]
        run["pieces"] = bench_pieces
    for name in stages:
        rep.log(f"== {name}")
        try:
            run[name](args, rep)
        except Exception as exc:  # keep the other stages' results; report the failure
            rep.error(name, exc)
        rep.save()
    rep.save(final=True)
    return 1 if rep.result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
