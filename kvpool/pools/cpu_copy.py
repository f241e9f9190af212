"""CPU copies: a request's K/V rows (``KVCpuCopy``) or state slots (``MambaCpuCopy``) of every
layer of a pool, parked in host memory.

A pool's ``get_cpu_copy(indices)`` returns one and its ``load_cpu_copy(copy, indices)`` writes it
back, byte for byte (docs/contract.md, "Moves and CPU copies"); ``check_cpu_copy`` and
``check_mamba_cpu_copy`` are what the loads require of a copy before they write anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kvpool.kernels.copy_rows import RowTable, checked_copy


def copy_rows_to_host(
    table: RowTable, indices: torch.Tensor, host_rows: list[torch.Tensor], device: torch.device, name: str = "indices"
) -> None:
    """Rows ``indices`` (checked) of a pool's ``table`` into ``host_rows``, the same buffers' blocks
    in host memory (pinned on CUDA; row ``j`` takes slot ``indices[j]``): one launch, then on CUDA a
    wait for the current stream, so the copy is complete on return. ``name`` is ``indices``'s in
    errors."""
    n = indices.shape[0]
    if n == 0:
        return
    pinned = device.type == "cuda"
    host = RowTable.of(host_rows, table_device=device if pinned else None, non_blocking=pinned)
    positions = torch.arange(n, dtype=torch.int64, device=device)
    checked_copy(host, positions, table, indices, None, False, ("positions", name))
    if pinned:
        torch.cuda.current_stream(device).synchronize()


def copy_rows_from_host(
    table: RowTable, indices: torch.Tensor, staged_rows: list[torch.Tensor], device: torch.device, name: str = "indices"
) -> None:
    """Row ``j`` of ``staged_rows`` (a CPU copy's blocks in ``table``'s order, already sent to the
    device on CUDA) into slot ``indices[j]`` (checked) of a pool's ``table``, every buffer in one
    launch; no synchronisation. ``name`` is ``indices``'s in errors."""
    staged = RowTable.of(staged_rows, non_blocking=device.type == "cuda")
    positions = torch.arange(indices.shape[0], dtype=torch.int64, device=device)
    checked_copy(table, indices, staged, positions, None, False, (name, "positions"))


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

    def layers(self) -> list[torch.Tensor]:
        """The per-layer row blocks ``K0, V0, K1, V1, ...``, in a pool's ``row_table`` order."""
        return [t for pair in zip(self.k, self.v) for t in pair]


def check_cpu_copy(
    copy: object,
    dtype: torch.dtype,
    store_dtype: torch.dtype,
    start_layer: int,
    k_shape: tuple[int, ...],
    v_shape: tuple[int, ...],
) -> KVCpuCopy:
    """``copy`` if it is a KVCpuCopy of ``dtype`` rows from layer ``start_layer`` on whose ``k`` and
    ``v`` are host tensors of ``store_dtype`` with shapes ``k_shape``/``v_shape`` ([layers, n, H, D])
    and contiguous rows; raises naming ``kv_cache_cpu`` (the load's argument) otherwise."""
    if not isinstance(copy, KVCpuCopy):
        raise TypeError(f"kv_cache_cpu must be a KVCpuCopy (from get_cpu_copy), got {type(copy).__name__}")
    if copy.dtype != dtype:
        raise ValueError(f"kv_cache_cpu must hold {dtype} rows (this pool's dtype), got {copy.dtype}")
    if copy.start_layer != start_layer:
        raise ValueError(f"kv_cache_cpu must start at layer {start_layer}, got {copy.start_layer}")
    for name, t, want in (("k", copy.k, k_shape), ("v", copy.v, v_shape)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"kv_cache_cpu.{name} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != want:
            raise ValueError(f"kv_cache_cpu.{name} must have shape {want} ([layers, len(indices), H, D]), got {tuple(t.shape)}")
        if t.dtype != store_dtype:
            raise ValueError(f"kv_cache_cpu.{name} must be {store_dtype}, got {t.dtype}")
        if t.device.type != "cpu":
            raise ValueError(f"kv_cache_cpu.{name} must be in host memory, got {t.device}")
        if t.numel() and not t[0, 0].is_contiguous():  # the rows are copied as whole [H, D] blocks
            raise ValueError(
                f"kv_cache_cpu.{name} must have contiguous [H, D] rows (as get_cpu_copy makes them), got strides "
                f"{t.stride()}"
            )
    return copy


@dataclass(frozen=True)
class MambaCpuCopy:
    """States of some slots of every layer in host memory, as ``MambaPool.get_cpu_copy`` returns
    them and ``MambaPool.load_cpu_copy`` takes them back (the stored bytes, untouched).

    Attributes
    ----------
    conv : tuple of Tensor [layers, n, conv_dim, conv_kernel - 1], one per convolution of a layer.
    temporal : Tensor [layers, n, v_heads, v_head_dim, k_head_dim].
    layers : global ids of the layers (row ``l`` of each tensor is layer ``layers[l]``).
    Pinned when the pool is on CUDA.
    """

    conv: tuple[torch.Tensor, ...]
    temporal: torch.Tensor
    layers: tuple[int, ...]

    def __len__(self) -> int:
        return self.temporal.shape[1]


def check_mamba_cpu_copy(
    copy: object, conv: Sequence[torch.Tensor], temporal: torch.Tensor, layers: tuple[int, ...], n: int
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """The ``(conv, temporal)`` host tensors of ``copy`` if they fit ``n`` slots of a pool whose
    buffers are ``conv`` (one per convolution) and ``temporal`` ([layers, slots, ...]) over global
    ``layers``; raises naming ``mamba_cache_cpu`` (the load's argument) otherwise.

    ``copy`` is a :class:`MambaCpuCopy` (its layers must be ``layers``) or SGLang's form, a pair
    ``(conv, temporal)`` whose ``conv`` is a tensor or a sequence of tensors."""
    if isinstance(copy, MambaCpuCopy):
        if copy.layers != layers:
            raise ValueError(f"mamba_cache_cpu must hold layers {list(layers)}, got {list(copy.layers)}")
        got_conv, got_temporal = copy.conv, copy.temporal
    elif isinstance(copy, (tuple, list)) and len(copy) == 2:
        got_conv, got_temporal = copy
        got_conv = (got_conv,) if isinstance(got_conv, torch.Tensor) else got_conv
        if not isinstance(got_conv, (tuple, list)):
            raise TypeError(
                f"mamba_cache_cpu[0] (conv) must be a tensor or a sequence of tensors, got {type(got_conv).__name__}"
            )
    else:
        raise TypeError(
            "mamba_cache_cpu must be a MambaCpuCopy (from get_cpu_copy) or a (conv, temporal) pair, got "
            f"{type(copy).__name__}{f' of {len(copy)}' if isinstance(copy, (tuple, list)) else ''}"
        )
    if len(got_conv) != len(conv):
        raise ValueError(f"mamba_cache_cpu must hold {len(conv)} convolution states per layer, got {len(got_conv)}")
    named = [(f"conv[{c}]", t, conv[c]) for c, t in enumerate(got_conv)]
    named.append(("temporal", got_temporal, temporal))
    for name, t, mine in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"mamba_cache_cpu.{name} must be a torch.Tensor, got {type(t).__name__}")
        want = (len(layers), n, *mine.shape[2:])
        if tuple(t.shape) != want:
            raise ValueError(
                f"mamba_cache_cpu.{name} must have shape {want} ([layers, len(indices), ...]), got {tuple(t.shape)}"
            )
        if t.dtype != mine.dtype:
            raise ValueError(f"mamba_cache_cpu.{name} must be {mine.dtype}, got {t.dtype}")
        if t.device.type != "cpu":
            raise ValueError(f"mamba_cache_cpu.{name} must be in host memory, got {t.device}")
        if t.numel() and not all(t[l].is_contiguous() for l in range(t.shape[0])):  # rows are copied as bytes
            raise ValueError(
                f"mamba_cache_cpu.{name} must have contiguous [n, ...] blocks per layer (as get_cpu_copy makes "
                f"them), got strides {t.stride()}"
            )
    return tuple(got_conv), got_temporal
