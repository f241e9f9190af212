"""The K/V write's argument checks, for every entry (docs/contract.md, "Bad input").

:func:`check_write` reads tensor metadata only (no synchronisation, traceable by torch.compile) and
classifies a checked write into its key (``WriteKey``); :func:`check_values` and
:func:`check_prefix_values` read device memory (slot range, scale values, commit lengths) and run
only in ``validate`` mode. Index tensors are checked by ``kvpool.checks``.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple, Optional

import torch

from kvpool.checks import check_in_range, check_index
from kvpool.kernels.formats import (
    CACHE_DTYPES,
    INPUT_DTYPES,
    LOC_DTYPES,
    SCALE_HEAD,
    SCALE_NONE,
    SCALE_TENSOR,
    SCALE_VALUE,
    is_fp8,
)
from kvpool.write_types import F32_MAX, F32_MIN_NORMAL, ArgNames, Geometry, Scale

def _device_str(t: torch.Tensor) -> str:
    return str(t.device)


def check_rows(t: object, name: str, heads: int, dim: int, device: torch.device) -> torch.Tensor:
    """``t`` must be a [T, heads, dim] floating tensor on ``device``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 3:
        raise ValueError(f"{name} must be 3-D [T, {heads}, {dim}], got shape {tuple(t.shape)}")
    _, h, d = t.shape
    if h != heads:
        raise ValueError(f"{name} must have {heads} heads (shape[1]), got {h} (shape {tuple(t.shape)})")
    if d != dim:
        raise ValueError(f"{name} must have head dim {dim} (shape[2]), got {d} (shape {tuple(t.shape)})")
    if t.dtype not in INPUT_DTYPES:
        raise ValueError(f"{name} must be bfloat16, float16 or float32, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {_device_str(t)}")
    return t


def check_loc(loc: object, name: str, tokens: int, device: torch.device) -> torch.Tensor:
    """A plain write's slots: [T] int32/int64 on ``device``."""
    loc = check_index(loc, name, dims="[T]", dtypes=LOC_DTYPES)
    if loc.shape[0] != tokens:
        raise ValueError(f"{name} must have T={tokens} entries (one per token), got {loc.shape[0]}")
    if loc.device != device:
        raise ValueError(f"{name} must be on {device}, got {_device_str(loc)}")
    return loc


def check_scale(scale: object, name: str, heads: int, device: torch.device) -> Scale:
    """Return the scale in canonical form: None, a Python float, or a tensor on ``device`` with one
    element (per tensor) or ``heads`` elements (per head, shape [H] or [H, 1])."""
    if scale is None:
        return None
    if isinstance(scale, torch.Tensor):
        if not scale.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point tensor, got {scale.dtype}")
        if scale.device != device:
            raise ValueError(f"{name} must be on {device}, got {_device_str(scale)}")
        shape = tuple(scale.shape)
        if scale.numel() != 1 and shape not in ((heads,), (heads, 1)):
            raise ValueError(
                f"{name} must have one element (per tensor) or shape [{heads}] or [{heads}, 1] "
                f"(per head), got shape {shape}"
            )
        return scale
    if type(scale) is not float:
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            raise TypeError(
                f"{name} must be None, a positive float or a floating-point tensor, "
                f"got {type(scale).__name__}"
            )
        scale = float(scale)
    if not (F32_MIN_NORMAL <= scale <= F32_MAX):
        raise ValueError(
            f"{name} must be a positive finite float that is a normal float32 "
            f"(2**-126 <= scale <= 3.4028234663852886e38), got {scale!r}"
        )
    return scale


def check_cache(cache: object, name: str) -> torch.Tensor:
    """A caller-owned cache for the public write functions: [slots, H, D] of a cache dtype."""
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cache).__name__}")
    if cache.dim() != 3:
        raise ValueError(f"{name} must be 3-D [slots, H, D], got shape {tuple(cache.shape)}")
    if cache.dtype not in CACHE_DTYPES:
        hint = " (pass the FP8 view, not its uint8 storage)" if cache.dtype == torch.uint8 else ""
        expected = ", ".join(str(d).replace("torch.", "") for d in CACHE_DTYPES)
        raise ValueError(f"{name} must be one of {expected}, got {cache.dtype}{hint}")
    if cache.requires_grad:
        # The fused path writes through the data pointer and the reference path writes in place;
        # neither may touch a tensor autograd tracks, so both refuse it here, identically.
        raise ValueError(f"{name} must not require grad (a cache is written in place), got requires_grad=True")
    return cache


def check_cache_pair(k_cache: object, v_cache: object) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V caches a public write function was handed, checked as a pair.

    Parameters
    ----------
    k_cache : Tensor [slots, H, D] of a cache dtype (FP8 as its float8 view), not requiring grad.
    v_cache : Tensor [slots, Hv, Dv], ``k_cache``'s dtype, slot count and device.

    Returns
    -------
    (k_cache, v_cache), the arguments themselves.

    Raises
    ------
    TypeError
        If either is not a tensor.
    ValueError
        If either is not 3-D, not of a cache dtype or requires grad, or ``v_cache`` differs from
        ``k_cache`` in dtype, slots or device.
    """
    k_cache = check_cache(k_cache, "k_cache")
    v_cache = check_cache(v_cache, "v_cache")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache must have k_cache's dtype {k_cache.dtype}, got {v_cache.dtype}")
    if v_cache.shape[0] != k_cache.shape[0]:
        raise ValueError(
            f"v_cache must have k_cache's {k_cache.shape[0]} slots (shape[0]), got {v_cache.shape[0]}"
        )
    if v_cache.device != k_cache.device:
        raise ValueError(f"v_cache must be on k_cache's device {k_cache.device}, got {v_cache.device}")
    return k_cache, v_cache


class WriteKey(NamedTuple):
    """A checked write's inputs classified into the kernel's constants: the one key the verdict memo,
    the gate's per-call part and the launch cache all use. Hot paths build the same tuple directly
    (a plain tuple with these fields in this order compares and hashes equal)."""

    k_dtype: torch.dtype
    v_dtype: torch.dtype
    loc_dtype: torch.dtype
    k_scale_kind: int  # SCALE_NONE / SCALE_VALUE / SCALE_TENSOR / SCALE_HEAD
    v_scale_kind: int
    k_scale_dtype: Optional[torch.dtype]  # tensor scales only, else None
    v_scale_dtype: Optional[torch.dtype]
    # The verify write (loc [bs, width] with commit_lens): commit_lens's dtype; None for a plain write.
    # A dtype rather than a flag: the compiled kernel reads commit_lens as that type.
    commit_dtype: Optional[torch.dtype]


#: ``check_write``'s ``commit_lens`` when the write is a plain one ([T] ``loc``, no commit lengths).
PLAIN_WRITE = object()


class CheckedWrite(NamedTuple):
    """A write that passed :func:`check_write`: its ``key`` (a :class:`WriteKey`) and its scales as
    checked (None where the cache takes no scale: a 16-bit or fp32 cache)."""

    key: tuple  # a WriteKey
    k_scale: Scale
    v_scale: Scale


def scale_kind(scale: Scale) -> tuple[int, Optional[torch.dtype]]:
    """(kind, tensor dtype) of a checked scale."""
    if scale is None:
        return SCALE_NONE, None
    if isinstance(scale, torch.Tensor):
        return (SCALE_TENSOR if scale.numel() == 1 else SCALE_HEAD), scale.dtype
    return SCALE_VALUE, None


def write_key(
    k: torch.Tensor,
    v: torch.Tensor,
    loc: torch.Tensor,
    k_scale: Scale,
    v_scale: Scale,
    commit_lens: Optional[torch.Tensor] = None,
) -> WriteKey:
    """The key of a write whose arguments are already checked and canonical."""
    (ka, kd), (va, vd) = scale_kind(k_scale), scale_kind(v_scale)
    return WriteKey(k.dtype, v.dtype, loc.dtype, ka, va, kd, vd, None if commit_lens is None else commit_lens.dtype)


def check_write(
    g: Geometry,
    k: object,
    v: object,
    loc: object,
    k_scale: object,
    v_scale: object,
    names: ArgNames,
    commit_lens: object = PLAIN_WRITE,
) -> CheckedWrite:
    """All metadata checks of one write; raises before anything is written. With ``commit_lens``
    the write is a prefix-valid one: ``loc`` is [bs, width] and T = bs * width. (The default is a
    marker, not None, so that a verify write passed ``commit_lens=None`` is told so, rather than
    checked as a plain write whose ``loc`` is not 1-D.)"""
    k = check_rows(k, names.k, g.heads, g.head_dim, g.device)
    v = check_rows(v, names.v, g.v_heads, g.v_head_dim, g.device)
    tokens = k.shape[0]
    if v.shape[0] != tokens:
        raise ValueError(f"{names.v} must have T={tokens} tokens like {names.k}, got {v.shape[0]}")
    if commit_lens is PLAIN_WRITE:
        check_loc(loc, names.loc, tokens, g.device)
    else:
        check_loc_2d(loc, names.loc, tokens, g.device)
        check_commit_lens(commit_lens, loc.shape[0], g.device, names.loc)  # type: ignore[union-attr]
    if is_fp8(g.cache_dtype):
        k_scale = check_scale(k_scale, names.k_scale, g.heads, g.device)
        v_scale = check_scale(v_scale, names.v_scale, g.v_heads, g.device)
    else:
        # A 16-bit or fp32 cache stores inputs as they are; a checkpoint's KV scales do not apply.
        k_scale = v_scale = None
    commit = None if commit_lens is PLAIN_WRITE else commit_lens
    return CheckedWrite(write_key(k, v, loc, k_scale, v_scale, commit), k_scale, v_scale)  # type: ignore[arg-type]


def check_loc_2d(loc: object, name: str, tokens: int, device: torch.device) -> torch.Tensor:
    """A prefix-valid write's slots: [bs, width] int32/int64 with bs * width == T."""
    loc = check_index(loc, name, ndim=2, dims="[bs, width]", dtypes=LOC_DTYPES)
    if loc.shape[0] * loc.shape[1] != tokens:
        raise ValueError(
            f"{name} must have bs * width = T = {tokens} entries (one per token), "
            f"got shape {tuple(loc.shape)}"
        )
    if loc.device != device:
        raise ValueError(f"{name} must be on {device}, got {_device_str(loc)}")
    return loc


def check_commit_lens(commit_lens: object, bs: int, device: torch.device, loc_name: str = "loc_2d") -> torch.Tensor:
    """How many leading tokens of each row to write: [bs] int32/int64 on the device."""
    dims = f"[bs] with bs = {bs} (one per row of {loc_name})"
    commit_lens = check_index(commit_lens, "commit_lens", dims=dims, dtypes=LOC_DTYPES)
    if commit_lens.shape[0] != bs:
        raise ValueError(f"commit_lens must be 1-D {dims}, got shape {tuple(commit_lens.shape)}")
    if commit_lens.device != device:
        raise ValueError(f"commit_lens must be on {device}, got {_device_str(commit_lens)}")
    return commit_lens


# --- checks that read device memory (validate mode only) -------------------------------------------


def check_values(loc: torch.Tensor, loc_name: str, capacity: int, k_scale: Scale, v_scale: Scale) -> None:
    """Everything ``validate`` adds to a plain write: slot range and scale values (synchronises)."""
    check_in_range([(loc, capacity, loc_name)], what="slots")
    check_scale_values(k_scale, "k_scale")
    check_scale_values(v_scale, "v_scale")


def check_prefix_values(
    loc_2d: torch.Tensor, commit_lens: torch.Tensor, capacity: int, k_scale: Scale, v_scale: Scale
) -> None:
    """Everything ``validate`` adds to a verify write: every commit length in 0..width, every
    committed slot below ``capacity``, and the scale values (synchronises)."""
    width = loc_2d.shape[1]
    lens = commit_lens.to(torch.int64)
    bad = (lens < 0) | (lens > width)
    if bool(bad.any()):
        pos = int(torch.argmax(bad.to(torch.uint8)))
        raise ValueError(f"commit_lens[{pos}] must be in 0..{width} (the width of loc_2d), got {int(lens[pos])}")
    committed = torch.arange(width, device=loc_2d.device)[None, :] < lens[:, None]
    check_in_range([(torch.where(committed, loc_2d.to(torch.int64), -1), capacity, "loc_2d")], what="slots")
    check_scale_values(k_scale, "k_scale")
    check_scale_values(v_scale, "v_scale")


def check_scale_values(scale: Scale, name: str) -> None:
    """A scale tensor's values must be positive, finite and normal in float32, as a float scale
    must be (one synchronisation)."""
    if not isinstance(scale, torch.Tensor):
        return
    values = scale.detach().reshape(-1).to(torch.float32)
    ok = (values >= F32_MIN_NORMAL) & torch.isfinite(values)
    if not bool(ok.all()):
        pos = int(torch.argmin(ok.to(torch.uint8)))
        raise ValueError(
            f"{name} must hold positive finite normal float32 values, got {float(values[pos])!r} at index {pos}"
        )

