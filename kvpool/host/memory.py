"""Host memory for the host tier: how much is available, the K/V buffers page-locked in place, and
their two layouts.

The host pool sizes itself against :func:`available_host_bytes` (docs/contract.md, "Host tier",
"Size" and "Memory and layouts") and, on CUDA, pins its buffers with ``cudaHostRegister`` so that
the GPU reaches them directly (the ``"kernel"`` backend) and the copy engine moves them
asynchronously.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch

#: ``"layer_first"``: ``[layer_num, size, H, D]`` (a layer's rows of a page are contiguous);
#: ``"page_first"``: ``[size, layer_num, H, D]`` (a page of every layer is one block per K/V).
LAYOUTS = ("layer_first", "page_first")
#: Host memory left free when sizing: min(this, a quarter of what is available).
HOST_RESERVE_BYTES = 8 * 2**30
_CUDA_HOST_REGISTER_PORTABLE_MAPPED = 3  # cudaHostRegisterPortable | cudaHostRegisterMapped


def layer_views(buf: torch.Tensor, layout: str) -> list[torch.Tensor]:
    """Each layer's ``[size, H, D]`` rows of a host buffer (or of a staging buffer laid out like one)."""
    if layout == "layer_first":
        return list(buf.unbind(0))
    return list(buf.unbind(1))


def available_host_bytes() -> int:
    """Host memory available to new allocations (``MemAvailable``; physical pages where there is no
    /proc/meminfo)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def gb(nbytes: int) -> str:
    """A byte count for an error message: GB when large, exact bytes otherwise."""
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 10**7 else f"{nbytes:,} bytes"


def host_slots(host_size: object, host_to_device_ratio: object, device_slots: int, slot_bytes: int) -> int:
    """The slots a host pool asks for (docs/contract.md, "Host tier", "Size"): ``host_size`` GB (1e9
    bytes) of slots of ``slot_bytes`` bytes when ``host_size > 0``, else ``device_slots *
    host_to_device_ratio``, rounded down. Raises ``ValueError`` naming the argument that is not a
    usable number (the ratio is read only when ``host_size <= 0``)."""
    if isinstance(host_size, bool) or not isinstance(host_size, (int, float)) or not math.isfinite(host_size):
        raise ValueError(f"host_size must be a number of GB (<= 0: use host_to_device_ratio), got {host_size!r}")
    if host_size > 0:
        return int(host_size * 1e9 // slot_bytes)
    ratio = host_to_device_ratio
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not math.isfinite(ratio) or ratio <= 0:
        raise ValueError(f"host_to_device_ratio must be a positive number when host_size <= 0, got {ratio!r}")
    return int(device_slots * ratio)


def check_host_memory(slots: int, size_per_token: int) -> None:
    """Raise ``ValueError`` (before anything is allocated) when ``slots`` host slots of
    ``size_per_token`` bytes need more than the available host memory minus the reserve."""
    requested = slots * size_per_token
    available = available_host_bytes()
    reserve = min(HOST_RESERVE_BYTES, available // 4)
    if requested > available - reserve:
        raise ValueError(
            f"host memory: the host pool needs {gb(requested)} ({slots} slots x {size_per_token} B) "
            f"but only {gb(max(0, available - reserve))} is available ({gb(available)} free, "
            f"{gb(reserve)} kept back); lower host_size or host_to_device_ratio"
        )


class PinnedRegion:
    """Whole pages of host memory page-locked in place with cudaHostRegister, unregistered when this
    object (held by the host pool) is collected; it holds the allocation until then.

    Attributes
    ----------
    raw : the allocation (uint8) the region lies in.
    ptr, nbytes : the registered range.
    """

    def __init__(self, raw: torch.Tensor, ptr: int, nbytes: int) -> None:
        err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _CUDA_HOST_REGISTER_PORTABLE_MAPPED))
        if err != 0:
            raise RuntimeError(f"cudaHostRegister of {gb(nbytes)} of host memory failed with cudaError {err}")
        self.raw, self.ptr, self.nbytes = raw, ptr, nbytes

    def __del__(self) -> None:
        try:
            torch.cuda.cudart().cudaHostUnregister(self.ptr)
        except Exception:  # interpreter shutdown: CUDA may be gone already
            pass


def host_buffers(
    k_shape: tuple[int, ...], v_shape: tuple[int, ...], dtype: torch.dtype, pin: bool
) -> tuple[torch.Tensor, torch.Tensor, Optional[PinnedRegion]]:
    """The K and V host buffers, and the pinned region holding them (None when not pinned): two
    buffers of one dtype, as :func:`host_part_buffers` makes them."""
    (k, v), handle = host_part_buffers([(k_shape, dtype), (v_shape, dtype)], pin)
    return k, v, handle


def host_part_buffers(
    specs: list[tuple[tuple[int, ...], torch.dtype]], pin: bool
) -> tuple[list[torch.Tensor], Optional[PinnedRegion]]:
    """One host buffer per ``(shape, dtype)`` of ``specs``, and the pinned region holding them all
    (None when not pinned).

    Pinned buffers are page-locked in place, at their exact size (the caching host allocator would
    round a block up to a power of two): one allocation with a page of slack at each end, so that
    the registered range is whole pages no other allocation shares (registering a page twice
    fails); each buffer starts on a page of its own. The region stays registered while the returned
    handle lives; views kept past it are plain host memory."""
    if not pin:
        return [torch.empty(shape, dtype=dtype) for shape, dtype in specs], None
    page = os.sysconf("SC_PAGE_SIZE")
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in specs]
    starts = [0]
    for nbytes in sizes:
        starts.append(starts[-1] + (nbytes + page - 1) // page * page)
    span = starts[-1]
    raw = torch.empty(span + 2 * page, dtype=torch.uint8)
    start = -raw.data_ptr() % page
    region = raw[start : start + span]
    handle = PinnedRegion(raw, region.data_ptr(), span)
    buffers = [
        region[at : at + nbytes].view(dtype).view(shape) for (shape, dtype), at, nbytes in zip(specs, starts, sizes)
    ]
    return buffers, handle


def page_buffer_meta(
    buffers: list[torch.Tensor], layout: str, layer_num: int, page_size: int, firsts: list[int]
) -> tuple[list[int], list[int]]:
    """Host addresses and byte sizes of the pages starting at host slots ``firsts`` of ``buffers``
    (one per part, ``[layer_num, size, ...]`` or ``[size, layer_num, ...]`` as ``layout`` says):
    ``page_first``: per page, each part's block (every layer of the page); ``layer_first``: per
    page, per layer, each part's block."""
    ptrs: list[int] = []
    sizes: list[int] = []
    bases = [b.data_ptr() for b in buffers]
    rows = [b[0, 0].nbytes for b in buffers]
    if layout == "page_first":
        blocks = [page_size * layer_num * r for r in rows]
        for s in firsts:
            ptrs += [base + s * layer_num * r for base, r in zip(bases, rows)]
            sizes += blocks
    else:
        size = buffers[0].shape[1]
        blocks = [page_size * r for r in rows]
        for s in firsts:
            for layer in range(layer_num):
                ptrs += [base + (layer * size + s) * r for base, r in zip(bases, rows)]
                sizes += blocks
    return ptrs, sizes
