"""How an FP4 pool is told its format, and an NVFP4 pool's per-layer global scales: the checked
values the constructor and ``set_global_scales`` take, and the rule for a ``k_scale`` given to a
write (it must be the layer's global scale). docs/contract.md, "NVFP4"."""

from __future__ import annotations

import struct
from typing import Optional

import torch

from kvpool.kernels.store_kv.checks import check_scale

#: SGLang's ``--kv-cache-dtype`` names of its two FP4 KV formats: exponent scales per 16 elements,
#: and two-level NVFP4 (e4m3 block scales and a float32 global scale per tensor).
FP4_MX_BLOCK16 = "fp4_mx_block16"
NVFP4 = "nvfp4"
FP4_FORMATS = (FP4_MX_BLOCK16, NVFP4)


def fp4_format_of(dtype: object, fp4_format: Optional[str]) -> str:
    """The format a pool stores: ``fp4_format`` if given, else ``"nvfp4"`` for ``dtype="nvfp4"``
    and the exponent-scale format for any other ``dtype`` (which the pool checks itself)."""
    if fp4_format is None:
        return NVFP4 if dtype == NVFP4 else FP4_MX_BLOCK16
    if fp4_format not in FP4_FORMATS:
        raise ValueError(f"fp4_format must be {FP4_MX_BLOCK16!r} or {NVFP4!r}, got {fp4_format!r}")
    if dtype == NVFP4 and fp4_format != NVFP4:
        raise ValueError(f"fp4_format must be {NVFP4!r} (or None) with dtype='nvfp4', got {fp4_format!r}")
    return fp4_format


def float32_of(value: float) -> float:
    """``value`` rounded to float32, as a Python float (what a float32 tensor of it holds)."""
    return struct.unpack("f", struct.pack("f", value))[0]


def global_scale_list(value: object, name: str, layers: int) -> list[float]:
    """``layers`` checked global scales, float32-rounded: from None (1.0 each), one positive normal
    float for all, or a sequence of ``layers`` of them."""
    if value is None:
        return [1.0] * layers
    if not isinstance(value, (list, tuple)):
        return [_one_scale(value, name)] * layers
    if len(value) != layers:
        raise ValueError(f"{name} must have one scale per layer ({layers}), got {len(value)}")
    return [_one_scale(item, f"{name}[{j}]") for j, item in enumerate(value)]


def _one_scale(value: object, name: str) -> float:
    if isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a Python float (a per-layer global scale), got a tensor")
    return float32_of(float(check_scale(value, name, 1, torch.device("cpu"))))  # type: ignore[arg-type]


def check_global_scale_arg(
    scale: object, name: str, known: float, device_scale: torch.Tensor, device: torch.device, validate: bool
) -> None:
    """A scale given to an NVFP4 write must be the layer's global scale ``known`` (its device copy
    ``device_scale``): None; a float equal to it in float32; or a one-element floating tensor on the
    device, whose value is compared under ``validate`` only (one synchronisation)."""
    if scale is None:
        return
    checked = check_scale(scale, name, 1, device)
    if isinstance(checked, torch.Tensor):
        if checked.numel() != 1:
            raise ValueError(f"{name} must have one element (an NVFP4 global scale), got shape {tuple(checked.shape)}")
        if validate and not bool((checked.detach().reshape(()).to(torch.float32) == device_scale.reshape(())).item()):
            raise ValueError(f"{name} must equal the layer's NVFP4 global scale {known!r} (set_global_scales)")
        return
    if float32_of(float(checked)) != known:  # type: ignore[arg-type]
        raise ValueError(f"{name} must be None or the layer's NVFP4 global scale {known!r} (set_global_scales), got {checked!r}")
