"""Compile the benchmark's Triton peers for an H200 (sm_90) without a GPU, as the benchmark launches them.

The CPU dry run of bench_set_kv.py executes these kernels in Triton's interpreter, which does not
notice a construct the GPU compiler rejects; this compiles each peer for sm_90 with the
specialisation a launch on contiguous tensors gets (pointers and row strides divisible by 16) and
prints one JSON line per kernel and geometry: the global load and store forms (vector widths), the
approximate division (``div.full``) and the saturating FP8 conversion it is expected to contain.

Usage: python benchmarks/cross_compile_peers.py   (TRITON_INTERPRET must not be set)
"""

from __future__ import annotations

import json
import os
import re
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("cross_compile_peers.py compiles real kernels: unset TRITON_INTERPRET")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_report  # noqa: E402
import peers  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)


def _compile(fn, sig: dict, const: dict, aligned: list[str], num_warps: int = 4) -> dict:
    names = list(fn.arg_names)
    sig = {**sig, **{n: "constexpr" for n in const}}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    ptx = triton.compile(src, target=SM90, options={"num_warps": num_warps}).asm["ptx"]
    return {
        "loads": sorted(set(re.findall(r"ld\.global[.\w]*", ptx))),
        "stores": sorted(set(re.findall(r"st\.global[.\w]*", ptx))),
        "div_full": len(re.findall(r"div\.full\.f32", ptx)),
        "div_rn": ptx.count("div.rn.f32"),
        "cvt_satfinite": ptx.count("cvt.rn.satfinite"),
    }


def per_token(h: int, d: int) -> dict:
    row = h * d
    sig = {
        "k_ptr": "*bf16", "v_ptr": "*bf16", "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv", "loc_ptr": "*i64",
        "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "stride_k": "i32", "stride_v": "i32", "stride_kc": "i32",
        "stride_vc": "i32",
    }  # fmt: skip
    const = dict(ROW=row, V_ROW=row, BLOCK=triton.next_power_of_2(row), V_BLOCK=triton.next_power_of_2(row), FMAX=448.0)
    aligned = ["k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr", "loc_ptr", "stride_k", "stride_v", "stride_kc", "stride_vc"]
    return _compile(peers._per_token_kernel, sig, const, aligned, peers.per_token_warps(const["BLOCK"]))


def per_head(h: int, d: int) -> dict:
    sig = {
        "k_ptr": "*bf16", "v_ptr": "*bf16", "kc_ptr": "*u8", "vc_ptr": "*u8", "loc_ptr": "*i64", "ks_ptr": "*fp32",
        "vs_ptr": "*fp32", "stride_t": "i32", "stride_h": "i32", "stride_ct": "i32", "stride_ch": "i32",
    }  # fmt: skip
    const = dict(D=d, BLOCK_D=triton.next_power_of_2(d), FMAX=448.0, FP8_E4M3=True)
    aligned = ["k_ptr", "v_ptr", "kc_ptr", "vc_ptr", "loc_ptr", "stride_t", "stride_ct"] + (["stride_h", "stride_ch"] if d % 16 == 0 else [])
    return _compile(peers._straightforward_kernel, sig, const, aligned)


def main() -> int:
    failed = 0
    for name, (h, d) in bench_report.MODELS.items():
        for kernel, fn in (("Triton, program per token", per_token), ("Triton, program per token x head", per_head)):
            line = {"kernel": kernel, "model": name, "target": "sm_90"}
            try:
                line.update(fn(h, d))
            except Exception as exc:
                line["error"] = f"{type(exc).__name__}: {exc}"[:300]
                failed += 1
            print(json.dumps(line), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
