"""The fused FP4 write's Triton kernel: K and V rows of a few tokens per program, in one launch:
block amax, exponent, rounding, packing and the scatter of codes and scale bytes. A program reads
its tokens' 16-element blocks whole (vector loads) as the rows of one tile and stores each block's
8 code bytes at once; the NVFP4 kernel shares that layout (``block_pairs``, ``store_blocks``). Bit-identical to
``naive.write_fp4_reference`` (docs/contract.md, "FP4 pools"): the exponent comes from the bits of
``amax / 6`` (integer operations, no ``log2``), the division by 6 is ``div_rn``, and ``x / 2**e`` is
a multiplication by ``2**-e``, which is the same correctly rounded quotient."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def block_pairs(
    x_ptr,  # [T, H, D] input rows, any strides
    t0,  # int64 first token of the program
    T,  # tokens
    sx_t, sx_h, sx_d,  # input strides (elements)
    D: tl.constexpr,  # head dim (a multiple of 16: a block never crosses heads)
    BLOCKS: tl.constexpr,  # H * D // 16
    BLOCKS_P2: tl.constexpr,  # next power of two of BLOCKS
    TOK: tl.constexpr,  # tokens per program
):
    """The 16-element blocks of tokens ``t0 .. t0 + TOK - 1`` as rows of one tile, each block's 16
    elements read at once (contiguous when ``sx_d`` is 1) and split into its 8 pairs: returns the
    token and block of each tile row, whether the row is a real block, and the pairs' first and
    second elements, float32 ``[TOK * BLOCKS_P2, 8]``."""
    r = tl.arange(0, TOK * BLOCKS_P2)
    t = t0 + r // BLOCKS_P2
    b = r % BLOCKS_P2
    live = (b < BLOCKS) & (t < T)
    flat = b[:, None] * 16 + tl.arange(0, 16)[None, :]  # element of the token's row
    x = tl.load(x_ptr + t[:, None] * sx_t + (flat // D) * sx_h + (flat % D) * sx_d, mask=live[:, None], other=0.0)
    x0, x1 = tl.split(tl.reshape(x.to(tl.float32), [TOK * BLOCKS_P2, 8, 2]))
    return t, b, live, x0, x1


@triton.jit
def store_blocks(codes_ptr, scale_ptr, slot, b, ok, packed, scale, codes_row, scale_row):
    """Tile rows ``ok`` to their slots: 8 code bytes at byte ``8 * b`` of the slot's code row, the
    scale byte at byte ``b`` of its scale row."""
    pair = tl.arange(0, 8)[None, :]
    tl.store(codes_ptr + (slot * codes_row + b * 8)[:, None] + pair, packed.to(tl.uint8), mask=ok[:, None])
    tl.store(scale_ptr + slot * scale_row + b, scale.to(tl.uint8), mask=ok)


@triton.jit
def _fp4_part(
    x_ptr, t0, T, sx_t, sx_h, sx_d, loc_ptr, stride_loc, rows, codes_ptr, scale_ptr, codes_row, scale_row,
    D: tl.constexpr, BLOCKS: tl.constexpr, BLOCKS_P2: tl.constexpr, TOK: tl.constexpr,
):  # fmt: skip
    """The FP4 of one part (K or V) of ``TOK`` tokens, to their slots (outside ``0..rows - 1``:
    nothing written)."""
    t, b, live, x0, x1 = block_pairs(x_ptr, t0, T, sx_t, sx_h, sx_d, D, BLOCKS, BLOCKS_P2, TOK)
    slot = tl.load(loc_ptr + t * stride_loc, mask=live, other=-1).to(tl.int64)
    ok = live & (slot >= 0) & (slot < rows)
    a0, a1 = tl.abs(x0), tl.abs(x1)
    # inf and NaN are found by comparison (a NaN fails both), not through max, whose NaN rule varies.
    bad = ((a0 == float("inf")) | (a0 != a0) | (a1 == float("inf")) | (a1 != a1)).to(tl.int32)
    non_finite = tl.max(bad, axis=1) > 0  # [TOK * BLOCKS_P2]
    amax = tl.max(tl.maximum(tl.where(a0 == a0, a0, 0.0), tl.where(a1 == a1, a1, 0.0)), axis=1)
    v = tl.maximum(tl.div_rn(amax, 6.0), 1e-10)
    bits = v.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    e = tl.where(non_finite, 0, e)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)[:, None]  # 2**-e, normal for e in -33..126
    packed = tl.where(non_finite[:, None], 0, _code(x0 * inv) | (_code(x1 * inv) << 4))
    store_blocks(codes_ptr, scale_ptr, slot, b, ok, packed, tl.where(non_finite, 0, e + 127), codes_row, scale_row)


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
    T,  # tokens
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
    TOK: tl.constexpr,  # tokens per program
):
    """``TOK`` tokens per program: rows ``loc[t]`` of the code and scale buffers become the FP4 of K
    and V row ``t``; a slot outside ``0..rows - 1`` (negative: padding) writes nothing."""
    t0 = tl.program_id(0).to(tl.int64) * TOK
    _fp4_part(k_ptr, t0, T, sk_t, sk_h, sk_d, loc_ptr, stride_loc, rows, k_codes_ptr, k_scale_ptr, k_codes_row,
              k_scale_row, D, K_BLOCKS, K_BLOCKS_P2, TOK)  # fmt: skip
    _fp4_part(v_ptr, t0, T, sv_t, sv_h, sv_d, loc_ptr, stride_loc, rows, v_codes_ptr, v_scale_ptr, v_codes_row,
              v_scale_row, DV, V_BLOCKS, V_BLOCKS_P2, TOK)  # fmt: skip
