"""Two-level NVFP4 in plain PyTorch: the definition of the bytes an NVFP4 pool stores
(docs/contract.md, "NVFP4").

A value is ``e2m1 * block_scale * global_scale``: e2m1 codes two a byte, one e4m3fn block scale per
16 consecutive elements of a head, one float32 global scale ``g`` per tensor (a layer's K, or its V).
With ``y = float32(x) / g`` (correctly rounded):

- each block's scale byte is ``e4m3(float32(amax / 6))``, ``amax`` the block's largest ``|y|``, where
  ``e4m3`` rounds to nearest, ties to even, saturates at 448 and has subnormals (0x01 is 2**-9);
- each element's code is ``e2m1(float32(y / S))``, ``S`` the block scale's value: round to nearest,
  ties to even (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), saturating
  at 6, with the sign bit 0x8 the sign bit of ``x`` (-0.0 stores 0x8, as a hardware conversion does);
- a block whose scale byte is 0 (``amax / 6 <= 2**-10``) stores its elements' sign bits only;
- a block holding +-inf or NaN in ``y`` stores scale byte 0 and sixteen 0x0 codes (it reads back as
  zeros, as the exponent-scale FP4 format's do);
- two codes a byte, element ``2j`` in the low nibble.

Dequantized: ``float32(e2m1 * S)`` (exact), times ``g`` in float32, cast to the output type.
"""

from __future__ import annotations

import torch

from kvpool.kernels.store_fp4.naive import E2M1_VALUES, FP4_BLOCK
from kvpool.kernels.store_kv.naive import scatter_rows

#: The largest e4m3fn value: a block scale saturates there.
E4M3_MAX = 448.0

#: Magnitude code c is the number of these a scaled |y| passes; a bound of the odd codes' left end
#: is reached with ``>`` (a tie there rounds down, to the even code), of the even ones with ``>=``.
E2M1_RNE_BOUNDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def _check_rows(x: torch.Tensor, name: str) -> tuple[int, int, int]:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"{name} must be 3-D [T, H, D], got shape {tuple(x.shape)}")
    t, h, d = x.shape
    return t, h, d


def _check_global_scale(global_scale: object, device: torch.device) -> torch.Tensor:
    if not isinstance(global_scale, torch.Tensor):
        raise ValueError(f"global_scale must be a float32 tensor of one element, got {type(global_scale).__name__}")
    if global_scale.dtype != torch.float32 or global_scale.numel() != 1:
        got = f"{global_scale.dtype} with {global_scale.numel()} elements"
        raise ValueError(f"global_scale must be a float32 tensor of one element, got {got}")
    if global_scale.device != device:
        raise ValueError(f"global_scale must be on {device}, got {global_scale.device}")
    return global_scale.reshape(1, 1, 1)


def e4m3_bytes(s: torch.Tensor) -> torch.Tensor:
    """Non-negative float32 values (or +inf) as e4m3fn bytes: round to nearest even, saturating at
    448 (torch's conversion through float32, clamped first so no torch version makes NaN of it)."""
    return torch.clamp(s, max=E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def e2m1_codes(q: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """e2m1 codes of float32 values: round to nearest even, saturating at 6; 0x8 where ``negative``."""
    size = q.abs()
    magnitude = torch.zeros(q.shape, dtype=torch.uint8, device=q.device)
    for bound, inclusive in E2M1_RNE_BOUNDS:
        magnitude += (size >= bound if inclusive else size > bound).to(torch.uint8)
    return magnitude | (negative.to(torch.uint8) << 3)


def quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows to two-level NVFP4: packed e2m1 codes and one e4m3fn block scale byte per 16 elements.

    Parameters
    ----------
    x : Tensor [T, H, D], bfloat16, float16 or float32, ``D`` a multiple of 16. Never modified.
    global_scale : Tensor of one float32 element on ``x``'s device: the tensor's scale ``g``
        (values are ``e2m1 * block_scale * g``), positive and normal (not checked here).

    Returns
    -------
    (packed, scales): Tensor [T, H, D // 2] uint8 (element ``2j`` in the low nibble) and Tensor
    [T, H, D // 16] uint8 (e4m3fn bits), new tensors on ``x``'s device.

    Examples
    --------
    >>> packed, scales = quantize_nvfp4(torch.full((1, 1, 16), 3.0), torch.tensor([1.0]))
    >>> packed[0, 0, 0].item(), scales[0, 0, 0].item()   # 3 / 6 = 0.5 (byte 0x30); 3 / 0.5 = 6
    (119, 48)
    """
    t, h, d = _check_rows(x, "x")
    if d % FP4_BLOCK:
        raise ValueError(f"x must have D a multiple of {FP4_BLOCK}, got shape {tuple(x.shape)}")
    g = _check_global_scale(global_scale, x.device)
    y = (x.detach().to(torch.float32) / g).reshape(t, h, d // FP4_BLOCK, FP4_BLOCK)
    finite = torch.isfinite(y).all(dim=-1)
    # A device tensor divisor: CUDA divides by a Python scalar through its reciprocal.
    six = torch.full((), 6.0, dtype=torch.float32, device=x.device)
    amax = torch.where(finite, y.abs().amax(dim=-1), 0.0)
    scales = e4m3_bytes(amax / six)
    block = scales.view(torch.float8_e4m3fn).to(torch.float32).unsqueeze(-1)
    live = (scales != 0).unsqueeze(-1)
    q = torch.where(live, y / torch.where(live, block, 1.0), 0.0)
    negative = torch.signbit(y)
    codes = torch.where(finite.unsqueeze(-1), e2m1_codes(q, negative), 0).reshape(t, h, d)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, torch.where(finite, scales, 0)


def dequantize_nvfp4(
    packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Two-level NVFP4 back to values: ``float32(e2m1(code) * S) * g``, cast to ``dtype`` (code 0x8
    is -0.0; the block scale byte 0x7F, e4m3fn's NaN, makes its block NaN).

    Parameters
    ----------
    packed : Tensor [T, H, D // 2] uint8.
    scales : Tensor [T, H, D // 16] uint8 (e4m3fn bits).
    global_scale : Tensor of one float32 element on ``packed``'s device.
    dtype : the element type returned (SGLang's getters: bfloat16).

    Returns
    -------
    Tensor [T, H, D] of ``dtype``, new.
    """
    t, h, half = _check_rows(packed, "packed")
    d = 2 * half
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"packed and scales must be uint8, got {packed.dtype} and {scales.dtype}")
    if tuple(scales.shape) != (t, h, d // FP4_BLOCK) or d % FP4_BLOCK:
        want = (t, h, d // FP4_BLOCK)
        raise ValueError(f"scales must have shape {want} for packed {tuple(packed.shape)}, got {tuple(scales.shape)}")
    g = _check_global_scale(global_scale, packed.device).reshape(1, 1, 1, 1)
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(t, h, d // FP4_BLOCK, FP4_BLOCK)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    values = table[(codes & 0x07).long()]
    values = torch.where((codes & 0x08) != 0, -values, values)
    block = scales.view(torch.float8_e4m3fn).to(torch.float32).unsqueeze(-1)
    return ((values * block) * g).reshape(t, h, d).to(dtype)


def write_nvfp4_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_store: tuple[torch.Tensor, torch.Tensor],
    v_store: tuple[torch.Tensor, torch.Tensor],
    loc: torch.Tensor,
    k_global_scale: torch.Tensor,
    v_global_scale: torch.Tensor,
) -> None:
    """The NVFP4 write on checked arguments: quantize ``k`` and ``v`` with their global scales, then
    scatter the packed rows and the block scale rows to ``loc`` (negative and out-of-range slots
    write nothing; no synchronisation).

    Parameters
    ----------
    k, v : Tensor [T, H, D] / [T, H, Dv].
    k_store, v_store : (packed buffer [rows, H, D // 2], scale buffer [rows, H, D // 16]), uint8.
    loc : Tensor [T], int32/int64.
    k_global_scale, v_global_scale : one-element float32 tensors on the buffers' device.
    """
    if k.shape[0] == 0:
        return
    for x, g, (packed_buf, scale_buf) in ((k, k_global_scale, k_store), (v, v_global_scale, v_store)):
        packed, scales = quantize_nvfp4(x, g)
        scatter_rows(packed_buf, loc, packed)
        scatter_rows(scale_buf, loc, scales)
