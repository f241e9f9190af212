"""The K/V write in plain PyTorch: any device, and the definition of the write (docs/contract.md,
"The write"); the fused kernel matches it bit for bit.

``quantize`` is the per-element function q(x, s); ``scatter_rows`` writes rows to slots while skipping
negative and out-of-range slots without reading ``loc`` on the host (no synchronisation);
``write_reference`` is the whole write on checked arguments, as the writer's reference path runs it.
The public function of the same signature as the fused one is in ``op.py``.
"""

from __future__ import annotations

from typing import Optional

import torch

from kvpool.kernels.formats import FP8_FORMATS, NAN_BITS, bits_dtype, is_fp8
from kvpool.write_types import Scale


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
    """q(x, s): the values a write stores, as a new tensor of ``dtype``.

    For FP8: float32 division by the scale (IEEE, correctly rounded), saturation to the format's
    largest finite value (infinities too), round to nearest even. The explicit clamp makes the
    result independent of the torch version (torch <= 2.11 turns overflow into NaN).
    For 16-bit and fp32 caches: the plain cast; the scale is not used.
    NaN: whenever the element type changes, a NaN is stored as ``formats.NAN_BITS[dtype]`` (the
    format's positive all-ones NaN), whatever its sign and payload; an input that already has the
    cache's type is copied bit for bit.

    Parameters
    ----------
    x : Tensor [T, H, D], bfloat16, float16 or float32. Never modified.
    dtype : the cache element type.
    scale : None, a float, or a tensor with 1 or H elements (FP8 only).
    """
    x = x.detach()
    if x.dtype == dtype:
        return x.clone()
    y = x.to(torch.float32)
    if is_fp8(dtype):
        s = _scale_tensor(scale, x.shape[1], x.device)
        if s is not None:
            y = y / s  # out of place: inputs are never modified (SGLang's fallback divides in place)
        fmax = FP8_FORMATS[dtype].max_finite
        q = y.clamp(-fmax, fmax).to(dtype)
    else:
        q = y.to(dtype)
    bits = torch.where(torch.isnan(y), NAN_BITS[dtype], q.view(bits_dtype(dtype)))
    return bits.view(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    # Rows move as integers of the same width: FP8 has no where/index_put_ on every device and torch
    # version, and integer copies keep NaN payloads exactly.
    return t.view(bits_dtype(t.dtype))


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


def prefix_slots(loc_2d: torch.Tensor, commit_lens: torch.Tensor) -> torch.Tensor:
    """A verify write's slots as a plain write's: ``loc_2d[i, j]`` where ``j < commit_lens[i]``, else
    -1 (write nothing), flattened to [bs * width]. No synchronisation."""
    col = torch.arange(loc_2d.shape[1], device=loc_2d.device)
    committed = col[None, :] < commit_lens.to(torch.int64)[:, None]
    return torch.where(committed, loc_2d.to(torch.int64), -1).reshape(-1)


def observe_amax(x: torch.Tensor, loc: torch.Tensor, capacity: int, amax: torch.Tensor) -> None:
    """Fold the largest finite |x| per head over the tokens a write stores (slot in range) into
    ``amax`` [H] (float32, in place). NaN and +-inf are left out."""
    slots = loc.to(torch.int64)
    written = ((slots >= 0) & (slots < capacity))[:, None, None]
    mag = x.detach().to(torch.float32).abs()
    head_max = torch.where(written & torch.isfinite(mag), mag, 0.0).amax(dim=(0, 2))
    torch.maximum(amax, head_max, out=amax)


def write_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    loc: torch.Tensor,
    k_scale: Scale,
    v_scale: Scale,
    cache_dtype: torch.dtype,
    commit_lens: Optional[torch.Tensor] = None,
    amax: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> None:
    """The reference write on checked arguments: caches in their storage dtype (uint8 for FP8),
    ``cache_dtype`` the logical one; ``commit_lens`` with a [bs, width] ``loc`` (verify write);
    ``amax`` = (K maxima [H], V maxima [Hv]) to fold the write's |x| into."""
    if k.shape[0] == 0:
        return
    if commit_lens is not None:
        loc = prefix_slots(loc, commit_lens)
    if amax is not None:
        observe_amax(k, loc, k_store.shape[0], amax[0])
        observe_amax(v, loc, v_store.shape[0], amax[1])
    scatter_rows(k_store, loc, _bits(quantize(k, cache_dtype, k_scale)))
    scatter_rows(v_store, loc, _bits(quantize(v, cache_dtype, v_scale)))
