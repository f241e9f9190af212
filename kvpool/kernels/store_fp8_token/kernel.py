"""The fused per-token-head FP8 write's Triton kernel: one program per token writes that token's K
and V rows in one launch: per head the amax over the finite elements, the scale, the division, the
rounding, and the scatter of codes and scales. Bit-identical to ``naive.write_token_head_reference``
(docs/contract.md, "Per-token-head FP8"): both divisions are ``div_rn`` (correctly rounded), and the
rounding to FP8 is either Triton's own conversion (``cvt.rn.satfinite`` on NVIDIA sm_89+: saturating,
nearest even, NaN to 0x7f) or, with ``SOFT_CAST``, integer operations on the float32 bits, which are
exact everywhere, Triton's CPU interpreter included (its own float->fp8 conversion is not)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpool.kernels.formats import NAN_BITS
from kvpool.kernels.store_fp8_token.naive import MIN_TOKEN_SCALE

FP8_NAN_CODE = tl.constexpr(NAN_BITS[torch.float8_e4m3fn])
assert NAN_BITS[torch.float8_e5m2] == NAN_BITS[torch.float8_e4m3fn]
MIN_SCALE = tl.constexpr(MIN_TOKEN_SCALE)


@triton.jit
def _widen(raw, SOFT_CAST: tl.constexpr):
    """An input tile as float32, exactly: the interpreter's bf16 widening mangles subnormals, so the
    soft mode moves the 16 bits into the high half of a float32 pattern itself."""
    if SOFT_CAST and raw.dtype == tl.bfloat16:
        return (raw.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return raw.to(tl.float32)


@triton.jit
def _soft_fp8(y, MANT_BITS: tl.constexpr, EXP_BIAS: tl.constexpr, FMAX: tl.constexpr):
    """float32 -> FP8 code (int32 in 0..255) with integer operations: saturating (+-inf too), round
    to nearest even, the sign of zero kept, NaN to FP8_NAN_CODE."""
    nan = y != y
    sign = (y.to(tl.int32, bitcast=True) >> 24) & 0x80
    a = tl.minimum(tl.where(nan, 0.0, tl.abs(y)), FMAX)
    bits = a.to(tl.int32, bitcast=True)
    # Normal codes: drop 23 - MANT_BITS mantissa bits with ties to even (a carry into the exponent
    # is the step to the next binade), then rebias the exponent field.
    DROP: tl.constexpr = 23 - MANT_BITS
    kept = (bits + ((1 << (DROP - 1)) - 1) + ((bits >> DROP) & 1)) >> DROP
    normal = kept - ((127 - EXP_BIAS) << MANT_BITS)
    # Subnormal codes: a in units of the smallest subnormal, rounded to an integer by the float32
    # adder (adding 2**23 leaves the integer, rounded to even, in the low mantissa bits).
    UNITS: tl.constexpr = 2.0 ** (EXP_BIAS + MANT_BITS - 1)
    SMALLEST_NORMAL: tl.constexpr = 2.0 ** (1 - EXP_BIAS)
    sub = (a * UNITS + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    code = tl.where(a < SMALLEST_NORMAL, sub, normal) | sign
    return tl.where(nan, FP8_NAN_CODE, code)


@triton.jit
def _token_head_row(
    x_ptr,  # [T, H, D] input rows, bf16/fp16/fp32, any strides
    t,  # int64 token index
    sx_t, sx_h, sx_d,  # input strides (elements)
    codes_ptr,  # [rows, H, D] uint8 codes
    sc_r, sc_h, sc_d,  # codes strides (bytes)
    scale_ptr,  # [rows, H] float32 scales
    ss_r, ss_h,  # scale strides (elements)
    slot,  # int64 row written, in 0..rows - 1
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    E4M3: tl.constexpr,
    SOFT_CAST: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    live = (h < H)[:, None] & (d < D)[None, :]
    raw = tl.load(x_ptr + t * sx_t + h[:, None] * sx_h + d[None, :] * sx_d, mask=live, other=0.0)
    x = _widen(raw, SOFT_CAST)
    a = tl.abs(x)
    amax = tl.max(tl.where(a < float("inf"), a, 0.0), axis=1)  # NaN compares false: left out too
    if E4M3:
        s = tl.maximum(tl.div_rn(amax, 448.0), MIN_SCALE)
    else:
        s = tl.maximum(tl.div_rn(amax, 57344.0), MIN_SCALE)
    y = tl.div_rn(x, s[:, None])
    if SOFT_CAST:
        if E4M3:
            code = _soft_fp8(y, 3, 7, 448.0).to(tl.uint8)
        else:
            code = _soft_fp8(y, 2, 15, 57344.0).to(tl.uint8)
    else:
        if E4M3:
            code = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            code = y.to(tl.float8e5).to(tl.uint8, bitcast=True)
    tl.store(codes_ptr + slot * sc_r + h[:, None] * sc_h + d[None, :] * sc_d, code, mask=live)
    tl.store(scale_ptr + slot * ss_r + h * ss_h, s, mask=h < H)


@triton.jit(do_not_specialize=["loc_ptr", "stride_loc", "map_ptr", "map_len"])
def store_fp8_token_kv(
    k_ptr,  # [T, H, D] K rows, bf16/fp16/fp32, any strides
    v_ptr,  # [T, H, DV] V rows
    loc_ptr,  # [T] int32/int64 slots (MAPPED: indices into map); outside 0..rows - 1: skipped
    map_ptr,  # [map_len] int64 slot map (MAPPED only; else any pointer)
    k_codes_ptr,  # [rows, H, D] uint8
    v_codes_ptr,  # [rows, H, DV] uint8
    k_scale_ptr,  # [rows, H] float32
    v_scale_ptr,  # [rows, H] float32
    rows,
    stride_loc,
    map_len,
    sk_t, sk_h, sk_d,  # K input strides
    sv_t, sv_h, sv_d,  # V input strides
    skc_r, skc_h, skc_d,  # K codes strides
    svc_r, svc_h, svc_d,  # V codes strides
    sks_r, sks_h,  # K scale strides
    svs_r, svs_h,  # V scale strides
    H: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    E4M3: tl.constexpr,
    SOFT_CAST: tl.constexpr,
    MAPPED: tl.constexpr,
):
    """One program per token: rows ``loc[t]`` (``MAPPED``: ``map[loc[t]]``, -1 for an index outside
    the map) of the code and scale buffers become the per-token-head FP8 of K and V row ``t``; a
    slot outside ``0..rows - 1`` (negative: padding) writes nothing."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(loc_ptr + t * stride_loc).to(tl.int64)
    if MAPPED:
        inside = (slot >= 0) & (slot < map_len)
        slot = tl.load(map_ptr + tl.where(inside, slot, 0), mask=inside, other=-1)
    if (slot >= 0) & (slot < rows):
        _token_head_row(k_ptr, t, sk_t, sk_h, sk_d, k_codes_ptr, skc_r, skc_h, skc_d, k_scale_ptr, sks_r, sks_h,
                        slot, H, D, BLOCK_H, BLOCK_D, E4M3, SOFT_CAST)  # fmt: skip
        _token_head_row(v_ptr, t, sv_t, sv_h, sv_d, v_codes_ptr, svc_r, svc_h, svc_d, v_scale_ptr, svs_r, svs_h,
                        slot, H, DV, BLOCK_H, BLOCK_DV, E4M3, SOFT_CAST)  # fmt: skip
