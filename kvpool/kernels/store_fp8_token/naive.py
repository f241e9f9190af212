"""FP8 with a scale per token and head, in plain PyTorch: the definition of what a per-token-head
pool stores (docs/contract.md, "Per-token-head FP8"); the fused kernel matches it bit for bit.

For one head of one token (a row ``x`` of ``D`` elements, widened to float32 exactly) and an FP8
format with largest finite value ``fmax`` (448 for e4m3fn, 57344 for e5m2):

- ``amax`` is the largest ``|x|`` over the row's finite elements (NaN and +-inf are left out; a row
  with none has ``amax = 0``);
- the scale is ``s = max(float32(amax / fmax), 2**-126)``: IEEE float32 division, correctly rounded,
  then raised to the smallest normal float32 (so an all-zero row stores ``s = 2**-126`` and zeros, and
  no path ever divides by a subnormal scale, which GPUs may flush);
- each element stores ``cast_rne(clamp(float32(x) / s, -fmax, +fmax))``, the per-tensor write's rule
  with this scale: a correctly rounded division, saturation (+-inf stores +-fmax), round to nearest
  even, the sign of zero kept, and NaN stored as the format's ``NAN_BITS`` (0x7f).

Reading back, an element is ``float32(code) * s`` (float32 multiplication, correctly rounded).
"""

from __future__ import annotations

from typing import Optional

import torch

from kvpool.kernels.formats import FP8_FORMATS, NAN_BITS
from kvpool.kernels.store_kv.naive import scatter_rows
from kvpool.write_types import F32_MIN_NORMAL

#: The smallest scale a row stores (the smallest normal float32): an all-zero row's scale.
MIN_TOKEN_SCALE = F32_MIN_NORMAL

#: The FP8 formats a per-token-head row may hold (the fnuz formats of MI300-class GPUs are not among
#: them: no NaN code of 0x7f and no negative zero, which this rule and its kernel spell out).
TOKEN_HEAD_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _check_rows(x: object, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"{name} must be 3-D [T, H, D], got shape {tuple(x.shape)}")
    return x


def _check_fp8(dtype: object) -> float:
    if dtype not in TOKEN_HEAD_DTYPES:
        raise ValueError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype!r}")
    return FP8_FORMATS[dtype].max_finite  # type: ignore[index]


def token_head_scales(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The scale of every token and head: ``max(float32(amax / fmax), 2**-126)``, ``amax`` over the
    finite elements of the head's row.

    Parameters
    ----------
    x : Tensor [T, H, D], bfloat16, float16 or float32. Never modified.
    dtype : the FP8 format (``torch.float8_e4m3fn`` or ``torch.float8_e5m2``).

    Returns
    -------
    Tensor [T, H] float32 on ``x``'s device, new.
    """
    fmax = _check_fp8(dtype)
    mag = _check_rows(x, "x").detach().to(torch.float32).abs()
    amax = torch.where(torch.isfinite(mag), mag, 0.0).amax(dim=2)
    # A device tensor divisor: CUDA divides by a Python scalar through its reciprocal.
    divisor = torch.full((), fmax, dtype=torch.float32, device=x.device)
    return torch.clamp(amax / divisor, min=MIN_TOKEN_SCALE)


def quantize_token_head(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows to FP8 codes with a scale per token and head.

    Parameters
    ----------
    x : Tensor [T, H, D], bfloat16, float16 or float32. Never modified.
    dtype : the FP8 format.

    Returns
    -------
    (codes, scales): Tensor [T, H, D] uint8 (the FP8 bit patterns) and Tensor [T, H] float32, new.

    Examples
    --------
    >>> codes, scales = quantize_token_head(torch.tensor([[[448.0, -224.0, 0.0]]]), torch.float8_e4m3fn)
    >>> codes.tolist(), scales.tolist()   # scale 1: 448 is 0x7e, -224 is 0xf6
    ([[[126, 246, 0]]], [[1.0]])
    """
    fmax = _check_fp8(dtype)
    scales = token_head_scales(x, dtype)
    y = x.detach().to(torch.float32) / scales.unsqueeze(-1)
    q = y.clamp(-fmax, fmax).to(dtype).view(torch.uint8)
    codes = torch.where(torch.isnan(y), NAN_BITS[dtype], q).to(torch.uint8)
    return codes, scales


def dequantize_token_head(
    codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Stored rows back to values: ``float32(code) * scale`` (correctly rounded), cast to ``out_dtype``.

    Parameters
    ----------
    codes : Tensor [R, H, D], uint8 (or already the FP8 ``dtype`` view).
    scales : Tensor [R, H], float32.
    dtype : the FP8 format of the codes.
    out_dtype : what is returned.

    Returns
    -------
    Tensor [R, H, D] of ``out_dtype``, new.
    """
    _check_fp8(dtype)
    _check_rows(codes, "codes")
    if codes.dtype not in (torch.uint8, dtype):
        raise ValueError(f"codes must be torch.uint8 or {dtype}, got {codes.dtype}")
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32:
        raise ValueError(f"scales must be a float32 tensor, got {getattr(scales, 'dtype', type(scales).__name__)}")
    if tuple(scales.shape) != tuple(codes.shape[:2]):
        want = tuple(codes.shape[:2])
        raise ValueError(f"scales must have shape {want} ([R, H] of codes), got {tuple(scales.shape)}")
    values = codes.view(dtype).to(torch.float32) * scales.unsqueeze(-1)
    return values.to(out_dtype)


def mapped_slots(slot_map: torch.Tensor, loc: torch.Tensor) -> torch.Tensor:
    """``slot_map[s]`` for each entry ``s`` of ``loc`` in ``[0, len(slot_map))``, -1 for any other:
    the rows a write through a slot map writes (int64, ``loc``'s shape; no synchronisation).

    >>> mapped_slots(torch.tensor([0, 5, 0, 7]), torch.tensor([1, 3, -1, 9, 2]))
    tensor([ 5,  7, -1, -1,  0])
    """
    m = slot_map.shape[0]
    slots = loc.to(torch.int64)
    inside = (slots >= 0) & (slots < m)
    return torch.where(inside, slot_map[slots.clamp(0, max(m - 1, 0))], -1) if m else torch.full_like(slots, -1)


def write_token_head_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_store: tuple[torch.Tensor, torch.Tensor],
    v_store: tuple[torch.Tensor, torch.Tensor],
    loc: torch.Tensor,
    dtype: torch.dtype,
    slot_map: Optional[torch.Tensor] = None,
) -> None:
    """The per-token-head write on checked arguments: quantize ``k`` and ``v``, then scatter codes
    and scales to ``loc`` (negative and out-of-range slots write nothing; no synchronisation), or
    to ``mapped_slots(slot_map, loc)`` with a slot map.

    Parameters
    ----------
    k, v : Tensor [T, H, D] / [T, H, Dv].
    k_store, v_store : (codes [rows, H, D] uint8, scales [rows, H] float32).
    loc : Tensor [T], int32/int64.
    dtype : the FP8 format.
    slot_map : Tensor [M] int64, or None.
    """
    if k.shape[0] == 0:
        return
    if slot_map is not None:
        loc = mapped_slots(slot_map, loc)
    for x, (codes_buf, scale_buf) in ((k, k_store), (v, v_store)):
        codes, scales = quantize_token_head(x, dtype)
        scatter_rows(codes_buf, loc, codes)
        scatter_rows(scale_buf, loc, scales)
