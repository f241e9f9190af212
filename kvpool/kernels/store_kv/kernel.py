"""The fused K/V cache write, as Triton device code only (plan: ``plan.py``; the writer
that launches it: ``writer.py``; what it writes: docs/contract.md, "The write").

One launch writes K and V for every token: load a tile of rows, divide by the scale in correctly
rounded float32, saturate, round to nearest even (natively, or with integer operations: ``SOFT_CAST``,
see ``_convert``), and scatter each row to its slot. Grid: axis 0 walks token blocks, axis 1 the
blocks of K and then of V; with ``JOINED`` one program loads a token block's K and V rows, then
stores both. With ``PREFIX`` it is the verify write: token ``i * width + j`` is written only when
``j < commit_lens[i]``. With ``MAPPED`` each loaded slot is translated through a slot map first
(a sliding-window pool's full-to-SWA mapping), in the same launch. Per-element work is kept small: large writes are otherwise instruction-bound.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpool.kernels import formats

# Output and scale kinds: the compile-time constants the launcher passes (defined in formats.py).
OUT_E4M3 = tl.constexpr(formats.OUT_KIND[torch.float8_e4m3fn])
OUT_E5M2 = tl.constexpr(formats.OUT_KIND[torch.float8_e5m2])
OUT_BF16 = tl.constexpr(formats.OUT_KIND[torch.bfloat16])
OUT_FP16 = tl.constexpr(formats.OUT_KIND[torch.float16])
OUT_FP32 = tl.constexpr(formats.OUT_KIND[torch.float32])
OUT_E4M3FNUZ = tl.constexpr(formats.OUT_KIND[torch.float8_e4m3fnuz])
OUT_E5M2FNUZ = tl.constexpr(formats.OUT_KIND[torch.float8_e5m2fnuz])
SCALE_NONE = tl.constexpr(formats.SCALE_NONE)
SCALE_VALUE = tl.constexpr(formats.SCALE_VALUE)
SCALE_TENSOR = tl.constexpr(formats.SCALE_TENSOR)
SCALE_HEAD = tl.constexpr(formats.SCALE_HEAD)
FP8_NAN = tl.constexpr(formats.NAN_BITS[torch.float8_e4m3fn])
assert formats.NAN_BITS[torch.float8_e5m2] == formats.NAN_BITS[torch.float8_e4m3fn]
FNUZ_NAN = tl.constexpr(formats.NAN_BITS[torch.float8_e4m3fnuz])
assert formats.NAN_BITS[torch.float8_e5m2fnuz] == formats.NAN_BITS[torch.float8_e4m3fnuz]
HALF_NAN = tl.constexpr(formats.NAN_BITS[torch.bfloat16])
assert formats.NAN_BITS[torch.float16] == formats.NAN_BITS[torch.bfloat16]
F32_NAN = tl.constexpr(formats.NAN_BITS[torch.float32])


@triton.jit
def _fp8_bits_soft(
    y, MANT_BITS: tl.constexpr, EXP_BIAS: tl.constexpr, MAX_FINITE: tl.constexpr, NAN_CODE: tl.constexpr,
    SIGNED_ZERO: tl.constexpr,
):  # fmt: skip
    """float32 -> FP8 code (int32 in [0, 255]): saturate finite and infinite values, NaN to NAN_CODE,
    round to nearest even; a zero result keeps its sign with ``SIGNED_ZERO``, and is 0x00 without
    (the fnuz formats, where 0x80 is the NaN)."""
    is_nan = y != y
    sign = (y.to(tl.int32, bitcast=True) >> 24) & 0x80
    a = tl.where(is_nan, 0.0, tl.abs(y))
    a = tl.minimum(a, MAX_FINITE)  # +inf saturates too; RNE of a value <= MAX_FINITE stays <= it
    bits = a.to(tl.int32, bitcast=True)
    # Normal range: round the 23-bit mantissa to MANT_BITS, ties to even; a carry moves into the
    # exponent field, which is exactly the rounding up to the next binade. Then rebias the exponent.
    SHIFT: tl.constexpr = 23 - MANT_BITS
    rounded = bits + ((1 << (SHIFT - 1)) - 1) + ((bits >> SHIFT) & 1)
    normal = (rounded >> SHIFT) - ((127 - EXP_BIAS) << MANT_BITS)
    # Subnormal range: the code is a / 2**(1 - EXP_BIAS - MANT_BITS) rounded to an integer. Scaling
    # by a power of two is exact, and adding 2**23 makes the float32 adder round to an integer (ties
    # to even); the integer then sits in the low mantissa bits. A result of 2**MANT_BITS is the code
    # of the smallest normal, so the two ranges meet without a seam.
    SUB_SCALE: tl.constexpr = 2.0 ** (EXP_BIAS + MANT_BITS - 1)
    MIN_NORMAL: tl.constexpr = 2.0 ** (1 - EXP_BIAS)
    sub = (a * SUB_SCALE + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    mag = tl.where(a < MIN_NORMAL, sub, normal)
    if SIGNED_ZERO:
        code = mag | sign
    else:
        code = tl.where(mag == 0, 0, mag | sign)
    return tl.where(is_nan, NAN_CODE, code)


@triton.jit
def _bf16_bits_soft(y):
    """float32 -> bfloat16 bits (uint32 in [0, 65535]), round to nearest even, NaN to HALF_NAN."""
    bits = y.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(y != y, HALF_NAN, rounded)


@triton.jit
def _to_float32(x, SOFT_CAST: tl.constexpr):
    """Widen an input tile to float32. The interpreter mangles bf16 subnormals when widening, so
    the soft mode places the 16 bits in the high half of a float32 pattern itself (exact)."""
    if SOFT_CAST and x.dtype == tl.bfloat16:
        wide = x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16
        return wide.to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def _convert(x, OUT_KIND: tl.constexpr, SOFT_CAST: tl.constexpr):
    """float32 tile -> the value stored: uint8 codes for FP8, the element itself otherwise.

    Native (``SOFT_CAST=False``, NVIDIA sm_89+ only): Triton's casts, ``cvt.rn.satfinite`` for FP8
    (nearest even, overflow and +-inf to +-fmax, every NaN to FP8_NAN) and ``cvt.rn.bf16.f32`` for
    bf16 (nearest even, every NaN to HALF_NAN): the write's definition with no clamp and no NaN
    select (tests/test_write_nan_hardware_cast.py, test_write_nan_and_autograd.py,
    test_write_compiled_on_cuda.py, test_write_kernel_targets.py).
    Soft (``SOFT_CAST=True``): round-to-nearest-even with integer operations on the float32 bits,
    bit-exact everywhere, including Triton's CPU interpreter (whose own float->fp8/bf16 conversions
    are wrong) and GPUs with no FP8 conversion. fp16 and fp32 outputs select their NaN pattern on
    both branches: their casts (and the interpreter's) keep NaN signs and payloads.
    The fnuz formats take the integer encoder on every target: NVIDIA GPUs have no conversion to
    them, and the saturation, NaN and zero behaviour of Triton's AMD conversion (``float8e4b8``,
    ``float8e5b16``) is not checked against the write's definition on an MI300-class GPU."""
    if OUT_KIND == OUT_E4M3:
        if SOFT_CAST:
            out = _fp8_bits_soft(x, 3, 7, 448.0, FP8_NAN, True).to(tl.uint8)
        else:
            out = x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    elif OUT_KIND == OUT_E5M2:
        if SOFT_CAST:
            out = _fp8_bits_soft(x, 2, 15, 57344.0, FP8_NAN, True).to(tl.uint8)
        else:
            out = x.to(tl.float8e5).to(tl.uint8, bitcast=True)
    elif OUT_KIND == OUT_E4M3FNUZ:
        out = _fp8_bits_soft(x, 3, 8, 240.0, FNUZ_NAN, False).to(tl.uint8)
    elif OUT_KIND == OUT_E5M2FNUZ:
        out = _fp8_bits_soft(x, 2, 16, 57344.0, FNUZ_NAN, False).to(tl.uint8)
    elif OUT_KIND == OUT_BF16:
        if SOFT_CAST:
            out = _bf16_bits_soft(x).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            out = x.to(tl.bfloat16)
    elif OUT_KIND == OUT_FP16:
        bits = x.to(tl.float16).to(tl.int16, bitcast=True)
        out = tl.where(x != x, HALF_NAN, bits).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        out = tl.where(x != x, F32_NAN, x.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
    return out


# The reciprocal-and-FMA division below is taken for scales in [2**-40, 2**40]; others use div.rn.
# Inputs are first clamped to +-2**64: in that range x * (1/s) cannot overflow, and every input the
# clamp changes still divides to >= 2**24, which saturates both FP8 formats as the exact quotient does.
DIV_SCALE_LO = tl.constexpr(2.0**-40)
DIV_SCALE_HI = tl.constexpr(2.0**40)
DIV_X_LIMIT = tl.constexpr(2.0**64)


@triton.jit
def _div_by_reciprocal(x, s, r):
    """x / s as FP8 sees it, given r = RN(1/s) for a scale s in [2**-40, 2**40].

    Markstein's correction with the correctly rounded reciprocal: q0 = RN(x * r) is a float next to
    the quotient (not always within one ulp of x / s: x = 1.8855892, s = 1.8878249 gives 1.37 ulp,
    but never more than one float away from RN(x / s) in the checks below), the residual
    e = q0 * s - x is exact in an FMA, and RN(q0 - e * r) is the correctly rounded quotient when
    nothing over- or underflows. Evidence rather than a proof of our own: tests/test_write_fast_division.py
    replays these steps with an exact FMA over every float32 mantissa of x against hard and random
    scale mantissas (CPU, in CI), and runs this code against IEEE division on 64M random pairs (on a
    GPU). The clamp of x to +-2**64 rules out overflow (infinities included; NaN passes
    through both min and max). The residual is exact while |x / s| >= about 2**-63; below that the
    quotient can be off, but it rounds to a (signed) FP8 zero either way (FP8 needs >= 2**-17). The
    residual is negated through the FMA, not formed as x - q0 * s: for x = -0 that keeps the result
    -0 (x - q0 * s would give +0 and lose the sign). Four operations per element, no selects."""
    x = tl.minimum(tl.maximum(x, -DIV_X_LIMIT, propagate_nan=tl.PropagateNan.ALL), DIV_X_LIMIT,
                   propagate_nan=tl.PropagateNan.ALL)  # fmt: skip
    q0 = x * r
    e = tl.fma(q0, s, -x)
    return tl.fma(e, -r, q0)


@triton.jit
def _reciprocal(s, SCALE_KIND: tl.constexpr, FAST_DIV: tl.constexpr, SHARED: tl.constexpr):
    """RN(1 / s) for the fast division when a block's two head_dim pieces share it (``SHARED``):
    computed once before either piece's range check. ``s`` itself otherwise, and each tile's
    division computes it behind its range check: for a one-piece row, computing it ahead of the
    check lengthens a decode write's dependent chain; two pieces gain from sharing it."""
    if SHARED and FAST_DIV and (SCALE_KIND == SCALE_VALUE or SCALE_KIND == SCALE_TENSOR or SCALE_KIND == SCALE_HEAD):
        r = tl.div_rn(1.0, s)
    else:
        r = s
    return r


@triton.jit
def _divide_scalar(x, s, r, FAST_DIV: tl.constexpr, SHARED: tl.constexpr):
    """x / s for one scale s (a scalar), correctly rounded where FP8 can see it; r is
    ``_reciprocal(s)`` when ``SHARED``. The range check is one uniform branch per tile."""
    if FAST_DIV:
        if (s >= DIV_SCALE_LO) & (s <= DIV_SCALE_HI):
            if SHARED:
                x = _div_by_reciprocal(x, s, r)
            else:
                x = _div_by_reciprocal(x, s, tl.div_rn(1.0, s))
        else:
            x = tl.div_rn(x, s)
    else:
        x = tl.div_rn(x, s)
    return x


@triton.jit
def _divide_per_head(x, s, r, FAST_DIV: tl.constexpr, SHARED: tl.constexpr):
    """x [BLOCK_T, BLOCK_H, BLOCK_D] / s [BLOCK_H] (one scale per head); r is ``_reciprocal(s)``
    when ``SHARED``. The fast division runs when every scale of the block is in range (a
    reduction over the block's heads, once)."""
    if FAST_DIV:
        in_range = ((s >= DIV_SCALE_LO) & (s <= DIV_SCALE_HI)).to(tl.int32)
        if tl.min(in_range, axis=0) == 1:
            if SHARED:
                x = _div_by_reciprocal(x, s[None, :, None], r[None, :, None])
            else:
                x = _div_by_reciprocal(x, s[None, :, None], tl.div_rn(1.0, s)[None, :, None])
        else:
            x = tl.div_rn(x, s[None, :, None])
    else:
        x = tl.div_rn(x, s[None, :, None])
    return x


@triton.jit
def _quantize_tile(raw, scale, recip, SCALE_KIND: tl.constexpr, OUT_KIND: tl.constexpr, SOFT_CAST: tl.constexpr,
                   FAST_DIV: tl.constexpr, SHARED: tl.constexpr):  # fmt: skip
    """A loaded [BLOCK_T, BLOCK_H, BLOCK_D] tile -> the values stored. ``scale`` is the scalar
    (SCALE_VALUE, SCALE_TENSOR) or the [BLOCK_H] per-head scales (SCALE_HEAD); unused otherwise.
    ``recip`` is ``_reciprocal(scale, ..., SHARED)``."""
    if (
        (OUT_KIND == OUT_BF16 and raw.dtype == tl.bfloat16)
        or (OUT_KIND == OUT_FP16 and raw.dtype == tl.float16)
        or (OUT_KIND == OUT_FP32 and raw.dtype == tl.float32)
    ):
        out = raw  # same type in and out: store the bits as they are (NaN payloads included)
    else:
        x = _to_float32(raw, SOFT_CAST)
        if SCALE_KIND == SCALE_VALUE or SCALE_KIND == SCALE_TENSOR:
            x = _divide_scalar(x, scale, recip, FAST_DIV, SHARED)
        elif SCALE_KIND == SCALE_HEAD:
            x = _divide_per_head(x, scale, recip, FAST_DIV, SHARED)
        out = _convert(x, OUT_KIND, SOFT_CAST)
    return out


@triton.jit
def _head_max(raw, keep, SOFT_CAST: tl.constexpr):
    """[BLOCK_H] largest finite |x| per head over the lanes in ``keep`` (calibration)."""
    mag = tl.abs(_to_float32(raw, SOFT_CAST))
    keep = keep & (mag < float("inf"))  # NaN compares false too
    return tl.max(tl.max(tl.where(keep, mag, 0.0), axis=2), axis=0)


@triton.jit
def _block_lanes(head_block, d_block, H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_D2: tl.constexpr, I64: tl.constexpr):  # fmt: skip
    """The heads and head_dim elements a block covers, and which of them exist: (offs_h, offs_d,
    offs_d2, head_ok, in_row, in_row2). With BLOCK_D2 > 0 the head_dim is covered by two power-of-two
    pieces, [0, BLOCK_D) and [BLOCK_D, BLOCK_D + BLOCK_D2), in the same program (a row of 288 = 256 +
    32 elements keeps every lane busy and stays in one program); without, the second piece's lanes
    are the first's (unused)."""
    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = d_block * BLOCK_D + tl.arange(0, BLOCK_D)
    if I64:
        # A caller's head-major cache viewed as [slots, H, D] has a head stride of slots * D, and
        # (H - 1) * slots * D passes 2**31 on a 2 GiB cache; the launcher takes 32-bit offsets only
        # when every offset of every tensor of the launch fits.
        offs_h = offs_h.to(tl.int64)
        offs_d = offs_d.to(tl.int64)
    head_ok = offs_h < H
    in_row = head_ok[None, :, None] & (offs_d < D)[None, None, :]
    if BLOCK_D2 > 0:
        offs_d2 = BLOCK_D + tl.arange(0, BLOCK_D2)
        if I64:
            offs_d2 = offs_d2.to(tl.int64)
        in_row2 = head_ok[None, :, None] & (offs_d2 < D)[None, None, :]
    else:
        offs_d2 = offs_d
        in_row2 = in_row
    return offs_h, offs_d, offs_d2, head_ok, in_row, in_row2


@triton.jit
def _load_block(
    src_ptr,  # [T, H, D] input rows, any strides
    scale_ptr,  # [1] or [H] float32; unused unless SCALE_KIND is SCALE_TENSOR or SCALE_HEAD
    scale_value,  # float32, used when SCALE_KIND == SCALE_VALUE
    scale_stride,  # the per-head scale's stride along heads (SCALE_HEAD)
    offs_t,  # [BLOCK_T] token indices (int64, or int32 when I64 is off)
    token_ok,  # [BLOCK_T] token exists (t < T)
    head_block,
    d_block,
    stride_st,
    stride_sh,
    stride_sd,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    SCALE_KIND: tl.constexpr,
    I64: tl.constexpr,
):
    """Issue the loads of BLOCK_T tokens x BLOCK_H heads x one head_dim block of one tensor (K or V):
    (scale, raw, raw2), raw2 the second head_dim piece (raw itself when there is none). The rows are
    masked by token only, not by slot validity: a decode-sized write is then one memory round trip
    (slots, scale and rows in flight together) followed by the stores. Masked lanes load 1.0, not
    0.0: a zero dividend sends div.rn down its slow path."""
    offs_h, offs_d, offs_d2, head_ok, in_row, in_row2 = _block_lanes(head_block, d_block, H, D, BLOCK_H, BLOCK_D, BLOCK_D2, I64)
    if SCALE_KIND == SCALE_VALUE:
        scale = scale_value
    elif SCALE_KIND == SCALE_TENSOR:
        scale = tl.load(scale_ptr).to(tl.float32)
    elif SCALE_KIND == SCALE_HEAD:
        scale = tl.load(scale_ptr + offs_h * scale_stride, mask=head_ok, other=1.0).to(tl.float32)
    else:
        scale = 1.0
    row_src = src_ptr + offs_t[:, None, None] * stride_st + offs_h[None, :, None] * stride_sh
    raw = tl.load(row_src + offs_d[None, None, :] * stride_sd, mask=token_ok[:, None, None] & in_row, other=1.0)
    if BLOCK_D2 > 0:
        raw2 = tl.load(row_src + offs_d2[None, None, :] * stride_sd, mask=token_ok[:, None, None] & in_row2, other=1.0)
    else:
        raw2 = raw
    return scale, raw, raw2


@triton.jit
def _slot_ok(slot, write_ok, capacity, map_ptr, map_rows, MAPPED: tl.constexpr, I64: tl.constexpr):
    """(slot narrowed to the offset width, whether the token's row is written). Called after the
    rows' loads are issued, so they do not wait for the slots. With ``MAPPED`` the loaded slot is
    first translated through ``map_ptr`` (``map_ptr[slot]`` for a slot in ``[0, map_rows)``, -1,
    skipped, for any other). The range check runs on the slot as loaded (int32 or int64); only
    then may it be narrowed."""
    if MAPPED:
        in_map = write_ok & (slot >= 0) & (slot < map_rows)
        slot = tl.load(map_ptr + slot, mask=in_map, other=-1)
    row_ok = write_ok & (slot >= 0) & (slot < capacity)
    return (slot.to(tl.int64) if I64 else slot.to(tl.int32)), row_ok


@triton.jit
def _store_block(
    dst_ptr,  # [capacity, H, D] cache (uint8 storage for FP8), any strides
    amax_ptr,  # [H] float32 running max of |x| per head (OBSERVE only)
    slot,  # [BLOCK_T] slot of each token (int64, or int32 when I64 is off)
    row_ok,  # [BLOCK_T] the token's row is written (slot in range and the token may be written)
    scale,
    raw,
    raw2,
    head_block,
    d_block,
    stride_ct,
    stride_ch,
    stride_cd,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    SCALE_KIND: tl.constexpr,
    OUT_KIND: tl.constexpr,
    SOFT_CAST: tl.constexpr,
    FAST_DIV: tl.constexpr,
    OBSERVE: tl.constexpr,
    I64: tl.constexpr,
):
    """Quantize a block loaded by ``_load_block`` and scatter each token's part of it to its slot."""
    offs_h, offs_d, offs_d2, head_ok, in_row, in_row2 = _block_lanes(head_block, d_block, H, D, BLOCK_H, BLOCK_D, BLOCK_D2, I64)
    row_dst = dst_ptr + slot[:, None, None] * stride_ct + offs_h[None, :, None] * stride_ch
    store_ok = row_ok[:, None, None]
    recip = _reciprocal(scale, SCALE_KIND, FAST_DIV, BLOCK_D2 > 0)
    tl.store(
        row_dst + offs_d[None, None, :] * stride_cd,
        _quantize_tile(raw, scale, recip, SCALE_KIND, OUT_KIND, SOFT_CAST, FAST_DIV, BLOCK_D2 > 0),
        mask=store_ok & in_row,
    )
    if BLOCK_D2 > 0:
        tl.store(
            row_dst + offs_d2[None, None, :] * stride_cd,
            _quantize_tile(raw2, scale, recip, SCALE_KIND, OUT_KIND, SOFT_CAST, FAST_DIV, True),
            mask=store_ok & in_row2,
        )
    if OBSERVE:
        # Calibration: fold the largest finite |x| of each head over the tokens this call writes
        # into the running maximum (a max is exact in any order).
        head_max = _head_max(raw, store_ok & in_row, SOFT_CAST)
        if BLOCK_D2 > 0:
            head_max = tl.maximum(head_max, _head_max(raw2, store_ok & in_row2, SOFT_CAST))
        tl.atomic_max(amax_ptr + offs_h, head_max, mask=head_ok)


@triton.jit
def _store_head_block(
    src_ptr, dst_ptr, scale_ptr, scale_value, scale_stride, amax_ptr, slot, offs_t, token_ok, write_ok,
    head_block, d_block, capacity, map_ptr, map_rows, stride_st, stride_sh, stride_sd, stride_ct, stride_ch,
    stride_cd, H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_D2: tl.constexpr, SCALE_KIND: tl.constexpr, OUT_KIND: tl.constexpr, SOFT_CAST: tl.constexpr,
    FAST_DIV: tl.constexpr, OBSERVE: tl.constexpr, MAPPED: tl.constexpr, I64: tl.constexpr,
):  # fmt: skip
    """One block of one tensor (K or V): its loads, then its slots' range check, then its stores
    (``slot`` as loaded; arguments as for ``_load_block`` and ``_store_block``)."""
    scale, raw, raw2 = _load_block(
        src_ptr, scale_ptr, scale_value, scale_stride, offs_t, token_ok, head_block, d_block,
        stride_st, stride_sh, stride_sd, H, D, BLOCK_H, BLOCK_D, BLOCK_D2, SCALE_KIND, I64,
    )  # fmt: skip
    dst_slot, row_ok = _slot_ok(slot, write_ok, capacity, map_ptr, map_rows, MAPPED, I64)
    _store_block(
        dst_ptr, amax_ptr, dst_slot, row_ok, scale, raw, raw2, head_block, d_block, stride_ct, stride_ch, stride_cd,
        H, D, BLOCK_H, BLOCK_D, BLOCK_D2, SCALE_KIND, OUT_KIND, SOFT_CAST, FAST_DIV, OBSERVE, I64,
    )  # fmt: skip


# T (the token count), the loc pointer and the scale pointers/strides change from call to call (a
# scheduler slices loc out of a larger buffer; a scale tensor may be one element of a stacked
# per-layer tensor); so do a verify write's width and commit_lens. Not specializing on them keeps one
# compiled variant per pool configuration, so the warmup at pool construction covers the first call.
# The arguments that change per call come first (up to ``stride_commit``), those fixed for a kind
# of call after them: a direct launch reuses the second part.
@triton.jit(
    do_not_specialize=[
        "T", "loc_ptr", "k_scale_ptr", "v_scale_ptr", "k_scale_stride", "v_scale_stride",
        "commit_ptr", "width", "stride_loc_row", "stride_commit", "k_amax_ptr", "v_amax_ptr", "map_ptr", "map_rows",
    ]
)  # fmt: skip
def store_kv(
    k_ptr,  # [T, H, D] bf16/fp16/fp32, any strides
    v_ptr,  # [T, HV, DV]
    k_cache_ptr,  # [capacity, H, D] cache, uint8 storage for FP8
    v_cache_ptr,  # [capacity, HV, DV]
    loc_ptr,  # [T] int32/int64 slot per token; < 0 or >= capacity: skipped
    k_scale_ptr,  # [1] or [H] float32 (any pointer when K_SCALE_KIND != SCALE_TENSOR)
    v_scale_ptr,  # [1] or [HV] float32
    commit_ptr,  # [bs] int32/int64 tokens to write per row of loc (PREFIX only; else any pointer)
    k_amax_ptr,  # [H] float32 running max |k| per head (OBSERVE only; else any pointer)
    v_amax_ptr,  # [HV] float32
    k_scale_value,
    v_scale_value,
    k_scale_stride,
    v_scale_stride,
    T,
    width,  # PREFIX: loc is [T // width, width]
    stride_loc_row,  # PREFIX: loc's stride along rows
    stride_commit,
    map_ptr,  # [map_rows] int64 slot of each loc entry (MAPPED only; else any pointer)
    map_rows,
    capacity,
    stride_loc,  # loc's stride along tokens (along width, PREFIX)
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kct,
    stride_kch,
    stride_kcd,
    stride_vct,
    stride_vch,
    stride_vcd,
    H: tl.constexpr,
    D: tl.constexpr,
    HV: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    BLOCK_DV2: tl.constexpr,
    K_SCALE_KIND: tl.constexpr,
    V_SCALE_KIND: tl.constexpr,
    OUT_KIND: tl.constexpr,
    SOFT_CAST: tl.constexpr,
    FAST_DIV: tl.constexpr,
    PREFIX: tl.constexpr,
    OBSERVE: tl.constexpr,
    I64: tl.constexpr,
    JOINED: tl.constexpr,
    MAPPED: tl.constexpr,
):
    """Write one layer's K and V rows: load, divide by the scale, saturate, cast and scatter to
    ``loc``, for the tokens of this program's tile; a slot outside ``[0, capacity)`` is skipped."""
    # 64-bit offsets unless every offset of the launch fits in 32 bits (the launcher checks the
    # inputs' and caches' extents); 64-bit arithmetic costs decode-sized writes measurable time.
    if I64:
        offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    else:
        offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_ok = offs_t < T
    if PREFIX:
        row = offs_t // width
        col = offs_t - row * width
        loc_off = row * stride_loc_row + col * stride_loc
        # Rows and slots still load under token_ok alone; only the store waits for commit_lens.
        committed = tl.load(commit_ptr + row * stride_commit, mask=token_ok, other=0)
        write_ok = token_ok & (col < committed)
    else:
        loc_off = offs_t * stride_loc
        write_ok = token_ok
    # Every load is issued before anything waits on one: the slots here, then the scale and rows of
    # the block(s) this program writes.
    slot = tl.load(loc_ptr + loc_off, mask=token_ok, other=-1)

    # Axis 1: K's blocks, then V's; each tensor's blocks walk head_dim blocks within head blocks
    # (one head_dim block per head, except in flat plans, where a "head" is a whole row).
    # (With a second piece, BLOCK_D + BLOCK_D2 >= D: one head_dim block per head.)
    # JOINED plans have one block per tensor and one program per token block writing both.
    K_D_BLOCKS: tl.constexpr = (D - BLOCK_D2 + BLOCK_D - 1) // BLOCK_D
    V_D_BLOCKS: tl.constexpr = (DV - BLOCK_DV2 + BLOCK_DV - 1) // BLOCK_DV
    K_BLOCKS: tl.constexpr = (H + BLOCK_H - 1) // BLOCK_H * K_D_BLOCKS
    b = tl.program_id(1)
    if JOINED:
        k_scale, k_raw, k_raw2 = _load_block(
            k_ptr, k_scale_ptr, k_scale_value, k_scale_stride, offs_t, token_ok, 0, 0,
            stride_kt, stride_kh, stride_kd, H, D, BLOCK_H, BLOCK_D, BLOCK_D2, K_SCALE_KIND, I64,
        )  # fmt: skip
        v_scale, v_raw, v_raw2 = _load_block(
            v_ptr, v_scale_ptr, v_scale_value, v_scale_stride, offs_t, token_ok, 0, 0,
            stride_vt, stride_vh, stride_vd, HV, DV, BLOCK_HV, BLOCK_DV, BLOCK_DV2, V_SCALE_KIND, I64,
        )  # fmt: skip
        dst_slot, row_ok = _slot_ok(slot, write_ok, capacity, map_ptr, map_rows, MAPPED, I64)
        _store_block(
            k_cache_ptr, k_amax_ptr, dst_slot, row_ok, k_scale, k_raw, k_raw2, 0, 0, stride_kct, stride_kch, stride_kcd,
            H, D, BLOCK_H, BLOCK_D, BLOCK_D2, K_SCALE_KIND, OUT_KIND, SOFT_CAST, FAST_DIV, OBSERVE, I64,
        )  # fmt: skip
        _store_block(
            v_cache_ptr, v_amax_ptr, dst_slot, row_ok, v_scale, v_raw, v_raw2, 0, 0, stride_vct, stride_vch, stride_vcd,
            HV, DV, BLOCK_HV, BLOCK_DV, BLOCK_DV2, V_SCALE_KIND, OUT_KIND, SOFT_CAST, FAST_DIV, OBSERVE, I64,
        )  # fmt: skip
    elif b < K_BLOCKS:
        _store_head_block(
            k_ptr, k_cache_ptr, k_scale_ptr, k_scale_value, k_scale_stride, k_amax_ptr, slot, offs_t, token_ok,
            write_ok, b // K_D_BLOCKS, b % K_D_BLOCKS, capacity, map_ptr, map_rows, stride_kt, stride_kh, stride_kd,
            stride_kct, stride_kch, stride_kcd, H, D, BLOCK_H, BLOCK_D, BLOCK_D2, K_SCALE_KIND, OUT_KIND, SOFT_CAST,
            FAST_DIV, OBSERVE, MAPPED, I64,
        )  # fmt: skip
    else:
        b -= K_BLOCKS
        _store_head_block(
            v_ptr, v_cache_ptr, v_scale_ptr, v_scale_value, v_scale_stride, v_amax_ptr, slot, offs_t, token_ok,
            write_ok, b // V_D_BLOCKS, b % V_D_BLOCKS, capacity, map_ptr, map_rows, stride_vt, stride_vh, stride_vd,
            stride_vct, stride_vch, stride_vcd, HV, DV, BLOCK_HV, BLOCK_DV, BLOCK_DV2, V_SCALE_KIND, OUT_KIND,
            SOFT_CAST, FAST_DIV, OBSERVE, MAPPED, I64,
        )  # fmt: skip
