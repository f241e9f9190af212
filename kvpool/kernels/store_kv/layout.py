"""How the K/V write addresses a pool's memory, shared by its writer, its custom operator and the
pools: the cache as the kernel sees it (``storage_view``), the two column parts of one row buffer
(``parts_of_one_row``), a slot map read in the kernel or translated before it (``maps_in_kernel``,
``translate_slots``), and whether the hardware's own FP8 conversion is exact (``native_cast_ok``)."""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from kvpool.kernels.formats import store_dtype_for
from kvpool.kernels.launch import INTERPRETER
from kvpool.write_types import Geometry

#: Element offsets the kernel computes in 32 bits stay below this.
I32_LIMIT = 2**31

#: The last entry of the key of a call whose slots go through a slot map.
MAPPED_KEY = "slot_map"


def maps_in_kernel(slot_map: torch.Tensor, device: torch.device) -> bool:
    """Whether the kernel can read ``slot_map`` itself: one contiguous int64 dimension on the
    writer's device, short enough for 32-bit offsets."""
    return (
        slot_map.dtype == torch.int64 and slot_map.dim() == 1 and slot_map.stride(0) == 1
        and slot_map.device == device and slot_map.shape[0] < I32_LIMIT
    )  # fmt: skip


def translate_slots(slot_map: torch.Tensor, loc: torch.Tensor) -> torch.Tensor:
    """``slot_map[s]`` for each entry ``s`` of ``loc`` in ``[0, len(slot_map))``, -1 for any other
    (int64, ``loc``'s shape): what a mapped write writes, as one clamp, one gather and one select,
    no synchronisation, whatever the map's last entry.

    >>> translate_slots(torch.tensor([0, 5, 0, 7, -1]), torch.tensor([1, 3, -1, 9, 2]))
    tensor([ 5,  7, -1, -1,  0])
    >>> translate_slots(torch.tensor([3, 6]), torch.tensor([-1, 1, 2]))
    tensor([-1,  6, -1])
    """
    m = slot_map.shape[0]
    if m == 0:
        return torch.full(loc.shape, -1, dtype=torch.int64, device=loc.device)
    inside = (loc >= 0) & (loc < m)
    return torch.where(inside, slot_map[loc.clamp(0, m - 1)], -1)


@functools.lru_cache(maxsize=None)
def native_cast_ok(device: torch.device) -> bool:
    """Whether Triton's own fp32->fp8/bf16 conversion is exact here: NVIDIA sm_89+ (cvt.rn.satfinite).
    Elsewhere (interpreter, AMD, older NVIDIA) the kernel encodes with integer operations."""
    if INTERPRETER or device.type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def storage_view(cache: torch.Tensor) -> torch.Tensor:
    """The cache as the kernel addresses it: FP8 as its uint8 bytes (a view, never a copy)."""
    store = store_dtype_for(cache.dtype)
    return cache if store == cache.dtype else cache.view(store)


def parts_of_one_row(geometry: Geometry, k_strides: Sequence[int], v_strides: Sequence[int]) -> bool:
    """Whether K and V caches with these strides are the two column parts of one row buffer, as an
    MLA pool's latent and rotary views are: one head each, and a row stride of the whole row. Such
    caches take joined plans, whether a pool's eager write or the custom operator writes them."""
    g = geometry
    return g.heads == g.v_heads == 1 and k_strides[0] == v_strides[0] == g.head_dim + g.v_head_dim
