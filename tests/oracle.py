"""An independent oracle for the K/V write (docs/contract.md, "The write"), written from the format
definitions.

Nothing here calls kvpool, and nothing here uses torch's float->fp8 or float->16-bit conversions: the
encoders work on float32 bit patterns with integer arithmetic (vectorised, NumPy), and a second,
scalar encoder works on exact rationals (``fractions.Fraction``) so that the two can check each other.
torch appears only to move bytes between tensors and NumPy arrays.

q(x, s) = RNE(clamp(float32(x) / float32(s), -fmax, +fmax))   for FP8 caches
q(x, s) = RNE(float32(x)) into the cache format (plain cast)   for bf16 / fp16 / fp32 caches

Every encoder returns unsigned integer *codes* (the cache's bit patterns); NaN results are compared
by "is a NaN code", never by bit pattern, because the format allows many NaN encodings.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Optional, Sequence, Union

import numpy as np
import torch


@dataclasses.dataclass(frozen=True)
class Fmt:
    """A binary floating-point format: 1 sign bit, ``ebits`` exponent bits, ``mbits`` mantissa bits."""

    name: str
    ebits: int
    mbits: int
    bias: int
    saturating: bool  # FP8 writes clamp to +-fmax; the IEEE casts overflow to inf
    has_inf: bool

    @property
    def width(self) -> int:
        return 1 + self.ebits + self.mbits

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number."""
        return 1 - self.bias

    @property
    def sign_bit(self) -> int:
        return 1 << (self.width - 1)

    @property
    def max_code(self) -> int:
        """Code of the largest finite positive value."""
        if self.name == "e4m3fn":  # no infinities: only S.1111.111 is NaN
            return (((1 << self.ebits) - 1) << self.mbits) | ((1 << self.mbits) - 2)
        return (((1 << self.ebits) - 2) << self.mbits) | ((1 << self.mbits) - 1)

    @property
    def inf_code(self) -> Optional[int]:
        return (((1 << self.ebits) - 1) << self.mbits) if self.has_inf else None

    @property
    def nan_code(self) -> int:
        """One quiet NaN code (the oracle's canonical NaN)."""
        return (1 << (self.width - 1)) - 1

    @property
    def fmax(self) -> Fraction:
        return decode_exact(self.max_code, self)

    def is_nan_code(self, codes: np.ndarray) -> np.ndarray:
        mag = np.asarray(codes).astype(np.int64) & (self.sign_bit - 1)
        if self.name == "e4m3fn":
            return mag == self.nan_code
        return mag > self.inf_code


E4M3FN = Fmt("e4m3fn", ebits=4, mbits=3, bias=7, saturating=True, has_inf=False)
E5M2 = Fmt("e5m2", ebits=5, mbits=2, bias=15, saturating=True, has_inf=True)
BF16 = Fmt("bfloat16", ebits=8, mbits=7, bias=127, saturating=False, has_inf=True)
FP16 = Fmt("float16", ebits=5, mbits=10, bias=15, saturating=False, has_inf=True)
FP32 = Fmt("float32", ebits=8, mbits=23, bias=127, saturating=False, has_inf=True)

FORMAT_OF = {
    torch.float8_e4m3fn: E4M3FN,
    torch.float8_e5m2: E5M2,
    torch.bfloat16: BF16,
    torch.float16: FP16,
    torch.float32: FP32,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_UINT_OF_WIDTH = {8: (torch.uint8, np.uint8), 16: (torch.int16, np.uint16), 32: (torch.int32, np.uint32)}


# ----------------------------------------------------------------------------------------------
# Moving bytes between torch and NumPy (no value conversion anywhere).


def _dense(t: torch.Tensor) -> torch.Tensor:
    """A packed row-major copy (``contiguous()`` keeps odd strides on size-1 dims, which ``view`` rejects)."""
    out = torch.empty(t.shape, dtype=t.dtype)
    out.copy_(t.detach().cpu())
    return out


def codes_of(t: torch.Tensor) -> np.ndarray:
    """The bit patterns of a tensor of one of the five cache/input formats, as unsigned NumPy ints."""
    fmt = FORMAT_OF[t.dtype]
    tdt, ndt = _UINT_OF_WIDTH[fmt.width]
    return _dense(t).view(tdt).numpy().view(ndt).copy()


def float32_of(t: torch.Tensor) -> np.ndarray:
    """float32 values of a bf16/fp16/fp32 tensor, widened exactly with bit manipulation."""
    fmt = FORMAT_OF[t.dtype]
    c = codes_of(t).astype(np.uint32)
    if fmt is FP32:
        return c.view(np.float32)
    if fmt is BF16:  # bf16 is the top half of a float32
        return (c << 16).astype(np.uint32).view(np.float32)
    if fmt is FP16:  # IEEE half -> single is exact; NumPy implements it bit-exactly
        return c.astype(np.uint16).view(np.float16).astype(np.float32)
    raise TypeError(f"not an input format: {t.dtype}")


def scale_float32(scale: Union[None, float, torch.Tensor], num_heads: int) -> np.ndarray:
    """float32(s) for every head, shape [H]. None means 1; a Python float is rounded to float32 (RNE)."""
    if scale is None:
        return np.ones(num_heads, dtype=np.float32)
    if isinstance(scale, torch.Tensor):
        flat = scale.detach().reshape(-1)
        if flat.dtype == torch.float64:  # round float64 -> float32 in NumPy (IEEE RNE)
            vals = flat.numpy().astype(np.float32)
        else:
            vals = float32_of(flat)
        if vals.size == 1:
            return np.repeat(vals, num_heads)
        assert vals.size == num_heads, "oracle given a scale of the wrong shape"
        return vals
    return np.full(num_heads, np.float32(float(scale)), dtype=np.float32)


# ----------------------------------------------------------------------------------------------
# The vectorised encoder: integer arithmetic on float32 bit patterns.


def encode_f32(y: np.ndarray, fmt: Fmt) -> np.ndarray:
    """Round float32 values ``y`` to ``fmt`` (RNE), returning codes (int64 array, same shape).

    FP8 formats saturate: |y| > fmax and +-inf give +-fmax. IEEE formats overflow to +-inf.
    The sign of zero is kept (-0.0 and negative values that round to zero give the sign bit alone).
    NaN gives ``fmt.nan_code``.
    """
    y = np.ascontiguousarray(y, dtype=np.float32)
    u = y.view(np.uint32).astype(np.int64)
    sign = (u >> 31) & 1
    e32 = (u >> 23) & 0xFF
    f32 = u & 0x7FFFFF
    is_nan = (e32 == 0xFF) & (f32 != 0)
    is_inf = (e32 == 0xFF) & (f32 == 0)
    is_zero = (e32 == 0) & (f32 == 0)

    # |y| = sig * 2**exp2 with sig an integer < 2**24
    sig = np.where(e32 == 0, f32, f32 | 0x800000)
    exp2 = np.where(e32 == 0, -149, e32 - 150)
    # E = floor(log2 |y|): for float32 subnormals from the position of the leading bit
    bitlen = np.zeros_like(sig)
    s = sig.copy()
    for _ in range(25):
        nz = s > 0
        bitlen += nz
        s >>= 1
    E = exp2 + bitlen - 1
    Eeff = np.maximum(E, fmt.emin)  # below emin: subnormal quantum of the target format
    q_exp = Eeff - fmt.mbits  # value of one unit in the last place of the result
    shift = q_exp - exp2  # always >= 1 for the narrower formats, 0 for float32 -> float32
    shift = np.clip(shift, 0, 40)
    # round sig / 2**shift to nearest, ties to even
    n = sig >> shift
    rem = sig - (n << shift)
    half = np.where(shift > 0, np.left_shift(np.int64(1), np.maximum(shift - 1, 0)), 0)
    up = (shift > 0) & ((rem > half) | ((rem == half) & ((n & 1) == 1)))
    n = n + up
    # code = ((Eeff + bias) << mbits) + n - 2**mbits works for normals, subnormals, and a carry
    # out of the mantissa (n == 2**(mbits+1) moves to the next binade by itself)
    mag = ((Eeff + fmt.bias) << fmt.mbits) + n - (1 << fmt.mbits)
    mag = np.where(n == 0, 0, mag)

    if fmt.saturating:
        fmax = float(fmt.fmax)
        with np.errstate(invalid="ignore"):
            over = is_inf | (np.abs(y.astype(np.float64)) > fmax)
        mag = np.where(over, fmt.max_code, mag)
    else:
        over = is_inf | (mag >= fmt.inf_code)
        mag = np.where(over, fmt.inf_code, mag)
    mag = np.where(is_zero, 0, mag)
    codes = (sign << (fmt.width - 1)) | mag
    codes = np.where(is_nan, fmt.nan_code, codes)
    return codes.astype(np.int64)


def divide_f32(x: np.ndarray, s: np.ndarray) -> np.ndarray:
    """IEEE float32 division (NumPy's float32 ``/`` is correctly rounded)."""
    with np.errstate(all="ignore"):
        return (x.astype(np.float32) / s.astype(np.float32)).astype(np.float32)


def q_codes(x: torch.Tensor, cache_dtype: torch.dtype, scale=None) -> np.ndarray:
    """Codes of q(x, s) for x [T, H, D]; the scale is ignored unless the cache is FP8."""
    fmt = FORMAT_OF[cache_dtype]
    x32 = float32_of(x)
    if cache_dtype in FP8_DTYPES:
        s = scale_float32(scale, x.shape[1]).reshape(1, -1, 1)
        y = divide_f32(x32, s)
    else:
        y = x32
    if fmt is FP32:  # identity: keep the exact bits (NaN payload included)
        return x32.view(np.uint32).astype(np.int64)
    return encode_f32(y, fmt)


# ----------------------------------------------------------------------------------------------
# The exact scalar encoder (rationals), used to check the vectorised one.


def _rne_fraction(a: Fraction) -> int:
    """Round a non-negative rational to the nearest integer, ties to even."""
    n, r = divmod(a.numerator, a.denominator)
    twice = 2 * r
    if twice > a.denominator or (twice == a.denominator and n % 2 == 1):
        n += 1
    return n


def encode_exact(y: float, fmt: Fmt) -> int:
    """Encode one float (already the float32 quotient) into ``fmt`` using exact rationals."""
    if y != y:
        return fmt.nan_code
    negative = np.signbit(np.float64(y))
    sign = fmt.sign_bit if negative else 0
    if y in (float("inf"), float("-inf")):
        return sign | (fmt.max_code if fmt.saturating else fmt.inf_code)
    a = abs(Fraction(y))
    if fmt.saturating and a > fmt.fmax:
        return sign | fmt.max_code
    if a == 0:
        return sign
    # find E with 2**E <= a < 2**(E+1)
    E = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** E > a:
        E -= 1
    elif Fraction(2) ** (E + 1) <= a:
        E += 1
    Eeff = max(E, fmt.emin)
    ulp = Fraction(2) ** (Eeff - fmt.mbits)
    n = _rne_fraction(a / ulp)
    if n == 0:
        return sign
    mag = ((Eeff + fmt.bias) << fmt.mbits) + n - (1 << fmt.mbits)
    if not fmt.saturating and mag >= fmt.inf_code:
        mag = fmt.inf_code
    return sign | mag


def decode_exact(code: int, fmt: Fmt) -> Fraction | float:
    """The value of a code: a Fraction, or a float for inf/NaN."""
    code = int(code)
    negative = bool(code & fmt.sign_bit)
    mag = code & (fmt.sign_bit - 1)
    e = mag >> fmt.mbits
    m = mag & ((1 << fmt.mbits) - 1)
    if fmt.name == "e4m3fn" and mag == fmt.nan_code:
        return float("nan")
    if fmt.has_inf and e == (1 << fmt.ebits) - 1:
        if m == 0:
            return float("-inf") if negative else float("inf")
        return float("nan")
    if e == 0:
        v = Fraction(m) * Fraction(2) ** (fmt.emin - fmt.mbits)
    else:
        v = (1 + Fraction(m, 1 << fmt.mbits)) * Fraction(2) ** (e - fmt.bias)
    return -v if negative else v


def decode_float(code: int, fmt: Fmt) -> float:
    v = decode_exact(code, fmt)
    return float(v) if isinstance(v, Fraction) else v


def q_exact(x: float, s: float, fmt: Fmt) -> int:
    """Scalar q(x, s) for an FP8 format: float32 division, then the exact encoder."""
    y = divide_f32(np.array([x], dtype=np.float32), np.array([s], dtype=np.float32))[0]
    return encode_exact(float(y), fmt)


# ----------------------------------------------------------------------------------------------
# The scatter.


def expected_cache(
    before: np.ndarray,
    x: torch.Tensor,
    loc: Sequence[int],
    cache_dtype: torch.dtype,
    scale=None,
) -> np.ndarray:
    """Codes of a cache after the write: ``before`` (codes [slots, H, D]) with rows ``loc[t]``
    replaced by q(x[t], s) for 0 <= loc[t] < slots; every other row untouched.
    ``loc`` must not name a valid slot twice (which token wins is unspecified)."""
    after = np.array(before, dtype=np.int64, copy=True)
    rows = q_codes(x, cache_dtype, scale)
    slots = after.shape[0]
    valid = [int(l) for l in loc if 0 <= int(l) < slots]
    assert len(valid) == len(set(valid)), "oracle cannot decide between duplicate slots"
    for t, slot in enumerate(int(l) for l in loc):
        if 0 <= slot < slots:
            after[slot] = rows[t]
    return after


def expected_latent_cache(
    before: np.ndarray,
    parts: Sequence[torch.Tensor],
    loc: Sequence[int],
    cache_dtype: torch.dtype,
    scale=None,
) -> np.ndarray:
    """Codes of an MLA layer buffer [slots, 1, sum of part widths] after a write of the latent rows
    whose consecutive column ranges are ``parts`` (each [T, 1, width]; one part: the whole row),
    every part quantized with the one ``scale``; rows not named by ``loc`` untouched."""
    rows = np.concatenate([q_codes(p, cache_dtype, scale) for p in parts], axis=2)
    after = np.array(before, dtype=np.int64, copy=True)
    slots = after.shape[0]
    valid = [int(l) for l in loc if 0 <= int(l) < slots]
    assert len(valid) == len(set(valid)), "oracle cannot decide between duplicate slots"
    for t, slot in enumerate(int(l) for l in loc):
        if 0 <= slot < slots:
            after[slot] = rows[t]
    return after


# ----------------------------------------------------------------------------------------------
# The assertion helper.


def assert_codes_equal(actual: torch.Tensor | np.ndarray, expected: np.ndarray, fmt: Fmt, what: str,
                       *, nan_equal: bool = True) -> None:
    """Byte-for-byte comparison of codes; two NaN codes count as equal when ``nan_equal``.

    On failure reports the mismatch count, the first bad index and both values (code and value).
    """
    got = codes_of(actual) if isinstance(actual, torch.Tensor) else np.asarray(actual)
    got = got.astype(np.int64)
    exp = np.asarray(expected).astype(np.int64)
    assert got.shape == exp.shape, f"{what}: shape {got.shape} != expected {exp.shape}"
    same = got == exp
    if nan_equal:
        same |= fmt.is_nan_code(got) & fmt.is_nan_code(exp)
    if same.all():
        return
    bad = np.argwhere(~same)
    first = tuple(int(i) for i in bad[0])
    g, e = int(got[first]), int(exp[first])
    hexw = fmt.width // 4
    raise AssertionError(
        f"{what} ({fmt.name}): {len(bad)} of {same.size} elements differ; first at index {first}: "
        f"got 0x{g:0{hexw}x} ({decode_float(g, fmt)!r}), expected 0x{e:0{hexw}x} "
        f"({decode_float(e, fmt)!r})"
    )


def assert_bytes_unchanged(before: torch.Tensor, after: torch.Tensor, what: str) -> None:
    """Exact byte identity of two tensors (no NaN leniency): for inputs and untouched memory."""
    b = _dense(before).reshape(-1).view(torch.uint8).numpy()
    a = _dense(after).reshape(-1).view(torch.uint8).numpy()
    assert b.shape == a.shape, f"{what}: {b.shape} != {a.shape}"
    diff = np.flatnonzero(a != b)
    if diff.size:
        i = int(diff[0])
        raise AssertionError(
            f"{what}: {diff.size} of {b.size} bytes changed; first at byte {i}: "
            f"was 0x{int(b[i]):02x}, now 0x{int(a[i]):02x}"
        )
