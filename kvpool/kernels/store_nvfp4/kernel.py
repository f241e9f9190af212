"""The fused NVFP4 write's Triton kernel: K and V rows of a few tokens per program, in one launch
(the FP4 kernel's tile of 16-element blocks):
division by the layer's global scale, block amax, e4m3 block scale, e2m1 rounding, packing and the
scatter of codes and scale bytes. Bit-identical to ``naive.write_nvfp4_reference``
(docs/contract.md, "NVFP4"): every division is ``div_rn``, and the e4m3 conversions are integer
operations (Triton's interpreter converts to FP8 wrongly, and not every GPU converts natively)."""

from __future__ import annotations

import triton
import triton.language as tl

from kvpool.kernels.store_fp4.kernel import block_amax, block_pairs, store_blocks


@triton.jit
def _e4m3_code(s):
    """Non-negative float32 (or +inf) to its e4m3fn code: round to nearest even, saturating at 448."""
    a = tl.minimum(s, 448.0)
    bits = a.to(tl.int32, bitcast=True)
    # Normal range: round the 23-bit mantissa to 3 bits, ties to even (a carry moves into the
    # exponent, the rounding up to the next binade), then rebias the exponent from 127 to 7.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal range (below 2**-6): the code is a / 2**-9 rounded to an integer; adding 2**23 makes
    # the float32 adder round it, ties to even. 8 is the smallest normal's code, so the ranges meet.
    sub = (a * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    return tl.where(a < 0.015625, sub, normal)


@triton.jit
def _e4m3_value(code):
    """An e4m3fn code in 0..0x7E as its float32 value (exact)."""
    e = code >> 3
    m = code & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    return tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)


@triton.jit
def _e2m1_code(q, y):
    """e2m1 code of a scaled value ``q``: round to nearest even, saturating at 6; 0x8 from the sign
    bit of ``y`` (so -0.0 keeps it). From 1 up the codes are the float's exponent and top mantissa
    bit rounded to nearest even (2 + 2 * exponent + bit); below 1 two comparisons."""
    m = tl.abs(q)
    bits = m.to(tl.int32, bitcast=True)
    upper = tl.minimum(((bits + 0x1FFFFF + ((bits >> 22) & 1)) >> 22) - 252, 7)
    mag = tl.where(m >= 1.0, upper, (m > 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32))
    return mag | ((y.to(tl.int32, bitcast=True) < 0).to(tl.int32) << 3)


@triton.jit
def _nvfp4_part(
    x_ptr, t0, T, sx_t, sx_h, sx_d, g_ptr, loc_ptr, stride_loc, rows, codes_ptr, scale_ptr, codes_row, scale_row,
    D: tl.constexpr, BLOCKS: tl.constexpr, BLOCKS_P2: tl.constexpr, TOK: tl.constexpr, WORDS: tl.constexpr,
):  # fmt: skip
    """The NVFP4 of one part (K or V) of ``TOK`` tokens, divided by the part's global scale
    ``g_ptr[0]``, to their slots (outside ``0..rows - 1``: nothing written)."""
    t, b, live, x0, x1 = block_pairs(x_ptr, t0, T, sx_t, sx_h, sx_d, D, BLOCKS, BLOCKS_P2, TOK, WORDS)
    slot = tl.load(loc_ptr + t * stride_loc, mask=live, other=-1).to(tl.int64)
    ok = live & (slot >= 0) & (slot < rows)
    g = tl.load(g_ptr)
    y0, y1 = tl.div_rn(x0, g), tl.div_rn(x1, g)
    non_finite, amax = block_amax(tl.abs(y0), tl.abs(y1))
    scale = tl.where(non_finite, 0, _e4m3_code(tl.div_rn(amax, 6.0)))
    has_scale = (scale != 0)[:, None]
    block = tl.where(has_scale, _e4m3_value(scale)[:, None], 1.0)
    q0 = tl.where(has_scale, tl.div_rn(y0, block), 0.0)
    q1 = tl.where(has_scale, tl.div_rn(y1, block), 0.0)
    packed = tl.where(non_finite[:, None], 0, _e2m1_code(q0, y0) | (_e2m1_code(q1, y1) << 4))
    store_blocks(codes_ptr, scale_ptr, slot, b, ok, packed, scale, codes_row, scale_row)


@triton.jit
def store_nvfp4_kv(
    k_ptr,  # [T, H, D] K rows, bf16/fp16/fp32, any strides
    v_ptr,  # [T, H, Dv] V rows
    loc_ptr,  # [T] int32/int64 slots
    k_codes_ptr,  # [rows, H, D // 2] uint8, contiguous rows
    v_codes_ptr,  # [rows, H, Dv // 2] uint8
    k_scale_ptr,  # [rows, H, D // 16] uint8 (e4m3fn bits)
    v_scale_ptr,  # [rows, H, Dv // 16] uint8
    k_global_ptr,  # [1] float32, the layer's K global scale
    v_global_ptr,  # [1] float32, the layer's V global scale
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
    K_WORDS: tl.constexpr,  # K read a pair per 32-bit word (block_pairs)
    V_WORDS: tl.constexpr,
):
    """``TOK`` tokens per program: rows ``loc[t]`` of the code and scale buffers become the NVFP4 of
    K and V row ``t``; a slot outside ``0..rows - 1`` (negative: padding) writes nothing."""
    t0 = tl.program_id(0).to(tl.int64) * TOK
    _nvfp4_part(k_ptr, t0, T, sk_t, sk_h, sk_d, k_global_ptr, loc_ptr, stride_loc, rows, k_codes_ptr, k_scale_ptr,
                k_codes_row, k_scale_row, D, K_BLOCKS, K_BLOCKS_P2, TOK, K_WORDS)  # fmt: skip
    _nvfp4_part(v_ptr, t0, T, sv_t, sv_h, sv_d, v_global_ptr, loc_ptr, stride_loc, rows, v_codes_ptr, v_scale_ptr,
                v_codes_row, v_scale_row, DV, V_BLOCKS, V_BLOCKS_P2, TOK, V_WORDS)  # fmt: skip
