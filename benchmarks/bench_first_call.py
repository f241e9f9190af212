"""What the warmup at pool construction buys: the first ``set_kv_buffer`` call against the steady state.

Runs with an empty Triton cache (a fresh ``TRITON_CACHE_DIR``), as on a freshly deployed server:

1. a pool built with ``warmup=True``: construction time (the warmup's share and the variants it
   compiled), the first call, the steady-state median;
2. a pool of another geometry built with ``warmup=False``: the first call (which compiles), the
   steady state.

Each call is timed as synchronised wall time (T=256 tokens, D=128, an FP8 pool of 1M slots).

Usage (on a GPU): python benchmarks/bench_first_call.py --out DIR
``--cpu-smoke`` runs it on the CPU at toy sizes (the kernel in Triton's interpreter, which a pool
warms only on CUDA).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402

SMOKE = report.interpret_if_smoke()
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvpool-triton-cache-")  # before Triton compiles anything

import torch  # noqa: E402

from kvpool import MHATokenToKVPool  # noqa: E402

DEVICE = "cpu" if SMOKE else "cuda"
SLOTS, TOKENS, CALLS = (1 << 10, 8, 3) if SMOKE else (1 << 20, 256, 200)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed_call(fn) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - t0) * 1e3


def measure(heads: int, warmup: bool) -> dict:
    t0 = time.perf_counter()
    pool = MHATokenToKVPool(SLOTS, 1, torch.float8_e4m3fn, heads, 128, 2, DEVICE, warmup=warmup, fused="always")
    sync()
    built = time.perf_counter() - t0
    qkv = (torch.randn(TOKENS, 6 * heads, 128, device=DEVICE) * 30).to(torch.bfloat16)
    k, v = qkv[:, 4 * heads : 5 * heads], qkv[:, 5 * heads :]  # slices of a fused projection, as a model has them
    loc = torch.randperm(SLOTS - 1, device=DEVICE)[:TOKENS].to(torch.int32) + 1
    scale = torch.tensor([0.37], device=DEVICE)
    call = lambda: pool.set_kv_buffer(None, loc, k, v, scale, scale, layer_id_override=1)  # noqa: E731
    first = timed_call(call)
    steady = statistics.median(timed_call(call) for _ in range(CALLS))
    return {"warmup": warmup, "heads": heads, "tokens": TOKENS, "construction_s": built, "warmup_s": pool.warmup_seconds or 0.0,
            "variants": len(pool.warmup_variants()) if warmup else 0, "first_call_ms": first, "steady_ms": steady}  # fmt: skip


def markdown(result: dict) -> str:
    lines = [
        "Empty Triton cache; synchronised wall time per call; FP8 pool, D=128, "
        f"T={result['records'][0]['tokens'] if result['records'] else '?'} tokens per call.",
        "",
        "| pool | heads | construction s | of it the warmup s (variants) | first call ms | steady state ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["records"]:
        lines.append(f"| warmup={r['warmup']} | {r['heads']} | {r['construction_s']:.2f} | {r['warmup_s']:.2f} ({r['variants']}) "
                     f"| {r['first_call_ms']:.2f} | {r['steady_ms']:.3f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(result: dict, fig) -> None:
    ax = fig.subplots()
    rows = result["records"]
    labels = [f"warmup={r['warmup']}" for r in rows]
    for i, (key, name) in enumerate((("first_call_ms", "first call"), ("steady_ms", "steady state"))):
        ax.bar([x + (i - 0.5) * 0.35 for x in range(len(rows))], [r[key] for r in rows], 0.35, label=name)
    ax.set_yscale("log")
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("ms per set_kv_buffer call (synchronised)")
    ax.legend(fontsize=8)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    report.add_common_arguments(parser, "first-call")
    args = parser.parse_args()
    if not SMOKE and not torch.cuda.is_available():
        parser.error("no CUDA device (--cpu-smoke checks the script on the CPU)")
    rep = report.Report(args, "bench_first_call", "First call after construction", markdown, plot)
    rep.result["records"] = []
    for heads, warmup in ((8, True), (4, False)):  # another geometry: nothing compiled for it yet
        rec = measure(heads, warmup)
        rep.result["records"].append(rec)
        rep.log(f"warmup={warmup}: construction {rec['construction_s']:.2f} s (warmup {rec['warmup_s']:.2f} s, {rec['variants']} variants); "
                f"first call {rec['first_call_ms']:.2f} ms; steady state {rec['steady_ms']:.3f} ms")  # fmt: skip
        rep.save()
    rep.save(final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
