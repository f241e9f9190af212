"""The K/V write as a PyTorch custom operator, ``torch.ops.kvpool.store_kv`` (docs/contract.md,
"Compiled callers and CUDA graphs").

Compiled model code sees one opaque op that declares the two caches it mutates, so
``torch.compile(fullgraph=True)`` traces through ``set_kv_buffer`` without a graph break, keeps the
write in place (no copy of the cache), and at run time the op launches the fused Triton kernel on
CUDA or runs the reference path elsewhere. Eager calls skip the dispatcher: ``set_kv_buffer`` only
routes through the op while ``torch.compile`` is tracing, because the dispatcher costs several
microseconds of host time per call and eager decode is launch-bound.
"""

from __future__ import annotations

from typing import Optional

import torch

from kvpool.kernels.checks import Scale, write_key
from kvpool.kernels.store_kv import storage_view
from kvpool.kernels.write import writer_for


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
    storage with different dtypes, which AOTAutograd rejects.

    A scale is either a tensor (``k_scale``) or a float (``k_scale_value``) or neither.
    ``fused`` is the pool's mode: ``auto``, ``always`` or ``never``. The decision and the write are
    the writer's, as for every other path.
    """
    _write(k, v, k_cache, v_cache, loc, k_scale, v_scale, k_scale_value, v_scale_value, fused, None)


@store_kv_custom_op.register_fake
def _store_kv_fake(k, v, k_cache, v_cache, loc, k_scale, v_scale, k_scale_value, v_scale_value, fused):
    return None


# The same write while the pool observes maxima (calibration): a second op, because mutated
# arguments must not be optional (torch 2.11's dispatcher drops trailing None arguments before
# bumping the version counters of the mutated ones).
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
    _write(k, v, k_cache, v_cache, loc, k_scale, v_scale, k_scale_value, v_scale_value, fused, (k_amax, v_amax))


@store_kv_observed_custom_op.register_fake
def _store_kv_observed_fake(k, v, k_cache, v_cache, loc, k_scale, v_scale, k_scale_value, v_scale_value, fused, k_amax, v_amax):
    return None


def _write(k, v, k_cache, v_cache, loc, k_scale, v_scale, k_scale_value, v_scale_value, fused, amax) -> None:
    ks: Scale = k_scale if k_scale is not None else k_scale_value
    vs: Scale = v_scale if v_scale is not None else v_scale_value
    writer_for(k_cache, v_cache, fused).write(
        write_key(k, v, loc, ks, vs), k, v, storage_view(k_cache), storage_view(v_cache), loc, ks, vs, None, amax
    )


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
    (caches in their logical dtype)."""
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
