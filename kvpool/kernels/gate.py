"""The eligibility gate: may the fused Triton kernel do this write? (pure functions, no state)

The decision has two parts. What is fixed when the caches exist (Triton present, device, cache
dtype, head dims, NHD layout) is decided once, by :func:`cache_verdict`, when a pool or a writer is
built. What can change from call to call is decided by :func:`input_verdict` from the write's key
(its inputs classified into the kernel's constants, see ``kvpool.kernels.store_kv.checks.WriteKey``); the
writer memoises that verdict per key. Neither part raises for a write it cannot take: each says why,
and the caller falls back to the reference path (``fused="auto"``) or raises (``fused="always"``).
Rules: docs/contract.md ("The gate", "Modes").
"""

from __future__ import annotations

from typing import Optional

import torch

from kvpool.kernels.formats import CACHE_DTYPES, FP4_DTYPE, INPUT_DTYPES, SCALE_HEAD, SCALE_TENSOR

#: Largest head_dim the kernel takes: a [BLOCK_H, next_pow2(head_dim)] tile must fit one program.
MAX_HEAD_DIM = 1024

ELIGIBLE = "eligible"

Verdict = tuple[bool, str]


def cache_verdict(
    device: torch.device,
    cache_dtype: torch.dtype,
    head_dim: int,
    v_head_dim: int,
    k_cache_stride_d: int,
    v_cache_stride_d: int,
    *,
    triton_available: bool,
    interpreter: bool,
) -> Verdict:
    """The part of the decision fixed by the caches.

    Parameters
    ----------
    device : where the caches live.
    cache_dtype : their element type.
    head_dim, v_head_dim : D and Dv.
    k_cache_stride_d, v_cache_stride_d : the caches' head_dim strides (NHD layout means 1).
    triton_available : Triton imported and the kernel was defined.
    interpreter : the kernel may run under ``TRITON_INTERPRET=1`` on CPU tensors (pools ask for it
        only with ``fused="always"``: the interpreter is far slower than the reference path).

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
    if cache_dtype not in CACHE_DTYPES and (FP4_DTYPE is None or cache_dtype != FP4_DTYPE):
        return False, f"cache dtype {cache_dtype} is not supported"
    if head_dim > MAX_HEAD_DIM or v_head_dim > MAX_HEAD_DIM:
        return False, f"head_dim {max(head_dim, v_head_dim)} exceeds the fused kernel's limit of {MAX_HEAD_DIM}"
    if k_cache_stride_d != 1 or v_cache_stride_d != 1:
        return False, (
            f"cache layout is not NHD with a contiguous head_dim "
            f"(head_dim strides {k_cache_stride_d}/{v_cache_stride_d}, expected 1)"
        )
    return True, ELIGIBLE


def input_verdict(key: tuple) -> Verdict:
    """The part of the decision that depends on the call: its key (``WriteKey`` or the same tuple).

    Input and ``loc`` dtypes were checked before a key is made, and every checked combination runs
    in the kernel; what remains is the element type of scale tensors, which the kernel reads as
    float32."""
    for kind, dtype, name in ((key[3], key[5], "k_scale"), (key[4], key[6], "v_scale")):
        if (kind == SCALE_TENSOR or kind == SCALE_HEAD) and dtype != torch.float32:
            return False, f"{name} is a {dtype} tensor; the fused kernel reads float32 scale tensors"
    return True, ELIGIBLE


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
    k_scale: object,
    v_scale: object,
    triton_available: bool,
    interpreter: bool,
) -> Verdict:
    """The whole decision for one write described by its metadata (both parts above), for callers
    that want to ask before writing. Input dtypes outside bf16/fp16/fp32 are refused here too,
    although a write with them never reaches the gate (the argument checks reject it first)."""
    ok, reason = cache_verdict(
        device, cache_dtype, head_dim, v_head_dim, k_cache_stride_d, v_cache_stride_d,
        triton_available=triton_available, interpreter=interpreter,
    )  # fmt: skip
    if not ok:
        return ok, reason
    if k_dtype not in INPUT_DTYPES or v_dtype not in INPUT_DTYPES:
        return False, f"input dtypes {k_dtype}/{v_dtype} are not bf16/fp16/fp32"
    return input_verdict((k_dtype, v_dtype, None, *_kind_and_dtype(k_scale, v_scale)))


def _kind_and_dtype(k_scale: object, v_scale: object) -> tuple:
    def one(s: object) -> tuple[int, Optional[torch.dtype]]:
        if isinstance(s, torch.Tensor):
            return (SCALE_TENSOR if s.numel() == 1 else SCALE_HEAD), s.dtype
        return 0, None

    (ka, kd), (va, vd) = one(k_scale), one(v_scale)
    return ka, va, kd, vd
