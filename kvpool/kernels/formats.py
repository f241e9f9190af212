"""Element formats a KV cache can hold, and the facts about each that the write paths need.

The FP8 constants are the format definitions (OCP FP8: e4m3fn has no infinities and one NaN
mantissa pattern; e5m2 is IEEE-like; the fnuz formats of MI300-class GPUs, e4m3fnuz and e5m2fnuz,
have no infinities, no negative zero and one NaN, the pattern 0x80 that would be -0). The kind
numbers below (``OUT_KIND``, ``SCALE_*``) are the fused kernel's compile-time constants: the kernel,
its launcher, the argument checks and the gate read them from here, so a write is classified once,
in these terms. ``NAN_BITS`` is read by the kernel and by the reference path alike. (The kernel's
integer FP8 encoder spells each format's exponent bias, mantissa width, largest finite value and
zero rule as literals, which match ``FP8_FORMATS``.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8Format:
    """How an FP8 format is laid out: what the saturating round-to-nearest-even encoder needs."""

    dtype: torch.dtype
    exp_bias: int
    mant_bits: int
    max_finite: float
    #: False for the fnuz formats: a result that rounds to zero is stored as 0x00 whatever its sign
    #: (0x80 is their NaN).
    signed_zero: bool = True

    @property
    def min_normal(self) -> float:
        """The smallest positive normal value, ``2 ** (1 - exp_bias)``."""
        return 2.0 ** (1 - self.exp_bias)

    def __post_init__(self) -> None:
        if self.max_finite != torch.finfo(self.dtype).max:
            raise ValueError(f"{self.dtype}: max_finite {self.max_finite} disagrees with torch.finfo")


FP8_FORMATS: dict[torch.dtype, Fp8Format] = {
    torch.float8_e4m3fn: Fp8Format(torch.float8_e4m3fn, exp_bias=7, mant_bits=3, max_finite=448.0),
    torch.float8_e5m2: Fp8Format(torch.float8_e5m2, exp_bias=15, mant_bits=2, max_finite=57344.0),
    torch.float8_e4m3fnuz: Fp8Format(
        torch.float8_e4m3fnuz, exp_bias=8, mant_bits=3, max_finite=240.0, signed_zero=False
    ),
    torch.float8_e5m2fnuz: Fp8Format(
        torch.float8_e5m2fnuz, exp_bias=16, mant_bits=2, max_finite=57344.0, signed_zero=False
    ),
}

#: Element types a cache (pool) may hold. (A transfer header names a dtype by its position here:
#: new types go at the end.)
CACHE_DTYPES: tuple[torch.dtype, ...] = (
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
)

#: SGLang's FP4 KV format (two e2m1 values a byte, an exponent scale byte per 16 elements): the FP4
#: pools' element type, None on a torch without it (kvpool/kernels/store_fp4).
FP4_DTYPE = getattr(torch, "float4_e2m1fn_x2", None)

#: Element types that may be written into a cache.
INPUT_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)

LOC_DTYPES: tuple[torch.dtype, ...] = (torch.int32, torch.int64)

#: How the kernel produces a cache element, per cache dtype (a compile-time constant of the kernel).
OUT_KIND: dict[torch.dtype, int] = {
    torch.float8_e4m3fn: 0,
    torch.float8_e5m2: 1,
    torch.bfloat16: 2,
    torch.float16: 3,
    torch.float32: 4,
    torch.float8_e4m3fnuz: 5,
    torch.float8_e5m2fnuz: 6,
}

#: Scale kinds (compile-time constants of the kernel): no scale; a Python float passed by value
#: (baked into a CUDA graph); a one-element tensor read on the device when the kernel runs; one
#: element per head, read with its own stride.
SCALE_NONE, SCALE_VALUE, SCALE_TENSOR, SCALE_HEAD = 0, 1, 2, 3

#: The bits a NaN is stored as whenever a write converts between element types: the format's
#: positive NaN with every exponent and mantissa bit set (for the fnuz formats their only NaN,
#: 0x80). Hardware and torch disagree about NaN
#: payloads and signs (torch's own CPU conversions differ between its scalar and vector code), so
#: both write paths store this pattern explicitly. A write whose input already has the cache's
#: type copies the bits as they are, NaN payloads included.
NAN_BITS: dict[torch.dtype, int] = {
    torch.float8_e4m3fn: 0x7F,
    torch.float8_e5m2: 0x7F,
    torch.bfloat16: 0x7FFF,
    torch.float16: 0x7FFF,
    torch.float32: 0x7FFFFFFF,
    torch.float8_e4m3fnuz: 0x80,
    torch.float8_e5m2fnuz: 0x80,
}


def bits_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer type of the same width, for handling values as bit patterns."""
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32}[dtype.itemsize]


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is one of the FP8 formats of ``FP8_FORMATS``."""
    return dtype in FP8_FORMATS


def store_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """The element type the buffers are allocated with: FP8 lives in uint8 storage (as SGLang's does:
    ``index_put_`` and ``where`` are not implemented for FP8 on every device and torch version);
    other types are stored as themselves."""
    return torch.uint8 if is_fp8(dtype) else dtype
