"""What the quantizing writes of the scaled pools (per-token-head FP8, FP4, NVFP4) share around their
kernels: the gate's verdict on a pool's buffers, the refusal ``fused="always"`` raises when the pool
is built, and each write's choice between the fused kernel and the reference path (docs/contract.md,
"The gate", "Modes"; the modes are the FP8 write's)."""

from __future__ import annotations

import torch

from kvpool.config import FusedMode
from kvpool.errors import FusedPathUnavailable
from kvpool.kernels.gate import Verdict, cache_verdict
from kvpool.kernels.launch import INTERPRETER
from kvpool.kernels.store_kv.writer import PathStats


def buffers_verdict(
    device: torch.device, dtype: torch.dtype, head_dim: int, v_head_dim: int, mode: FusedMode, kernel: object
) -> Verdict:
    """The gate's part fixed by a scaled pool's buffers (contiguous rows of ``dtype``): the FP8
    write's ``cache_verdict``, with Triton present where ``kernel`` (the jitted kernel, or None) is;
    the interpreter counts on the CPU only with ``fused="always"``."""
    return cache_verdict(
        device, dtype, head_dim, v_head_dim, 1, 1,
        triton_available=kernel is not None, interpreter=INTERPRETER and mode == "always",
    )  # fmt: skip


def check_always(mode: FusedMode, verdict: Verdict) -> None:
    """Raise ``FusedPathUnavailable`` with the gate's reason when ``mode`` is ``"always"`` and the
    gate refuses a pool's buffers (``verdict``), before the pool exists."""
    if mode == "always" and not verdict[0]:
        raise FusedPathUnavailable(f"fused='always' but {verdict[1]}")


def takes_fused_path(verdict: Verdict, mode: FusedMode, stats: PathStats) -> bool:
    """Whether a write runs the fused kernel: ``verdict`` (the gate's, for this write) allows it and
    ``mode`` is not ``"never"``. The choice is counted in ``stats`` (a reference write with its
    reason).

    Raises
    ------
    FusedPathUnavailable
        Under ``mode == "always"`` when the gate refuses, naming its reason; nothing is counted.
    """
    ok, reason = (False, "fused='never'") if mode == "never" else verdict
    if ok:
        stats.fused_calls += 1
        return True
    if mode == "always":
        raise FusedPathUnavailable(f"fused='always' but {reason}")
    stats.reference_calls += 1
    stats.reasons[reason] = stats.reasons.get(reason, 0) + 1
    return False
