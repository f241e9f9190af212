"""The per-token-head FP8 write's one decision: the gate, then the fused kernel, the reference path,
or the gate's reason as an error (docs/contract.md, "Per-token-head FP8"; the modes are the FP8
write's)."""

from __future__ import annotations

from typing import Optional

import torch

from kvpool.config import FusedMode
from kvpool.kernels.fused_path import buffers_verdict, takes_fused_path
from kvpool.kernels.gate import Verdict
from kvpool.kernels.launch import TRITON_AVAILABLE, next_pow2
from kvpool.kernels.store_fp8_token.naive import write_token_head_reference
from kvpool.kernels.store_kv.layout import native_cast_ok
from kvpool.kernels.store_kv.writer import PathStats

if TRITON_AVAILABLE:
    from kvpool.kernels.store_fp8_token.kernel import store_fp8_token_kv
else:  # pragma: no cover - exercised only where triton is absent
    store_fp8_token_kv = None

#: Warps of a program, by the elements of its [next_pow2(H), next_pow2(D)] tile: about 256 elements
#: a warp, 1 to 16 warps (a starting point, not measured on hardware).
ELEMS_PER_WARP = 256
MAX_WARPS = 16


def token_head_cache_verdict(
    device: torch.device, dtype: torch.dtype, head_dim: int, v_head_dim: int, mode: FusedMode
) -> Verdict:
    """The gate's whole decision for a per-token-head pool (the write takes no scale, so nothing
    depends on the call): the FP8 write's ``cache_verdict`` on its buffers; the interpreter counts on
    the CPU only with ``fused="always"``."""
    return buffers_verdict(device, dtype, head_dim, v_head_dim, mode, store_fp8_token_kv)


def launch_token_head_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_store: tuple[torch.Tensor, torch.Tensor],
    v_store: tuple[torch.Tensor, torch.Tensor],
    loc: torch.Tensor,
    dtype: torch.dtype,
    slot_map: Optional[torch.Tensor] = None,
) -> None:
    """One launch, one program per token, writing K and V codes and scales (checked arguments); with
    ``slot_map`` the kernel reads each token's row from it."""
    t, h, d = k.shape
    dv = v.shape[2]
    (kc, ks), (vc, vs) = k_store, v_store
    block_h = next_pow2(h)
    warps = min(MAX_WARPS, max(1, block_h * next_pow2(max(d, dv)) // ELEMS_PER_WARP))
    mapped = slot_map is not None
    if mapped:
        slot_map = slot_map.contiguous()  # type: ignore[union-attr]  # the kernel reads entry s at s
    store_fp8_token_kv[(t,)](
        k, v, loc, slot_map if mapped else loc, kc, vc, ks, vs, kc.shape[0], loc.stride(0),
        slot_map.shape[0] if mapped else 0,  # type: ignore[union-attr]
        *k.stride(), *v.stride(), *kc.stride(), *vc.stride(), *ks.stride(), *vs.stride(),
        H=h, D=d, DV=dv, BLOCK_H=block_h, BLOCK_D=next_pow2(d), BLOCK_DV=next_pow2(dv),
        E4M3=dtype == torch.float8_e4m3fn, SOFT_CAST=not native_cast_ok(k.device), MAPPED=mapped, num_warps=warps,
    )  # fmt: skip


def write_token_head(
    cache_ok: Verdict,
    mode: FusedMode,
    stats: PathStats,
    k: torch.Tensor,
    v: torch.Tensor,
    k_store: tuple[torch.Tensor, torch.Tensor],
    v_store: tuple[torch.Tensor, torch.Tensor],
    loc: torch.Tensor,
    dtype: torch.dtype,
    slot_map: Optional[torch.Tensor] = None,
) -> None:
    """The per-token-head write on checked arguments, on the path ``cache_ok`` (the gate's verdict on
    the pool's buffers) and ``mode`` choose, counted in ``stats``.

    Parameters
    ----------
    k, v : Tensor [T, H, D] / [T, H, Dv], bf16/fp16/fp32, any strides.
    k_store, v_store : (codes [rows, H, D] uint8, scales [rows, H] float32), contiguous rows.
    loc : Tensor [T] int32/int64.
    dtype : the FP8 format.
    slot_map : Tensor [M] int64, or None: token ``t`` goes to row ``slot_map[loc[t]]`` (nothing for
        an index outside ``[0, M)``), read in the same launch on the fused path.

    Raises
    ------
    FusedPathUnavailable
        Under ``mode == "always"`` when the gate refuses, before anything is written.
    """
    if not takes_fused_path(cache_ok, mode, stats):
        write_token_head_reference(k, v, k_store, v_store, loc, dtype, slot_map)
    elif k.shape[0]:
        launch_token_head_write(k, v, k_store, v_store, loc, dtype, slot_map)
