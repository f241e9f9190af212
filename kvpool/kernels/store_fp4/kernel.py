"""The fused FP4 write's Triton kernel: K and V in one launch, each program taking ``ROWS``
consecutive 16-element blocks of one part (K or V), the part's ``[T, H * D // 16]`` blocks counted
row after row (so no block is padding, whatever the row's block count), with block amax, exponent,
rounding, packing and the scatter of codes and scale bytes. A program reads its blocks as the rows of
one tile of element pairs (16-bit inputs a pair per 32-bit word, vector loads either way) and stores
each block's 8 code bytes at once; the NVFP4 kernel shares that layout (``block_pairs``,
``block_amax``, ``block_slots``, ``store_blocks``). Bit-identical to ``naive.write_fp4_reference``
(docs/contract.md, "FP4 pools"): the exponent comes from the bits of ``amax / 6`` (integer
operations, no ``log2``; ``div_rn`` for float32 inputs, none needed for 16-bit ones, whose few
significant bits keep the quotient's rounding off every power of two), ``x / 2**e`` is a
multiplication by ``2**-e``, which is the same correctly rounded quotient, and the codes come from
the scaled values' bits (for 16-bit inputs by multiply-adds, see ``pack_codes``)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def block_pairs(
    x_ptr,  # [T, H, D] input rows, any strides
    r0,  # int64 first block of the program, of the part's T * BLOCKS blocks
    T,  # tokens
    sx_t, sx_h, sx_d,  # input strides (elements; with WORDS, of tokens and heads in 32-bit words)
    D: tl.constexpr,  # head dim (a multiple of 16: a block never crosses heads)
    BLOCKS: tl.constexpr,  # H * D // 16, blocks of a token's row
    ROWS: tl.constexpr,  # blocks per program (a power of two)
    WORDS: tl.constexpr,  # 16-bit inputs whose pairs are aligned 32-bit words (sx_d 1, even strides)
):
    """Blocks ``r0 .. r0 + ROWS - 1`` as the rows of one tile, split into their 8 pairs: returns the
    token and block (of its row) of each tile row, whether the row is a real block (``t < T``), and
    the pairs' first and second elements, float32 ``[ROWS, 8]`` (exact: every input type widens to
    float32 exactly). Rows past the last block read as 1.0 (any finite nonzero value would do: the
    NVFP4 kernel divides by what it reads, and a zero dividend takes the divider's slow path). With
    ``WORDS`` each pair is read as one 32-bit word and its halves widened by bit operations;
    otherwise a block's 16 elements are read at once and split."""
    t0 = r0 // BLOCKS
    q = (r0 - t0 * BLOCKS).to(tl.int32) + tl.arange(0, ROWS)  # block of token t0's row onwards
    t = t0 + q // BLOCKS
    b = q % BLOCKS
    live = t < T
    head = b // (D // 16)
    if WORDS:
        word = (b - head * (D // 16)) * 8  # first word of the block in its head
        words = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        ptr = words + (t * sx_t + head * sx_h + word)[:, None] + tl.arange(0, 8)[None, :]
        if x_ptr.dtype.element_ty == tl.bfloat16:  # a bfloat16 is the top half of its float32
            w = tl.load(ptr, mask=live[:, None], other=0x3F803F80)
            x0 = (w << 16).to(tl.float32, bitcast=True)
            x1 = (w & -65536).to(tl.float32, bitcast=True)
        else:
            w = tl.load(ptr, mask=live[:, None], other=0x3C003C00)
            x0 = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            x1 = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        col = (b - head * (D // 16))[:, None] * 16 + tl.arange(0, 16)[None, :]  # element of the head
        x = tl.load(x_ptr + (t * sx_t + head * sx_h)[:, None] + col * sx_d, mask=live[:, None], other=1.0)
        x0, x1 = tl.split(tl.reshape(x.to(tl.float32), [ROWS, 8, 2]))
    return t, b, live, x0, x1


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def block_amax(x0, x1):
    """Per tile row: whether its block holds an infinity or a NaN, and the largest magnitude,
    meaningful only where it does not (such a block is stored as zeros). The maximum keeps NaN, so
    a block's is below infinity exactly when the block is finite."""
    amax = tl.reduce(tl.maximum(tl.abs(x0), tl.abs(x1), propagate_nan=tl.PropagateNan.ALL), 1, _max_nan)
    return ~(amax < float("inf")), amax


@triton.jit
def store_blocks(codes_ptr, scale_ptr, slot, b, ok, packed, scale, codes_row, scale_row):
    """Tile rows ``ok`` to their slots: 8 code bytes at byte ``8 * b`` of the slot's code row, the
    scale byte at byte ``b`` of its scale row."""
    pair = tl.arange(0, 8)[None, :]
    tl.store(codes_ptr + (slot * codes_row + b * 8)[:, None] + pair, packed.to(tl.uint8), mask=ok[:, None])
    tl.store(scale_ptr + slot * scale_row + b, scale.to(tl.uint8), mask=ok)


@triton.jit
def block_slots(t, live, loc_ptr, stride_loc, rows):
    """Each tile row's slot, and whether the row is written (a real block at a slot in
    ``0..rows - 1``)."""
    slot = tl.load(loc_ptr + t * stride_loc, mask=live, other=-1).to(tl.int64)
    return slot, live & (slot >= 0) & (slot < rows)


@triton.jit
def _code(s):
    """e2m1 code of a scaled value (``|s|`` below 7): the bounds it reaches, ties away from zero;
    0x8 iff s < 0. From 1 up the codes are the float's exponent and top mantissa bit after adding
    half of that bit (2 + 2 * exponent + bit); below 1 two comparisons."""
    m = tl.abs(s)
    bits = m.to(tl.int32, bitcast=True)
    upper = tl.minimum(((bits + 0x200000) >> 22) - 252, 7)
    mag = tl.where(m >= 1.0, upper, (m >= 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32))
    return mag | ((s < 0).to(tl.int32) << 3)


@triton.jit
def _magnitude16_bits(s):
    """For a scaled 16-bit input (``|s|`` below 7, at most 11 significant bits), the bits of a float
    whose exponent and top mantissa bit after adding half of that bit give its magnitude code as
    ``2 + 2 * exponent + bit`` (plus 252 in the biased exponent): ``|s|`` itself from 1 up, and
    below 1 ``|s| / 2 + 0.5``, which lies in ``[0.5, 1)`` with its two top mantissa bits ``|s|``'s
    two top fraction bits (exact for such values from 2**-13 up, and below 0.625 under it)."""
    m = tl.abs(s)
    return tl.maximum(m, m * 0.5 + 0.5).to(tl.int32, bitcast=True)


@triton.jit
def _negative(s):
    """1 where ``s < 0`` (not for -0.0), else 0, with multiply-adds only: ``2 * s + 2**-149`` is
    negative exactly where ``s`` is (both zeros give 2**-149, the least negative ``s``, -2**-149,
    gives -2**-149), and its sign bit is the high word of twice its bits."""
    t = s * 2.0 + 1.401298464324817e-45
    return tl.umulhi(t.to(tl.uint32, bitcast=True), 2).to(tl.int32)


@triton.jit
def pack_codes(s0, s1, CODE16: tl.constexpr):
    """The code byte of scaled element pairs: ``s0``'s code in the low nibble, ``s1``'s in the high
    one. For float32 inputs by ``_code``; for 16-bit ones (``CODE16``) from ``_magnitude16_bits``
    plus half the top mantissa bit, shifted right by 22 (the high word of it times 1024: the
    magnitude plus 252), and ``_negative``: multiply-adds, which leave the integer pipe to the rest
    of the kernel."""
    if CODE16:
        m0 = tl.umulhi((_magnitude16_bits(s0) + 0x200000).to(tl.uint32, bitcast=True), 1024).to(tl.int32)
        m1 = tl.umulhi((_magnitude16_bits(s1) + 0x200000).to(tl.uint32, bitcast=True), 1024).to(tl.int32)
        return m0 + m1 * 16 + _negative(s0) * 8 + _negative(s1) * 128 - 252 * 17
    else:
        return _code(s0) | (_code(s1) << 4)


@triton.jit
def block_exponent(amax, CODE16: tl.constexpr):
    """``ceil(log2(max(float32(amax / 6), float32(1e-10))))`` of finite block maxima, exactly. In
    general from the bits of the correctly rounded quotient (its exponent, plus one unless it is a
    power of two). For 16-bit inputs (``CODE16``: at most 11 significant bits) the quotient's
    rounding never crosses a power of two, so the exponent is that of ``amax / 6`` itself: with
    ``amax = M * 2**E`` (``M`` in ``[1, 2)``), ``E - 2``, plus one where ``M > 1.5`` (a carry into
    the exponent bits); at least -33, the exponent of ``float32(1e-10)``."""
    if CODE16:
        return tl.maximum(((amax.to(tl.int32, bitcast=True) + 0x3FFFFF) >> 23) - 129, -33)
    else:
        bits = tl.maximum(tl.div_rn(amax, 6.0), 1e-10).to(tl.int32, bitcast=True)
        return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def _fp4_part(
    x_ptr, r0, T, sx_t, sx_h, sx_d, loc_ptr, stride_loc, rows, codes_ptr, scale_ptr, codes_row, scale_row,
    D: tl.constexpr, BLOCKS: tl.constexpr, ROWS: tl.constexpr, WORDS: tl.constexpr, CODE16: tl.constexpr,
):  # fmt: skip
    """The FP4 of one part's blocks ``r0 .. r0 + ROWS - 1``, to their tokens' slots (outside
    ``0..rows - 1``: nothing written)."""
    t, b, live, x0, x1 = block_pairs(x_ptr, r0, T, sx_t, sx_h, sx_d, D, BLOCKS, ROWS, WORDS)
    slot, ok = block_slots(t, live, loc_ptr, stride_loc, rows)
    non_finite, amax = block_amax(x0, x1)
    e = tl.where(non_finite, 0, block_exponent(amax, CODE16))
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)[:, None]  # 2**-e, normal for e in -33..126
    packed = tl.where(non_finite[:, None], 0, pack_codes(x0 * inv, x1 * inv, CODE16))
    store_blocks(codes_ptr, scale_ptr, slot, b, ok, packed, tl.where(non_finite, 0, e + 127), codes_row, scale_row)


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
    k_programs,  # programs of K (the first ones); the rest take V
    stride_loc,  # loc's stride (elements)
    sk_t, sk_h, sk_d,  # K input strides
    sv_t, sv_h, sv_d,  # V input strides
    k_codes_row, v_codes_row, k_scale_row, v_scale_row,  # buffer row strides (bytes)
    D: tl.constexpr,
    DV: tl.constexpr,
    K_BLOCKS: tl.constexpr,
    V_BLOCKS: tl.constexpr,
    ROWS: tl.constexpr,  # blocks per program
    K_WORDS: tl.constexpr,  # K read a pair per 32-bit word (block_pairs)
    V_WORDS: tl.constexpr,
    CODE16: tl.constexpr,  # the inputs are 16-bit (pack_codes, block_exponent)
):
    """Programs ``0 .. k_programs - 1`` write K's blocks, the others V's, ``ROWS`` blocks each: rows
    ``loc[t]`` of the code and scale buffers become the FP4 of K and V row ``t``; a slot outside
    ``0..rows - 1`` (negative: padding) writes nothing."""
    pid = tl.program_id(0)
    if pid < k_programs:
        _fp4_part(k_ptr, pid.to(tl.int64) * ROWS, T, sk_t, sk_h, sk_d, loc_ptr, stride_loc, rows, k_codes_ptr,
                  k_scale_ptr, k_codes_row, k_scale_row, D, K_BLOCKS, ROWS, K_WORDS, CODE16)  # fmt: skip
    else:
        _fp4_part(v_ptr, (pid - k_programs).to(tl.int64) * ROWS, T, sv_t, sv_h, sv_d, loc_ptr, stride_loc, rows,
                  v_codes_ptr, v_scale_ptr, v_codes_row, v_scale_row, DV, V_BLOCKS, ROWS, V_WORDS, CODE16)  # fmt: skip
