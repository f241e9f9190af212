"""The write's oracle (``kvassert``'s q(x, s), docs/contract.md "The write") and kvpool against it.

* The kernel's fast division, replayed step by step in NumPy with an exact float32 FMA.
* FP8 (and 16-bit) encodings derived by hand, as literal bytes: the oracle must agree with them, and
  so must ``quantize``, ``reference_set_kv_buffer`` and ``fused_fp8_set_kv_buffer`` (through the
  Triton interpreter on CPU), byte for byte.
* Properties of the write against the oracle, for random shapes, input and cache dtypes, scales,
  magnitudes (subnormal to overflow, inf and NaN), strided inputs and slot lists: the written rows
  equal the oracle byte for byte (NaN as "some NaN code"), every other row and the memory around the
  cache keep their poisoned bytes, and the inputs keep theirs.
"""

from __future__ import annotations

import dataclasses
import math
import os
from fractions import Fraction
from typing import NamedTuple
from unittest import mock

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvpool
from kvassert import (
    BF16,
    CACHE_DTYPES,
    E4M3FN,
    E5M2,
    FORMAT_OF,
    FP16,
    INPUT_DTYPES,
    INTERPRETER,
    Layer,
    assert_codes_equal,
    assert_same_bytes,
    codes_of,
    cuda_gen,
    encode_exact,
    encode_f32,
    expected_cache,
    gpu,
    needs_interpreter,
    q_codes,
    q_exact,
    skip_fused_without_interpreter,
)
from kvpool.kernels.store_kv import kernel as store_kv_kernel

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy inside Triton's interpreter


# ==============================================================================================
# The kernel's fast division.
#
# ``store_kv_kernel._div_by_reciprocal`` computes x / s as: clamp x to +-2**64, r = RN(1/s),
# q0 = RN(x * r), e = fma(q0, s, -x), q = fma(e, -r, q0). On a GPU, the last test of this part runs
# the kernel code itself against IEEE division on 64M random pairs; CI has no GPU (and the interpreter
# does not fuse FMAs), so the others check the arithmetic where it is hardest: every float32 mantissa
# of x against scale mantissas next to powers of two, and against random ones. A change to the
# kernel's division must be mirrored in ``fast_divide`` below.

F32, F64 = np.float32, np.float64
X_LIMIT = F32(2.0**64)


def fma_f32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """RN_float32(a * b + c) with one rounding, for float32 arrays.

    The product of two float32 values is exact in float64. The float64 sum s = p + c is rounded, but
    its error is recovered exactly (TwoSum). Rounding s to float32 then gives the right answer unless
    s sits exactly on a float32 midpoint while the true sum does not (a float32 midpoint is a float64,
    so no midpoint can lie strictly between the true sum and s): then the error says which way."""
    p = a.astype(F64) * b.astype(F64)
    c = c.astype(F64)
    s = p + c
    p_part = s - c
    err = (p - p_part) + (c - (s - p_part))
    f = s.astype(F32)
    toward = np.where(s > f.astype(F64), F32(np.inf), F32(-np.inf)).astype(F32)
    g = np.nextafter(f, toward)
    on_midpoint = (s != f.astype(F64)) & (s == (f.astype(F64) + g.astype(F64)) / 2)
    err_toward_g = np.sign(err) == np.sign(g.astype(F64) - f.astype(F64))
    return np.where(on_midpoint & (err != 0) & err_toward_g, g, f)


def fast_divide(x: np.ndarray, s: np.float32) -> np.ndarray:
    """The kernel's fast path (store_kv_kernel._div_by_reciprocal), for one scale in [2**-40, 2**40]."""
    with np.errstate(invalid="ignore"):
        x = np.where(np.isnan(x), x, np.clip(x, -X_LIMIT, X_LIMIT)).astype(F32)
    r = F32(1) / s
    s_arr = np.full_like(x, s)
    r_arr = np.full_like(x, r)
    q0 = x * r
    e = fma_f32(q0, s_arr, -x)
    return fma_f32(e, -r_arr, q0)


def _f32(bits: int) -> np.float32:
    return np.array([bits], dtype=np.uint32).view(F32)[0]


def _f32_scale(exponent: int, mantissa: int) -> np.float32:
    return _f32(((exponent + 127) << 23) | mantissa)


def _rn32(v: Fraction) -> np.float32:
    """A rational rounded once to float32, ties to even (normal and subnormal range)."""
    if v == 0:
        return F32(0.0)
    mag = abs(v)
    e = mag.numerator.bit_length() - mag.denominator.bit_length()
    while Fraction(2) ** e > mag:
        e -= 1
    while Fraction(2) ** (e + 1) <= mag:
        e += 1
    step = Fraction(2) ** max(e - 23, -149)  # the float32 spacing at this magnitude
    q = round(mag / step)  # Fraction rounding is round-half-even
    return F32(float(q * step) * (1 if v > 0 else -1))


def test_exact_fma_model_rounds_once():
    """Against exact rational arithmetic, on a case where going through float64 rounds twice (the
    exact sum lies 3 * 2**-68 above the midpoint 1 + 5 * 2**-24, float64 lands on the midpoint,
    and ties-to-even would then pick the wrong neighbour), and on random triples."""
    a = np.array([-3 * 2.0**-24 * (1 + 2.0**-22)], dtype=F32)
    b = np.array([1 - 2.0**-22], dtype=F32)
    c = np.array([1 + 2.0**-21], dtype=F32)
    exact = Fraction(float(a[0])) * Fraction(float(b[0])) + Fraction(float(c[0]))
    assert Fraction(float(F32(float(a[0])))) == Fraction(-3 * 2**-24 * (1 + 2**-22))  # a is a float32
    assert exact - (1 + 5 * Fraction(2) ** -24) == 3 * Fraction(2) ** -68
    twice = F32(float(a[0]) * float(b[0]) + float(c[0]))
    assert twice != _rn32(exact)  # the case does discriminate
    assert fma_f32(a, b, c)[0] == _rn32(exact) == F32(1 + 3 * 2.0**-23)

    rng = np.random.default_rng(5)
    bits = rng.integers(0, 2**32, (3, 3000), dtype=np.uint64).astype(np.uint32)
    bits &= np.uint32(0xBFFFFFFF)  # exponents up to 2**0: no overflow in the product
    x, y, z = (row.view(F32) for row in bits)
    z = z * F32(2.0**-20)  # put the addend near the product's scale, so they interact
    got = fma_f32(x, y, z)
    for i in range(x.size):
        if np.isfinite(got[i]):
            want = _rn32(Fraction(float(x[i])) * Fraction(float(y[i])) + Fraction(float(z[i])))
            assert got[i] == want or (got[i] == 0 and want == 0), (x[i], y[i], z[i])


# Scale mantissas where reciprocal-based division is known to be delicate (all ones, one ulp either
# side of a power of two and of 1.5, thirds), and random ones.
HARD_MANTISSAS = [0x7FFFFF, 0x7FFFFE, 0x000001, 0x000000, 0x400000, 0x3FFFFF, 0x400001, 0x555555, 0x2AAAAB]
RANDOM_MANTISSAS = [int(m) for m in np.random.default_rng(20261129).integers(0, 2**23, 6)]
EVERY_MANTISSA = (np.arange(2**23, dtype=np.uint32) | np.uint32(0x3F800000)).view(F32)  # [1, 2)


@pytest.mark.parametrize("mantissa", HARD_MANTISSAS + RANDOM_MANTISSAS, ids=hex)
def test_every_dividend_mantissa(mantissa):
    s = _f32_scale(0, mantissa)
    x = np.concatenate([EVERY_MANTISSA, -EVERY_MANTISSA[::97]])
    got = fast_divide(x, s)
    want = x / s
    bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert bad.size == 0, f"s={float(s)!r}: {bad.size} quotients differ, e.g. x={float(x[bad[0]])!r}"


@pytest.mark.parametrize("exponent,mantissa", [(-40, 0x7FFFFF), (-40, 0x000001), (39, 0x7FFFFF), (39, 0x2AAAAB)])
def test_scales_at_the_ends_of_the_fast_range(exponent, mantissa):
    s = _f32_scale(exponent, mantissa)
    x = EVERY_MANTISSA[::7] * F32(2.0**10)
    got = fast_divide(x, s)
    assert np.array_equal(got.view(np.uint32), (x / s).view(np.uint32))


def test_zeros_infinities_nan_and_extremes():
    """Signed zeros keep their sign, infinities and inputs beyond the clamp still divide to values
    that saturate FP8 (>= 2**17) with the right sign, tiny quotients stay below FP8's reach with
    their sign, NaN stays NaN."""
    tiny = _f32(1)  # the smallest float32 subnormal
    x = np.array([0.0, -0.0, np.inf, -np.inf, 3e38, -3e38, 2.0**64, 2.0**70, 1e-30, -1e-30, tiny, -tiny, np.nan], dtype=F32)
    for s in (_f32_scale(-40, 0), _f32_scale(0, 0x7FFFFF), F32(0.37), _f32_scale(39, 0x7FFFFF)):
        got = fast_divide(x, s)
        with np.errstate(over="ignore"):
            want = x / s
        assert np.array_equal(np.signbit(got[:-1]), np.signbit(want[:-1]))
        assert np.isnan(got[-1])
        big = np.abs(want[:-1]) >= 2.0**17
        small = np.abs(want[:-1]) < 2.0**-20
        assert (np.abs(got[:-1][big]) >= 2.0**17).all()
        assert (np.abs(got[:-1][small]) < 2.0**-19).all()
        mid = ~big & ~small
        assert np.array_equal(got[:-1][mid].view(np.uint32), want[:-1][mid].view(np.uint32))


@triton.jit
def _divide_probe(x_ptr, s_ptr, out_ptr, BLOCK: tl.constexpr, FAST: tl.constexpr, SHARED: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    s = tl.load(s_ptr + tl.program_id(0))  # one scale per program, as the kernel reads a scale
    if SHARED:
        r = store_kv_kernel._reciprocal(s, store_kv_kernel.SCALE_TENSOR, FAST, True)
    else:
        r = s
    tl.store(out_ptr + offs, store_kv_kernel._divide_scalar(x, s, r, FAST, SHARED))


@gpu
@pytest.mark.parametrize("shared", [False, True], ids=["reciprocal-per-tile", "reciprocal-shared"])
def test_fast_division_is_correctly_rounded_where_fp8_can_see_it(shared):
    """The reciprocal-and-FMA division against IEEE division (torch on the device), on 64M random
    (x, s) pairs: x any finite float32, s log-uniform over 2**-64..2**64 (the fast path takes
    2**-40..2**40, div.rn the rest). Quotients of magnitude 2**-20..2**17 (FP8 represents
    2**-16..57344) must match bit for bit; larger ones must stay above 2**17 (both saturate),
    smaller ones below 2**-19 (both round to zero); the sign always agrees, zeros included."""
    g = cuda_gen(11)
    block = 1024
    for _ in range(4):
        n = 16 * 2**20
        x = torch.randint(-(2**31), 2**31, (n,), device="cuda", generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
        x = torch.where(torch.isfinite(x), x, torch.ones_like(x))
        x[:4096] = torch.tensor([0.0, -0.0, 2.0**64, -(2.0**70)], device="cuda").repeat(1024)
        mant = torch.rand(n // block, device="cuda", generator=g) + 1.0
        s = mant * torch.exp2(torch.randint(-64, 64, (n // block,), device="cuda", generator=g).float())
        out = torch.empty_like(x)
        _divide_probe[(n // block,)](x, s, out, BLOCK=block, FAST=True, SHARED=shared)
        ieee = x / s.repeat_interleave(block)
        mag = ieee.abs()
        visible = (mag >= 2.0**-20) & (mag <= 2.0**17)
        assert_same_bytes(torch.where(visible, out, 0.0), torch.where(visible, ieee, 0.0), "fast division")
        assert (out.abs()[mag > 2.0**17] > 2.0**17).all(), "a saturating quotient came out in range"
        assert (out.abs()[mag < 2.0**-20] < 2.0**-19).all(), "a vanishing quotient came out visible"
        assert torch.equal(torch.signbit(out), torch.signbit(ieee)), "sign differs"


# ==============================================================================================
# Encodings derived by hand.
#
# Every expected byte below was worked out on paper from the format definitions (comments show the
# working).
#
# e4m3fn: value = 2**(e-7) * 1.mmm (e = 1..15), 2**-6 * 0.mmm (e = 0); S.1111.111 is NaN, no inf;
#         fmax = 1.75 * 2**8 = 448 = 0x7E; smallest subnormal 2**-9.
# e5m2:   value = 2**(e-15) * 1.mm (e = 1..30), 2**-14 * 0.mm (e = 0); e = 31 is inf/NaN;
#         fmax = 1.75 * 2**15 = 57344 = 0x7B; smallest subnormal 2**-16.

NAN = float("nan")
INF = float("inf")
E4M3 = torch.float8_e4m3fn
E5M2_T = torch.float8_e5m2


class Known(NamedTuple):
    id: str
    x: float
    code: int  # expected byte; -1 means "a NaN code"
    approx: bool = False  # True: the byte holds for x rounded to any input dtype (x itself need not be exact)


# fmt: off
E4M3FN_KNOWN = [
    Known("zero", 0.0, 0x00),
    Known("neg_zero", -0.0, 0x80),
    Known("one", 1.0, 0x38),                       # e=7, m=000
    Known("tie_1.0625_down_to_even", 1.0625, 0x38),  # halfway 1.0 (m=000) / 1.125 (m=001) -> even 000
    Known("tie_1.1875_up_to_even", 1.1875, 0x3A),    # halfway 1.125 (001) / 1.25 (010) -> even 010
    Known("1.97_rounds_up_to_2", 1.97, 0x40, approx=True),  # above midpoint 1.9375 of 1.875 / 2.0
    Known("tie_1.9375_carries_to_2", 1.9375, 0x40),  # halfway 1.875 (111) / 2.0 (e=8, 000) -> even 000
    Known("0.1", 0.1, 0x1D, approx=True),          # 1.6 * 2**-4: e=3, m=4.8 -> 5 (101)
    Known("neg_3.5", -3.5, 0xC6),                  # 1.75 * 2**1: S=1, e=8, m=110
    Known("240", 240.0, 0x77),                     # 1.875 * 2**7: e=14, m=111
    Known("416", 416.0, 0x7D),                     # 1.625 * 2**8: e=15, m=101
    Known("424", 424.0, 0x7D),                     # m = 5.25 -> 5
    Known("tie_432_up_to_even_448", 432.0, 0x7E),  # halfway 416 (101) / 448 (110) -> 110
    Known("440", 440.0, 0x7E),                     # m = 5.75 -> 6
    Known("fmax_448", 448.0, 0x7E),
    Known("neg_fmax", -448.0, 0xFE),
    Known("449_saturates", 449.0, 0x7E, approx=True),
    Known("464_saturates", 464.0, 0x7E),           # midpoint of 448 and (non-existent) 480: clamp first
    Known("465_saturates", 465.0, 0x7E, approx=True),
    Known("480_saturates", 480.0, 0x7E),
    Known("1e6_saturates", 1e6, 0x7E, approx=True),
    Known("neg_1e6_saturates", -1e6, 0xFE, approx=True),
    Known("inf_saturates", INF, 0x7E),
    Known("neg_inf_saturates", -INF, 0xFE),
    Known("nan", NAN, -1),
    Known("min_normal_2^-6", 2.0 ** -6, 0x08),
    Known("min_subnormal_2^-9", 2.0 ** -9, 0x01),
    Known("7*2^-9", 7 * 2.0 ** -9, 0x07),          # largest subnormal
    Known("tie_2^-10_to_zero", 2.0 ** -10, 0x00),  # halfway 0 / 2**-9 -> even 0
    Known("neg_tie_2^-10_to_neg_zero", -(2.0 ** -10), 0x80),
    Known("just_above_2^-10", 2.0 ** -10 + 2.0 ** -17, 0x01),
    Known("2^-11_to_zero", 2.0 ** -11, 0x00),
    Known("tie_3*2^-10_to_2", 3 * 2.0 ** -10, 0x02),   # 1.5 quanta -> 2
    Known("tie_5*2^-10_to_2", 5 * 2.0 ** -10, 0x02),   # 2.5 quanta -> 2
    Known("tie_7*2^-10_to_4", 7 * 2.0 ** -10, 0x04),   # 3.5 quanta -> 4
    Known("tie_15*2^-10_to_min_normal", 15 * 2.0 ** -10, 0x08),  # 7.5 quanta -> 8 = 2**-6
    Known("1e-30_to_zero", 1e-30, 0x00, approx=True),
    Known("neg_1e-30_to_neg_zero", -1e-30, 0x80, approx=True),
    Known("f32_subnormal_to_zero", 2.0 ** -140, 0x00, approx=True),
    Known("neg_f32_subnormal_to_neg_zero", -(2.0 ** -140), 0x80, approx=True),
]

E5M2_KNOWN = [
    Known("zero", 0.0, 0x00),
    Known("neg_zero", -0.0, 0x80),
    Known("one", 1.0, 0x3C),                       # e=15, m=00
    Known("tie_1.125_down_to_even", 1.125, 0x3C),  # halfway 1.0 (00) / 1.25 (01)
    Known("tie_1.375_up_to_even", 1.375, 0x3E),    # halfway 1.25 (01) / 1.5 (10)
    Known("1.97_rounds_up_to_2", 1.97, 0x40, approx=True),  # above midpoint 1.875 of 1.75 / 2.0
    Known("tie_1.875_carries_to_2", 1.875, 0x40),  # halfway 1.75 (11) / 2.0 (e=16, 00)
    Known("0.1", 0.1, 0x2E, approx=True),          # 1.6 * 2**-4: e=11, m=2.4 -> 2 (10)
    Known("neg_3.5", -3.5, 0xC3),                  # 1.75 * 2: S=1, e=16, m=11
    Known("49152", 49152.0, 0x7A),                 # 1.5 * 2**15: e=30, m=10
    Known("tie_53248_down_to_even", 53248.0, 0x7A),  # halfway 49152 (10) / 57344 (11)
    Known("fmax_57344", 57344.0, 0x7B),
    Known("neg_fmax", -57344.0, 0xFB),
    Known("57345_saturates", 57345.0, 0x7B, approx=True),
    Known("61440_saturates", 61440.0, 0x7B),       # midpoint of 57344 and 65536 (would be inf)
    Known("65504_saturates", 65504.0, 0x7B),
    Known("1e5_saturates", 1e5, 0x7B, approx=True),
    Known("1e30_saturates", 1e30, 0x7B, approx=True),
    Known("inf_saturates", INF, 0x7B),
    Known("neg_inf_saturates", -INF, 0xFB),
    Known("nan", NAN, -1),
    Known("min_normal_2^-14", 2.0 ** -14, 0x04),
    Known("min_subnormal_2^-16", 2.0 ** -16, 0x01),
    Known("3*2^-16", 3 * 2.0 ** -16, 0x03),        # largest subnormal
    Known("tie_2^-17_to_zero", 2.0 ** -17, 0x00),
    Known("neg_tie_2^-17_to_neg_zero", -(2.0 ** -17), 0x80),
    Known("just_above_2^-17", 2.0 ** -17 + 2.0 ** -24, 0x01),
    Known("tie_3*2^-17_to_2", 3 * 2.0 ** -17, 0x02),
    Known("tie_5*2^-17_to_2", 5 * 2.0 ** -17, 0x02),
    Known("tie_7*2^-17_to_min_normal", 7 * 2.0 ** -17, 0x04),  # 3.5 quanta -> 4 = 2**-14
    Known("neg_1e-30_to_neg_zero", -1e-30, 0x80, approx=True),
]
# fmt: on

KNOWN = {E4M3: E4M3FN_KNOWN, E5M2_T: E5M2_KNOWN}
FMT_ID = {E4M3: "e4m3fn", E5M2_T: "e5m2"}


def _representable(x: float, dtype: torch.dtype) -> bool:
    if math.isnan(x) or math.isinf(x):
        return True
    back = torch.tensor([x], dtype=torch.float64).to(dtype).double().item()
    return back == x and math.copysign(1.0, back) == math.copysign(1.0, x)


def _literal_rows(cache_dtype, in_dtype, mult: float = 1.0):
    """The literal rows usable with this input dtype, with inputs x * mult."""
    out = []
    for k in KNOWN[cache_dtype]:
        xm = k.x * mult
        if k.approx or _representable(xm, in_dtype):
            out.append(k._replace(x=xm))
    return out


def _check_codes(codes: np.ndarray, rows, fmt, what: str) -> None:
    codes = np.asarray(codes).reshape(-1)
    expected = np.array([r.code if r.code >= 0 else fmt.nan_code for r in rows])
    for i, r in enumerate(rows):
        if r.code < 0:
            assert fmt.is_nan_code(np.array([codes[i]]))[0], f"{what}: {r.id} -> 0x{int(codes[i]):02x}, want NaN"
    assert_codes_equal(codes, expected, fmt, f"{what} {[r.id for r in rows]}")


# ----------------------------------------------------------------------------------------------
# The oracle against the literals.


@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2_T], ids=FMT_ID.get)
def test_oracle_agrees_with_literals(cache_dtype):
    fmt = FORMAT_OF[cache_dtype]
    for k in KNOWN[cache_dtype]:
        y = np.array([k.x], dtype=np.float32)
        vec = int(encode_f32(y, fmt)[0])
        exact = encode_exact(float(y[0]), fmt)
        for name, got in (("vectorised", vec), ("exact", exact)):
            if k.code < 0:
                assert fmt.is_nan_code(np.array([got]))[0], f"{name} oracle: {k.id} gave 0x{got:02x}"
            else:
                assert got == k.code, f"{name} oracle: {k.id} ({k.x!r}) gave 0x{got:02x}, literal 0x{k.code:02x}"


def test_oracle_encoders_agree_on_every_bf16_and_fp16_pattern():
    """The vectorised (bit-pattern) and exact (rational) encoders agree on 131072 inputs."""
    bf = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)
    fp = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    sample = np.concatenate([bf[::7], fp[::7]])  # every 7th keeps this quick; ties stay dense
    for fmt in (E4M3FN, E5M2, BF16, FP16):
        vec = encode_f32(sample, fmt)
        exact = np.array([encode_exact(float(y), fmt) for y in sample])
        assert_codes_equal(vec, exact, fmt, "vectorised vs exact encoder")


def test_oracle_fp16_encoder_agrees_with_numpy_ieee_cast():
    """NumPy's float32 -> float16 is an independent IEEE RNE implementation (overflow to inf)."""
    rng = np.random.default_rng(1234)
    y = rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    y = np.concatenate([y, (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)])
    with np.errstate(all="ignore"):
        np_codes = y.astype(np.float16).view(np.uint16).astype(np.int64)
    assert_codes_equal(encode_f32(y, FP16), np_codes, FP16, "oracle vs numpy float16")


# ----------------------------------------------------------------------------------------------
# kvpool against the literals: quantize, both write functions, three input dtypes, several scales.

# (id, scale as passed, multiplier applied to the inputs so that x * mult / scale == x), per head
SCALES = [
    ("none", lambda H: None, [1.0, 1.0]),
    ("float_1", lambda H: 1.0, [1.0, 1.0]),
    ("float_2", lambda H: 2.0, [2.0, 2.0]),
    ("float_0.25", lambda H: 0.25, [0.25, 0.25]),
    ("t0d_0.5", lambda H: torch.tensor(0.5), [0.5, 0.5]),
    ("t1_4", lambda H: torch.tensor([4.0]), [4.0, 4.0]),
    ("t111_0.5", lambda H: torch.full((1, 1, 1), 0.5), [0.5, 0.5]),
    ("head_H_2_0.5", lambda H: torch.tensor([2.0, 0.5]), [2.0, 0.5]),
    ("head_H1_0.5_4", lambda H: torch.tensor([[0.5], [4.0]]), [0.5, 4.0]),
]
SCALE_IDS = [s[0] for s in SCALES]


def _literal_input(cache_dtype, in_dtype, mults):
    """x [2, 2, N]: token 0 = literals, token 1 = their negations; head h scaled by mults[h].

    Only rows usable for both heads' multipliers are kept."""
    usable = None
    per_head = []
    for m in mults:
        rows = _literal_rows(cache_dtype, in_dtype, m)
        per_head.append(rows)
        ids = {r.id for r in rows}
        usable = ids if usable is None else usable & ids
    per_head = [[r for r in rows if r.id in usable] for rows in per_head]
    vals = torch.tensor([[r.x for r in rows] for rows in per_head], dtype=torch.float64)
    x = torch.stack([vals, -vals]).to(in_dtype)  # [2, H=2, N]
    base = [r for r in KNOWN[cache_dtype] if r.id in usable]
    fmt = FORMAT_OF[cache_dtype]
    pos = np.array([r.code if r.code >= 0 else fmt.nan_code for r in base])
    neg = np.where(fmt.is_nan_code(pos), pos, pos ^ 0x80)
    expected = np.stack([np.stack([pos, pos]), np.stack([neg, neg])])  # [2, 2, N]
    return x, expected, base


@pytest.mark.parametrize("scale_case", SCALES, ids=SCALE_IDS)
@pytest.mark.parametrize("in_dtype", INPUT_DTYPES, ids=str)
@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2_T], ids=FMT_ID.get)
def test_quantize_and_oracle_match_literals(cache_dtype, in_dtype, scale_case):
    _, make_scale, mults = scale_case
    x, expected, base = _literal_input(cache_dtype, in_dtype, mults)
    scale = make_scale(2)
    fmt = FORMAT_OF[cache_dtype]
    x_before = x.clone()
    got = kvpool.quantize(x, cache_dtype, scale)
    assert got.dtype == cache_dtype
    assert_codes_equal(q_codes(x, cache_dtype, scale), expected, fmt, "oracle on literals")
    assert_codes_equal(got, expected, fmt, "quantize on literals")
    for i, r in enumerate(base):  # NaN literals must come out as NaN (not merely equal-as-NaN)
        if r.code < 0:
            assert fmt.is_nan_code(codes_of(got)[:, :, i]).all(), f"{r.id} did not stay NaN"
    assert_same_bytes(x, x_before, "quantize input")


def _poisoned_caches(slots, H, D, dtype, poison=0xFF):
    kc = torch.empty(slots, H, D, dtype=dtype)
    kc.view(torch.uint8).fill_(poison)
    vc = torch.empty(slots, H, D, dtype=dtype)
    vc.view(torch.uint8).fill_(poison ^ 0x5A)
    return kc, vc


WRITERS = {
    "reference": kvpool.reference_set_kv_buffer,
    "fused_interp": kvpool.fused_fp8_set_kv_buffer,
}


@pytest.mark.parametrize("writer", list(WRITERS), ids=str)
@pytest.mark.parametrize("scale_case", SCALES, ids=SCALE_IDS)
@pytest.mark.parametrize("in_dtype", INPUT_DTYPES, ids=str)
@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2_T], ids=FMT_ID.get)
def test_write_functions_match_literals(cache_dtype, in_dtype, scale_case, writer):
    """Both tokens land in their rows with the literal bytes; K and V both; other rows untouched."""
    skip_fused_without_interpreter(writer)
    _, make_scale, mults = scale_case
    x, expected, _ = _literal_input(cache_dtype, in_dtype, mults)
    fmt = FORMAT_OF[cache_dtype]
    N = x.shape[2]
    kc, vc = _poisoned_caches(6, 2, N, cache_dtype)
    kc0, vc0 = kc.clone(), vc.clone()
    v = x.flip(0).clone()  # V gets the tokens the other way round
    loc = torch.tensor([4, 1], dtype=torch.int64)
    ks, vs = make_scale(2), make_scale(2)
    WRITERS[writer](x, v, kc, vc, loc, ks, vs)
    exp_k = codes_of(kc0).astype(np.int64)
    exp_v = codes_of(vc0).astype(np.int64)
    exp_k[4], exp_k[1] = expected[0], expected[1]
    exp_v[4], exp_v[1] = expected[1], expected[0]
    assert_codes_equal(kc, exp_k, fmt, f"{writer} k_cache")
    assert_codes_equal(vc, exp_v, fmt, f"{writer} v_cache")
    for slot in (0, 2, 3, 5):
        assert_same_bytes(kc[slot], kc0[slot], f"{writer} k_cache untouched row {slot}")
        assert_same_bytes(vc[slot], vc0[slot], f"{writer} v_cache untouched row {slot}")


# ----------------------------------------------------------------------------------------------
# Non-power-of-two scales: the division is IEEE float32 division, rounded once to float32 and then
# rounded again to FP8 (docs/contract.md, "The write"). These inputs sit where that matters:
# multiplying by a float32 reciprocal, or rounding the exact quotient directly to FP8, gives a
# different byte.
# float32(0.1) = 13421773 * 2**-27, float32(0.37) = 12415139 * 2**-25, float32(3.3) = 13841203 * 2**-22.

# (id, float32 input, scale, cache dtype, expected byte, what goes wrong otherwise)
# fmt: off
DIVISION_CASES = [
    ("e4m3_s0.1_quotient_is_tie_1.0625", 0.10625000298023224, 0.1, E4M3, 0x38, "exact quotient is above the tie -> 0x39"),
    ("e4m3_s0.1_quotient_is_tie_1.1875", 0.11874999850988388, 0.1, E4M3, 0x3A, "exact quotient is below the tie -> 0x39"),
    ("e4m3_s0.1_quotient_below_1.9375", 0.19374999403953552, 0.1, E4M3, 0x3F, "x * (1/s) rounds to the tie 1.9375 -> 0x40"),
    ("e4m3_s0.37_quotient_below_1.1875", 0.43937498331069946, 0.37, E4M3, 0x39, "x * (1/s) rounds to the tie -> 0x3A"),
    ("e4m3_s0.37_quotient_below_1.6875", 0.6243749856948853, 0.37, E4M3, 0x3D, "x * (1/s) rounds to the tie -> 0x3E"),
    ("e4m3_s3.3_quotient_is_tie_1.0625", 3.5062501430511475, 3.3, E4M3, 0x38, "x * (1/s) and the exact quotient -> 0x39"),
    ("e4m3_s3.3_quotient_is_tie_1.9375", 6.393749713897705, 3.3, E4M3, 0x40, "exact quotient is below the tie -> 0x3F"),
    ("e5m2_s0.1_quotient_is_tie_1.125", 0.11250000447034836, 0.1, E5M2_T, 0x3C, "exact quotient is above the tie -> 0x3D"),
    ("e5m2_s0.37_quotient_is_tie_1.125", 0.4162500202655792, 0.37, E5M2_T, 0x3C, "x * (1/s) and the exact quotient -> 0x3D"),
    ("e5m2_s3.3_quotient_is_tie_1.125", 3.7125000953674316, 3.3, E5M2_T, 0x3C, "x * (1/s) and the exact quotient -> 0x3D"),
    # float32-subnormal inputs divided by the smallest accepted scale 2**-126: no flush to zero allowed
    ("e5m2_f32_subnormal_x_2^-140_over_2^-126", 2.0 ** -140, 2.0 ** -126, E5M2_T, 0x04, "flushing x to 0 -> 0x00"),
    ("e5m2_f32_subnormal_x_3*2^-143_over_2^-126", 3 * 2.0 ** -143, 2.0 ** -126, E5M2_T, 0x02, "tie 1.5 quanta -> 2"),
    ("e4m3_f32_subnormal_x_7*2^-136_over_2^-126", 7 * 2.0 ** -136, 2.0 ** -126, E4M3, 0x04, "tie 3.5 quanta -> 4"),
]
# fmt: on


@pytest.mark.parametrize("case", DIVISION_CASES, ids=[c[0] for c in DIVISION_CASES])
def test_division_literals(case):
    name, x, s, cache_dtype, code, _why = case
    fmt = FORMAT_OF[cache_dtype]
    assert q_exact(x, s, fmt) == code, f"oracle disagrees with the literal for {name}"
    for scale in (s, torch.tensor(s, dtype=torch.float32), torch.tensor([s, s], dtype=torch.float32)):
        xt = torch.tensor([x, -x], dtype=torch.float32).reshape(1, 2, 1).expand(1, 2, 3).contiguous()
        expected = np.array([[code] * 3, [code ^ 0x80] * 3]).reshape(1, 2, 3)
        assert_codes_equal(kvpool.quantize(xt, cache_dtype, scale), expected, fmt, f"quantize {name}")
        for writer, fn in WRITERS.items():
            if writer == "fused_interp" and not INTERPRETER:
                continue
            kc, vc = _poisoned_caches(2, 2, 3, cache_dtype)
            fn(xt, xt, kc, vc, torch.tensor([1], dtype=torch.int32), scale, scale)
            assert_codes_equal(kc[1:], expected, fmt, f"{writer} k {name} scale={scale!r}")
            assert_codes_equal(vc[1:], expected, fmt, f"{writer} v {name} scale={scale!r}")


_ALL16 = torch.from_numpy(np.arange(1 << 16, dtype=np.uint16).view(np.int16).copy())
ALL_BF16 = _ALL16.view(torch.bfloat16).reshape(256, 1, 256)
ALL_FP16 = _ALL16.view(torch.float16).reshape(256, 1, 256)


@pytest.mark.parametrize("scale", [None, 0.1, 0.37, 3.3, 1e-3, 1e3], ids=lambda s: f"s={s}")
@pytest.mark.parametrize("in_name", ["all_bf16", "all_fp16"])
@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2_T], ids=FMT_ID.get)
def test_quantize_every_16bit_pattern_matches_oracle(cache_dtype, in_name, scale):
    """Every bf16 / fp16 bit pattern (NaNs and infs included) through quantize and the reference write."""
    x = ALL_BF16 if in_name == "all_bf16" else ALL_FP16
    fmt = FORMAT_OF[cache_dtype]
    expected = q_codes(x, cache_dtype, scale)
    assert_codes_equal(kvpool.quantize(x, cache_dtype, scale), expected, fmt, f"quantize {in_name}")
    kc, vc = _poisoned_caches(256, 1, 256, cache_dtype)
    loc = torch.arange(255, -1, -1)
    kvpool.reference_set_kv_buffer(x, x, kc, vc, loc, scale, scale)
    assert_codes_equal(kc.flip(0), expected, fmt, f"reference write {in_name}")


@needs_interpreter
@pytest.mark.parametrize("scale", [0.1, 0.37, 3.3], ids=lambda s: f"s={s}")
@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2_T], ids=FMT_ID.get)
def test_fused_interpreter_every_bf16_pattern_matches_oracle(cache_dtype, scale):
    x = ALL_BF16
    fmt = FORMAT_OF[cache_dtype]
    expected = q_codes(x, cache_dtype, scale)
    kc, vc = _poisoned_caches(257, 1, 256, cache_dtype)
    loc = torch.arange(1, 257, dtype=torch.int32)
    kvpool.fused_fp8_set_kv_buffer(x, x, kc, vc, loc, scale, torch.tensor([scale]))
    assert_codes_equal(kc[1:], expected, fmt, "fused k, every bf16 pattern")
    assert_codes_equal(vc[1:], expected, fmt, "fused v, every bf16 pattern")
    assert (codes_of(kc[0]) == 0xFF).all()


def _random_fp32(shape, seed, exp_lo=110, exp_hi=146):
    """float32 values with random signs and mantissas and exponent fields in [exp_lo, exp_hi)
    (2**-17 .. 2**18 by default: FP8 subnormals, normals and overflow), plus a few inf/NaN/zeros."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    sign = rng.integers(0, 2, n, dtype=np.uint32) << 31
    exp = rng.integers(exp_lo, exp_hi, n, dtype=np.uint32) << 23
    man = rng.integers(0, 1 << 23, n, dtype=np.uint32)
    bits = sign | exp | man
    special = np.array([0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x00000000, 0x80000000,
                        0x00000001, 0x80400000], dtype=np.uint32)
    bits[rng.choice(n, size=len(special), replace=False)] = special
    return torch.from_numpy(bits.view(np.float32).reshape(shape).copy())


@needs_interpreter
def test_fused_interpreter_random_fp32_matches_oracle():
    """float32 inputs spanning the FP8 ranges, per-tensor scale 0.37 and per-head 3.3/1e-3, both formats."""
    x = _random_fp32((64, 2, 128), seed=7)
    for cache_dtype in (E4M3, E5M2_T):
        fmt = FORMAT_OF[cache_dtype]
        for writer, fn in WRITERS.items():
            kc, vc = _poisoned_caches(64, 2, 128, cache_dtype)
            vs = torch.tensor([3.3, 1e-3])
            fn(x, x, kc, vc, torch.arange(64), 0.37, vs)
            assert_codes_equal(kc, q_codes(x, cache_dtype, 0.37), fmt, f"{writer} k, random fp32")
            assert_codes_equal(vc, q_codes(x, cache_dtype, vs), fmt, f"{writer} v, random fp32")


# ----------------------------------------------------------------------------------------------
# 16-bit and float32 caches: the plain cast; scales are ignored.

# (id, input dtype, x, cache dtype, expected 16-bit code)
# fmt: off
CAST_CASES = [
    ("f32->bf16_tie_1+2^-8_down", torch.float32, 1 + 2.0 ** -8, torch.bfloat16, 0x3F80),
    ("f32->bf16_tie_1+3*2^-8_up", torch.float32, 1 + 3 * 2.0 ** -8, torch.bfloat16, 0x3F82),
    ("f32->bf16_above_tie", torch.float32, 1 + 2.0 ** -8 + 2.0 ** -20, torch.bfloat16, 0x3F81),
    ("f32->bf16_max_f32_overflows", torch.float32, 3.4028234663852886e38, torch.bfloat16, 0x7F80),
    ("f32->bf16_neg_zero", torch.float32, -0.0, torch.bfloat16, 0x8000),
    ("f32->bf16_min_normal", torch.float32, 2.0 ** -126, torch.bfloat16, 0x0080),
    ("f32->bf16_f32_subnormal_to_zero", torch.float32, 2.0 ** -149, torch.bfloat16, 0x0000),
    ("f32->bf16_subnormal", torch.float32, 2.0 ** -133, torch.bfloat16, 0x0001),
    ("f32->fp16_max", torch.float32, 65504.0, torch.float16, 0x7BFF),
    ("f32->fp16_below_overflow_tie", torch.float32, 65519.0, torch.float16, 0x7BFF),
    ("f32->fp16_overflow_tie_to_inf", torch.float32, 65520.0, torch.float16, 0x7C00),
    ("f32->fp16_1e6_inf", torch.float32, 1e6, torch.float16, 0x7C00),
    ("f32->fp16_neg_inf", torch.float32, -INF, torch.float16, 0xFC00),
    ("f32->fp16_min_subnormal", torch.float32, 2.0 ** -24, torch.float16, 0x0001),
    ("f32->fp16_tie_2^-25_to_zero", torch.float32, 2.0 ** -25, torch.float16, 0x0000),
    ("f32->fp16_neg_tie_to_neg_zero", torch.float32, -(2.0 ** -25), torch.float16, 0x8000),
    ("f32->fp16_tie_3*2^-25_to_2", torch.float32, 3 * 2.0 ** -25, torch.float16, 0x0002),
    ("f32->fp16_tie_1+2^-11_down", torch.float32, 1 + 2.0 ** -11, torch.float16, 0x3C00),
    ("f32->fp16_tie_1+3*2^-11_up", torch.float32, 1 + 3 * 2.0 ** -11, torch.float16, 0x3C02),
    ("bf16->fp16_1+2^-7", torch.bfloat16, 1 + 2.0 ** -7, torch.float16, 0x3C08),
    ("bf16->fp16_65536_inf", torch.bfloat16, 65536.0, torch.float16, 0x7C00),
    ("bf16->fp16_2^-30_to_zero", torch.bfloat16, 2.0 ** -30, torch.float16, 0x0000),
    ("fp16->bf16_1+2^-10_down", torch.float16, 1 + 2.0 ** -10, torch.bfloat16, 0x3F80),
    ("fp16->bf16_tie_1+2^-8_down", torch.float16, 1 + 2.0 ** -8, torch.bfloat16, 0x3F80),
    ("fp16->bf16_tie_1+3*2^-8_up", torch.float16, 1 + 3 * 2.0 ** -8, torch.bfloat16, 0x3F82),
    ("fp16->bf16_65504", torch.float16, 65504.0, torch.bfloat16, 0x4780),  # 1.999 * 2**15 -> 2**16
]
# fmt: on


@pytest.mark.parametrize("writer", ["quantize", *WRITERS], ids=str)
@pytest.mark.parametrize("case", CAST_CASES, ids=[c[0] for c in CAST_CASES])
def test_16bit_cache_cast_literals(case, writer):
    name, in_dtype, x, cache_dtype, code = case
    skip_fused_without_interpreter(writer)
    fmt = FORMAT_OF[cache_dtype]
    xt = torch.tensor([x], dtype=torch.float64).to(in_dtype).reshape(1, 1, 1)
    assert xt.double().item() == x or math.isinf(x), "input not exactly representable"
    assert int(q_codes(xt, cache_dtype, 0.5)[0, 0, 0]) == code, f"oracle disagrees with literal {name}"
    expected = np.array([[[code]]])
    if writer == "quantize":
        got = kvpool.quantize(xt, cache_dtype, 0.5)  # the scale must be ignored
        assert_codes_equal(got, expected, fmt, name)
        return
    kc = torch.full((3, 1, 1), float("nan"), dtype=cache_dtype)
    vc = kc.clone()
    WRITERS[writer](xt, xt, kc, vc, torch.tensor([2]), 0.5, torch.tensor([0.25]))
    assert_codes_equal(kc[2:], expected, fmt, f"{writer} k {name}")
    assert_codes_equal(vc[2:], expected, fmt, f"{writer} v {name}")


# ==============================================================================================
# Properties of the write against the oracle. The reference function runs on every example; the
# Triton kernel (interpreter) and the pool on fewer.

LAYOUTS = ["contiguous", "qkv_slice", "tokens_last", "d_strided", "heads_transposed"]
GUARD = 2  # guard rows on each side of a caller-owned cache


def _examples(n_at_ci: int) -> int:
    """Examples for an interpreter-heavy test: n_at_ci under the "ci" profile (60), scaled with the profile."""
    return max(5, n_at_ci * settings().max_examples // 60)


# ----------------------------------------------------------------------------------------------
# Building one example.


def _make_input(rng: np.random.Generator, T: int, H: int, D: int, dtype, layout: str, regime: str,
                centre: float, specials: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H, D] of ``dtype`` laid out as ``layout``; returns (x, base) where base owns the memory."""
    lo, hi = {"tiny": (-22, -6), "normal": (-8, 9), "huge": (8, 22), "wide": (-30, 22)}[regime]
    n = T * H * D
    e = rng.integers(lo, hi, n) + centre
    vals = (rng.uniform(1.0, 2.0, n) * np.exp2(e) * rng.choice([-1.0, 1.0], n))
    if regime == "tiny":  # also exact multiples of tiny powers of two: ties in the subnormal range
        k = rng.integers(0, 16, n) * np.exp2(np.floor(centre) - rng.integers(8, 19, n))
        vals = np.where(rng.random(n) < 0.5, vals, k * rng.choice([-1.0, 1.0], n))
    if specials and n:
        m = max(1, n // 30)
        idx = rng.choice(n, size=m, replace=True)
        vals[idx] = rng.choice([np.inf, -np.inf, np.nan, 0.0, -0.0], size=m)
    vals = torch.from_numpy(vals.reshape(T, H, D)).to(dtype)
    if layout == "contiguous":
        base = vals.clone()
        return base, base
    if layout == "qkv_slice":  # k or v sliced out of a fused projection [T, Hq + H + pad, D + 3]
        base = torch.full((T, H + 3, D + 3), 7.0, dtype=dtype)
        x = base[:, 2:2 + H, 1:1 + D]
        x.copy_(vals)
        return x, base
    if layout == "tokens_last":  # stored [H, D, T]: every stride differs from the contiguous one
        base = vals.permute(1, 2, 0).contiguous()
        return base.permute(2, 0, 1), base
    if layout == "d_strided":  # head_dim not contiguous
        base = torch.full((T, H, 2 * D), -3.0, dtype=dtype)
        x = base[:, :, ::2]
        x.copy_(vals)
        return x, base
    if layout == "heads_transposed":  # stored [T, D, H]
        base = vals.transpose(1, 2).contiguous()
        return base.transpose(1, 2), base
    raise AssertionError(layout)


@dataclasses.dataclass
class Example:
    T: int
    H: int
    D: int
    Hv: int
    Dv: int
    k_dtype: torch.dtype
    v_dtype: torch.dtype
    cache_dtype: torch.dtype
    slots: int
    loc: torch.Tensor
    loc_base: torch.Tensor
    k_scale: object
    v_scale: object
    k: torch.Tensor
    v: torch.Tensor
    k_base: torch.Tensor
    v_base: torch.Tensor
    poison: int

    def __repr__(self) -> str:
        def sc(s):
            if isinstance(s, torch.Tensor):
                return f"tensor{tuple(s.shape)}:{s.dtype}={s.reshape(-1).tolist()}"
            return repr(s)

        return (f"Example(T={self.T}, H={self.H}, D={self.D}, Hv={self.Hv}, Dv={self.Dv}, "
                f"k={self.k_dtype} strides {self.k.stride()}, v={self.v_dtype} strides {self.v.stride()}, "
                f"cache={self.cache_dtype}, slots={self.slots}, loc={self.loc.tolist()} ({self.loc.dtype}), "
                f"k_scale={sc(self.k_scale)}, v_scale={sc(self.v_scale)}, poison=0x{self.poison:02x})")


def _draw_scale(draw, H: int, kind: str, tensor_dtypes) -> object:
    value = st.one_of(
        st.sampled_from([1.0, 0.5, 2.0, 0.1, 0.37, 3.3, 1e-3, 1e3, 0.0123, 448.0 / 3]),
        st.floats(min_value=1e-3, max_value=1e3, allow_nan=False, allow_infinity=False),
    )
    if kind == "none":
        return None
    if kind == "float":
        return draw(value)
    dtype = draw(st.sampled_from(tensor_dtypes))
    if kind == "per_tensor":
        shape = draw(st.sampled_from([(), (1,), (1, 1)]))
        return torch.tensor(draw(value), dtype=torch.float64).to(dtype).reshape(shape)
    vals = [draw(value) for _ in range(H)]
    t = torch.tensor(vals, dtype=torch.float64).to(dtype)
    form = draw(st.sampled_from(["H", "H1", "H_strided", "H1_strided"]))
    if form.endswith("strided"):  # a column of a wider table: per-head values at stride 2
        wide = torch.full((H, 2), 1e30, dtype=torch.float64).to(dtype)
        wide[:, 0] = t
        t = wide[:, 0] if form == "H_strided" else wide[:, :1]
        return t
    return t if form == "H" else t.reshape(H, 1)


@st.composite
def examples(draw, *, max_T=8, dims=(1, 5, 8, 16, 96), cache_dtypes=CACHE_DTYPES,
             scale_tensor_dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64),
             same_heads=False, layouts=LAYOUTS, strided_loc=True):
    T = draw(st.sampled_from([t for t in (0, 1, 2, 3, 7, 8) if t <= max_T]))
    H = draw(st.integers(1, 4))
    Hv = H if same_heads else draw(st.integers(1, 4))
    D = draw(st.sampled_from(dims))
    Dv = draw(st.sampled_from(dims))
    cache_dtype = draw(st.sampled_from(cache_dtypes))
    k_dtype = draw(st.sampled_from(INPUT_DTYPES))
    v_dtype = draw(st.sampled_from(INPUT_DTYPES))
    scale_kinds = ["none", "float", "per_tensor", "per_head"]
    k_scale = _draw_scale(draw, H, draw(st.sampled_from(scale_kinds)), scale_tensor_dtypes)
    v_scale = _draw_scale(draw, Hv, draw(st.sampled_from(scale_kinds)), scale_tensor_dtypes)

    # slots: each token is padding (< 0), a distinct valid slot, or out of range (>= slots)
    slots = T + draw(st.integers(2, 5))  # >= 2: a pool needs size = slots - 1 >= 1
    loc_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    big = 2**31 - 1 if loc_dtype == torch.int32 else 2**40
    small = -(2**31) if loc_dtype == torch.int32 else -(2**40)
    free = list(draw(st.permutations(range(slots))))
    loc = []
    for _ in range(T):
        kind = draw(st.sampled_from(["valid", "valid", "valid", "negative", "out_of_range"]))
        if kind == "valid":
            loc.append(free.pop())
        elif kind == "negative":
            loc.append(draw(st.sampled_from([-1, -2, -slots, small])))
        else:
            loc.append(draw(st.sampled_from([slots, slots + 1, slots + GUARD, big])))
    loc_t = torch.tensor(loc, dtype=loc_dtype)
    if strided_loc and draw(st.booleans()):  # a strided loc (every other entry of a longer buffer)
        loc_base = torch.full((2 * T,), 12345, dtype=loc_dtype)
        loc_base[::2] = loc_t
        loc_t = loc_base[::2]
    else:
        loc_base = loc_t

    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)

    def centre(s):
        if isinstance(s, torch.Tensor):
            return float(np.log2(float(s.double().reshape(-1)[0])))
        return float(np.log2(s)) if s is not None else 0.0

    # values are placed relative to the scale so the quotient covers the FP8 ranges
    specials = draw(st.booleans())
    k, k_base = _make_input(rng, T, H, D, k_dtype, draw(st.sampled_from(layouts)),
                            draw(st.sampled_from(["tiny", "normal", "huge", "wide"])),
                            round(centre(k_scale)), specials)
    v, v_base = _make_input(rng, T, Hv, Dv, v_dtype, draw(st.sampled_from(layouts)),
                            draw(st.sampled_from(["tiny", "normal", "huge", "wide"])),
                            round(centre(v_scale)), specials)
    poison = draw(st.sampled_from([0xFF, 0xA5]))
    return Example(T, H, D, Hv, Dv, k_dtype, v_dtype, cache_dtype, slots, loc_t, loc_base,
                   k_scale, v_scale, k, v, k_base, v_base, poison)


# ----------------------------------------------------------------------------------------------
# Running one example through a write function and checking everything.


CACHE_LAYOUTS = {
    # name: (outer shape from (slots, H, D), the cache as a view of the outer tensor)
    "contiguous": (lambda s, h, d: (s + 2 * GUARD, h, d), lambda o, s, h, d: o[GUARD:GUARD + s]),
    "padded_head_dim": (lambda s, h, d: (s + 2 * GUARD, h, d + 3), lambda o, s, h, d: o[GUARD:GUARD + s, :, 1:1 + d]),
    "heads_of_wider": (lambda s, h, d: (s + 2 * GUARD, h + 2, d), lambda o, s, h, d: o[GUARD:GUARD + s, 1:1 + h]),
    "every_other_slot": (lambda s, h, d: (2 * s + 2 * GUARD, h, d), lambda o, s, h, d: o[GUARD:GUARD + 2 * s:2]),
}


def _guarded_cache(slots, H, D, dtype, poison, layout="contiguous"):
    """A [slots, H, D] cache viewed inside a larger poisoned tensor (guard rows before and after).

    Returns (cache, outer, inside) where ``inside`` marks the elements of ``outer`` that are the cache."""
    shape_of, view_of = CACHE_LAYOUTS[layout]
    outer = torch.empty(shape_of(slots, H, D), dtype=dtype)
    outer.view(torch.uint8).fill_(poison)
    inside = torch.zeros(outer.shape, dtype=torch.bool)
    view_of(inside, slots, H, D).fill_(True)
    return view_of(outer, slots, H, D), outer, inside


def _snapshot(ex: Example):
    return [t.clone() if isinstance(t, torch.Tensor) else t
            for t in (ex.k_base, ex.v_base, ex.loc_base, ex.k_scale, ex.v_scale)]


def _check_inputs_unchanged(ex: Example, snap) -> None:
    names = ("k (and the tensor it views)", "v (and the tensor it views)", "loc", "k_scale", "v_scale")
    now = (ex.k_base, ex.v_base, ex.loc_base, ex.k_scale, ex.v_scale)
    for name, before, after in zip(names, snap, now):
        if isinstance(before, torch.Tensor):
            assert_same_bytes(after, before, f"input {name}")


def _check_written(ex: Example, cache: torch.Tensor, outer: torch.Tensor, inside: torch.Tensor, x: torch.Tensor,
                   scale, what: str):
    fmt = FORMAT_OF[ex.cache_dtype]
    poisoned = torch.empty(cache.shape, dtype=cache.dtype)
    poisoned.view(torch.uint8).fill_(ex.poison)
    before = codes_of(poisoned)
    expected = expected_cache(before, x, ex.loc.tolist(), ex.cache_dtype, scale)
    assert_codes_equal(cache, expected, fmt, f"{what}; {ex!r}")
    # rows not named: the exact poison bytes (NaN-leniency would hide a stray NaN write)
    named = {int(l) for l in ex.loc.tolist() if 0 <= int(l) < ex.slots}
    for slot in range(ex.slots):
        if slot not in named:
            assert_same_bytes(cache[slot], poisoned[slot], f"{what}: untouched row {slot}; {ex!r}")
    outside = outer.view(torch.uint8)[~inside.unsqueeze(-1).expand(*outer.shape, outer.element_size())
                                      .reshape(*outer.shape[:-1], -1)]
    bad = torch.nonzero(outside != ex.poison)
    assert bad.numel() == 0, (f"{what}: {bad.shape[0]} bytes outside the cache view changed "
                              f"(first: flat {bad[0].tolist()}, now 0x{int(outside[bad[0, 0]]):02x}); {ex!r}")


def _run_function(fn, ex: Example, what: str, k_layout="contiguous", v_layout="contiguous") -> None:
    kc, k_outer, k_in = _guarded_cache(ex.slots, ex.H, ex.D, ex.cache_dtype, ex.poison, k_layout)
    vc, v_outer, v_in = _guarded_cache(ex.slots, ex.Hv, ex.Dv, ex.cache_dtype, ex.poison ^ 0x5A, v_layout)
    what = f"{what} [caches {k_layout}/{v_layout}]"
    snap = _snapshot(ex)
    ret = fn(ex.k, ex.v, kc, vc, ex.loc, ex.k_scale, ex.v_scale)
    assert ret is None, f"{what} returned {ret!r}"
    _check_inputs_unchanged(ex, snap)
    _check_written(ex, kc, k_outer, k_in, ex.k, ex.k_scale, f"{what} k_cache")
    ex_v = dataclasses.replace(ex, poison=ex.poison ^ 0x5A)
    _check_written(ex_v, vc, v_outer, v_in, ex.v, ex.v_scale, f"{what} v_cache")


@given(ex=examples(), k_layout=st.sampled_from(list(CACHE_LAYOUTS)), v_layout=st.sampled_from(list(CACHE_LAYOUTS)))
def test_reference_write_equals_oracle(ex, k_layout, v_layout):
    _run_function(kvpool.reference_set_kv_buffer, ex, "reference_set_kv_buffer", k_layout, v_layout)


@settings(max_examples=_examples(40))
@given(ex=examples(max_T=7, dims=(1, 5, 16, 96), scale_tensor_dtypes=(torch.float32,), strided_loc=False),
       k_layout=st.sampled_from(list(CACHE_LAYOUTS)), v_layout=st.sampled_from(list(CACHE_LAYOUTS)))
@needs_interpreter
def test_fused_interpreter_write_equals_oracle(ex, k_layout, v_layout):
    _run_function(kvpool.fused_fp8_set_kv_buffer, ex, "fused_fp8_set_kv_buffer (interpreter)", k_layout, v_layout)


@given(ex=examples(max_T=8))
def test_quantize_equals_oracle(ex):
    snap = ex.k_base.clone()
    got = kvpool.quantize(ex.k, ex.cache_dtype, ex.k_scale)
    assert got.dtype == ex.cache_dtype and tuple(got.shape) == tuple(ex.k.shape)
    assert_codes_equal(got, q_codes(ex.k, ex.cache_dtype, ex.k_scale), FORMAT_OF[ex.cache_dtype],
                       f"quantize; {ex!r}")
    assert_same_bytes(ex.k_base, snap, "quantize input")




@pytest.mark.parametrize("writer", [
    pytest.param("reference", id="reference"),
    pytest.param("fused_interp", id="fused_interp"),
])
@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64], ids=str)
def test_strided_loc_is_read_with_its_stride(writer, loc_dtype):
    """loc as a view with stride 2 (e.g. a column of a [T, 2] index table): tokens go to loc[t]."""
    skip_fused_without_interpreter(writer)
    fn = {"reference": kvpool.reference_set_kv_buffer, "fused_interp": kvpool.fused_fp8_set_kv_buffer}[writer]
    k = torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]], [[5.0, 6.0]]])
    loc_base = torch.tensor([[5, 0], [1, 2], [-1, 3]], dtype=loc_dtype)
    loc = loc_base[:, 0]  # [5, 1, -1], stride 2
    kc = torch.full((6, 1, 2), float("nan"), dtype=torch.float8_e4m3fn)
    vc = kc.clone()
    before = codes_of(kc)
    fn(k, k, kc, vc, loc)
    expected = expected_cache(before, k, [5, 1, -1], torch.float8_e4m3fn)
    assert_codes_equal(kc, expected, FORMAT_OF[torch.float8_e4m3fn], f"{writer} with loc strides {loc.stride()}")
    assert_same_bytes(kc[[0, 2, 3, 4]], torch.from_numpy(before[[0, 2, 3, 4]].astype(np.uint8)).view(torch.float8_e4m3fn),
                      "rows not named")


@pytest.mark.parametrize("mode", [
    pytest.param("never", id="never"),
    pytest.param("always", id="always"),
])
def test_pool_strided_loc_is_read_with_its_stride(mode):
    skip_fused_without_interpreter(mode)
    with mock.patch.dict(os.environ):
        os.environ.pop("KVPOOL_FUSED", None)
        pool = kvpool.MHATokenToKVPool(5, 1, torch.float8_e5m2, 1, 2, 1, "cpu", fused=mode)
    k = torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]]], dtype=torch.bfloat16)
    loc = torch.tensor([[4, 0], [2, 1]])[:, 0]  # [4, 2], stride 2
    kb, vb = pool.get_kv_buffer(0)
    kb.view(torch.uint8).fill_(0xA5)
    before = codes_of(kb)
    pool.set_kv_buffer(Layer(0), loc, k, k)
    expected = expected_cache(before, k, [4, 2], torch.float8_e5m2)
    assert_codes_equal(kb, expected, FORMAT_OF[torch.float8_e5m2], f"pool[{mode}] with loc strides {loc.stride()}")


def test_duplicate_slots_write_one_of_the_tokens():
    """Which token wins a duplicated slot is unspecified (docs/contract.md, "The write"); with one head
    and one block per row, as here, the row is one of them, whole."""
    k = torch.tensor([[[1.0, 2.0, 3.0]], [[-5.0, 0.25, 100.0]], [[7.0, 7.0, 7.0]]])
    loc = torch.tensor([2, 2, 0])
    writers = [kvpool.reference_set_kv_buffer] + ([kvpool.fused_fp8_set_kv_buffer] if INTERPRETER else [])
    for fn in writers:
        for dtype in (torch.float8_e4m3fn, torch.bfloat16):
            kc = torch.full((4, 1, 3), float("nan"), dtype=dtype)
            vc = kc.clone()
            fn(k, k, kc, vc, loc, 0.5, 0.5)
            rows = q_codes(k, dtype, 0.5)
            got = codes_of(kc)
            assert any((got[2] == rows[t]).all() for t in (0, 1)), f"{fn.__name__} {dtype}: slot 2 = {got[2]}"
            assert (got[0] == rows[2]).all()
            assert (codes_of(kc[1]) == codes_of(torch.full((1, 3), float("nan"), dtype=dtype))).all()


# ----------------------------------------------------------------------------------------------
# The pool: fused="never" (reference path) and fused="always" (interpreter) against the oracle.


def _pool_example(ex: Example, start_layer: int, mode: str):
    size = ex.slots - 1  # buffers have size + page_size = slots rows with page_size 1
    pool = kvpool.MHATokenToKVPool(size, 1, ex.cache_dtype, ex.H, ex.D, 2, "cpu", v_head_dim=ex.Dv,
                                   start_layer=start_layer, fused=mode)
    return pool


@settings(max_examples=_examples(30), suppress_health_check=[HealthCheck.too_slow])
@given(ex=examples(max_T=7, dims=(1, 5, 16, 96), scale_tensor_dtypes=(torch.float32,), same_heads=True,
                   strided_loc=False),
       mode=st.sampled_from(["never", "always"] if INTERPRETER else ["never"]), start_layer=st.sampled_from([0, 3]),
       which=st.sampled_from([0, 1]), via_override=st.booleans())
def test_pool_write_equals_oracle(ex, mode, start_layer, which, via_override):
    with mock.patch.dict(os.environ):
        os.environ.pop("KVPOOL_FUSED", None)
        os.environ.pop("KVPOOL_VALIDATE", None)
        pool = _pool_example(ex, start_layer, mode)
    layer_id = start_layer + which
    other = start_layer + 1 - which
    bufs = {}
    for lid in (layer_id, other):
        kb, vb = pool.get_kv_buffer(lid)
        assert kb.dtype == ex.cache_dtype and tuple(kb.shape) == (ex.slots, ex.H, ex.D)
        assert tuple(vb.shape) == (ex.slots, ex.H, ex.Dv)
        kb.view(torch.uint8).fill_(ex.poison)
        vb.view(torch.uint8).fill_(ex.poison ^ 0x5A)
        bufs[lid] = (kb.clone(), vb.clone())
    snap = _snapshot(ex)
    before = dataclasses.replace(pool.stats, reasons=dict(pool.stats.reasons))
    if via_override:
        ret = pool.set_kv_buffer(None, ex.loc, ex.k, ex.v, ex.k_scale, ex.v_scale, layer_id_override=layer_id)
    else:
        ret = pool.set_kv_buffer(Layer(layer_id), ex.loc, ex.k, ex.v, ex.k_scale, ex.v_scale)
    assert ret is None
    _check_inputs_unchanged(ex, snap)
    fmt = FORMAT_OF[ex.cache_dtype]
    kb, vb = pool.get_kv_buffer(layer_id)
    exp_k = expected_cache(codes_of(bufs[layer_id][0]), ex.k, ex.loc.tolist(), ex.cache_dtype, ex.k_scale)
    exp_v = expected_cache(codes_of(bufs[layer_id][1]), ex.v, ex.loc.tolist(), ex.cache_dtype, ex.v_scale)
    assert_codes_equal(kb, exp_k, fmt, f"pool[{mode}] layer {layer_id} K; {ex!r}")
    assert_codes_equal(vb, exp_v, fmt, f"pool[{mode}] layer {layer_id} V; {ex!r}")
    named = {int(l) for l in ex.loc.tolist() if 0 <= int(l) < ex.slots}
    for slot in range(ex.slots):
        if slot not in named:
            assert_same_bytes(kb[slot], bufs[layer_id][0][slot], f"pool K untouched row {slot}")
            assert_same_bytes(vb[slot], bufs[layer_id][1][slot], f"pool V untouched row {slot}")
    ok, ov = pool.get_kv_buffer(other)
    assert_same_bytes(ok, bufs[other][0], f"pool K of the other layer {other}")
    assert_same_bytes(ov, bufs[other][1], f"pool V of the other layer {other}")
    # the path taken is the one asked for (T == 0 is a no-op that may take no path at all)
    stats = pool.stats
    if ex.T == 0:
        assert stats.fused_calls + stats.reference_calls <= before.fused_calls + before.reference_calls + 1
    elif mode == "always":
        assert stats.fused_calls == before.fused_calls + 1, stats
        assert stats.reference_calls == before.reference_calls, stats
    else:
        assert stats.reference_calls == before.reference_calls + 1, stats
        assert stats.fused_calls == before.fused_calls, stats


# ----------------------------------------------------------------------------------------------
# A deliberate grid of shapes (head dims around block sizes, many heads, many tokens), both paths.

# (id, T, H, D, Hv, Dv)
SHAPES = [
    ("T7-H3-D96", 7, 3, 96, 3, 96),
    ("T1-H1-D1", 1, 1, 1, 1, 1),
    ("T3-H2-D576-Dv512", 3, 2, 576, 2, 512),
    ("T2-H8-D128-Hv1", 2, 8, 128, 1, 128),
    ("T5-H4-D160-Hv2-Dv192", 5, 4, 160, 2, 192),
    ("T300-H1-D8", 300, 1, 8, 1, 8),
    ("T1-H32-D64", 1, 32, 64, 32, 64),
    ("T4-H2-D129-Dv127", 4, 2, 129, 2, 127),
]


@pytest.mark.parametrize("writer", ["reference", "fused_interp"])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_shape_grid_equals_oracle(shape, cache_dtype, writer):
    skip_fused_without_interpreter(writer)
    _, T, H, D, Hv, Dv = shape
    rng = np.random.default_rng(T * 1000 + H * 10 + D)
    slots = T + 3
    perm = rng.permutation(slots)[:T]
    loc = [int(s) if rng.random() > 0.15 else int(rng.choice([-1, slots, slots + 7])) for s in perm]
    k, k_base = _make_input(rng, T, H, D, torch.bfloat16, "qkv_slice", "wide", -1, True)
    v, v_base = _make_input(rng, T, Hv, Dv, torch.float32, "tokens_last", "normal", 3, True)
    k_scale = 0.37
    v_scale = torch.tensor(rng.uniform(1.0, 16.0, Hv), dtype=torch.float32)
    ex = Example(T, H, D, Hv, Dv, torch.bfloat16, torch.float32, cache_dtype, slots,
                 torch.tensor(loc, dtype=torch.int32), torch.tensor(loc, dtype=torch.int32), k_scale, v_scale,
                 k, v, k_base, v_base, 0xFF)
    fn = {"reference": kvpool.reference_set_kv_buffer, "fused_interp": kvpool.fused_fp8_set_kv_buffer}[writer]
    _run_function(fn, ex, writer, "padded_head_dim", "every_other_slot")


@pytest.mark.parametrize("writer", ["reference", "fused_interp"])
def test_integer_python_scales_are_floats(writer):
    """A Python int scale is a number like any other: 3 divides like 3.0."""
    skip_fused_without_interpreter(writer)
    fn = {"reference": kvpool.reference_set_kv_buffer, "fused_interp": kvpool.fused_fp8_set_kv_buffer}[writer]
    x = torch.tensor([[[1.0, 3.0, 5.0, 1000.0, -7.0]]])
    kc = torch.zeros(2, 1, 5, dtype=torch.float8_e4m3fn)
    vc = torch.zeros(2, 1, 5, dtype=torch.float8_e4m3fn)
    fn(x, x, kc, vc, torch.tensor([1]), 3, 2)
    assert_codes_equal(kc[1:], q_codes(x, torch.float8_e4m3fn, 3.0), FORMAT_OF[torch.float8_e4m3fn], "k, scale 3")
    assert_codes_equal(vc[1:], q_codes(x, torch.float8_e4m3fn, 2.0), FORMAT_OF[torch.float8_e4m3fn], "v, scale 2")
