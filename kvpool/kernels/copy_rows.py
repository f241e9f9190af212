"""Row copies between tables of buffers (STAND-IN: plain PyTorch, to be replaced by the copyrows branch).

This file only fixes the interface the transfer code is written against; the copyrows branch
provides the real implementation (one Triton launch per call on CUDA) with this same API.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class RowTable:
    """A list of buffers that one launch addresses: buffer b is rows x row_bytes[b] bytes, row r at
    base[b] + r * row_stride[b] (bytes). All buffers of a table share `rows` and `device`."""

    buffers: tuple[torch.Tensor, ...]
    rows: int
    row_bytes: tuple[int, ...]
    device: torch.device

    @classmethod
    def of(cls, buffers: Sequence[torch.Tensor]) -> "RowTable":
        """Each buffer ``[rows, ...]`` whose row (dims 1..) is contiguous; any dtype (bytes are copied)."""
        bufs = tuple(buffers)
        if not bufs:
            raise ValueError("buffers must hold at least one tensor, got none")
        rows, device = bufs[0].shape[0], bufs[0].device
        row_bytes = []
        for i, b in enumerate(bufs):
            if b.dim() < 1 or b.shape[0] != rows or b.device != device:
                raise ValueError(
                    f"buffers[{i}] must be [{rows}, ...] on {device}, got {tuple(b.shape)} on {b.device}"
                )
            if not _rows_contiguous(b):
                raise ValueError(f"buffers[{i}] must have contiguous rows, got strides {b.stride()}")
            row_bytes.append(b[0].numel() * b.element_size() if b.dim() > 1 else b.element_size())
        return cls(bufs, rows, tuple(row_bytes), device)


def _rows_contiguous(t: torch.Tensor) -> bool:
    expected = 1
    for dim in range(t.dim() - 1, 0, -1):
        if t.shape[dim] != 1 and t.stride(dim) != expected:
            return False
        expected *= t.shape[dim]
    return True


def _byte_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, row_bytes]`` uint8, a view of the same memory."""
    return t.view(t.shape[0], -1).view(torch.uint8)


def copy_rows(
    dst: RowTable,
    dst_index: torch.Tensor,
    src: RowTable,
    src_index: torch.Tensor,
    *,
    max_programs: int | None = None,
    validate: bool = False,
) -> None:
    """For every buffer b and every i: row dst_index[i] of dst.buffers[b] becomes a byte copy of row
    src_index[i] of src.buffers[b]. Pairs with an index < 0 or >= that table's rows are skipped;
    validate=True raises IndexError instead (one sync). Same number of buffers and equal row_bytes
    per buffer in both tables. CUDA: one Triton launch for all buffers, no sync, no allocation.
    Elsewhere: a torch reference path with the same result."""
    del max_programs
    if len(dst.buffers) != len(src.buffers) or dst.row_bytes != src.row_bytes:
        raise ValueError(f"tables must have equal row_bytes per buffer, got {dst.row_bytes} and {src.row_bytes}")
    if dst_index.shape != src_index.shape or dst_index.dim() != 1:
        raise ValueError(
            f"dst_index and src_index must be 1-D of one length, got {tuple(dst_index.shape)} and {tuple(src_index.shape)}"
        )
    d = dst_index.to(torch.int64)
    s = src_index.to(torch.int64)
    ok = (d >= 0) & (d < dst.rows) & (s >= 0) & (s < src.rows)
    if validate and not bool(ok.all()):
        i = int((~ok).nonzero()[0])
        raise IndexError(f"pair {i}: dst_index {int(d[i])} (rows {dst.rows}), src_index {int(s[i])} (rows {src.rows})")
    d, s = d[ok], s[ok]
    for db, sb in zip(dst.buffers, src.buffers):
        _byte_rows(db)[d] = _byte_rows(sb)[s]
