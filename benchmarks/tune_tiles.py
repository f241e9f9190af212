"""Sweep the fused kernel's tile (elements per program x warps) per head_dim (a report).

The launcher's TILE_TABLE is chosen by write size, not head_dim, from ``probe_plans.py --decode``;
this sweep is kept to show how much a per-head_dim table would move.

For each geometry it times every candidate tile at one decode token and 256 tokens (per write in a
CUDA graph of 64 writes) and at 16k tokens (L2 flushed before each write), all as CUDA-graph
replays so host launch cost never enters. A tile's score for a head_dim block is the geometric mean,
over the geometries and sizes of that block, of its time over the best time there. The lowest score
wins; tiles within 1% of it count as tied, and the tie goes to the one fastest at 16k tokens (tile
choice moves large-write bandwidth by several percent, while decode-sized writes are dominated by
fixed costs that no tile changes).

Usage (on a GPU): python benchmarks/tune_tiles.py --out DIR
          (anywhere): python benchmarks/tune_tiles.py --from-json tune.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import flush_buffer, graph_us  # noqa: E402

from kvpool.config import KernelOptions  # noqa: E402
from kvpool.kernels.checks import write_key  # noqa: E402
from kvpool.kernels.store_kv import PreparedLaunch, TileConfig  # noqa: E402

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
    parser.add_argument("--from-json", help="recompute the table from a saved sweep instead of sweeping")
    args = parser.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            return finish(choose_table(json.load(f)["results"]), args)
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
            key = write_key(x, x, loc, scale, scale)
            line = []
            for tile in CANDIDATES:
                launch = PreparedLaunch(h, d, h, d, fp8, caches[0].stride(), caches[0].stride(), SLOTS, x.device,
                                        options=KernelOptions(soft_cast=False), tile=tile, caches_aligned=True)  # fmt: skip
                fn = lambda i: launch(key, x, x, caches[2 * (i % LAYERS)], caches[2 * (i % LAYERS) + 1], loc, scale, scale)  # noqa: E731
                us = graph_us(fn, calls=10 if cold else 64, flush=flush if cold else None)
                plan = launch.variant_for(x.stride(), x.stride(), (key[3], key[4])).plan  # flat for H=3 D=96
                results.append(dict(H=h, D=d, T=t, elems=tile.elems, warps=tile.num_warps, block_t=plan.block_t,
                                    block_h=plan.block_h, us=us, gbps=nbytes / (us * 1e-6) / 1e9))  # fmt: skip
                line.append(f"{tile.elems}/{tile.num_warps}:{us:.2f}")
            best = min((r for r in results if (r["H"], r["D"], r["T"]) == (h, d, t)), key=lambda r: r["us"])
            print(f"H={h} D={d} T={t}: best {best['elems']}/{best['warps']} {best['us']:.2f} us "
                  f"{best['gbps']:.0f} GB/s | " + " ".join(line), flush=True)  # fmt: skip
        del caches
        torch.cuda.empty_cache()

    table = choose_table(results)
    with open(os.path.join(args.out, "tune.json"), "w") as f:
        json.dump({"results": results, "table": table_json(table)}, f, indent=1)
    return finish(table, args)


TIE = 0.01  # tiles whose score is within 1% of the best are tied


def _geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values))


def choose_table(results: list[dict]) -> dict[int, tuple[TileConfig, float, float]]:
    """head_dim block -> (tile, score, its time / best time at 16k tokens, geometric mean)."""
    table = {}
    for bd in sorted({block_d(r["D"]) for r in results}):
        rows = [r for r in results if block_d(r["D"]) == bd]
        best_us = {}
        for r in rows:
            cell = (r["H"], r["D"], r["T"])
            best_us[cell] = min(best_us.get(cell, math.inf), r["us"])
        scores, large = {}, {}
        for tile in sorted({(r["elems"], r["warps"]) for r in rows}):
            mine = [r for r in rows if (r["elems"], r["warps"]) == tile]
            scores[tile] = _geomean([r["us"] / best_us[(r["H"], r["D"], r["T"])] for r in mine])
            large[tile] = _geomean([r["us"] / best_us[(r["H"], r["D"], r["T"])] for r in mine if r["T"] >= 16384])
        lowest = min(scores.values())
        tied = [t for t in scores if scores[t] <= lowest * (1 + TIE)]
        winner = min(tied, key=lambda t: (large[t], scores[t]))
        ranked = sorted(scores, key=scores.get)[:5]
        print(f"head_dim block {bd}: " + ", ".join(f"{e}/{w}={scores[(e, w)]:.3f} (16k {large[(e, w)]:.3f})" for e, w in ranked)
              + f" -> {winner[0]}/{winner[1]}", flush=True)  # fmt: skip
        table[bd] = (TileConfig(*winner), scores[winner], large[winner])
    return table


def table_json(table: dict) -> dict:
    return {bd: [t.elems, t.num_warps, s, l] for bd, (t, s, l) in table.items()}


def finish(table: dict, args) -> int:
    """The choice is printed by choose_table; nothing is written back into the package."""
    return 0


if __name__ == "__main__":
    sys.exit(main())
