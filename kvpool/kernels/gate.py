"""The eligibility gate: may the fused Triton kernel do this write? (SPEC section 4.3)

One pure function of the write's metadata. It never raises for a write it cannot take; it says why,
and the caller falls back to the reference path (``fused="auto"``) or raises (``fused="always"``).
"""

from __future__ import annotations

import torch

from kvpool.kernels.checks import Scale
from kvpool.kernels.formats import CACHE_DTYPES, INPUT_DTYPES

#: Largest head_dim the kernel takes: a [BLOCK_H, next_pow2(head_dim)] tile must fit one program.
MAX_HEAD_DIM = 1024

ELIGIBLE = "eligible"


def _scale_reason(scale: Scale, name: str) -> str | None:
    if isinstance(scale, torch.Tensor) and scale.dtype != torch.float32:
        return f"{name} is a {scale.dtype} tensor; the fused kernel reads float32 scale tensors"
    return None


def fused_eligibility(
    *,
    device: torch.device,
    cache_dtype: torch.dtype,
    k_dtype: torch.dtype,
    v_dtype: torch.dtype,
    head_dim: int,
    v_head_dim: int,
    k_cache_stride_d: int,
    v_cache_stride_d: int,
    k_scale: Scale,
    v_scale: Scale,
    triton_available: bool,
    interpreter: bool,
) -> tuple[bool, str]:
    """Decide whether the fused kernel may perform a write.

    Parameters
    ----------
    device : where the cache and inputs live (already checked to agree).
    cache_dtype, k_dtype, v_dtype : element types of the cache and of the inputs.
    head_dim, v_head_dim : D and Dv.
    k_cache_stride_d, v_cache_stride_d : the caches' head_dim strides (NHD layout means 1).
    k_scale, v_scale : None, a float, or a scale tensor (already checked for shape and device).
    triton_available : Triton imported and the kernel was defined.
    interpreter : the kernel runs under ``TRITON_INTERPRET=1``, so CPU tensors are acceptable.

    Returns
    -------
    (eligible, reason) : ``reason`` is ``"eligible"`` or says which condition failed, with values.
    """
    if not triton_available:
        return False, "triton is not installed or failed to import"
    if device.type == "cpu":
        if not interpreter:
            return False, (
                "device is cpu: the fused kernel runs on CUDA devices "
                "(or on the CPU under TRITON_INTERPRET=1 with fused='always')"
            )
    elif device.type != "cuda":
        return False, f"device type {device.type!r} has no Triton backend here"
    elif interpreter:
        return False, "TRITON_INTERPRET=1 is set, and the interpreter takes CPU tensors only"
    if cache_dtype not in CACHE_DTYPES:
        return False, f"cache dtype {cache_dtype} is not supported"
    if k_dtype not in INPUT_DTYPES or v_dtype not in INPUT_DTYPES:
        return False, f"input dtypes {k_dtype}/{v_dtype} are not bf16/fp16/fp32"
    if head_dim > MAX_HEAD_DIM or v_head_dim > MAX_HEAD_DIM:
        return False, f"head_dim {max(head_dim, v_head_dim)} exceeds the fused kernel's limit of {MAX_HEAD_DIM}"
    if k_cache_stride_d != 1 or v_cache_stride_d != 1:
        return False, (
            f"cache layout is not NHD with a contiguous head_dim "
            f"(head_dim strides {k_cache_stride_d}/{v_cache_stride_d}, expected 1)"
        )
    reason = _scale_reason(k_scale, "k_scale") or _scale_reason(v_scale, "v_scale")
    if reason is not None:
        return False, reason
    return True, ELIGIBLE
