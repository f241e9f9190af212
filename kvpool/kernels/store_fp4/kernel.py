"""The fused FP4 write's Triton kernel: for one token per program, K and V rows in one launch,
block amax, exponent, rounding, packing and the scatter of codes and scale bytes. Bit-identical to
``naive.write_fp4_reference`` (docs/contract.md, "FP4 pools"): the exponent comes from the bits of
``amax / 6`` (integer operations, no ``log2``), the division by 6 is ``div_rn``, and ``x / 2**e`` is
a multiplication by ``2**-e``, which is the same correctly rounded quotient."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _fp4_row(
    x_ptr,  # [T, H, D] input rows, any strides
    t,  # int64 token index
    sx_t, sx_h, sx_d,  # input strides (elements)
    codes_ptr,  # uint8 row of the packed buffer [rows, H, D // 2] at the slot
    scale_ptr,  # uint8 row of the scale buffer [rows, H * D // 16] at the slot
    D: tl.constexpr,  # head dim
    BLOCKS: tl.constexpr,  # H * D // 16
    BLOCKS_P2: tl.constexpr,  # next power of two of BLOCKS
):
    b = tl.arange(0, BLOCKS_P2)[:, None]  # block of the row
    i = tl.arange(0, 8)[None, :]  # pair within the block
    live = b < BLOCKS
    even = b * 16 + 2 * i  # flat index of the pair's first element in the row
    odd = even + 1
    base = x_ptr + t * sx_t
    x0 = tl.load(base + (even // D) * sx_h + (even % D) * sx_d, mask=live, other=0.0).to(tl.float32)
    x1 = tl.load(base + (odd // D) * sx_h + (odd % D) * sx_d, mask=live, other=0.0).to(tl.float32)
    a0, a1 = tl.abs(x0), tl.abs(x1)
    # inf and NaN are found by comparison (a NaN fails both), not through max, whose NaN rule varies.
    bad = ((a0 == float("inf")) | (a0 != a0) | (a1 == float("inf")) | (a1 != a1)).to(tl.int32)
    non_finite = tl.max(bad, axis=1) > 0  # [BLOCKS_P2]
    amax = tl.max(tl.maximum(tl.where(a0 == a0, a0, 0.0), tl.where(a1 == a1, a1, 0.0)), axis=1)
    v = tl.maximum(tl.div_rn(amax, 6.0), 1e-10)
    bits = v.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    e = tl.where(non_finite, 0, e)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)[:, None]  # 2**-e, normal for e in -33..126
    s0, s1 = x0 * inv, x1 * inv
    c0 = _code(s0)
    c1 = _code(s1)
    packed = tl.where(non_finite[:, None], 0, c0 | (c1 << 4))
    tl.store(codes_ptr + even // 2, packed.to(tl.uint8), mask=live)
    scale = tl.where(non_finite, 0, e + 127)
    blocks = tl.arange(0, BLOCKS_P2)
    tl.store(scale_ptr + blocks, scale.to(tl.uint8), mask=blocks < BLOCKS)


@triton.jit
def _code(s):
    """e2m1 code of a scaled value: the bounds it reaches, ties away from zero; 0x8 iff s < 0."""
    m = tl.abs(s)
    mag = (
        (m >= 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32) + (m >= 1.25).to(tl.int32) + (m >= 1.75).to(tl.int32)
        + (m >= 2.5).to(tl.int32) + (m >= 3.5).to(tl.int32) + (m >= 5.0).to(tl.int32)
    )  # fmt: skip
    return mag | ((s < 0).to(tl.int32) << 3)


@triton.jit
def store_fp4_kv(
    k_ptr,  # [T, H, D] K rows, bf16/fp16/fp32, any strides
    v_ptr,  # [T, H, Dv] V rows
    loc_ptr,  # [T] int32/int64 slots
    k_codes_ptr,  # [rows, H, D // 2] uint8, contiguous rows
    v_codes_ptr,  # [rows, H, Dv // 2] uint8
    k_scale_ptr,  # [rows, H * D // 16] uint8
    v_scale_ptr,  # [rows, H * Dv // 16] uint8
    rows,  # slots in the buffers
    stride_loc,  # loc's stride (elements)
    sk_t, sk_h, sk_d,  # K input strides
    sv_t, sv_h, sv_d,  # V input strides
    k_codes_row, v_codes_row, k_scale_row, v_scale_row,  # buffer row strides (bytes)
    D: tl.constexpr,
    DV: tl.constexpr,
    K_BLOCKS: tl.constexpr,
    V_BLOCKS: tl.constexpr,
    K_BLOCKS_P2: tl.constexpr,
    V_BLOCKS_P2: tl.constexpr,
):
    """One program per token: rows ``loc[t]`` of the code and scale buffers become the FP4 of K and
    V row ``t``; a slot outside ``0..rows - 1`` (negative: padding) writes nothing."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(loc_ptr + t * stride_loc).to(tl.int64)
    if (slot >= 0) & (slot < rows):
        _fp4_row(k_ptr, t, sk_t, sk_h, sk_d, k_codes_ptr + slot * k_codes_row, k_scale_ptr + slot * k_scale_row,
                 D, K_BLOCKS, K_BLOCKS_P2)  # fmt: skip
        _fp4_row(v_ptr, t, sv_t, sv_h, sv_d, v_codes_ptr + slot * v_codes_row, v_scale_ptr + slot * v_scale_row,
                 DV, V_BLOCKS, V_BLOCKS_P2)  # fmt: skip
