"""The write kernel's plans and launcher.

Plans: the plan a write takes (tiles, flat, joined and chunk plans; every layout the plan sweep can
force) against the reference, the direct launch's view of the kernel's signature, the warmup, and
the write kernel compiled for real GPU targets (NVIDIA sm_80/90/100, AMD gfx942) on a machine
without one, with the Hopper build keeping the instructions its speed depends on.

Launcher: the writer's direct launch and its fallback, the frames from a public call to the launch,
and the environment switches (``KernelOptions``). After a kind of call's first launch through
Triton's JIT, a ``KVWriter`` launches the compiled kernel directly. If that direct launch fails (a
Triton whose compiled-kernel launcher takes its arguments differently), that writer, and only that
one, goes back to the JIT launch for good, logs one warning, and the write still happens. On the CPU
there is no compiled kernel, so the JIT launch is wrapped (``kvassert.StandInJit``): it runs the
real (interpreted) kernel and hands back a stand-in for the compiled kernel that checks a direct
launch's positional arguments against the variant and launches the real kernel with them, or raises
as a mismatched launcher would. The row copy's and the state commit's launches go through the same
stand-in.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import logging
import re
import sys
import tokenize
from pathlib import Path

import pytest
import torch

import kvpool
from kvassert import (
    DEVICE,
    INPUT_DTYPES,
    StandInJit,
    assert_same_arguments,
    assert_same_bytes,
    bits,
    both_paths,
    compiled_variants,
    cross_compile,
    cuda_pool,
    cuda_values,
    geometry_of,
    gpu,
    id_of,
    needs_interpreter,
    poison_,
    poisoned_caches,
    scale_of,
    slots_for,
    spread_rows,
)
from kvpool import MambaCacheParams, MambaPool, MambaStateShape, MHATokenToKVPool, reference_set_kv_buffer
from kvpool.config import KernelOptions
from kvpool.kernels import copy_rows, copy_rows_kernel, state_commit, state_commit_kernel, store_kv, store_kv_kernel
from kvpool.kernels.copy_rows import RowTable
from kvpool.kernels.store_kv import KVWriter, storage_view
from kvpool.kernels.store_kv_checks import FUNCTION_NAMES, Geometry, write_key
from kvpool.kernels.store_kv_plan import CHUNK, JOINED, PER_HEAD, ROW, ROW_JOINED, LaunchPlan, plan_write
from kvpool.kernels.tuning import SMALL_TOKENS, WRITE_LARGE_ROW, WRITE_SMALL, WRITE_SMALL_JOINED, Tile

BIG = SMALL_TOKENS + 1  # a write of the large-token band


# --- plans against the reference ------------------------------------------------------------------


def _layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values as ``x`` [T, H, D] in another memory layout."""
    t, h, d = x.shape
    if layout == "qkv_slice":  # heads contiguous within a row, rows further apart
        wide = torch.zeros(t, 2 * h + 1, d, dtype=x.dtype, device=x.device)
        wide[:, h : 2 * h] = x
        return wide[:, h : 2 * h]
    if layout == "head_dim_strided":  # [T, D, H] transposed: heads not contiguous
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    return x


# Tiles far smaller than a row force several head blocks per tensor and partial token blocks, so
# every mask in the kernel is exercised.
@pytest.mark.parametrize("elems", [16, 64, 256, 4096])
@pytest.mark.parametrize("h,d,hv,dv", [(3, 96, 3, 96), (4, 16, 2, 40), (1, 8, 1, 8)])
def test_tile_shapes(elems, h, d, hv, dv):
    t, slots = 13, 40
    tile = Tile(elems=elems, num_warps=4)
    plan = plan_write(h, d, hv, dv, t, tile=tile)
    assert plan.block_t >= 1 and plan.k_blocks * plan.block_h * (plan.block_d + plan.block_d2) >= h * d
    k, v = spread_rows(t, h, d, torch.float16, 9), spread_rows(t, hv, dv, torch.float16, 10)
    (kf, vf), (kr, vr) = both_paths(
        k, v, slots_for(t, slots, torch.int32, 11), 0.7, 1.9, slots, torch.float8_e4m3fn, tile=tile
    )
    assert_same_bytes(kf, kr, "k_cache")
    assert_same_bytes(vf, vr, "v_cache")


def test_flat_plans_only_where_the_per_head_plan_pads():
    assert not plan_write(8, 128, 8, 128, BIG, row=True).row_view and not plan_write(1, 256, 1, 256, BIG, row=True).row_view
    # A head_dim that pads badly is cut into two power-of-two pieces: no flat plan needed.
    for d, pieces in [(96, (64, 32)), (80, (64, 16)), (72, (64, 8)), (120, (128, 0))]:
        plan = plan_write(1, d, 1, d, BIG)
        assert (plan.block_d, plan.block_d2) == pieces and not plan_write(1, d, 1, d, BIG, row=True).row_view, (d, plan)
    # Heads that pad badly (3 of 4 head slots) take a flat plan: the whole row in one program.
    assert plan_write(3, 96, 3, 96, BIG).lane_use == 0.75
    flat = plan_write(3, 96, 3, 96, BIG, row=True)
    assert (flat.heads, flat.head_dim, flat.block_h, flat.block_d, flat.block_d2) == (1, 288, 1, 256, 32)
    assert flat.lane_use == 1.0 and flat.grid_y == 2 and flat.block_t == 4  # large tile: 2048 // 288 -> 4 rows
    assert plan_write(3, 96, 3, 96, 1, row=True).block_t == 2  # small writes: the small tile
    six = plan_write(6, 64, 6, 64, BIG, row=True)
    assert (six.block_d, six.block_d2, six.k_blocks) == (256, 128, 1)  # 384 = 256 + 128
    # A row longer than the tile is cut into several blocks of at most the tile's elements.
    small = WRITE_SMALL
    for h, d in [(12, 128), (9, 128), (20, 64)]:
        long = plan_write(h, d, h, d, 1, row=True)
        assert long.block_d2 == 0 and long.block_d <= small.elems and long.lane_use >= 0.9, (h, d, long)
        assert long.k_blocks > 1


def test_large_writes_of_several_heads_cut_in_two_pieces_take_a_row_plan():
    """H=8, D=96: the per-head plan cuts every head's 96 elements into 64 + 32. A large write that
    may view its rows as one run takes the row plan over WRITE_LARGE_ROW instead (768 = 512 + 256,
    four rows a program); small writes, calls that may not, and one-head rows keep their plans, and
    so do the other model geometries. A write of such a plan matches the reference."""
    per_head = plan_write(8, 96, 8, 96, BIG)
    assert (per_head.block_d, per_head.block_d2, per_head.row_view, per_head.lane_use) == (64, 32, False, 1.0)
    row = plan_write(8, 96, 8, 96, BIG, row=True)
    assert row == plan_write(8, 96, 8, 96, BIG, row=True, tile=WRITE_LARGE_ROW, layout=ROW)
    assert (row.heads, row.head_dim, row.block_d, row.block_d2, row.block_t, row.num_warps) == (1, 768, 512, 256, 4, 4)
    assert plan_write(8, 96, 8, 96, SMALL_TOKENS, row=True) == plan_write(8, 96, 8, 96, 1) == plan_write(8, 96, 8, 96, 1, row=True)
    assert not plan_write(8, 96, 8, 96, SMALL_TOKENS, row=True).row_view
    assert plan_write(1, 96, 1, 96, BIG, row=True) == plan_write(1, 96, 1, 96, BIG)  # one head: the per-head plan
    # The other geometries of the plan sweep take the plans they took before.
    assert plan_write(8, 128, 8, 128, BIG, row=True) == plan_write(8, 128, 8, 128, BIG)
    assert plan_write(1, 128, 1, 128, BIG, row=True).block_t == 16 and plan_write(1, 256, 1, 256, BIG, row=True).block_t == 8
    odd = plan_write(3, 96, 3, 96, BIG, row=True)
    assert (odd.head_dim, odd.block_d, odd.block_d2, odd.block_t) == (288, 256, 32, 4)  # the lane-use rule, large tile
    mla = plan_write(1, 512, 1, 64, BIG, row=True, joined=True)
    assert mla.joined and not mla.row_view and mla.block_t == 4
    # A small geometry of the same kind, through the writer's policy: 48 = 32 + 16 per row.
    h, d = 2, 24
    small = plan_write(h, d, h, d, BIG, row=True)
    assert small.row_view and (small.block_d, small.block_d2) == (32, 16) and not plan_write(h, d, h, d, BIG).row_view
    t, slots = BIG, BIG + 40
    k, v = spread_rows(t, h, d, torch.bfloat16, 44), spread_rows(t, h, d, torch.bfloat16, 45)
    kf, vf = poisoned_caches(slots, h, d, h, d, torch.float8_e4m3fn)
    writer = KVWriter(geometry_of(kf, vf), kf.stride(), vf.stride(), slots, "always")
    assert writer.plan(k.stride(), v.stride(), (2, 2), False, t) == small
    (kf, vf), (kr, vr) = both_paths(k, v, slots_for(t, slots, torch.int64, 46), torch.tensor([0.3], device=DEVICE), 2.5,
                                     slots, torch.float8_e4m3fn)  # fmt: skip
    assert_same_bytes(kf, kr, "k_cache")
    assert_same_bytes(vf, vr, "v_cache")


def test_writes_pick_the_tile_by_size_and_both_tiles_match_reference():
    """Writes of at most SMALL_TOKENS tokens take the small tile, larger ones the large tile (both
    per-head and flat plans); a write just past the boundary matches the reference."""
    h, d = 3, 8  # rows of 24: the flat plan applies (3 of 4 head slots would be used)
    kf, vf = poisoned_caches(4, h, d, h, d, torch.float8_e4m3fn)
    writer = KVWriter(geometry_of(kf, vf), kf.stride(), vf.stride(), 4, "always")
    st = (h * d, d, 1)
    for kinds, flat in (((2, 2), True), ((3, 3), False)):  # tensor scales: flat; per-head scales: per-head
        small = writer.plan(st, st, kinds, False, SMALL_TOKENS)
        large = writer.plan(st, st, kinds, False, SMALL_TOKENS + 1)
        assert small == plan_write(h, d, h, d, 1, row=flat, tile=WRITE_SMALL) and small.row_view == flat
        assert large == plan_write(h, d, h, d, BIG, row=flat) and large.row_view == flat
        assert small.num_warps == WRITE_SMALL.num_warps and large.block_t != small.block_t
    t, slots = SMALL_TOKENS + 1, 2 * SMALL_TOKENS + 8
    k, v = spread_rows(t, h, d, torch.bfloat16, 41), spread_rows(t, h, d, torch.bfloat16, 42)
    (kf, vf), (kr, vr) = both_paths(k, v, slots_for(t, slots, torch.int64, 43), 0.3, torch.tensor([2.5], device=DEVICE),
                                     slots, torch.float8_e4m3fn)  # fmt: skip
    assert_same_bytes(kf, kr, "k_cache")
    assert_same_bytes(vf, vr, "v_cache")


@pytest.mark.parametrize("chunk", [8, 16, 32])
@pytest.mark.parametrize("h,d,hv,dv,mla", [(3, 96, 3, 96, False), (2, 64, 2, 64, False), (1, 64, 1, 32, True)])
def test_chunk_plans_match_reference(h, d, hv, dv, mla, chunk):
    """Rows viewed as runs of ``chunk`` elements (a candidate of the plan sweep, bench_write.py
    --sections plans): same bytes as the reference, on caches that are views of one row (MLA's
    latent and rotary parts) too."""
    t, slots = 9, 23
    tile = Tile(elems=64, num_warps=1)
    plan = plan_write(h, d, hv, dv, t, row=True, tile=tile, layout=CHUNK, chunk=chunk)
    assert plan.row_view and plan.head_dim == chunk and plan.lane_use == 1.0
    k, v = spread_rows(t, h, d, torch.bfloat16, 51), spread_rows(t, hv, dv, torch.bfloat16, 52)
    loc = slots_for(t, slots, torch.int64, 53)
    out = []
    for _ in range(2):
        if mla:
            row = poison_(torch.empty(slots, 1, d + dv, dtype=torch.float8_e4m3fn, device=DEVICE))
            out.append((row, row[:, :, :d], row[:, :, d:]))
        else:
            kc, vc = poisoned_caches(slots, h, d, hv, dv, torch.float8_e4m3fn)
            out.append((None, kc, vc))
    (_, kf, vf), (_, kr, vr) = out
    writer = KVWriter(geometry_of(kf, vf), kf.stride(), vf.stride(), slots, "always", tile=tile, layout=CHUNK, chunk=chunk)
    scale = torch.tensor([0.37], device=DEVICE)
    assert writer.plan(k.stride(), v.stride(), (2, 2), False, t) == plan  # the chunk plan runs
    writer.write(storage_view(kf), storage_view(vf), loc, k, v, scale, scale, FUNCTION_NAMES)
    reference_set_kv_buffer(k, v, kr, vr, loc, scale, scale)
    assert_same_bytes(kf, kr, "k_cache")
    assert_same_bytes(vf, vr, "v_cache")
    # 288 is not a multiple of 64: no chunk plan, the policy's plan instead
    assert plan_write(3, 96, 3, 96, t, row=True, tile=tile, layout=CHUNK, chunk=64) == plan_write(3, 96, 3, 96, t, row=True, tile=tile)


def test_joined_plans_only_where_each_row_is_one_block():
    mla = plan_write(1, 512, 1, 64, BIG, joined=True)
    assert mla.joined and mla.grid_y == 1 and (mla.block_t, mla.block_d, mla.block_dv) == (4, 512, 64)
    eight = plan_write(8, 128, 8, 128, BIG, joined=True)
    assert eight.joined and eight.grid_y == 1  # 8 x 128 fits the 2048-element tile
    assert not plan_write(8, 128, 8, 128, BIG, joined=True, tile=Tile(elems=512, num_warps=4)).joined  # 2 head blocks each
    assert plan_write(1, 512, 1, 64, BIG, joined=True, tile=Tile(elems=256, num_warps=4)).block_t == 1  # a row is one block
    # A joined writer takes the small_joined tile for small writes (one MLA row per program).
    row = (576, 576, 1)
    writer = KVWriter(Geometry(torch.float8_e4m3fn, 1, 512, 1, 64, torch.device(DEVICE)), row, row, 8, "always", joined=True)
    inputs = ((512, 512, 1), (64, 64, 1))
    small, large = (writer.plan(*inputs, (2, 2), False, t) for t in (1, BIG))
    assert small == plan_write(1, 512, 1, 64, 1, joined=True, tile=WRITE_SMALL_JOINED) and small.joined
    assert (small.block_t, large.block_t) == (1, 4)
    with pytest.raises(ValueError, match="one block per tensor"):
        LaunchPlan(8, 128, 8, 128, block_t=1, block_h=4, block_d=128, block_hv=4, block_dv=128, num_warps=4, joined=True)


# One program writes both tensors: different head counts, dims and second pieces (96 = 64 + 32),
# every scale kind (K and V each their own), partial token blocks, padding and out-of-range slots.
@pytest.mark.parametrize("scale_kind", ["none", "float", "tensor", "per_head"])
@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64], ids=id_of)
@pytest.mark.parametrize("h,d,hv,dv", [(1, 64, 1, 16), (3, 96, 3, 96), (2, 32, 1, 40)])
def test_joined_plans_match_reference(h, d, hv, dv, loc_dtype, scale_kind):
    t, slots = 11, 29
    tile = Tile(elems=512, num_warps=2)
    plan = plan_write(h, d, hv, dv, t, joined=True, tile=tile)
    assert plan.joined and plan.block_t < t
    k, v = spread_rows(t, h, d, torch.bfloat16, 61), spread_rows(t, hv, dv, torch.float32, 62)
    ks, vs = scale_of(scale_kind, h, 63), scale_of(scale_kind, hv, 64)
    if scale_kind in ("float", "tensor"):  # K and V scales differ, so a mix-up shows
        vs = 1.9 if scale_kind == "float" else torch.tensor([0.21], device=DEVICE)
    loc = slots_for(t, slots, loc_dtype, 65)
    key = write_key(k, v, loc, ks, vs)
    kc, vc = poisoned_caches(slots, h, d, hv, dv, torch.float8_e4m3fn)
    writer = KVWriter(geometry_of(kc, vc), kc.stride(), vc.stride(), slots, "always", tile=tile, row_plans=False, joined=True)
    assert writer.plan(k.stride(), v.stride(), (key[3], key[4]), False, t) == plan  # the joined plan runs
    for cache_dtype in (torch.float8_e4m3fn, torch.bfloat16):
        (kf, vf), (kr, vr) = both_paths(
            k, v, loc, ks, vs, slots, cache_dtype, tile=tile, joined=True, flat=False
        )  # fmt: skip
        assert_same_bytes(kf, kr, "k_cache")
        assert_same_bytes(vf, vr, "v_cache")


# Every layout plan_write can be asked for (what the plan sweep times), on geometries where each
# applies and where it must fall back: the bytes are the reference's, and a forced layout the call
# cannot take gives the policy's plan.
@pytest.mark.parametrize("layout", [PER_HEAD, JOINED, ROW, ROW_JOINED, CHUNK])
@pytest.mark.parametrize("h,d,hv,dv,tile", [(3, 96, 3, 96, 512), (2, 40, 1, 24, 64), (1, 64, 1, 32, 128)])
def test_every_plan_layout_matches_reference(h, d, hv, dv, tile, layout):
    t, slots = 7, 19
    k, v = spread_rows(t, h, d, torch.bfloat16, 71), spread_rows(t, hv, dv, torch.float16, 72)
    loc = slots_for(t, slots, torch.int64, 73)
    tiles = Tile(elems=tile, num_warps=2)
    plan = plan_write(h, d, hv, dv, t, row=True, tile=tiles, layout=layout, chunk=8)
    policy = plan_write(h, d, hv, dv, t, row=True, tile=tiles)
    if layout == ROW_JOINED:
        assert plan.joined and plan.row_view and plan.grid_y == 1
    elif layout == CHUNK:
        assert plan.row_view and plan.head_dim == 8
    elif layout == JOINED and not plan.joined:
        assert plan == policy  # a row takes more than one block: the join does not apply
    scale = torch.tensor([0.37], device=DEVICE)
    (kf, vf), (kr, vr) = both_paths(k, v, loc, scale, 1.9, slots, torch.float8_e4m3fn, tile=tiles, layout=layout)
    assert_same_bytes(kf, kr, "k_cache")
    assert_same_bytes(vf, vr, "v_cache")


def test_flat_plan_with_rows_longer_than_the_tile():
    t, slots, h, d = 5, 11, 3, 16  # 48-element rows, 32-element tile: three blocks of 16 per row
    tile = Tile(elems=32, num_warps=1)
    plan = plan_write(h, d, h, d, t, row=True, tile=tile)
    assert plan.block_d == 16 and plan.block_d2 == 0 and plan.k_blocks == 3
    k, v = spread_rows(t, h, d, torch.bfloat16, 31), spread_rows(t, h, d, torch.bfloat16, 32)
    (kf, vf), (kr, vr) = both_paths(
        k, v, slots_for(t, slots, torch.int64, 33), torch.tensor([0.3], device=DEVICE), 2.5, slots,
        torch.float8_e4m3fn, tile=tile,
    )  # fmt: skip
    assert_same_bytes(kf, kr, "k_cache")
    assert_same_bytes(vf, vr, "v_cache")


# Geometries with a flat plan: K and V rows of equal and of different lengths, one head, and rows
# that split into whole blocks. Calls whose inputs or scales rule the flat plan out take the
# per-head plan; both must match the reference.
@pytest.mark.parametrize("layout", ["contiguous", "qkv_slice", "head_dim_strided"])
@pytest.mark.parametrize("h,d,hv,dv", [(3, 96, 3, 96), (3, 40, 5, 24), (1, 80, 1, 80), (6, 64, 6, 64)])
@pytest.mark.parametrize("scale_kind", ["tensor", "per_head"])
def test_flat_and_per_head_plans_match_reference(h, d, hv, dv, layout, scale_kind):
    t, slots = 9, 23
    k = _layout(spread_rows(t, h, d, torch.bfloat16, 21), layout)
    v = _layout(spread_rows(t, hv, dv, torch.bfloat16, 22), layout)
    ks, vs = scale_of(scale_kind, h, 23), scale_of(scale_kind, hv, 24)
    cache_dtype = torch.float8_e4m3fn
    kf, vf = poisoned_caches(slots, h, d, hv, dv, cache_dtype)
    writer = KVWriter(geometry_of(kf, vf), kf.stride(), vf.stride(), slots, "always")
    kinds = (2 if scale_kind == "tensor" else 3,) * 2
    # one head per row is contiguous in any layout; a geometry whose per-head plan fills its lanes
    # (one head of 80 = 64 + 16) has no flat plan
    has_flat = plan_write(h, d, hv, dv, BIG, row=True).row_view
    expect_flat = has_flat and scale_kind == "tensor" and (layout != "head_dim_strided" or h == hv == 1)
    assert (not has_flat) == ((h, d, hv, dv) == (1, 80, 1, 80))
    assert writer.plan(k.stride(), v.stride(), kinds, False, BIG).row_view == expect_flat
    (kf, vf), (kr, vr) = both_paths(k, v, slots_for(t, slots, torch.int64, 25), ks, vs, slots, cache_dtype)
    assert_same_bytes(kf, kr, "k_cache")
    assert_same_bytes(vf, vr, "v_cache")


def test_direct_launch_knows_the_kernel_signature():
    """Direct launches pass every argument positionally: the per-call ones, the fixed ones, then the
    compile-time constants, in the kernel's signature order."""
    names = list(store_kv_kernel._store_kv_kernel.arg_names)
    assert tuple(names[-len(store_kv.CONSTEXPRS) :]) == store_kv.CONSTEXPRS
    assert tuple(names) == store_kv.PARAMS


# --- the warmup -----------------------------------------------------------------------------------


@gpu
def test_warmup_compiles_what_the_first_calls_need():
    pool = cuda_pool(torch.float8_e5m2, fused="auto")  # a geometry/format no other test has compiled
    assert pool.warmup_seconds is not None
    compiled = compiled_variants()
    qkv = cuda_values((SMALL_TOKENS + 1, 48, 128), torch.bfloat16, 8)  # large writes take another tile
    for in_dtype, loc_dtype, scale in itertools.product(
        INPUT_DTYPES, (torch.int32, torch.int64), (None, 0.25, torch.tensor([0.5], device="cuda"))
    ):
        x = qkv.to(in_dtype)
        loc = torch.arange(1, SMALL_TOKENS + 2, device="cuda", dtype=loc_dtype)
        pool.set_kv_buffer(None, loc[:7], x[:7, 32:40], x[:7, 40:48], scale, scale, layer_id_override=1)
        pool.set_kv_buffer(None, loc[:1], x[:1, 32:40], x[:1, 40:48], scale, scale, layer_id_override=0)
        pool.set_kv_buffer(None, loc, x[:, 32:40], x[:, 40:48], scale, scale, layer_id_override=0)
    assert compiled_variants() == compiled, "a first call compiled a variant the warmup missed"


# --- the write kernel compiled for real GPU targets -----------------------------------------------


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    return cross_compile()


def test_the_write_kernel_compiles_for_every_target(compiled):
    assert {v["target"] for v in compiled} == {"sm90", "sm100", "sm80", "gfx942"}
    assert len(compiled) == 16


def test_hopper_build_uses_wide_accesses_and_hardware_fp8(compiled):
    [fp8] = [
        v for v in compiled
        if v["target"] == "sm90" and v["D"] == 128 and v["out_kind"] == 0
        and not (v["prefix"] or v["observe"]) and v["i64"]
    ]  # fmt: skip
    # 16-byte loads of bf16 rows and 16-byte stores of FP8 rows; cvt.rn.satfinite for the cast;
    # the reciprocal-and-FMA division per element, with div.rn left for the reciprocal itself and
    # for scales outside the range where the FMA correction is exact.
    assert fp8["ld_v4"] > 0 and fp8["st_v4"] > 0
    assert fp8["cvt_satfinite"] > 0 and fp8["fma_rn"] > fp8["div_rn"] > 0
    # The cast saturates by itself (no clamp); the division clamps its input with NaN-keeping min/max.
    assert fp8["max_nan"] > 0
    [e5m2] = [v for v in compiled if v["target"] == "sm90" and v["out_kind"] == 1]
    assert e5m2["cvt_satfinite"] > 0
    [soft] = [v for v in compiled if v["target"] == "sm80" and v["out_kind"] == 0]
    assert soft["soft"] and soft["cvt_satfinite"] == 0, "no FP8 conversion instruction before sm_89"


def test_prefix_and_observe_variants_keep_the_fast_write(compiled):
    """The verify write (PREFIX) and the calibrating write (OBSERVE) are the same vectorised write;
    only the observing one carries an atomic max, and the plain one has none."""
    by = {
        (v["prefix"], v["observe"]): v
        for v in compiled if v["target"] == "sm90" and v["H"] == 8 and v["out_kind"] == 0 and v["i64"]
    }  # fmt: skip
    for v in by.values():
        assert v["ld_v4"] > 0 and v["st_v4"] > 0 and v["cvt_satfinite"] > 0
    assert by[(False, True)]["atom_max"] > 0
    assert by[(False, False)]["atom_max"] == 0 and by[(True, False)]["atom_max"] == 0


def test_32_bit_offsets_and_two_piece_rows_compile_to_the_fast_write(compiled):
    """The 32-bit-offset variant does less 64-bit address arithmetic than the 64-bit one; the odd
    shape's flat plan (288 = 256 + 32 per row, 32-bit offsets) keeps 16-byte loads and the
    hardware cast."""
    [wide] = [v for v in compiled if v["target"] == "sm90" and v["H"] == 8 and v["i64"] and not (v["prefix"] or v["observe"]) and v["out_kind"] == 0]
    [narrow] = [v for v in compiled if v["target"] == "sm90" and (v["H"], v["D"]) == (8, 128) and not v["i64"]]
    assert narrow["mul_wide"] < wide["mul_wide"], (narrow, wide)
    assert narrow["ld_v4"] > 0 and narrow["st_v4"] > 0 and narrow["cvt_satfinite"] > 0
    [odd] = [v for v in compiled if v["target"] == "sm90" and v["flat"] and v["H"] == 3]
    assert odd["ld_v4"] > 0 and odd["cvt_satfinite"] > 0


def test_the_row_plan_of_heads_cut_in_two_pieces_compiles_to_wider_accesses(compiled):
    """H=8, D=96: a large write's row plan (each row one run, 512 + 256) issues 16-byte stores and
    more 16-byte loads than the per-head plan (every head 64 + 32), which has no 16-byte store."""
    by = {v["flat"]: v for v in compiled if v["target"] == "sm90" and (v["H"], v["D"]) == (8, 96)}
    assert by[True]["st_v4"] > by[False]["st_v4"] and by[True]["ld_v4"] > by[False]["ld_v4"], by
    assert by[True]["cvt_satfinite"] > 0 and not by[True]["i64"]


def test_joined_plan_compiles_to_the_fast_write(compiled):
    """The MLA pool's joined plan (one program writes the 512 latent and 64 rotary values of its
    tokens) keeps 16-byte loads and stores, the hardware cast and the FMA division for both parts."""
    [mla] = [v for v in compiled if v["joined"]]
    assert (mla["H"], mla["D"], mla["DV"]) == (1, 512, 64)
    assert mla["ld_v4"] > 0 and mla["st_v4"] > 0 and mla["cvt_satfinite"] > 0 and mla["fma_rn"] > mla["div_rn"] > 0


@gpu
def test_a_writer_on_a_bare_cuda_device_takes_the_current_device_tensors():
    """``KVWriter`` given ``torch.device("cuda")`` takes it as the current device: it writes K and V
    of tensors on ``cuda:<current>`` exactly as the reference does."""
    kc = poison_(torch.empty(8, 2, 16, dtype=torch.float8_e4m3fn, device="cuda"))
    vc = poison_(torch.empty(8, 2, 16, dtype=torch.float8_e4m3fn, device="cuda"))
    writer = KVWriter(Geometry(kc.dtype, 2, 16, 2, 16, torch.device("cuda")), kc.stride(), vc.stride(), 8, "always")
    assert writer.geometry.device == kc.device
    k, v = cuda_values((3, 2, 16), torch.bfloat16, seed=5), cuda_values((3, 2, 16), torch.bfloat16, seed=6)
    loc = torch.tensor([1, 4, 6], device="cuda")
    writer.write(storage_view(kc), storage_view(vc), loc, k, v, None, None, FUNCTION_NAMES)
    k_ref, v_ref = poison_(torch.empty_like(kc)), poison_(torch.empty_like(vc))
    reference_set_kv_buffer(k, v, k_ref, v_ref, loc)
    assert_same_bytes(kc.view(torch.uint8), k_ref.view(torch.uint8), "K written through a bare-cuda writer")
    assert_same_bytes(vc.view(torch.uint8), v_ref.view(torch.uint8), "V written through a bare-cuda writer")


# --- the launcher --------------------------------------------------------------------------------

#: The direct-launch tests stand in for the compiled kernel around the interpreter, on CPU tensors.
CPU = "cpu"


@pytest.fixture
def jit(monkeypatch):
    """The write kernel behind a JIT stand-in whose compiled stand-ins check every direct launch."""
    if not store_kv.INTERPRETER:
        pytest.skip("fakes the compiled kernel around Triton's interpreter")
    jit = StandInJit(store_kv_kernel._store_kv_kernel)
    monkeypatch.setattr(store_kv_kernel, "_store_kv_kernel", jit)
    return jit


def _launcher(h=2, d=16, slots=12) -> tuple[KVWriter, torch.Tensor, torch.Tensor]:
    kc = poison_(torch.empty(slots, h, d, dtype=torch.float8_e4m3fn))
    vc = poison_(torch.empty(slots, h, d, dtype=torch.float8_e4m3fn))
    geometry = Geometry(kc.dtype, h, d, h, d, torch.device(CPU))
    launch = KVWriter(geometry, kc.stride(), vc.stride(), slots, "always")
    launch.launches.enabled = True  # as on a GPU; the interpreter turns it off
    return launch, kc, vc


def _write(launch, kc, vc, seed, scale=0.5):
    """One write through ``launch``, and the same write on fresh caches by the reference path."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(5, kc.shape[1], kc.shape[2], generator=g) * 100
    loc = torch.randperm(kc.shape[0], generator=g)[:5]
    loc[2] = -1
    launch.write(storage_view(kc), storage_view(vc), loc, k, k, scale, scale, FUNCTION_NAMES)
    ek, ev = poison_(torch.empty_like(kc)), poison_(torch.empty_like(vc))
    reference_set_kv_buffer(k, k, ek, ev, loc, scale, scale)
    return loc, ek, ev


def _assert_rows(kc, expected, loc, what):
    rows = [int(s) for s in loc if s >= 0]
    assert_same_bytes(kc[rows], expected[rows], what)


def test_failed_direct_launch_falls_back_for_that_launcher_only(jit, caplog):
    a, ka, va = _launcher()
    b, kb, vb = _launcher(h=1, d=32)
    jit.fail_next = True
    loc, ek, _ = _write(a, ka, va, seed=1)  # JIT launch; A keeps a compiled kernel that will fail
    _assert_rows(ka, ek, loc, "A, first write")
    jit.fail_next = False
    loc, ek, _ = _write(b, kb, vb, seed=2)  # JIT launch; B keeps a working one
    _assert_rows(kb, ek, loc, "B, first write")
    assert jit.launches == 2 and len(a.launches.entries) == len(b.launches.entries) == 1
    failing, working = jit.handed

    with caplog.at_level(logging.WARNING, logger="kvpool"):
        loc, ek, ev = _write(a, ka, va, seed=3, scale=2.0)  # direct launch fails -> JIT launch
    assert failing.calls == 1 and jit.launches == 3
    _assert_rows(ka, ek, loc, "A, the write whose direct launch failed")
    _assert_rows(va, ev, loc, "A (V), the write whose direct launch failed")
    warnings = [r for r in caplog.records if r.name == "kvpool" and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "direct launch of the compiled kernel failed" in warnings[0].getMessage()
    assert "takes its arguments differently" in warnings[0].getMessage()
    assert a.launches.enabled is False and not a.launches.entries

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvpool"):
        loc, ek, _ = _write(a, ka, va, seed=4)  # A no longer tries the direct launch
        loc_b, ek_b, _ = _write(b, kb, vb, seed=5)  # B still launches directly
    assert failing.calls == 1 and jit.launches == 4
    _assert_rows(ka, ek, loc, "A after the fallback")
    assert b.launches.enabled is True and working.calls == 1, "the other launcher must keep launching directly"
    _assert_rows(kb, ek_b, loc_b, "B, direct launch")
    assert not caplog.records, "one warning per launcher, not one per call"


def test_direct_launch_writes_what_the_jit_launch_writes(jit):
    """The direct launch's positional arguments (runtime ones, then the constexprs) reach the kernel
    in signature order: a write through the compiled stand-in equals the reference, for several
    scale kinds (each its own compiled variant)."""
    launch, kc, vc = _launcher(h=3, d=24)
    for scale in (None, 0.37, torch.tensor([1.5]), torch.tensor([0.2, 3.0, 9.0])):
        _write(launch, kc, vc, seed=6, scale=scale)  # JIT launch, keeps the compiled stand-in
        launches = jit.launches
        loc, ek, ev = _write(launch, kc, vc, seed=7, scale=scale)  # direct launch
        assert jit.launches == launches, f"scale {scale}: the second call did not launch directly"
        _assert_rows(kc, ek, loc, f"direct launch, scale {scale}")
        _assert_rows(vc, ev, loc, f"direct launch (V), scale {scale}")
    assert sum(c.calls for c in jit.handed) == 4


def test_pool_write_still_happens_when_its_direct_launch_fails(jit, caplog):
    pool = MHATokenToKVPool(16, 1, torch.float8_e4m3fn, 2, 8, 1, CPU, fused="always", warmup=False)
    other = MHATokenToKVPool(16, 1, torch.float8_e4m3fn, 2, 8, 1, CPU, fused="always", warmup=False)
    pool._writer.launches.enabled = other._writer.launches.enabled = True
    x = torch.randn(3, 2, 8) * 10
    loc = torch.tensor([1, 2, 3])
    jit.fail_next = True
    pool.set_kv_buffer(None, loc, x, x, layer_id_override=0)
    jit.fail_next = False
    other.set_kv_buffer(None, loc, x, x, layer_id_override=0)
    with caplog.at_level(logging.WARNING, logger="kvpool"):
        pool.set_kv_buffer(None, loc, x * 3, x * 3, layer_id_override=0)
        other.set_kv_buffer(None, loc, x * 3, x * 3, layer_id_override=0)
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    expected = MHATokenToKVPool(16, 1, torch.float8_e4m3fn, 2, 8, 1, CPU, fused="never")
    expected.set_kv_buffer(None, loc, x * 3, x * 3, layer_id_override=0)
    for p in (pool, other):
        for a, b in zip(p.get_kv_buffer(0), expected.get_kv_buffer(0)):
            assert_same_bytes(a, b, "after the failed direct launch")
        assert p.stats.fused_calls == 2
    assert pool._writer.launches.enabled is False and other._writer.launches.enabled is True


def test_a_repeated_write_launches_directly_what_its_jit_launch_bound(jit):
    """The same call twice: the direct launch passes, parameter by parameter in signature order,
    exactly what the JIT launch bound (the same tensors, equal values and constexprs)."""
    launch, kc, vc = _launcher(h=3, d=24)
    g = torch.Generator().manual_seed(8)
    k = torch.randn(4, 3, 24, generator=g)
    loc = torch.tensor([3, -1, 7, 1])
    for scale in (0.37, torch.tensor([1.5]), None):
        for _ in range(2):
            launch.write(storage_view(kc), storage_view(vc), loc, k, k, scale, scale, FUNCTION_NAMES)
        compiled = jit.handed[-1]
        assert compiled.calls == 1, f"scale {scale}: the second call did not launch directly"
        assert_same_arguments(compiled.direct[-1], compiled.bound, jit.params)


# --- the row copy's and the state commit's direct launches -------------------------------------------


@pytest.fixture
def row_jits(monkeypatch):
    """Both row kernels behind JIT stand-ins, on CPU tables, with their launch caches on and empty."""
    if not store_kv.INTERPRETER:
        pytest.skip("fakes the compiled kernels around Triton's interpreter")
    jits = {}
    for module, kernels, name in ((copy_rows, copy_rows_kernel, "_copy_rows_kernel"),
                                  (state_commit, state_commit_kernel, "_commit_rows_kernel")):  # fmt: skip
        jits[module] = StandInJit(getattr(kernels, name))
        monkeypatch.setattr(kernels, name, jits[module])
        monkeypatch.setattr(module, "_kernel_on_cpu", True)
        monkeypatch.setattr(module.LAUNCHES, "enabled", True)
        monkeypatch.setattr(module.LAUNCHES, "entries", {})
    return jits[copy_rows], jits[state_commit]


def _random_bytes(shape, g) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)


def test_row_copies_launch_directly_after_their_first_launch_and_stay_exact(row_jits):
    """Copies of every kind Triton specialises on (index slices 16-byte aligned and not, int32 and
    int64 indices, 1, 16 and 17 pairs, a table moving rows within itself in one pass and through the
    staging buffer): the second round launches the compiled stand-ins only, each launch checked
    against its variant, and every result is the reference's."""
    jit, _ = row_jits
    g = torch.Generator().manual_seed(11)
    rows = 1100
    shapes = [(8, 16), (4, 6)]  # 128-byte rows and 24-byte rows (8-byte aligned)
    cases = [
        (16, 0, torch.int64, False), (16, 1, torch.int64, False), (1, 0, torch.int64, False),
        (17, 2, torch.int32, False), (7, 0, torch.int64, True), (1030, 0, torch.int64, True),
    ]  # fmt: skip
    for round_ in range(2):
        launches = jit.launches
        for n, offset, dtype, same in cases:
            dst = [_random_bytes((rows, *s), g) for s in shapes]
            src = dst if same else [_random_bytes((rows, *s), g) for s in shapes]
            expected = [b.clone() for b in dst]
            di = torch.randperm(rows, generator=g)[: n + offset].to(dtype)[offset:]
            si = torch.randperm(rows, generator=g)[: n + offset].to(dtype)[offset:]
            dt = RowTable.of(dst)
            st = dt if same else RowTable.of(src)
            et = RowTable.of(expected)
            copy_rows.copy_rows_reference(et, di, et if same else RowTable.of([b.clone() for b in src]), si)
            copy_rows.copy_rows(dt, di, st, si)
            for b, (got, want) in enumerate(zip(dst, expected)):
                what = f"round {round_}, {n} pairs at offset {offset}, {dtype}, same={same}: buffer {b}"
                assert_same_bytes(got, want, what)
        if round_ == 1:
            assert jit.launches == launches, f"{jit.launches - launches} launches went through the JIT in the second round"
    assert sum(c.calls for c in jit.handed) >= len(cases)


def test_a_repeated_row_copy_launches_directly_what_its_jit_launch_bound(row_jits):
    jit, _ = row_jits
    g = torch.Generator().manual_seed(12)
    dst, src = RowTable.of([_random_bytes((40, 32), g)]), RowTable.of([_random_bytes((40, 32), g)])
    di, si = torch.tensor([3, 9, -1, 20]), torch.tensor([5, 1, 2, 39])
    for _ in range(2):
        copy_rows.copy_rows(dst, di, src, si)
    compiled = jit.handed[-1]
    assert jit.launches == 1 and compiled.calls == 1
    assert_same_arguments(compiled.direct[-1], compiled.bound, jit.params)


STATE_PARAMS = MambaCacheParams(MambaStateShape(conv=(7, 3), temporal=(2, 3, 5)), (1, 2, 5))


def _state_pool(seed: int) -> MambaPool:
    pool = MambaPool(size=9, spec_state_size=4, cache_params=STATE_PARAMS, device="cpu", speculative_num_draft_tokens=3)
    g = torch.Generator().manual_seed(seed)
    for t in (*pool.conv, pool.temporal, *pool.intermediate_conv_window, pool.intermediate_ssm):
        t.view(torch.uint8).copy_(_random_bytes(t.view(torch.uint8).shape, g))
    pool.alloc_slots(pool.size)  # a commit names slots handed out
    return pool


def test_state_commits_launch_directly_after_their_first_launch_and_stay_exact(row_jits):
    """MambaPool.commit with int64 and int32 indices, one request (a count Triton specialises) and
    track slots: the second round launches the compiled stand-ins only (a launch cache built with
    the wrong arguments fails at its first ``remember``), and the states are the reference's."""
    _, jit = row_jits
    i32, i64 = torch.int32, torch.int64
    cases = [
        ([4, 1, 9], [3, 0, 2], None, None, i64),
        ([2, 7], [1, 3], None, None, i32),
        ([5], [2], None, None, i64),
        ([3, 6], [1, 2], [8, 2], [3, 0], i64),
    ]
    for round_ in range(2):
        launches = jit.launches
        for n, (slots, steps, track, track_steps, dtype) in enumerate(cases):
            pool, twin = _state_pool(n), _state_pool(n)
            args = [None if v is None else torch.tensor(v, dtype=dtype) for v in (slots, steps, track, track_steps)]
            pool.commit(*args)
            state_commit.commit_rows_reference(twin.row_table, twin.spec_row_table, 3, *args)
            for a, b, name in zip((*pool.conv, pool.temporal), (*twin.conv, twin.temporal), ("conv", "ssm")):
                assert_same_bytes(a.view(torch.uint8), b.view(torch.uint8), f"round {round_}, case {n}: {name}")
        if round_ == 1:
            assert jit.launches == launches, f"{jit.launches - launches} commits went through the JIT in the second round"
    assert sum(c.calls for c in jit.handed) == len(cases)


def test_a_repeated_state_commit_launches_directly_what_its_jit_launch_bound(row_jits):
    _, jit = row_jits
    pool = _state_pool(3)
    slots, steps = torch.tensor([4, 1]), torch.tensor([3, 1])
    for _ in range(2):
        pool.commit(slots, steps)
    compiled = jit.handed[-1]
    assert jit.launches == 1 and compiled.calls == 1
    assert_same_arguments(compiled.direct[-1], compiled.bound, jit.params)


def test_recorded_direct_launch_writes_the_same_bytes_again(jit):
    """``writer.launches.recording()`` hands a benchmark the direct launch a write made, and puts
    the compiled kernels back after the block; replaying the record, or launching it through the JIT
    with ``jit_launch_of``, writes the same bytes again."""
    pool = MHATokenToKVPool(16, 1, torch.float8_e4m3fn, 2, 8, 1, CPU, fused="always", warmup=False)
    writer = pool.writer
    writer.launches.enabled = True  # as on a GPU
    x = torch.randn(3, 2, 8) * 10
    loc = torch.tensor([1, 2, 3])
    pool.set_kv_buffer(None, loc, x, x, 0.5, 0.5, layer_id_override=0)  # JIT launch: keeps the compiled stand-in
    with writer.launches.recording() as records:
        pool.set_kv_buffer(None, loc, x, x, 0.5, 0.5, layer_id_override=0)
    assert len(records) == 1 and records[0].compiled is jit.handed[0]
    assert [b.compiled for b in writer.launches.entries.values()] == [jit.handed[0]], "the compiled kernel is back"
    assert [b.run for b in writer.launches.entries.values()] == [jit.handed[0].run], "the recorder is gone"
    expected = [bits(b).clone() for b in pool.get_kv_buffer(0)]
    replays = (("replay", records[0].replay), ("direct replay", records[0].replay_direct))
    for how, launch in (*replays, ("JIT launch", writer.jit_launch_of(records[0]))):
        for b in pool.get_kv_buffer(0):
            poison_(b)
        launch()
        for b, e in zip(pool.get_kv_buffer(0), expected):
            assert_same_bytes(bits(b)[loc], e[loc], f"{how} of the recorded launch")
            others = torch.ones(b.shape[0], dtype=torch.bool)
            others[loc] = False
            assert bool((bits(b)[others] == 0xFF).all()), f"{how}: rows the write does not name stay untouched"
    assert jit.launches == 2 and jit.handed[0].calls == 3, "one direct launch recorded, two replayed"
    assert pool.stats.fused_calls == 2, "replays are not pool writes"


# --- KernelOptions and the environment -----------------------------------------------------------

SWITCHES = {"KVPOOL_DIRECT_LAUNCH": "direct_launch", "KVPOOL_FAST_DIV": "fast_div", "KVPOOL_SOFT_CAST": "soft_cast"}


@pytest.fixture
def clean_env(monkeypatch):
    for name in (*SWITCHES, "KVPOOL_FUSED", "KVPOOL_VALIDATE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_kernel_options_defaults(clean_env):
    assert KernelOptions.from_env() == KernelOptions() == KernelOptions(direct_launch=True, fast_div=True, soft_cast=False)
    for name in SWITCHES:
        clean_env.setenv(name, "")  # empty means unset
    assert KernelOptions.from_env() == KernelOptions()


@pytest.mark.parametrize("value", ["0", "1"])
@pytest.mark.parametrize("name", list(SWITCHES))
def test_kernel_options_read_each_switch(clean_env, name, value):
    clean_env.setenv(name, value)
    options = KernelOptions.from_env()
    field = SWITCHES[name]
    assert getattr(options, field) is (value == "1")
    others = {f: getattr(KernelOptions(), f) for f in SWITCHES.values() if f != field}
    assert {f: getattr(options, f) for f in others} == others


@pytest.mark.parametrize("value", ["yes", "true", "2", " 1", "01", "on"])
@pytest.mark.parametrize("name", list(SWITCHES))
def test_kernel_options_reject_bad_values_naming_the_variable(clean_env, name, value):
    clean_env.setenv(name, value)
    with pytest.raises(ValueError, match=rf"^{name} must be 0 or 1, got {re.escape(repr(value))}$"):
        KernelOptions.from_env()


def test_kernel_options_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        KernelOptions().fast_div = False  # type: ignore[misc]


@needs_interpreter
def test_a_bad_switch_fails_when_a_launcher_is_built(clean_env):
    """The switches are read when a pool's launcher is constructed, not on the hot path."""
    clean_env.setenv("KVPOOL_SOFT_CAST", "maybe")
    with pytest.raises(ValueError, match=r"KVPOOL_SOFT_CAST must be 0 or 1, got 'maybe'"):
        MHATokenToKVPool(8, 1, torch.float8_e4m3fn, 1, 8, 1, CPU, fused="always", warmup=False)
    clean_env.setenv("KVPOOL_SOFT_CAST", "1")
    pool = MHATokenToKVPool(8, 1, torch.float8_e4m3fn, 1, 8, 1, CPU, fused="always", warmup=False)
    assert pool._writer.soft_cast
    clean_env.setenv("KVPOOL_SOFT_CAST", "maybe")  # read once: later writes do not look again
    x = torch.ones(1, 1, 8)
    pool.set_kv_buffer(None, torch.tensor([1]), x, x, layer_id_override=0)
    assert (bits(pool.get_key_buffer(0)[1]) == 0x38).all()  # 1.0 in e4m3fn


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("KVPOOL_FUSED", "sometimes", r"KVPOOL_FUSED must be one of auto, always, never, got 'sometimes'"),
        ("KVPOOL_VALIDATE", "yes", r"KVPOOL_VALIDATE must be 0 or 1, got 'yes'"),
    ],
)
def test_pool_switches_reject_bad_values_naming_the_variable(clean_env, name, value, message):
    clean_env.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        MHATokenToKVPool(8, 1, torch.bfloat16, 1, 8, 1, CPU)


ENV_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def test_only_config_reads_the_environment():
    """No module of kvpool but kvpool/config.py touches the process environment (code only:
    names in comments and strings do not count)."""
    package = Path(kvpool.__file__).parent
    files = sorted(package.rglob("*.py"))
    assert len(files) > 10
    readers = {}
    for path in files:
        source = path.read_text()
        names = {
            tok.string
            for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type == tokenize.NAME and tok.string in ENV_NAMES
        }
        if names:
            readers[str(path.relative_to(package))] = names
    assert readers == {"config.py": {"environ"}}


@pytest.mark.parametrize("first, second", [(torch.int32, torch.int64), (torch.int64, torch.int32)], ids=["i32-i64", "i64-i32"])
def test_verify_writes_with_commit_lens_of_another_dtype_get_their_own_variant(jit, first, second):
    """commit_lens may be int32 or int64 whatever loc's type is; the compiled variant is typed by
    it, so a verify write whose commit_lens type differs from an earlier call's (all else equal)
    must not be launched directly on the earlier call's variant (it would read the lengths as the
    wrong integer type: int64 [3, 1] read as int32 is [3, 0])."""
    pool = MHATokenToKVPool(16, 1, torch.float8_e4m3fn, 2, 8, 1, CPU, fused="always", warmup=False)
    ref = MHATokenToKVPool(16, 1, torch.float8_e4m3fn, 2, 8, 1, CPU, fused="never")
    pool._writer.launches.enabled = True
    loc = torch.tensor([[1, 2, 3], [4, 5, 6]])
    x = torch.randn(6, 2, 8) * 10
    for step, dtype in enumerate([first, second, first, second]):
        commit = torch.tensor([[3, 1], [1, 2], [0, 3], [2, 0]][step], dtype=dtype)
        for p in (pool, ref):
            p.set_kv_buffer_prefix_valid(None, loc, commit, x * (step + 1), x, layer_id_override=0)
        for a, b in zip(pool.get_kv_buffer(0), ref.get_kv_buffer(0)):
            assert_same_bytes(a, b, f"step {step} (commit_lens {dtype})")
    assert jit.launches == 2, "one JIT launch per commit_lens type, then direct launches"


# --- frames from a public call to the kernel launch ------------------------------------------------

PACKAGE = Path(kvpool.__file__).resolve().parent


def _kvpool_frames() -> list[str]:
    """The kvpool functions on the caller's stack, innermost first."""
    names, frame = [], sys._getframe(1)
    while frame is not None:
        if Path(frame.f_code.co_filename).resolve().is_relative_to(PACKAGE):
            names.append(frame.f_code.co_name)
        frame = frame.f_back
    return names


@pytest.fixture
def frames(jit):
    """Direct launches record the kvpool frames under them; returns a function giving the frames of one call."""
    stacks: list[list[str]] = []
    jit.on_direct = lambda: stacks.append(_kvpool_frames())

    def of(call) -> list[str]:
        call()  # the first call of a kind launches through the JIT
        stacks.clear()
        call()
        assert len(stacks) == 1, f"{len(stacks)} direct launches for one call"
        return stacks[0]

    return of


def test_warm_eager_writes_reach_the_launch_in_two_kvpool_frames(frames):
    """A warm eager write is the entry and the writer's ``write``, which launches the compiled
    kernel: no other kvpool frame is on the stack when the launch happens."""
    mha = MHATokenToKVPool(16, 1, torch.float8_e4m3fn, 2, 8, 2, CPU, fused="always", warmup=False)
    mla = kvpool.MLATokenToKVPool(16, 1, torch.float8_e4m3fn, 16, 8, 2, CPU, fused="always", warmup=False)
    for pool in (mha, mla):
        pool._writer.launches.enabled = True
    x = torch.randn(3, 2, 8)
    row = torch.randn(3, 1, 24)
    loc = torch.tensor([1, 2, 3])
    scale = torch.tensor([0.5])
    assert frames(lambda: mha.set_kv_buffer(None, loc, x, x, scale, scale, layer_id_override=1)) == ["write", "set_kv_buffer"]
    assert frames(lambda: mha.set_kv_buffer_prefix_valid(None, loc.view(1, 3), torch.tensor([2]), x, x, 0.5, None, layer_id_override=0)) == ["write", "set_kv_buffer_prefix_valid"]  # fmt: skip
    assert frames(lambda: mla.set_kv_buffer(None, loc, row, None, scale, layer_id_override=0)) == ["write", "set_kv_buffer"]
    assert frames(lambda: mla.set_mla_kv_buffer(None, loc, row[:, :, :16], row[:, :, 16:], 0.5, layer_id_override=1)) == ["write", "set_mla_kv_buffer"]  # fmt: skip
    k_cache, v_cache = torch.zeros(8, 2, 8, dtype=torch.float8_e4m3fn), torch.zeros(8, 2, 8, dtype=torch.float8_e4m3fn)
    store_kv.writer_for(k_cache, v_cache, "always").launches.enabled = True
    assert frames(lambda: kvpool.fused_fp8_set_kv_buffer(x, x, k_cache, v_cache, loc, 0.5, 0.5)) == ["write", "fused_fp8_set_kv_buffer"]  # fmt: skip


def test_compiled_writes_reach_the_launch_in_two_kvpool_frames(frames):
    """Under torch.compile(fullgraph=True) the traced set_kv_buffer is gone at run time: the custom
    operator's implementation calls the writer's ``write``, which launches."""
    pool = MHATokenToKVPool(16, 1, torch.float8_e4m3fn, 2, 8, 1, CPU, fused="always", warmup=False)
    store_kv.writer_for(pool._k_views[0], pool._v_views[0], "always").launches.enabled = True
    torch._dynamo.reset()

    def step(x, loc, scale):
        pool.set_kv_buffer(None, loc, x, x, scale, scale, layer_id_override=0)
        return x.sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    x, loc, scale = torch.randn(3, 2, 8), torch.tensor([1, 2, 3]), torch.tensor([0.5])
    assert frames(lambda: compiled(x, loc, scale)) == ["write", "store_kv_custom_op"]


def test_a_launch_hook_keeps_triton_s_own_launch(jit):
    """With a launch hook set in Triton's knobs (a profiler's), a kept kernel launches through
    ``CompiledKernel[grid]``, which calls the hook; without one, through the launcher's entry."""
    from triton import knobs

    from kvpool.kernels.launch import Bound

    pool = MHATokenToKVPool(16, 1, torch.float8_e4m3fn, 2, 8, 1, CPU, fused="always", warmup=False)
    x, loc = torch.randn(3, 2, 8), torch.tensor([1, 2, 3])
    pool.set_kv_buffer(None, loc, x, x, 0.5, 0.5, layer_id_override=0)
    compiled = jit.handed[-1]
    assert Bound.of(compiled).run == compiled.run, "no hook: the launcher's entry"
    hook = knobs.runtime.launch_enter_hook
    seen: list = []
    if hasattr(hook, "add"):
        hook.add(seen.append)
        undo = lambda: hook.remove(seen.append)  # noqa: E731
    else:
        knobs.runtime.launch_enter_hook = seen.append
        undo = lambda: setattr(knobs.runtime, "launch_enter_hook", hook)  # noqa: E731
    try:
        bound = Bound.of(compiled)
    finally:
        undo()
    assert bound.run != compiled.run and bound.compiled is compiled, "a hook: Triton's own launch"
    calls = compiled.calls
    bound.run(1, 1, 1, 0, bound.function, bound.metadata, None, None, None, *compiled.bound)
    assert compiled.calls == calls + 1, "the launch went through compiled[grid]"
