"""SGLang's KV FP4 format in plain PyTorch: the definition of the bytes an FP4 pool stores
(docs/contract.md, "FP4 pools").

Each run of 16 consecutive elements of a row (a block) shares one scale byte ``b``: the block's
values are ``e2m1 * 2 ** (b - 127)``. With ``amax`` the block's largest ``|x|`` in float32:

- ``v = max(float32(amax / 6), float32(1e-10))`` (6 is e2m1's largest value; correctly rounded);
- ``e = ceil(log2(v))``, exactly: the exponent of ``v``, plus one unless ``v`` is a power of two;
- ``b = e + 127`` (94..253 for finite inputs);
- each element ``s = float32(x) / 2 ** e`` gets the magnitude code ``#{bound <= |s|}`` over the
  bounds 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 (the midpoints of the e2m1 values 0, 0.5, 1, 1.5, 2,
  3, 4, 6: a tie rounds away from zero, anything above 5 is 6) and the sign bit 0x8 iff ``s < 0``
  (so -0.0 stores 0x0 and a small negative value 0x8);
- two codes a byte: element ``2j`` in the low nibble, ``2j + 1`` in the high one.

A block whose ``amax`` is +-inf or NaN stores the scale byte ``NON_FINITE_SCALE`` (0) and sixteen
0x0 codes, so it reads back as zeros (what SGLang's quantizer stores for such blocks on a CPU).
The exponent is computed with integer operations on the bits of ``v`` rather than with ``log2``, so
that the fused kernel can compute the same value on any device.
"""

from __future__ import annotations

from typing import Optional

import torch

from kvpool.kernels.store_kv.naive import scatter_rows

#: Elements sharing one scale byte.
FP4_BLOCK = 16

#: e2m1's largest magnitude: the block maximum maps to at most this.
E2M1_MAX = 6.0

#: The eight e2m1 magnitudes, by code (the low three bits of a nibble).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

#: Magnitude code c is the number of these a scaled |x| reaches (``>=``).
E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)

#: The scale byte of a block holding +-inf or NaN (its codes are all 0x0).
NON_FINITE_SCALE = 0

#: The smallest ``amax / 6`` the exponent is taken of (float32(1e-10): all-zero blocks get 2**-33).
_MIN_RATIO = 1e-10

_EXP_BIAS = 127


def _check_fp4_rows(x: torch.Tensor, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"{name} must be 3-D [T, H, D], got shape {tuple(x.shape)}")


def fp4_block_exponents(amax: torch.Tensor) -> torch.Tensor:
    """``ceil(log2(max(float32(amax / 6), float32(1e-10))))`` for finite ``amax`` >= 0, exactly, as
    int32 (a power of two gives its own exponent; anything above it the next one). Non-finite
    entries give 128 (inf) or more (NaN): callers mask them.

    Parameters
    ----------
    amax : Tensor [...], float32, the blocks' largest magnitudes.
    """
    # A device tensor divisor: CUDA divides by a Python scalar through its reciprocal (not
    # correctly rounded).
    six = torch.full((), E2M1_MAX, dtype=torch.float32, device=amax.device)
    v = torch.clamp(amax / six, min=_MIN_RATIO)
    bits = v.view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - _EXP_BIAS
    return exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def quantize_fp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows to SGLang's KV FP4: packed e2m1 codes and one exponent scale byte per 16 elements.

    Parameters
    ----------
    x : Tensor [T, H, D], bfloat16, float16 or float32, ``H * D`` a multiple of 16 (blocks run over
        the flattened ``H * D`` row, as SGLang's do) and ``D`` even. Never modified.

    Returns
    -------
    (packed, scales): Tensor [T, H, D // 2] uint8 (element ``2j`` in the low nibble) and Tensor
    [T, H * D // 16] uint8 (``2 ** (b - 127)`` per block), new tensors on ``x``'s device.

    Examples
    --------
    >>> packed, scales = quantize_fp4(torch.full((1, 1, 16), 3.0))
    >>> packed[0, 0, 0].item(), scales[0, 0].item()   # 3.0 = 6 * 2**-1: code 7 twice, byte 126
    (119, 126)
    """
    _check_fp4_rows(x, "x")
    t, h, d = x.shape
    if d % 2 or (h * d) % FP4_BLOCK:
        raise ValueError(f"x must have an even D and H * D a multiple of {FP4_BLOCK}, got shape {tuple(x.shape)}")
    blocks = x.detach().to(torch.float32).reshape(t, h * d // FP4_BLOCK, FP4_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    finite = torch.isfinite(amax)
    exponent = torch.where(finite, fp4_block_exponents(amax), 0)
    # 2**e is a normal float32 for every finite block (e in -33..126): the division is exact up to
    # float32 underflow, as SGLang's.
    scaled = blocks / torch.exp2(exponent.to(torch.float32)).unsqueeze(-1)
    magnitude = torch.zeros(scaled.shape, dtype=torch.uint8, device=x.device)
    size = scaled.abs()
    for bound in E2M1_BOUNDS:
        magnitude += (size >= bound).to(torch.uint8)
    codes = magnitude | ((scaled < 0).to(torch.uint8) << 3)
    codes = torch.where(finite.unsqueeze(-1), codes, 0).reshape(t, h, d)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = torch.where(finite, exponent + _EXP_BIAS, NON_FINITE_SCALE).to(torch.uint8)
    return packed, scales


def dequantize_fp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """SGLang's KV FP4 back to values: ``e2m1(code) * 2 ** (b - 127)``, exact in float32, then cast
    to ``dtype`` (code 0x8 is -0.0; byte 255 makes a block's zeros NaN, as ``0 * inf``).

    Parameters
    ----------
    packed : Tensor [T, H, D // 2] uint8.
    scales : Tensor [T, H * D // 16] uint8.
    dtype : the element type returned (SGLang's getters: bfloat16).

    Returns
    -------
    Tensor [T, H, D] of ``dtype``, new.
    """
    _check_fp4_rows(packed, "packed")
    t, h, half = packed.shape
    d = 2 * half
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"packed and scales must be uint8, got {packed.dtype} and {scales.dtype}")
    if tuple(scales.shape) != (t, h * d // FP4_BLOCK) or (h * d) % FP4_BLOCK:
        raise ValueError(
            f"scales must have shape {(t, h * d // FP4_BLOCK)} for packed {tuple(packed.shape)}, got {tuple(scales.shape)}"
        )
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(t, h * d // FP4_BLOCK, FP4_BLOCK)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    values = table[(codes & 0x07).long()]
    values = torch.where((codes & 0x08) != 0, -values, values)
    factor = torch.exp2(scales.to(torch.float32) - _EXP_BIAS).unsqueeze(-1)
    return (values * factor).reshape(t, h, d).to(dtype)


def fp4_scale_tensor(scale: object, heads: int, device: torch.device) -> Optional[torch.Tensor]:
    """A checked scale (None, a float, or a tensor of one element or one per head) as a float32
    device tensor that broadcasts over [T, H, D]: a device tensor because CUDA divides by a Python
    scalar through its reciprocal, which is not the correctly rounded quotient."""
    if scale is None:
        return None
    if isinstance(scale, torch.Tensor):
        s = scale.detach().to(torch.float32)
        return s.reshape(1, heads, 1) if s.numel() == heads and heads != 1 else s.reshape(1, 1, 1)
    return torch.full((1, 1, 1), float(scale), dtype=torch.float32, device=device)  # type: ignore[arg-type]


def scale_divided(x: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
    """``x / scale`` as SGLang's FP4 pool divides it before quantizing: in float32, correctly
    rounded, then rounded back to ``x``'s dtype (out of place; SGLang divides its input in place).
    ``scale`` is None or a float32 tensor that broadcasts over [T, H, D]."""
    if scale is None:
        return x
    return (x.detach().to(torch.float32) / scale).to(x.dtype)


def write_fp4_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_store: tuple[torch.Tensor, torch.Tensor],
    v_store: tuple[torch.Tensor, torch.Tensor],
    loc: torch.Tensor,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> None:
    """The FP4 write on checked arguments: quantize ``k`` and ``v`` (after the scale division), then
    scatter the packed rows and the scale rows to ``loc`` (negative and out-of-range slots write
    nothing; no synchronisation).

    Parameters
    ----------
    k, v : Tensor [T, H, D] / [T, H, Dv].
    k_store, v_store : (packed buffer [rows, H, D // 2], scale buffer [rows, H * D // 16]), uint8.
    loc : Tensor [T], int32/int64.
    k_scale, v_scale : None or float32 tensors that broadcast over [T, H, D].
    """
    if k.shape[0] == 0:
        return
    for x, scale, (packed_buf, scale_buf) in ((k, k_scale, k_store), (v, v_scale, v_store)):
        packed, scales = quantize_fp4(scale_divided(x, scale))
        scatter_rows(packed_buf, loc, packed)
        scatter_rows(scale_buf, loc, scales)
