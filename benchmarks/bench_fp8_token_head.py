"""The per-token-head FP8 write on a GPU, against the per-tensor FP8 write and the ceiling.

For each shape (named after the models whose KV geometry it is), bf16 K and V rows written at random
slots of a 1M-slot (or smaller, for the largest rows) e4m3fn pool with int64 ``loc``:

* ``MHATokenToKVPoolFP8PerTokenHead.set_kv_buffer``: per head the amax, the scale, the division, the
  rounding and the scatter of codes and float32 scales, K and V in one launch;
* ``MHATokenToKVPool.set_kv_buffer`` with a per-tensor float32 scale tensor (kvpool's exact FP8
  write: the same codes' bytes, no scales);
* the cast-only scatter of the same code bytes to the same slots (no division, no amax, no scales:
  the ceiling docs/contract.md "How performance is measured" names), and a copy kernel moving the
  per-token-head write's bytes.

Device time: CUDA-graph replays with L2 flushed before each call (``timing.py``); decode sizes also
per write in a graph of 64 writes with L2 warm. Bytes counted per token: (H * D + H * Dv) x (input
size + 1) + 2 x H x 4 (the scales) + 8 (the slot). After the timed runs the fused pool's bytes are
compared with the reference path's, codes and scales.

Usage (on a GPU): python benchmarks/bench_fp8_token_head.py --out DIR
``--cpu-smoke`` runs every code path on the CPU at toy sizes (kernels in Triton's interpreter).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402

SMOKE = report.interpret_if_smoke()  # before kvpool and peers define their kernels

import torch  # noqa: E402

import peers  # noqa: E402
from timing import DryClock, GpuClock, same_bytes_copy_gbps  # noqa: E402

from kvpool import MHATokenToKVPool, MHATokenToKVPoolFP8PerTokenHead  # noqa: E402

FP8 = torch.float8_e4m3fn
#: (name, tokens, heads, head_dim): Llama-3-8B and Qwen3.5-397B (TP8) rows, an odd head_dim, decode.
SHAPES = (
    ("llama3-8b 16k", 16384, 8, 128), ("qwen3.5 tp8 32k", 32768, 2, 256), ("h8 d96 16k", 16384, 8, 96),
    ("llama3-8b decode 1", 1, 8, 128), ("llama3-8b decode 256", 256, 8, 128),
)  # fmt: skip
SMOKE_SHAPES = (("toy 8", 8, 2, 16), ("toy decode 1", 1, 2, 16))
DECODE_MAX = 256
METHODS = ("per-token-head write", "per-tensor FP8 write", "cast-only scatter (ceiling)")


def bytes_moved(t: int, h: int, d: int) -> int:
    return t * (2 * h * d) * (2 + 1) + t * 2 * h * 4 + t * 8


def measure(clock, device: str, name: str, t: int, h: int, d: int) -> dict:
    slots = 1 << 10 if SMOKE else min(1 << 20, (2 << 30) // (2 * h * d + 8 * h))
    g = torch.Generator(device=device).manual_seed(t * h * d)
    k = (torch.randn(t, h, d, device=device, generator=g) * 3).to(torch.bfloat16)
    v = (torch.randn(t, h, d, device=device, generator=g) * 3).to(torch.bfloat16)
    loc = torch.randperm(slots, device=device, generator=g)[:t] + 1
    ours = MHATokenToKVPoolFP8PerTokenHead(slots, 1, FP8, h, d, 1, device, fused="always")
    plain = MHATokenToKVPool(slots, 1, FP8, h, d, 1, device, fused="always")
    scale = torch.tensor([0.02], device=device)
    k_codes, v_codes = ours.get_fp8_buffers(0).k, ours.get_fp8_buffers(0).v
    calls = {
        METHODS[0]: lambda i: ours.set_kv_buffer(None, loc, k, v, layer_id_override=0),
        METHODS[1]: lambda i: plain.set_kv_buffer(None, loc, k, v, scale, scale, layer_id_override=0),
        METHODS[2]: lambda i: peers.cast_scatter(k, v, k_codes, v_codes, loc),
    }
    rec = {"shape": name, "tokens": t, "heads": h, "head_dim": d, "bytes": bytes_moved(t, h, d), "cold_us": {}, "warm_us": {}}
    for method, fn in calls.items():
        rec["cold_us"][method] = clock.device_us(fn, 10, cold=True)
        if t <= DECODE_MAX:
            rec["warm_us"][method] = clock.device_us(fn, 64, cold=False)
    rec["copy_gbps"] = same_bytes_copy_gbps(clock, rec["bytes"], device) if not clock.dry else 0.0
    reference = MHATokenToKVPoolFP8PerTokenHead(slots, 1, FP8, h, d, 1, device, fused="never")
    ours.set_kv_buffer(None, loc, k, v, layer_id_override=0)
    reference.set_kv_buffer(None, loc, k, v, layer_id_override=0)
    rec["exact"] = all(
        torch.equal(getattr(ours, n)[0].view(torch.uint8), getattr(reference, n)[0].view(torch.uint8)) for n in ours.part_names
    )  # fmt: skip
    return rec


def markdown(result: dict) -> str:
    lines = [
        "Device time per write, CUDA-graph replays, L2 flushed (decode sizes also in a graph of 64 writes, L2 warm); "
        "e4m3fn pool, bf16 inputs, random slots. GB/s counts the per-token-head write's bytes for every method.",
        "",
        "| shape | T | H | D | " + " | ".join(f"{m} us (GB/s)" for m in METHODS) + " | vs ceiling | vs per-tensor | copy GB/s | exact |",
        "|---|---:|---:|---:|" + "---:|" * len(METHODS) + "---:|---:|---:|---|",
    ]
    for r in result["records"]:
        cold = r["cold_us"]
        cells = [f"{cold[m]:.2f} ({r['bytes'] / (cold[m] * 1e-6) / 1e9:,.0f})" for m in METHODS]
        lines.append(
            f"| {r['shape']} | {r['tokens']} | {r['heads']} | {r['head_dim']} | " + " | ".join(cells)
            + f" | {cold[METHODS[2]] / cold[METHODS[0]]:.0%} | {cold[METHODS[1]] / cold[METHODS[0]]:.0%}"
            + f" | {r['copy_gbps']:,.0f} | {r['exact']} |"
        )  # fmt: skip
        if r["warm_us"]:
            warm = r["warm_us"]
            lines.append(f"| (warm, in a graph of 64) | | | | " + " | ".join(f"{warm[m]:.2f}" for m in METHODS) + " | | | | |")
    return "\n".join(lines) + "\n"


def plot(result: dict, fig) -> None:
    """GB/s of each method per shape and token count (cold device time)."""
    ax = fig.subplots()
    records = result["records"]
    labels = [f"{r['shape']} T={r['tokens']}" for r in records]
    width = 0.8 / len(METHODS)
    for j, method in enumerate(METHODS):
        gbps = [r["bytes"] / (r["cold_us"][method] * 1e-6) / 1e9 if r["cold_us"][method] else 0.0 for r in records]
        ax.bar([i + j * width for i in range(len(records))], gbps, width, label=method)
    ax.set_xticks([i + width * (len(METHODS) - 1) / 2 for i in range(len(records))], labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("GB/s (cold)")
    ax.legend(fontsize=8)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    report.add_common_arguments(parser, "fp8-token-head", budget_s=300)
    args = parser.parse_args()
    if not SMOKE and not torch.cuda.is_available():
        parser.error("no CUDA device (--cpu-smoke checks the script on the CPU)")
    rep = report.Report(args, "bench_fp8_token_head", "Per-token-head FP8 write", markdown, plot)
    clock, device = (DryClock(), "cpu") if SMOKE else (GpuClock(), "cuda")
    rep.result["records"] = []
    rep.result["copy_ceiling_gbps"] = clock.copy_ceiling_gbps()
    for name, t, h, d in SMOKE_SHAPES if SMOKE else SHAPES:
        if rep.over_budget(name):
            continue
        try:
            rec = measure(clock, device, name, t, h, d)
        except Exception as exc:  # one failed shape is reported; the run goes on
            rep.error(name, exc)
            continue
        rep.result["records"].append(rec)
        rep.log(f"{name}: " + ", ".join(f"{m} {us:.2f} us" for m, us in rec["cold_us"].items()) + f"; exact {rec['exact']}")
        rep.save()
    rep.save(final=True)
    return 0 if all(r["exact"] for r in rep.result["records"]) and not rep.result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
