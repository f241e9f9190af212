"""The verify write of speculative decoding (``set_kv_buffer_prefix_valid``): token ``(i, j)`` is
written exactly as ``set_kv_buffer`` writes it iff ``j < commit_lens[i]``, the rest write nothing.

Properties, commit lengths at and beyond the edges, the flat plan with qkv slices, bad input and
validate; on CUDA against the reference and the plain write, in CUDA graphs, with neither
synchronisation nor allocation.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvassert import (
    CUDA_D,
    CUDA_H,
    CUDA_ROWS,
    D,
    DEVICE,
    FORMAT_OF,
    FP8,
    H,
    META,
    assert_codes_equal,
    assert_pools_equal,
    assert_same_bytes,
    bits,
    codes_of,
    committed_tokens,
    cuda_gen,
    cuda_pool,
    cuda_scale,
    cuda_values,
    fused_runs,
    gpu,
    id_of,
    no_sync,
    poison_,
    poison_pool_,
    q_codes_stored,
    scale_of,
)
from kvpool import MHATokenToKVPool

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy inside Triton's interpreter


# ==============================================================================================
# The verify write.
# Token ``(i, j)`` (input row ``i * width + j``) is written to slot ``loc_2d[i, j]`` exactly as
# ``set_kv_buffer`` writes a token iff ``j < commit_lens[i]``; the rest write nothing. Every case runs
# on a fused pool and a reference pool, with all buffers poisoned first, and the two must agree byte
# for byte with each other and with an expected buffer built here from the oracle (``kvassert.q_codes_stored``) row by row.
# K is [T, H, D] with the bad-input cases' H and D; V is [T, H, VERIFY_DV].


# A pool of 21 rows, two layers; layer 1 is written, layer 0 must stay poisoned. K [T, 2, 8], V [T, 2, 4].
VERIFY_DV = 4
VERIFY_SIZE, VERIFY_PAGE = 20, 1
VERIFY_ROWS = VERIFY_SIZE + VERIFY_PAGE  # 21 rows per buffer
VERIFY_LAYERS = 2
VERIFY_LAYER = 1


def _verify_pool(dtype, fused, **kw) -> MHATokenToKVPool:
    pool = MHATokenToKVPool(VERIFY_SIZE, VERIFY_PAGE, dtype, H, D, VERIFY_LAYERS, DEVICE, v_head_dim=VERIFY_DV, fused=fused, warmup=False, **kw)
    return poison_pool_(pool)


def _buffer_bits(pool) -> list[torch.Tensor]:
    return [bits(b).clone() for b in pool.k_buffer + pool.v_buffer]


def _assert_buffers_unchanged(pool, snapshot, what) -> None:
    for i, (b, s) in enumerate(zip(pool.k_buffer + pool.v_buffer, snapshot)):
        assert torch.equal(bits(b), s), f"{what}: buffer {i} changed"


def _verify_rows(t, heads, dim, dtype, seed):
    """Values with a wide magnitude range and the specials (NaN, +-inf, +-0, overflow)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, heads, dim, generator=g) * torch.exp2(torch.randint(-12, 12, (t, heads, dim), generator=g).float())
    flat = x.view(-1)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e5, -600.0])
    flat[: min(flat.numel(), 6)] = specials[: min(flat.numel(), 6)]
    return x.to(dtype).to(DEVICE)


def _verify_qkv_slice(t, heads, dim, dtype, seed):
    """[t, heads, dim] as a strided view (the V part of a fused projection)."""
    wide = _verify_rows(t, 3 * heads, dim, dtype, seed)
    return wide[:, heads : 2 * heads]


def _loc_layout(loc: list[list[int]], layout: str, dtype) -> torch.Tensor:
    """``loc`` [bs, width] as a tensor with the given memory layout (same logical values)."""
    t = torch.tensor(loc, dtype=dtype, device=DEVICE).reshape(len(loc), -1)
    bs, width = t.shape
    if layout == "slice":  # rows of a bigger table: stride (width + 5, 1), offset
        big = torch.full((bs + 2, width + 5), -77, dtype=dtype, device=DEVICE)
        big[1 : 1 + bs, 2 : 2 + width] = t
        out = big[1 : 1 + bs, 2 : 2 + width]
    elif layout == "transposed":  # stride (1, bs)
        out = t.t().contiguous().t()
    elif layout == "every_other_column":  # stride (2 * width, 2)
        big = torch.full((bs, 2 * width), -77, dtype=dtype, device=DEVICE)
        big[:, ::2] = t
        out = big[:, ::2]
    else:
        out = t
    assert torch.equal(out, t)
    assert layout == "contiguous" or not out.is_contiguous() or min(out.shape) <= 1
    return out


def _verify_expected(dtype, loc, commit, k, v, ks, vs):
    """The oracle's codes of one layer's poisoned buffers with the committed, in-range tokens written
    row by row (NaN as the write stores it)."""
    ek = codes_of(poison_(torch.empty(VERIFY_ROWS, H, D, dtype=dtype))).astype(np.int64)
    ev = codes_of(poison_(torch.empty(VERIFY_ROWS, H, VERIFY_DV, dtype=dtype))).astype(np.int64)
    qk, qv = q_codes_stored(k, dtype, ks), q_codes_stored(v, dtype, vs)
    width = len(loc[0]) if loc else 0
    for i, row in enumerate(loc):
        for j, slot in enumerate(row):
            t = i * width + j
            if j < commit[i] and 0 <= slot < VERIFY_ROWS:
                ek[slot] = qk[t]
                ev[slot] = qv[t]
    return ek, ev


def _verify_check(dtype, loc, commit, loc_t, commit_t, k, v, ks, vs) -> None:
    """Fused pool, reference pool, the explicit expectation, and set_kv_buffer of just the
    committed tokens must all hold the same bytes."""
    pools = {fused: _verify_pool(dtype, fused) for fused in ("always", "never")}
    for pool in pools.values():
        pool.set_kv_buffer_prefix_valid(None, loc_t, commit_t, k, v, ks, vs, layer_id_override=VERIFY_LAYER)
    assert_pools_equal(pools["always"], pools["never"], "fused vs reference", range(VERIFY_LAYERS))
    ek, ev = _verify_expected(dtype, loc, commit, k, v, ks, vs)
    fmt = FORMAT_OF[dtype]
    assert_codes_equal(pools["never"].get_key_buffer(VERIFY_LAYER), ek, fmt, "K vs expected rows", nan_equal=False)
    assert_codes_equal(pools["never"].get_value_buffer(VERIFY_LAYER), ev, fmt, "V vs expected rows", nan_equal=False)
    # The same write as a plain set_kv_buffer of the committed tokens only.
    width = len(loc[0]) if loc else 0
    kept = [i * width + j for i, row in enumerate(loc) for j in range(width) if j < commit[i]]
    plain = _verify_pool(dtype, "never")
    idx = torch.tensor(kept, dtype=torch.int64, device=DEVICE)
    flat = torch.tensor([s for row in loc for s in row] or [0], dtype=torch.int64, device=DEVICE)[idx]
    plain.set_kv_buffer(None, flat, k[idx], v[idx], ks, vs, layer_id_override=VERIFY_LAYER)
    assert_pools_equal(plain, pools["never"], "set_kv_buffer of the committed tokens vs verify write", range(VERIFY_LAYERS))
    assert pools["always"].stats.fused_calls == 1 and pools["never"].stats.reference_calls == 1


# --- properties ------------------------------------------------------------------------------------


@st.composite
def verify_writes(draw):
    bs = draw(st.integers(0, 4))
    width = draw(st.integers(0, 4))
    loc_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    commit_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    # In-range slots are distinct (which duplicate wins is unspecified); padding and
    # out-of-range slots may repeat.
    in_range = draw(st.permutations(range(VERIFY_ROWS)))
    big = 2**31 - 1 if loc_dtype == torch.int32 else 2**40
    loc = []
    for i in range(bs):
        row = []
        for j in range(width):
            kind = draw(st.sampled_from(["slot", "slot", "slot", "negative", "out_of_range"]))
            if kind == "slot":
                row.append(in_range[i * width + j])
            elif kind == "negative":
                row.append(draw(st.sampled_from([-1, -5, -(2**31)])))
            else:
                row.append(draw(st.sampled_from([VERIFY_ROWS, VERIFY_ROWS + 3, big])))
        loc.append(row)
    commit = [draw(st.integers(-2, width + 2)) for _ in range(bs)]
    return dict(
        bs=bs, width=width, loc=loc, commit=commit, loc_dtype=loc_dtype, commit_dtype=commit_dtype,
        layout=draw(st.sampled_from(["contiguous", "slice", "transposed", "every_other_column"])),
        cache_dtype=draw(st.sampled_from([torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16])),
        in_dtype=draw(st.sampled_from([torch.bfloat16, torch.float32])),
        k_scale=draw(st.sampled_from(["none", "float", "tensor", "per_head"])),
        v_scale=draw(st.sampled_from(["none", "float", "tensor", "per_head"])),
        seed=draw(st.integers(0, 2**16)),
    )  # fmt: skip


@fused_runs
@given(verify_writes())
def test_verify_write_property(case):
    bs, width = case["bs"], case["width"]
    t = bs * width
    loc_t = (
        _loc_layout(case["loc"], case["layout"], case["loc_dtype"])
        if bs and width
        else torch.empty(bs, width, dtype=case["loc_dtype"], device=DEVICE)
    )
    commit_t = torch.tensor(case["commit"], dtype=case["commit_dtype"], device=DEVICE)
    k = _verify_rows(t, H, D, case["in_dtype"], case["seed"])
    v = _verify_qkv_slice(t, H, VERIFY_DV, case["in_dtype"], case["seed"] + 1)
    ks, vs = scale_of(case["k_scale"], H, case["seed"]), scale_of(case["v_scale"], H, case["seed"] + 2)
    if t == 0:
        for fused in ("always", "never"):
            pool = _verify_pool(case["cache_dtype"], fused)
            before = _buffer_bits(pool)
            pool.set_kv_buffer_prefix_valid(None, loc_t, commit_t, k, v, ks, vs, layer_id_override=VERIFY_LAYER)
            _assert_buffers_unchanged(pool, before, f"empty verify write ({bs}x{width})")
        return
    _verify_check(case["cache_dtype"], case["loc"], case["commit"], loc_t, commit_t, k, v, ks, vs)


# --- deliberate cases ------------------------------------------------------------------------------


@fused_runs
@pytest.mark.parametrize("layout", ["contiguous", "slice", "transposed"])
@pytest.mark.parametrize("commit_dtype", [torch.int32, torch.int64], ids=id_of)
@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64], ids=id_of)
def test_commit_lengths_at_and_beyond_the_edges(loc_dtype, commit_dtype, layout):
    """commit_lens 0, width, negative, beyond width and in between, in one batch of 5 requests."""
    width = 3
    loc = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12], [13, -1, VERIFY_ROWS + 1]]
    commit = [0, width, -1, width + 4, 2]
    k = _verify_rows(15, H, D, torch.bfloat16, 1)
    v = _verify_rows(15, H, VERIFY_DV, torch.bfloat16, 2)
    loc_t = _loc_layout(loc, layout, loc_dtype)
    commit_t = torch.tensor(commit, dtype=commit_dtype, device=DEVICE)
    _verify_check(torch.float8_e4m3fn, loc, commit, loc_t, commit_t, k, v, 0.5, torch.tensor([3.0], device=DEVICE))
    # slots 1-3 (commit 0), 7-9 (negative commit) and all others never named stay poisoned
    pool = _verify_pool(torch.float8_e4m3fn, "always")
    pool.set_kv_buffer_prefix_valid(None, loc_t, commit_t, k, v, 0.5, None, layer_id_override=VERIFY_LAYER)
    untouched = [0, 1, 2, 3, 7, 8, 9, 14, *range(15, VERIFY_ROWS)]
    assert (bits(pool.get_key_buffer(VERIFY_LAYER))[untouched] == 0xFF).all()
    assert not (bits(pool.get_key_buffer(VERIFY_LAYER))[[4, 5, 6, 10, 11, 12, 13]] == 0xFF).all(dim=(1, 2)).any()


@fused_runs
def test_verify_write_on_the_flat_plan_geometry_with_qkv_slices():
    """A geometry whose launcher takes the flat plan (H=3, D=96) and inputs sliced out of a fused
    projection: the prefix mask must hold for every block of the row."""
    h, d = 3, 96
    loc = [[3, 9, 4], [7, 1, 12]]
    commit = torch.tensor([2, 1], device=DEVICE)
    loc_t = torch.tensor(loc, device=DEVICE)
    wide = _verify_rows(6, 3 * h, d, torch.bfloat16, 5)
    k, v = wide[:, h : 2 * h], wide[:, 2 * h :]
    pools = {}
    for fused in ("always", "never"):
        pool = MHATokenToKVPool(16, 1, torch.float8_e4m3fn, h, d, 1, DEVICE, fused=fused, warmup=False)
        poison_pool_(pool)
        pool.set_kv_buffer_prefix_valid(None, loc_t, commit, k, v, 0.3, 0.7, layer_id_override=0)
        pools[fused] = pool
    assert pools["always"]._writer.plan((h * d, d, 1), (h * d, d, 1), (1, 1), False, 6).row_view  # a row plan exists
    for a, b in zip(pools["always"].get_kv_buffer(0), pools["never"].get_kv_buffer(0)):
        assert_same_bytes(a, b, "flat plan")
    written = {3, 9, 7}
    k_bits = bits(pools["always"].get_key_buffer(0))
    for slot in range(17):
        assert (k_bits[slot] == 0xFF).all() == (slot not in written), slot


@fused_runs
def test_commit_lens_is_read_when_the_write_runs():
    """Changing commit_lens in place between two writes changes what the second one writes (the
    kernel reads it on the device; nothing is cached from the first call)."""
    pool = _verify_pool(torch.bfloat16, "always")
    ref = _verify_pool(torch.bfloat16, "never")
    loc = torch.tensor([[1, 2], [3, 4]], device=DEVICE)
    commit = torch.tensor([0, 0], device=DEVICE)
    k = _verify_rows(4, H, D, torch.float32, 3)
    v = _verify_rows(4, H, VERIFY_DV, torch.float32, 4)
    ever = set()
    for lens, slots in (([0, 0], set()), ([1, 2], {1, 3, 4}), ([2, 0], {1, 2})):
        commit.copy_(torch.tensor(lens))
        for p in (pool, ref):
            p.set_kv_buffer_prefix_valid(None, loc, commit, k * (lens[0] + 1), v, layer_id_override=0)
        assert_pools_equal(pool, ref, f"commit_lens {lens}", range(VERIFY_LAYERS))
        ever |= slots
        for slot in (1, 2, 3, 4):
            poisoned = bool((bits(pool.get_key_buffer(0))[slot] == -1).all())
            assert poisoned == (slot not in ever), (lens, slot)


# --- bad input -------------------------------------------------------------------------------------

def _verify_base():
    return dict(
        layer=None,
        loc_2d=torch.tensor([[1, 2, 3], [4, 5, 6]], device=DEVICE),
        commit_lens=torch.tensor([2, 3], device=DEVICE, dtype=torch.int32),
        cache_k=torch.randn(6, H, D, device=DEVICE),
        cache_v=torch.randn(6, H, VERIFY_DV, device=DEVICE),
        k_scale=0.5,
        v_scale=None,
        layer_id_override=VERIFY_LAYER,
    )


VERIFY_BAD = {
    "loc_2d 1-D": (dict(loc_2d=torch.arange(1, 7)), ValueError, r"loc_2d must be 2-D \[bs, width\], got shape \(6,\)"),
    "loc_2d 3-D": (dict(loc_2d=torch.ones(2, 3, 1, dtype=torch.long)), ValueError, r"loc_2d must be 2-D \[bs, width\], got shape \(2, 3, 1\)"),
    "loc_2d bs*width != T": (dict(loc_2d=torch.ones(3, 3, dtype=torch.long)), ValueError, r"loc_2d must have bs \* width = T = 6 entries.*got shape \(3, 3\)"),
    "loc_2d float": (dict(loc_2d=torch.ones(2, 3)), ValueError, r"loc_2d must be int32 or int64, got torch.float32"),
    "loc_2d list": (dict(loc_2d=[[1, 2, 3], [4, 5, 6]]), TypeError, r"loc_2d must be a torch.Tensor, got list"),
    "loc_2d other device": (dict(loc_2d=torch.ones(2, 3, dtype=torch.long, device=META)), ValueError, rf"loc_2d must be on {DEVICE}.*got meta"),
    "commit_lens too long": (dict(commit_lens=torch.tensor([1, 1, 1])), ValueError, r"commit_lens must be 1-D \[bs\] with bs = 2 \(one per row of loc_2d\), got shape \(3,\)"),
    "commit_lens 2-D": (dict(commit_lens=torch.tensor([[1], [1]])), ValueError, r"commit_lens must be 1-D \[bs\] with bs = 2.*got shape \(2, 1\)"),
    "commit_lens 0-d": (dict(commit_lens=torch.tensor(2)), ValueError, r"commit_lens must be 1-D \[bs\] with bs = 2.*got shape \(\)"),
    "commit_lens float": (dict(commit_lens=torch.tensor([1.0, 2.0])), ValueError, r"commit_lens must be int32 or int64, got torch.float32"),
    "commit_lens bool": (dict(commit_lens=torch.tensor([True, False])), ValueError, r"commit_lens must be int32 or int64, got torch.bool"),
    "commit_lens int16": (dict(commit_lens=torch.tensor([1, 2], dtype=torch.int16)), ValueError, r"commit_lens must be int32 or int64, got torch.int16"),
    "commit_lens other device": (dict(commit_lens=torch.tensor([1, 2], device=META)), ValueError, rf"commit_lens must be on {DEVICE}.*got meta"),
    "commit_lens list": (dict(commit_lens=[2, 3]), TypeError, r"commit_lens must be a torch.Tensor, got list"),
    "commit_lens None": (dict(commit_lens=None), TypeError, r"commit_lens must be a torch.Tensor, got NoneType"),
    "cache_v T differs": (dict(cache_v=torch.randn(5, H, VERIFY_DV)), ValueError, r"cache_v must have T=6 tokens like cache_k, got 5"),
    "cache_k heads": (dict(cache_k=torch.randn(6, H + 1, D)), ValueError, r"cache_k must have 2 heads \(shape\[1\]\), got 3"),
    "cache_v head dim": (dict(cache_v=torch.randn(6, H, D)), ValueError, r"cache_v must have head dim 4 \(shape\[2\]\), got 8"),
    "cache_k int": (dict(cache_k=torch.ones(6, H, D, dtype=torch.int32)), ValueError, r"cache_k must be bfloat16, float16 or float32, got torch.int32"),
    "cache_k 2-D": (dict(cache_k=torch.randn(6, H * D)), ValueError, r"cache_k must be 3-D"),
    "k_scale negative": (dict(k_scale=-1.0), ValueError, r"k_scale must be a positive finite float.*got -1.0"),
    "v_scale shape": (dict(v_scale=torch.ones(3)), ValueError, r"v_scale must have one element \(per tensor\) or shape \[2\].*got shape \(3,\)"),
    "layer outside": (dict(layer_id_override=VERIFY_LAYERS), IndexError, rf"layer_id {VERIFY_LAYERS} is outside this pool's layers"),
    "no layer": (dict(layer_id_override=None), TypeError, r"layer_id_override"),
}  # fmt: skip


def _to_device(value):
    if isinstance(value, torch.Tensor) and value.device.type == "cpu" and DEVICE != "cpu":
        return value.to(DEVICE)
    return value


@fused_runs
@pytest.mark.parametrize("fused", ["always", "never"])
@pytest.mark.parametrize("case", list(VERIFY_BAD))
def test_verify_write_bad_input_raises_naming_the_argument_and_writes_nothing(case, fused):
    change, exc, message = VERIFY_BAD[case]
    pool = _verify_pool(torch.float8_e4m3fn, fused)
    args = _verify_base()
    args.update({name: _to_device(value) for name, value in change.items()})
    before = _buffer_bits(pool)
    with pytest.raises(exc, match=message):
        pool.set_kv_buffer_prefix_valid(**args)
    _assert_buffers_unchanged(pool, before, case)
    assert pool.stats.fused_calls == pool.stats.reference_calls == 0


# --- validate mode ---------------------------------------------------------------------------------

VALIDATE_BAD = {
    "commit_lens negative": ([[1, 2, 3], [4, 5, 6]], [-1, 3], ValueError, r"commit_lens\[0\] must be in 0..3 \(the width of loc_2d\), got -1"),
    "commit_lens beyond width": ([[1, 2, 3], [4, 5, 6]], [2, 4], ValueError, r"commit_lens\[1\] must be in 0..3 .*got 4"),
    "committed slot = rows": ([[1, 2, 3], [4, VERIFY_ROWS, 6]], [3, 2], IndexError, rf"loc_2d\[1, 1\] = {VERIFY_ROWS} is out of range: slots are 0..{VERIFY_ROWS - 1}"),
    "committed slot huge": ([[1, 2, 2**40], [4, 5, 6]], [3, 0], IndexError, rf"loc_2d\[0, 2\] = {2**40} is out of range"),
}  # fmt: skip


@fused_runs
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("fused", ["always", "never"])
@pytest.mark.parametrize("case", list(VALIDATE_BAD))
def test_verify_write_validate_rejects_bad_values_before_writing(case, fused, layout):
    loc, commit, exc, message = VALIDATE_BAD[case]
    pool = _verify_pool(torch.float8_e4m3fn, fused, validate=True)
    args = _verify_base()
    args.update(loc_2d=_loc_layout(loc, layout, torch.int64), commit_lens=torch.tensor(commit, device=DEVICE))
    before = _buffer_bits(pool)
    with pytest.raises(exc, match=message):
        pool.set_kv_buffer_prefix_valid(**args)
    _assert_buffers_unchanged(pool, before, case)


@fused_runs
@pytest.mark.parametrize("fused", ["always", "never"])
def test_verify_write_validate_accepts_uncommitted_out_of_range_and_committed_padding(fused):
    """Out-of-range slots that are not committed are never written, so validate lets them be;
    a committed negative slot is padding."""
    loc = [[1, 2, VERIFY_ROWS + 7], [-1, 5, 2**40]]
    commit = [2, 2]
    pool = _verify_pool(torch.float8_e4m3fn, fused, validate=True)
    args = _verify_base()
    args.update(loc_2d=_loc_layout(loc, "slice", torch.int64), commit_lens=torch.tensor(commit, device=DEVICE))
    pool.set_kv_buffer_prefix_valid(**args)
    ek, ev = _verify_expected(torch.float8_e4m3fn, loc, commit, args["cache_k"], args["cache_v"], 0.5, None)
    fmt = FORMAT_OF[torch.float8_e4m3fn]
    assert_codes_equal(pool.get_key_buffer(VERIFY_LAYER), ek, fmt, "K", nan_equal=False)
    assert_codes_equal(pool.get_value_buffer(VERIFY_LAYER), ev, fmt, "V", nan_equal=False)


@fused_runs
def test_verify_write_validate_checks_scale_tensor_values():
    pool = _verify_pool(torch.float8_e4m3fn, "never", validate=True)
    args = _verify_base()
    args.update(v_scale=torch.tensor([0.0], device=DEVICE))
    before = _buffer_bits(pool)
    with pytest.raises(ValueError, match=r"v_scale must hold positive finite normal float32 values, got 0.0"):
        pool.set_kv_buffer_prefix_valid(**args)
    _assert_buffers_unchanged(pool, before, "zero v_scale")


# On CUDA: real shapes, CUDA graphs, no synchronisation, no allocation, the compiled variants.


def _verify_inputs(bs, width, loc_dtype, commit_dtype, layout, seed):
    """loc_2d [bs, width] in the given layout (distinct in-range slots, some padding, some out of
    range), commit_lens [bs] covering 0, width, negative, beyond width and random values."""
    g = cuda_gen(seed)
    t = bs * width
    loc = torch.randperm(CUDA_ROWS, device="cuda", generator=g)[:t].reshape(bs, width)
    loc[5, 1], loc[6, 0], loc[7, width - 1] = -1, CUDA_ROWS, CUDA_ROWS + 100
    loc[8, 0] = 2**31 - 1 if loc_dtype == torch.int32 else 2**40
    loc = loc.to(loc_dtype)
    if layout == "slice":
        big = torch.full((bs + 3, width + 7), -5, dtype=loc_dtype, device="cuda")
        big[2 : 2 + bs, 3 : 3 + width] = loc
        loc_2d = big[2 : 2 + bs, 3 : 3 + width]
    elif layout == "transposed":
        loc_2d = loc.t().contiguous().t()
    else:
        loc_2d = loc
    assert torch.equal(loc_2d, loc)
    commit = torch.randint(-2, width + 3, (bs,), device="cuda", generator=g)
    commit[:4] = torch.tensor([0, width, -1, width + 5], device="cuda")
    commit[5:9] = width  # the rows holding padding and out-of-range slots are committed
    return loc_2d, commit.to(commit_dtype)


@gpu
@pytest.mark.parametrize("scale_kind", ["none", "float", "tensor", "per_head"])
@pytest.mark.parametrize("cache_dtype", FP8 + [torch.bfloat16], ids=id_of)
def test_verify_write_matches_reference_and_the_plain_write(cache_dtype, scale_kind):
    fused, ref, plain = cuda_pool(cache_dtype), cuda_pool(cache_dtype, "never"), cuda_pool(cache_dtype, "never")
    bs, width = 64, 8
    i32, i64 = torch.int32, torch.int64
    cases = [("contiguous", i64, i64), ("slice", i32, i32), ("transposed", i64, i32), ("slice", i64, i64), ("transposed", i32, i64)]
    for n, (layout, loc_dtype, commit_dtype) in enumerate(cases):
        what = f"{layout} loc {id_of(loc_dtype)} commit {id_of(commit_dtype)}"
        for pool in (fused, ref, plain):
            for buf in pool.k_buffer + pool.v_buffer:
                poison_(buf)
        loc_2d, commit = _verify_inputs(bs, width, loc_dtype, commit_dtype, layout, seed=n)
        qkv = cuda_values((bs * width, 6 * CUDA_H, CUDA_D), torch.bfloat16, seed=100 + n)
        k, v = qkv[:, 4 * CUDA_H : 5 * CUDA_H], qkv[:, 5 * CUDA_H :]  # strided views of a fused projection
        ks, vs = cuda_scale(scale_kind, CUDA_H), cuda_scale(scale_kind, CUDA_H)
        for pool in (fused, ref):
            pool.set_kv_buffer_prefix_valid(None, loc_2d, commit, k, v, ks, vs, layer_id_override=1)
        assert_pools_equal(fused, ref, f"{what}: fused vs reference", (0, 1))
        idx, slots = committed_tokens(loc_2d, commit)
        plain.set_kv_buffer(None, slots, k[idx], v[idx], ks, vs, layer_id_override=1)
        assert_pools_equal(plain, ref, f"{what}: verify write vs set_kv_buffer of the committed tokens", (0, 1))
        written = torch.zeros(CUDA_ROWS, dtype=torch.bool, device="cuda")
        written[slots[(slots >= 0) & (slots < CUDA_ROWS)]] = True
        untouched = bits(fused.get_key_buffer(1))[~written]
        assert (untouched == (0xFF if cache_dtype.itemsize == 1 else -1)).all(), f"{what}: a row not committed changed"
    assert fused.stats.fused_calls == len(cases) and fused.stats.reference_calls == 0


@gpu
def test_verify_writes_alternating_commit_lens_dtypes_on_one_pool():
    """The same loc_2d and inputs with commit_lens int32, then int64, then back: each call is a
    direct launch after the first of its kind, and must launch the variant compiled for its
    commit_lens type (an int64 [3, 1] read as int32 is [3, 0])."""
    pool, ref = cuda_pool(), cuda_pool(fused="never")
    bs, width = 32, 4
    loc_2d = torch.randperm(CUDA_ROWS, device="cuda")[: bs * width].reshape(bs, width)
    g = cuda_gen(8)
    for step, dtype in enumerate([torch.int32, torch.int64, torch.int32, torch.int64, torch.int64, torch.int32]):
        commit = torch.randint(0, width + 1, (bs,), device="cuda", generator=g).to(dtype)
        x = cuda_values((bs * width, CUDA_H, CUDA_D), torch.bfloat16, 200 + step)
        for p in (pool, ref):
            p.set_kv_buffer_prefix_valid(None, loc_2d, commit, x, x, 0.5, 0.5, layer_id_override=0)
        torch.cuda.synchronize()
        assert_pools_equal(pool, ref, f"step {step}: commit_lens {id_of(dtype)}", (0,))


@gpu
def test_verify_write_in_a_cuda_graph_reads_commit_lens_on_replay():
    pool, ref = cuda_pool(), cuda_pool(fused="never")
    bs, width = 16, 4
    static_loc = torch.randperm(CUDA_ROWS, device="cuda")[: bs * width].reshape(bs, width)
    static_commit = torch.zeros(bs, dtype=torch.int32, device="cuda")
    static_k = cuda_values((bs * width, CUDA_H, CUDA_D), torch.bfloat16, 1)
    static_v = cuda_values((bs * width, CUDA_H, CUDA_D), torch.bfloat16, 2)
    k_scale = torch.tensor([0.5], device="cuda")
    # compile the variant outside the capture (commit_lens all 0: writes nothing)
    pool.set_kv_buffer_prefix_valid(None, static_loc, static_commit, static_k, static_v, k_scale, 2.0, layer_id_override=1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pool.set_kv_buffer_prefix_valid(None, static_loc, static_commit, static_k, static_v, k_scale, 2.0, layer_id_override=1)
    g = cuda_gen(3)
    for step in range(5):
        if step == 2:
            static_commit.zero_()  # a replay that commits nothing
        else:
            static_commit.copy_(torch.randint(-1, width + 2, (bs,), device="cuda", generator=g).int())
        static_loc.copy_(torch.randperm(CUDA_ROWS, device="cuda", generator=g)[: bs * width].reshape(bs, width))
        static_loc[0, 0] = -1
        static_k.copy_(cuda_values((bs * width, CUDA_H, CUDA_D), torch.bfloat16, 10 + step))
        static_v.copy_(cuda_values((bs * width, CUDA_H, CUDA_D), torch.bfloat16, 20 + step))
        k_scale.fill_([0.37, 1e-3, 7.0, 3.3, 0.9][step])
        graph.replay()
        ref.set_kv_buffer_prefix_valid(None, static_loc, static_commit, static_k, static_v, k_scale, 2.0, layer_id_override=1)
        torch.cuda.synchronize()
        assert_pools_equal(pool, ref, f"replay {step}", (1,))


def _sync_free(calls, what):
    try:
        with no_sync():
            for _ in range(3):
                for call in calls:
                    call()
    except RuntimeError as exc:
        raise AssertionError(f"{what}: a call synchronised: {exc}") from exc


@gpu
def test_verify_and_observing_writes_neither_synchronise_nor_allocate_on_the_fused_path():
    plain, observing = cuda_pool(), cuda_pool(observe_amax=True)
    t = 96
    x = cuda_values((t, CUDA_H, CUDA_D), torch.bfloat16, 4)
    qkv = cuda_values((t, 6 * CUDA_H, CUDA_D), torch.float16, 5)
    loc_2d = torch.randperm(CUDA_ROWS, device="cuda")[:t].reshape(12, 8)
    loc_t = loc_2d.int().t().contiguous().t()  # int32, transposed layout
    loc_flat, loc_t_flat = loc_2d.reshape(-1), loc_t.reshape(-1)  # made here: a call must not allocate
    commit = torch.randint(0, 9, (12,), device="cuda", dtype=torch.int32)
    commit64 = commit.long()
    k16, v16 = qkv[:, 32:40], qkv[:, 40:48]
    scale = torch.tensor([0.37], device="cuda")
    calls = [
        lambda: plain.set_kv_buffer_prefix_valid(None, loc_2d, commit, x, x, scale, scale, layer_id_override=0),
        lambda: plain.set_kv_buffer_prefix_valid(None, loc_t, commit64, k16, v16, 0.5, None, layer_id_override=1),
        lambda: observing.set_kv_buffer(None, loc_flat, x, x, scale, 0.25, layer_id_override=0),
        lambda: observing.set_kv_buffer(None, loc_t_flat, k16, v16, None, None, layer_id_override=1),
        lambda: observing.set_kv_buffer_prefix_valid(None, loc_2d, commit, x, x, 0.5, scale, layer_id_override=1),
    ]
    for call in calls:
        call()  # first call of each variant outside the measurement
    torch.cuda.synchronize()
    allocs_before = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
    _sync_free(calls, "fused path")
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats().get("allocation.all.allocated", 0) == allocs_before, "a fused write allocated"
    assert plain.stats.reference_calls == observing.stats.reference_calls == 0
    assert plain.stats.fused_calls == 8 and observing.stats.fused_calls == 12


@gpu
def test_verify_and_observing_writes_never_synchronise_on_the_reference_path():
    pool = cuda_pool(fused="never", observe_amax=True)
    x = cuda_values((96, CUDA_H, CUDA_D), torch.bfloat16, 6)
    loc_2d = torch.randperm(CUDA_ROWS, device="cuda")[:96].reshape(12, 8)
    loc_2d[0, 0] = CUDA_ROWS + 3
    commit = torch.randint(-1, 10, (12,), device="cuda", dtype=torch.int32)
    scale = torch.tensor([0.37], device="cuda")
    loc_flat = loc_2d.reshape(-1)
    calls = [
        lambda: pool.set_kv_buffer_prefix_valid(None, loc_2d, commit, x, x, scale, 0.5, layer_id_override=0),
        lambda: pool.set_kv_buffer(None, loc_flat, x, x, 0.25, scale, layer_id_override=1),
    ]
    for call in calls:
        call()
    _sync_free(calls, "reference path")
    assert pool.stats.reference_calls == 8
