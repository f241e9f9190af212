"""Sweep the fused kernel's tile (elements per program x warps) per head_dim, to fill TILE_TABLE.

For each geometry it times every candidate tile at one decode token and 256 tokens (per write in a
CUDA graph of 64 writes) and at 16k tokens (L2 flushed before each write), all as CUDA-graph
replays so host launch cost never enters. A tile's score for a head_dim block is the geometric mean,
over the geometries and sizes of that block, of its time over the best time there; the lowest score
wins. With --write-table, the winners replace TILE_TABLE in kvpool/kernels/store_kv.py (and a copy of
that file goes to --out), so the benchmark that follows in the same run measures the table chosen.

Usage (on a GPU): python benchmarks/tune_tiles.py --out DIR [--write-table]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import flush_buffer, graph_us  # noqa: E402

from kvpool.kernels import store_kv  # noqa: E402
from kvpool.kernels.store_kv import PreparedLaunch, TileConfig, plan_launch  # noqa: E402

GEOMETRIES = [(8, 64), (8, 128), (1, 128), (3, 96), (1, 256)]
CANDIDATES = [TileConfig(e, w) for e in (512, 1024, 2048, 4096, 8192) for w in (2, 4, 8)]
SIZES = [(1, False), (256, False), (16384, True)]  # (tokens, flush L2 before each write)
SLOTS = 1 << 20
LAYERS = 4


def block_d(d: int) -> int:
    return 1 << (d - 1).bit_length()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--write-table", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    fp8 = torch.float8_e4m3fn
    flush = flush_buffer()
    scale = torch.tensor([0.37], device="cuda")
    results = []
    for h, d in GEOMETRIES:
        caches = [torch.zeros(SLOTS, h, d, dtype=torch.uint8, device="cuda") for _ in range(2 * LAYERS)]
        for t, cold in SIZES:
            x = (torch.randn(t, h, d, device="cuda") * 60).to(torch.bfloat16)
            loc = torch.randperm(SLOTS, device="cuda")[:t]
            nbytes = t * 2 * h * d * 3 + t * 8
            line = []
            for tile in CANDIDATES:
                launch = PreparedLaunch(h, d, h, d, fp8, caches[0].stride(), caches[0].stride(), SLOTS,
                                        soft_cast=False, tile=tile)  # fmt: skip
                fn = lambda i: launch(x, x, caches[2 * (i % LAYERS)], caches[2 * (i % LAYERS) + 1], loc, scale, scale)  # noqa: E731
                us = graph_us(fn, calls=10 if cold else 64, flush=flush if cold else None)
                plan = plan_launch(h, d, h, d, tile)
                results.append(dict(H=h, D=d, T=t, elems=tile.elems, warps=tile.num_warps, block_t=plan.block_t,
                                    block_h=plan.block_h, us=us, gbps=nbytes / (us * 1e-6) / 1e9))  # fmt: skip
                line.append(f"{tile.elems}/{tile.num_warps}:{us:.2f}")
            best = min((r for r in results if (r["H"], r["D"], r["T"]) == (h, d, t)), key=lambda r: r["us"])
            print(f"H={h} D={d} T={t}: best {best['elems']}/{best['warps']} {best['us']:.2f} us "
                  f"{best['gbps']:.0f} GB/s | " + " ".join(line), flush=True)  # fmt: skip
        del caches
        torch.cuda.empty_cache()

    table = {}
    for bd in sorted({block_d(d) for _, d in GEOMETRIES}):
        cells = {(r["H"], r["D"], r["T"]) for r in results if block_d(r["D"]) == bd}
        best_us = {c: min(r["us"] for r in results if (r["H"], r["D"], r["T"]) == c) for c in cells}
        scores = {}
        for tile in CANDIDATES:
            ratios = [r["us"] / best_us[(r["H"], r["D"], r["T"])] for r in results
                      if block_d(r["D"]) == bd and (r["elems"], r["warps"]) == (tile.elems, tile.num_warps)]  # fmt: skip
            scores[tile] = math.exp(sum(map(math.log, ratios)) / len(ratios))
        winner = min(scores, key=scores.get)
        table[bd] = (winner, scores[winner])
        ranked = sorted(scores.items(), key=lambda kv: kv[1])[:5]
        print(f"head_dim block {bd}: " + ", ".join(f"{t.elems}/{t.num_warps}={s:.3f}" for t, s in ranked), flush=True)

    with open(os.path.join(args.out, "tune.json"), "w") as f:
        json.dump({"results": results, "table": {bd: [t.elems, t.num_warps, s] for bd, (t, s) in table.items()}}, f, indent=1)
    if args.write_table:
        path = store_kv.__file__
        src = open(path).read()
        body = "".join(
            f"    {bd}: TileConfig(elems={t.elems}, num_warps={t.num_warps}),  # geomean time / best = {s:.3f}\n"
            for bd, (t, s) in sorted(table.items())
        )
        new, n = re.subn(r"(TILE_TABLE: dict\[int, TileConfig\] = \{\n)(.*?)(\})", lambda m: m.group(1) + body + m.group(3), src, flags=re.S)
        if n != 1:
            print("could not find TILE_TABLE to rewrite", flush=True)
            return 1
        open(path, "w").write(new)
        shutil.copy(path, os.path.join(args.out, "store_kv.py"))
        print(f"wrote TILE_TABLE to {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
