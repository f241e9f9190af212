"""Moving a pool's KV rows: between slots (``move_kv_cache``) and to host memory and back
(``get_cpu_copy`` / ``load_cpu_copy``). ``MHATokenToKVPool`` exposes these as thin methods;
``MLATokenToKVPool`` its CPU copies too, its rows seen as a K part (the latent columns) and a V part
(the rotary columns).

Every path copies bytes (FP8 stays FP8, bit for bit) through :func:`kvpool.kernels.copy_rows.copy_rows`
over the pool's row table: the K and V buffers of every layer, interleaved (``K0, V0, K1, V1, ...``),
so layer ``i``'s pair is ``table.select(2 * i, 2 * i + 2)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvpool.kernels import copy_rows as rows

if TYPE_CHECKING:
    from kvpool.pools.mha_pool import MHATokenToKVPool


def kv_rows(pool: "MHATokenToKVPool") -> rows.RowTable:
    """``pool.row_table`` (the name the host tier reads until it reads the attribute)."""
    return pool.row_table


@dataclass(frozen=True)
class KVCpuCopy:
    """A request's K and V rows of every layer of a pool, in host memory, as ``get_cpu_copy`` returns
    them and ``load_cpu_copy`` takes them back.

    Attributes
    ----------
    k : Tensor [layer_num, n, head_num, head_dim] of the pool's ``store_dtype`` (uint8 for FP8: the
        stored bytes, untouched); row ``j`` of layer ``l`` is slot ``indices[j]`` of layer
        ``start_layer + l``. Pinned when the pool is on CUDA.
    v : Tensor [layer_num, n, head_num, v_head_dim], likewise.
    dtype : the pool's element type (``k.view(dtype)`` gives the values).
    start_layer : the global id of layer 0 of ``k`` and ``v``.
    """

    k: torch.Tensor
    v: torch.Tensor
    dtype: torch.dtype
    start_layer: int

    def __len__(self) -> int:
        return self.k.shape[1]


def _interleaved(k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
    return [t for pair in zip(k, v) for t in pair]


def get_cpu_copy(pool: "MHATokenToKVPool", indices: torch.Tensor) -> KVCpuCopy:
    """Copy the K/V rows ``indices`` of every layer to host memory. On CUDA one kernel writes every
    layer straight into pinned host memory; the call then waits for the current stream (the copy is
    complete when it returns, as SGLang's is), so it checks ``indices`` against the buffers' rows
    at no extra cost: an index outside ``0..size + page_size - 1`` raises IndexError."""
    n = rows.check_pairs(indices, indices, pool.device, ("indices", "indices"))
    capacity = pool.size + pool.page_size
    _check_all_in_range(indices, capacity)
    pinned = pool.device.type == "cuda"
    shape = (pool.layer_num, n, pool.head_num)
    k = torch.empty((*shape, pool.head_dim), dtype=pool.store_dtype, pin_memory=pinned)
    v = torch.empty((*shape, pool.v_head_dim), dtype=pool.store_dtype, pin_memory=pinned)
    if n:
        host = rows.RowTable.of(
            _interleaved(k, v), table_device=pool.device if pinned else None, non_blocking=pinned
        )
        positions = torch.arange(n, dtype=torch.int64, device=pool.device)
        rows.checked_copy(host, positions, kv_rows(pool), indices, None, False, ("positions", "indices"))
        if pinned:
            torch.cuda.current_stream(pool.device).synchronize()
    return KVCpuCopy(k, v, pool.dtype, pool.start_layer)


def _check_all_in_range(indices: torch.Tensor, capacity: int) -> None:
    if indices.numel() == 0:
        return
    bad = (indices < 0) | (indices >= capacity)
    if bool(bad.any()):
        pos = int(torch.argmax(bad.to(torch.uint8)))
        raise IndexError(f"indices[{pos}] = {int(indices[pos])} is out of range: slots are 0..{capacity - 1}")


def check_cpu_copy(pool: "MHATokenToKVPool", copy: object, n: int) -> KVCpuCopy:
    """``copy`` is a KVCpuCopy of this pool's geometry holding ``n`` rows."""
    if not isinstance(copy, KVCpuCopy):
        raise TypeError(f"kv_cache_cpu must be a KVCpuCopy (from get_cpu_copy), got {type(copy).__name__}")
    if copy.dtype != pool.dtype:
        raise ValueError(f"kv_cache_cpu must hold {pool.dtype} rows (this pool's dtype), got {copy.dtype}")
    if copy.start_layer != pool.start_layer:
        raise ValueError(f"kv_cache_cpu must start at layer {pool.start_layer}, got {copy.start_layer}")
    for name, t, dim in (("k", copy.k, pool.head_dim), ("v", copy.v, pool.v_head_dim)):
        want = (pool.layer_num, n, pool.head_num, dim)
        if tuple(t.shape) != want:
            raise ValueError(f"kv_cache_cpu.{name} must have shape {want} ([layers, len(indices), H, D]), got {tuple(t.shape)}")
        if t.dtype != pool.store_dtype:
            raise ValueError(f"kv_cache_cpu.{name} must be {pool.store_dtype}, got {t.dtype}")
        if t.device.type != "cpu":
            raise ValueError(f"kv_cache_cpu.{name} must be in host memory, got {t.device}")
    return copy


def load_cpu_copy(pool: "MHATokenToKVPool", kv_cache_cpu: KVCpuCopy, indices: torch.Tensor) -> None:
    """Write a ``get_cpu_copy`` result back into the rows ``indices`` of every layer. Checked before
    anything is written (type, dtype, layers, shapes, ``len(indices)``). No synchronisation on CUDA:
    the rows cross to the device with the copy engine (``non_blocking``, so host memory is released
    only after the copy), then one kernel scatters every layer. Out-of-range indices are never
    written (IndexError under the pool's ``validate``)."""
    n = rows.check_pairs(indices, indices, pool.device, ("indices", "indices"))
    copy = check_cpu_copy(pool, kv_cache_cpu, n)
    if pool.validate:
        rows.check_in_range([(indices, pool.size + pool.page_size, "indices")])
    if n == 0:
        return
    cuda = pool.device.type == "cuda"
    k = copy.k.to(pool.device, non_blocking=True) if cuda else copy.k
    v = copy.v.to(pool.device, non_blocking=True) if cuda else copy.v
    staged = rows.RowTable.of(_interleaved(k, v), non_blocking=cuda)
    positions = torch.arange(n, dtype=torch.int64, device=pool.device)
    rows.checked_copy(kv_rows(pool), indices, staged, positions, None, False, ("indices", "positions"))
