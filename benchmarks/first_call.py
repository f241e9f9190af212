"""What the warmup at pool construction buys: the first set_kv_buffer call against the steady state.

Runs with an empty Triton cache (a fresh TRITON_CACHE_DIR), as on a freshly deployed server:
1. a pool built with warmup=True: construction time, first call, steady-state median;
2. a pool of another geometry built with warmup=False: first call (includes compilation), steady state.

Usage (on a GPU): python benchmarks/first_call.py
       (anywhere): python benchmarks/first_call.py --dry-run   (tiny sizes on the CPU, kernel in
       Triton's interpreter, which a pool warms only on CUDA: the figures measure nothing)
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

DRY = "--dry-run" in sys.argv[1:]
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvpool-triton-cache-")

import torch  # noqa: E402

from kvpool import MHATokenToKVPool  # noqa: E402

DEVICE = "cpu" if DRY else "cuda"
SLOTS, TOKENS, CALLS = (1 << 10, 8, 3) if DRY else (1 << 20, 256, 200)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed_call(fn) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - t0) * 1e3


def run(label: str, h: int, warmup: bool) -> None:
    t0 = time.perf_counter()
    pool = MHATokenToKVPool(SLOTS, 1, torch.float8_e4m3fn, h, 128, 2, DEVICE, warmup=warmup, fused="always")
    sync()
    built = time.perf_counter() - t0
    qkv = (torch.randn(TOKENS, 6 * h, 128, device=DEVICE) * 30).to(torch.bfloat16)
    k, v = qkv[:, 4 * h : 5 * h], qkv[:, 5 * h :]
    loc = torch.randperm(SLOTS - 1, device=DEVICE)[:TOKENS].to(torch.int32) + 1
    scale = torch.tensor([0.37], device=DEVICE)
    call = lambda: pool.set_kv_buffer(None, loc, k, v, scale, scale, layer_id_override=1)  # noqa: E731
    first = timed_call(call)
    steady = statistics.median(timed_call(call) for _ in range(CALLS))
    print(f"{label}: construction {built:.2f} s (warmup {pool.warmup_seconds or 0:.2f} s, "
          f"{len(pool.warmup_variants()) if warmup else 0} variants); first call {first:.2f} ms; "
          f"steady state {steady:.3f} ms (synchronised wall time per call, T={TOKENS}, H={h}, D=128)", flush=True)


def main() -> int:
    if not DRY and not torch.cuda.is_available():
        print("no CUDA device (use --dry-run to check the script on the CPU)")
        return 2
    run("warmup=True ", 8, True)
    run("warmup=False", 4, False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
