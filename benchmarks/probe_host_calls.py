"""Host time of the calls a host-tier transfer is made of, one kind at a time (CUDA only).

A host-tier load queues, per layer, copy-engine calls, a Triton launch, event records and waits and
stream switches; whatever the host spends there delays the model's own work queued after the load
(bench_host_tier.py's overlap stage) and the second direction of a both-ways transfer. This probe
times each piece alone, with the GPU held busy by a sleep kernel so that nothing waits for the
device: per call, the median of ``--rounds`` rounds of ``--calls`` calls.

Pieces: torch stream and event calls, a small pinned-to-device ``copy_``, a Triton launch of the
row-copy kernel through ``launch_copy_rows`` (the JIT's argument binding and cache lookup each
time) and through the compiled kernel it returned (the launch alone), and whole host-tier calls
(8k tokens of Llama-3-8B FP8, pages of 16, host pages as allocated): both backends, backup and
all-layer load, with and without the layer-transfer counter registered.

Usage: python benchmarks/probe_host_calls.py --out DIR   (writes DIR/probe_host_calls.json)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kvpool import MHATokenToKVPool, MHATokenToKVPoolHost  # noqa: E402
from kvpool.kernels import copy_rows as C  # noqa: E402
from kvpool.kernels import copy_rows_kernel as K  # noqa: E402
from kvpool.streams import OnStream  # noqa: E402

LAYERS, HEADS, HEAD_DIM, TOKENS, PAGE = 32, 8, 128, 8192, 16
HOLD = 100_000_000  # sleep cycles (about 50 ms): longer than a round below


def per_call_us(fn, calls: int, rounds: int) -> float:
    """Median host microseconds per ``fn()`` with the device held (nothing waits for the GPU)."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        torch.cuda._sleep(HOLD)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="gpu_out")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda")
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    import triton

    res["triton"] = triton.__version__
    n, r = args.calls, args.rounds
    side = torch.cuda.Stream()
    ev = torch.cuda.Event()
    prims = {}
    prims["current_stream"] = per_call_us(lambda: torch.cuda.current_stream(dev), n, r)
    prims["event_record"] = per_call_us(lambda: ev.record(side), n, r)
    prims["stream_wait_event"] = per_call_us(lambda: side.wait_event(ev), n, r)

    def on_stream():
        with OnStream(side):
            pass

    prims["on_stream_enter_exit"] = per_call_us(on_stream, n, r)
    pinned = torch.empty(1 << 16, dtype=torch.uint8, pin_memory=True)
    dbuf = torch.empty(1 << 16, dtype=torch.uint8, device=dev)
    prims["h2d_copy_64k"] = per_call_us(lambda: dbuf.copy_(pinned, non_blocking=True), n, r)
    prims["slice_h2d_copy_64k"] = per_call_us(lambda: dbuf[0 : 1 << 16].copy_(pinned[0 : 1 << 16], non_blocking=True), n, r)

    # A per-layer row copy: 2 buffers (K, V) of 1 KiB rows, 16 pairs.
    a = [torch.empty(4096, 1024, dtype=torch.uint8, device=dev) for _ in range(2)]
    b = [torch.empty(4096, 1024, dtype=torch.uint8, device=dev) for _ in range(2)]
    ta, tb = C.RowTable.of(a), C.RowTable.of(b)
    idx = torch.arange(16, device=dev)
    prims["launch_copy_rows_jit"] = per_call_us(lambda: C.launch_copy_rows(ta, idx, tb, idx, max_programs=8), n, r)
    plan = C.plan_copy(16, 2, ta.distinct_row_bytes, min(ta.align, tb.align), False, 8, C.FEW_PROGRAMS_TILE)
    targs = (ta.table, tb.table, idx, idx, 16, ta.rows, tb.rows, idx.stride(0), idx.stride(0),
             ta.table.stride(0), tb.table.stride(0), 2, plan.chunks, plan.tasks)  # fmt: skip
    consts = dict(ELEM_BYTES=plan.elem_bytes, ALIGN=plan.align, BLOCK_P=plan.block_p, BLOCK_W=plan.block_w,
                  EVEN=plan.even, ONE_PASS=plan.one_pass, num_warps=plan.num_warps)  # fmt: skip
    compiled = K._copy_rows_kernel[(plan.programs,)](*targs, **consts)
    runner = compiled[(plan.programs, 1, 1)]
    # The compiled kernel takes every parameter in order, constexprs included (Triton 3.6).
    full = targs + (plan.elem_bytes, plan.align, plan.block_p, plan.block_w, plan.even, plan.one_pass)
    prims["compiled_kernel_launch"] = per_call_us(lambda: runner(*full), n, r)
    stream_handle = torch.cuda.current_stream(dev).cuda_stream
    prims["compiled_kernel_launch_stream_given"] = per_call_us(lambda: runner(*full, stream=stream_handle), n, r)
    prims["plan_copy_lookup"] = per_call_us(
        lambda: C.plan_copy(16, 2, ta.distinct_row_bytes, min(ta.align, tb.align), False, 8, C.FEW_PROGRAMS_TILE), n, r)
    prims["stream_handle_lookup"] = per_call_us(lambda: torch.cuda.current_stream(dev).cuda_stream, n, r)
    res["primitives_us"] = prims
    for k, v in prims.items():
        print(f"{k:<40} {v:8.2f} us", flush=True)

    # Whole host-tier calls.
    pool = MHATokenToKVPool(TOKENS * 2, PAGE, torch.float8_e4m3fn, HEADS, HEAD_DIM, LAYERS, dev, warmup=False)
    d = (torch.randperm(2 * TOKENS // PAGE - 1)[: TOKENS // PAGE] + 1)
    d = (d[:, None] * PAGE + torch.arange(PAGE)).reshape(-1).to(dev)
    calls = {}
    for layout in ("layer_first", "page_first"):
        host = MHATokenToKVPoolHost(pool, 1.0, 0, PAGE, layout)
        h = host.alloc(TOKENS)
        for backend in ("kernel", "direct"):
            name = f"{layout} {backend}"
            calls[f"{name} backup"] = per_call_us(lambda: host.backup_from_device_all_layer(pool, h, d, backend), 3, r) / 1e3
            calls[f"{name} load"] = per_call_us(lambda: host.load_to_device_all_layer(pool, h.clone(), d, backend), 3, r) / 1e3
            pool.register_layer_transfer_counter(host.layer_transfer_counter)
            calls[f"{name} load, counter registered"] = per_call_us(
                lambda: host.load_to_device_all_layer(pool, h.clone(), d, backend), 3, r) / 1e3  # fmt: skip
            pool.register_layer_transfer_counter(None)
        host.free(h)
        del host
    res["host_tier_calls_ms"] = calls
    for k, v in calls.items():
        print(f"{k:<48} {v:8.3f} ms", flush=True)
    with open(os.path.join(args.out, "probe_host_calls.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
