"""The fused FP4 write's Triton kernel: K and V rows of a few tokens per program, in one launch:
block amax, exponent, rounding, packing and the scatter of codes and scale bytes. A program takes
its tokens' 16-element blocks as the rows of one tile of element pairs (16-bit inputs a pair per
32-bit word, vector loads either way) and stores each block's 8 code bytes at once; the NVFP4
kernel shares that layout (``block_pairs``, ``block_amax``, ``store_blocks``). Bit-identical to
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
    sx_t, sx_h, sx_d,  # input strides (elements; with WORDS, of tokens and heads in 32-bit words)
    D: tl.constexpr,  # head dim (a multiple of 16: a block never crosses heads)
    BLOCKS: tl.constexpr,  # H * D // 16
    BLOCKS_P2: tl.constexpr,  # next power of two of BLOCKS
    TOK: tl.constexpr,  # tokens per program
    WORDS: tl.constexpr,  # 16-bit inputs whose pairs are aligned 32-bit words (sx_d 1, even strides)
):
    """The 16-element blocks of tokens ``t0 .. t0 + TOK - 1`` as rows of one tile, split into their 8
    pairs: returns the token and block of each tile row, whether the row is a real block, and the
    pairs' first and second elements, float32 ``[TOK * BLOCKS_P2, 8]`` (exact: every input type
    widens to float32 exactly). With ``WORDS`` each pair is read as one 32-bit word and its halves
    widened by bit operations; otherwise a block's 16 elements are read at once and split."""
    r = tl.arange(0, TOK * BLOCKS_P2)
    t = t0 + r // BLOCKS_P2
    b = r % BLOCKS_P2
    live = (b < BLOCKS) & (t < T)
    if WORDS:
        head = (b * 16) // D
        word = b[:, None] * 8 + tl.arange(0, 8)[None, :] - (head * (D // 2))[:, None]  # of the pair in its head
        words = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        w = tl.load(words + (t * sx_t + head * sx_h)[:, None] + word, mask=live[:, None], other=0)
        if x_ptr.dtype.element_ty == tl.bfloat16:  # a bfloat16 is the top half of its float32
            x0 = (w << 16).to(tl.float32, bitcast=True)
            x1 = (w & -65536).to(tl.float32, bitcast=True)
        else:
            x0 = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            x1 = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        flat = b[:, None] * 16 + tl.arange(0, 16)[None, :]  # element of the token's row
        x = tl.load(x_ptr + t[:, None] * sx_t + (flat // D) * sx_h + (flat % D) * sx_d, mask=live[:, None], other=0.0)
        x0, x1 = tl.split(tl.reshape(x.to(tl.float32), [TOK * BLOCKS_P2, 8, 2]))
    return t, b, live, x0, x1


@triton.jit
def block_amax(a0, a1):
    """Per tile row: whether its block holds an infinity or a NaN (``a < inf`` fails for both), and
    the largest magnitude, meaningful only where it does not (such a block is stored as zeros)."""
    finite = ((a0 < float("inf")) & (a1 < float("inf"))).to(tl.int32)
    return tl.min(finite, axis=1) == 0, tl.max(tl.maximum(a0, a1), axis=1)


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
    D: tl.constexpr, BLOCKS: tl.constexpr, BLOCKS_P2: tl.constexpr, TOK: tl.constexpr, WORDS: tl.constexpr,
):  # fmt: skip
    """The FP4 of one part (K or V) of ``TOK`` tokens, to their slots (outside ``0..rows - 1``:
    nothing written)."""
    t, b, live, x0, x1 = block_pairs(x_ptr, t0, T, sx_t, sx_h, sx_d, D, BLOCKS, BLOCKS_P2, TOK, WORDS)
    slot = tl.load(loc_ptr + t * stride_loc, mask=live, other=-1).to(tl.int64)
    ok = live & (slot >= 0) & (slot < rows)
    non_finite, amax = block_amax(tl.abs(x0), tl.abs(x1))
    v = tl.maximum(tl.div_rn(amax, 6.0), 1e-10)
    bits = v.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    e = tl.where(non_finite, 0, e)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)[:, None]  # 2**-e, normal for e in -33..126
    packed = tl.where(non_finite[:, None], 0, _code(x0 * inv) | (_code(x1 * inv) << 4))
    store_blocks(codes_ptr, scale_ptr, slot, b, ok, packed, tl.where(non_finite, 0, e + 127), codes_row, scale_row)


@triton.jit
def _code(s):
    """e2m1 code of a scaled value (``|s|`` at most 6 up to rounding): the bounds it reaches, ties
    away from zero; 0x8 iff s < 0. From 1 up the codes are the float's exponent and top mantissa bit
    after adding half of that bit (2 + 2 * exponent + bit); below 1 two comparisons."""
    m = tl.abs(s)
    bits = m.to(tl.int32, bitcast=True)
    upper = tl.minimum(((bits + 0x200000) >> 22) - 252, 7)
    mag = tl.where(m >= 1.0, upper, (m >= 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32))
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
    K_WORDS: tl.constexpr,  # K read a pair per 32-bit word (block_pairs)
    V_WORDS: tl.constexpr,
):
    """``TOK`` tokens per program: rows ``loc[t]`` of the code and scale buffers become the FP4 of K
    and V row ``t``; a slot outside ``0..rows - 1`` (negative: padding) writes nothing."""
    t0 = tl.program_id(0).to(tl.int64) * TOK
    _fp4_part(k_ptr, t0, T, sk_t, sk_h, sk_d, loc_ptr, stride_loc, rows, k_codes_ptr, k_scale_ptr, k_codes_row,
              k_scale_row, D, K_BLOCKS, K_BLOCKS_P2, TOK, K_WORDS)  # fmt: skip
    _fp4_part(v_ptr, t0, T, sv_t, sv_h, sv_d, loc_ptr, stride_loc, rows, v_codes_ptr, v_scale_ptr, v_codes_row,
              v_scale_row, DV, V_BLOCKS, V_BLOCKS_P2, TOK, V_WORDS)  # fmt: skip
