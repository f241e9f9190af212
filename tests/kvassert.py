"""What the tests share: the device they run on, dtypes and test ids, pools and their buffers, the
byte comparison that explains a mismatch, the independent oracle of the K/V write, the write's
bad-input targets, small MLA pools, the host tier's CPU pools, allocator snapshots and launch counts, the
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
import hashlib
import importlib.util
import inspect
import io
import json
import os
import random
import re
import subprocess
import sys
import time
import types
import unittest
import unittest.mock
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union
from unittest import mock

import numpy as np
import pytest
import torch
import hypothesis
import hypothesis.stateful
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import invariant
from torch.utils._python_dispatch import TorchDispatchMode

from kvpool import (
    HybridLinearKVPool,
    HybridPoolHost,
    HybridReqToTokenPool,
    MambaCacheParams,
    MambaStateShape,
    MHATokenToKVPool,
    MHATokenToKVPoolHost,
    PagedTokenToKVPoolAllocator,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
)
from kvpool.cache import (
    CacheInitParams,
    EvictParams,
    HiMambaRadixCache,
    HiRadixCache,
    InsertParams,
    MambaRadixCache,
    MatchPrefixParams,
    RadixCache,
    RadixKey,
    SWARadixCache,
)

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
#: The FP8 formats of MI300-class GPUs (no infinities, no -0, NaN 0x80): their own tests.
FNUZ = [torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]
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
    fnuz: bool = False  # every exponent finite, no -0: 0x80 is the one NaN

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
        if self.fnuz:  # every code but 0x80 is a number
            return (1 << (self.width - 1)) - 1
        return (((1 << self.ebits) - 2) << self.mbits) | ((1 << self.mbits) - 1)

    @property
    def inf_code(self) -> Optional[int]:
        return (((1 << self.ebits) - 1) << self.mbits) if self.has_inf else None

    @property
    def nan_code(self) -> int:
        """One quiet NaN code (the oracle's canonical NaN; for fnuz formats the only one)."""
        if self.fnuz:
            return self.sign_bit
        return (1 << (self.width - 1)) - 1

    @property
    def fmax(self) -> Fraction:
        return decode_exact(self.max_code, self)

    def is_nan_code(self, codes: np.ndarray) -> np.ndarray:
        if self.fnuz:
            return np.asarray(codes).astype(np.int64) == self.sign_bit
        mag = np.asarray(codes).astype(np.int64) & (self.sign_bit - 1)
        if self.name == "e4m3fn":
            return mag == self.nan_code
        return mag > self.inf_code


E4M3FN = Fmt("e4m3fn", ebits=4, mbits=3, bias=7, saturating=True, has_inf=False)
E5M2 = Fmt("e5m2", ebits=5, mbits=2, bias=15, saturating=True, has_inf=True)
BF16 = Fmt("bfloat16", ebits=8, mbits=7, bias=127, saturating=False, has_inf=True)
FP16 = Fmt("float16", ebits=5, mbits=10, bias=15, saturating=False, has_inf=True)
FP32 = Fmt("float32", ebits=8, mbits=23, bias=127, saturating=False, has_inf=True)
E4M3FNUZ = Fmt("e4m3fnuz", ebits=4, mbits=3, bias=8, saturating=True, has_inf=False, fnuz=True)
E5M2FNUZ = Fmt("e5m2fnuz", ebits=5, mbits=2, bias=16, saturating=True, has_inf=False, fnuz=True)

FORMAT_OF = {
    torch.float8_e4m3fn: E4M3FN,
    torch.float8_e5m2: E5M2,
    torch.bfloat16: BF16,
    torch.float16: FP16,
    torch.float32: FP32,
    torch.float8_e4m3fnuz: E4M3FNUZ,
    torch.float8_e5m2fnuz: E5M2FNUZ,
}
_UINT_OF_WIDTH = {8: (torch.uint8, np.uint8), 16: (torch.int16, np.uint16), 32: (torch.int32, np.uint32)}


# Moving bytes between torch and NumPy (no value conversion anywhere).


def _dense(t: torch.Tensor) -> torch.Tensor:
    """A packed row-major copy (``contiguous()`` keeps odd strides on size-1 dims, which ``view`` rejects)."""
    out = torch.empty(t.shape, dtype=t.dtype)
    out.copy_(t.detach().cpu())
    return out


def codes_of(t: torch.Tensor) -> np.ndarray:
    """The bit patterns of a tensor of one of the cache/input formats, as unsigned NumPy ints."""
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
    The sign of zero is kept (-0.0 and negative values that round to zero give the sign bit alone),
    except in the fnuz formats, which have no -0: every zero result is code 0.
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
    if fmt.fnuz:
        codes = np.where(mag == 0, 0, codes)
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
    if cache_dtype in FP8 or cache_dtype in FNUZ:
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
    zero = 0 if fmt.fnuz else sign  # what a result that rounds to zero stores
    if y in (float("inf"), float("-inf")):
        return sign | (fmt.max_code if fmt.saturating else fmt.inf_code)
    a = abs(Fraction(y))
    if fmt.saturating and a > fmt.fmax:
        return sign | fmt.max_code
    if a == 0:
        return zero
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
        return zero
    mag = ((Eeff + fmt.bias) << fmt.mbits) + n - (1 << fmt.mbits)
    if not fmt.saturating and mag >= fmt.inf_code:
        mag = fmt.inf_code
    return sign | mag


def decode_exact(code: int, fmt: Fmt) -> Fraction | float:
    """The value of a code: a Fraction, or a float for inf/NaN."""
    code = int(code)
    negative = bool(code & fmt.sign_bit)
    mag = code & (fmt.sign_bit - 1)
    if fmt.fnuz and code == fmt.sign_bit:
        return float("nan")
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


def host_page_bytes(host: MHATokenToKVPoolHost, start: int) -> torch.Tensor:
    """The bytes of the host page at slot ``start`` as the contract lays a stored page out, read
    straight from the host buffers (not through the data-page calls): every layer's K rows, then
    every layer's V rows, in the layout's order (``layer_first``: layer by layer; ``page_first``:
    slot by slot, each slot's layers together)."""
    ps, parts = host.page_size, []
    for which in "kv":
        rows = [host_rows(host, layer, which)[start : start + ps] for layer in range(host.layer_num)]
        parts.append(torch.stack(rows, dim=0 if host.layout == "layer_first" else 1).reshape(-1))
    return torch.cat(parts)


def file_store(path, host=None, max_bytes: int = 1 << 20, **config):
    """A ``HiCacheFile`` in ``path`` (a fresh directory under a pytest ``tmp_path``), its config from
    ``config``, over ``host`` when given."""
    from kvpool.storage import HiCacheFile, HiCacheStorageConfig

    store = HiCacheFile(HiCacheStorageConfig(**config), str(path), max_bytes=max_bytes)
    if host is not None:
        store.register_mem_pool_host(host)
    return store


def stalled_store(path, call: str = "get", number: int = 1):
    """A file store in ``path`` whose ``number``-th ``call`` stops inside until told to go on: returns
    ``(store, inside, go)``, two ``threading.Event`` s, ``inside`` set once the call is stopped,
    ``go`` to set to let it finish (it goes on by itself after 10 s)."""
    import threading

    from kvpool.storage.faults import FaultyStorage

    inside, go = threading.Event(), threading.Event()

    def stall(_seconds):
        inside.set()
        go.wait(10)

    return FaultyStorage(file_store(path), delay_s=1.0, delay_calls={call: {number}}, sleep=stall), inside, go


def directory_state(path) -> dict[str, bytes]:
    """Every file in a directory and its bytes (temporary files included)."""
    return {name: (Path(path) / name).read_bytes() for name in sorted(os.listdir(path))}


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


def records_at_once(a):
    """``a`` (a fresh allocator) recording each ``alloc``'s slots held in the call itself, as under
    validate, instead of lending a view of its free list and recording them at its next launch."""
    from kvpool.pools.allocator.freelist import FreeLists

    lists = a._lists
    a._lists = FreeLists(a.num_pages, a.device, a.need_sort, lists.eager, type(a).__name__, lends=False)
    return a


class AllocatorLaunches(TorchDispatchMode):
    """Counts what a block launches on the device: torch operations that are not views (each one a
    kernel on a GPU) in ``ops``, and launches of the allocators' bookkeeping kernels in ``kernels``
    (by the launcher's name; what a launch runs inside, the interpreter's operations on the CPU, is
    not counted)."""

    def __init__(self, monkeypatch) -> None:
        super().__init__()
        from kvpool.kernels.allocator import launcher

        self.ops: list[str] = []
        self.kernels: list[str] = []
        self._launching = False
        for name in ("hand_out", "give_back"):
            real = getattr(launcher, name)
            monkeypatch.setattr(launcher, name, self._counted(name, real))

    def _counted(self, name: str, real: Callable) -> Callable:
        def launch(*args, **kwargs):
            self.kernels.append(name)
            self._launching = True
            try:
                return real(*args, **kwargs)
            finally:
                self._launching = False

        return launch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and not self._launching:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))

    def clear(self) -> None:
        self.ops.clear()
        self.kernels.clear()


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


def fused_and_reference_serve(monkeypatch, serve_on):
    """An example runner's serving on two FP8 pools: ``serve_on(dtype)`` (build a pool of ``dtype``
    and serve on it) with every write on the reference path (``KVPOOL_FUSED=never``), then on the fused
    kernel (``always``: Triton's interpreter without a GPU). No write takes the other path, the fused
    run makes as many writes as the reference run, and, the writes being bit-identical, the
    generations are the same tokens and logits. Returns (reference, fused) for further checks."""
    monkeypatch.setenv("KVPOOL_FUSED", "never")
    reference = serve_on(torch.float8_e4m3fn)
    monkeypatch.setenv("KVPOOL_FUSED", "always")
    fused = serve_on(torch.float8_e4m3fn)
    assert reference.fused_calls == 0 and fused.reference_calls == 0
    assert fused.fused_calls == reference.reference_calls > 0
    for a, b in zip(fused.generations, reference.generations):
        assert a.tokens == b.tokens and torch.equal(a.logits, b.logits)
    return reference, fused


def _expected_swa_slots(kv_len: int, window: int, page: int) -> int:
    """SWA slots a request holds once the whole pages of its tokens at positions <= kv_len - window
    are given back: from the page of its oldest token inside the window to its last page."""
    first_kept_page = max(0, kv_len - window + 1) // page
    return (-(-kv_len // page) - first_kept_page) * page


def serve_checking_swa_give_back(arch, cfg) -> None:
    """Serve ``cfg``'s prompts with a sliding-window runner's ``arch`` (examples/support/runners),
    checking step by step that the full part holds every token of the running requests and the SWA
    part only the pages of their live windows (at most a window and a page each), that the mapping
    keeps every token in a window and none of the whole pages before it, and that the allocator's
    integrity check passes; at the end every slot of both parts is back. Returns the model runner
    (with a speculative ``arch``, its tallies of drafts and accepted tokens)."""
    from support import runners

    w, p = cfg.shape.sliding_window, cfg.page_size
    with runners.cpu_threads(cfg):
        model = arch.build_model(cfg)
        pools = arch.make_pool(cfg, model, torch.float32)
        prompts = runners.make_prompts(cfg)
        sched = arch.scheduler(pools, cfg.batch, cfg.max_context_len, cfg.chunk_size)
        runner = arch.runner(model, pools, None)
        for rid, pr in enumerate(prompts):
            sched.add(runners.Request(rid, list(pr.tokens), pr.new_tokens))
        a = sched.allocator
        steps = freed_steps = 0
        while runner.step(sched, keep_logits=False) is not None:
            steps += 1
            a.check_integrity()
            full_held = a.size_full - a.full_available_size()
            swa_held = a.size_swa - a.swa_available_size()
            assert full_held == sum(-(-r.kv_len // p) * p for r in sched.running)
            assert swa_held == sum(_expected_swa_slots(r.kv_len, w, p) for r in sched.running)
            assert swa_held <= len(sched.running) * (-(-(w + p - 2) // p) * p)  # a live window and a page each
            freed_steps += swa_held < full_held
            for r in sched.running:
                swa = a.translate_loc_from_full_to_swa(sched.table.req_to_token[r.row, : r.kv_len].to(torch.int64))
                live = max(0, r.kv_len - w + 1)
                assert bool((swa[live:] > 0).all())  # every token a later query can see is there
                assert bool((swa[: live // p * p] == 0).all())  # every whole page before the window is given back
        assert sched.step_error is None and len(sched.finished) == len(prompts)
        assert freed_steps > steps // 2  # the SWA part held less than the full part most of the run
    assert a.full_available_size() == a.size_full and a.swa_available_size() == a.size_swa
    assert sched.leaked_slots() == 0
    sched.check_integrity()
    return runner


def serve_on_swa_prefix_cache(arch, cfg) -> tuple[Any, list[list[int]], list[list[int]]]:
    """Serve ``cfg``'s prompts (``prefix_cache`` set: they share prefixes) with a sliding-window
    runner's ``arch`` on its ``SWARadixCache``, checking after every step, from the allocator's
    counts and mapping, that each part holds exactly the tree's tokens plus the running requests' own
    (whole pages from ``cache_protected_len``; in the SWA part from what each gave back), that every
    token inside a running request's window has an SWA slot and none it gave back does, and that the
    tree's live nodes map to SWA slots and its tombstones do not. At the end every slot of both
    parts is back. Returns the scheduler, the generated tokens and HF's (fp32 pool)."""
    from support import runners

    w, p = cfg.shape.sliding_window, cfg.page_size
    with runners.cpu_threads(cfg):
        model = arch.build_model(cfg)
        pools = arch.make_pool(cfg, model, torch.float32)
        prompts = runners.make_prompts(cfg)
        sched = arch.scheduler(pools, cfg.batch, cfg.max_context_len, cfg.chunk_size, True)
        runner = arch.runner(model, pools, None)
        for rid, pr in enumerate(prompts):
            sched.add(runners.Request(rid, list(pr.tokens), pr.new_tokens))
        a, cache = sched.allocator, sched.cache
        while runner.step(sched, keep_logits=False) is not None:
            assert sched.step_error is None, sched.step_error
            tree_full = tree_swa = 0
            stack = list(cache.root_node.children.values())
            while stack:
                node = stack.pop()
                stack.extend(node.children.values())
                swa = a.full_to_swa_index_mapping[node.value]
                tree_full += len(node.value)
                if node.swa_tombstone:
                    assert bool((swa == 0).all()), f"tombstone node {node.id} maps to SWA slots"
                else:
                    assert bool((swa > 0).all()), f"live node {node.id} lost an SWA slot"
                    tree_swa += len(node.value)
            own_full = own_swa = 0
            for r in sched.running:
                end = -(-r.kv_len // p) * p
                own_full += end - r.cache_protected_len
                kept = max(r.cache_protected_len, r.swa_evicted_seqlen)
                own_swa += end - kept
                swa = a.translate_loc_from_full_to_swa(sched.table.req_to_token[r.row, : r.kv_len].to(torch.int64))
                assert bool((swa[max(0, r.kv_len - w + 1) :] > 0).all()), f"request {r.rid} lost a token of its window"
                assert bool((swa[r.cache_protected_len : kept] == 0).all()), f"request {r.rid} maps a slot it gave back"
            assert a.size_full - a.full_available_size() == tree_full + own_full
            assert a.size_swa - a.swa_available_size() == tree_swa + own_swa
        assert len(sched.finished) == len(prompts)
        sched.check_integrity()
        assert sched.leaked_slots() == 0
        assert a.full_available_size() == a.size_full and a.swa_available_size() == a.size_swa
        tokens = [r.output for r in sorted(sched.finished, key=lambda r: r.rid)]
        hf = [g.tokens for g in runners.hf_reference(model, prompts)]
    return sched, tokens, hf


def assert_swa_prefix_cache_serves(module, arch, cfg, argv: list, json_path) -> None:
    """A sliding-window runner (``module``, its ``arch``) on its prefix cache at ``cfg`` (and ``argv``,
    the same run's command line): requests hit the cache, its SWA eviction makes tombstones, every
    step's accounting holds (``serve_on_swa_prefix_cache``) and the tokens are HF's and the run's
    without a cache; the command line (with its speculative run) passes and reports the hits in the
    summary and ``--json``."""
    from support import runners

    sched, tokens, hf = serve_on_swa_prefix_cache(arch, cfg)
    assert tokens == hf
    assert sched.cached_tokens > 0 and sched.prompt_tokens > sched.cached_tokens
    assert sched.swa_evicted > 0 and sched.tombstoned_nodes > 0 and sched.tombstones_peak > 0
    with runners.cpu_threads(cfg):
        model = arch.build_model(cfg)
        plain = runners.serve(model, arch.make_pool(cfg, model, torch.float32), runners.make_prompts(cfg), cfg.batch,
                              keep_logits=False, arch=arch, chunk_size=cfg.chunk_size)  # fmt: skip
    assert [g.tokens for g in plain.generations] == tokens
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert module.main([*argv, "--prefix-cache", "--dtypes", "fp32", "--json", str(json_path)]) == 0
    summary = out.getvalue()
    assert f"    cache       {sched.cached_tokens} of {sched.prompt_tokens} prompt tokens matched" in summary
    assert f"which made {sched.tombstoned_nodes} nodes ({sched.tombstoned_tokens} tokens) tombstones" in summary
    assert summary.count("prompt tokens matched") == 2 and "spec check  PASS" in summary  # the speculative run too
    assert "allocators  OK" in summary and summary.rstrip().endswith("PASS")
    report = json.loads(Path(json_path).read_text())
    assert report["fp32_tokens"] == tokens and report["spec_tokens"] == tokens
    assert report["prefix_cache"]["cached_tokens"] == sched.cached_tokens
    assert report["prefix_cache"]["tombstoned_nodes"] == sched.tombstoned_nodes


def assert_speculative_runs(rep, summary: str, layers: int, prompts: int, every_length: bool = True) -> None:
    """A sliding-window runner's report (``run`` with ``spec_width``): each speculative run generated
    the plain run's tokens on its dtype (and, on fp32, HF's tokens with HF's logits), only in prefill
    and verify steps, one write per layer and step, every slot given back and the SWA part within its
    bound; each verify kept its accepted drafts plus the target's token. With ``every_length``, the
    verify steps accepted every number of drafts from none to all somewhere in the run."""
    from support import runners

    assert rep.spec_runs and rep.spec_check is True and rep.ok, summary
    for s in rep.spec_runs:
        r = s.result
        assert s.vs_plain.identical, summary
        if s.dtype == "fp32":
            assert s.vs_hf.identical and s.vs_hf.max_rel_logit_err <= runners.LOGIT_RTOL, summary
        assert r.decode_steps == 0 and r.verify_steps > 0 and r.allocators_ok, summary
        assert r.fused_calls + r.reference_calls == (r.prefill_steps + r.verify_steps) * layers, summary
        assert r.generated_tokens == prompts + len(r.accept_lengths) + r.accepted_tokens, summary
        assert 0 < r.memory["swa_peak"] <= r.memory["swa_peak_bound"], summary
        if every_length:
            assert set(r.accept_lengths) == set(range(s.width)), summary


def assert_every_write_fused_on_cuda(runner, tiny) -> None:
    """A sliding-window runner (``runner``: its module) on a GPU with ``tiny``'s config: every write
    fused, the tokens transformers' (fp32) or the rounded reference's, the SWA part within its bound."""
    from dataclasses import replace

    rep = runner.run(replace(tiny, device="cuda"))
    summary = runner.format_summary(rep)
    assert rep.fp32_check is True and rep.ok, summary
    for r in rep.runs:
        if r.dtype != "fp32":
            assert r.vs_rounded.identical, summary
        assert r.result.reference_calls == 0 and r.result.fused_calls > 0, summary
        assert r.result.memory["swa_peak"] <= r.result.memory["swa_peak_bound"], summary


def assert_speculative_writes_fused_on_cuda(runner, tiny) -> None:
    """A sliding-window runner (``runner``: its module) on a GPU with ``tiny``'s config: every write of
    the speculative runs (prefill, and the verify write into both parts) is fused, and the
    speculative tokens are the plain runs' on fp32 and FP8 pools."""
    from dataclasses import replace

    cfg = replace(tiny, device="cuda", pool_dtypes=("fp32",), calibrate=False)
    rep = runner.run(cfg, runner.SlidingOptions(spec_width=4, spec_dtypes=("fp32", "fp8_e4m3")))
    summary = runner.format_summary(rep)
    assert_speculative_runs(rep, summary, cfg.shape.layers, cfg.prompts, every_length=False)
    for r in [*rep.runs, *rep.spec_runs]:
        assert r.result.reference_calls == 0 and r.result.fused_calls > 0, summary


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
        kwargs = getattr(kernel, "kwargs", {})
        self.unspecialised = frozenset(kwargs.get("do_not_specialize") or ())
        self.unaligned = frozenset(  # parameters (named or by position) not specialised on alignment
            self.params[n] if isinstance(n, int) else n for n in kwargs.get("do_not_specialize_on_alignment") or ()
        )
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
            ("constexpr", v) if n in self.constexprs
            else _specialisation(v, n not in (self.unaligned if isinstance(v, torch.Tensor) else self.unspecialised))
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

#: ``KVPOOL_LONG_TESTS=1`` runs every state machine until it has taken ``KVPOOL_LONG_STEPS`` steps
#: (100000): ``LONG_RUNS`` runs of up to ``LONG_RUN_STEPS`` steps from each seed, one random seed after
#: another (``KVPOOL_LONG_SEED`` the first: a seed's runs are the same whatever the budget, so that
#: it repeats a failure); ``KVPOOL_NO_SHRINK=1`` reports a failure as found, unshrunk.
LONG_TESTS = os.environ.get("KVPOOL_LONG_TESTS") == "1"
LONG_STEPS = int(os.environ.get("KVPOOL_LONG_STEPS", "100000"))
LONG_RUNS, LONG_RUN_STEPS = 10, 200


def _counting(machine: type) -> type:
    """``machine`` with a step counter (``steps_taken``, on the class): an invariant, which Hypothesis
    checks once after every step (the initialize rule's included) and never before it. The class
    reads as ``machine`` to Hypothesis (name, module, source), so a derandomised run draws the same
    examples as ``machine`` itself."""

    class Counted(machine):  # type: ignore[misc, valid-type]
        steps_taken = 0

        @invariant()
        def count_step(self) -> None:
            type(self).steps_taken += 1

    Counted.__name__, Counted.__qualname__, Counted.__module__ = machine.__name__, machine.__qualname__, machine.__module__
    return Counted


def run_machine(machine: type, *, examples: int, steps: int, seed: Optional[int] = None) -> int:
    """Run the state machine ``machine``; returns the steps it took, and prints them on stderr.

    CI: ``examples`` runs of up to ``steps`` steps, derandomised (from ``seed`` when given), so
    that a CI run is reproducible. ``KVPOOL_LONG_TESTS=1``: ``LONG_RUNS`` runs of up to
    ``LONG_RUN_STEPS`` steps per seed, one random seed after another (``seed`` ignored), until
    ``LONG_STEPS`` steps were taken. No
    deadline; a failure prints the blob that reproduces it (and, long, its seed)."""
    counted = _counting(machine)
    phases = {"phases": [Phase.explicit, Phase.reuse, Phase.generate]} if os.environ.get("KVPOOL_NO_SHRINK") == "1" else {}

    def run(first: Optional[int], runs: int, length: int) -> None:
        factory = counted if first is None else hypothesis.seed(first)(counted)
        hypothesis.stateful.run_state_machine_as_test(factory, settings=settings(
            max_examples=runs, stateful_step_count=length, deadline=None, database=None, print_blob=True,
            derandomize=not LONG_TESTS, suppress_health_check=list(HealthCheck), **phases,
        ))  # fmt: skip

    start = time.monotonic()
    if not LONG_TESTS:
        run(seed, examples, steps)
        seeds = "derandomised" if seed is None else f"seed {seed}"
    else:
        first = int(os.environ.get("KVPOOL_LONG_SEED") or random.randrange(2**32))
        s = first
        while counted.steps_taken < LONG_STEPS:
            try:
                run(s, LONG_RUNS, LONG_RUN_STEPS)
            except BaseException:
                print(f"{machine.__name__}: failed in the run from seed {s} (KVPOOL_LONG_SEED={s} repeats it)", file=sys.stderr)
                raise
            s += 1
        seeds = f"seeds {first}..{s - 1}"
    print(f"{machine.__name__}: {counted.steps_taken} steps, {seeds}, {time.monotonic() - start:.1f} s", file=sys.stderr)
    return counted.steps_taken


def machine_test(machine: type, *, examples: int, steps: int, seed: Optional[int] = None) -> type:
    """A test case (one pytest id, named ``Test<machine>``) that runs ``run_machine(machine, ...)`` and
    checks that it took steps."""

    def runTest(self: unittest.TestCase) -> None:
        assert run_machine(machine, examples=examples, steps=steps, seed=seed) > 0

    name = f"Test{machine.__name__}"
    return type(name, (unittest.TestCase,), {"runTest": runTest, "__qualname__": name, "__module__": machine.__module__})


# ----------------------------------------------------------------------------------------------
# The prefix caches: short forms of their calls, a record of a tree's contents, a scheduler over
# the real allocators and request table (Engine), and one for hybrid models (HybridEngine).

def int_tensor(xs, dtype=torch.int64):
    """``xs`` as an int64 (or ``dtype``) tensor: the cache tests' short form."""
    return torch.tensor(xs, dtype=dtype)


def sim(page_size=1, **kwargs) -> RadixCache:
    return RadixCache.create_simulated(page_size=page_size, **kwargs)


def insert(cache, tokens, values=None, extra=None, priority=0) -> int:
    v = None if values is None else int_tensor(values)
    return cache.insert(InsertParams(key=RadixKey(list(tokens), extra), value=v, priority=priority)).prefix_len


def match(cache, tokens, extra=None):
    return cache.match_prefix(MatchPrefixParams(key=RadixKey(list(tokens), extra)))


def tree_state(cache: RadixCache) -> tuple:
    """Everything the tree holds, as plain values (to prove that a call changed nothing)."""
    rows = []
    stack = [cache.root_node]
    while stack:
        n = stack.pop()
        value = None if n.value is None else tuple(n.value.tolist())
        parent = None if n.parent is None else n.parent.id
        rows.append((n.id, parent, tuple(n.key.token_ids), n.key.extra_key, value, n.lock_ref, n.hit_count, n.priority))
        stack.extend(n.children.values())
    return (sorted(rows, key=repr), cache.evictable_size(), cache.protected_size(), len(cache.kv_event_queue))


def seq(n, start=1000, step=1):
    return list(range(start, start + n * step, step))


def free_recorder():
    freed: list[list[int]] = []
    alloc = unittest.mock.Mock()
    alloc.device = torch.device("cpu")
    alloc.free.side_effect = lambda t: freed.append(t.tolist())
    return alloc, freed


@dataclasses.dataclass
class SimReq:
    """A request as the cache's request protocol describes it (kvpool.cache.requests)."""

    req_pool_idx: int
    origin_input_ids: list
    extra_key: Any = None
    output_ids: list = dataclasses.field(default_factory=list)
    last_node: Any = None
    cache_protected_len: int = 0
    prefix_indices: Any = None
    kv_committed_len: int = 0
    kv_allocated_len: int = 0
    priority: int = 0

    @property
    def fill_ids(self) -> list:
        return self.origin_input_ids + self.output_ids


class Engine:
    """A scheduler's use of the cache: admit (match, lock, load back from the host tier, allocate,
    evict on shortage), decode one token, chunk (cache_unfinished_req), finish, retract. Records
    each slot's content (the namespace and the token prefix whose KV it holds), so a match can be
    checked slot by slot. With ``host_policy`` the cache is a ``HiRadixCache`` over an FP8 device pool
    and a host pool, every slot's K/V rows hold a pattern of its content, and every loaded slot's
    bytes are checked against it. With ``storage`` (a backend, and ``storage_policy``) the cache has
    a storage tier too, and an admission prefetches the match's remainder from it first, as SGLang's
    scheduler does (``wait=True``: asks ``check_prefetch_progress`` until it says go on); engines
    that share ``ids`` write the same patterns, so one can check pages another stored."""

    def __init__(self, kind: str, page: int, pages: int, rows: int = 6, policy: str = "lru",
                 host_policy: Optional[str] = None, layout: str = "layer_first", host_ratio: float = 2.0,
                 storage: Any = None, storage_policy: Any = None, **cache_kw):  # fmt: skip
        size = pages * page
        self.pool = None
        if host_policy is not None:
            self.pool = MHATokenToKVPool(size, page, torch.float8_e4m3fn, 3, 8, 2, "cpu", v_head_dim=4)
        if kind == "token":
            self.alloc = TokenToKVPoolAllocator(size, kvcache=self.pool, validate=True)
        else:
            self.alloc = PagedTokenToKVPoolAllocator(size, page, kvcache=self.pool, validate=True)
        self.page, self.size = page, size
        self.table = ReqToTokenPool(rows, max_context_len=size + page, device="cpu")
        params = CacheInitParams(
            disable=False, req_to_token_pool=self.table, token_to_kv_pool_allocator=self.alloc, page_size=page,
            eviction_policy=policy, **cache_kw,
        )  # fmt: skip
        if host_policy is None:
            self.cache = RadixCache(params)
        else:
            self.host = MHATokenToKVPoolHost(self.pool, host_ratio, 0, page, layout)
            self.cache = HiRadixCache(params, host_pool=self.host, write_policy=host_policy, load_back_threshold=0,
                                      storage=storage, storage_policy=storage_policy)  # fmt: skip
        self.running: dict[int, SimReq] = {}
        self.content: dict[int, tuple] = {}
        self.ids: dict[tuple, int] = {}
        self.loaded = 0
        self.from_storage = 0

    def prefetch(self, rid: Any, tokens: list, extra: Any, wait: bool = True) -> Any:
        """Match ``tokens``, prefetch what follows the match's last host copy from storage, and match
        again once ``check_prefetch_progress`` lets the request go on."""
        m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens, extra)))
        node, depth = m.last_host_node, 0
        while node is not self.cache.root_node:
            depth, node = depth + len(node.key), node.parent
        self.cache.prefetch_from_storage(rid, m.last_host_node, RadixKey(tokens[depth:], extra))
        while not self.cache.check_prefetch_progress(rid):
            assert wait, "the prefetch policy held the request back"
            time.sleep(0.005)
        self.from_storage += self.cache.pop_prefetch_loaded_tokens(rid)
        return self.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens, extra)))

    def check_slots(self, slots: torch.Tensor, extra: Any, tokens: list) -> None:
        for i, s in enumerate(slots.tolist()):
            assert self.content.get(s) == (extra, tuple(tokens[: i + 1])), f"slot {s} at position {i} holds other KV"

    def pattern(self, contents: list[tuple], layer: int, which: str) -> torch.Tensor:
        """[n, row bytes] uint8: the K or V row bytes of each content (its id's bytes, then a mix)."""
        ids = torch.tensor([self.ids.setdefault(c, len(self.ids)) for c in contents], dtype=torch.int64)
        width = 3 * (8 if which == "k" else 4)
        rows = (ids[:, None] * 131 + torch.arange(width) * 7 + layer * 13 + (which == "v") * 57) % 256
        rows[:, :4] = torch.stack([(ids >> (8 * b)) % 256 for b in range(4)], 1)
        return rows.to(torch.uint8)

    def _rows(self, layer: int, which: str) -> torch.Tensor:
        buf = self.pool.k_buffer[layer] if which == "k" else self.pool.v_buffer[layer]
        return buf.view(torch.uint8).reshape(buf.shape[0], -1)

    def record(self, slots: list[int], contents: list[tuple]) -> None:
        """``slots`` now hold ``contents``' KV (written by the model, here its pattern)."""
        for s, c in zip(slots, contents):
            self.content[s] = c
        if self.pool is not None and slots:
            for layer in range(self.pool.layer_num):
                for which in "kv":
                    self._rows(layer, which)[int_tensor(slots)] = self.pattern(contents, layer, which)

    def check_bytes(self, slots: list[int], contents: list[tuple]) -> None:
        for layer in range(self.pool.layer_num):
            for which in "kv":
                got, want = self._rows(layer, which)[int_tensor(slots)], self.pattern(contents, layer, which)
                assert torch.equal(got, want), f"loaded {which} rows of layer {layer} differ from the KV backed up"

    def _alloc(self, n: int, prefix: int, last: int) -> Optional[torch.Tensor]:
        if isinstance(self.alloc, TokenToKVPoolAllocator):
            return self.alloc.alloc(n)
        one = int_tensor([1])
        pre, sq = prefix * one, (prefix + n) * one
        return self.alloc.alloc_extend(pre, pre.clone(), sq, sq.clone(), last * one, n)

    def alloc_or_evict(self, n: int, prefix: int, last: int) -> Optional[torch.Tensor]:
        got = self._alloc(n, prefix, last)
        if got is None:
            self.cache.evict(EvictParams(num_tokens=n + self.page))
            got = self._alloc(n, prefix, last)
        return got

    def admit(self, tokens: list, extra: Any = None) -> Optional[SimReq]:
        rows = self.table.alloc(1)
        if rows is None:
            return None
        if isinstance(self.cache, HiRadixCache) and self.cache.enable_storage:
            m = self.prefetch(rows[0], tokens[:-1], extra)
        else:
            m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens[:-1], extra)))
        prefix, last = m.device_indices, m.last_device_node
        assert len(prefix) % self.page == 0 and len(prefix) < len(tokens)
        self.check_slots(prefix, extra, tokens)
        self.cache.inc_lock_ref(last)
        if m.host_hit_length:  # as SGLang's PrefillAdder: load back under the device prefix's lock
            new, loaded_node = self.cache.init_load_back(m.last_host_node, m.host_hit_length)
            self.cache.dec_lock_ref(last)
            self.cache.inc_lock_ref(loaded_node)
            last = loaded_node
            if len(new):
                self.cache.ready_to_load_host_cache()
                contents = [(extra, tuple(tokens[: len(prefix) + i + 1])) for i in range(len(new))]
                self.check_bytes(new.tolist(), contents)
                self.record(new.tolist(), contents)
                self.loaded += len(new)
                prefix = torch.cat((prefix, new))
        p = len(prefix)
        new = self.alloc_or_evict(len(tokens) - p, p, int(prefix[-1]) if p else -1)
        if new is None:
            self.cache.dec_lock_ref(last)
            self.table.free(rows[0])
            return None
        row = rows[0]
        self.table.write((row, slice(0, len(tokens))), torch.cat((prefix, new)).to(torch.int32))
        self.record(new.tolist(), [(extra, tuple(tokens[: p + i + 1])) for i in range(len(new))])
        req = SimReq(row, list(tokens), extra, last_node=last, cache_protected_len=p, prefix_indices=prefix,
                     kv_committed_len=len(tokens), kv_allocated_len=len(tokens))  # fmt: skip
        self.running[row] = req
        return req

    def decode(self, req: SimReq, token: int) -> bool:
        n = req.kv_committed_len
        last = int(self.table.req_to_token[req.req_pool_idx, n - 1])
        if isinstance(self.alloc, TokenToKVPoolAllocator):
            got = self.alloc.alloc(1)
        else:
            sq = int_tensor([n + 1])
            got = self.alloc.alloc_decode(sq, sq.clone(), int_tensor([last]))
        if got is None:
            return False
        req.output_ids.append(token)
        self.table.req_to_token[req.req_pool_idx, n] = int(got[0])
        self.record([int(got[0])], [(req.extra_key, tuple(req.fill_ids))])
        req.kv_committed_len = req.kv_allocated_len = n + 1
        return True

    def chunk(self, req: SimReq) -> None:
        self.cache.cache_unfinished_req(req)
        row = self.table.req_to_token[req.req_pool_idx, : req.kv_committed_len].to(torch.int64)
        assert torch.equal(req.prefix_indices, row)
        self.check_slots(row, req.extra_key, req.fill_ids)

    def finish(self, req: SimReq, insert: bool = True) -> None:
        tokens = req.fill_ids[: req.kv_committed_len]
        self.cache.cache_finished_req(req, is_insert=insert)
        self.table.free(req.req_pool_idx)
        del self.running[req.req_pool_idx]
        if insert:
            aligned = len(tokens) // self.page * self.page
            m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens, req.extra_key)))
            assert len(m.device_indices) == aligned
            self.check_slots(m.device_indices, req.extra_key, tokens)

    def drain(self) -> None:
        """Finish everything and evict the whole tree: every slot must be back (host slots too)."""
        for req in list(self.running.values()):
            self.finish(req)
        if isinstance(self.cache, HiRadixCache):
            self.cache.check_hicache_events()
        self.cache.evict(EvictParams(num_tokens=self.size))
        assert self.cache.total_size() == 0
        assert self.alloc.available_size() == self.size // self.page * self.page
        if isinstance(self.cache, HiRadixCache):
            self.cache.evict_host(self.host.size)
            assert self.host.available_size() == self.host.size and len(self.cache.root_node.children) == 0
        self.cache.check_integrity()


class SWAEngine:
    """A scheduler on an SWARadixCache over an SWATokenToKVPoolAllocator (``validate`` on): as
    ``Engine``, and as SGLang's ``ScheduleBatch._evict_swa``, each decode gives back the SWA part of
    the request's own tokens that left its window (``free_swa``, whole pages, from
    ``cache_protected_len`` on) and records it in ``req.swa_evicted_seqlen``. Every match is
    checked: its slots hold its tokens' KV and its last window has SWA KV; a shortage evicts from
    whichever part is short."""

    def __init__(self, page: int, pages: int, swa_pages: int, window: int, rows: int = 6, policy: str = "lru",
                 is_eagle: bool = False, sglang_slide: bool = False):  # fmt: skip
        from kvpool import SWATokenToKVPoolAllocator

        self.page, self.window, self.eagle, self.sglang_slide = page, window, is_eagle, sglang_slide
        self.size, self.size_swa = pages * page, swa_pages * page
        self.alloc = SWATokenToKVPoolAllocator(self.size, self.size_swa, page, validate=True)
        self.table = ReqToTokenPool(rows, max_context_len=self.size + page, device="cpu")
        self.cache = SWARadixCache(CacheInitParams(
            disable=False, req_to_token_pool=self.table, token_to_kv_pool_allocator=self.alloc, page_size=page,
            eviction_policy=policy, sliding_window_size=window, is_eagle=is_eagle,
        ))  # fmt: skip
        self.running: dict[int, SimReq] = {}
        self.content: dict[int, tuple] = {}

    def has_swa(self, slots: torch.Tensor) -> torch.Tensor:
        """Per full slot: whether it has a SWA slot (the allocator's mapping)."""
        return self.alloc.full_to_swa_index_mapping[slots.to(torch.int64)] > 0

    def check_match(self, slots: torch.Tensor, extra: Any, tokens: list) -> None:
        for i, s in enumerate(slots.tolist()):
            assert self.content.get(s) == (extra, tuple(tokens[: i + 1])), f"slot {s} at position {i} holds other KV"
        tail = slots[max(len(slots) - self.window, 0) :]
        assert bool(self.has_swa(tail).all()), "a match returned a prefix whose last window lacks SWA KV"

    def _alloc(self, n: int, prefix: int, last: int) -> Optional[torch.Tensor]:
        if self.page == 1:
            return self.alloc.alloc(n)
        one = int_tensor([1])
        pre, sq = prefix * one, (prefix + n) * one
        return self.alloc.alloc_extend(pre, pre.clone(), sq, sq.clone(), last * one, n)

    def alloc_or_evict(self, n: int, prefix: int, last: int) -> Optional[torch.Tensor]:
        got = self._alloc(n, prefix, last)
        if got is None:
            need = n + self.page
            self.cache.evict(EvictParams(num_tokens=max(need - self.alloc.full_available_size(), 0),
                                         swa_num_tokens=max(need - self.alloc.swa_available_size(), 0)))  # fmt: skip
            got = self._alloc(n, prefix, last)
        return got

    def admit(self, tokens: list, extra: Any = None) -> Optional[SimReq]:
        rows = self.table.alloc(1)
        if rows is None:
            return None
        m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens[:-1], extra)))
        prefix, last = m.device_indices, m.last_device_node
        assert len(prefix) % self.page == 0 and len(prefix) < len(tokens)
        self.check_match(prefix, extra, tokens)
        uuid = self.cache.inc_lock_ref(last)
        p = len(prefix)
        new = self.alloc_or_evict(len(tokens) - p, p, int(prefix[-1]) if p else -1)
        if new is None:
            self.cache.dec_lock_ref(last, uuid)
            self.table.free(rows[0])
            return None
        row = rows[0]
        self.table.write((row, slice(0, len(tokens))), torch.cat((prefix, new)).to(torch.int32))
        for i, s in enumerate(new.tolist()):
            self.content[s] = (extra, tuple(tokens[: p + i + 1]))
        req = SimReq(row, list(tokens), extra, last_node=last, cache_protected_len=p, prefix_indices=prefix,
                     kv_committed_len=len(tokens), kv_allocated_len=len(tokens))  # fmt: skip
        req.swa_uuid_for_lock, req.swa_evicted_seqlen = uuid, 0
        self.running[row] = req
        return req

    def slide(self, req: SimReq) -> None:
        """Give back the SWA part of the request's own tokens that left its window, and of no token
        in the last window of what the tree can take of it (its whole pages; with EAGLE keys one
        token fewer, since a key of n tokens caches n - 1 slots), so that its cached tail keeps a
        whole window. With ``sglang_slide``, as SGLang's scheduler does: everything before the last
        window of its committed tokens (its cached tail may then be shorter than the window)."""
        start = max(req.swa_evicted_seqlen, req.cache_protected_len)
        n = req.kv_committed_len
        cacheable = n if self.sglang_slide else (n - (1 if self.eagle else 0)) // self.page * self.page
        end = max(start, min(n, cacheable) - self.window) // self.page * self.page
        if end > start:
            self.alloc.free_swa(self.table.req_to_token[req.req_pool_idx, start:end])
            req.swa_evicted_seqlen = end

    def decode(self, req: SimReq, token: int) -> bool:
        n = req.kv_committed_len
        last = int(self.table.req_to_token[req.req_pool_idx, n - 1])
        if self.page == 1:
            got = self.alloc_or_evict(1, n, last)
        else:
            sq = int_tensor([n + 1])
            got = self.alloc.alloc_decode(sq, sq.clone(), int_tensor([last]))
            if got is None:
                self.cache.evict(EvictParams(num_tokens=self.page, swa_num_tokens=self.page))
                got = self.alloc.alloc_decode(sq, sq.clone(), int_tensor([last]))
        if got is None:
            return False
        req.output_ids.append(token)
        self.table.req_to_token[req.req_pool_idx, n] = int(got[0])
        self.content[int(got[0])] = (req.extra_key, tuple(req.fill_ids))
        req.kv_committed_len = req.kv_allocated_len = n + 1
        self.slide(req)
        return True

    def chunk(self, req: SimReq) -> None:
        self.cache.cache_unfinished_req(req)
        row = self.table.req_to_token[req.req_pool_idx, : req.kv_committed_len].to(torch.int64)
        assert torch.equal(req.prefix_indices, row)
        self.check_match(row[: req.cache_protected_len], req.extra_key, req.fill_ids)
        for i, s in enumerate(row.tolist()):
            assert self.content.get(s) == (req.extra_key, tuple(req.fill_ids[: i + 1])), f"row slot {s} at {i} holds other KV"

    def finish(self, req: SimReq, insert: bool = True) -> None:
        tokens = req.fill_ids[: req.kv_committed_len]
        self.cache.cache_finished_req(req, is_insert=insert)
        self.table.free(req.req_pool_idx)
        del self.running[req.req_pool_idx]
        m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens, req.extra_key)))
        self.check_match(m.device_indices, req.extra_key, tokens)

    def drain(self) -> None:
        """Finish everything and evict the whole tree: every slot of both parts must be back."""
        for req in list(self.running.values()):
            self.finish(req)
        self.cache.evict(EvictParams(num_tokens=self.size, swa_num_tokens=self.size_swa))
        assert self.cache.total_size() == (0, 0)
        assert (self.alloc.full_available_size(), self.alloc.swa_available_size()) == (self.size, self.size_swa)
        self.cache.check_integrity()


STATE = MambaCacheParams(MambaStateShape(conv=(6, 3), temporal=(2, 3, 4)), layers=(1, 3))


class HybridEngine:
    """A hybrid model's scheduler on a MambaRadixCache: each request has a state slot that holds the
    state after its tokens (here a byte pattern of its content), and with the extra buffer a track
    slot snapshots it at every whole page. Every match is checked: its KV slots hold its tokens'
    KV, and the node it ends on holds the state after exactly those tokens."""

    def __init__(self, page: int, pages: int, states: int, rows: int = 6, extra: bool = False):
        size = pages * page
        self.page, self.size = page, size
        self.table = HybridReqToTokenPool(size=rows, mamba_size=states, max_context_len=size + page, device="cpu",
                                          cache_params=STATE, enable_mamba_extra_buffer=extra)  # fmt: skip
        self.pool = self.table.mamba_pool
        self.alloc = (TokenToKVPoolAllocator(size, validate=True) if page == 1 else PagedTokenToKVPoolAllocator(size, page, validate=True))
        self.cache = MambaRadixCache(CacheInitParams(
            disable=False, req_to_token_pool=self.table, token_to_kv_pool_allocator=self.alloc, page_size=page,
            enable_mamba_extra_buffer=extra,
        ), mamba_cache_chunk_size=page)  # fmt: skip
        self.extra = extra
        self.running: dict[int, SimReq] = {}
        self.content: dict[int, tuple] = {}
        self.ids: dict[tuple, int] = {}

    def state_bytes(self, slot: int) -> list[torch.Tensor]:
        return [t[:, slot].reshape(t.shape[0], -1).view(torch.uint8) for t in (*self.pool.conv, self.pool.temporal)]

    def write_state(self, slot: int, content: tuple) -> None:
        cid = self.ids.setdefault(content, len(self.ids))
        for b in self.state_bytes(slot):
            b.copy_((torch.arange(b.numel()).view(b.shape) * 3 + cid * 101) % 256)
            b[:, :4] = torch.tensor([(cid >> (8 * i)) % 256 for i in range(4)], dtype=torch.uint8)

    def check_state(self, slot: int, content: tuple) -> None:
        cid = self.ids.get(content)
        for b in self.state_bytes(slot):
            got = sum(int(x) << (8 * i) for i, x in enumerate(b[0, :4].tolist()))
            assert cid is not None and got == cid, f"state slot {slot} holds another state than after {len(content[1])} tokens"

    def check_match(self, m, extra: Any, tokens: list) -> None:
        n = len(m.device_indices)
        for i, s in enumerate(m.device_indices.tolist()):
            assert self.content.get(s) == (extra, tuple(tokens[: i + 1])), f"slot {s} at position {i} holds other KV"
        if n:
            node = m.last_device_node
            assert node.mamba_value is not None, "KV returned without a state snapshot"
            self.check_state(int(node.mamba_value), (extra, tuple(tokens[:n])))

    def _alloc(self, n: int, prefix: int, last: int) -> Optional[torch.Tensor]:
        if self.page == 1:
            return self.alloc.alloc(n)
        one = int_tensor([1])
        pre, sq = prefix * one, (prefix + n) * one
        return self.alloc.alloc_extend(pre, pre.clone(), sq, sq.clone(), last * one, n)

    def compute(self, req: SimReq, start: int) -> None:
        """The model ran tokens start.. of req: its state slot now holds the state after all of them,
        and (extra buffer) its track slots snapshotted it at each whole page passed."""
        tokens = req.fill_ids
        if self.extra:
            for end in range((start // self.page + 1) * self.page, len(tokens) + 1, self.page):
                track = int(req.mamba_ping_pong_track_buffer[req.mamba_next_track_idx])
                self.write_state(track, (req.extra_key, tuple(tokens[:end])))
                req.mamba_last_track_seqlen = end
                req.mamba_next_track_idx = self.table.get_mamba_ping_pong_other_idx(req.mamba_next_track_idx)
        self.write_state(int(req.mamba_pool_idx), (req.extra_key, tuple(tokens)))

    def admit(self, tokens: list, extra: Any = None) -> Optional[SimReq]:
        req = SimReq(-1, list(tokens), extra)
        del req.req_pool_idx
        req.mamba_pool_idx = None
        req.mamba_last_track_seqlen = None
        if self.table.alloc([req]) is None:
            self.cache.evict(EvictParams(num_tokens=0, mamba_num=2))
            if self.table.alloc([req]) is None:
                return None
        m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens[:-1], extra), cow_mamba=True, req=req))
        self.check_match(m, extra, tokens)
        p = len(m.device_indices)
        if p:
            self.check_state(int(req.mamba_pool_idx), (extra, tuple(tokens[:p])))  # forked into its own slot
        self.cache.inc_lock_ref(m.last_device_node)
        new = self._alloc(len(tokens) - p, p, -1)
        if new is None:
            self.cache.evict(EvictParams(num_tokens=len(tokens) - p + self.page))
            new = self._alloc(len(tokens) - p, p, -1)
        if new is None:
            self.cache.dec_lock_ref(m.last_device_node)
            self.table.free_mamba_cache(req)
            self.table.free(req)
            return None
        row = req.req_pool_idx
        self.table.write((row, slice(0, len(tokens))), torch.cat((m.device_indices, new)).to(torch.int32))
        for i, s in enumerate(new.tolist()):
            self.content[s] = (extra, tuple(tokens[: p + i + 1]))
        req.last_node, req.cache_protected_len, req.prefix_indices = m.last_device_node, p, m.device_indices
        req.kv_committed_len = req.kv_allocated_len = len(tokens)
        self.compute(req, p)
        self.running[row] = req
        return req

    def decode(self, req: SimReq, token: int) -> bool:
        n = req.kv_committed_len
        if self.page == 1:
            got = self.alloc.alloc(1)
        else:
            sq = int_tensor([n + 1])
            got = self.alloc.alloc_decode(sq, sq.clone(), int_tensor([int(self.table.req_to_token[req.req_pool_idx, n - 1])]))
        if got is None:
            return False
        req.output_ids.append(token)
        self.table.req_to_token[req.req_pool_idx, n] = int(got[0])
        self.content[int(got[0])] = (req.extra_key, tuple(req.fill_ids))
        req.kv_committed_len = req.kv_allocated_len = n + 1
        self.compute(req, n)
        return True

    def finish(self, req: SimReq, insert: bool = True) -> None:
        tokens = req.fill_ids[: req.kv_committed_len]
        self.cache.cache_finished_req(req, is_insert=insert)
        self.table.free(req)
        del self.running[[r for r, q in self.running.items() if q is req][0]]
        self.check_match(self.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens, req.extra_key))), req.extra_key, tokens)

    def chunk(self, req: SimReq) -> None:
        self.cache.cache_unfinished_req(req)
        row = self.table.req_to_token[req.req_pool_idx, : req.kv_committed_len].to(torch.int64)
        assert torch.equal(req.prefix_indices, row)

    def drain(self) -> None:
        for req in list(self.running.values()):
            self.finish(req)
        self.cache.evict(EvictParams(num_tokens=self.size))
        assert self.cache.total_size() == (0, 0) and self.alloc.available_size() == self.size
        assert self.pool.available_size() == self.pool.size
        self.cache.check_integrity()



class HiHybridEngine(HybridEngine):
    """``HybridEngine`` on a ``HiMambaRadixCache``: the allocator over an FP8 ``HybridLinearKVPool``
    with the table's state pool, a ``HybridPoolHost`` below it. Every computed slot's K/V rows hold a
    pattern of its content (as every state slot does), and an admission loads the match's host part
    back as SGLang's scheduler does, checking every loaded KV row and state byte for byte against
    the pattern of what it holds, then forks the loaded state into the request (a second match)."""

    def __init__(self, page: int, pages: int, states: int, rows: int = 6, extra: bool = False,
                 host_policy: str = "write_through", host_ratio: float = 2.0, state_ratio: Optional[float] = None,
                 layout: str = "layer_first", storage: Any = None, storage_policy: Any = None):  # fmt: skip
        size = pages * page
        self.page, self.size, self.extra = page, size, extra
        self.table = HybridReqToTokenPool(size=rows, mamba_size=states, max_context_len=size + page, device="cpu",
                                          cache_params=STATE, enable_mamba_extra_buffer=extra)  # fmt: skip
        self.pool = self.table.mamba_pool
        self.kv = HybridLinearKVPool(size, torch.float8_e4m3fn, page, 2, 4, [0, 2], False, "cpu", self.pool, warmup=False)
        kw = dict(kvcache=self.kv, validate=True)
        self.alloc = TokenToKVPoolAllocator(size, **kw) if page == 1 else PagedTokenToKVPoolAllocator(size, page, **kw)
        self.host = HybridPoolHost(self.kv, host_ratio, 0, page, layout, state_host_to_device_ratio=state_ratio)
        self.cache = HiMambaRadixCache(self.cache_params(), host_pool=self.host, write_policy=host_policy,
                                       load_back_threshold=0, mamba_cache_chunk_size=page, storage=storage,
                                       storage_policy=storage_policy)  # fmt: skip
        self.running: dict[int, SimReq] = {}
        self.content: dict[int, tuple] = {}
        self.ids: dict[tuple, int] = {}
        self.loaded = self.states_loaded = self.from_storage = 0

    def prefetch(self, rid: Any, key: RadixKey) -> None:
        """Prefetch from storage what follows ``key``'s match's ``last_host_node``, waiting until
        ``check_prefetch_progress`` lets the request go on."""
        m = self.cache.match_prefix(MatchPrefixParams(key=key))
        node, depth = m.last_host_node, 0
        while node is not self.cache.root_node:
            depth, node = depth + len(node.key), node.parent
        self.cache.prefetch_from_storage(rid, m.last_host_node, RadixKey(list(key.token_ids[depth:]), key.extra_key))
        deadline = time.monotonic() + 30
        while not self.cache.check_prefetch_progress(rid):
            assert time.monotonic() < deadline, f"request {rid}'s prefetch did not finish"
            time.sleep(0.002)
        self.from_storage += self.cache.pop_prefetch_loaded_tokens(rid)

    def cache_params(self) -> CacheInitParams:
        """The engine's pools as a cache's parameters."""
        return CacheInitParams(
            disable=False, req_to_token_pool=self.table, token_to_kv_pool_allocator=self.alloc, page_size=self.page,
            enable_mamba_extra_buffer=self.extra,
        )  # fmt: skip

    def state_pattern(self, content: tuple) -> list[torch.Tensor]:
        """The bytes ``write_state`` writes for ``content``, computed apart from any slot."""
        cid = self.ids[content]
        out = []
        for b in self.state_bytes(0):
            want = ((torch.arange(b.numel()).view(b.shape) * 3 + cid * 101) % 256).to(torch.uint8)
            want[:, :4] = torch.tensor([(cid >> (8 * i)) % 256 for i in range(4)], dtype=torch.uint8)
            out.append(want)
        return out

    def check_state_bytes(self, slot: int, content: tuple) -> None:
        for got, want in zip(self.state_bytes(slot), self.state_pattern(content)):
            assert torch.equal(got, want), f"state slot {slot} differs byte for byte from the state after {len(content[1])} tokens"

    def _rows(self, layer: int, which: str) -> torch.Tensor:
        inner = self.kv.full_kv_pool
        buf = inner.k_buffer[layer] if which == "k" else inner.v_buffer[layer]
        return buf.view(torch.uint8).reshape(buf.shape[0], -1)

    def kv_pattern(self, contents: list, layer: int, which: str) -> torch.Tensor:
        ids = torch.tensor([self.ids.setdefault(c, len(self.ids)) for c in contents], dtype=torch.int64)
        width = self._rows(layer, which).shape[1]
        rows = (ids[:, None] * 131 + torch.arange(width) * 7 + layer * 13 + (which == "v") * 57) % 256
        rows[:, :4] = torch.stack([(ids >> (8 * b)) % 256 for b in range(4)], 1)
        return rows.to(torch.uint8)

    def check_kv_bytes(self, slots: list, contents: list) -> None:
        for layer in range(self.kv.full_kv_pool.layer_num):
            for which in "kv":
                got, want = self._rows(layer, which)[int_tensor(slots)], self.kv_pattern(contents, layer, which)
                assert torch.equal(got, want), f"{which} rows of layer {layer} differ from the KV written"

    def compute(self, req: SimReq, start: int) -> None:
        super().compute(req, start)
        tokens = req.fill_ids
        slots = self.table.req_to_token[req.req_pool_idx, start : len(tokens)].tolist()
        contents = [(req.extra_key, tuple(tokens[: start + i + 1])) for i in range(len(slots))]
        for layer in range(self.kv.full_kv_pool.layer_num):
            for which in "kv":
                self._rows(layer, which)[int_tensor(slots)] = self.kv_pattern(contents, layer, which)

    def admit(self, tokens: list, extra: Any = None) -> Optional[SimReq]:
        req = SimReq(-1, list(tokens), extra)
        del req.req_pool_idx
        req.mamba_pool_idx = None
        req.mamba_last_track_seqlen = None
        if self.table.alloc([req]) is None:
            self.cache.evict(EvictParams(num_tokens=0, mamba_num=2))
            if self.table.alloc([req]) is None:
                return None
        key = RadixKey(tokens[:-1], extra)
        if self.cache.enable_storage:
            self.prefetch(req.req_pool_idx, key)
        m = self.cache.match_prefix(MatchPrefixParams(key=key, cow_mamba=True, req=req))
        self.check_match(m, extra, tokens)
        last = m.last_device_node
        self.cache.inc_lock_ref(last)
        if m.host_hit_length:
            new, node = self.cache.init_load_back(m.last_host_node, m.host_hit_length)
            self.cache.dec_lock_ref(last)
            self.cache.inc_lock_ref(node)
            last = node
            if len(new):
                assert len(new) == m.host_hit_length
                self.cache.ready_to_load_host_cache()
                p0 = len(m.device_indices)
                contents = [(extra, tuple(tokens[: p0 + i + 1])) for i in range(len(new))]
                self.check_kv_bytes(new.tolist(), contents)
                self.check_state_bytes(int(node.mamba_value), contents[-1])
                for s, c in zip(new.tolist(), contents):
                    self.content[s] = c
                self.loaded += len(new)
                self.states_loaded += 1
                m = self.cache.match_prefix(MatchPrefixParams(key=key, cow_mamba=True, req=req))  # fork it
                assert m.last_device_node is node and len(m.device_indices) == p0 + len(new)
        p = len(m.device_indices)
        self.check_match(m, extra, tokens)
        if p:
            self.check_state_bytes(int(req.mamba_pool_idx), (extra, tuple(tokens[:p])))  # forked into its own slot
        new = self._alloc(len(tokens) - p, p, int(m.device_indices[-1]) if p else -1)
        if new is None:
            self.cache.evict(EvictParams(num_tokens=len(tokens) - p + self.page))
            new = self._alloc(len(tokens) - p, p, int(m.device_indices[-1]) if p else -1)
        if new is None:
            self.cache.dec_lock_ref(last)
            self.table.free_mamba_cache(req)
            self.table.free(req)
            return None
        row = req.req_pool_idx
        self.table.write((row, slice(0, len(tokens))), torch.cat((m.device_indices, new)).to(torch.int32))
        for i, s in enumerate(new.tolist()):
            self.content[s] = (extra, tuple(tokens[: p + i + 1]))
        req.last_node, req.cache_protected_len, req.prefix_indices = last, p, m.device_indices
        req.kv_committed_len = req.kv_allocated_len = len(tokens)
        self.compute(req, p)
        self.running[row] = req
        return req

    def drain(self) -> None:
        """Finish everything, evict the whole tree from both tiers: every slot of every pool back."""
        for req in list(self.running.values()):
            self.finish(req)
        self.cache.check_hicache_events()
        self.cache.evict(EvictParams(num_tokens=self.size))
        assert self.cache.total_size() == (0, 0) and self.alloc.available_size() == self.size
        assert self.pool.available_size() == self.pool.size
        self.cache.evict_host(self.host.kv_host.size)
        assert self.host.kv_host.available_size() == self.host.kv_host.size
        assert self.host.state_host.available_size() == self.host.state_host.size
        assert not self.cache.root_node.children
        self.cache.check_integrity()

# ----------------------------------------------------------------------------------------------
# What a refused call must leave as it was: a snapshot of a cache, its allocator, request table,
# KV pool, state pool and host pool, through their public attributes; injected faults; and the
def tensor_digest(tensors: Any) -> str:
    """SHA-256 of the bytes of a tensor, or of a list/tuple of tensors, in order."""
    h = hashlib.sha256()
    for t in tensors if isinstance(tensors, (list, tuple)) else [tensors]:
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _listed(t: Any) -> Any:
    if t is None:
        return None
    return f"<{t.device} tensor {tuple(t.shape)}>" if t.device.type == "meta" else t.tolist()


def tree_dump(cache: Any) -> list:
    """Every node of the tree as plain values, parents before children, children in key order."""
    rows = []
    stack = [(cache.root_node, None)]
    while stack:
        node, parent = stack.pop()
        rows.append((
            node.id, parent, tuple(node.key.token_ids), repr(node.key.extra_key), _listed(node.value),
            _listed(node.host_value), _listed(node.mamba_value), node.lock_ref, node.mamba_lock_ref,
            node.host_ref_counter, node.swa_lock_ref, node.swa_uuid, node.swa_tombstone, node.hit_count,
            repr(node.priority), node.last_access_time,
            node.creation_time, None if node.hash_value is None else tuple(node.hash_value),
        ))  # fmt: skip
        for ck in sorted(node.children, key=repr, reverse=True):
            stack.append((node.children[ck], node.id))
    return rows


def cache_snapshot(cache: Any) -> dict:
    """Everything a call on ``cache`` could change: the tree, the cache's sizes and queues of
    transfers, the allocator's free lists and holders, the request table (and its state pool), the
    KV pool's and host pool's buffers (hashed)."""
    snap: dict = {"tree": tree_dump(cache), "events": len(cache.kv_event_queue)}
    snap["sizes"] = (cache.evictable_size(), cache.protected_size(), cache.total_size())
    if hasattr(cache, "mamba_evictable_size"):
        snap["state sizes"] = (cache.mamba_evictable_size(), cache.mamba_protected_size())
    if hasattr(cache, "swa_evictable_size"):
        snap["swa sizes"] = (cache.swa_evictable_size(), cache.swa_protected_size())
    alloc = cache.token_to_kv_pool_allocator
    if alloc is not None and hasattr(alloc, "full_to_swa_index_mapping"):
        snap["allocator"] = swa_allocator_snapshot(alloc)
    elif alloc is not None and hasattr(alloc, "backup_state"):
        st = alloc.backup_state()
        snap["allocator"] = (
            alloc.available_size(), st.free_pages.tolist(), st.release_pages.tolist(),
            [t.tolist() for t in st.free_group], st.owners.tolist(), st.live.tolist(), st.page_free.tolist(),
            int(st.unrecorded), getattr(alloc, "rejected_frees", None),
        )  # fmt: skip
        pool = alloc.get_kvcache()
        pool = getattr(pool, "full_kv_pool", pool)  # a hybrid pool's full-attention layers
        if pool is not None:
            snap["kv pool"] = tensor_digest(list(pool.k_buffer) + list(pool.v_buffer))
    table = cache.req_to_token_pool
    if table is not None:
        snap["table"] = (list(table.free_slots), tensor_digest(table.req_to_token))
        mamba = getattr(table, "mamba_pool", None)
        if mamba is not None:
            snap["state pool"] = (
                mamba.available_size(), mamba.held_slots(), tensor_digest(list(mamba.conv) + [mamba.temporal]),
                tensor_digest(table.req_index_to_mamba_index_mapping),
            )  # fmt: skip
    host = getattr(cache, "token_to_kv_pool_host", None)
    if host is not None:  # the bytes of the host slots the tree holds (a free host slot holds nothing)
        held = [n.host_value for n in device_nodes(cache) if n.host_value is not None]
        rows = torch.cat(held).tolist() if held else []
        pages = sorted({s // host.page_size for s in rows})
        kv = [host.get_data_page(q * host.page_size, flat=True) for q in pages]
        snap["host pool"] = (host.available_size(), rows, tensor_digest(kv) if kv else None)
        snap["transfers"] = (len(cache.ongoing_write_through), len(cache.ongoing_load_back))
    state_host = getattr(cache, "mamba_pool_host", None)
    if state_host is not None:  # the host state slots the tree holds, and their bytes
        held = [n.records["host_state"].slot for n in device_nodes(cache) if "host_state" in n.records]
        slots = torch.cat(held) if held else torch.empty(0, dtype=torch.int64)
        parts = [t[:, slots] if state_host.layout == "layer_first" else t[slots] for t in (*state_host.conv, state_host.temporal)]
        snap["state host"] = (state_host.available_size(), slots.tolist(), tensor_digest(parts))
    return snap


def assert_unchanged(before: dict, after: dict, what: str) -> None:
    """``after`` equals ``before``; names the first part that differs."""
    for part in before:
        if before[part] != after.get(part):
            if part == "tree":
                b, a = before[part], after[part]
                diff = [(x, y) for x, y in zip(b, a) if x != y][:2] or (len(b), len(a))
                raise AssertionError(f"{what} changed the tree: {diff}")
            raise AssertionError(f"{what} changed the {part}: {before[part]!r:.300} -> {after.get(part)!r:.300}")


class InjectedFault(RuntimeError):
    """Raised by an injected fault (never by the library)."""


class FailingFree:
    """An allocator whose next ``free`` raises ``InjectedFault`` once ``arm()``ed; every other
    call (and ``free`` when not armed) goes to the wrapped allocator."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.armed = False

    def arm(self) -> None:
        self.armed = True

    def free(self, free_index: Any) -> None:
        if self.armed:
            self.armed = False
            raise InjectedFault("free: injected fault")
        self.inner.free(free_index)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class FailingBackup:
    """Wraps a host pool's ``backup_from_device_all_layer`` so that its next call raises
    ``InjectedFault`` once ``arm()``ed (before copying anything)."""

    def __init__(self, host: Any) -> None:
        self.real = host.backup_from_device_all_layer
        self.armed = False
        host.backup_from_device_all_layer = self

    def arm(self) -> None:
        self.armed = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.armed:
            self.armed = False
            raise InjectedFault("backup_from_device_all_layer: injected fault")
        return self.real(*args, **kwargs)


# ----------------------------------------------------------------------------------------------
# The prefix caches' reference model: a plain dict of whole-page token prefixes, written from the
# contract (docs/contract.md, "The prefix cache") and nothing of kvpool's, and the tags that mark
# what each KV slot and state slot holds.


@dataclasses.dataclass
class RefPage:
    """One cached page of the reference: its slots, the clock of its last access and creation, its
    matches, its priority, the locks covering it; with states, the state slot after it (or None)."""

    slots: tuple
    tick: int
    born: int
    priority: int
    hits: int = 0
    lock: int = 0
    state: Optional[int] = None
    state_lock: int = 0


class RefCache:
    """The prefix cache as ``{(extra_key, tokens of the first k pages): RefPage}``, with the node
    boundaries a radix tree would have (``ends``: the pages a node ends on).

    A match returns the slots of the longest run of cached pages and counts a hit and an access on
    each; an insert takes the slots of the pages not cached, raises the priority of those that are
    and returns the tokens cached already; a lock covers the pages of a prefix. A walk that ends
    inside a node splits it there and counts the rest of that node as accessed too, and new pages are
    stamped after the path they hang from (SGLang 0.5's LRU). ``rank`` is each eviction policy's
    order, as the contract defines it (the smallest goes first)."""

    def __init__(self, page: int, policy: str = "lru") -> None:
        self.page, self.policy = page, policy
        self.pages: dict[tuple, RefPage] = {}
        self.ends: set[tuple] = set()
        self.clock = 0

    def keys(self, extra: Any, tokens: Sequence[int]) -> list[tuple]:
        p = self.page
        return [(extra, tuple(tokens[:k])) for k in range(p, len(tokens) // p * p + 1, p)]

    def held(self, extra: Any, tokens: Sequence[int]) -> int:
        n = 0
        for k in self.keys(extra, tokens):
            if k not in self.pages:
                break
            n += self.page
        return n

    def children(self, key: tuple) -> list[tuple]:
        e, t = key
        return [k for k in self.pages if k[0] == e and len(k[1]) == len(t) + self.page and k[1][: len(t)] == t]

    def split_after(self, key: Optional[tuple]) -> None:
        """A walk ended on ``key``: if its node goes on, the rest of the node counts as accessed and the
        node is cut after ``key``."""
        if key is None or key in self.ends:
            return
        nxt: Optional[tuple] = key
        while nxt is not None and nxt not in self.ends:
            below = self.children(nxt)
            nxt = below[0] if len(below) == 1 else None
            if nxt is not None:
                self.pages[nxt].tick = self.clock
        self.ends.add(key)

    def match(self, extra: Any, tokens: Sequence[int]) -> list[int]:
        self.clock += 1
        slots: list[int] = []
        last = None
        for k in self.keys(extra, tokens):
            page = self.pages.get(k)
            if page is None:
                break
            page.tick = self.clock
            page.hits += 1
            slots += page.slots
            last = k
        self.split_after(last)
        return slots

    def insert(self, extra: Any, tokens: Sequence[int], slots: Sequence[int], priority: int = 0) -> int:
        self.clock += 1
        held = self.held(extra, tokens)
        p = self.page
        keys = self.keys(extra, tokens)
        for k in keys[: held // p]:
            self.pages[k].tick = self.clock
            self.pages[k].priority = max(self.pages[k].priority, priority)
        self.split_after(keys[held // p - 1] if held else None)
        if held < len(keys) * p:
            self.clock += 1
            for i in range(held // p, len(keys)):
                self.pages[keys[i]] = RefPage(tuple(slots[i * p : (i + 1) * p]), self.clock, self.clock, priority)
            self.ends.add(keys[-1])
        return held

    def drop(self, key: tuple) -> None:
        """``key``'s page left the cache."""
        del self.pages[key]
        self.ends.discard(key)

    def lock(self, extra: Any, tokens: Sequence[int], delta: int) -> None:
        """Add ``delta`` to the locks of every page of ``tokens`` (whole pages, all cached)."""
        for k in self.keys(extra, tokens):
            self.pages[k].lock += delta

    def slots_of(self, extra: Any, tokens: Sequence[int]) -> list[int]:
        return [s for k in self.keys(extra, tokens) for s in self.pages[k].slots]

    def with_children(self) -> set:
        p = self.page
        return {(e, t[:-p]) for e, t in self.pages if len(t) > p}

    def below(self, key: tuple) -> list[tuple]:
        """The cached pages that extend ``key``'s prefix (its descendants)."""
        e, t = key
        return [k for k in self.pages if k[0] == e and len(k[1]) > len(t) and k[1][: len(t)] == t]

    def unlocked_tokens(self) -> int:
        return sum(self.page for page in self.pages.values() if page.lock == 0)

    def rank(self, page: RefPage) -> Any:
        return {
            "lru": page.tick, "lfu": (page.hits, page.tick), "fifo": page.born, "mru": -page.tick,
            "filo": -page.born, "priority": (page.priority, page.tick),
        }[self.policy]  # fmt: skip


def device_pages(cache: Any) -> dict[tuple, tuple]:
    """The tree's pages on the device, read through nodes' public attributes: ``{(extra_key, tokens of
    the first k pages): (slots, lock_ref, state slot or None, mamba_lock_ref)}``, the state given for
    a node's last page only."""
    p = cache.page_size
    out: dict[tuple, tuple] = {}
    stack = [(child, ()) for child in cache.root_node.children.values()]
    while stack:
        node, prefix = stack.pop()
        tokens = prefix + tuple(node.key.token_ids)
        if node.value is not None:
            value = node.value.tolist()
            for i in range(0, len(value), p):
                last = i + p == len(value)
                state = int(node.mamba_value) if last and node.mamba_value is not None else None
                out[(node.key.extra_key, tokens[: len(prefix) + i + p])] = (
                    tuple(value[i : i + p]), node.lock_ref, state, node.mamba_lock_ref if last else 0,
                )  # fmt: skip
        stack.extend((child, tokens) for child in node.children.values())
    return out


def device_nodes(cache: Any) -> list:
    """Every node below the root, through ``children``."""
    out, stack = [], list(cache.root_node.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


class KVTags:
    """Marks each KV slot with the id of what it holds (a namespace and the token prefix whose last
    token's KV it is), written through ``set_kv_buffer`` into a float32 pool (K = id, V = -id), and
    reads them back."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.ids: dict[tuple, int] = {}

    def tag(self, content: tuple) -> int:
        return self.ids.setdefault(content, len(self.ids) + 1)

    def write(self, slots: Sequence[int], contents: Sequence[tuple]) -> None:
        if not len(slots):
            return
        tags = torch.tensor([float(self.tag(c)) for c in contents], dtype=torch.float32).view(-1, 1, 1)
        loc = torch.tensor(list(slots), dtype=torch.int64)
        for layer in range(self.pool.layer_num):
            self.pool.set_kv_buffer(None, loc, tags, -tags, layer_id_override=self.pool.start_layer + layer)

    def check(self, slots: Sequence[int], contents: Sequence[tuple], what: str) -> None:
        if not len(slots):
            return
        want = torch.tensor([float(self.tag(c)) for c in contents], dtype=torch.float32)
        loc = torch.tensor(list(slots), dtype=torch.int64)
        for layer in range(self.pool.layer_num):
            k = self.pool.k_buffer[layer][loc].reshape(-1)
            v = self.pool.v_buffer[layer][loc].reshape(-1)
            bad = ((k != want) | (v != -want)).nonzero().flatten().tolist()
            assert not bad, f"{what}: slot {int(loc[bad[0]])} at position {bad[0]} holds KV tag {float(k[bad[0]])}, expected {float(want[bad[0]])}"


def prefix_contents(extra: Any, tokens: Sequence[int], start: int, end: int) -> list[tuple]:
    """What the slots of positions ``start..end`` of ``tokens`` hold: (namespace, tokens up to it)."""
    return [(extra, tuple(tokens[: i + 1])) for i in range(start, end)]


def cache_bad_calls(ctx: Any) -> dict[str, tuple]:
    """Calls on a populated cache that must raise and change nothing: ``{name: (thunk, exception
    types, pattern of the message)}``. ``ctx`` has ``cache``, ``alloc``, ``page``, ``size``,
    ``running`` (row -> request), ``gone`` (nodes that left the tree) and ``foreign`` (a node of
    another tree). Calls whose ingredients the state lacks (no free page, no running request) are
    left out."""
    cache, p = ctx.cache, ctx.page
    calls: dict[str, tuple] = {}
    bad = (TypeError, ValueError)
    hybrid = hasattr(cache, "mamba_evictable_size")
    swa = hasattr(cache, "swa_evictable_size")
    key = RadixKey([7] * p + [8] * p, "bad-call")  # two pages nobody caches
    state = torch.tensor([0], dtype=torch.int64)
    if hybrid and cache.mamba_pool is not None:
        free_states = [s for s in range(1, cache.mamba_pool.size + 1) if not cache.mamba_pool.is_held(s)]
        state = torch.tensor(free_states[:1] or [1], dtype=torch.int64)

    # A value the call may take: slots a running request owns (handed out, not the tree's).
    own = [r for r in ctx.running.values() if int(r.kv_committed_len) - int(r.cache_protected_len) >= 2 * p]
    legit = None
    if own:
        r = own[0]
        row = cache.req_to_token_pool.req_to_token[r.req_pool_idx].to(torch.int64)
        legit = row[r.cache_protected_len : r.cache_protected_len + 2 * p].clone()

    def ins(k: Any = key, value: Any = None, priority: Any = 0, **kw: Any) -> Any:
        params = InsertParams(key=k, value=legit if value is None else value, priority=priority, **kw)
        if hybrid and "mamba_value" not in kw:
            params.mamba_value = state
        return lambda: cache.insert(params)

    backup = ctx.alloc.backup_state()
    owners = getattr(backup, "full", backup).owners  # an SWA allocator: the full part's (the slots calls take)
    tree = [nd for nd in device_nodes(cache) if nd.value is not None]
    tree_slots = cache.all_values_flatten()
    first = torch.arange(p, 2 * p)  # slots of page 1
    slots_of = lambda *xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    free_pages = [q for q in range(1, ctx.size // p + 1) if all(int(owners[q * p + i]) == 0 for i in range(p))]
    if legit is not None:
        calls["insert: key not a RadixKey"] = (ins(k=[7] * 2 * p), bad, "key must be a RadixKey")
        calls["insert: bool tokens"] = (ins(k=RadixKey([True] + [2] * (2 * p - 1))), bad, "key.token_ids")
        calls["insert: float token"] = (ins(k=RadixKey([1.5] + [2] * (2 * p - 1))), bad, "key.token_ids")
        calls["insert: token past int64"] = (ins(k=RadixKey([2**63] + [2] * (2 * p - 1))), bad, "key.token_ids")
        calls["insert: unhashable extra_key"] = (ins(k=RadixKey([7] * 2 * p, ["x"])), bad, "extra_key")
        calls["insert: priority None"] = (ins(priority=None), bad, "priority")
        calls["insert: priority 1.5"] = (ins(priority=1.5), bad, "priority")
        calls["insert: priority 'x'"] = (ins(priority="x"), bad, "priority")
        if not cache.is_eagle:  # an EAGLE key of 2p tokens caches p slots: the repeat lies past them
            calls["insert: value twice"] = (ins(value=torch.cat((legit[:p], legit[:p]))), bad, "value")
        if hybrid:
            calls["insert: mamba_value of 2"] = (ins(mamba_value=slots_of(1, 2)), bad, "mamba_value")
            calls["insert: mamba_value float"] = (ins(mamba_value=torch.tensor([1.0])), bad, "mamba_value")
            calls["insert: mamba_value on meta"] = (ins(mamba_value=state.to("meta")), bad, "mamba_value")
            calls["insert: mamba_value slot 0"] = (ins(mamba_value=slots_of(0)), bad, "mamba_value")
            calls["insert: mamba_value out of range"] = (ins(mamba_value=slots_of(10**6)), bad, "mamba_value")
            held_states = [int(nd.mamba_value) for nd in tree if nd.mamba_value is not None]
            if held_states:
                calls["insert: mamba_value the tree holds"] = (ins(mamba_value=slots_of(held_states[0])), bad, "mamba_value")
    calls["insert: value a list"] = (ins(value=list(range(p, 3 * p))), bad, "value")
    calls["insert: float value"] = (ins(value=torch.arange(p, 3 * p, dtype=torch.float32)), bad, "value")
    calls["insert: bool value"] = (ins(value=torch.ones(2 * p, dtype=torch.bool)), bad, "value")
    calls["insert: 2-D value"] = (ins(value=torch.arange(p, 3 * p).view(1, -1)), bad, "value")
    calls["insert: short value"] = (ins(value=torch.arange(p, 3 * p - 1)), bad, "value")
    calls["insert: value on meta"] = (ins(value=torch.arange(p, 3 * p).to("meta")), bad, "value")
    calls["insert: int8 value"] = (ins(value=torch.arange(p, 3 * p, dtype=torch.int8)), bad, "value")
    calls["insert: 0-D value"] = (ins(value=torch.tensor(p)), bad, "value")
    calls["insert: token_ids a str"] = (ins(k=RadixKey("ab" * p)), bad, "key.token_ids")
    if not cache.is_eagle:
        calls["insert: a bigram key in a plain cache"] = (ins(k=RadixKey([(7, 8)] * 2 * p, is_bigram=True)), bad, "is_eagle")
    calls["insert: negative slots"] = (ins(value=torch.arange(-2 * p, 0)), bad, "value")
    calls["insert: slots out of range"] = (ins(value=torch.arange(ctx.size + p, ctx.size + 3 * p)), bad, "value")
    calls["insert: slot 0 page"] = (ins(value=torch.cat((torch.arange(0, p), first))), bad, "value")
    if len(free_pages) >= 2:
        a, b = free_pages[:2]
        calls["insert: free slots"] = (ins(value=torch.cat((torch.arange(a * p, a * p + p), torch.arange(b * p, b * p + p)))), bad, "value")
    if tree_slots.numel() >= p:
        page = tree_slots[:p]
        calls["insert: slots already in the tree"] = (ins(value=torch.cat((page, page))), bad, "value")
    calls["match: key not a RadixKey"] = (lambda: cache.match_prefix(MatchPrefixParams(key=[1] * p)), bad, "key must be a RadixKey")
    calls["match: bool tokens"] = (lambda: cache.match_prefix(MatchPrefixParams(key=RadixKey([True] * p))), bad, "key.token_ids")
    calls["match: float token"] = (lambda: cache.match_prefix(MatchPrefixParams(key=RadixKey([0.5] * p))), bad, "key.token_ids")
    calls["evict: a list"] = (lambda: cache.evict([1]), bad, "num_tokens")
    calls["match: unhashable extra_key"] = (lambda: cache.match_prefix(MatchPrefixParams(key=RadixKey([1] * p, {}))), bad, "extra_key")
    for what, node in (("a str", "node"), ("None", None), ("a foreign node", ctx.foreign)):
        calls[f"inc_lock_ref: {what}"] = (lambda n=node: cache.inc_lock_ref(n), bad, "node")
        calls[f"dec_lock_ref: {what}"] = (lambda n=node: cache.dec_lock_ref(n), bad, "node")
    gone = [nd for nd in ctx.gone if nd.value is None][:1]
    if gone:
        calls["inc_lock_ref: an evicted node"] = (lambda: cache.inc_lock_ref(gone[0]), bad, "node")
        calls["dec_lock_ref: an evicted node"] = (lambda: cache.dec_lock_ref(gone[0]), bad, "node")
    unlocked = [nd for nd in tree if nd.lock_ref == 0]
    if unlocked:
        calls["dec_lock_ref: an unlocked node"] = (lambda: cache.dec_lock_ref(unlocked[0]), bad, "not locked")
    for v in (-1, 1.5, True, None, "3"):
        calls[f"evict: num_tokens {v!r}"] = (lambda v=v: cache.evict(EvictParams(num_tokens=v)), bad, "num_tokens")
    if swa:
        calls.update(swa_bad_calls(ctx, ins, legit))
    else:
        calls["evict: swa_num_tokens"] = (lambda: cache.evict(EvictParams(num_tokens=1, swa_num_tokens=1)), bad, "swa_num_tokens")
    if hybrid:
        for v in (-1, 1.5, True):
            calls[f"evict: mamba_num {v!r}"] = (lambda v=v: cache.evict(EvictParams(num_tokens=0, mamba_num=v)), bad, "mamba_num")
    else:
        calls["evict: mamba_num"] = (lambda: cache.evict(EvictParams(num_tokens=1, mamba_num=1)), bad, "mamba_num")
    extra_buffer = getattr(cache, "enable_mamba_extra_buffer", False)
    untracked = [r for r in ctx.running.values() if extra_buffer and getattr(r, "mamba_last_track_seqlen", 0) is None]
    tracked = [ctx.running[row] for row in sorted(ctx.running) if ctx.running[row] not in untracked]
    if tracked:
        req = tracked[0]

        def twin(base: Any = req, **changes: Any) -> Any:
            other = dataclasses.replace(base, output_ids=list(base.output_ids))
            for k, v in vars(base).items():
                if not hasattr(other, k) or k in ("mamba_pool_idx", "mamba_ping_pong_track_buffer"):
                    setattr(other, k, v)
            for k, v in changes.items():
                setattr(other, k, v)
            return other

        committed = int(req.kv_committed_len)
        aligned = committed // p * p
        for how, call in (("cache_finished_req", cache.cache_finished_req), ("cache_unfinished_req", cache.cache_unfinished_req)):
            calls[f"{how}: cache_protected_len past the pages"] = (
                lambda c=call: c(twin(cache_protected_len=aligned + p)), bad, "cache_protected_len")
            calls[f"{how}: negative cache_protected_len"] = (lambda c=call: c(twin(cache_protected_len=-1)), bad, "cache_protected_len")
            calls[f"{how}: a foreign last_node"] = (lambda c=call: c(twin(last_node=ctx.foreign)), bad, "last_node")
            if untracked:  # no state known yet: the request is still checked
                calls[f"{how}: cache_protected_len past the pages, no state known"] = (
                    lambda c=call, r=untracked[0]: c(twin(r, cache_protected_len=int(r.kv_committed_len) + p)), bad,
                    "cache_protected_len")  # fmt: skip
            if gone:
                calls[f"{how}: an evicted last_node"] = (lambda c=call: c(twin(last_node=gone[0])), bad, "last_node")
            fresh = [r for r in ctx.running.values() if r.cache_protected_len == 0]
            if unlocked and fresh:
                calls[f"{how}: an unlocked last_node"] = (
                    lambda c=call, r=fresh[0]: c(twin(r, last_node=unlocked[0])), bad, "last_node")
    return calls


def swa_bad_calls(ctx: Any, ins: Callable, legit: Optional[torch.Tensor]) -> dict[str, tuple]:
    """The bad calls only an SWARadixCache has: window counts, SWA-evicted lengths, lock ids, and
    slots whose SWA KV does not match what the tree would take them as."""
    cache, p = ctx.cache, ctx.page
    bad = (TypeError, ValueError)
    calls: dict[str, tuple] = {}
    for v in (-1, 1.5, True, None):
        calls[f"evict: swa_num_tokens {v!r}"] = (lambda v=v: cache.evict(EvictParams(swa_num_tokens=v)), bad, "swa_num_tokens")
    if legit is not None:
        for v in (-p, 1.5, True) + ((1,) if p > 1 else ()):
            calls[f"insert: swa_evicted_seqlen {v!r}"] = (ins(prev_prefix_len=0, swa_evicted_seqlen=v), bad, "swa_evicted_seqlen")
        with_swa = bool((ctx.alloc.full_to_swa_index_mapping[legit] > 0).all())
        if with_swa and not cache.is_eagle:  # an EAGLE key of 2p tokens caches one page: before swa_evicted_seqlen = p, so none
            calls["insert: slots with SWA KV as a tombstone"] = (ins(prev_prefix_len=0, swa_evicted_seqlen=p), bad, "no SWA KV before")
    mapping = ctx.alloc.full_to_swa_index_mapping
    for req in ctx.running.values():
        row = cache.req_to_token_pool.req_to_token[req.req_pool_idx].to(torch.int64)
        own = row[req.cache_protected_len : min(req.cache_protected_len + 2 * p, req.kv_committed_len)]
        if len(own) == 2 * p and int(mapping[own[0]]) == 0:
            calls["insert: slots without SWA KV as live"] = (ins(value=own.clone(), prev_prefix_len=0), bad, "must have SWA KV")
            break
    locked = [r for r in ctx.running.values() if r.last_node is not cache.root_node]
    if locked:
        node = locked[0].last_node
        calls["dec_lock_ref: a foreign swa_uuid_for_lock"] = (lambda: cache.dec_lock_ref(node, 10**9), bad, "swa_uuid_for_lock")
    tombs = [nd for nd in device_nodes(cache) if nd.value is not None and nd.swa_tombstone]
    if tombs:
        calls["inc_lock_ref: a tombstone"] = (lambda: cache.inc_lock_ref(tombs[0]), bad, "tombstone")
    reqs = [ctx.running[row] for row in sorted(ctx.running)]
    if reqs:
        req = reqs[0]

        def twin(**changes: Any) -> Any:
            other = dataclasses.replace(req, output_ids=list(req.output_ids))
            for k, v in {**vars(req), **changes}.items():
                setattr(other, k, v)
            return other

        for how, call in (("cache_finished_req", cache.cache_finished_req), ("cache_unfinished_req", cache.cache_unfinished_req)):
            for v in (-p, 0.5) + ((1,) if p > 1 else ()):
                calls[f"{how}: swa_evicted_seqlen {v!r}"] = (lambda c=call, v=v: c(twin(swa_evicted_seqlen=v)), bad, "swa_evicted_seqlen")
            calls[f"{how}: a foreign swa_uuid_for_lock"] = (lambda c=call: c(twin(swa_uuid_for_lock=10**9)), bad, "swa_uuid_for_lock")
    return calls


#: Bad calls and faults the library still handles against the contract, each with what happens. The
#: state machines leave them out; the bad-input table and the atomicity tests keep them as strict
#: expected failures, so that a fix shows up as one. A key is a call's name in
#: ``cache_bad_calls``, or "<cache kind>: <name>" for one kind only.
CACHE_KNOWN_BAD: dict[str, str] = {
}


def known_bad(kind: str, name: str) -> Optional[str]:
    """Why ``name`` (on a cache of ``kind``) is still expected to fail, or None."""
    return CACHE_KNOWN_BAD.get(f"{kind}: {name}") or CACHE_KNOWN_BAD.get(name)


class StateTags:
    """Marks each state slot of a ``MambaPool`` with the id of the state it holds (the state after a
    namespace's token prefix): the first 4 bytes of every layer's convolution and temporal state are
    the id, the rest a pattern of it; ``check`` reads every byte back."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.ids: dict[tuple, int] = {}

    def _views(self, slot: int) -> list[torch.Tensor]:
        return [t[:, slot].reshape(t.shape[0], -1).view(torch.uint8) for t in (*self.pool.conv, self.pool.temporal)]

    def _pattern(self, view: torch.Tensor, cid: int) -> torch.Tensor:
        want = (torch.arange(view.numel()).view(view.shape) * 7 + cid * 31) % 256
        want[:, :4] = torch.tensor([(cid >> (8 * i)) % 256 for i in range(4)])
        return want.to(torch.uint8)

    def write(self, slot: int, content: tuple) -> None:
        cid = self.ids.setdefault(content, len(self.ids) + 1)
        for view in self._views(int(slot)):
            view.copy_(self._pattern(view, cid))

    def check(self, slot: int, content: tuple, what: str) -> None:
        cid = self.ids.get(content)
        assert cid is not None, f"{what}: no state was ever computed for {content}"
        for view in self._views(int(slot)):
            assert torch.equal(view, self._pattern(view, cid)), f"{what}: state slot {int(slot)} holds another state than after {len(content[1])} tokens"


# ----------------------------------------------------------------------------------------------
# Sliding-window pools and allocators: a pool with a mapping of the test's own, the slots it
# translates to (computed in Python, not by the code under test), and snapshots of both.

SWA_LAYERS, FULL_LAYERS = [0, 2, 3], [1, 4]  # global ids: three sliding-window layers, two full


def make_swa_pool(dtype=torch.float8_e4m3fn, size=24, size_swa=12, page_size=1, device=DEVICE, **kw):
    """An SWAKVPool of an odd geometry (H=3, D=16, Dv=8) over ``SWA_LAYERS`` and ``FULL_LAYERS``,
    its buffers filled with random bytes."""
    from kvpool import SWAKVPool

    pool = SWAKVPool(size, size_swa, page_size, dtype, 3, 16, SWA_LAYERS, FULL_LAYERS, False, device,
                     v_head_dim=8, **kw)  # fmt: skip
    part_buffers = [b for p in (pool.full_kv_pool, pool.swa_kv_pool) for b in p.k_buffer + p.v_buffer]
    fill_random_(part_buffers, seed=5)
    return pool


def swa_mapping(full_rows: int, pairs: dict[int, int], device=DEVICE) -> torch.Tensor:
    """A full-to-SWA mapping [full_rows + 1] int64: full slot -> SWA slot for ``pairs``, 0 elsewhere,
    -1 last."""
    m = [0] * full_rows + [-1]
    for f, s in pairs.items():
        m[f] = s
    return torch.tensor(m, dtype=torch.int64, device=device)


def translated(loc: Sequence[int], pairs: dict[int, int], full_rows: int) -> list[int]:
    """The SWA slots a write at full slots ``loc`` lands on, by the contract: the mapped slot, 0 for
    an unmapped full slot, -1 (nothing) for a slot outside the full pool."""
    return [pairs.get(s, 0) if 0 <= s < full_rows else -1 for s in loc]


def pool_bytes(pool) -> list[torch.Tensor]:
    """Copies of every K and V buffer of both parts of an SWAKVPool (or of one MHA pool), as bytes."""
    parts = (pool.full_kv_pool, pool.swa_kv_pool) if hasattr(pool, "swa_kv_pool") else (pool,)
    return [b.view(torch.uint8).clone() for p in parts for b in p.k_buffer + p.v_buffer]


def swa_allocator_snapshot(a) -> tuple:
    """Everything an SWATokenToKVPoolAllocator knows, as plain Python values."""
    return (allocator_snapshot(a.full_attn_allocator), allocator_snapshot(a.swa_attn_allocator),
            a.full_to_swa_index_mapping.tolist())  # fmt: skip


def swa_as_on_gpu(a, lands: bool = True):
    """Run an SWATokenToKVPoolAllocator on the CPU as on a GPU without validate: its parts' counts
    copied back rather than read (``counts_copied_back``), device arguments unchecked, and frees
    that hand the SWA part every entry, mapped or not (which entries are mapped is known only on the
    device there)."""
    for part in (a.full_attn_allocator, a.swa_attn_allocator):
        counts_copied_back(part, lands)
        part._cheap_device_checks = False
    a._checked = False
    return a


# ----------------------------------------------------------------------------------------------
# FP4 (SGLang's KV FP4): SGLang's own quantizer from its wheel, and an oracle written from the rule.

#: Where the FP4 tests look for SGLang's wheel: ``$KVPOOL_SGLANG_WHEEL``, else the checkout's ``.sgl/``
#: (``pip download --no-deps sglang==0.5.9 -d .sgl``, ignored by git).
SGLANG_WHEEL = Path(os.environ.get("KVPOOL_SGLANG_WHEEL") or ROOT / ".sgl" / "sglang-0.5.9-py3-none-any.whl")
_KVFP4_SOURCE = "sglang/srt/layers/quantization/kvfp4_tensor.py"


def sglang_kvfp4() -> Any:
    """SGLang's ``KVFP4QuantizeUtil`` read from the wheel's ``kvfp4_tensor.py`` (it imports torch
    only), loaded by path under a private module name; skips the test without the wheel or without a
    C++ compiler (its functions are ``torch.compile``d, as SGLang runs them)."""
    import shutil
    import tempfile
    import zipfile

    if not SGLANG_WHEEL.exists():
        pytest.skip(
            f"SGLang's wheel is not at {SGLANG_WHEEL} (pip download --no-deps sglang==0.5.9 -d .sgl, or set KVPOOL_SGLANG_WHEEL)"
        )
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("torch.compile on CPU needs a C++ compiler (SGLang's quantizer is compiled)")
    cached = sys.modules.get("kvpool_tests_sglang_kvfp4")
    if cached is not None:
        return cached.KVFP4QuantizeUtil
    with zipfile.ZipFile(SGLANG_WHEEL) as z:
        source = z.read(_KVFP4_SOURCE).decode()
    path = os.path.join(tempfile.mkdtemp(prefix="sglang-kvfp4-"), "kvfp4_tensor.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("kvpool_tests_sglang_kvfp4", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kvpool_tests_sglang_kvfp4"] = mod
    spec.loader.exec_module(mod)
    # The module builds its e2m1 tables on CUDA when a GPU is present; the comparisons run on the
    # CPU, so its tables (module globals, read when its functions are traced) move there.
    for name, value in list(vars(mod).items()):
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            setattr(mod, name, value.cpu())
    return mod.KVFP4QuantizeUtil


_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def fp4_oracle(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(codes [T, H, D] uint8, scale bytes [T, H * D // 16] uint8) from the FP4 rule of
    docs/contract.md, written independently of kvpool: the exponent from Python's ``math.frexp``
    of float32(amax / 6) (NumPy's float32 division), each code the nearest e2m1 value of
    ``x / 2**e`` in exact arithmetic, a tie going to the larger magnitude, the sign bit iff the
    float32 quotient is below zero; a block holding inf or NaN gets byte 0 and codes 0."""
    import math

    t, h, d = x.shape
    xs = x.detach().cpu().to(torch.float32).numpy().reshape(t, h * d // 16, 16)
    codes = np.zeros(xs.shape, dtype=np.uint8)
    scales = np.zeros(xs.shape[:2], dtype=np.uint8)
    for i in range(xs.shape[0]):
        for b in range(xs.shape[1]):
            block = xs[i, b]
            if not np.all(np.isfinite(block)):
                continue
            ratio = max(float(np.float32(np.abs(block).max()) / np.float32(6.0)), float(np.float32(1e-10)))
            mant, exp = math.frexp(ratio)  # ratio = mant * 2**exp, 0.5 <= mant < 1
            e = exp - 1 if mant == 0.5 else exp
            scales[i, b] = e + 127
            for j, value in enumerate(block):
                q = np.float32(value) / np.float32(2.0**e)
                mag = abs(Fraction(float(q)))
                best = min(range(8), key=lambda c: (abs(mag - Fraction(_E2M1[c])), -c))
                codes[i, b, j] = best | (8 if q < 0 else 0)
    return codes.reshape(t, h, d), scales


def fp4_unpacked(packed: torch.Tensor) -> np.ndarray:
    """The codes of packed FP4 bytes [..., D // 2] as [..., D] (element 2j in the low nibble)."""
    p = packed.detach().cpu().numpy()
    out = np.empty((*p.shape[:-1], 2 * p.shape[-1]), dtype=np.uint8)
    out[..., 0::2], out[..., 1::2] = p & 0x0F, p >> 4
    return out


# ----------------------------------------------------------------------------------------------
# NVFP4 (two-level: e4m3 block scales, a float32 global scale): an oracle written from the rule, and
# SGLang's ``NVFP4KVQuantizeUtil`` from a wheel that has it.

#: Where the NVFP4 tests look for a SGLang wheel with ``NVFP4KVQuantizeUtil`` (0.5.9 has none):
#: ``$KVPOOL_SGLANG_NVFP4_WHEEL``, else the checkout's ``.sgl/`` (``pip download --no-deps
#: sglang==0.5.23 -d .sgl``, ignored by git).
SGLANG_NVFP4_WHEEL = Path(
    os.environ.get("KVPOOL_SGLANG_NVFP4_WHEEL") or ROOT / ".sgl" / "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl"
)

#: The 127 finite non-negative e4m3fn values by code (0x00..0x7E), exact.
E4M3_VALUES = tuple(Fraction(m, 512) if e == 0 else Fraction(8 + m, 8) * Fraction(2) ** (e - 7) for e in range(16) for m in range(8))[:127]


def _nearest_even(value: Fraction, table: Sequence[Fraction]) -> int:
    """The code of the entry of ``table`` (ascending) nearest ``value``; a tie goes to the even code."""
    return min(range(len(table)), key=lambda c: (abs(value - table[c]), c & 1))


def nvfp4_oracle(x: torch.Tensor, global_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """(codes [T, H, D] uint8, block scale bytes [T, H, D // 16] uint8) from the NVFP4 rule of
    docs/contract.md, written independently of kvpool: NumPy's float32 divisions, then each e4m3
    scale and e2m1 code the nearest value in exact arithmetic over the formats' tables (ties to the
    even code), the sign bit of the element; a non-finite block gets byte 0 and codes 0."""
    t, h, d = x.shape
    xs = x.detach().cpu().to(torch.float32).numpy().reshape(t, h, d // 16, 16)
    with np.errstate(over="ignore", invalid="ignore"):
        ys = xs / np.float32(global_scale)
    e2m1 = [Fraction(v) for v in _E2M1]
    codes = np.zeros(ys.shape, dtype=np.uint8)
    scales = np.zeros(ys.shape[:3], dtype=np.uint8)
    for idx in np.ndindex(*ys.shape[:3]):
        block = ys[idx]
        if not np.all(np.isfinite(block)):
            continue
        c = _nearest_even(Fraction(float(np.float32(np.abs(block).max()) / np.float32(6.0))), E4M3_VALUES)
        scales[idx] = c
        for j, y in enumerate(block):
            sign = 8 if np.signbit(y) else 0
            mag = 0
            if c:
                q = np.float32(y) / np.float32(float(E4M3_VALUES[c]))
                mag = _nearest_even(abs(Fraction(float(q))), e2m1)
            codes[idx + (j,)] = mag | sign
    return codes.reshape(t, h, d), scales


def sglang_nvfp4(sm: int) -> Any:
    """SGLang's ``NVFP4KVQuantizeUtil`` read from the wheel's ``kvfp4_tensor.py``, loaded by path
    under a private module name, with its one SGLang import (``get_platform``) answered as by a GPU
    of compute capability ``sm`` (90: its pure-PyTorch dequantizer; 100: flashinfer's kernels).
    Skips the test without the wheel."""
    import tempfile
    import zipfile

    if not SGLANG_NVFP4_WHEEL.exists():
        pytest.skip(
            f"no SGLang wheel with NVFP4KVQuantizeUtil at {SGLANG_NVFP4_WHEEL} "
            "(pip download --no-deps sglang==0.5.23 -d .sgl, or set KVPOOL_SGLANG_NVFP4_WHEEL)"
        )
    name = f"kvpool_tests_sglang_nvfp4_sm{sm}"
    cached = sys.modules.get(name)
    if cached is not None:
        return cached.NVFP4KVQuantizeUtil
    with zipfile.ZipFile(SGLANG_NVFP4_WHEEL) as z:
        source = z.read(_KVFP4_SOURCE).decode()
    wanted = "from sglang.srt.runtime_context import get_platform"
    if wanted not in source:
        pytest.fail(f"{SGLANG_NVFP4_WHEEL}'s kvfp4_tensor.py no longer imports get_platform as expected")
    path = os.path.join(tempfile.mkdtemp(prefix="sglang-nvfp4-"), "kvfp4_tensor.py")
    with open(path, "w") as f:
        f.write(source.replace(wanted, "get_platform = _kvpool_platform"))
    platform = types.SimpleNamespace(is_sm90=sm == 90, is_sm100=sm == 100, is_sm120=sm == 120)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    mod._kvpool_platform = lambda: platform
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod.NVFP4KVQuantizeUtil


# ----------------------------------------------------------------------------------------------
# Per-token-head FP8 (docs/contract.md, "Per-token-head FP8"): the oracle, from the format
# definitions in NumPy (nothing of kvpool's, none of torch's conversions).


def token_head_oracle(x: torch.Tensor, cache_dtype: torch.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(codes [T, H, D] int64, scales [T, H] float32) of per-token-head FP8: ``s = max(float32(amax /
    fmax), 2**-126)`` with ``amax`` over the finite elements of each head's row, then the codes of
    ``RNE(clamp(float32(x) / s))`` with NaN stored as the format's ``nan_code``."""
    fmt = FORMAT_OF[cache_dtype]
    x32 = float32_of(x)
    mag = np.abs(x32)
    with np.errstate(invalid="ignore"):
        amax = np.where(np.isfinite(mag), mag, np.float32(0)).max(axis=2).astype(np.float32)
    scales = np.maximum(divide_f32(amax, np.float32(float(fmt.fmax))), np.float32(2.0**-126)).astype(np.float32)
    codes = encode_f32(divide_f32(x32, scales[:, :, None]), fmt)
    return np.where(fmt.is_nan_code(codes), fmt.nan_code, codes), scales


# --- host tier and storage over pools with scales beside their codes ----------------------------------

#: The pools whose rows carry scales: both FP4 formats (MHA), the FP4 latent pool, per-token-head FP8.
SCALED_KINDS = ["fp4", "nvfp4", "mla_fp4", "fp8_token_head"]
SCALED_START = 2  # their global layer ids: 2..3
NVFP4_GLOBAL_SCALES = dict(k_global_scales=[0.5, 3.0], v_global_scales=[2.0, 0.25])


def scaled_pool(kind: str, device: str, seed: int = 0, **over):
    """A tiny 2-layer pool of ``kind`` (``SCALED_KINDS``) with random bytes in every part."""
    from kvpool.pools.mha_fp4_pool import MHATokenToKVPoolFP4
    from kvpool.pools.mha_fp8_token_pool import MHATokenToKVPoolFP8PerTokenHead
    from kvpool.pools.mla_fp4_pool import MLATokenToKVPoolFP4

    common = dict(start_layer=SCALED_START)
    if kind == "fp4":
        pool = MHATokenToKVPoolFP4(20, 2, "fp4_e2m1", 3, 32, 2, device, v_head_dim=16, **common)
    elif kind == "nvfp4":
        scales = {**NVFP4_GLOBAL_SCALES, **over}
        pool = MHATokenToKVPoolFP4(20, 2, "nvfp4", 3, 32, 2, device, v_head_dim=16, **scales, **common)
    elif kind == "mla_fp4":
        pool = MLATokenToKVPoolFP4(20, 2, "fp4_e2m1", 32, 16, 2, device, **common)
    else:
        pool = MHATokenToKVPoolFP8PerTokenHead(20, 2, torch.float8_e4m3fn, 3, 8, 2, device, v_head_dim=4, **common)
    fill_random_(scaled_parts(pool), seed)
    return pool


def scaled_parts(pool) -> list:
    """Every buffer of every layer of a pool with ``part_names``, part by part."""
    return [b for name in pool.part_names for b in getattr(pool, name)]


def scaled_host(pool, layout: str, seed: int = 9, **kw):
    """A host pool (page size 2, twice the device slots) over ``pool``, random bytes in every part."""
    from kvpool.host.pool import MLATokenToKVPoolHost
    from kvpool.pools.mla_fp4_pool import MLATokenToKVPoolFP4

    cls = MLATokenToKVPoolHost if isinstance(pool, MLATokenToKVPoolFP4) else MHATokenToKVPoolHost
    host = cls(pool, 2.0, 0, 2, layout, **kw)
    fill_random_(host.buffers, seed)
    return host


def scaled_host_rows(host, part: int, layer: int) -> torch.Tensor:
    """[size, row bytes] uint8 of one part of one layer (0-based) on the host."""
    buf = host.buffers[part]
    rows = buf[layer] if host.layout == "layer_first" else buf[:, layer]
    return rows.reshape(host.size, -1).view(torch.uint8)


def scaled_dev_rows(pool, part: int, layer: int) -> torch.Tensor:
    """[rows, row bytes] uint8 of one part of one layer (0-based) of a device pool, on the CPU."""
    return getattr(pool, pool.part_names[part])[layer].reshape(pool.rows, -1).view(torch.uint8).cpu()


def poisoned_parts(pool):
    """``pool`` with every byte of every part 0xA5, so rows a write must not touch show up."""
    for b in scaled_parts(pool):
        b.view(torch.uint8).fill_(0xA5)
    return pool


def assert_rows_copied(after, before, dst: list[int], src: list[int], what: str) -> None:
    """Each tensor of ``after`` is its ``before`` with rows ``dst`` byte copies of ``before``'s rows
    ``src`` and every other row unchanged (what a move or a CPU copy's round trip leaves)."""
    for i, (a, b) in enumerate(zip(after, before, strict=True)):
        want = b.clone()
        want[dst] = b[src]
        assert_same_bytes(a, want, f"{what} (buffer {i})")


def assert_tensors_unchanged(after, before, what: str) -> None:
    """Each tensor of ``after`` holds its ``before``'s bytes (nothing was written)."""
    for i, (a, b) in enumerate(zip(after, before, strict=True)):
        assert_same_bytes(a, b, f"{what} (buffer {i})")


def assert_same_parts(a, b) -> None:
    """Every part of every layer of pools ``a`` and ``b`` (with ``part_names``) holds the same bytes;
    a difference is named ``k_buffer[0]`` and so on."""
    for name in a.part_names:
        for i, (x, y) in enumerate(zip(getattr(a, name), getattr(b, name), strict=True)):
            assert_same_bytes(x, y, f"{name}[{i}]")


def qkv_slices(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``k`` [T, H, D] and ``v`` [T, H, Dv <= D] as views sliced out of one wider [T, 3H, D]
    projection, as a fused QKV output is: the same values with its strides."""
    t, h, d = k.shape
    dv = v.shape[2]
    qkv = torch.zeros(t, 3 * h, d, dtype=k.dtype, device=k.device)
    qkv[:, h : 2 * h] = k
    qkv[:, 2 * h :, :dv] = v
    return qkv[:, h : 2 * h], qkv[:, 2 * h :, :dv]


# --- FP4 parts of HybridLinearKVPool and SWAKVPool ----------------------------------------------------

#: The FP4 dtype as SGLang spells it (torch's, or SGLang's name on a torch without it).
FP4_POOL_DTYPE = getattr(torch, "float4_e2m1fn_x2", "fp4_e2m1")
#: Both FP4 formats, as ``fp4_format`` names them.
FP4_PART_FORMATS = ["fp4_mx_block16", "nvfp4"]
FP4_H, FP4_D, FP4_DV = 3, 32, 16  # an odd head count; head dims of two and one scale blocks


def fp4_rows(t: int, dim: int, seed: int) -> torch.Tensor:
    """[t, FP4_H, dim] bf16 on the suite's device, magnitudes spread over 2**-8..2**8 per head."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, FP4_H, dim, generator=g) * torch.exp2(torch.randint(-8, 8, (t, FP4_H, 1), generator=g).float())
    return x.to(torch.bfloat16).to(DEVICE)


def fp4_alone(fmt: str, size: int, layers: int, **kw):
    """The standalone ``MHATokenToKVPoolFP4`` (reference path) a part of format ``fmt`` should
    behave as: FP4_H heads, FP4_D / FP4_DV, page size 1."""
    from kvpool.pools.mha_fp4_pool import MHATokenToKVPoolFP4

    return MHATokenToKVPoolFP4(size, 1, FP4_POOL_DTYPE, FP4_H, FP4_D, layers, DEVICE, v_head_dim=FP4_DV,
                               fp4_format=fmt, fused="never", **kw)  # fmt: skip


def changed_rows(after: list[torch.Tensor], before: list[torch.Tensor]) -> set[int]:
    """The rows (first index) in which any of ``after`` differs from its ``before``, byte for byte."""
    rows: set[int] = set()
    for a, b in zip(after, before, strict=True):
        differ = (a.view(torch.uint8) != b.view(torch.uint8)).reshape(a.shape[0], -1).any(dim=1)
        rows.update(int(i) for i in torch.nonzero(differ.cpu()).flatten())
    return rows


def every_16_bit_value(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of a 16-bit type, signed zeros and subnormals included, in blocks of 15
    neighbours by magnitude, each block led by a maximum that is theirs times a factor of 1 up to
    2**127 (capped at the type's largest value): every code, tie and sign of the FP4 formats, under
    block scales from the smallest to those that make the smallest values underflow to zero.
    [T, 1, 1024] rows on the CPU."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype).float()
    values = bits[torch.isfinite(bits)]
    values = values[torch.argsort(values.abs(), stable=True)]
    blocks = -(-values.numel() // 15)
    values = torch.cat((values, values[: blocks * 15 - values.numel()])).reshape(blocks, 15)
    factors = torch.tensor([1, 1.25, 1.5, 1.75, 2, 3, 5, 2**4, 1.5 * 2**8, 2**12, 2**20, 2**40, 2**70, 2**100, 2**127])
    lead = values.abs().amax(dim=1) * factors[torch.arange(blocks) % factors.numel()]
    lead = torch.minimum(lead.to(dtype).float(), torch.tensor(torch.finfo(dtype).max))
    lead = torch.where(torch.arange(blocks) % 2 == 0, lead, -lead)
    rows = torch.cat((lead[:, None], values), dim=1).reshape(-1)
    rows = torch.cat((rows, torch.zeros(-rows.numel() % 1024)))
    return rows.reshape(-1, 1, 1024).to(dtype)
