"""Compile the fused kernel ahead of time for GPU targets this machine does not have.

Triton compiles for a named target without a device (through PTX/cubin for NVIDIA, AMDGCN/hsaco for
AMD), so CI, which has no GPU, can still check that every kernel variant compiles for real hardware
(the interpreter would not notice a construct the compiler rejects) and that the Hopper build keeps
16-byte vector loads and stores and hardware FP8 conversion. Prints one JSON line per variant.

Usage: python scripts/cross_compile.py [--full | --copy-rows | --allocator | --fp4]   (TRITON_INTERPRET must not be set)
``--copy-rows`` compiles the row-copy kernel (kvpool/kernels/copy_rows/kernel.py) instead, for the plans the
launcher makes, and counts its vector accesses and barriers. ``--allocator`` compiles the allocators'
bookkeeping kernels (kvpool/kernels/allocator/kernel.py), every kind the launchers make. ``--fp4``
compiles the FP4 and NVFP4 writes for the geometries the benchmark writes, counting their vector
accesses, registers and spills.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("cross_compile.py compiles real kernels: unset TRITON_INTERPRET")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kvpool.kernels.allocator import kernel as AK  # noqa: E402
from kvpool.kernels.allocator import launcher as AL  # noqa: E402
from kvpool.kernels.copy_rows import kernel as CK  # noqa: E402
from kvpool.kernels.store_fp4 import kernel as FP4K  # noqa: E402
from kvpool.kernels.store_nvfp4 import kernel as NVFP4K  # noqa: E402
from kvpool.kernels.store_kv import kernel as K  # noqa: E402
from kvpool.kernels.copy_rows.launcher import FEW_PROGRAMS_TILE, SM_TILE, plan_copy  # noqa: E402
from kvpool.kernels.store_fp4.writer import FP4_TILE  # noqa: E402
from kvpool.kernels.store_nvfp4.writer import NVFP4_TILE  # noqa: E402
from kvpool.kernels.store_kv.writer import PER_CALL  # noqa: E402
from kvpool.kernels.store_kv.plan import SMALL_TOKENS, plan_write  # noqa: E402

OUT_TYPES = {0: "u8", 1: "u8", 2: "bf16", 3: "fp16", 4: "fp32", 5: "u8", 6: "u8"}  # formats.OUT_KIND
TARGETS = {
    "sm90": (GPUTarget("cuda", 90, 32), False),
    "sm100": (GPUTarget("cuda", 100, 32), False),
    "sm80": (GPUTarget("cuda", 80, 32), True),
    "gfx942": (GPUTarget("hip", "gfx942", 64), True),
}


def compile_variant(
    target_name, heads, head_dim, out_kind, in_type, k_kind, v_kind, loc_type="i64", prefix=False, observe=False,
    i64=True, flat=False, joined=False, v_head_dim=None, mapped=False,
):  # fmt: skip
    target, soft = TARGETS[target_name]
    names = list(K.store_kv.arg_names)
    v_head_dim = v_head_dim or head_dim
    # The large writes' plans: the per-head one, the row plan of geometries the per-head plan pads
    # badly or cuts into two pieces per head (flat), or the joined one (K and V from one program).
    plan = plan_write(heads, head_dim, heads, v_head_dim, SMALL_TOKENS + 1, row=flat, joined=joined)
    assert plan.row_view == flat and plan.joined == joined, (heads, head_dim, flat, joined, plan)
    sig = {
        "k_ptr": f"*{in_type}", "v_ptr": f"*{in_type}",
        "k_cache_ptr": f"*{OUT_TYPES[out_kind]}", "v_cache_ptr": f"*{OUT_TYPES[out_kind]}",
        "loc_ptr": f"*{loc_type}", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
        "commit_ptr": f"*{loc_type}", "k_amax_ptr": "*fp32", "v_amax_ptr": "*fp32",
        "k_scale_value": "fp32", "v_scale_value": "fp32", "k_scale_stride": "i32", "v_scale_stride": "i32",
        "T": "i32", "capacity": "i32", "width": "i32", "stride_loc": "i32", "stride_loc_row": "i32",
        "stride_commit": "i32", "map_ptr": "*i64", "map_rows": "i32",
    }  # fmt: skip
    assert tuple(names[: len(PER_CALL)]) == PER_CALL, "the kernel's per-call arguments moved"
    strides = [n for n in names if n.startswith("stride_") and n not in ("stride_loc", "stride_loc_row", "stride_commit")]
    const = dict(
        H=plan.heads, D=plan.head_dim, HV=plan.v_heads, DV=plan.v_head_dim, BLOCK_T=plan.block_t,
        BLOCK_H=plan.block_h, BLOCK_D=plan.block_d, BLOCK_HV=plan.block_hv, BLOCK_DV=plan.block_dv,
        BLOCK_D2=plan.block_d2, BLOCK_DV2=plan.block_dv2,
        K_SCALE_KIND=k_kind, V_SCALE_KIND=v_kind, OUT_KIND=out_kind, SOFT_CAST=soft, FAST_DIV=not soft,
        PREFIX=prefix, OBSERVE=observe, I64=i64, JOINED=plan.joined, MAPPED=mapped,
    )  # fmt: skip
    # As Triton specializes a contiguous launch: unit head_dim strides, the rest divisible by 16.
    for n in strides:
        if n.endswith("d"):
            const[n] = 1
        else:
            sig[n] = "i32"
    sig.update({n: "constexpr" for n in const})
    sig = {n: sig[n] for n in names}  # in signature order
    aligned = ["k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr", "capacity"] + [n for n in strides if not n.endswith("d")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(
        fn=K.store_kv, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs
    )
    compiled = triton.compile(src, target=target, options={"num_warps": plan.num_warps})
    info = {"target": target_name, "H": heads, "D": head_dim, "out_kind": out_kind, "in": in_type,
            "k_kind": k_kind, "v_kind": v_kind, "soft": soft, "prefix": prefix, "observe": observe,
            "i64": i64, "flat": flat, "joined": joined, "DV": v_head_dim, "mapped": mapped}  # fmt: skip
    ptx = compiled.asm.get("ptx")
    if ptx is not None:
        info["ld_v4"] = len(re.findall(r"ld\.global(?:\.\w+)*\.v4", ptx))
        info["st_v4"] = len(re.findall(r"st\.global(?:\.\w+)*\.v4", ptx))
        info["cvt_satfinite"] = ptx.count("cvt.rn.satfinite")
        info["div_rn"] = ptx.count("div.rn.f32")
        info["fma_rn"] = ptx.count("fma.rn.f32")
        info["max_nan"] = ptx.count("max.NaN.f32")
        info["mul_wide"] = ptx.count("mul.wide.s32") + ptx.count("mul.lo.s64")
        info["atom_max"] = len(re.findall(r"atom\.global(?:\.\w+)*\.max", ptx)) + len(re.findall(r"red\.global(?:\.\w+)*\.max", ptx))
    gcn = compiled.asm.get("amdgcn")
    if gcn is not None:
        # The hardware FP8 conversions of gfx942 (e4m3fnuz "fp8", e5m2fnuz "bf8"), which the write
        # does not use; and the stores, to show the kernel was built.
        info["cvt_fp8"] = len(re.findall(r"v_cvt_(?:pk|sr)_(?:fp8|bf8)_f32", gcn))
        info["stores"] = len(re.findall(r"global_store|buffer_store", gcn))
    return info


_COPY_ELEM = {1: "u8", 2: "i16", 4: "i32"}


def compile_copy_rows(target_name, row_bytes, align, n_pairs, one_pass, few_programs=False, index_type="i64"):
    """Compile the copy kernel as the launcher would launch it for this geometry."""
    target, _ = TARGETS[target_name]
    tile = FEW_PROGRAMS_TILE if few_programs else SM_TILE
    plan = plan_copy(n_pairs, 2, tuple(sorted(set(row_bytes))), align, one_pass, 8 if few_programs else 1056, tile)
    names = list(CK.copy_rows.arg_names)
    sig = {"dst_table_ptr": "*i64", "src_table_ptr": "*i64", "dst_index_ptr": f"*{index_type}", "src_index_ptr": f"*{index_type}"}
    for n in names[4:]:
        if n.isupper():
            break
        sig[n] = "i32"
    const = dict(
        ELEM_BYTES=plan.elem_bytes, ALIGN=plan.align,
        BLOCK_P=plan.block_p, BLOCK_W=plan.block_w, EVEN=plan.even, ONE_PASS=plan.one_pass,
    )  # fmt: skip
    sig.update({n: "constexpr" for n in const})
    src = ASTSource(fn=CK.copy_rows, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()})
    compiled = triton.compile(src, target=target, options={"num_warps": plan.num_warps})
    info = {"kernel": "copy_rows", "target": target_name, "row_bytes": list(row_bytes), "align": align,
            "pairs": n_pairs, "one_pass": one_pass, "few_programs": few_programs, "block_p": plan.block_p,
            "block_w": plan.block_w, "elem": _COPY_ELEM[plan.elem_bytes], "num_warps": plan.num_warps}  # fmt: skip
    ptx = compiled.asm.get("ptx")
    if ptx is not None:
        for width in ("v4", "v2"):
            info[f"ld_{width}"] = len(re.findall(rf"ld\.global(?:\.\w+)*\.{width}", ptx))
            info[f"st_{width}"] = len(re.findall(rf"st\.global(?:\.\w+)*\.{width}", ptx))
        info["ld"] = len(re.findall(r"ld\.global", ptx))
        info["st"] = len(re.findall(r"st\.global", ptx))
        info["bar_sync"] = len(re.findall(r"bar\.sync|barrier\.sync", ptx))
    return info


COPY_VARIANTS = [
    # (target, row bytes (K, V), align, pairs, one pass, few programs)
    ("sm90", (1024, 1024), 16, 100_000, False, False),  # Llama-3-8B FP8 rows, device-to-device
    ("sm90", (1024, 1024), 16, 8192, False, True),  # the host tier's grid of a few programs
    ("sm90", (1024, 1024), 16, 256, True, False),  # a speculative-decoding move (aliasing)
    ("sm90", (1024, 1024), 16, 1, True, False),
    ("sm90", (288, 192), 16, 7, False, False),  # H=3, D=96 FP8 with Dv=64: rows of two lengths
    ("sm90", (24, 24), 8, 64, False, False),  # 8-byte aligned rows: 8-byte vectors
    ("sm90", (6, 6), 2, 64, False, False),
    ("sm100", (1024, 1024), 16, 256, True, False),
    ("sm80", (512, 512), 16, 4096, False, False),
    ("gfx942", (1024, 1024), 16, 256, True, False),
]


def compile_allocator(target_name, name, consts, lens_type="i64"):
    """Compile one of the allocator kernels with the constexprs a launcher passes (every integer
    argument 32-bit, the common case; the kernels specialise on nothing else)."""
    target, _ = TARGETS[target_name]
    fn = getattr(AK, name)
    names = list(fn.arg_names)
    types = {
        "hand_out": ["*i64", "*i64", f"*{lens_type}", f"*{lens_type}", f"*{lens_type}", "*i32", "*i32", "*i1", "*i1", "*i64"],
        "give_back": ["*i64", "*i32", "*i32", "*i1", "*i64", "*i64", "*i64", "*i64", "*i64", "*i64", "*i64", "*i64"],
    }[name]  # fmt: skip
    sig = dict(zip(names, types))
    for n in names[len(types):]:
        sig[n] = "constexpr" if n.isupper() else "i32"
    const = dict(zip([n for n in names if n.isupper()], consts))
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()})
    warps = AL.HAND_OUT_WARPS if name == "hand_out" else AL.give_back_shape(const["SORT"])[1]
    compiled = triton.compile(src, target=target, options={"num_warps": warps})
    out = {"kernel": name, "target": target_name, "consts": list(consts), "lens": lens_type}
    if target_name == "sm90":
        out.update(registers_and_spills(compiled.asm["ptx"], 90))
    return out


def registers_and_spills(ptx: str, capability: int) -> dict:
    """What ptxas reports for a kernel's PTX on an NVIDIA target: registers per thread and the bytes
    spilled to local memory (a kernel that spills runs its arithmetic through memory)."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        arch = f"sm_{capability}a" if capability >= 90 else f"sm_{capability}"
        cmd = [get_ptxas(capability).path, f"-arch={arch}", "-v", src, "-o", os.path.join(d, "kernel.cubin")]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    return {
        "registers": int(re.search(r"Used (\d+) registers", log).group(1)),
        "spill_bytes": int(re.search(r"(\d+) bytes spill stores", log).group(1)),
    }


def allocator_variants():
    """The kinds the launchers make: on Hopper every hand-out kind with and without the validate
    bookkeeping and every give-back destination, of slots and of pages; on the other targets and at
    one slot per page, the extend hand-out and the free to the ring."""
    hand = lambda page, kind, ever=False: ("hand_out", (page, kind, ever, AL.HAND_OUT_BLOCK, AL.HAND_OUT_REQ_BLOCK, AL.HAND_OUT_SUB_BLOCK))  # noqa: E731
    give = lambda page, dest, to, append=False, sort=0, skip=False, mirror=False, mapped=False: (  # noqa: E731
        "give_back", AL.give_back_consts(page, dest, to, append, sort, skip, mirror, mapped)[0]
    )
    for kind in (AL.PLAIN, AL.EXTEND, AL.DECODE):
        for ever in (False, True):
            yield ("sm90", *hand(64, kind, ever))
    for dest, to in ((AL.RING, AL.TO_TAIL), (AL.LIST, AL.TO_RELEASE), (AL.LIST, AL.TO_NONE)):
        for append in (False, True):
            yield ("sm90", *give(64, dest, to, append))
    yield ("sm90", *hand(64, AL.EXTEND), "i32")
    for sort in (16, AL.GIVE_BACK_SORT_MAX):  # the smallest and the largest free the kernel sorts itself,
        # copying its counters to the host as a GPU allocator's free does
        yield ("sm90", *give(64, AL.RING, AL.TO_TAIL, False, sort, mirror=True))
        yield ("gfx942", *give(64, AL.RING, AL.TO_TAIL, False, sort, mirror=True))
    yield ("sm90", *give(64, AL.RING, AL.TO_TAIL, False, AL.GIVE_BACK_SORT_MAX, True, True, True))  # a SWA part's free
    yield ("sm90", *give(1, AL.LIST, AL.TO_NONE, False, 16, True, True, True))  # ... in a free group, one slot a page
    for target in TARGETS:
        yield (target, *hand(1, AL.PLAIN))
        yield (target, *give(1, AL.RING, AL.TO_TAIL, mirror=True))
    for target in ("sm100", "sm80", "gfx942"):
        yield (target, *hand(64, AL.EXTEND))


def compile_fp4(target_name, fmt, heads, head_dim, v_head_dim=None, in_type="bf16"):
    """Compile an FP4 write (``fmt``: "fp4" or "nvfp4") as its launcher launches contiguous K and V
    rows of ``heads`` x ``head_dim`` (V: ``v_head_dim``): unit element strides, the rest divisible
    by 16."""
    target, _ = TARGETS[target_name]
    fn = FP4K.store_fp4_kv if fmt == "fp4" else NVFP4K.store_nvfp4_kv
    names = list(fn.arg_names)
    dv = v_head_dim or head_dim
    words = in_type in ("bf16", "fp16")  # even strides and aligned starts, as a contiguous launch has
    kb, vb = heads * head_dim // 16, heads * dv // 16
    rows, warps = FP4_TILE if fmt == "fp4" else NVFP4_TILE
    const = dict(D=head_dim, DV=dv, K_BLOCKS=kb, V_BLOCKS=vb, ROWS=rows, K_WORDS=words, V_WORDS=words,
                 CODE16=in_type != "fp32", sk_d=1, sv_d=1)  # fmt: skip
    sig = {n: "constexpr" if n in const else "i32" for n in names}
    sig.update(k_ptr=f"*{in_type}", v_ptr=f"*{in_type}", loc_ptr="*i64")
    for n in names:
        if n.endswith("_ptr") and n not in ("k_ptr", "v_ptr", "loc_ptr"):
            sig[n] = "*fp32" if "global" in n else "*u8"
    aligned = [n for n in names if sig[n] != "constexpr" and n not in ("loc_ptr", "rows", "T", "k_programs", "stride_loc")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    compiled = triton.compile(src, target=target, options={"num_warps": warps})
    info = {"kernel": fmt, "target": target_name, "H": heads, "D": head_dim, "DV": dv, "in": in_type, "ROWS": rows}
    ptx = compiled.asm.get("ptx")
    if ptx is not None:
        info["ld_v4"] = len(re.findall(r"ld\.global(?:\.\w+)*\.v4", ptx))
        info["st_vector"] = len(re.findall(r"st\.global(?:\.\w+)*\.v[24]", ptx))
        if target_name == "sm90":
            info.update(registers_and_spills(ptx, 90))
    return info


FP4_VARIANTS = [
    (target, fmt, h, d) for target in ("sm90", "sm100") for fmt in ("fp4", "nvfp4") for h, d in ((8, 128), (1, 128), (1, 256))
] + [("sm90", "fp4", 1, 512, 64)]  # the FP4 MLA pool's write: the latent part as K, the rotary part as V


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--full", action="store_true", help="every output kind, input type and scale kind")
    parser.add_argument("--copy-rows", action="store_true", help="the row-copy kernel's variants instead")
    parser.add_argument("--fp4", action="store_true", help="the FP4 and NVFP4 writes instead")
    parser.add_argument("--allocator", action="store_true", help="the allocators' bookkeeping kernels instead")
    args = parser.parse_args()
    if args.allocator:
        for v in allocator_variants():
            print(json.dumps(compile_allocator(*v)), flush=True)
        return 0
    if args.fp4:
        for v in FP4_VARIANTS:
            print(json.dumps(compile_fp4(*v)), flush=True)
        return 0
    if args.copy_rows:
        for v in COPY_VARIANTS:
            print(json.dumps(compile_copy_rows(*v)), flush=True)
        return 0
    if args.full:
        variants = itertools.product(TARGETS, [(3, 96), (8, 128)], OUT_TYPES, ["bf16", "fp16", "fp32"], range(4))
        variants = [(t, h, d, o, i, s, s) for t, (h, d), o, i, s in variants]
    else:
        variants = [
            ("sm90", 8, 128, 0, "bf16", 2, 2),
            ("sm90", 1, 256, 1, "fp16", 1, 0),
            ("sm90", 3, 96, 2, "fp32", 0, 0),
            ("sm100", 8, 128, 0, "bf16", 2, 1),
            ("sm90", 3, 96, 0, "bf16", 3, 3),
            ("sm80", 3, 96, 0, "bf16", 2, 2),
            ("sm80", 1, 128, 2, "fp32", 0, 0),
            ("gfx942", 8, 128, 0, "bf16", 2, 2),
            ("gfx942", 3, 96, 1, "fp16", 1, 1),
            ("sm90", 8, 128, 0, "bf16", 2, 2, "i64", True, False),
            ("sm90", 8, 128, 0, "bf16", 2, 2, "i64", False, True),
            ("sm90", 8, 128, 0, "bf16", 2, 2, "i64", False, False, False),
            ("sm90", 3, 96, 0, "bf16", 2, 2, "i64", False, False, False, True),
            # H=8, D=96: large writes take the row plan (768 = 512 + 256) over the per-head one (64 + 32)
            ("sm90", 8, 96, 0, "bf16", 2, 2, "i64", False, False, False, True),
            ("sm90", 8, 96, 0, "bf16", 2, 2, "i64", False, False, False, False),
            ("sm90", 1, 512, 0, "bf16", 2, 2, "i64", False, False, False, False, True, 64),  # the MLA pool's plan
            # a sliding-window layer's write through the full-to-SWA mapping: plain and verify write
            ("sm90", 8, 64, 0, "bf16", 2, 2, "i64", False, False, False, False, False, None, True),
            ("sm90", 8, 64, 0, "bf16", 2, 2, "i32", True, False, False, False, False, None, True),
            ("gfx942", 8, 64, 0, "bf16", 2, 2, "i64", False, False, False, False, False, None, True),
            # The fnuz formats (out kinds 5 and 6): MI300-class GPUs, and NVIDIA ones, which encode
            # them with integer operations
            ("gfx942", 8, 128, 5, "bf16", 2, 2),
            ("gfx942", 3, 96, 6, "fp16", 1, 1),
            ("gfx942", 1, 512, 5, "bf16", 2, 2, "i64", False, False, False, False, True, 64),
            ("sm90", 8, 128, 5, "bf16", 2, 2),
            ("sm90", 3, 96, 6, "bf16", 3, 3),
        ]
    for v in variants:
        print(json.dumps(compile_variant(*v)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
