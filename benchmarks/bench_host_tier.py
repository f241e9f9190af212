"""The host tier on a GPU: KV backup and load between an FP8 device pool and pinned host memory.

Shapes: Llama-3-8B with an FP8 KV cache (32 layers, 8 KV heads, head_dim 128: 64 KiB per token over
all layers), 8k and 32k tokens, device pages in random order, page sizes 1, 16 and 64, both host
layouts, both backends (``kernel``: copy_rows on a grid of 8 programs; ``direct``: the copy engine).
Host pages in two orders (``--host-orders``): ``shuffled`` (the pages a host pool hands out after
long churn: every page on its own) and ``allocated`` (as ``alloc`` hands them out from a fresh host
pool: consecutive, so the direct backend's copies are a layer's whole run). Against the copy-engine ceiling measured in the same run: one 1 GiB pinned copy each way,
and both directions at once on two streams.

Measured (medians of wall time from the call to completion, ``torch.cuda.synchronize`` around each
repetition, so the host's enqueue cost counts, as it does for a scheduler):

1. backup (all layers) and load (all layers: one launch for the kernel backend, since nothing waits
   per layer; the same load layer by layer, with the layer-transfer counter registered, beside it)
   GB/s per case; the targets: the better
   backend >= 95% of the ceiling in each direction, the kernel backend >= 90%. The kernel backend is
   also timed on device time alone (CUDA events, the GPU held in a sleep kernel while the host
   queues the call), against the copy engine's 1 GiB copies timed the same way: what the transfer
   costs a scheduler that queues it ahead of time, without the call's host time (0.16-1.1 ms per
   call on the H200 machines, up to 8.5% of an 8k-token transfer's wall time);
2. backup and load at once (two streams) >= 90 GB/s together;
3. a per-layer load of 32 layers overlapped with 32 layers of a stand-in attention (a bf16 matmul per
   layer sized to take as long as that layer's load, reading the loaded rows through the getters with
   the layer-transfer counter registered): finishes within 1.1x of max(load alone, compute alone);
   each case with the load queued by the call before the model's work, and with it queued by the
   host pool's worker thread (``background=True``) while the model's work is queued;
4. copy_rows device-to-device (gather of 32k tokens over 64 buffers) against a 2 GiB device copy.

``--sweep`` also times the kernel backend's alternative tiles and grids (8k tokens) for the tile
table in ``kvpool/kernels/copy_rows.py``. Direct-backend cases that would need more than
``--max-copies`` copy-engine calls (one per run of host slots per K/V, per layer for layer_first)
are reported as skipped.

Usage (on a GPU): python benchmarks/bench_host_tier.py --out DIR [--quick] [--sweep]
Writes DIR/host_tier.json and DIR/host_tier.md. ``--cpu-smoke`` runs the transfers, both-ways and
device-gather stages and the report on small CPU pools, timing nothing that means anything: it checks
the script against the library.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

import torch
import triton

from kvpool import MHATokenToKVPool
from kvpool.kernels import copy_rows as C
from kvpool.host import MHATokenToKVPoolHost, direct_backend
from kvpool.host.kernel_backend import KERNEL_PROGRAMS

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import event_ms  # noqa: E402

LAYERS, HEADS, HEAD_DIM = 32, 8, 128
TOKEN_BYTES = LAYERS * 2 * HEADS * HEAD_DIM  # FP8: 64 KiB per token, K and V of every layer
TOKENS = [8192, 32768]
PAGE_SIZES = [1, 16, 64]
LAYOUTS = ["layer_first", "page_first"]
BACKENDS = ["kernel", "direct"]
HOST_ORDERS = ["shuffled", "allocated"]
DEVICE_SLOTS = 36864  # holds 32k tokens plus room
DEVICE = "cuda"
FP8 = torch.float8_e4m3fn
SWEEP_TILES = [C.Tile(8192, 8), C.Tile(16384, 16), C.Tile(32768, 32), C.Tile(4096, 4)]
SWEEP_PROGRAMS = [8, 16]


def configure_smoke() -> None:
    """--cpu-smoke: CPU pools of a few layers and tokens (the shapes' names no longer apply)."""
    global LAYERS, HEADS, HEAD_DIM, TOKEN_BYTES, TOKENS, PAGE_SIZES, DEVICE_SLOTS, DEVICE
    LAYERS, HEADS, HEAD_DIM, TOKENS, PAGE_SIZES, DEVICE_SLOTS, DEVICE = 3, 2, 16, [64], [1, 16], 512, "cpu"
    TOKEN_BYTES = LAYERS * 2 * HEADS * HEAD_DIM


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def log(msg: str) -> None:
    print(msg, flush=True)


def wall_ms(fn, reps: int, warmup: int = 1) -> float:
    """Median milliseconds from the call to the completion of everything it enqueued."""
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


@contextlib.contextmanager
def copy_tile(tile):
    """Every capped copy_rows grid (any program count) takes ``tile`` (None: the tile table's own)."""
    if tile is None:
        yield
        return
    saved = C.FEW_PROGRAMS_TILE, C.FEW_PROGRAMS
    C.FEW_PROGRAMS_TILE, C.FEW_PROGRAMS = tile, 1 << 30
    try:
        yield
    finally:
        C.FEW_PROGRAMS_TILE, C.FEW_PROGRAMS = saved


def parse_tiles(text: str) -> list:
    """"default,1024/1/32" -> [None, Tile(1024, 1, maxnreg=32)]."""
    out = []
    for item in text.split(","):
        if item == "default":
            out.append(None)
        elif item:
            parts = [int(x) for x in item.split("/")]
            out.append(C.Tile(parts[0], parts[1], parts[2] if len(parts) > 2 else None))
    return out


def profile_host(args, records: list) -> None:
    """Where a call's host time goes: cProfile of 20 backups and 20 all-layer loads (8k tokens), top
    functions by own time: the kernel backend for page 16 layer_first and page 1 with either layout
    (shuffled host pages), the direct backend for page 16 with either layout (host pages as
    allocated), its loads also layer by layer (the counter registered). Only the backends in
    ``--backends``."""
    import cProfile
    import io
    import pstats

    cases = [("kernel", 16, "layer_first", "shuffled"), ("kernel", 1, "layer_first", "shuffled"),
             ("kernel", 1, "page_first", "shuffled"), ("direct", 16, "layer_first", "allocated"),
             ("direct", 16, "page_first", "allocated")]  # fmt: skip
    for backend, page, layout, order in cases:
        if backend not in args.backends:
            continue
        gen = torch.Generator().manual_seed(5)
        pool = make_device_pool(page)
        host = MHATokenToKVPoolHost(pool, 1.0, 0, page, layout)
        h = host_pages(host, 8192, gen, order)
        d = random_device_pages(8192, page, gen)
        calls = {
            "backup": lambda: host.backup_from_device_all_layer(pool, h, d, backend),
            "load": lambda: host.load_to_device_all_layer(pool, h.clone(), d, backend),
        }
        if backend == "direct":
            calls["load layer by layer"] = calls["load"]
        for name, fn in calls.items():
            per_layer = name == "load layer by layer"
            pool.register_layer_transfer_counter(host.layer_transfer_counter if per_layer else None)
            fn()
            torch.cuda.synchronize()
            prof = cProfile.Profile()
            for _ in range(20):
                prof.enable()
                fn()
                prof.disable()
                torch.cuda.synchronize()
            pool.register_layer_transfer_counter(None)
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
            records.append(dict(call=name, backend=backend, page_size=page, layout=layout, host_order=order,
                                profile=text.getvalue()))  # fmt: skip
            log(f"  host profile of 20 {name} calls, {backend}, page {page}, {layout}, {order} host pages:\n{text.getvalue()}")
        host.free(h)
        del host, pool
        torch.cuda.empty_cache()


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


#: Sleep-kernel cycles before a device-time measurement starts (about 10 ms on an H200): longer than
#: any call's host time, so the host has queued the whole call when the GPU reaches it.
HOLD = 20_000_000


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


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
    # The same copies on device time (the kernel backend's device-time figures are against these).
    out["h2d_device_gbps"] = gbps(n, event_ms(lambda: dev_a.copy_(host_a, non_blocking=True), reps, hold_cycles=HOLD))
    out["d2h_device_gbps"] = gbps(n, event_ms(lambda: host_b.copy_(dev_b, non_blocking=True), reps, hold_cycles=HOLD))
    del host_a, host_b, dev_a, dev_b
    return out


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


def random_host_pages(host: MHATokenToKVPoolHost, tokens: int, gen: torch.Generator) -> torch.Tensor:
    return host_pages(host, tokens, gen, "shuffled")


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


def bench_transfers(args, ceiling: dict, records: list) -> None:
    gen = torch.Generator().manual_seed(0)
    for page_size in PAGE_SIZES:
        pool = make_device_pool(page_size)
        for layout in LAYOUTS:
            host = MHATokenToKVPoolHost(pool, 1.0, 0, page_size, layout)
            host.k_buffer.fill_(0x3C)  # touch every host page once before timing
            host.v_buffer.fill_(0xC3)
            for tokens, order in [(t, o) for t in args.tokens for o in args.host_orders]:
                h = host_pages(host, tokens, gen, order)
                d = random_device_pages(tokens, page_size, gen)
                nbytes = tokens * TOKEN_BYTES
                for backend in args.backends:
                    for direction in ("backup", "load"):
                        rec = dict(tokens=tokens, page_size=page_size, layout=layout, backend=backend,
                                   direction=direction, bytes=nbytes, host_order=order)  # fmt: skip
                        copies = direct_copies(host, h, direction) if backend == "direct" else 0
                        if copies > args.max_copies:
                            rec["skipped"] = f"{copies} copy-engine calls"
                            records.append(rec)
                            log(f"  {tokens:>6} tok page {page_size:>2} {layout:<11} {order:<9} {backend:<6} {direction:<6} "
                                f"skipped ({copies} copies)")  # fmt: skip
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
                        enqueue = host_ms(fn, args.reps)
                        ceil = ceiling["d2h_gbps"] if direction == "backup" else ceiling["h2d_gbps"]
                        rec.update(ms=ms, gbps=gbps(nbytes, ms), of_ceiling=gbps(nbytes, ms) / ceil, copies=copies,
                                   host_ms=enqueue)  # fmt: skip
                        if (backend == "kernel" or order == "allocated") and DEVICE == "cuda":
                            dev_ms = event_ms(fn, args.reps, (host.backup_stream, host.load_stream), hold_cycles=HOLD)
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
                        log(f"  {tokens:>6} tok page {page_size:>2} {layout:<11} {order:<9} {backend:<6} {direction:<6} "
                            f"{ms:8.2f} ms {rec['gbps']:6.1f} GB/s ({100 * rec['of_ceiling']:5.1f}%), host {enqueue:.2f} ms"
                            + (f", device time {100 * rec['device_of_ceiling']:5.1f}%" if "device_ms" in rec else "")
                            + (f"; layer by layer {100 * rec['per_layer_of_ceiling']:5.1f}%" if "per_layer_ms" in rec else ""))  # fmt: skip
                host.free(h)
            del host
        del pool
        torch.cuda.empty_cache()


def bench_sweep(args, ceiling: dict, records: list) -> None:
    gen = torch.Generator().manual_seed(1)
    default_tile, default_programs = C.FEW_PROGRAMS_TILE, None
    for page_size in (1, 16):
        pool = make_device_pool(page_size)
        for layout in LAYOUTS:
            host = MHATokenToKVPoolHost(pool, 1.0, 0, page_size, layout)
            default_programs = host.kernel_programs
            h = random_host_pages(host, 8192, gen)
            d = random_device_pages(8192, page_size, gen)
            for tile in SWEEP_TILES:
                for programs in SWEEP_PROGRAMS:
                    C.FEW_PROGRAMS_TILE = tile
                    host.kernel_programs = programs
                    try:
                        for direction in ("backup", "load"):
                            if direction == "backup":
                                fn = lambda: host.backup_from_device_all_layer(pool, h, d, "kernel")  # noqa: E731
                            else:
                                fn = lambda: host.load_to_device_all_layer(pool, h, d, "kernel")  # noqa: E731
                            ms = wall_ms(fn, args.reps)
                            nbytes = 8192 * TOKEN_BYTES
                            ceil = ceiling["d2h_gbps"] if direction == "backup" else ceiling["h2d_gbps"]
                            rec = dict(page_size=page_size, layout=layout, direction=direction, tile_elems=tile.elems,
                                       num_warps=tile.num_warps, programs=programs, gbps=gbps(nbytes, ms),
                                       of_ceiling=gbps(nbytes, ms) / ceil)  # fmt: skip
                            records.append(rec)
                            log(f"  sweep page {page_size:>2} {layout:<11} {direction:<6} tile {tile.elems:>5}/{tile.num_warps:>2}w "
                                f"{programs:>2} programs: {rec['gbps']:6.1f} GB/s ({100 * rec['of_ceiling']:5.1f}%)")  # fmt: skip
                    finally:
                        C.FEW_PROGRAMS_TILE = default_tile
                        host.kernel_programs = default_programs
            del host
        del pool
        torch.cuda.empty_cache()


def bench_bidirectional(args, ceiling: dict, records: list) -> None:
    gen = torch.Generator().manual_seed(2)
    tokens = TOKENS[0]  # 8k tokens each way
    pool = make_device_pool(16)
    for layout, order in [(lay, o) for lay in LAYOUTS for o in args.host_orders]:
        host = MHATokenToKVPoolHost(pool, 1.0, 0, 16, layout)
        h_out, h_in = host_pages(host, tokens, gen, order), host_pages(host, tokens, gen, order)
        d_out, d_in = random_device_pages(tokens, 16, gen), random_device_pages(tokens, 16, gen)
        host.backup_from_device_all_layer(pool, h_in, d_in, "kernel")  # something to load
        default = host.kernel_programs
        # The direct backend on shuffled pages is one copy per page and layer (page 16: 16 KiB
        # pieces), tens of thousands of copy-engine calls: timed on allocated pages only.
        runs = [(backend, backend, default, default) for backend in args.backends if backend == "kernel" or order == "allocated"]
        runs += [("kernel", "kernel", b, ld) for b, ld in args.bidir_programs if (b, ld) != (default, default)]
        if order == "allocated" and set(BACKENDS) <= set(args.backends):
            # Each direction on its own engine: the kernel's backup costs the host a fraction of the
            # direct one's, so the load (queued after it) starts sooner.
            runs += [("kernel", "direct", default, default), ("direct", "kernel", default, default)]
        for backup_backend, load_backend, backup_programs, load_programs in runs:

            def both():
                host.kernel_programs = backup_programs  # read when a transfer is enqueued
                host.backup_from_device_all_layer(pool, h_out, d_out, backup_backend)  # enqueued first: runs alongside
                host.kernel_programs = load_programs
                host.load_to_device_all_layer(pool, h_in, d_in, load_backend)

            ms = wall_ms(both, args.reps)
            host.kernel_programs = default
            rate = gbps(2 * tokens * TOKEN_BYTES, ms)
            backend = backup_backend if backup_backend == load_backend else f"{backup_backend} backup, {load_backend} load"
            records.append(dict(layout=layout, backend=backend, tokens=tokens, ms=ms, gbps=rate,
                                of_ceiling=rate / ceiling["bidir_gbps"], backup_programs=backup_programs,
                                load_programs=load_programs, host_order=order))  # fmt: skip
            log(f"  both ways {layout:<11} {order:<9} {backend:<22} programs {backup_programs:>2}/{load_programs:>2} "
                f"{ms:8.2f} ms {rate:6.1f} GB/s together")
        del host
    del pool
    torch.cuda.empty_cache()


def bench_overlap(args, records: list) -> None:
    """Per-layer loads of 32 layers against 32 layers of a stand-in attention that reads each
    layer's loaded rows through the getters (waiting for that layer's event) and runs a matmul."""
    gen = torch.Generator().manual_seed(3)
    tokens = 8192
    pool = make_device_pool(16)
    # page_first direct loads move every layer together (nothing to overlap layer by layer); the
    # direct backend on shuffled pages is a copy per page and layer (session 7: 470 ms a load).
    layouts = {"layer_first": ("kernel", "direct"), "page_first": ("kernel",)}
    cases = [(layout, backend, programs, tile, order, background)
             for layout in args.overlap_layouts for backend in layouts[layout] if backend in args.backends
             for programs in (args.overlap_programs if backend == "kernel" else [None])
             for tile in (args.overlap_tiles if backend == "kernel" else [None])
             for order in args.host_orders if backend == "kernel" or order == "allocated"
             for background in args.overlap_background]  # fmt: skip
    for layout, backend, programs, tile, order, background in cases:
        host = MHATokenToKVPoolHost(pool, 1.0, 0, 16, layout, kernel_programs=programs or KERNEL_PROGRAMS)
        h = host_pages(host, tokens, gen, order)
        d = random_device_pages(tokens, 16, gen)
        host.backup_from_device_all_layer(pool, h, d, "kernel")
        with copy_tile(tile):
            rec = overlap_case(args, pool, host, h, d, backend, order, background)
        tile_name = "default" if tile is None else f"{tile.elems}/{tile.num_warps}" + (f"/{tile.maxnreg}" if tile.maxnreg else "")
        rec.update(layout=layout, backend=backend, tokens=tokens, programs=host.kernel_programs, tile=tile_name,
                   host_order=order, background=background)  # fmt: skip
        records.append(rec)
        log(f"  overlap {layout:<11} {order:<9} {backend:<6} {'background' if background else 'queued    '} {host.kernel_programs} programs, "
            f"tile {tile_name}: load {rec['load_ms']:7.2f} ms, compute {rec['compute_ms']:7.2f} ms "
            f"({rec['matmuls_per_layer']} matmuls/layer), both {rec['overlapped_ms']:7.2f} ms: {rec['ratio']:.3f}x of the longer; "
            f"profiled: matmul {rec.get('matmul_us', 0):.0f} us, copy {rec.get('copy_us', 0):.0f} us "
            f"({rec.get('copy_regs')} regs), model starts at {rec.get('model_start_us', 0):.0f} us")  # fmt: skip
        host.free(h)
        del host
    del pool
    torch.cuda.empty_cache()


def overlap_case(args, pool, host, h: torch.Tensor, d: torch.Tensor, backend: str, order: str = "",
                 background: bool = False) -> dict:  # fmt: skip
    # The counter is registered throughout: the load alone moves layer by layer as the overlapped
    # one does (without it, nothing waits per layer and the kernel backend takes one launch).
    # ``background``: the host pool's worker thread queues the layers while the model is queued.
    pool.register_layer_transfer_counter(host.layer_transfer_counter)
    load = lambda: host.load_to_device_all_layer(pool, h, d, backend, background=background)  # noqa: E731
    # Alone, the load is timed until its work is queued and done (wait_for_loads: the host waits for
    # the worker thread to finish queueing; a synchronisation alone could come before that).
    t_load = wall_ms(lambda: (load(), host.wait_for_loads()), args.reps)
    # Matmuls per layer taking about as long as that layer's load (the hardest case to hide). One
    # matmul's time is the device time of a run of 20 (a single call's wall time includes the
    # launch and the synchronisation, which made this count swing between 2 and 4).
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
    # One more overlapped run under the profiler: how long the matmuls take beside the copies (a
    # copy program holding an SM pushes a matmul's CTAs into another wave), and when the model's
    # first kernel starts (after the host has queued the whole load).
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        both()
        torch.cuda.synchronize()
    tile = C.FEW_PROGRAMS_TILE
    name = (f"overlap_{host.layout}_{order}_{backend}_{'background_' if background else ''}"
            f"{host.kernel_programs}_{tile.elems}x{tile.num_warps}.json")  # fmt: skip
    path = os.path.join(args.out, name)
    prof.export_chrome_trace(path)
    stats = trace_stats(path)
    if not args.trace:
        os.remove(path)
    pool.register_layer_transfer_counter(None)
    return dict(load_ms=t_load, compute_ms=t_comp, overlapped_ms=t_both, ratio=t_both / max(t_load, t_comp),
                matmuls_per_layer=reps_per_layer, **stats)  # fmt: skip


def trace_stats(path: str) -> dict:
    """Median matmul and copy kernel durations (us) in a profiled overlapped run, the matmul's
    registers and threads per CTA, and when the first model kernel started after the load's first
    device work (a copy kernel, or the direct backend's first copy-engine transfer)."""
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
        out.update(matmul_us=statistics.median(e["dur"] for e in mm), matmul_regs=mm[0]["args"].get("registers per thread"),
                   matmul_block=mm[0]["args"].get("block"), matmul_grid=mm[0]["args"].get("grid"))  # fmt: skip
    if copies:
        out.update(copy_us=statistics.median(e["dur"] for e in copies), copy_regs=copies[0]["args"].get("registers per thread"))
    if model:
        out["model_start_us"] = min(e["ts"] for e in model) - t0
    return out


def bench_device_gather(args, device_ceiling: float, records: list) -> None:
    tokens = 32768
    pool = make_device_pool(1)
    tokens = min(tokens, DEVICE_SLOTS - 1)
    staging = [torch.empty(tokens, HEADS, HEAD_DIM, dtype=torch.uint8, device=DEVICE) for _ in range(2 * LAYERS)]
    table = C.RowTable.of(staging)
    d = random_device_pages(tokens, 1, torch.Generator().manual_seed(4))
    pos = torch.arange(tokens, device=DEVICE)
    ms = wall_ms(lambda: C.copy_rows(table, pos, pool.row_table, d), args.reps)
    rate = gbps(2 * tokens * TOKEN_BYTES, ms)  # read + write, as the ceiling
    records.append(dict(tokens=tokens, buffers=2 * LAYERS, ms=ms, gbps=rate, of_ceiling=rate / device_ceiling))
    log(f"  device gather {tokens} tokens x {2 * LAYERS} buffers: {ms:.3f} ms, {rate:.0f} GB/s "
        f"({100 * rate / device_ceiling:.1f}% of a device copy)")  # fmt: skip


# --- report -----------------------------------------------------------------------------------------


def _order(r: dict) -> str:
    return r.get("host_order", "shuffled")  # results written before host orders were recorded


def _pct_range(values: list) -> str:
    return f"{100 * min(values):.1f}-{100 * max(values):.1f}%"


def _best_per_order(records: list, rank, line) -> list[str]:
    """For each host page order that ran, ``line`` of its best record (lowest ``rank``)."""
    out = []
    for order in HOST_ORDERS:
        mine = [r for r in records if _order(r) == order]
        if mine:
            out.append(f"host pages {order}: {line(min(mine, key=rank))}")
    return out


def verdicts(res: dict) -> list[str]:
    """The targets, judged on what this run measured (a stage or backend that did not run is said
    to be not measured, never judged), for each host page order that ran."""
    out = []
    rows = [r for r in res["transfers"] if "gbps" in r]
    orders = [o for o in HOST_ORDERS if any(_order(r) == o for r in res["transfers"])]
    for order in orders:
        mine = [r for r in rows if _order(r) == order]
        backends = sorted({r["backend"] for r in mine})
        keys = sorted({(r["tokens"], r["page_size"], r["layout"], r["direction"]) for r in res["transfers"] if _order(r) == order})
        best, kern = [], []
        for key in keys:
            case = [r for r in mine if (r["tokens"], r["page_size"], r["layout"], r["direction"]) == key]
            best.append(max((r["of_ceiling"] for r in case), default=0.0))
            kern.append(max((r["of_ceiling"] for r in case if r["backend"] == "kernel"), default=0.0))
        which = "" if set(backends) == set(BACKENDS) else f" (only the {', '.join(backends) or 'no'} backend timed)"
        out.append(f"host pages {order}: better backend >= 95% of the ceiling in every case{which}: "
                   f"{'MET' if min(best) >= 0.95 else 'NOT MET'} (best per case {_pct_range(best)})")  # fmt: skip
        if "kernel" in backends:
            out.append(f"host pages {order}: kernel backend (8 programs) >= 90% in every case: "
                       f"{'MET' if min(kern) >= 0.90 else 'NOT MET'} ({_pct_range(kern)})")  # fmt: skip
        for backend in backends:
            device = [r["device_of_ceiling"] for r in mine if r["backend"] == backend and "device_of_ceiling" in r]
            if device:
                out.append(f"host pages {order}: {backend} backend on device time alone: {_pct_range(device)} of the "
                           "copy engine's device time")  # fmt: skip
    if not orders:
        out.append("backup and load one way at a time: not measured in this run")
    c = res["ceiling"]
    if "h2d_device_gbps" in c and min(c["h2d_device_gbps"] / c["h2d_gbps"], c["d2h_device_gbps"] / c["d2h_gbps"]) < 0.95:
        # The same 1 GiB copies timed two ways differ only by launch latency; a gap means the link
        # was disturbed while one of them ran (seen once: 37.9 against 54.7 GB/s).
        out.append(f"WARNING: the ceiling's device-time copies ({c['h2d_device_gbps']:.1f} / {c['d2h_device_gbps']:.1f} GB/s) "
                   f"ran below its wall-time copies ({c['h2d_gbps']:.1f} / {c['d2h_gbps']:.1f}): this run's device-time "
                   "percentages are void")  # fmt: skip
    if res["bidirectional"]:
        out += _best_per_order(res["bidirectional"], lambda r: -r["gbps"], lambda t: (
            f"backup and load at once >= 90 GB/s: best {t['gbps']:.1f} GB/s ({t['backend']}, {t['layout']}), "
            f"{'MET' if t['gbps'] >= 90 else 'NOT MET'}"))  # fmt: skip
    else:
        out.append("backup and load at once: not measured in this run")
    if res["overlap"]:
        out += _best_per_order(res["overlap"], lambda r: r["ratio"], lambda t: (
            f"overlapped per-layer load within 1.1x: best {t['ratio']:.3f}x ({t['backend']}, {t['layout']}"
            f"{', queued by the worker thread' if t.get('background') else ''}), "
            f"{'MET' if t['ratio'] <= 1.1 else 'NOT MET'}"))  # fmt: skip
    else:
        out.append("overlapped per-layer load: not measured in this run")
    return out


def markdown(res: dict) -> str:
    m, c = res["meta"], res["ceiling"]
    lines = [
        f"# Host tier on {m['gpu']} ({m['date']})",
        "",
        f"torch {m['torch']}, triton {m['triton']}; Llama-3-8B FP8 KV (32 layers, H=8, D=128, 64 KiB/token); "
        "random device pages; host pages shuffled or as allocated; wall time from the call to completion, medians.",
        "",
        f"Copy-engine ceiling (1 GiB pinned): host-to-device {c['h2d_gbps']:.1f} GB/s, device-to-host "
        f"{c['d2h_gbps']:.1f} GB/s, both at once {c['bidir_gbps']:.1f} GB/s; on device time "
        f"{c.get('h2d_device_gbps', float('nan')):.1f} / {c.get('d2h_device_gbps', float('nan')):.1f} GB/s. "
        f"Device copy {res['device_ceiling_gbps']:.0f} GB/s.",
        "",
        "## Targets",
        "",
        *[f"- {v}" for v in verdicts(res)],
        "",
        "## Backup (device to host) and load (host to device), GB/s (% of the ceiling)",
        "",
        "| tokens | page | layout | host pages | direction | kernel | kernel, layer by layer | direct | host ms (kernel) "
        "| kernel, device time | direct, device time |",
        "|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    keys = sorted({(r["tokens"], r["page_size"], r["layout"], _order(r), r["direction"]) for r in res["transfers"]})
    for key in keys:
        cells, host, per_layer, device = [], "-", "-", {b: "-" for b in BACKENDS}
        for backend in BACKENDS:
            found = [r for r in res["transfers"] if (r["tokens"], r["page_size"], r["layout"], _order(r), r["direction"]) == key
                     and r["backend"] == backend]  # fmt: skip
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
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {key[4]} | {cells[0]} | {per_layer} | {cells[1]} | {host} "
                     f"| {device['kernel']} | {device['direct']} |")  # fmt: skip
    lines += ["", "## Both directions at once (8k tokens each way, page 16)", "",
              "| layout | host pages | backend | programs (backup / load) | GB/s together |", "|---|---|---|---|---:|"]  # fmt: skip
    for r in res["bidirectional"]:
        programs = f"{r['backup_programs']} / {r['load_programs']}" if r["backend"] == "kernel" and "load_programs" in r else ""
        lines.append(f"| {r['layout']} | {_order(r)} | {r['backend']} | {programs} | {r['gbps']:.1f} |")
    lines += ["", "## Per-layer load overlapped with a stand-in attention (8k tokens, 32 layers)", "",
              "| layout | host pages | backend | load queued by | load ms | compute ms (matmuls) | both ms | ratio "
              "| matmul us beside the load | model starts (us after the load) |",
              "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in res["overlap"]:
        backend = r["backend"]
        if r["backend"] == "kernel" and "programs" in r:
            backend += f", {r['programs']} programs" + ("" if r.get("tile", "default") == "default" else f", tile {r['tile']}")
        queued = "worker thread" if r.get("background") else "the call"
        lines.append(f"| {r['layout']} | {_order(r)} | {backend} | {queued} | {r['load_ms']:.2f} | {r['compute_ms']:.2f} "
                     f"({r['matmuls_per_layer']}/layer) | {r['overlapped_ms']:.2f} | {r['ratio']:.3f} | {r.get('matmul_us', 0):.0f} "
                     f"| {r.get('model_start_us', 0):.0f} |")  # fmt: skip
    for r in res["device_gather"]:
        lines += ["", f"copy_rows device gather, {r['tokens']} tokens x {r['buffers']} buffers: {r['gbps']:.0f} GB/s "
                  f"({100 * r['of_ceiling']:.1f}% of a device copy)"]  # fmt: skip
    if res.get("sweep"):
        lines += ["", "## Kernel backend tiles (8k tokens), GB/s", "", "| page | layout | direction | tile/warps | programs | GB/s | % |",
                  "|---:|---|---|---|---:|---:|---:|"]  # fmt: skip
        for r in res["sweep"]:
            lines.append(f"| {r['page_size']} | {r['layout']} | {r['direction']} | {r['tile_elems']}/{r['num_warps']} | "
                         f"{r['programs']} | {r['gbps']:.1f} | {100 * r['of_ceiling']:.0f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--quick", action="store_true", help="8k tokens only, 3 repetitions")
    parser.add_argument("--sweep", action="store_true", help="also time the kernel backend's alternative tiles")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--max-copies", type=int, default=40_000, help="skip direct cases needing more copy calls")
    parser.add_argument("--bidir-programs", default="", metavar="B/L,...",
                        help="also time both directions at once with these kernel grids (backup/load programs), e.g. 16/16,8/32")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated io backends to time")
    parser.add_argument("--host-orders", default=",".join(HOST_ORDERS), help="comma-separated host page orders")
    parser.add_argument("--overlap-programs", default=str(KERNEL_PROGRAMS), metavar="N,...",
                        help="kernel_programs settings for the overlap stage (default: the host pool's default)")
    parser.add_argument("--overlap-tiles", default="default", metavar="ELEMS/WARPS[/MAXNREG],...",
                        help="copy tiles for the overlap stage's kernel loads (default: the tile table's)")
    parser.add_argument("--overlap-layouts", default=",".join(LAYOUTS), help="host layouts for the overlap stage")
    parser.add_argument("--overlap-background", default="off,on", metavar="off,on",
                        help="overlap stage: the load queued by the call (off), by the host pool's worker thread (on)")
    parser.add_argument("--trace", action="store_true", help="export a CUDA trace of one overlapped run per case")
    parser.add_argument("--cpu-smoke", action="store_true", help="small CPU pools, three stages: checks the script")
    parser.add_argument("--stages", default="transfers,bidirectional,overlap,device_gather",
                        help="comma-separated stages to run (plus sweep with --sweep)")
    args = parser.parse_args()
    try:
        args.bidir_programs = [tuple(int(x) for x in item.split("/")) for item in args.bidir_programs.split(",") if item]
        if any(len(p) != 2 or min(p) < 1 for p in args.bidir_programs):
            raise ValueError
    except ValueError:
        parser.error(f"--bidir-programs must look like 16/16,8/32, got {args.bidir_programs!r}")
    args.overlap_programs = [int(x) for x in args.overlap_programs.split(",") if x]
    args.overlap_tiles = parse_tiles(args.overlap_tiles)
    args.overlap_layouts = [x for x in args.overlap_layouts.split(",") if x]
    modes = [x for x in args.overlap_background.split(",") if x]
    if not modes or set(modes) - {"off", "on"}:
        parser.error(f"--overlap-background must be off, on or off,on, got {args.overlap_background!r}")
    args.overlap_background = [m == "on" for m in modes]
    args.backends = [b for b in args.backends.split(",") if b]
    args.host_orders = [o for o in args.host_orders.split(",") if o]
    if not args.host_orders or set(args.host_orders) - set(HOST_ORDERS):
        parser.error(f"--host-orders must name some of {', '.join(HOST_ORDERS)}, got {args.host_orders}")
    if not args.backends or set(args.backends) - set(BACKENDS):
        parser.error(f"--backends must name some of {', '.join(BACKENDS)}, got {args.backends}")
    if args.cpu_smoke:
        configure_smoke()
        args.stages, args.sweep = "transfers,bidirectional,device_gather", False
    elif not torch.cuda.is_available():
        print("bench_host_tier.py needs a CUDA device", file=sys.stderr)
        return 2
    args.tokens = TOKENS if args.cpu_smoke else [8192] if args.quick else TOKENS
    args.reps = args.reps or (3 if args.quick or args.cpu_smoke else 5)
    os.makedirs(args.out, exist_ok=True)
    meta = dict(
        gpu=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke run)", torch=torch.__version__,
        triton=triton.__version__, python=platform.python_version(),
        date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        sms=torch.cuda.get_device_properties(0).multi_processor_count if DEVICE == "cuda" else 0,
    )  # fmt: skip
    log(f"host tier benchmark on {meta['gpu']}")
    if DEVICE == "cuda":
        ceiling = copy_engine_ceiling(args.reps)
        device_ceiling = device_copy_ceiling(args.reps)
    else:  # nothing to compare with: every rate is its own ceiling's multiple
        ceiling, device_ceiling = {"h2d_gbps": 1.0, "d2h_gbps": 1.0, "bidir_gbps": 1.0}, 1.0
    log(f"ceiling: h2d {ceiling['h2d_gbps']:.1f} GB/s, d2h {ceiling['d2h_gbps']:.1f} GB/s, both {ceiling['bidir_gbps']:.1f} GB/s; "
        f"device copy {device_ceiling:.0f} GB/s")  # fmt: skip
    res = dict(meta=meta, ceiling=ceiling, device_ceiling_gbps=device_ceiling, transfers=[], bidirectional=[],
               overlap=[], device_gather=[], sweep=[], profile_host=[])  # fmt: skip
    stages = [
        ("transfers", lambda: bench_transfers(args, ceiling, res["transfers"])),
        ("bidirectional", lambda: bench_bidirectional(args, ceiling, res["bidirectional"])),
        ("overlap", lambda: bench_overlap(args, res["overlap"])),
        ("device_gather", lambda: bench_device_gather(args, device_ceiling, res["device_gather"])),
        ("profile_host", lambda: profile_host(args, res["profile_host"])),
    ]
    wanted = set(args.stages.split(","))
    unknown = wanted - {name for name, _ in stages}
    if unknown:
        parser.error(f"unknown stages {sorted(unknown)}")
    stages = [(name, fn) for name, fn in stages if name in wanted]
    if args.sweep:
        stages.append(("sweep", lambda: bench_sweep(args, ceiling, res["sweep"])))
    status = 0
    for name, stage in stages:
        log(f"== {name}")
        started = time.perf_counter()
        try:
            stage()
            log(f"== {name} done in {time.perf_counter() - started:.1f} s")
        except Exception as exc:  # keep the other stages' results; report the failure
            log(f"{name} FAILED: {type(exc).__name__}: {exc}")
            res.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"
            status = 1
        with open(os.path.join(args.out, "host_tier.json"), "w") as f:
            json.dump(res, f, indent=1)
    text = markdown(res)
    with open(os.path.join(args.out, "host_tier.md"), "w") as f:
        f.write(text)
    log(text)
    return status


if __name__ == "__main__":
    sys.exit(main())
