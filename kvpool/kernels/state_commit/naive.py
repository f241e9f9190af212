"""The speculative state commit in plain PyTorch: the definition of the commit kernel's result
(``launcher.py`` runs one or the other)."""

from __future__ import annotations

from typing import Optional

import torch

from kvpool.kernels.copy_rows.naive import copy_rows_reference
from kvpool.kernels.row_table import RowTable


def commit_source_rows(num_steps: int, steps: torch.Tensor) -> torch.Tensor:
    """[bs] int64: the scratch row request ``i`` commits from, ``i * K + steps[i] - 1``, or -1 where
    ``steps[i]`` is outside ``1..K`` (device operations only: no synchronisation)."""
    s = steps.to(torch.int64)
    first = torch.arange(s.shape[0], dtype=torch.int64, device=s.device) * num_steps - 1
    return torch.where((s >= 1) & (s <= num_steps), first + s, -1)


def commit_rows_reference(
    dst: RowTable,
    src: RowTable,
    num_steps: int,
    slots: torch.Tensor,
    steps: torch.Tensor,
    track_slots: Optional[torch.Tensor] = None,
    track_steps: Optional[torch.Tensor] = None,
) -> None:
    """The commit in plain PyTorch: the source rows computed on the device, then
    :func:`~kvpool.kernels.copy_rows.copy_rows_reference`. Unchecked, no synchronisation."""
    dst_index, src_index = slots, commit_source_rows(num_steps, steps)
    if track_slots is not None:
        dst_index = torch.cat((dst_index.to(torch.int64), track_slots.to(torch.int64)))
        src_index = torch.cat((src_index, commit_source_rows(num_steps, track_steps)))
    copy_rows_reference(dst, dst_index, src, src_index)
