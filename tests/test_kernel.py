"""The fused Triton kernel against the reference path, byte for byte.

Without CUDA the kernel runs through Triton's interpreter on CPU tensors (its soft-cast mode, since
the interpreter's own FP8/bf16 conversions are wrong); with CUDA the same tests run the compiled
kernel. Shapes stay small: the interpreter costs about a millisecond per program.
"""

from __future__ import annotations

import pytest
import torch

from kvassert import assert_same_bytes, bits, poison_
from kvpool import fused_fp8_set_kv_buffer, quantize, reference_set_kv_buffer
from kvpool.kernels import store_kv, store_kv_kernel
from kvpool.kernels.store_kv import KVWriter, storage_view
from kvpool.kernels.store_kv_checks import FUNCTION_NAMES, Geometry, write_key
from kvpool.kernels.store_kv_op import launch_store_kv
from kvpool.kernels.store_kv_plan import CHUNK, JOINED, PER_HEAD, ROW, ROW_JOINED, LaunchPlan, plan_write
from kvpool.kernels.tuning import SMALL_TOKENS, WRITE_LARGE_ROW, WRITE_SMALL, WRITE_SMALL_JOINED, Tile

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BIG = SMALL_TOKENS + 1  # a write of the large-token band
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
CACHE_DTYPES = FP8 + [torch.bfloat16, torch.float16, torch.float32]
INPUT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _name(x) -> str:
    return str(x).replace("torch.", "")


def _geometry(k_cache, v_cache) -> Geometry:
    return Geometry(k_cache.dtype, *k_cache.shape[1:], *v_cache.shape[1:], k_cache.device)


def _rows(t, h, d, dtype, seed, spread=True):
    """Random rows with a wide magnitude range (overflow, normals, subnormals) and a few specials."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, d, generator=g)
    if spread:
        x = x * torch.exp2(torch.randint(-20, 12, (t, h, d), generator=g).float())
    flat = x.view(-1)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 448.0, 464.0, -57344.0])
    n = min(flat.numel(), specials.numel())
    flat[:n] = specials[:n]
    return x.to(dtype).to(DEVICE)


def _scale(kind, heads, seed=0):
    if kind == "none":
        return None
    if kind == "float":
        return 0.37
    if kind == "tensor":
        return torch.tensor([3.3], device=DEVICE)
    if kind == "tensor0d":
        return torch.tensor(0.1, device=DEVICE)
    g = torch.Generator().manual_seed(seed)
    per_head = (torch.rand(heads, generator=g) * 4 + 0.05).to(DEVICE)
    return per_head if kind == "per_head" else per_head.reshape(heads, 1)


def _caches(slots, h, d, hv, dv, dtype):
    k = poison_(torch.empty(slots, h, d, dtype=dtype, device=DEVICE))
    v = poison_(torch.empty(slots, hv, dv, dtype=dtype, device=DEVICE))
    return k, v


def _both_paths(k, v, loc, k_scale, v_scale, slots, cache_dtype, **launch):
    """Run the kernel and the reference on identically poisoned caches; return both results."""
    h, d, hv, dv = k.shape[1], k.shape[2], v.shape[1], v.shape[2]
    kf, vf = _caches(slots, h, d, hv, dv, cache_dtype)
    kr, vr = _caches(slots, h, d, hv, dv, cache_dtype)
    if launch:
        launch_store_kv(k, v, kf, vf, loc, k_scale, v_scale, **launch)
    else:
        fused_fp8_set_kv_buffer(k, v, kf, vf, loc, k_scale, v_scale)
    reference_set_kv_buffer(k, v, kr, vr, loc, k_scale, v_scale)
    return (kf, vf), (kr, vr)


def _loc(t, slots, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    loc = torch.randperm(slots, generator=g)[:t].to(dtype)
    if t >= 4:
        loc[1] = -1  # padding token
        loc[3] = slots + 5  # out of range: never written
    return loc.to(DEVICE)


@pytest.mark.parametrize("scale_kind", ["none", "float", "tensor", "tensor0d", "per_head", "per_head_col"])
@pytest.mark.parametrize("in_dtype", INPUT_DTYPES, ids=_name)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=_name)
def test_matches_reference_odd_shape(cache_dtype, in_dtype, scale_kind):
    t, h, d, slots = 7, 3, 96, 19
    k, v = _rows(t, h, d, in_dtype, 1), _rows(t, h, d, in_dtype, 2)
    ks, vs = _scale(scale_kind, h, 3), _scale(scale_kind, h, 4)
    (kf, vf), (kr, vr) = _both_paths(k, v, _loc(t, slots, torch.int64, 5), ks, vs, slots, cache_dtype)
    assert_same_bytes(kf, kr, "k_cache")
    assert_same_bytes(vf, vr, "v_cache")


@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64], ids=_name)
@pytest.mark.parametrize("cache_dtype", FP8, ids=_name)
def test_k_and_v_differ_in_heads_and_dims(cache_dtype, loc_dtype):
    t, slots = 9, 30
    k, v = _rows(t, 2, 32, torch.bfloat16, 6), _rows(t, 5, 24, torch.bfloat16, 7)
    (kf, vf), (kr, vr) = _both_paths(
        k, v, _loc(t, slots, loc_dtype, 8), 0.3, _scale("per_head", 5), slots, cache_dtype
    )
    assert_same_bytes(kf, kr, "k_cache")
    assert_same_bytes(vf, vr, "v_cache")


# Tiles far smaller than a row force several head blocks per tensor and partial token blocks, so
# every mask in the kernel is exercised.
@pytest.mark.parametrize("elems", [16, 64, 256, 4096])
@pytest.mark.parametrize("h,d,hv,dv", [(3, 96, 3, 96), (4, 16, 2, 40), (1, 8, 1, 8)])
def test_tile_shapes(elems, h, d, hv, dv):
    t, slots = 13, 40
    tile = Tile(elems=elems, num_warps=4)
    plan = plan_write(h, d, hv, dv, t, tile=tile)
    assert plan.block_t >= 1 and plan.k_blocks * plan.block_h * (plan.block_d + plan.block_d2) >= h * d
    k, v = _rows(t, h, d, torch.float16, 9), _rows(t, hv, dv, torch.float16, 10)
    (kf, vf), (kr, vr) = _both_paths(
        k, v, _loc(t, slots, torch.int32, 11), 0.7, 1.9, slots, torch.float8_e4m3fn, tile=tile
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
    k, v = _rows(t, h, d, torch.bfloat16, 44), _rows(t, h, d, torch.bfloat16, 45)
    kf, vf = _caches(slots, h, d, h, d, torch.float8_e4m3fn)
    writer = KVWriter(_geometry(kf, vf), kf.stride(), vf.stride(), slots, "always")
    assert writer.plan(k.stride(), v.stride(), (2, 2), False, t) == small
    (kf, vf), (kr, vr) = _both_paths(k, v, _loc(t, slots, torch.int64, 46), torch.tensor([0.3], device=DEVICE), 2.5,
                                     slots, torch.float8_e4m3fn)  # fmt: skip
    assert_same_bytes(kf, kr, "k_cache")
    assert_same_bytes(vf, vr, "v_cache")


def test_writes_pick_the_tile_by_size_and_both_tiles_match_reference():
    """Writes of at most SMALL_TOKENS tokens take the small tile, larger ones the large tile (both
    per-head and flat plans); a write just past the boundary matches the reference."""
    h, d = 3, 8  # rows of 24: the flat plan applies (3 of 4 head slots would be used)
    kf, vf = _caches(4, h, d, h, d, torch.float8_e4m3fn)
    writer = KVWriter(_geometry(kf, vf), kf.stride(), vf.stride(), 4, "always")
    st = (h * d, d, 1)
    for kinds, flat in (((2, 2), True), ((3, 3), False)):  # tensor scales: flat; per-head scales: per-head
        small = writer.plan(st, st, kinds, False, SMALL_TOKENS)
        large = writer.plan(st, st, kinds, False, SMALL_TOKENS + 1)
        assert small == plan_write(h, d, h, d, 1, row=flat, tile=WRITE_SMALL) and small.row_view == flat
        assert large == plan_write(h, d, h, d, BIG, row=flat) and large.row_view == flat
        assert small.num_warps == WRITE_SMALL.num_warps and large.block_t != small.block_t
    t, slots = SMALL_TOKENS + 1, 2 * SMALL_TOKENS + 8
    k, v = _rows(t, h, d, torch.bfloat16, 41), _rows(t, h, d, torch.bfloat16, 42)
    (kf, vf), (kr, vr) = _both_paths(k, v, _loc(t, slots, torch.int64, 43), 0.3, torch.tensor([2.5], device=DEVICE),
                                     slots, torch.float8_e4m3fn)  # fmt: skip
    assert_same_bytes(kf, kr, "k_cache")
    assert_same_bytes(vf, vr, "v_cache")


@pytest.mark.parametrize("chunk", [8, 16, 32])
@pytest.mark.parametrize("h,d,hv,dv,mla", [(3, 96, 3, 96, False), (2, 64, 2, 64, False), (1, 64, 1, 32, True)])
def test_chunk_plans_match_reference(h, d, hv, dv, mla, chunk):
    """Rows viewed as runs of ``chunk`` elements (a candidate of the plan sweep, bench_set_kv.py
    --sections plans): same bytes as the reference, on caches that are views of one row (MLA's
    latent and rotary parts) too."""
    t, slots = 9, 23
    tile = Tile(elems=64, num_warps=1)
    plan = plan_write(h, d, hv, dv, t, row=True, tile=tile, layout=CHUNK, chunk=chunk)
    assert plan.row_view and plan.head_dim == chunk and plan.lane_use == 1.0
    k, v = _rows(t, h, d, torch.bfloat16, 51), _rows(t, hv, dv, torch.bfloat16, 52)
    loc = _loc(t, slots, torch.int64, 53)
    out = []
    for _ in range(2):
        if mla:
            row = poison_(torch.empty(slots, 1, d + dv, dtype=torch.float8_e4m3fn, device=DEVICE))
            out.append((row, row[:, :, :d], row[:, :, d:]))
        else:
            kc, vc = _caches(slots, h, d, hv, dv, torch.float8_e4m3fn)
            out.append((None, kc, vc))
    (_, kf, vf), (_, kr, vr) = out
    writer = KVWriter(_geometry(kf, vf), kf.stride(), vf.stride(), slots, "always", tile=tile, layout=CHUNK, chunk=chunk)
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
@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64], ids=_name)
@pytest.mark.parametrize("h,d,hv,dv", [(1, 64, 1, 16), (3, 96, 3, 96), (2, 32, 1, 40)])
def test_joined_plans_match_reference(h, d, hv, dv, loc_dtype, scale_kind):
    t, slots = 11, 29
    tile = Tile(elems=512, num_warps=2)
    plan = plan_write(h, d, hv, dv, t, joined=True, tile=tile)
    assert plan.joined and plan.block_t < t
    k, v = _rows(t, h, d, torch.bfloat16, 61), _rows(t, hv, dv, torch.float32, 62)
    ks, vs = _scale(scale_kind, h, 63), _scale(scale_kind, hv, 64)
    if scale_kind in ("float", "tensor"):  # K and V scales differ, so a mix-up shows
        vs = 1.9 if scale_kind == "float" else torch.tensor([0.21], device=DEVICE)
    loc = _loc(t, slots, loc_dtype, 65)
    key = write_key(k, v, loc, ks, vs)
    kc, vc = _caches(slots, h, d, hv, dv, torch.float8_e4m3fn)
    writer = KVWriter(_geometry(kc, vc), kc.stride(), vc.stride(), slots, "always", tile=tile, row_plans=False, joined=True)
    assert writer.plan(k.stride(), v.stride(), (key[3], key[4]), False, t) == plan  # the joined plan runs
    for cache_dtype in (torch.float8_e4m3fn, torch.bfloat16):
        (kf, vf), (kr, vr) = _both_paths(
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
    k, v = _rows(t, h, d, torch.bfloat16, 71), _rows(t, hv, dv, torch.float16, 72)
    loc = _loc(t, slots, torch.int64, 73)
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
    (kf, vf), (kr, vr) = _both_paths(k, v, loc, scale, 1.9, slots, torch.float8_e4m3fn, tile=tiles, layout=layout)
    assert_same_bytes(kf, kr, "k_cache")
    assert_same_bytes(vf, vr, "v_cache")


def test_flat_plan_with_rows_longer_than_the_tile():
    t, slots, h, d = 5, 11, 3, 16  # 48-element rows, 32-element tile: three blocks of 16 per row
    tile = Tile(elems=32, num_warps=1)
    plan = plan_write(h, d, h, d, t, row=True, tile=tile)
    assert plan.block_d == 16 and plan.block_d2 == 0 and plan.k_blocks == 3
    k, v = _rows(t, h, d, torch.bfloat16, 31), _rows(t, h, d, torch.bfloat16, 32)
    (kf, vf), (kr, vr) = _both_paths(
        k, v, _loc(t, slots, torch.int64, 33), torch.tensor([0.3], device=DEVICE), 2.5, slots,
        torch.float8_e4m3fn, tile=tile,
    )  # fmt: skip
    assert_same_bytes(kf, kr, "k_cache")
    assert_same_bytes(vf, vr, "v_cache")


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


# Geometries with a flat plan: K and V rows of equal and of different lengths, one head, and rows
# that split into whole blocks. Calls whose inputs or scales rule the flat plan out take the
# per-head plan; both must match the reference.
@pytest.mark.parametrize("layout", ["contiguous", "qkv_slice", "head_dim_strided"])
@pytest.mark.parametrize("h,d,hv,dv", [(3, 96, 3, 96), (3, 40, 5, 24), (1, 80, 1, 80), (6, 64, 6, 64)])
@pytest.mark.parametrize("scale_kind", ["tensor", "per_head"])
def test_flat_and_per_head_plans_match_reference(h, d, hv, dv, layout, scale_kind):
    t, slots = 9, 23
    k = _layout(_rows(t, h, d, torch.bfloat16, 21), layout)
    v = _layout(_rows(t, hv, dv, torch.bfloat16, 22), layout)
    ks, vs = _scale(scale_kind, h, 23), _scale(scale_kind, hv, 24)
    cache_dtype = torch.float8_e4m3fn
    kf, vf = _caches(slots, h, d, hv, dv, cache_dtype)
    writer = KVWriter(_geometry(kf, vf), kf.stride(), vf.stride(), slots, "always")
    kinds = (2 if scale_kind == "tensor" else 3,) * 2
    # one head per row is contiguous in any layout; a geometry whose per-head plan fills its lanes
    # (one head of 80 = 64 + 16) has no flat plan
    has_flat = plan_write(h, d, hv, dv, BIG, row=True).row_view
    expect_flat = has_flat and scale_kind == "tensor" and (layout != "head_dim_strided" or h == hv == 1)
    assert (not has_flat) == ((h, d, hv, dv) == (1, 80, 1, 80))
    assert writer.plan(k.stride(), v.stride(), kinds, False, BIG).row_view == expect_flat
    (kf, vf), (kr, vr) = _both_paths(k, v, _loc(t, slots, torch.int64, 25), ks, vs, slots, cache_dtype)
    assert_same_bytes(kf, kr, "k_cache")
    assert_same_bytes(vf, vr, "v_cache")


@pytest.mark.parametrize("scale", [None, 0.37, 2.0**-7], ids=["none", "0.37", "pow2"])
@pytest.mark.parametrize("cache_dtype", FP8 + [torch.bfloat16, torch.float16], ids=_name)
def test_every_bf16_bit_pattern(cache_dtype, scale):
    """All 65,536 bf16 values: every exponent, both zeros, subnormals, infinities, NaNs."""
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    k = every.reshape(512, 1, 128).to(DEVICE)
    loc = torch.arange(512, device=DEVICE)
    (kf, _), (kr, _) = _both_paths(k, k, loc, scale, scale, 512, cache_dtype)
    assert_same_bytes(kf, kr, "k_cache")


def test_every_fp16_bit_pattern_into_e5m2():
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
    k = every.reshape(256, 2, 128).to(DEVICE)
    loc = torch.arange(256, device=DEVICE)
    (kf, _), (kr, _) = _both_paths(k, k, loc, 3.3, None, 256, torch.float8_e5m2)
    assert_same_bytes(kf, kr, "k_cache")


def test_strided_inputs_need_no_copy():
    """K and V sliced out of a fused QKV projection, and a view whose head_dim is not contiguous."""
    t, hq, h, d, slots = 6, 4, 2, 64, 16
    qkv = _rows(t, hq + 2 * h, d, torch.bfloat16, 12)
    k, v = qkv[:, hq : hq + h], qkv[:, hq + h :]
    assert not k.is_contiguous() and not v.is_contiguous()
    (kf, vf), (kr, vr) = _both_paths(k, v, _loc(t, slots, torch.int64, 13), 0.25, 0.5, slots, torch.float8_e4m3fn)
    assert_same_bytes(kf, kr, "k_cache")
    assert_same_bytes(vf, vr, "v_cache")
    dhn = _rows(t, d, h, torch.float32, 14)  # [T, D, H] storage: head_dim stride is H
    kt = dhn.transpose(1, 2)
    (kf, _), (kr, _) = _both_paths(kt, kt, _loc(t, slots, torch.int64, 15), None, None, slots, torch.float8_e5m2)
    assert_same_bytes(kf, kr, "k_cache (transposed input)")


def test_out_of_range_and_negative_slots_touch_nothing_outside():
    """The caches are a window into a larger poisoned tensor; slots outside the window (negative,
    >= slots, huge) must leave every guard row untouched, on both paths."""
    t, h, d, slots, guard = 8, 2, 16, 10, 4
    loc = torch.tensor([0, -1, slots, slots + guard, 2**31 + 3, -(2**40), 9, 5], device=DEVICE)
    k = _rows(t, h, d, torch.bfloat16, 16, spread=False)
    for write in (fused_fp8_set_kv_buffer, reference_set_kv_buffer):
        backing = poison_(torch.empty(slots + 2 * guard, h, d, dtype=torch.float8_e4m3fn, device=DEVICE))
        backing_v = poison_(torch.empty_like(backing))
        before = bits(backing).clone()
        write(k, k, backing[guard : guard + slots], backing_v[guard : guard + slots], loc, 0.5, 0.5)
        after = bits(backing)
        assert torch.equal(after[:guard], before[:guard]), f"{write.__name__} wrote below the cache"
        assert torch.equal(after[guard + slots :], before[guard + slots :]), f"{write.__name__} wrote past the cache"
        written = {0, 9, 5}
        for row in range(slots):
            changed = not torch.equal(after[guard + row], before[guard + row])
            assert changed == (row in written), f"{write.__name__}: row {row} changed={changed}"


def test_inputs_and_scales_are_never_modified():
    t, h, d = 5, 2, 32
    k, v = _rows(t, h, d, torch.float32, 17), _rows(t, h, d, torch.float32, 18)
    ks = torch.tensor([0.3], device=DEVICE)
    loc = _loc(t, 12, torch.int64, 19)
    snapshot = [bits(x).clone() for x in (k, v, ks, loc)]
    for write in (fused_fp8_set_kv_buffer, reference_set_kv_buffer):
        kc, vc = _caches(12, h, d, h, d, torch.float8_e4m3fn)
        write(k, v, kc, vc, loc, ks, 0.9)
        for x, s in zip((k, v, ks, loc), snapshot):
            assert torch.equal(bits(x), s), f"{write.__name__} modified an input"


def test_zero_tokens_is_a_no_op():
    kc, vc = _caches(8, 2, 16, 2, 16, torch.float8_e4m3fn)
    before = bits(kc).clone(), bits(vc).clone()
    empty = torch.empty(0, 2, 16, dtype=torch.bfloat16, device=DEVICE)
    loc = torch.empty(0, dtype=torch.int64, device=DEVICE)
    for write in (fused_fp8_set_kv_buffer, reference_set_kv_buffer):
        assert write(empty, empty, kc, vc, loc, 0.5, 0.5) is None
    assert torch.equal(bits(kc), before[0]) and torch.equal(bits(vc), before[1])


def test_duplicate_slots_take_one_of_the_rows():
    """Which token wins a shared slot is unspecified; the slot must still hold one of them."""
    h, d = 2, 16
    k = _rows(4, h, d, torch.bfloat16, 20, spread=False)
    loc = torch.tensor([3, 3, 7, 3], device=DEVICE)
    for write in (fused_fp8_set_kv_buffer, reference_set_kv_buffer):
        kc, vc = _caches(10, h, d, h, d, torch.float8_e4m3fn)
        write(k, k, kc, vc, loc, 0.5, 0.5)
        full = torch.zeros(10, h, d, dtype=torch.float8_e4m3fn, device=DEVICE)
        reference_set_kv_buffer(k, k, full, full.clone(), torch.arange(4, device=DEVICE), 0.5, 0.5)
        candidates = [bits(full[i]) for i in (0, 1, 3)]
        assert any(torch.equal(bits(kc[3]), c) for c in candidates)
        assert torch.equal(bits(kc[7]), bits(full[2]))


def test_direct_launch_knows_the_kernel_signature():
    """Direct launches pass every argument positionally: the per-call ones, the fixed ones, then the
    compile-time constants, in the kernel's signature order."""
    names = list(store_kv_kernel._store_kv_kernel.arg_names)
    assert tuple(names[-len(store_kv.CONSTEXPRS) :]) == store_kv.CONSTEXPRS
    assert tuple(names) == store_kv.PARAMS


@pytest.mark.parametrize("write", [fused_fp8_set_kv_buffer, reference_set_kv_buffer], ids=lambda f: f.__name__)
def test_public_functions_follow_kvpool_validate(write, monkeypatch):
    kc, vc = _caches(8, 1, 16, 1, 16, torch.float8_e4m3fn)
    before = bits(kc).clone()
    x = torch.ones(2, 1, 16, device=DEVICE)
    loc = torch.tensor([1, 8], device=DEVICE)
    monkeypatch.setenv("KVPOOL_VALIDATE", "1")
    with pytest.raises(IndexError, match=r"cache_loc\[1\] = 8 is out of range"):
        write(x, x, kc, vc, loc)
    assert torch.equal(bits(kc), before)
    write(x, x, kc, vc, loc, validate=False)  # an explicit argument wins over the environment
    assert not torch.equal(bits(kc), before)


def test_head_major_cache_beyond_int32_offsets():
    """A caller's head-major cache [H, slots, D] viewed as [slots, H, D] has head stride slots * D;
    with (H - 1) * slots * D >= 2**31 the head offset must not wrap (it did, writing before the
    buffer). 3 GiB of lazily zeroed memory; only the written rows are touched."""
    if DEVICE == "cuda" and torch.cuda.mem_get_info()[0] < (4 << 30):
        pytest.skip("needs 3 GiB of device memory")
    h, slots, d = 3, 2**26, 16
    backing = torch.zeros(h, slots, d, dtype=torch.float8_e4m3fn, device=DEVICE)
    k_cache = backing.transpose(0, 1)  # [slots, H, D], stride (16, 2**30, 1)
    k = _rows(2, h, d, torch.bfloat16, 21, spread=False)
    loc = torch.tensor([5, slots - 1], device=DEVICE)
    fused_fp8_set_kv_buffer(k, k, k_cache, k_cache, loc, 0.5, 0.5)
    expected = quantize(k, torch.float8_e4m3fn, 0.5)
    for t, slot in enumerate([5, slots - 1]):
        assert_same_bytes(backing[:, slot], expected[t], f"slot {slot}")


def test_non_contiguous_per_head_scale_needs_no_copy():
    t, h, d, slots = 5, 3, 32, 12
    k = _rows(t, h, d, torch.bfloat16, 22)
    wide = (torch.rand(h, 4, device=DEVICE) * 3 + 0.1)
    for scale in (wide[:, 1], wide[:, 2:3]):  # [H] with stride 4, [H, 1] with stride (4, 1)
        assert not scale.is_contiguous()
        (kf, vf), (kr, vr) = _both_paths(k, k, _loc(t, slots, torch.int64, 23), scale, scale, slots, torch.float8_e4m3fn)
        assert_same_bytes(kf, kr, "k_cache")
        assert_same_bytes(vf, vr, "v_cache")
