"""Where a decode-sized write's time goes: the fused write against the straightforward port, one
difference at a time (issue 15's decode target: no slower than any straightforward port as a
CUDA-graph replay).

The port (``peers.straightforward_triton``: one program per (token, head), K and V on a third grid
axis, Triton's approximate ``/``) is rebuilt here with switches, each adding one thing the fused
write does or has:

* ``div``: how it divides: ``approx`` (the port's ``/``), ``exact`` (the write's division: the
  reciprocal by ``div.rn`` once per program and two FMAs per element, behind the write's range check
  of the scale), ``exact_nobranch`` (the same without the range check), ``div_rn`` (``div.rn`` per
  element);
* ``pad``: 28 more kernel arguments (the write's kernel has about 40 runtime arguments, the port 11);
* ``check``: the write's slot range check (``0 <= slot < capacity``, stores masked by it) in 32-bit.

Beside them: the pool's own write (tensor scales, as the benchmark times it), with float scales,
without scales, with ``div.rn`` per element, and with smaller tiles than the table's decode tile.
Each figure is microseconds per write in a graph of 64 writes cycling over 4 layers' caches, no L2
flush (the benchmark's "graph" column).

Usage (GPU): python benchmarks/probe_decode.py --out DIR
Writes DIR/probe_decode.json and prints one line per geometry and size.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402
from timing import graph_us  # noqa: E402

from kvpool import MHATokenToKVPool  # noqa: E402
from kvpool.config import KernelOptions  # noqa: E402
from kvpool.kernels.store_kv import TileConfig, launch_store_kv  # noqa: E402
from kvpool.kernels.store_kv_kernel import _div_by_reciprocal, _divide_scalar  # noqa: E402

FP8 = torch.float8_e4m3fn
SLOTS = 1 << 16
LAYERS = 4
GEOMETRIES = {"l70b_tp8": (1, 128), "llama8b": (8, 128), "odd": (3, 96)}
TOKENS = (1, 32)
DIVS = {"approx": 0, "exact": 1, "exact_nobranch": 2, "div_rn": 3}


@triton.jit
def _port_body(k_ptr, v_ptr, kc_ptr, vc_ptr, loc_ptr, ks_ptr, vs_ptr, stride_t, stride_h, stride_ct, stride_ch,
               capacity, D: tl.constexpr, BLOCK_D: tl.constexpr, DIV: tl.constexpr, CHECK: tl.constexpr):  # fmt: skip
    t = tl.program_id(0)
    h = tl.program_id(1)
    is_v = tl.program_id(2)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    slot = tl.load(loc_ptr + t)
    src = tl.where(is_v == 1, v_ptr, k_ptr) + t * stride_t + h * stride_h + offs
    scale = tl.load(tl.where(is_v == 1, vs_ptr, ks_ptr))
    x = tl.load(src, mask=mask).to(tl.float32)
    if DIV == 0:
        x = x / scale
    elif DIV == 1:
        x = _divide_scalar(x, scale, scale, True, False)
    elif DIV == 2:
        x = _div_by_reciprocal(x, scale, tl.div_rn(1.0, scale))
    else:
        x = tl.div_rn(x, scale)
    if DIV == 0:
        x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    y = x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    if CHECK:
        ok = (slot >= 0) & (slot < capacity)
        slot = slot.to(tl.int32)
        mask = mask & ok
    else:
        slot = slot.to(tl.int64)
    dst = tl.where(is_v == 1, vc_ptr, kc_ptr) + slot * stride_ct + h * stride_ch + offs
    tl.store(dst, y, mask=mask)


@triton.jit(do_not_specialize=["capacity"])
def _port_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, loc_ptr, ks_ptr, vs_ptr, stride_t, stride_h, stride_ct, stride_ch,
                 capacity, D: tl.constexpr, BLOCK_D: tl.constexpr, DIV: tl.constexpr, CHECK: tl.constexpr):  # fmt: skip
    _port_body(k_ptr, v_ptr, kc_ptr, vc_ptr, loc_ptr, ks_ptr, vs_ptr, stride_t, stride_h, stride_ct, stride_ch,
               capacity, D, BLOCK_D, DIV, CHECK)  # fmt: skip


_PADS = [f"p{i}" for i in range(28)]


@triton.jit(do_not_specialize=["capacity"] + _PADS)
def _port_kernel_padded(k_ptr, v_ptr, kc_ptr, vc_ptr, loc_ptr, ks_ptr, vs_ptr, stride_t, stride_h, stride_ct, stride_ch,
                        capacity, p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15, p16, p17, p18,
                        p19, p20, p21, p22, p23, p24, p25, p26, p27,
                        D: tl.constexpr, BLOCK_D: tl.constexpr, DIV: tl.constexpr, CHECK: tl.constexpr):  # fmt: skip
    _port_body(k_ptr, v_ptr, kc_ptr, vc_ptr, loc_ptr, ks_ptr, vs_ptr, stride_t, stride_h, stride_ct, stride_ch,
               capacity, D, BLOCK_D, DIV, CHECK)  # fmt: skip


def port(k, v, kc, vc, loc, ks, vs, div: int, pad: bool, check: bool) -> None:
    t, h, d = k.shape
    args = (k, v, kc, vc, loc, ks, vs, k.stride(0), k.stride(1), kc.stride(0), kc.stride(1), kc.shape[0])
    consts = dict(D=d, BLOCK_D=triton.next_power_of_2(d), DIV=div, CHECK=check)
    if pad:
        _port_kernel_padded[(t, h, 2)](*args, *[1000 + i for i in range(28)], **consts)
    else:
        _port_kernel[(t, h, 2)](*args, **consts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="probe_out")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("probe_decode.py needs a CUDA device", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda")
    records = []
    for name, (h, d) in GEOMETRIES.items():
        pool = MHATokenToKVPool(SLOTS, 1, FP8, h, d, LAYERS, dev, fused="always", warmup=False)
        kb, vb = pool.k_buffer, pool.v_buffer
        kv = [pool.get_kv_buffer(i) for i in range(LAYERS)]
        gen = torch.Generator(device=dev).manual_seed(0)
        for t in TOKENS:
            k = (torch.randn(t, h, d, device=dev, generator=gen) * 60).to(torch.bfloat16)
            v = (torch.randn(t, h, d, device=dev, generator=gen) * 60).to(torch.bfloat16)
            loc = torch.randperm(SLOTS - 1, device=dev, generator=gen)[:t] + 1
            scale = torch.tensor([1.7], device=dev)
            fns = {
                "kvpool": lambda i: pool.set_kv_buffer(None, loc, k, v, scale, scale, layer_id_override=i),
                "kvpool float scales": lambda i: pool.set_kv_buffer(None, loc, k, v, 1.7, 1.7, layer_id_override=i),
                "kvpool no scales": lambda i: pool.set_kv_buffer(None, loc, k, v, layer_id_override=i),
                "kvpool div.rn": lambda i: launch_store_kv(k, v, kv[i][0], kv[i][1], loc, scale, scale,
                                                           options=KernelOptions(fast_div=False)),  # fmt: skip
                "peer straightforward": lambda i: peers.straightforward_triton(k, v, kb[i], vb[i], loc, scale, scale, FP8),
            }
            for elems in (128, 256, 512):
                tile = TileConfig(elems, 4)
                fns[f"kvpool tile {elems}/4"] = lambda i, tile=tile: launch_store_kv(
                    k, v, kv[i][0], kv[i][1], loc, scale, scale, tile=tile
                )
            for div_name, div in DIVS.items():
                for pad in (False, True):
                    for check in (False, True):
                        label = f"port div={div_name}" + (" pad" if pad else "") + (" check" if check else "")
                        fns[label] = lambda i, div=div, pad=pad, check=check: port(
                            k, v, kb[i], vb[i], loc, scale, scale, div, pad, check
                        )
            line = []
            for label, fn in fns.items():
                rec = dict(geometry=name, H=h, D=d, T=t, method=label)
                try:
                    fn(0)
                    torch.cuda.synchronize()
                    cycle = lambda i, fn=fn: fn(i % LAYERS)  # noqa: E731
                    rec["graph_us"] = graph_us(cycle, 64)
                    rec["graph_us_2"] = graph_us(cycle, 64)  # a second capture: the spread between captures
                except Exception as exc:  # keep the other variants
                    rec["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                records.append(rec)
                line.append(f"{label}=" + (f"{rec['graph_us']:.3f}/{rec['graph_us_2']:.3f}" if "graph_us" in rec else "error"))
            print(f"{name} T={t}: " + "; ".join(line), flush=True)
        del pool
        torch.cuda.empty_cache()
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    with open(os.path.join(args.out, "probe_decode.json"), "w") as f:
        json.dump(dict(meta=meta, records=records), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
