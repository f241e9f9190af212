"""The FP4 write's one decision: the gate, then the fused kernel, the reference path, or the gate's
reason as an error (docs/contract.md, "FP4 pools"; the modes are the FP8 write's)."""

from __future__ import annotations

from typing import Optional

import torch

from kvpool.config import FusedMode
from kvpool.kernels.formats import FP4_DTYPE
from kvpool.kernels.fused_path import buffers_verdict, takes_fused_path
from kvpool.kernels.gate import ELIGIBLE, Verdict
from kvpool.kernels.launch import TRITON_AVAILABLE, cdiv
from kvpool.kernels.store_fp4.naive import FP4_BLOCK, write_fp4_reference
from kvpool.kernels.store_kv.writer import PathStats

if TRITON_AVAILABLE:
    from kvpool.kernels.store_fp4.kernel import store_fp4_kv
else:  # pragma: no cover - exercised only where triton is absent
    store_fp4_kv = None


def fp4_cache_verdict(device: torch.device, head_dim: int, v_head_dim: int, mode: FusedMode) -> Verdict:
    """The gate's part fixed by an FP4 pool's buffers (the FP8 write's ``cache_verdict``; the
    interpreter counts on the CPU only with ``fused="always"``)."""
    if FP4_DTYPE is None:
        return False, "this torch has no torch.float4_e2m1fn_x2"
    return buffers_verdict(device, FP4_DTYPE, head_dim, v_head_dim, mode, store_fp4_kv)


def fp4_input_verdict(k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor]) -> Verdict:
    """The gate's part that depends on the call: the kernel writes unscaled inputs (a scaled write
    rounds ``x / s`` back to the input's type first, which the reference path does)."""
    if k_scale is not None or v_scale is not None:
        return False, "k_scale/v_scale given: the fused FP4 kernel writes unscaled inputs"
    return True, ELIGIBLE


#: 16-element blocks a program of the FP4 write takes (4,096 input elements), and its warps: two
#: blocks a thread: the fastest prefill tile that keeps a decode step short.
FP4_TILE = (256, 4)


def launch_fp4_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_store: tuple[torch.Tensor, torch.Tensor],
    v_store: tuple[torch.Tensor, torch.Tensor],
    loc: torch.Tensor,
    kernel: object = None,
    global_scales: tuple[torch.Tensor, ...] = (),
    tile: tuple[int, int] = FP4_TILE,
) -> None:
    """One launch writing K and V codes and scale bytes (checked arguments), ``tile`` (blocks a
    program, warps) K's programs first: of ``store_fp4_kv``, or of ``kernel`` (an FP4 kernel of the
    same arguments with ``global_scales`` after the buffers: ``store_nvfp4_kv`` and its K and V
    global scales)."""
    t, h, d = k.shape
    dv = v.shape[2]
    (kc, ks), (vc, vs) = k_store, v_store
    kb, vb = h * d // FP4_BLOCK, h * dv // FP4_BLOCK
    rows, warps = tile
    k_programs = cdiv(t * kb, rows)
    k_words, v_words = pairs_are_words(k), pairs_are_words(v)
    (store_fp4_kv if kernel is None else kernel)[(k_programs + cdiv(t * vb, rows),)](  # type: ignore[index]
        k, v, loc, kc, vc, ks, vs, *global_scales, kc.shape[0], t, k_programs, loc.stride(0),
        *_strides(k, k_words), *_strides(v, v_words), kc.stride(0), vc.stride(0), ks.stride(0), vs.stride(0),
        D=d, DV=dv, K_BLOCKS=kb, V_BLOCKS=vb, ROWS=rows, K_WORDS=k_words, V_WORDS=v_words,
        CODE16=k.element_size() == 2, num_warps=warps,
    )  # fmt: skip


def _strides(x: torch.Tensor, words: bool) -> tuple[int, int, int]:
    """``x``'s strides as the kernel takes them: in elements, or the token and head strides in
    32-bit words where it reads pairs as words."""
    st, sh, sd = x.stride()
    return (st // 2, sh // 2, sd) if words else (st, sh, sd)


def pairs_are_words(x: torch.Tensor) -> bool:
    """Whether the FP4 kernels may read ``x`` ([T, H, D] rows) a pair of elements per aligned 32-bit
    word: 16-bit elements, contiguous within a head, even strides and a 4-byte aligned start (a
    fused QKV projection's slices are)."""
    return x.element_size() == 2 and x.stride(2) == 1 and x.stride(0) % 2 == 0 and x.stride(1) % 2 == 0 and x.data_ptr() % 4 == 0


def write_fp4(
    cache_ok: Verdict,
    mode: FusedMode,
    stats: PathStats,
    k: torch.Tensor,
    v: torch.Tensor,
    k_store: tuple[torch.Tensor, torch.Tensor],
    v_store: tuple[torch.Tensor, torch.Tensor],
    loc: torch.Tensor,
    k_scale: Optional[torch.Tensor],
    v_scale: Optional[torch.Tensor],
) -> None:
    """The FP4 write on checked arguments, on the path the gate (``cache_ok``, then the scales) and
    ``mode`` choose, counted in ``stats``. Raises ``FusedPathUnavailable`` with the gate's reason
    under ``mode == "always"`` when the gate refuses, before anything is written."""
    verdict = cache_ok if not cache_ok[0] else fp4_input_verdict(k_scale, v_scale)
    if not takes_fused_path(verdict, mode, stats):
        write_fp4_reference(k, v, k_store, v_store, loc, k_scale, v_scale)
    elif k.shape[0]:
        launch_fp4_write(k, v, k_store, v_store, loc)
