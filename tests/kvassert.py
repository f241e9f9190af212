"""What the tests share: the device they run on, dtypes and test ids, pools and their buffers, the
byte comparison that explains a mismatch, the independent oracle of the K/V write, the write's
bad-input targets, small MLA pools, the host tier's CPU pools, allocator snapshots, the
cross-compilation probe, loading an example script as a module, a stand-in for a compiled
Triton kernel that checks direct launches on the CPU, small state pools with the paths they run on,
and the state machines' bounded and long profiles.

The oracle (q(x, s) from the format definitions, docs/contract.md "The write") calls nothing in
kvpool and uses none of torch's float->fp8 or float->16-bit conversions: its encoders work on
float32 bit patterns with integer arithmetic (vectorised, NumPy), and a second, scalar encoder works
on exact rationals (``fractions.Fraction``) so that the two can check each other. torch only moves
bytes between tensors and NumPy arrays there.

    q(x, s) = RNE(clamp(float32(x) / float32(s), -fmax, +fmax))   for FP8 caches
    q(x, s) = RNE(float32(x)) into the cache format (plain cast)   for bf16 / fp16 / fp32 caches

Every encoder returns unsigned integer *codes* (the cache's bit patterns); NaN results are compared
by "is a NaN code", because the formats allow many NaN encodings, except through ``q_codes_stored``,
which spells out the NaN bits the contract pins for a write.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import types
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union
from unittest import mock

import numpy as np
import pytest
import torch

import kvpool
from kvpool import MHATokenToKVPool, MHATokenToKVPoolHost, MLATokenToKVPool

ROOT = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------------------------
# Where the tests run. Device-agnostic tests use the suite's device (CUDA when present); tests that
# need CUDA carry the ``gpu`` marker (conftest skips them without a device).

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.gpu

# The fused kernel takes CPU tensors only through Triton's interpreter (conftest switches it on when
# there is no CUDA device); elsewhere the fused cases of the CPU tests are skipped, not failed.
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
#: The kernels can run on the suite's device: compiled on CUDA, or interpreted on the CPU.
KERNEL_HERE = DEVICE == "cuda" or INTERPRETER
needs_interpreter = pytest.mark.skipif(not INTERPRETER, reason="fused kernel on CPU tensors needs TRITON_INTERPRET=1")
fused_runs = pytest.mark.skipif(not KERNEL_HERE, reason="the fused kernel needs CUDA or TRITON_INTERPRET=1")


def skip_fused_without_interpreter(name: str) -> None:
    """Skip a case whose target name says it takes the fused path on CPU tensors ("fused", "always")."""
    if not INTERPRETER and ("fused" in name or "always" in name):
        pytest.skip("fused kernel on CPU tensors needs TRITON_INTERPRET=1")


# ----------------------------------------------------------------------------------------------
# Dtypes and test ids.

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
CACHE_DTYPES = FP8 + [torch.bfloat16, torch.float16, torch.float32]
INPUT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def id_of(x) -> str:
    """A readable test id: a function's name, a dtype without ``torch.``."""
    return getattr(x, "__name__", None) or str(x).replace("torch.", "")


@dataclasses.dataclass
class Layer:
    """What a pool reads from SGLang's attention layer: its global id."""

    layer_id: Any


# ----------------------------------------------------------------------------------------------
# Pools and their buffers.


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill a cache with a pattern no write produces by accident (0xFF bytes: NaN for FP8 and
    the floating types), so unwritten or wrongly written rows show up."""
    t.view(_INT_VIEW[t.element_size()]).fill_(-1)
    return t


def poison_pool_(pool):
    """Poison every K and V buffer of an MHA pool (after its warmup, which writes slot 0)."""
    for buf in pool.k_buffer + pool.v_buffer:
        poison_(buf)
    return pool


def fill_random_(tensors, seed: int) -> None:
    """Random bytes everywhere (NaN patterns included), so every row is distinguishable. The bytes
    are drawn on each tensor's own device (one generator per device, seeded alike)."""
    generators: dict[torch.device, torch.Generator] = {}
    for t in tensors:
        raw = t.view(torch.uint8)
        g = generators.setdefault(raw.device, torch.Generator(device=raw.device).manual_seed(seed))
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device=raw.device, generator=g))


def assert_pools_equal(a, b, what: str, layers: Sequence[int]) -> None:
    """Both pools hold the same K and V bytes in every one of ``layers``."""
    for layer in layers:
        for x, y, kv in zip(a.get_kv_buffer(layer), b.get_kv_buffer(layer), "KV"):
            assert_same_bytes(x, y, f"{what}: layer {layer} {kv}")


# ----------------------------------------------------------------------------------------------
# Byte comparison.

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern of a tensor, as an integer tensor of the same element size."""
    return t.contiguous().view(_INT_VIEW[t.element_size()])


def _report(what: str, differ: np.ndarray, actual: np.ndarray, expected: np.ndarray, describe) -> None:
    """Raise with the mismatch count, the first bad index, both values there and the largest
    difference between finite values (``describe(array, index)`` spells one element)."""
    bad = np.argwhere(differ)
    if not len(bad):
        return
    first = tuple(int(i) for i in bad[0])
    with np.errstate(all="ignore"):
        a, e = actual[differ].astype(np.float64), expected[differ].astype(np.float64)
        finite = np.isfinite(a) & np.isfinite(e)
        max_err = f"{float(np.abs(a - e)[finite].max())!r}" if finite.any() else "n/a (no finite pair)"
    raise AssertionError(
        f"{what}: {len(bad)} of {differ.size} elements differ; first at {first}: "
        f"actual {describe('actual', first)} vs expected {describe('expected', first)}; "
        f"max error between finite values {max_err}"
    )


def assert_same_bytes(actual: torch.Tensor, expected: torch.Tensor, what: str = "tensor", any_nan: bool = False) -> None:
    """Equal bit patterns everywhere, NaN payloads and signs included (the two write paths store the
    same NaN bits). ``any_nan=True`` accepts any NaN pattern where both are NaN, for comparisons
    with values computed outside kvpool (torch's own conversions disagree about NaN bits).

    On failure, reports the mismatch count, the first bad index, both values there and the largest
    difference between finite values."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise AssertionError(
            f"{what}: shape/dtype differ: {tuple(actual.shape)} {actual.dtype} vs "
            f"{tuple(expected.shape)} {expected.dtype}"
        )
    a, e = actual.detach().cpu(), expected.detach().cpu()
    ab, eb = bits(a), bits(e)
    differ = ab != eb
    if any_nan and a.dtype.is_floating_point:
        differ &= ~(torch.isnan(a.float()) & torch.isnan(e.float()))
    if not bool(differ.any()):
        return
    ab_np, eb_np = ab.long().numpy(), eb.long().numpy()
    floating = a.dtype.is_floating_point
    av = a.float().numpy() if floating else ab_np
    ev = e.float().numpy() if floating else eb_np

    def describe(which: str, i: tuple) -> str:
        v, b = (av[i], ab_np[i]) if which == "actual" else (ev[i], eb_np[i])
        return f"{float(v)!r} (bits {int(b) & ((1 << 8 * a.element_size()) - 1):#x})"

    _report(what, differ.numpy(), av, ev, describe)


# ----------------------------------------------------------------------------------------------
# Inputs of the write, and the write on both paths.


def spread_rows(t: int, h: int, d: int, dtype: torch.dtype, seed: int, spread: bool = True) -> torch.Tensor:
    """[t, h, d] on the suite's device: random rows with a wide magnitude range (overflow, normals,
    subnormals) and a few specials."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, d, generator=g)
    if spread:
        x = x * torch.exp2(torch.randint(-20, 12, (t, h, d), generator=g).float())
    flat = x.view(-1)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 448.0, 464.0, -57344.0])
    n = min(flat.numel(), specials.numel())
    flat[:n] = specials[:n]
    return x.to(dtype).to(DEVICE)


def scale_of(kind: str, heads: int, seed: int = 0):
    """A scale of each kind a write takes, on the suite's device (per-head values random)."""
    if kind == "none":
        return None
    if kind == "float":
        return 0.37
    if kind == "tensor":
        return torch.tensor([3.3], device=DEVICE)
    if kind == "tensor0d":
        return torch.tensor(0.1, device=DEVICE)
    g = torch.Generator().manual_seed(seed)
    per_head = (torch.rand(heads, generator=g) * 4 + 0.05).to(DEVICE)
    return per_head if kind == "per_head" else per_head.reshape(heads, 1)


def slots_for(t: int, slots: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``t`` distinct slots out of ``slots``, one of them padding (-1) and one out of range."""
    g = torch.Generator().manual_seed(seed)
    loc = torch.randperm(slots, generator=g)[:t].to(dtype)
    if t >= 4:
        loc[1] = -1  # padding token
        loc[3] = slots + 5  # out of range: never written
    return loc.to(DEVICE)


def poisoned_caches(slots: int, h: int, d: int, hv: int, dv: int, dtype: torch.dtype):
    """A K cache [slots, h, d] and a V cache [slots, hv, dv] on the suite's device, poisoned."""
    k = poison_(torch.empty(slots, h, d, dtype=dtype, device=DEVICE))
    v = poison_(torch.empty(slots, hv, dv, dtype=dtype, device=DEVICE))
    return k, v


def both_paths(k, v, loc, k_scale, v_scale, slots: int, cache_dtype: torch.dtype, **launch):
    """Run the kernel (``launch_store_kv`` with ``launch``, else the public function) and the
    reference on identically poisoned caches; return both results, ((kf, vf), (kr, vr))."""
    from kvpool import fused_fp8_set_kv_buffer, reference_set_kv_buffer
    from kvpool.kernels.store_kv.op import launch_store_kv

    h, d, hv, dv = k.shape[1], k.shape[2], v.shape[1], v.shape[2]
    kf, vf = poisoned_caches(slots, h, d, hv, dv, cache_dtype)
    kr, vr = poisoned_caches(slots, h, d, hv, dv, cache_dtype)
    if launch:
        launch_store_kv(k, v, kf, vf, loc, k_scale, v_scale, **launch)
    else:
        fused_fp8_set_kv_buffer(k, v, kf, vf, loc, k_scale, v_scale)
    reference_set_kv_buffer(k, v, kr, vr, loc, k_scale, v_scale)
    return (kf, vf), (kr, vr)


def geometry_of(k_cache: torch.Tensor, v_cache: torch.Tensor):
    """The writer's ``Geometry`` of a pair of caches."""
    from kvpool.write_types import Geometry

    return Geometry(k_cache.dtype, *k_cache.shape[1:], *v_cache.shape[1:], k_cache.device)


# On CUDA: larger shapes, generated on the device.


def cuda_gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def cuda_values(shape: tuple, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values over ~2^-24..2^14 on the GPU: overflow, normals and subnormals of both FP8 formats."""
    g = cuda_gen(seed)
    x = torch.randn(shape, device="cuda", generator=g)
    return (x * torch.exp2(torch.randint(-24, 14, shape, device="cuda", generator=g).float())).to(dtype)


def cuda_scale(kind: str, heads: int):
    """A scale of each kind a write takes, on the GPU (per-head values spread over 0.05..7)."""
    return {
        "none": None,
        "float": 0.37,
        "tensor": torch.tensor([3.3], device="cuda"),
        "per_head": torch.linspace(0.05, 7.0, heads, device="cuda"),
    }[kind]


CUDA_SLOTS = 4096
CUDA_ROWS = CUDA_SLOTS + 1  # page size 1
CUDA_H, CUDA_D = 8, 128


def cuda_pool(dtype: torch.dtype = torch.float8_e4m3fn, fused: str = "always", heads: int = CUDA_H, dim: int = CUDA_D, **kw):
    """A two-layer pool of CUDA_SLOTS slots on the GPU (Llama's 8 KV heads of 128 by default),
    poisoned after its warmup (which writes zeros to slot 0)."""
    from kvpool import MHATokenToKVPool

    return poison_pool_(MHATokenToKVPool(CUDA_SLOTS, 1, dtype, heads, dim, 2, "cuda", fused=fused, **kw))


def random_cuda_pool(size: int = 4096, page_size: int = 16, layers: int = 4, dtype: torch.dtype = torch.float8_e4m3fn,
                     v_head_dim=None, seed: int = 0):
    """A pool of 8 heads of 128 on the GPU whose every byte is random (rows distinguishable)."""
    from kvpool import MHATokenToKVPool

    pool = MHATokenToKVPool(size, page_size, dtype, 8, 128, layers, "cuda", v_head_dim=v_head_dim, warmup=False)
    fill_random_(pool.k_buffer + pool.v_buffer, seed)
    return pool


def committed_tokens(loc_2d: torch.Tensor, commit: torch.Tensor):
    """(token indices, their slots) of a verify write's committed tokens, in token order."""
    width = loc_2d.shape[1]
    mask = torch.arange(width, device=loc_2d.device)[None, :] < commit.long()[:, None]
    idx = mask.reshape(-1).nonzero().squeeze(1)
    return idx, loc_2d.long().reshape(-1)[idx]


@contextlib.contextmanager
def no_sync():
    """Any synchronising torch call inside raises."""
    torch.cuda.synchronize()
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(old)


# ----------------------------------------------------------------------------------------------
# The oracle: binary floating-point formats.


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
_UINT_OF_WIDTH = {8: (torch.uint8, np.uint8), 16: (torch.int16, np.uint16), 32: (torch.int32, np.uint32)}


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
    if cache_dtype in FP8:
        s = scale_float32(scale, x.shape[1]).reshape(1, -1, 1)
        y = divide_f32(x32, s)
    else:
        y = x32
    if fmt is FP32:  # identity: keep the exact bits (NaN payload included)
        return x32.view(np.uint32).astype(np.int64)
    return encode_f32(y, fmt)


def q_codes_stored(x: torch.Tensor, cache_dtype: torch.dtype, scale=None) -> np.ndarray:
    """Codes of q(x, s) with each NaN as the write stores it (docs/contract.md, "The write", NaN): the
    cache format's positive all-ones NaN (``nan_code``) when the element type changes, the input's own
    bits when it already has the cache's type. Compare with ``assert_codes_equal(..., nan_equal=False)``."""
    fmt = FORMAT_OF[cache_dtype]
    codes = q_codes(x, cache_dtype, scale)
    nan = fmt.is_nan_code(codes)
    if x.dtype == cache_dtype:
        return np.where(nan, codes_of(x).astype(np.int64), codes)
    return np.where(nan, fmt.nan_code, codes)


# The exact scalar encoder (rationals), which checks the vectorised one.


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
    return _scatter(before, q_codes(x, cache_dtype, scale), loc)


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
    return _scatter(before, rows, loc)


def _scatter(before: np.ndarray, rows: np.ndarray, loc: Sequence[int]) -> np.ndarray:
    after = np.array(before, dtype=np.int64, copy=True)
    slots = after.shape[0]
    valid = [int(l) for l in loc if 0 <= int(l) < slots]
    assert len(valid) == len(set(valid)), "oracle cannot decide between duplicate slots"
    for t, slot in enumerate(int(l) for l in loc):
        if 0 <= slot < slots:
            after[slot] = rows[t]
    return after


def assert_codes_equal(actual: torch.Tensor | np.ndarray, expected: np.ndarray, fmt: Fmt, what: str,
                       *, nan_equal: bool = True) -> None:
    """Codes against the oracle's, code for code; two NaN codes count as equal when ``nan_equal``.

    On failure reports what ``assert_same_bytes`` reports: the mismatch count, the first bad index,
    both values there (code and value) and the largest difference between finite values."""
    got = codes_of(actual) if isinstance(actual, torch.Tensor) else np.asarray(actual)
    got = got.astype(np.int64)
    exp = np.asarray(expected).astype(np.int64)
    assert got.shape == exp.shape, f"{what}: shape {got.shape} != expected {exp.shape}"
    same = got == exp
    if nan_equal:
        same |= fmt.is_nan_code(got) & fmt.is_nan_code(exp)
    if same.all():
        return
    hexw = fmt.width // 4
    decode = np.vectorize(lambda c: decode_float(int(c), fmt), otypes=[np.float64])

    def describe(which: str, i: tuple) -> str:
        c = int((got if which == "actual" else exp)[i])
        return f"0x{c:0{hexw}x} ({decode_float(c, fmt)!r})"

    differ = ~same
    values_got, values_exp = np.zeros(got.shape), np.zeros(exp.shape)
    values_got[differ], values_exp[differ] = decode(got[differ]), decode(exp[differ])
    _report(f"{what} ({fmt.name})", differ, values_got, values_exp, describe)


# ----------------------------------------------------------------------------------------------
# The write's bad-input targets: the two write functions (caller-owned caches between guard rows)
# and the pool, behind one call interface with byte snapshots of every buffer. The base call is
# valid and names real slots, so a write that happens before an error shows up in the snapshots.
# A tensor on ``torch.device("meta")`` is "a tensor on another device".

# The base call: T=5 tokens, K [5, 2, 8], V [5, 3, 6] (H != Hv, D != Dv so every number is distinct).
T, H, D, HV, DV = 5, 2, 8, 3, 6
PAGE = 4
SIZE = 8
SLOTS = SIZE + PAGE  # 12 rows per buffer
START, LAYERS = 4, 3  # the pool holds global layers 4, 5, 6
LAYER = 5
CACHE_DTYPE = torch.float8_e4m3fn
BASE_LOC = [1, 5, -1, 7, 10]
GUARD = 2
META = torch.device("meta")
POOL_NAMES = {"k": "cache_k", "v": "cache_v", "cache_loc": "loc"}


def base_args(hv: int = HV) -> dict:
    g = torch.Generator().manual_seed(0)
    return dict(
        k=torch.randn(T, H, D, generator=g).to(torch.bfloat16),
        v=torch.randn(T, hv, DV, generator=g).to(torch.bfloat16),
        cache_loc=torch.tensor(BASE_LOC, dtype=torch.int64),
        k_scale=0.5,
        v_scale=torch.tensor([0.25]),
        layer=Layer(LAYER),
        layer_id_override=None,
    )


# ----------------------------------------------------------------------------------------------
# Targets: the two functions (caller-owned, guarded caches) and the pool.


class FunctionTarget:
    hv = HV  # caller-owned caches may have H != Hv

    def __init__(self, fn: Callable, validate: bool = False, cache_dtype=CACHE_DTYPE):
        self.fn, self.validate = fn, validate
        self.k_outer = torch.empty(SLOTS + 2 * GUARD, H, D, dtype=cache_dtype)
        self.v_outer = torch.empty(SLOTS + 2 * GUARD, HV, DV, dtype=cache_dtype)
        self.k_outer.view(torch.uint8).fill_(0xA5)
        self.v_outer.view(torch.uint8).fill_(0x5A)
        self.k_cache = self.k_outer[GUARD:GUARD + SLOTS]
        self.v_cache = self.v_outer[GUARD:GUARD + SLOTS]

    def name(self, arg: str) -> str:
        return arg

    def snapshot(self):
        return [self.k_outer.clone(), self.v_outer.clone()]

    def current(self):
        return [self.k_outer, self.v_outer]

    def call(self, a: dict) -> None:
        kc = a.get("k_cache", self.k_cache)
        vc = a.get("v_cache", self.v_cache)
        return self.fn(a["k"], a["v"], kc, vc, a["cache_loc"], a["k_scale"], a["v_scale"], validate=self.validate)


class PoolTarget:
    hv = H  # the pool has head_num heads for K and V

    def __init__(self, mode: str, validate: bool = False, env_validate: bool = False, cache_dtype=CACHE_DTYPE):
        env = {"KVPOOL_VALIDATE": "1"} if env_validate else {}
        with mock.patch.dict(os.environ, env):
            os.environ.pop("KVPOOL_FUSED", None)
            if not env_validate:
                os.environ.pop("KVPOOL_VALIDATE", None)
            self.pool = kvpool.MHATokenToKVPool(SIZE, PAGE, cache_dtype, H, D, LAYERS, "cpu", v_head_dim=DV,
                                                start_layer=START, fused=mode, validate=validate)
        for lid in range(START, START + LAYERS):
            kb, vb = self.pool.get_kv_buffer(lid)
            kb.view(torch.uint8).fill_(0xA5 ^ lid)
            vb.view(torch.uint8).fill_(0x5A ^ lid)

    def name(self, arg: str) -> str:
        return POOL_NAMES.get(arg, arg)

    def buffers(self):
        out = []
        for lid in range(START, START + LAYERS):
            out.extend(self.pool.get_kv_buffer(lid))
        return out

    def snapshot(self):
        return [b.clone() for b in self.buffers()]

    def current(self):
        return self.buffers()

    def call(self, a: dict) -> None:
        return self.pool.set_kv_buffer(a["layer"], a["cache_loc"], a["k"], a["v"], a["k_scale"], a["v_scale"],
                                       layer_id_override=a["layer_id_override"])


TARGETS = {
    "reference": lambda: FunctionTarget(kvpool.reference_set_kv_buffer),
    "fused_interp": lambda: FunctionTarget(kvpool.fused_fp8_set_kv_buffer),
    "pool_never": lambda: PoolTarget("never"),
    "pool_always": lambda: PoolTarget("always"),
}
FUNCTION_TARGETS = ["reference", "fused_interp"]
POOL_TARGETS = ["pool_never", "pool_always"]


def exact_number(n) -> str:
    """A regex matching the number ``n`` on its own (not inside a longer number)."""
    return rf"(?<![\d.]){re.escape(str(n))}(?![\d.])"


# ----------------------------------------------------------------------------------------------
# MLA pools on the suite's device: a small latent geometry (R + ROPE columns, two layers) and inputs
# of every magnitude in several memory layouts.

MODES = ["never", "always"] if KERNEL_HERE else ["never"]
# Small geometries keep the interpreter quick; DeepSeek's 512 + 64 is in every grid too.
R, ROPE = 40, 24
MLA_SIZE, MLA_START, MLA_LAYERS = 11, 3, 2  # rows 0..11 (page_size 1); global layers 3 and 4


def make_mla_pool(dtype, mode="never", r=R, rope=ROPE, size=MLA_SIZE, page_size=1, **kw) -> MLATokenToKVPool:
    with mock.patch.dict(os.environ):
        os.environ.pop("KVPOOL_FUSED", None)
        os.environ.pop("KVPOOL_VALIDATE", None)
        kw.setdefault("warmup", False)
        return MLATokenToKVPool(size, page_size, dtype, r, rope, MLA_LAYERS, DEVICE, start_layer=MLA_START, fused=mode,
                                **kw)


def poison_mla_pool(pool: MLATokenToKVPool, poison: int = 0xA5) -> list[torch.Tensor]:
    """Fill every layer with its own byte pattern; return copies of the poisoned buffers."""
    for i, b in enumerate(pool.kv_buffer):
        b.view(torch.uint8).fill_(poison ^ (17 * i))
    return [b.clone() for b in pool.kv_buffer]


def wide_values(rng: np.random.Generator, shape: tuple, dtype: torch.dtype, centre: float = 0.0,
                specials: bool = True) -> torch.Tensor:
    """Magnitudes from subnormal to overflow around 2**centre, both signs, a few inf/NaN/zeros."""
    n = int(np.prod(shape))
    vals = rng.uniform(1.0, 2.0, n) * np.exp2(rng.integers(-24, 12, n) + centre) * rng.choice([-1.0, 1.0], n)
    if specials and n:
        idx = rng.choice(n, size=max(1, n // 40))
        vals[idx] = rng.choice([np.inf, -np.inf, np.nan, 0.0, -0.0, 448.0, 57344.0 * 2], size=idx.size)
    return torch.from_numpy(vals.reshape(shape)).to(dtype)


def latent_layout(x: torch.Tensor, how: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [T, 1, W] in another memory layout; returns (view, the tensor owning its memory)."""
    t, _, w = x.shape
    if how == "contiguous":
        base = x.clone()
        return base, base
    if how == "projection_slice":  # columns of a wider projection output: token stride W + 7
        base = torch.full((t, 1, w + 7), 3.0, dtype=x.dtype)
        base[:, :, 2 : 2 + w] = x
        return base[:, :, 2 : 2 + w], base
    if how == "head_of_many":  # one head of [T, 3, W]: token stride 3W, head stride W
        base = torch.full((t, 3, w), -5.0, dtype=x.dtype)
        base[:, 1:2] = x
        return base[:, 1:2], base
    if how == "tokens_last":  # stored [W, T]
        base = x[:, 0].t().contiguous()
        return base.t().unsqueeze(1), base
    if how == "d_strided":  # every other element along the row
        base = torch.full((t, 1, 2 * w), 9.0, dtype=x.dtype)
        base[:, :, ::2] = x
        return base[:, :, ::2], base
    raise AssertionError(how)


LATENT_LAYOUTS = ["contiguous", "projection_slice", "head_of_many", "tokens_last", "d_strided"]


def on_device(x):
    return x.to(DEVICE) if isinstance(x, torch.Tensor) else x


# ----------------------------------------------------------------------------------------------
# The host tier on CPU pools: a device pool and a host pool of random bytes, their rows as bytes,
# and snapshots of both.

HOST_LAYOUTS = ["layer_first", "page_first"]
HOST_BACKENDS = ["kernel", "direct"]
# H=3, D=8, Dv=4 in FP8: 24- and 12-byte rows; 3 layers.
HOST_GEOM = dict(head_num=3, head_dim=8, v_head_dim=4, layer_num=3)


def make_device_pool(size=40, page_size=4, dtype=torch.float8_e4m3fn, seed=0, validate=False, **over):
    g = {**HOST_GEOM, **over}
    pool = MHATokenToKVPool(
        size, page_size, dtype, g["head_num"], g["head_dim"], g["layer_num"], "cpu",
        v_head_dim=g["v_head_dim"], start_layer=g.get("start_layer", 0), validate=validate,
    )  # fmt: skip
    fill_random_(pool.k_buffer + pool.v_buffer, seed)
    return pool


def make_host(pool, layout="layer_first", page_size=4, ratio=2.0, seed=1, **kw):
    host = MHATokenToKVPoolHost(pool, ratio, 0, page_size, layout, **kw)
    fill_random_([host.k_buffer, host.v_buffer], seed)
    return host


def host_rows(host: MHATokenToKVPoolHost, layer: int, which: str) -> torch.Tensor:
    """[size, row bytes] uint8 view of one layer's K or V on the host."""
    buf = host.k_buffer if which == "k" else host.v_buffer
    view = buf[layer] if host.layout == "layer_first" else buf[:, layer]
    return view.reshape(host.size, -1).view(torch.uint8)


def dev_rows(pool, layer: int, which: str) -> torch.Tensor:
    buf = pool.k_buffer[layer] if which == "k" else pool.v_buffer[layer]
    return buf.reshape(buf.shape[0], -1).view(torch.uint8)


def host_tier_snapshot(pool, host):
    return [b.view(torch.uint8).clone() for b in pool.k_buffer + pool.v_buffer + [host.k_buffer, host.v_buffer]]


def host_tier_unchanged(pool, host, before):
    return all(torch.equal(a, b) for a, b in zip(before, host_tier_snapshot(pool, host)))


# ----------------------------------------------------------------------------------------------
# Slot allocators: everything one knows as plain values, and alloc_extend / alloc_decode from lists.


def allocator_snapshot(a) -> tuple:
    """Everything an allocator knows, as plain Python values (to prove that a call changed nothing)."""
    s = a.backup_state()
    return (
        s.free_pages.tolist(), s.release_pages.tolist(), [p for t in s.free_group for p in t.tolist()],
        s.owners.tolist(), s.live.tolist(), s.page_free.tolist(), int(s.unrecorded), a.is_not_in_free_group,
    )  # fmt: skip


def held_slots(a) -> set[int]:
    """The slots an allocator records as owned."""
    return set(a.backup_state().owners.nonzero().flatten().tolist())


def ext(a, prefix, seq, last_loc):
    """alloc_extend with the CPU copies and the token count derived from the lists."""
    pre, sq = torch.tensor(prefix, dtype=torch.int64), torch.tensor(seq, dtype=torch.int64)
    last = torch.tensor(last_loc, dtype=torch.int64)
    return a.alloc_extend(pre, pre.clone(), sq, sq.clone(), last, int((sq - pre).sum()))


def dec(a, seq, last_loc):
    """alloc_decode with the CPU copy of the lengths."""
    sq = torch.tensor(seq, dtype=torch.int64)
    return a.alloc_decode(sq, sq.clone(), torch.tensor(last_loc, dtype=torch.int64))


def counts_copied_back(a, lands: bool = True):
    """Run ``a`` (a CPU allocator) as on a GPU: the counts a free leaves on the device are copied back
    rather than read; with ``lands=False`` the copies never land, as while the device is busy."""
    a._lists.eager = False
    if not lands:
        a._lists._mirror.poll = lambda: None
    return a


# ----------------------------------------------------------------------------------------------
# The kernels, compiled for real GPU targets on a machine without one.


def cross_compile(*args: str) -> list[dict]:
    """Run scripts/cross_compile.py (outside the interpreter) and return its JSON lines: one per
    compiled variant, with the instruction counts the tests check."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "cross_compile.py"), *args],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def compiled_variants() -> int:
    """Number of compiled variants of the write kernel in Triton's in-process cache (skips the test
    where this Triton keeps its cache elsewhere)."""
    from kvpool.kernels.store_kv import kernel as store_kv_kernel

    caches = getattr(store_kv_kernel.store_kv, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton version keeps its kernel cache elsewhere")
    return sum(len(entry[0]) for entry in caches.values())


def frames_up_to(outer: str) -> int:
    """How deep the caller sits below function ``outer``: its frame, ``outer``'s and every frame
    between (0 when ``outer`` is not on the stack). Frame counts of a public call to its launch."""
    frame, depth = sys._getframe(1), 0
    while frame is not None:
        depth += 1
        if frame.f_code.co_name == outer:
            return depth
        frame = frame.f_back
    return 0


# ----------------------------------------------------------------------------------------------
# The examples.


def load_example(name: str) -> types.ModuleType:
    """``examples/<name>.py`` as module ``name`` (registered in ``sys.modules``, where dataclasses
    resolve annotations; the examples import their shared modules from their own folder)."""
    if name in sys.modules:
        return sys.modules[name]
    path = ROOT / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[name] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


#: examples/serve_sim.py's small run on the command line: memory pressure at 256 B/token, ~200 slots
#: for requests of up to 104 tokens (small_sim_config() is the same run as a SimConfig).
SMALL_SIM_ARGS = [
    "--requests", "12", "--layers", "2", "--heads", "2", "--head-dim", "32", "--kv-budget-mib", "0.05",
    "--max-running", "6", "--chunk-size", "48", "--prompt-len", "4", "80", "--output-len", "2", "24",
    "--device", "cpu", "--seed", "3", "--no-progress",
]  # fmt: skip


def small_sim_config():
    """examples/serve_sim.py's small run (SMALL_SIM_ARGS) as the example's ``SimConfig``."""
    return load_example("serve_sim").SimConfig(
        requests=12, layers=2, heads=2, head_dim=32, page_size=16, kv_budget_mib=0.05, max_running=6,
        chunk_size=48, prompt_len=(4, 80), output_len=(2, 24), arrival_every=0.5, device="cpu", seed=3,
    )  # fmt: skip


def dropping_last_token(runner, write_name: str, pool_of=lambda made: made):
    """A stand-in for an example model runner's ``make_pool`` (``runner``: the runner's module) whose
    pool (``pool_of`` the value made) drops the last token of every ``write_name`` call, as a padding
    token: attention then reads a stale row."""
    make_pool = runner.make_pool

    def leaky(*args, **kwargs):
        made = make_pool(*args, **kwargs)
        pool = pool_of(made)
        write = getattr(pool, write_name)

        def drop_last(layer, loc, *rest, **kw):
            loc = loc.clone()
            loc[-1] = -1  # a padding token: nothing is written
            write(layer, loc, *rest, **kw)

        setattr(pool, write_name, drop_last)
        return made

    return leaky


# --- a compiled kernel's stand-in: direct launches on the CPU ------------------------------------------


def _specialisation(value: object, specialised: bool) -> object:
    """What Triton compiles a runtime argument for: a tensor's dtype and 16-byte alignment, an int's
    type (i32 / i64 / u64 by range) and whether it is 1 or a multiple of 16 (alignment and those two
    only where the parameter is specialised), a float as fp32, anything else its type and value."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, specialised and value.data_ptr() % 16 == 0)
    if isinstance(value, bool) or value is None:
        return (type(value).__name__, value)
    if isinstance(value, int):
        width = "u64" if value >= 2**63 else "i64" if not -(2**31) <= value < 2**31 else "i32"
        return ("int", width, specialised and value == 1, specialised and value % 16 == 0)
    if isinstance(value, float):
        return ("fp32",)
    return (type(value).__name__, value)


class StandInJit:
    """Stands in for a ``@triton.jit`` kernel where its launcher looks it up (monkeypatch the module
    attribute with one made from the interpreted kernel): a JIT launch ``kernel[grid](*args,
    **kwargs)`` binds the arguments to the kernel's signature as Triton does (``bound``: every
    parameter's value in signature order, constexprs included), runs the interpreted kernel, and
    hands back a :class:`CompiledStandIn` for the variant Triton would have compiled. With
    ``fail_next`` set, the stand-in it hands back raises on every launch, as a compiled-kernel
    launcher that takes its arguments otherwise does. ``on_direct`` (if set) is called at every
    direct launch, before it runs."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.signature = inspect.signature(getattr(kernel, "fn", kernel))
        self.params = tuple(self.signature.parameters)
        self.constexprs = frozenset(n for n, p in self.signature.parameters.items() if "constexpr" in str(p.annotation))
        self.unspecialised = frozenset(getattr(kernel, "kwargs", {}).get("do_not_specialize") or ())
        self.fail_next = False
        self.on_direct = None
        self.launches = 0
        self.handed: list[CompiledStandIn] = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            params = {k: v for k, v in kwargs.items() if k in self.signature.parameters}  # the rest: num_warps, ...
            bound = self.signature.bind(*args, **params)
            bound.apply_defaults()
            self.launches += 1
            self.kernel[grid](*args, **kwargs)
            compiled = CompiledStandIn(self, tuple(bound.arguments[n] for n in self.params), self.fail_next)
            self.handed.append(compiled)
            return compiled

        return launch

    def compiled_for(self, values: tuple) -> tuple:
        """The variant a launch with these parameter values needs: constexprs by value, runtime
        arguments by what Triton specialises them on."""
        return tuple(
            ("constexpr", v) if n in self.constexprs else _specialisation(v, n not in self.unspecialised)
            for n, v in zip(self.params, values)
        )


class CompiledStandIn:
    """The compiled variant one JIT launch made, in place of Triton's: ``compiled[grid](*args,
    stream=None)`` takes every parameter positionally in signature order, constexprs included. A
    launch must pass exactly as many arguments as the kernel has parameters, the constexprs the
    variant was compiled with, and runtime arguments specialised alike (else AssertionError, naming
    the parameter); then the interpreted kernel runs with exactly those arguments, so one passed
    in the wrong place writes wrong bytes. ``bound`` is what the JIT launch bound; ``direct`` each
    direct launch's arguments (see :func:`assert_same_arguments`)."""

    def __init__(self, jit: StandInJit, bound: tuple, fail: bool) -> None:
        self.jit, self.bound, self.fail = jit, bound, fail
        self.variant = jit.compiled_for(bound)
        self.calls = 0
        self.direct: list[tuple] = []

    #: What Triton's CompiledKernel hands its launcher besides the grid, stream and arguments.
    function = packed_metadata = None

    def run(self, gx, gy, gz, stream, function, metadata, launch_metadata, enter_hook, exit_hook, *args):
        """The launcher's entry, as ``CompiledKernel.run`` takes it (a direct launch's path)."""
        self[(gx, gy, gz)](*args, stream=stream)

    def __getitem__(self, grid):
        def run(*args, stream=None):
            self.calls += 1
            if self.fail:
                raise TypeError("this launcher takes its arguments differently")
            jit = self.jit
            if len(args) != len(jit.params):
                raise AssertionError(f"a direct launch passed {len(args)} arguments; the kernel has {len(jit.params)}")
            for name, want, got in zip(jit.params, self.variant, jit.compiled_for(args)):
                if want != got:
                    raise AssertionError(f"a direct launch passed {name} as {got}; the variant was compiled for {want}")
            if jit.on_direct is not None:
                jit.on_direct()
            self.direct.append(args)
            jit.kernel[grid](*args)

        return run


def assert_same_arguments(direct: tuple, bound: tuple, params: tuple) -> None:
    """A direct launch of a call passed what the JIT launch of the same call bound: tensors over the
    same memory as the same type (a view made anew per call counts), equal values of the same types
    otherwise, parameter by parameter."""
    assert len(direct) == len(bound) == len(params), (len(direct), len(bound), len(params))
    for name, d, b in zip(params, direct, bound):
        if isinstance(b, torch.Tensor):
            same = isinstance(d, torch.Tensor) and (d.data_ptr(), d.dtype, d.shape, d.stride()) == (
                b.data_ptr(), b.dtype, b.shape, b.stride()
            )
        else:
            same = type(d) is type(b) and d == b
        assert same, f"{name}: the direct launch passed {_spelled(d)}, the JIT launch bound {_spelled(b)}"


def _spelled(v: object) -> str:
    if isinstance(v, torch.Tensor):
        return f"a {v.dtype} tensor {tuple(v.shape)} at {v.data_ptr():#x}"
    return repr(v)


# --- state pools (MambaPool): a small odd-shaped pool, its bytes, the paths it runs on ---------------

#: Global ids of the linear layers of the test pools (full attention at 0, 3, 4).
STATE_LAYERS = (1, 2, 5)
#: Draft steps of the test pools' speculative scratch.
STATE_K = 3


def state_params(conv=(7, 3), temporal=(2, 3, 5), layers=STATE_LAYERS, **dtype):
    """Odd shapes on purpose: conv rows of 7 x 3 bf16 (42 bytes), SSM rows of 2 x 3 x 5 fp32 (120)."""
    from kvpool import MambaCacheParams, MambaStateDType, MambaStateShape

    return MambaCacheParams(MambaStateShape(conv=conv, temporal=temporal), layers, MambaStateDType(**dtype))


def make_state_pool(device="cpu", size=9, spec=4, k=STATE_K, params=None, validate=False, seed=0, hold=True):
    """A MambaPool full of random bytes (scratch included); with ``hold`` every slot is handed out,
    in order, so that operations may name any of them."""
    from kvpool import MambaPool

    pool = MambaPool(
        size=size, spec_state_size=spec, cache_params=params or state_params(), device=device,
        speculative_num_draft_tokens=k, validate=validate,
    )  # fmt: skip
    scratch = [] if pool.intermediate_ssm is None else [*pool.intermediate_conv_window, pool.intermediate_ssm]
    fill_random_(state_tensors(pool) + scratch, seed)
    if hold:
        pool.alloc_slots(size)
    return pool


def state_tensors(pool) -> list[torch.Tensor]:
    """A state pool's slot buffers: every convolution, then the SSM state."""
    return [*pool.conv, pool.temporal]


def state_snapshot(pool) -> list[torch.Tensor]:
    """The bytes of every slot buffer, on the host."""
    return [t.view(torch.uint8).cpu().clone() for t in state_tensors(pool)]


def assert_states(pool, expected: list[torch.Tensor], what: str = "state") -> None:
    """Every slot buffer byte for byte equal to ``expected`` (a :func:`state_snapshot`)."""
    for i, (t, e) in enumerate(zip(state_tensors(pool), expected)):
        assert_same_bytes(t.view(torch.uint8).cpu(), e, f"{what}: {'ssm' if i == len(expected) - 1 else f'conv[{i}]'}")


def slots_of(values, device="cpu", dtype=torch.int64) -> torch.Tensor:
    """An index tensor."""
    return torch.tensor(values, dtype=dtype, device=device)


@pytest.fixture(params=["cpu-reference", "cpu-kernel", pytest.param("cuda-kernel", marks=pytest.mark.gpu)])
def state_device(request, monkeypatch):
    """The device a state pool lives on, with the row-copy and commit kernels forced onto CPU tables
    under the interpreter for ``cpu-kernel``."""
    from kvpool.kernels.copy_rows import launcher as copy_rows
    from kvpool.kernels.state_commit import launcher as state_commit

    dev, path = request.param.split("-")
    if dev == "cpu" and path == "kernel":
        if not copy_rows.INTERPRETER:
            pytest.skip("kernels on CPU tensors need TRITON_INTERPRET=1")
        monkeypatch.setattr(copy_rows, "kernel_on_cpu", True)
        monkeypatch.setattr(state_commit, "kernel_on_cpu", True)
    return dev


# --- state machines: a bounded CI profile, a long one behind KVPOOL_LONG_TESTS=1 ---------------------

#: ``KVPOOL_LONG_TESTS=1`` runs every state machine for at least ``KVPOOL_LONG_STEPS`` steps (100k).
LONG_TESTS = os.environ.get("KVPOOL_LONG_TESTS") == "1"
LONG_STEPS = int(os.environ.get("KVPOOL_LONG_STEPS", "100000"))


def run_machine(machine: type, *, examples: int, steps: int, seed: int) -> tuple[int, list[int]]:
    """Run ``machine`` (a RuleBasedStateMachine counting its steps in ``machine.steps_taken``):
    ``examples`` runs of up to ``steps`` steps from ``seed`` in CI; under ``KVPOOL_LONG_TESTS=1``
    rounds of 100 runs of up to 200 steps, seeds ``seed, seed + 1, ...``, until ``LONG_STEPS``
    steps ran. Returns (steps run, seeds) and prints them on stderr."""
    from hypothesis import HealthCheck
    from hypothesis import seed as with_seed
    from hypothesis import settings as hsettings
    from hypothesis.stateful import run_state_machine_as_test

    machine.steps_taken = 0
    budget = LONG_STEPS if LONG_TESTS else 0
    seeds: list[int] = []
    while not seeds or machine.steps_taken < budget:
        s = seed + len(seeds)
        seeds.append(s)
        run = hsettings(
            max_examples=100 if LONG_TESTS else examples, stateful_step_count=200 if LONG_TESTS else steps,
            deadline=None, database=None, suppress_health_check=list(HealthCheck),
        )  # fmt: skip
        run_state_machine_as_test(with_seed(s)(machine), settings=run)
    print(f"{machine.__name__}: {machine.steps_taken} steps, seeds {seeds[0]}..{seeds[-1]}", file=sys.stderr)
    return machine.steps_taken, seeds
