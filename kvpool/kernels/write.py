"""The one place a K/V write is decided: checked inputs -> gate -> fused launch / reference / raise.

Every write path reaches the writer: the pools' eager writes call :meth:`KVWriter.store`, which
classifies raw arguments (no dispatcher on the hot path); the verify write, the custom operator's
implementation (for compiled callers) and the public functions :func:`fused_fp8_set_kv_buffer` and
:func:`reference_set_kv_buffer` (docs, one check, one call) call :meth:`KVWriter.write` with checked
arguments. Both end in the same decision and launch. A write is classified once, by
:meth:`KVWriter.store` or the argument checks, into a key in the kernel's own constants
(``checks.WriteKey``); that key indexes the verdict memo here and the launch cache of the launcher.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from kvpool.config import KernelOptions, validate_enabled
from kvpool.errors import FusedPathUnavailable
from kvpool.kernels import store_kv
from kvpool.kernels.checks import (
    F32_MAX,
    F32_MIN_NORMAL,
    FUNCTION_NAMES,
    ArgNames,
    Geometry,
    Scale,
    check_caller_write,
    check_values,
    check_write,
)
from kvpool.kernels.formats import SCALE_NONE, SCALE_TENSOR, SCALE_VALUE, is_fp8
from kvpool.kernels.gate import Verdict, cache_verdict, input_verdict
from kvpool.kernels.reference import write_reference

logger = logging.getLogger("kvpool")

_F32 = torch.float32


@dataclass
class PathStats:
    """How many eager writes took each path, and why the fallbacks happened.

    Calls made from ``torch.compile``d code are not counted (counting would put Python side effects
    into the compiled graph).
    """

    fused_calls: int = 0
    reference_calls: int = 0
    reasons: dict[str, int] = field(default_factory=dict)  # reason -> reference calls


class KVWriter:
    """Writes K/V rows into caches of one geometry, deciding each write once per kind of input.

    Parameters
    ----------
    geometry : the caches' element type, heads, head dims and device.
    k_strides, v_strides : the caches' strides (one layer's buffers; every layer of a pool shares them).
    capacity : rows per cache.
    mode : ``"auto"`` (fused when eligible, else reference), ``"always"`` (raise
        ``FusedPathUnavailable`` instead of falling back; also runs the kernel on CPU tensors under
        ``TRITON_INTERPRET=1``), ``"never"`` (reference only).
    options : the launcher's debug switches (default: from the environment).
    caches_aligned : the caches are fresh allocations (a pool's), so their 16-byte alignment needs
        no check per call.
    validate : :meth:`store` also checks slot range and scale values (one synchronisation).

    Caches laid out as the two column parts of one row buffer (``parts_of_one_row``: an MLA pool's
    latent and rotary views) take the launcher's joined plan, in which one program writes both
    parts of its tokens' rows.
    """

    def __init__(
        self,
        geometry: Geometry,
        k_strides: tuple[int, ...],
        v_strides: tuple[int, ...],
        capacity: int,
        mode: str,
        *,
        options: Optional[KernelOptions] = None,
        caches_aligned: bool = False,
        validate: bool = False,
    ) -> None:
        g = self.geometry = geometry
        self.mode = mode
        self.capacity = capacity
        self.scales_apply = is_fp8(g.cache_dtype)
        self.stats = PathStats()
        self.cache_ok, self.cache_reason = cache_verdict(
            g.device, g.cache_dtype, g.head_dim, g.v_head_dim, k_strides[2], v_strides[2],
            triton_available=store_kv.TRITON_AVAILABLE, interpreter=store_kv.INTERPRETER and mode == "always",
        )  # fmt: skip
        self.launch: Optional[store_kv.PreparedLaunch] = None
        if self.cache_ok and mode != "never":
            self.launch = store_kv.PreparedLaunch(
                g.heads, g.head_dim, g.v_heads, g.v_head_dim, g.cache_dtype, tuple(k_strides), tuple(v_strides),
                capacity, g.device, options=options, caches_aligned=caches_aligned,
                joined=parts_of_one_row(g, k_strides, v_strides),
            )  # fmt: skip
        self._decisions: dict[tuple, _Decision] = {}
        self.validate = validate

    # --- the decision ----------------------------------------------------------------------------

    def decide(self, key: tuple) -> "_Decision":
        """The decision for writes of this key: the mode, the caches' fixed verdict, then the
        per-call part of the gate; made once per key. Only checked keys reach here, so a key found
        in the memo also certifies its dtypes and scale kinds."""
        decision = self._decisions.get(key)
        if decision is None:
            if self.mode == "never":
                ok, reason = False, "fused='never'"
            elif not self.cache_ok:
                ok, reason = False, self.cache_reason
            else:
                ok, reason = input_verdict(key)
            decision = self._decisions[key] = _Decision(ok, reason)
        return decision

    def verdict(self, key: tuple) -> Verdict:
        """(fused?, reason) for a write of this key."""
        d = self.decide(key)
        return d.fused, d.reason

    # --- the write -------------------------------------------------------------------------------

    def store(
        self,
        k_store: torch.Tensor,
        v_store: torch.Tensor,
        loc: object,
        k: object,
        v: object,
        k_scale: object,
        v_scale: object,
        names: ArgNames,
        amax: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    ) -> None:
        """Check, classify and perform one write given raw arguments (the pool's eager path).

        The common case (plain tensors of this geometry on the device; scales None, a float in
        range, or a one-element float32 tensor on the device; a key decided before, hence checked
        before) is recognised with a few comparisons; anything else goes through the full checks,
        which raise on bad input before anything is written. ``validate`` adds the checks that read
        device memory. ``amax`` as for :meth:`write`."""
        g = self.geometry
        decision = None
        if type(loc) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor:
            loc_shape = loc.shape
            dev = g.device
            if (
                len(loc_shape) == 1
                and k.shape == (loc_shape[0], g.heads, g.head_dim)
                and v.shape == (loc_shape[0], g.v_heads, g.v_head_dim)
                and k.device == dev
                and v.device == dev
                and loc.device == dev
            ):
                if self.scales_apply:
                    ka = _fast_scale_kind(k_scale, dev)
                    va = _fast_scale_kind(v_scale, dev)
                    if ka >= 0 and va >= 0:
                        key = (
                            k.dtype, v.dtype, loc.dtype, ka, va,
                            _F32 if ka == SCALE_TENSOR else None, _F32 if va == SCALE_TENSOR else None, None,
                        )  # fmt: skip
                        decision = self._decisions.get(key)
                else:
                    key = (k.dtype, v.dtype, loc.dtype, SCALE_NONE, SCALE_NONE, None, None, None)
                    k_scale = v_scale = None
                    decision = self._decisions.get(key)
        if decision is None:
            key, k_scale, v_scale = check_write(g, k, v, loc, k_scale, v_scale, names)
            decision = self.decide(key)
        if self.validate:
            check_values(loc, names.loc, self.capacity, k_scale, v_scale)  # type: ignore[arg-type]
        self._perform(decision, key, k, v, k_store, v_store, loc, k_scale, v_scale, None, amax)  # type: ignore

    def write(
        self,
        key: tuple,
        k: torch.Tensor,
        v: torch.Tensor,
        k_store: torch.Tensor,
        v_store: torch.Tensor,
        loc: torch.Tensor,
        k_scale: Scale,
        v_scale: Scale,
        commit_lens: Optional[torch.Tensor] = None,
        amax: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    ) -> None:
        """Perform one write whose arguments are checked and classified (``key``): the fused kernel
        when the decision allows, else the reference path, or ``FusedPathUnavailable`` in
        ``"always"`` mode; counted in ``stats``.

        ``k_store``/``v_store`` are the caches in storage dtype (uint8 for FP8). ``commit_lens``
        comes with a prefix key ([bs, width] ``loc``); ``amax`` = (K maxima [H], V maxima [Hv]) makes
        the write also fold its per-head max |x| into them (calibration)."""
        self._perform(self.decide(key), key, k, v, k_store, v_store, loc, k_scale, v_scale, commit_lens, amax)

    def _perform(self, decision, key, k, v, k_store, v_store, loc, k_scale, v_scale, commit_lens, amax) -> None:
        if k.shape[0] == 0:
            return
        if decision.fused:
            self.stats.fused_calls += 1
            self.launch(key, k, v, k_store, v_store, loc, k_scale, v_scale, commit_lens, amax)  # type: ignore[misc]
            return
        reason = decision.reason
        if self.mode == "always":
            raise FusedPathUnavailable(f"fused='always' but {reason}")
        stats = self.stats
        stats.reference_calls += 1
        seen = stats.reasons.get(reason)
        if seen is None:
            logger.info("kvpool: a write takes the reference path: %s", reason)
            stats.reasons[reason] = 1
        else:
            stats.reasons[reason] = seen + 1
        write_reference(k, v, k_store, v_store, loc, k_scale, v_scale, self.geometry.cache_dtype, commit_lens, amax)


class _Decision:
    """What the writer decided for one key."""

    __slots__ = ("fused", "reason")

    def __init__(self, fused: bool, reason: str) -> None:
        self.fused = fused
        self.reason = reason


def _fast_scale_kind(scale: object, device: torch.device) -> int:
    """The kind of None, a float that is a valid scale, or a one-element float32 tensor on
    ``device``; -1 for anything else (left to the full checks)."""
    if scale is None:
        return SCALE_NONE
    if type(scale) is float:
        return SCALE_VALUE if F32_MIN_NORMAL <= scale <= F32_MAX else -1
    if type(scale) is torch.Tensor and scale.dtype is _F32 and scale.numel() == 1 and scale.device == device:
        return SCALE_TENSOR
    return -1


@functools.lru_cache(maxsize=64)
def _writer(geometry: Geometry, k_strides: tuple, v_strides: tuple, capacity: int, mode: str) -> KVWriter:
    return KVWriter(geometry, k_strides, v_strides, capacity, mode)


def parts_of_one_row(geometry: Geometry, k_strides: Sequence[int], v_strides: Sequence[int]) -> bool:
    """Whether K and V caches with these strides are laid out as the two column parts of one row
    buffer, as an MLA pool's latent and rotary views are: one head each, and a row stride of the
    whole row. Writes into such caches take the joined plan (one program writes both parts of its
    tokens' rows): the MLA pool's eager writes, and the custom operator its compiled callers go
    through, which is given the same two views, so both run the same compiled variants."""
    g = geometry
    row = g.head_dim + g.v_head_dim
    return g.heads == g.v_heads == 1 and k_strides[0] == v_strides[0] == row


def writer_for(k_cache: torch.Tensor, v_cache: torch.Tensor, mode: str) -> KVWriter:
    """The writer for caller-owned caches (given in their logical dtype), one per cache geometry and
    mode. Its launcher keys compiled variants on the caches' alignment, since these caches are not
    a pool's own allocations; caches laid out as the two parts of one row take the joined plan
    (``parts_of_one_row``)."""
    g = Geometry(k_cache.dtype, k_cache.shape[1], k_cache.shape[2], v_cache.shape[1], v_cache.shape[2], k_cache.device)
    return _writer(g, tuple(k_cache.stride()), tuple(v_cache.stride()), k_cache.shape[0], mode)


def _caller_write(mode: str, k, v, k_cache, v_cache, cache_loc, k_scale, v_scale, validate) -> None:
    k_cache, v_cache, checked = check_caller_write(k, v, k_cache, v_cache, cache_loc, k_scale, v_scale)
    if validate_enabled(False) if validate is None else validate:
        check_values(cache_loc, FUNCTION_NAMES.loc, k_cache.shape[0], checked.k_scale, checked.v_scale)
    writer_for(k_cache, v_cache, mode).write(
        checked.key, k, v, store_kv.storage_view(k_cache), store_kv.storage_view(v_cache), cache_loc,
        checked.k_scale, checked.v_scale,
    )  # fmt: skip


def fused_fp8_set_kv_buffer(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_loc: torch.Tensor,
    k_scale: Scale = None,
    v_scale: Scale = None,
    *,
    validate: Optional[bool] = None,
) -> None:
    """Write K/V rows into caller-owned caches with the fused Triton kernel, in one launch.

    ``cache[cache_loc[t]] = q(x[t], scale)`` for K and V, where for FP8 caches q divides by the scale
    in correctly rounded float32, saturates to the format's finite range and rounds to nearest even
    (NaN is stored as the format's canonical NaN); for 16-bit/fp32 caches q is the plain cast and
    scales are ignored. Bit-identical to :func:`reference_set_kv_buffer`. No allocation, no
    synchronisation, CUDA-graph safe (a tensor scale is read on the device when the kernel runs).

    Parameters
    ----------
    k, v : Tensor [T, H, D] and [T, Hv, Dv], bfloat16/float16/float32, any strides (slices of a
        fused QKV projection need no copy). Never modified.
    k_cache, v_cache : Tensor [slots, H, D] and [slots, Hv, Dv], float8_e4m3fn, float8_e5m2,
        bfloat16, float16 or float32, head_dim contiguous, not requiring grad.
    cache_loc : Tensor [T], int32 or int64. Negative entries write nothing; entries >= slots are
        never written (``validate=True`` raises IndexError for them instead).
    k_scale, v_scale : None, a positive float, or a float32 tensor with 1 (per tensor) or H (per
        head, shape [H] or [H, 1]) elements.
    validate : also check slot range and scale values, at the cost of one synchronisation.
        None (the default) follows ``KVPOOL_VALIDATE``.

    Raises
    ------
    TypeError, ValueError, IndexError
        Malformed arguments (naming the argument, expected and actual value); nothing is written.
    FusedPathUnavailable
        The kernel cannot take this write (no CUDA device, unsupported scale dtype, ...); the message
        gives the gate's reason. :func:`reference_set_kv_buffer` takes every write.

    Examples
    --------
    >>> k_cache = torch.zeros(4096, 8, 128, dtype=torch.float8_e4m3fn, device="cuda")
    >>> v_cache = torch.zeros_like(k_cache)
    >>> qkv = torch.randn(7, 48, 128, dtype=torch.bfloat16, device="cuda")
    >>> k, v = qkv[:, 32:40], qkv[:, 40:48]            # strided views, no copy
    >>> loc = torch.tensor([3, 4, 5, -1, 9, 10, 11], device="cuda")
    >>> fused_fp8_set_kv_buffer(k, v, k_cache, v_cache, loc, k_scale=0.05, v_scale=0.05)
    """
    _caller_write("always", k, v, k_cache, v_cache, cache_loc, k_scale, v_scale, validate)


def reference_set_kv_buffer(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_loc: torch.Tensor,
    k_scale: Scale = None,
    v_scale: Scale = None,
    *,
    validate: Optional[bool] = None,
) -> None:
    """Write K/V rows into caller-owned caches with plain PyTorch (the definition of the write).

    Same signature and semantics as :func:`fused_fp8_set_kv_buffer`; runs on any device.

    Parameters
    ----------
    k, v : Tensor [T, H, D] and [T, Hv, Dv], bfloat16/float16/float32, any strides. Never modified.
    k_cache, v_cache : Tensor [slots, H, D] and [slots, Hv, Dv], float8_e4m3fn, float8_e5m2,
        bfloat16, float16 or float32, not requiring grad.
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
    _caller_write("never", k, v, k_cache, v_cache, cache_loc, k_scale, v_scale, validate)
