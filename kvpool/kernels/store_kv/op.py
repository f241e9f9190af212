"""The K/V write's entries besides the pools: the custom operators that compiled callers go through
(``torch.ops.kvpool.store_kv``, ``store_kv_observed``) and the public functions on caches the
caller owns (``fused_fp8_set_kv_buffer``, ``reference_set_kv_buffer``). Each is its checks and one
call of the caches' writer (``store_kv.writer_for``). Rules: docs/contract.md ("The write",
"Compiled callers and CUDA graphs").

Compiled model code sees one opaque op that declares the two caches it mutates, so
``torch.compile(fullgraph=True)`` traces through ``set_kv_buffer`` without a graph break and keeps
the write in place; at run time the op makes the same decision as an eager call. Eager pool writes
skip the dispatcher (it costs several microseconds of host time per call): a pool routes through the
op only while ``torch.compile`` is tracing.
"""

from __future__ import annotations

from typing import Optional

import torch

from kvpool.config import KernelOptions, validate_enabled
from kvpool.kernels.launch import Tile
from kvpool.kernels.store_kv.checks import check_cache_pair
from kvpool.kernels.store_kv.plan import AUTO
from kvpool.kernels.store_kv.layout import storage_view
from kvpool.kernels.store_kv.writer import writer_for
from kvpool.write_types import FUNCTION_NAMES, POOL_NAMES, Scale

# --- the custom operators ---------------------------------------------------------------------------


@torch.library.custom_op("kvpool::store_kv", mutates_args=("k_cache", "v_cache"))
def store_kv_custom_op(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
    k_scale: Optional[torch.Tensor],
    v_scale: Optional[torch.Tensor],
    k_scale_value: Optional[float],
    v_scale_value: Optional[float],
    fused: str,
) -> None:
    """Checked-by-the-caller write into caches given in their logical dtype (FP8 or 16/32-bit).

    The caches are the tensors the model reads (the pool's ``dtype`` views), not the uint8 storage:
    a compiled graph that mutated one and read the other would hold two inputs aliasing one
    storage with different dtypes, which AOTAutograd rejects. A scale is a tensor (``k_scale``), a
    float (``k_scale_value``) or neither; ``fused`` is the pool's mode.
    """
    writer_for(k_cache, v_cache, fused).write(
        storage_view(k_cache), storage_view(v_cache), loc, k, v,
        k_scale if k_scale is not None else k_scale_value, v_scale if v_scale is not None else v_scale_value,
        POOL_NAMES,
    )  # fmt: skip


@store_kv_custom_op.register_fake
def _store_kv_fake(k, v, k_cache, v_cache, loc, k_scale, v_scale, k_scale_value, v_scale_value, fused):
    return None


# The same write while the pool observes maxima (calibration): a second op, because mutated
# arguments must not be optional (torch's dispatcher drops trailing None arguments before bumping the
# version counters of the mutated ones).
@torch.library.custom_op("kvpool::store_kv_observed", mutates_args=("k_cache", "v_cache", "k_amax", "v_amax"))
def store_kv_observed_custom_op(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
    k_scale: Optional[torch.Tensor],
    v_scale: Optional[torch.Tensor],
    k_scale_value: Optional[float],
    v_scale_value: Optional[float],
    fused: str,
    k_amax: torch.Tensor,
    v_amax: torch.Tensor,
) -> None:
    """``store_kv`` that also folds the write's per-head max |k| and |v| into ``k_amax``/``v_amax``."""
    writer_for(k_cache, v_cache, fused).write(
        storage_view(k_cache), storage_view(v_cache), loc, k, v,
        k_scale if k_scale is not None else k_scale_value, v_scale if v_scale is not None else v_scale_value,
        POOL_NAMES, (k_amax, v_amax),
    )  # fmt: skip


@store_kv_observed_custom_op.register_fake
def _store_kv_observed_fake(k, v, k_cache, v_cache, loc, k_scale, v_scale, k_scale_value, v_scale_value, fused, k_amax, v_amax):
    return None


def store_kv_op(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
    k_scale: Scale,
    v_scale: Scale,
    fused: str = "auto",
    amax: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> None:
    """Call ``torch.ops.kvpool.store_kv`` (or ``store_kv_observed`` with ``amax``) for a checked write
    (caches in their logical dtype): what a pool's write traces to under ``torch.compile``."""
    args = (
        k, v, k_cache, v_cache, loc,
        k_scale if isinstance(k_scale, torch.Tensor) else None,
        v_scale if isinstance(v_scale, torch.Tensor) else None,
        None if isinstance(k_scale, torch.Tensor) else k_scale,
        None if isinstance(v_scale, torch.Tensor) else v_scale,
        fused,
    )  # fmt: skip
    if amax is None:
        torch.ops.kvpool.store_kv(*args)
    else:
        torch.ops.kvpool.store_kv_observed(*args, *amax)


# --- the public functions ----------------------------------------------------------------------------


def _validating(validate: Optional[bool]) -> bool:
    """A public function's ``validate``: None follows ``KVPOOL_VALIDATE`` (read on every call)."""
    return validate_enabled(False) if validate is None else bool(validate)


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
        float8_e4m3fnuz, float8_e5m2fnuz, bfloat16, float16 or float32, head_dim contiguous, not
        requiring grad.
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
    k_cache, v_cache = check_cache_pair(k_cache, v_cache)
    writer_for(k_cache, v_cache, "always", _validating(validate)).write(
        storage_view(k_cache), storage_view(v_cache), cache_loc, k, v, k_scale, v_scale, FUNCTION_NAMES
    )


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
        float8_e4m3fnuz, float8_e5m2fnuz, bfloat16, float16 or float32, not requiring grad.
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
    k_cache, v_cache = check_cache_pair(k_cache, v_cache)
    writer_for(k_cache, v_cache, "never", _validating(validate)).write(
        storage_view(k_cache), storage_view(v_cache), cache_loc, k, v, k_scale, v_scale, FUNCTION_NAMES
    )


def launch_store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
    k_scale: Scale = None,
    v_scale: Scale = None,
    *,
    options: Optional[KernelOptions] = None,
    tile: Optional[Tile] = None,
    flat: bool = True,
    joined: bool = False,
    layout: str = AUTO,
) -> None:
    """The fused write with chosen launch settings, for tests and benchmarks: ``options`` picks the
    division and the encoder (default: from the environment), ``tile`` and ``layout`` override the
    plan (``plan.plan_write``), ``flat=False`` keeps row plans out, ``joined=True`` writes K
    and V from one program where each is one block. Checked as ``fused_fp8_set_kv_buffer`` is
    (``fused="always"``)."""
    k_cache, v_cache = check_cache_pair(k_cache, v_cache)
    writer = writer_for(
        k_cache, v_cache, "always", options=options, tile=tile, layout=layout, row_plans=flat, joined=joined
    )
    writer.write(storage_view(k_cache), storage_view(v_cache), loc, k, v, k_scale, v_scale, FUNCTION_NAMES)
