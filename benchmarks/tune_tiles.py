"""Sweep the fused kernel's tile (elements per program x warps) per head_dim, to fill TILE_TABLE.

For each geometry it times a prefill-sized write (bandwidth) and a decode-sized write (latency)
for every candidate tile, with do_bench medians, and prints the best per geometry. The table in
kvpool/kernels/store_kv.py is chosen from this output; BENCHMARKS.md records the run.

Usage (on a GPU): python benchmarks/tune_tiles.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from triton.testing import do_bench

from kvpool.kernels.store_kv import TileConfig, launch_store_kv, plan_launch

GEOMETRIES = [(8, 128), (1, 128), (1, 256), (3, 96), (8, 64)]
ELEMS = [1024, 2048, 4096, 8192, 16384]
WARPS = [2, 4, 8]
TOKENS = [256, 16384]
SLOTS = 1 << 20


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = []
    fp8 = torch.float8_e4m3fn
    scale = torch.tensor([0.37], device="cuda")
    for h, d in GEOMETRIES:
        kc = torch.zeros(SLOTS, h, d, dtype=torch.uint8, device="cuda")
        vc = torch.zeros_like(kc)
        for t in TOKENS:
            x = (torch.randn(t, h, d, device="cuda") * 60).to(torch.bfloat16)
            loc = torch.randperm(SLOTS, device="cuda")[:t]
            nbytes = t * 2 * h * d * 3 + t * 8
            line = []
            for elems in ELEMS:
                for warps in WARPS:
                    tile = TileConfig(elems, warps)
                    plan = plan_launch(h, d, h, d, tile)
                    fn = lambda: launch_store_kv(x, x, kc, vc, loc, scale, scale, fp8, tile=tile)  # noqa: E731
                    fn()
                    ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
                    results.append(dict(H=h, D=d, T=t, elems=elems, warps=warps, block_t=plan.block_t,
                                        block_h=plan.block_h, us=ms * 1e3, gbps=nbytes / (ms * 1e-3) / 1e9))
                    line.append(f"{elems}/{warps}:{ms * 1e3:.1f}us")
            best = min((r for r in results if r["H"] == h and r["D"] == d and r["T"] == t), key=lambda r: r["us"])
            print(f"H={h} D={d} T={t}: best elems={best['elems']} warps={best['warps']} "
                  f"{best['us']:.1f} us {best['gbps']:.0f} GB/s | " + " ".join(line), flush=True)
        del kc, vc
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "tune.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
