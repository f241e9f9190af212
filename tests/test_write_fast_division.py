"""The write kernel's fast division, replayed step by step in NumPy with an exact float32 FMA, against
IEEE float32 division (on a GPU, the kernel code itself on 64M random pairs).
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from kvassert import assert_same_bytes, cuda_gen, gpu
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
