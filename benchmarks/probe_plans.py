"""Time the fused write's launch plans side by side on one GPU, to choose the plan per geometry.

For each geometry (the four of bench_set_kv.py and DeepSeek-V3's MLA row), it times the pool's
current plan, the same plan writing a contiguous run of slots instead of random ones (what the
scatter itself costs), every chunk plan (``store_kv.plan_chunk_launch``: the row viewed as runs of
``chunk`` elements) of a small grid, and, as references, the same-bytes copy kernel of
bench_set_kv.py and the one-program-per-token peer. Large writes: CUDA-graph replays with L2 flushed
before each write; decode sizes: per write in a graph of 64 writes. At decode sizes it also times
the current plan without a scale (no division), with ``div.rn`` alone, and the straightforward port.

``--ladder`` climbs from the same-bytes copy to the write at large sizes, one feature per rung, on the
write's own traffic (the inputs read as one contiguous bf16 run, one byte written per element to a
contiguous output): a byte copy (the high byte of each element, no arithmetic), the FP8 cast alone,
the cast after the reciprocal-and-FMA division, the cast after ``div.rn``, then the pool's plan
writing contiguous slots and random ones, and the joined plans (K and V from one program) at
large and decode sizes. Where the ratio to the same-bytes copy drops shows what
holds a geometry below it.

Usage (GPU): python benchmarks/probe_plans.py --out DIR [--geometries llama8b,odd]
Writes DIR/probe_plans.json; prints one summary line per geometry and size.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402
from timing import flush_buffer, graph_us  # noqa: E402

from kvpool.config import KernelOptions  # noqa: E402
from kvpool.kernels import store_kv  # noqa: E402
from kvpool.kernels.store_kv_kernel import _div_by_reciprocal  # noqa: E402
from kvpool.kernels.checks import write_key  # noqa: E402
from kvpool.kernels.store_kv import PreparedLaunch, TileConfig, plan_chunk_launch  # noqa: E402

FP8 = torch.float8_e4m3fn
SLOTS = 1 << 20
LAYERS = 4
GEOMETRIES = {  # name: (H, D, Hv, Dv, mla)
    "llama8b": (8, 128, 8, 128, False),
    "l70b_tp8": (1, 128, 1, 128, False),
    "qwen_tp8": (1, 256, 1, 256, False),
    "odd": (3, 96, 3, 96, False),
    "mla": (1, 512, 1, 64, True),
}
LARGE = (8192, 16384, 32768)
DECODE = (1, 32, 256)
CHUNKS = (16, 32, 64, 128)
TILES = ((1024, 2), (2048, 4), (4096, 4), (4096, 8))


def make_caches(h: int, d: int, hv: int, dv: int, mla: bool, dev: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """LAYERS (K, V) uint8 caches; for an MLA row, the two parts are views of one [SLOTS, 1, d + dv] buffer."""
    if mla:
        bufs = [torch.zeros(SLOTS, 1, d + dv, dtype=torch.uint8, device=dev) for _ in range(LAYERS)]
        return [(b[:, :, :d], b[:, :, d:]) for b in bufs]
    return [(torch.zeros(SLOTS, h, d, dtype=torch.uint8, device=dev),
             torch.zeros(SLOTS, hv, dv, dtype=torch.uint8, device=dev)) for _ in range(LAYERS)]  # fmt: skip


def make_launcher(caches: list, dev: torch.device, **keywords) -> PreparedLaunch:
    """A launcher for ``caches``' geometry (``keywords``: PreparedLaunch's; the kernel options
    default to the hardware cast with the fast division)."""
    kc0, vc0 = caches[0]
    (h, d), (hv, dv) = kc0.shape[1:], vc0.shape[1:]
    keywords.setdefault("options", KernelOptions(soft_cast=False))
    return PreparedLaunch(h, d, hv, dv, FP8, tuple(kc0.stride()), tuple(vc0.stride()), SLOTS, dev,
                          caches_aligned=True, **keywords)  # fmt: skip


def nbytes(t: int, h: int, d: int, hv: int, dv: int) -> int:
    return t * (h * d + hv * dv) * 3 + t * 8


DECODE_SIZES = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)
COLD_FROM = 512  # sizes from here on are timed with L2 flushed before each write (10 writes per graph)
TILES_BY_SIZE = [TileConfig(e, w) for e, w in (
    (128, 1), (128, 2), (128, 4), (128, 8), (256, 4), (512, 4), (512, 8),  # few elements per thread
    (1024, 4), (2048, 2), (2048, 4), (4096, 4), (4096, 8),  # large writes
)]  # fmt: skip


def decode_sweep(a, names) -> int:
    """Tiles by write size: small tiles (one head block per program, few elements per thread) and
    large ones, from 1 to 16k tokens, with the current tile and the straightforward port; graph
    replays (per write in a graph of 64 writes below COLD_FROM tokens, L2 flushed above)."""
    flush = flush_buffer()
    dev = torch.device("cuda")
    scale = torch.tensor([0.37], device=dev)
    results: list[dict] = []
    for name in names:
        h, d, hv, dv, mla = GEOMETRIES[name]
        caches = make_caches(h, d, hv, dv, mla, dev)
        variants = {"current": make_launcher(caches, dev)}
        for tile in TILES_BY_SIZE:
            variants[f"tile{tile.elems}/w{tile.num_warps}"] = make_launcher(caches, dev, tile=tile)
        for t in DECODE_SIZES:
            gen = torch.Generator(device=dev).manual_seed(t)
            k = (torch.randn(t, h, d, device=dev, generator=gen) * 60).to(torch.bfloat16)
            v = (torch.randn(t, hv, dv, device=dev, generator=gen) * 60).to(torch.bfloat16)
            loc = torch.randperm(SLOTS - 1, device=dev, generator=gen)[:t] + 1
            key = write_key(k, v, loc, scale, scale)
            line = {}
            cold = t >= COLD_FROM
            calls, fl = (10, flush) if cold else (64, None)
            for label, launch in variants.items():
                us = graph_us(lambda i, launch=launch: launch(key, k, v, *caches[i % LAYERS], loc, scale, scale), calls, fl)
                line[label] = us
            if not mla and h == hv and d == dv:
                line["peer/straightforward"] = graph_us(
                    lambda i: peers.straightforward_triton(k, v, *caches[i % LAYERS], loc, scale, scale, FP8), calls, fl)
            for label, us in line.items():
                results.append(dict(geometry=name, T=t, variant=label, us=us))
            print(f"{name} T={t}: " + " ".join(f"{lb}={u:.2f}" for lb, u in sorted(line.items(), key=lambda x: x[1])[:9]),
                  flush=True)  # fmt: skip
        with open(os.path.join(a.out, "probe_decode.json"), "w") as f:
            json.dump({"results": results, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}, f, indent=0)
        del caches, variants
        torch.cuda.empty_cache()
    return 0


@triton.jit
def _ladder_kernel(src_ptr, dst_ptr, scale_ptr, n, RUNG: tl.constexpr, BLOCK: tl.constexpr):
    """src [n] bf16 -> dst [n] uint8, contiguous. RUNG 0: high byte; 1: FP8 cast; 2: reciprocal
    division + cast; 3: div.rn + cast."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(src_ptr + offs, mask=ok, other=1.0)
    if RUNG == 0:
        out = (x.to(tl.int16, bitcast=True) >> 8).to(tl.uint8)
    else:
        y = x.to(tl.float32)
        if RUNG == 2:
            s = tl.load(scale_ptr)
            y = _div_by_reciprocal(y, s, tl.div_rn(1.0, s))
        elif RUNG == 3:
            y = tl.div_rn(y, tl.load(scale_ptr))
        out = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    tl.store(dst_ptr + offs, out, mask=ok)


LADDER_RUNGS = ("byte copy", "cast", "cast + reciprocal division", "cast + div.rn")


@triton.jit
def _flat_part(src_ptr, dst_ptr, loc_ptr, scale_ptr, T, capacity, ROW: tl.constexpr, STRIDE: tl.constexpr, BLOCK: tl.constexpr):
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = e < T * ROW
    t = e // ROW
    col = e - t * ROW
    s = tl.load(scale_ptr)
    slot = tl.load(loc_ptr + t, mask=ok, other=-1)
    x = tl.load(src_ptr + e, mask=ok, other=1.0).to(tl.float32)
    y = _div_by_reciprocal(x, s, tl.div_rn(1.0, s))
    keep = ok & (slot >= 0) & (slot < capacity)
    tl.store(dst_ptr + slot * STRIDE + col, y.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=keep)


@triton.jit
def _flat_write_kernel(
    k_ptr, v_ptr,  # [T, ROW_K] and [T, ROW_V] contiguous inputs (bf16)
    kc_ptr, vc_ptr,  # caches (uint8): row r of K at kc_ptr + r * K_STRIDE, of V at vc_ptr + r * V_STRIDE
    loc_ptr, scale_ptr, T, capacity,
    ROW_K: tl.constexpr, ROW_V: tl.constexpr, K_STRIDE: tl.constexpr, V_STRIDE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The write as a flat walk: axis 1 picks K or V, axis 0 a run of BLOCK elements of that tensor's
    T x ROW inputs; each element finds its token (a division by a constant) and the token's slot."""
    if tl.program_id(1) == 0:
        _flat_part(k_ptr, kc_ptr, loc_ptr, scale_ptr, T, capacity, ROW_K, K_STRIDE, BLOCK)
    elif tl.program_id(0) * BLOCK < T * ROW_V:
        _flat_part(v_ptr, vc_ptr, loc_ptr, scale_ptr, T, capacity, ROW_V, V_STRIDE, BLOCK)


def flat_write(k, v, kc, vc, loc, scale, block=2048, warps=4):
    """Probe launcher for ``_flat_write_kernel`` (contiguous inputs; caches' rows contiguous)."""
    t = k.shape[0]
    row_k, row_v = k[0].numel(), v[0].numel()
    blocks = triton.cdiv(t * max(row_k, row_v), block)
    grid = (blocks, 2)
    _flat_write_kernel[grid](k, v, kc, vc, loc, scale, t, kc.shape[0], ROW_K=row_k, ROW_V=row_v,
                             K_STRIDE=kc.stride(0), V_STRIDE=vc.stride(0), BLOCK=block, num_warps=warps)  # fmt: skip


@triton.jit
def _chunk_rows_kernel(
    k_ptr, v_ptr,  # [T, ROW_K], [T, ROW_V] inputs (bf16), each row contiguous
    kc_ptr, vc_ptr,  # caches (uint8): row r of K at kc_ptr + r * stride_kct, of V at vc_ptr + r * stride_vct
    loc_ptr, ks_ptr, vs_ptr, T, capacity, stride_kt, stride_vt, stride_kct, stride_vct,
    KC: tl.constexpr, VC: tl.constexpr, CHUNK: tl.constexpr, ROWS: tl.constexpr, CONVERT: tl.constexpr = True,
):
    """The write as a walk over chunk-rows: each token's K row is KC runs of CHUNK elements and its
    V row VC runs, one token after another (KC + VC chunk-rows a token); a program takes ROWS
    consecutive chunk-rows, whichever tensor and token they belong to, so every thread moves the
    same vector width whatever the row lengths. A chunk-row finds its token by a division by a
    constant, and its source and cache row by a select between the K and V pointers. Without
    CONVERT it stores each element's high byte instead (no division, no cast: the scatter alone)."""
    PER: tl.constexpr = KC + VC
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    t = r // PER
    c = r - t * PER
    ok = t < T
    is_k = c < KC
    col = tl.where(is_k, c, c - KC) * CHUNK
    d = tl.arange(0, CHUNK)
    slot = tl.load(loc_ptr + t, mask=ok, other=-1)
    src = tl.where(is_k, k_ptr + t * stride_kt, v_ptr + t * stride_vt) + col
    x = tl.load(src[:, None] + d[None, :], mask=ok[:, None], other=1.0)
    if CONVERT:
        ks = tl.load(ks_ptr)
        vs = tl.load(vs_ptr)
        s = tl.where(is_k, ks, vs)[:, None]
        rr = tl.where(is_k, tl.div_rn(1.0, ks), tl.div_rn(1.0, vs))[:, None]
        out = _div_by_reciprocal(x.to(tl.float32), s, rr).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        out = (x.to(tl.int16, bitcast=True) >> 8).to(tl.uint8)
    keep = ok & (slot >= 0) & (slot < capacity)
    dst = tl.where(is_k, kc_ptr + slot * stride_kct, vc_ptr + slot * stride_vct) + col
    tl.store(dst[:, None] + d[None, :], out, mask=keep[:, None])


def chunk_rows_write(k, v, kc, vc, loc, ks, vs, chunk, rows, warps, convert=True):
    """Probe launcher for ``_chunk_rows_kernel`` (inputs' rows and caches' rows contiguous)."""
    t = k.shape[0]
    kc_n, vc_n = k[0].numel() // chunk, v[0].numel() // chunk
    grid = (triton.cdiv(t * (kc_n + vc_n), rows),)
    _chunk_rows_kernel[grid](k, v, kc, vc, loc, ks, vs, t, kc.shape[0], k.stride(0), v.stride(0), kc.stride(0),
                             vc.stride(0), KC=kc_n, VC=vc_n, CHUNK=chunk, ROWS=rows, CONVERT=convert, num_warps=warps)  # fmt: skip


ROW_CHUNKS = (32, 64, 128)
ROW_TILES = ((1024, 4), (2048, 4), (4096, 4), (4096, 8), (8192, 8))
ROW_DECODE_TILES = ((256, 2), (512, 4), (1024, 4))


def rows(a, names) -> int:
    """The chunk-row walk against the pool's plan and the same-bytes copy, large and decode sizes."""
    flush = flush_buffer()
    dev = torch.device("cuda")
    scale = torch.tensor([0.37], device=dev)
    v_scale = torch.tensor([0.61], device=dev)
    results: list[dict] = []
    for name in names:
        h, d, hv, dv, mla = GEOMETRIES[name]
        caches = make_caches(h, d, hv, dv, mla, dev)
        cur = make_launcher(caches, dev, joined=True, flat=False) if mla else make_launcher(caches, dev)  # the pool's plan
        chunks = [c for c in ROW_CHUNKS if (h * d) % c == 0 and (hv * dv) % c == 0]
        for t in LARGE + DECODE:
            cold = t in LARGE
            calls, fl = (10, flush) if cold else (64, None)
            gen = torch.Generator(device=dev).manual_seed(t)
            flat = (torch.randn(t * (h * d + hv * dv), device=dev, generator=gen) * 60).to(torch.bfloat16)
            k = flat[: t * h * d].view(t, h, d)
            v = flat[t * h * d :].view(t, hv, dv)
            loc = torch.randperm(SLOTS - 1, device=dev, generator=gen)[:t] + 1
            key = write_key(k, v, loc, scale, v_scale)
            nb = nbytes(t, h, d, hv, dv)
            line = {"write": graph_us(lambda i: cur(key, k, v, *caches[i % LAYERS], loc, scale, v_scale), calls, fl)}
            if cold:
                n = max(1, nb // 8)
                src = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device=dev)
                dst = torch.empty_like(src)
                line["same-bytes copy"] = graph_us(lambda i: torch.bitwise_not(src, out=dst), calls, fl)
            elif not mla and h == hv and d == dv:
                line["straightforward"] = graph_us(
                    lambda i: peers.straightforward_triton(k, v, *caches[i % LAYERS], loc, scale, v_scale, FP8), calls, fl)
            kc, vc = caches[0]
            kc.zero_(), vc.zero_()
            cur(key, k, v, kc, vc, loc, scale, v_scale)
            want = (kc.clone(), vc.clone())  # whole caches: a stray write anywhere shows
            equal = True
            for chunk in chunks:
                for elems, warps in (ROW_TILES if cold else ROW_DECODE_TILES):
                    if elems < chunk:
                        continue
                    label = f"rows {chunk}x{elems // chunk}/w{warps}"
                    run = lambda i, c=chunk, r=elems // chunk, w=warps: chunk_rows_write(
                        k, v, *caches[i % LAYERS], loc, scale, v_scale, c, r, w)  # fmt: skip
                    line[label] = graph_us(run, calls, fl)
                    kc.zero_(), vc.zero_()
                    chunk_rows_write(k, v, kc, vc, loc, scale, v_scale, chunk, elems // chunk, warps)
                    equal = equal and torch.equal(kc, want[0]) and torch.equal(vc, want[1])
            if cold:  # the scatter alone: high bytes to random / contiguous slots, and the write to contiguous ones
                contig = torch.arange(1, t + 1, device=dev)
                line["write, contiguous slots"] = graph_us(
                    lambda i: cur(key, k, v, *caches[i % LAYERS], contig, scale, v_scale), calls, fl)
                for chunk in chunks[:1] if name != "mla" else (64,):
                    r = 2048 // chunk
                    for slots_label, slots in (("random", loc), ("contiguous", contig)):
                        for conv in (False, True):
                            what = "rows convert" if conv else "rows high byte"
                            line[f"{what} {chunk}x{r}, {slots_label} slots"] = graph_us(
                                lambda i, c=chunk, r=r, sl=slots, cv=conv: chunk_rows_write(
                                    k, v, *caches[i % LAYERS], sl, scale, v_scale, c, r, 4, cv), calls, fl)  # fmt: skip
            ref = line.get("same-bytes copy", line["write"])
            for label, us in line.items():
                results.append(dict(geometry=name, T=t, variant=label, us=us, of_ref=ref / us))
            if cold:
                print(f"  {name} T={t}: " + " | ".join(f"{lb} {ref / us:.1%}" for lb, us in line.items()
                                                      if "slots" in lb), flush=True)
            results.append(dict(geometry=name, T=t, variant="bytes equal", ok=equal))
            best = sorted(((us, lb) for lb, us in line.items() if lb.startswith("rows") and "slots" not in lb))[:3]
            if cold:
                print(f"rows {name} T={t}: copy {nb / ref / 1e3:.0f} GB/s | write {ref / line['write']:.1%} | "
                      + " | ".join(f"{lb} {ref / us:.1%}" for us, lb in best) + f" | bytes equal: {equal}", flush=True)
            else:
                print(f"rows {name} T={t} (us per write, graph of 64): write {line['write']:.3f}"
                      + (f" | straightforward {line['straightforward']:.3f}" if "straightforward" in line else "")
                      + " | " + " | ".join(f"{lb} {us:.3f}" for us, lb in best) + f" | bytes equal: {equal}", flush=True)
        with open(os.path.join(a.out, "probe_rows.json"), "w") as f:
            json.dump({"results": results, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}, f, indent=0)
        del caches
        torch.cuda.empty_cache()
    return 0


def ladder(a, names) -> int:
    """Same-bytes copy -> byte copy -> cast -> division -> the write (contiguous, random slots)."""
    flush = flush_buffer()
    dev = torch.device("cuda")
    scale = torch.tensor([0.37], device=dev)
    results: list[dict] = []
    for name in names:
        h, d, hv, dv, mla = GEOMETRIES[name]
        caches = make_caches(h, d, hv, dv, mla, dev)
        cur = make_launcher(caches, dev)
        joined = {  # K and V written by one program (store_kv.plan_joined_launch), where each row is one block
            label: make_launcher(caches, dev, joined=True, tile=tile, flat=False)
            for label, tile in (("joined", None), ("joined 4096/8", TileConfig(4096, 8)), ("joined 4096/4", TileConfig(4096, 4)),
                                ("joined 2048/2", TileConfig(2048, 2)), ("joined 1024/4", TileConfig(1024, 4)),
                                ("joined 512/4", TileConfig(512, 4)), ("joined 512/2", TileConfig(512, 2)))
            if all(store_kv.plan_joined_launch(h, d, hv, dv, t) is not None
                   for t in ((tile,) if tile else tuple(store_kv.TILE_TABLE.values())))
        }  # fmt: skip
        for t in DECODE:  # per write in a graph of 64 writes, L2 warm
            gen = torch.Generator(device=dev).manual_seed(t)
            k = (torch.randn(t, h, d, device=dev, generator=gen) * 60).to(torch.bfloat16)
            v = (torch.randn(t, hv, dv, device=dev, generator=gen) * 60).to(torch.bfloat16)
            loc = torch.randperm(SLOTS - 1, device=dev, generator=gen)[:t] + 1
            key = write_key(k, v, loc, scale, scale)
            line = {"write": graph_us(lambda i: cur(key, k, v, *caches[i % LAYERS], loc, scale, scale), 64, None)}
            for label, launch in joined.items():
                line[label] = graph_us(lambda i, launch=launch: launch(key, k, v, *caches[i % LAYERS], loc, scale, scale), 64, None)
            for label, us in line.items():
                results.append(dict(geometry=name, T=t, variant=label, us=us))
            print(f"ladder {name} T={t} (us per write, graph): " + " | ".join(f"{lb} {us:.3f}" for lb, us in line.items()),
                  flush=True)  # fmt: skip
        for t in LARGE:
            gen = torch.Generator(device=dev).manual_seed(t)
            flat = (torch.randn(t * (h * d + hv * dv), device=dev, generator=gen) * 60).to(torch.bfloat16)
            k = flat[: t * h * d].view(t, h, d)
            v = flat[t * h * d :].view(t, hv, dv)
            out = torch.empty(flat.numel(), dtype=torch.uint8, device=dev)
            loc = torch.randperm(SLOTS - 1, device=dev, generator=gen)[:t] + 1
            contig = torch.arange(1, t + 1, device=dev)
            nb = nbytes(t, h, d, hv, dv)
            n = max(1, nb // 8)
            src = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device=dev)
            dst = torch.empty_like(src)
            line = {"same-bytes copy": graph_us(lambda i: torch.bitwise_not(src, out=dst), 10, flush)}
            numel, block = flat.numel(), 2048
            for rung, label in enumerate(LADDER_RUNGS):
                line[label] = graph_us(lambda i, rung=rung: _ladder_kernel[(triton.cdiv(numel, block),)](
                    flat, out, scale, numel, RUNG=rung, BLOCK=block, num_warps=4), 10, flush)  # fmt: skip
            key = write_key(k, v, loc, scale, scale)
            line["write, contiguous slots"] = graph_us(lambda i: cur(key, k, v, *caches[i % LAYERS], contig, scale, scale), 10, flush)
            line["write, random slots"] = graph_us(lambda i: cur(key, k, v, *caches[i % LAYERS], loc, scale, scale), 10, flush)
            for label, launch in joined.items():
                if label == "joined":
                    line["write joined, contiguous slots"] = graph_us(
                        lambda i, launch=launch: launch(key, k, v, *caches[i % LAYERS], contig, scale, scale), 10, flush)
                line[f"write {label}, random slots"] = graph_us(
                    lambda i, launch=launch: launch(key, k, v, *caches[i % LAYERS], loc, scale, scale), 10, flush)
            for block, warps in ((1024, 4), (2048, 4), (4096, 8)):
                line[f"flat write {block}/{warps}, random slots"] = graph_us(
                    lambda i, b=block, w=warps: flat_write(k, v, *caches[i % LAYERS], loc, scale, b, w), 10, flush)
            # The flat walk must write what the pool's plan writes.
            kc, vc = caches[0]
            kc.zero_(), vc.zero_()
            cur(key, k, v, kc, vc, loc, scale, scale)
            want = (kc[loc].clone(), vc[loc].clone())
            kc.zero_(), vc.zero_()
            flat_write(k, v, kc, vc, loc, scale)
            line_ok = torch.equal(kc[loc], want[0]) and torch.equal(vc[loc], want[1])
            for launch in joined.values():  # and so must the joined plans
                kc.zero_(), vc.zero_()
                launch(key, k, v, kc, vc, loc, scale, scale)
                line_ok = line_ok and torch.equal(kc[loc], want[0]) and torch.equal(vc[loc], want[1])
            copy_us = line["same-bytes copy"]
            for label, us in line.items():
                results.append(dict(geometry=name, T=t, variant=label, us=us, of_copy=copy_us / us))
            results.append(dict(geometry=name, T=t, variant="flat write bytes equal", ok=line_ok))
            print(f"ladder {name} T={t}: " + " | ".join(f"{lb} {copy_us / us:.1%}" for lb, us in line.items())
                  + f" | flat and joined bytes equal: {line_ok}", flush=True)  # fmt: skip
        with open(os.path.join(a.out, "probe_ladder.json"), "w") as f:
            json.dump({"results": results, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}, f, indent=0)
        del caches
        torch.cuda.empty_cache()
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench_out")
    p.add_argument("--geometries", default=",".join(GEOMETRIES))
    p.add_argument("--decode", action="store_true", help="sweep small tiles at decode sizes only")
    p.add_argument("--ladder", action="store_true", help="copy -> cast -> division -> write, at large sizes only")
    p.add_argument("--rows", action="store_true", help="the chunk-row walk against the write, large and decode sizes")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.ladder:
        return ladder(a, a.geometries.split(","))
    if a.rows:
        return rows(a, a.geometries.split(","))
    if a.decode:
        return decode_sweep(a, a.geometries.split(","))
    dev = torch.device("cuda")
    flush = flush_buffer()
    scale = torch.tensor([0.37], device=dev)
    results: list[dict] = []
    t_start = time.perf_counter()

    def save() -> None:
        with open(os.path.join(a.out, "probe_plans.json"), "w") as f:
            json.dump({"results": results, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}, f, indent=0)

    for name in a.geometries.split(","):
        h, d, hv, dv, mla = GEOMETRIES[name]
        caches = make_caches(h, d, hv, dv, mla, dev)
        variants = {"current": make_launcher(caches, dev)}
        for chunk in CHUNKS:
            for elems, warps in TILES:
                plan = plan_chunk_launch(h, d, hv, dv, chunk, elems, warps)
                if plan is not None:
                    variants[f"chunk{chunk}/e{elems}/w{warps}"] = make_launcher(caches, dev, row_plan=plan)
        for t in LARGE + DECODE:
            cold = t in LARGE
            calls = 10 if cold else 64
            gen = torch.Generator(device=dev).manual_seed(t)
            k = (torch.randn(t, h, d, device=dev, generator=gen) * 60).to(torch.bfloat16)
            v = (torch.randn(t, hv, dv, device=dev, generator=gen) * 60).to(torch.bfloat16)
            loc = torch.randperm(SLOTS - 1, device=dev, generator=gen)[:t] + 1
            contig = torch.arange(1, t + 1, device=dev)
            nb = nbytes(t, h, d, hv, dv)
            line: dict[str, float] = {}

            def timed(label, fn):
                try:
                    us = graph_us(fn, calls, flush if cold else None)
                except Exception as exc:  # a variant that fails to compile or launch is reported
                    print(f"  {name} T={t} {label}: {type(exc).__name__}: {exc}"[:300], flush=True)
                    return
                line[label] = us
                results.append(dict(geometry=name, T=t, variant=label, us=us, gbps=nb / (us * 1e-6) / 1e9))

            key = write_key(k, v, loc, scale, scale)
            for label, launch in variants.items():
                timed(label, lambda i, launch=launch: launch(key, k, v, *caches[i % LAYERS], loc, scale, scale))
            cur = variants["current"]
            timed("current/contiguous", lambda i: cur(key, k, v, *caches[i % LAYERS], contig, scale, scale))
            n = max(1, nb // 8)
            src = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device=dev)
            dst = torch.empty_like(src)
            timed("same-bytes copy", lambda i: torch.bitwise_not(src, out=dst))
            if not mla:
                fp8_caches = [(kc.view(FP8), vc.view(FP8)) for kc, vc in caches]
                timed("peer/per-token", lambda i: peers.per_token_triton(k, v, *fp8_caches[i % LAYERS], loc, scale, scale))
            if not cold:
                key_none = write_key(k, v, loc, None, None)
                timed("current/no-scale", lambda i: cur(key_none, k, v, *caches[i % LAYERS], loc, None, None))
                slow = make_launcher(caches, dev, options=KernelOptions(soft_cast=False, fast_div=False))
                timed("current/div.rn", lambda i: slow(key, k, v, *caches[i % LAYERS], loc, scale, scale))
                if not mla and h == hv and d == dv:
                    timed("peer/straightforward",
                          lambda i: peers.straightforward_triton(k, v, *caches[i % LAYERS], loc, scale, scale, FP8))  # fmt: skip
            copy_us = line.get("same-bytes copy")
            chunk_best = min((u, lb) for lb, u in line.items() if lb.startswith("chunk")) if any(
                lb.startswith("chunk") for lb in line) else (float("nan"), "-")  # fmt: skip
            if cold:
                print(f"{name} T={t}: copy {nb / copy_us / 1e3:.0f} GB/s | current {copy_us / line.get('current', float('nan')):.1%} "
                      f"contig {copy_us / line.get('current/contiguous', float('nan')):.1%} | best chunk {chunk_best[1]} "
                      f"{copy_us / chunk_best[0]:.1%} | per-token {copy_us / line.get('peer/per-token', float('nan')):.1%}",
                      flush=True)  # fmt: skip
            else:
                print(f"{name} T={t}: us " + " ".join(f"{lb}={u:.2f}" for lb, u in sorted(line.items(), key=lambda x: x[1])[:8]),
                      flush=True)  # fmt: skip
            save()
        del caches, variants
        torch.cuda.empty_cache()
    print(f"probe done in {time.perf_counter() - t_start:.0f} s", flush=True)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
