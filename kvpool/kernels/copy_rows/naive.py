"""The row copy in plain PyTorch: the definition of :func:`kvpool.kernels.copy_rows.copy_rows`'s result.

CPU tables (and CUDA ones where Triton is missing) take this path; the tests compare the kernel
with it byte for byte. Semantics: docs/contract.md ("Moves and CPU copies").
"""

from __future__ import annotations

import torch

from kvpool.kernels.row_table import RowTable


def byte_rows(buf: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """``buf`` ([rows, ...], contiguous rows) as a uint8 [rows, row_bytes] view of the same memory."""
    esz = buf.element_size()
    out = torch.empty(0, dtype=torch.uint8, device=buf.device)
    out.set_(buf.untyped_storage(), buf.storage_offset() * esz, (buf.shape[0], row_bytes), (buf.stride(0) * esz, 1))
    return out


def copy_rows_reference(dst: RowTable, dst_index: torch.Tensor, src: RowTable, src_index: torch.Tensor) -> None:
    """The copy in plain PyTorch (``index_select`` then ``index_put_`` on byte views), the definition of
    :func:`copy_rows`'s result. Unchecked. No synchronisation when both tables and the indices share a
    device; with pinned host and CUDA tables it moves the indices across (which synchronises)."""
    n = dst_index.shape[0]
    if n == 0 or dst.rows == 0 or src.rows == 0:
        return
    di = dst_index.to(torch.int64)
    si = src_index.to(torch.int64)
    valid = (di >= 0) & (di < dst.rows) & (si >= 0) & (si < src.rows)
    src_safe = torch.where(valid, si, 0).to(src.device)
    # Pairs to skip are redirected, on the device, to repeat the first valid pair's write (same row,
    # same bytes); with no valid pair, every pair rewrites destination row 0 with its own contents.
    any_valid = valid.any()
    first = torch.argmax(valid.to(torch.uint8)).view(1)
    target = torch.where(valid, di, torch.where(any_valid, di.index_select(0, first), 0)).to(dst.device)
    valid_d, any_valid_d, first_d = valid.to(dst.device), any_valid.to(dst.device), first.to(dst.device)
    # index_put_ with a row named twice may interleave the duplicates' bytes (CPU threads split the
    # work by element): every pair writing a row writes the bytes of the last pair naming it.
    winner = _last_pair_per_target(target)
    for b, rb in enumerate(dst.row_bytes):
        s_bytes = byte_rows(src.buffers[b], rb)
        d_bytes = byte_rows(dst.buffers[b], rb)
        rows = s_bytes.index_select(0, src_safe).to(dst.device)  # every source read before any write
        fallback = torch.where(any_valid_d, rows.index_select(0, first_d), d_bytes[:1])
        d_bytes.index_put_((target,), torch.where(valid_d[:, None], rows, fallback).index_select(0, winner))


def _last_pair_per_target(target: torch.Tensor) -> torch.Tensor:
    """[n] int64 -> [n]: for each pair, the position of the last pair with the same target (device
    operations of fixed size: no synchronisation)."""
    order = torch.sort(target, stable=True).indices
    ordered = target.index_select(0, order)
    last = order.index_select(0, torch.searchsorted(ordered, ordered, right=True) - 1)
    return torch.empty_like(order).scatter_(0, order, last)
