"""A few fused writes for Nsight Compute to read counters of (run under ncu; see scripts/gpu_check.sh).

Each variant is launched twice (the first compiles); ncu profiles every launch of the kernel, so
the even-numbered launches (0-based 1, 3, 5, ...) are the ones to read. Order: see VARIANTS.
"""

from __future__ import annotations

import torch

from kvpool.config import KernelOptions
from kvpool.kernels.checks import write_key
from kvpool.kernels.store_kv import PreparedLaunch, plan_chunk_launch

SLOTS = 1 << 20
T = 16384
# (label, H, D, chunk plan (chunk, elems, warps) or None, contiguous slots)
VARIANTS = [
    ("odd current", 3, 96, None, False),
    ("odd chunk32/e2048/w4", 3, 96, (32, 2048, 4), False),
    ("llama8b current", 8, 128, None, False),
    ("llama8b current contiguous slots", 8, 128, None, True),
    ("llama8b chunk128/e4096/w8", 8, 128, (128, 4096, 8), False),
]


def main() -> None:
    dev = torch.device("cuda")
    scale = torch.tensor([0.37], device=dev)
    for label, h, d, chunk, contig in VARIANTS:
        kc = torch.zeros(SLOTS, h, d, dtype=torch.uint8, device=dev)
        vc = torch.zeros_like(kc)
        x = (torch.randn(T, h, d, device=dev) * 60).to(torch.bfloat16)
        loc = torch.arange(1, T + 1, device=dev) if contig else torch.randperm(SLOTS - 1, device=dev)[:T] + 1
        plan = None if chunk is None else plan_chunk_launch(h, d, h, d, *chunk)
        launch = PreparedLaunch(h, d, h, d, torch.float8_e4m3fn, kc.stride(), vc.stride(), SLOTS, dev,
                                options=KernelOptions(soft_cast=False), caches_aligned=True, row_plan=plan)
        key = write_key(x, x, loc, scale, scale)
        for _ in range(2):
            launch(key, x, x, kc, vc, loc, scale, scale)
        torch.cuda.synchronize()
        print(label, flush=True)


if __name__ == "__main__":
    main()
