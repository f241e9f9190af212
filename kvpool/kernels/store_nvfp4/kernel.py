"""The fused NVFP4 write's Triton kernel: K and V in one launch, in the FP4 kernel's programs of
16-element blocks: division by the layer's global scale, block amax, e4m3 block scale, e2m1
rounding, packing and the scatter of codes and scale bytes. Bit-identical to
``naive.write_nvfp4_reference`` (docs/contract.md, "NVFP4"): a division is ``div_rn`` or, by a power
of two, the multiplication by its reciprocal (the same quotient); the e2m1 codes of ``y / S`` come
without dividing by the block scale ``S``, by comparing ``y`` with the scaled bounds or, for 16-bit
inputs under a power-of-two global scale, from ``y`` times ``S``'s reciprocal (``_nvfp4_part``); and
the e4m3 conversions are integer operations (Triton's interpreter converts to FP8 wrongly, and not
every GPU converts natively)."""

from __future__ import annotations

import triton
import triton.language as tl

from kvpool.kernels.store_fp4.kernel import block_amax, block_pairs, block_slots, store_blocks


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
def _power_of_two(g):
    """Whether the positive normal ``g`` is a power of two up to 2**126 (its reciprocal normal)."""
    g_bits = g.to(tl.int32, bitcast=True)
    return ((g_bits & 0x7FFFFF) == 0) & (g_bits <= 0x7E800000)


@triton.jit
def _divided(x0, x1, g):
    """``x / g`` for each element, correctly rounded: a multiplication by ``1 / g`` (exact) where
    ``g`` is a power of two up to 2**126, else ``div_rn``."""
    if _power_of_two(g):
        r = tl.div_rn(1.0, g)
        y0, y1 = x0 * r, x1 * r
    else:
        y0, y1 = tl.div_rn(x0, g), tl.div_rn(x1, g)
    return y0, y1


@triton.jit
def _e2m1_magnitude_near(q):
    """The e2m1 magnitude code (round to nearest even, saturating at 6) of ``float32(y / S)`` from
    ``q = float32(|y| * float32(1 / S))``, where ``y`` has at most 11 significant bits and ``S`` at
    most 4: ``y / S`` is a bound exactly or at least ``2**-12`` of it away, and ``q`` is within
    ``2**-22.9`` of ``y / S``, so ``q`` rounded to 21 significant bits is the bound exactly or on
    ``y / S``'s side of it. From there the codes are the float's exponent and top mantissa bit
    rounded to nearest even, of ``q`` from 1 up and of ``q / 2 + 0.5`` below 1 (exact there from
    2**-3 up, below 0.5625 under it), clamped at 6: ``2 + 2 * exponent + bit``, plus 252."""
    bits = ((q.to(tl.int32, bitcast=True) + 4) & -8)
    m = bits.to(tl.float32, bitcast=True)
    z = tl.minimum(tl.maximum(m, m * 0.5 + 0.5), 6.0).to(tl.int32, bitcast=True)
    return (z + 0x1FFFFF + ((z >> 22) & 1)) >> 22


@triton.jit
def _sign_bit(y):
    """y's sign bit (0 or 1, -0.0 included), as the high word of twice its bits."""
    return tl.umulhi(y.to(tl.uint32, bitcast=True), 2).to(tl.int32)


@triton.jit
def _bound(bs, inclusive: tl.constexpr):
    """A bound times the block scale (exact: at most 7 significant bits) as the least magnitude
    that reaches it: itself if reaching it takes ``>=``, the next float up if it takes ``>``."""
    if inclusive:
        return bs
    else:
        return (bs.to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_magnitudes(y0, y1, block, has_scale):
    """Magnitude codes of ``y / block`` rounded to float32, without the division: ``float32(y / S)
    >= c`` exactly when ``y >= c * S`` for each bound ``c`` and block scale ``S`` (both products and
    the rounding of the quotient respect the order, since ``c * S`` has at most 7 significant bits
    and ``y / S`` at its neighbours is a bound's rounding distance away), and ``> c`` exactly when
    ``y > c * S``. The code is then found among the 7 scaled bounds in three comparisons. Blocks
    without a scale get bounds of infinity (code 0)."""
    inf = float("inf")
    s = tl.where(has_scale, block, inf)
    t1, t2, t3, t4 = _bound(s * 0.25, False), _bound(s * 0.75, True), _bound(s * 1.25, False), _bound(s * 1.75, True)
    t5, t6, t7 = _bound(s * 2.5, False), _bound(s * 3.5, True), _bound(s * 5.0, False)
    t1, t2, t3, t4, t5, t6, t7 = t1[:, None], t2[:, None], t3[:, None], t4[:, None], t5[:, None], t6[:, None], t7[:, None]
    return _search(tl.abs(y0), t1, t2, t3, t4, t5, t6, t7), _search(tl.abs(y1), t1, t2, t3, t4, t5, t6, t7)


@triton.jit
def _search(a, t1, t2, t3, t4, t5, t6, t7):
    """How many of the increasing bounds ``t1 .. t7`` ``a`` reaches (``>=``), in three comparisons."""
    hi = a >= t4
    mid = a >= tl.where(hi, t6, t2)
    lo = a >= tl.where(hi, tl.where(mid, t7, t5), tl.where(mid, t3, t1))
    return hi.to(tl.int32) * 4 + mid.to(tl.int32) * 2 + lo.to(tl.int32)


@triton.jit
def _nvfp4_part(
    x_ptr, r0, T, sx_t, sx_h, sx_d, g_ptr, loc_ptr, stride_loc, rows, codes_ptr, scale_ptr, codes_row, scale_row,
    D: tl.constexpr, BLOCKS: tl.constexpr, ROWS: tl.constexpr, WORDS: tl.constexpr, CODE16: tl.constexpr,
):  # fmt: skip
    """The NVFP4 of one part's blocks ``r0 .. r0 + ROWS - 1``, divided by the part's global scale
    ``g_ptr[0]``, to their tokens' slots (outside ``0..rows - 1``: nothing written)."""
    t, b, live, x0, x1 = block_pairs(x_ptr, r0, T, sx_t, sx_h, sx_d, D, BLOCKS, ROWS, WORDS)
    slot, ok = block_slots(t, live, loc_ptr, stride_loc, rows)
    g = tl.load(g_ptr)
    y0, y1 = _divided(x0, x1, g)
    non_finite, amax = block_amax(y0, y1)
    scale = tl.where(non_finite, 0, _e4m3_code(tl.div_rn(amax, 6.0)))
    has_scale = scale != 0
    if CODE16 and _power_of_two(g):  # y has the input's significant bits: at most 11
        r = tl.where(has_scale, tl.div_rn(1.0, tl.where(has_scale, _e4m3_value(scale), 1.0)), 0.0)[:, None]
        codes = _e2m1_magnitude_near(tl.abs(y0) * r) + _e2m1_magnitude_near(tl.abs(y1) * r) * 16 - 252 * 17
    else:
        m0, m1 = _e2m1_magnitudes(y0, y1, _e4m3_value(scale), has_scale)
        codes = m0 + m1 * 16
    codes = codes + _sign_bit(y0) * 8 + _sign_bit(y1) * 128
    packed = tl.where(non_finite[:, None], 0, codes)
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
    CODE16: tl.constexpr,  # the inputs are 16-bit (the block scale's reciprocal under a power-of-two g)
):
    """Programs ``0 .. k_programs - 1`` write K's blocks, the others V's, ``ROWS`` blocks each: rows
    ``loc[t]`` of the code and scale buffers become the NVFP4 of K and V row ``t``; a slot outside
    ``0..rows - 1`` (negative: padding) writes nothing."""
    pid = tl.program_id(0)
    if pid < k_programs:
        _nvfp4_part(k_ptr, pid.to(tl.int64) * ROWS, T, sk_t, sk_h, sk_d, k_global_ptr, loc_ptr, stride_loc, rows,
                    k_codes_ptr, k_scale_ptr, k_codes_row, k_scale_row, D, K_BLOCKS, ROWS, K_WORDS, CODE16)  # fmt: skip
    else:
        _nvfp4_part(v_ptr, (pid - k_programs).to(tl.int64) * ROWS, T, sv_t, sv_h, sv_d, v_global_ptr, loc_ptr,
                    stride_loc, rows, v_codes_ptr, v_scale_ptr, v_codes_row, v_scale_row, DV, V_BLOCKS, ROWS, V_WORDS,
                    CODE16)  # fmt: skip
