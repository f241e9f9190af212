"""The NVFP4 write's one decision: the gate, then the fused kernel, the reference path, or the
gate's reason as an error (docs/contract.md, "NVFP4"; the gate and the modes are the FP4 write's).
The global scales are device tensors the kernel reads at run time, so no scale sends a write to the
reference path."""

from __future__ import annotations

import torch

from kvpool.config import FusedMode
from kvpool.kernels.fused_path import takes_fused_path
from kvpool.kernels.gate import Verdict
from kvpool.kernels.launch import TRITON_AVAILABLE
from kvpool.kernels.store_fp4.writer import launch_fp4_write
from kvpool.kernels.store_kv.writer import PathStats
from kvpool.kernels.store_nvfp4.naive import write_nvfp4_reference

if TRITON_AVAILABLE:
    from kvpool.kernels.store_nvfp4.kernel import store_nvfp4_kv
else:  # pragma: no cover - exercised only where triton is absent
    store_nvfp4_kv = None


#: Blocks a program of the NVFP4 write takes (1,024 input elements) and its warps: one block a
#: thread: the fastest prefill tile that keeps a decode step short.
NVFP4_TILE = (64, 2)


def write_nvfp4(
    cache_ok: Verdict,
    mode: FusedMode,
    stats: PathStats,
    k: torch.Tensor,
    v: torch.Tensor,
    k_store: tuple[torch.Tensor, torch.Tensor],
    v_store: tuple[torch.Tensor, torch.Tensor],
    loc: torch.Tensor,
    k_global_scale: torch.Tensor,
    v_global_scale: torch.Tensor,
) -> None:
    """The NVFP4 write on checked arguments, on the path the gate (``cache_ok``) and ``mode``
    choose, counted in ``stats``. Raises ``FusedPathUnavailable`` with the gate's reason under
    ``mode == "always"`` when the gate refuses, before anything is written."""
    if not takes_fused_path(cache_ok, mode, stats):
        write_nvfp4_reference(k, v, k_store, v_store, loc, k_global_scale, v_global_scale)
    elif k.shape[0]:
        # The NVFP4 kernel takes the FP4 kernel's arguments, with the global scales after the buffers.
        launch_fp4_write(k, v, k_store, v_store, loc, store_nvfp4_kv, (k_global_scale, v_global_scale), NVFP4_TILE)
