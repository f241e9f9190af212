"""The reference write path: plain PyTorch, any device, and the definition of SPEC section 3.1.

``quantize`` is the per-element function q(x, s); ``scatter_rows`` writes rows to slots while skipping
negative and out-of-range slots without reading ``loc`` on the host (no synchronisation);
``reference_set_kv_buffer`` is the public function with the fused kernel's signature.
"""

from __future__ import annotations

import torch

from kvpool.kernels.checks import Scale, check_caller_values, check_caller_write
from kvpool.kernels.formats import FP8_FORMATS, is_fp8


def _scale_tensor(scale: Scale, heads: int, device: torch.device) -> torch.Tensor | None:
    """The scale as a float32 tensor on ``device`` that broadcasts over [T, H, D].

    A Python float becomes a device tensor (``torch.full`` fills it on the device, with no host copy
    and no synchronisation) because dividing a CUDA tensor by a Python scalar multiplies by the
    reciprocal instead, which is not the correctly rounded quotient.
    """
    if scale is None:
        return None
    if isinstance(scale, torch.Tensor):
        s = scale.detach().to(torch.float32)
        return s.reshape(1, heads, 1) if s.numel() == heads and heads != 1 else s.reshape(1, 1, 1)
    return torch.full((1, 1, 1), scale, dtype=torch.float32, device=device)


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: Scale = None) -> torch.Tensor:
    """q(x, s) of SPEC 3.1: the values a write stores, as a new tensor of ``dtype``.

    For FP8: float32 division by the scale (IEEE, correctly rounded), saturation to the format's
    largest finite value (infinities too), round to nearest even; NaN stays NaN. The explicit clamp
    makes the result independent of the torch version (torch <= 2.11 turns overflow into NaN).
    For 16-bit and fp32 caches: the plain cast; the scale is not used.

    Parameters
    ----------
    x : Tensor [T, H, D], bfloat16, float16 or float32. Never modified.
    dtype : the cache element type.
    scale : None, a float, or a tensor with 1 or H elements.
    """
    if not is_fp8(dtype):
        return x.to(dtype)
    y = x.to(torch.float32)
    s = _scale_tensor(scale, x.shape[1], x.device)
    if s is not None:
        y = y / s  # out of place: inputs are never modified (SGLang's fallback divides in place)
    fmax = FP8_FORMATS[dtype].max_finite
    return y.clamp(-fmax, fmax).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    # FP8 tensors are handled as uint8 so that where/index_put_ work on every device and torch version.
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def scatter_rows(cache: torch.Tensor, loc: torch.Tensor, rows: torch.Tensor) -> None:
    """``cache[loc[t]] = rows[t]`` for every t with ``0 <= loc[t] < cache.shape[0]``; other tokens
    write nothing. No host synchronisation: tokens to be skipped are redirected, on the device, to
    repeat the write of the first valid token (same slot, same row), and when no token is valid,
    every token rewrites slot 0 with its own current contents."""
    capacity = cache.shape[0]
    if loc.shape[0] == 0 or capacity == 0:
        return
    dst = _bits(cache)
    src = _bits(rows)
    slots = loc.to(torch.int64)
    valid = (slots >= 0) & (slots < capacity)
    any_valid = valid.any()
    # Index of the first valid token (0 if none), as a 1-element tensor: indexing with a 0-dim
    # tensor would turn it into a Python int, a synchronisation.
    first = torch.argmax(valid.to(torch.uint8)).view(1)
    fallback_slot = torch.where(any_valid, slots.index_select(0, first), 0)
    fallback_row = torch.where(any_valid, src.index_select(0, first), dst[:1])
    target = torch.where(valid, slots, fallback_slot)
    values = torch.where(valid.view(-1, *([1] * (src.dim() - 1))), src, fallback_row)
    dst.index_put_((target,), values)


def write_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
    k_scale: Scale,
    v_scale: Scale,
) -> None:
    """Unchecked reference write (arguments already checked). Caches carry their logical dtype."""
    scatter_rows(k_cache, loc, quantize(k, k_cache.dtype, k_scale))
    scatter_rows(v_cache, loc, quantize(v, v_cache.dtype, v_scale))


def reference_set_kv_buffer(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_loc: torch.Tensor,
    k_scale: Scale = None,
    v_scale: Scale = None,
    *,
    validate: bool | None = None,
) -> None:
    """Write K/V rows into caller-owned caches with plain PyTorch (the definition of the write).

    Same signature and semantics as :func:`kvpool.fused_fp8_set_kv_buffer`; runs on any device.

    Parameters
    ----------
    k, v : Tensor [T, H, D] and [T, Hv, Dv], bfloat16/float16/float32, any strides. Never modified.
    k_cache, v_cache : Tensor [slots, H, D] and [slots, Hv, Dv], float8_e4m3fn, float8_e5m2,
        bfloat16, float16 or float32.
    cache_loc : Tensor [T], int32 or int64. Negative entries are padding and write nothing; entries
        >= slots are never written (``validate=True`` raises IndexError for them instead).
    k_scale, v_scale : None, a positive float, or a float tensor with 1 or H elements (FP8 caches
        only; ignored for 16-bit caches).
    validate : also check slot range and scale values, at the cost of one synchronisation.
        None (the default) follows ``KVPOOL_VALIDATE``.

    Raises
    ------
    TypeError, ValueError, IndexError
        On malformed arguments, naming the argument, the expected and the actual value; nothing is
        written.

    Examples
    --------
    >>> k_cache = torch.zeros(16, 2, 8, dtype=torch.float8_e4m3fn)
    >>> v_cache = torch.zeros_like(k_cache)
    >>> k = torch.randn(3, 2, 8, dtype=torch.bfloat16)
    >>> reference_set_kv_buffer(k, k, k_cache, v_cache, torch.tensor([5, -1, 9]), k_scale=0.5)
    """
    checked = check_caller_write(k, v, k_cache, v_cache, cache_loc, k_scale, v_scale)
    check_caller_values(checked, cache_loc, k_cache.shape[0], validate)
    if checked.tokens == 0:
        return
    write_reference(k, v, k_cache, v_cache, cache_loc, checked.k_scale, checked.v_scale)
