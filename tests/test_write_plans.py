"""The write kernel's plans: the plan a write takes (tiles, flat, joined and chunk plans; every layout
the plan sweep can force) against the reference path, the direct launch's view of the kernel's
signature, and the warmup compiling what the first calls need.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kvassert import (
    DEVICE,
    INPUT_DTYPES,
    assert_same_bytes,
    both_paths,
    compiled_variants,
    cuda_pool,
    cuda_values,
    geometry_of,
    gpu,
    id_of,
    poison_,
    poisoned_caches,
    scale_of,
    slots_for,
    spread_rows,
)
from kvpool import reference_set_kv_buffer
from kvpool.kernels.store_kv import writer as store_kv
from kvpool.kernels.store_kv import kernel as store_kv_kernel
from kvpool.kernels.store_kv.layout import storage_view
from kvpool.kernels.store_kv.writer import KVWriter
from kvpool.write_types import FUNCTION_NAMES, Geometry
from kvpool.kernels.store_kv.checks import write_key
from kvpool.kernels.store_kv.plan import CHUNK, JOINED, PER_HEAD, ROW, ROW_JOINED, LaunchPlan, plan_write
from kvpool.kernels.store_kv.plan import SMALL_TOKENS, WRITE_LARGE_ROW, WRITE_SMALL, WRITE_SMALL_JOINED
from kvpool.kernels.launch import Tile

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
    names = list(store_kv_kernel.store_kv.arg_names)
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
