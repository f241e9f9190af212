"""``MHATokenToKVPoolHost``: the host-memory tier below a device pool (SGLang's HiCache host pool).

When the device pool fills, a scheduler parks KV pages here (``backup_from_device_all_layer``) and
brings them back layer by layer while the model runs (``load_to_device_per_layer``), or hands whole
pages to a storage tier (``get_data_page`` / ``set_from_flat_data_page`` / ``get_page_buffer_meta``).

Memory: host slots ``0..size-1`` in whole pages, in pinned memory when the device pool is on CUDA, in
one of two layouts, K and V in separate buffers of the device pool's storage dtype (FP8 as uint8):

* ``"layer_first"``: K ``[layer_num, size, head_num, head_dim]``, V ``[layer_num, size, head_num,
  v_head_dim]``: a layer's rows of a page are contiguous.
* ``"page_first"``: K ``[size, layer_num, head_num, head_dim]``, V likewise: a page of every layer
  is one contiguous block per K/V, ready for a storage tier.

Transfers copy bytes (FP8 bits round-trip exactly) with either backend, bit-identical:

* ``"kernel"``: ``copy_rows``'s Triton kernel reads and writes pinned host memory directly, one launch
  for all layers (backups, and loads that nothing waits on layer by layer) or per layer (loads a
  model waits on through the registered counter), on a grid of ``kernel_programs`` programs (8: it
  leaves the other SMs to the model).
* ``"direct"``: the copy engine. Device rows are gathered into (scattered from) a device staging
  buffer laid out like the host buffers with one launch, and each run of consecutive host slots is one
  ``cudaMemcpyAsync`` per contiguous block (``host_copy.py``), in chunks of the staging size.

On CUDA transfers run on the pool's own streams (``load_stream``, ``backup_stream``), each first
waiting for the compute stream's work so far (a stream wait); loads record one event per layer in
``layer_transfer_counter``, which the device pool's getters wait on once registered with
``device_pool.register_layer_transfer_counter``. Nothing waits on the device; the host waits only for
a load queued in the background (``load_to_device_all_layer(..., background=True)``: the pool's
worker thread queues the layers while the caller queues its model). Transfers that touch the
same host pages are ordered (a load waits for the backup that wrote its pages, a backup for the
loads still reading them), and a backup waits for the loads enqueued before it. Device slots stay
the caller's to order: hand slots a backup reads to other work only after its event (or
``wait_for_backups()``), and read loaded slots through the getters with the counter registered (or
after ``wait_for_loads()``). With a CPU device pool all of it is plain, synchronous CPU copies.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from kvpool.checks import positive_int
from kvpool.config import validate_enabled
from kvpool.kernels import copy_rows as rows
from kvpool.pools import host_copy
from kvpool.pools.kv_moves import kv_rows
from kvpool.pools.layer_transfer import LayerTransferCounter
from kvpool.streams import OnStream, StreamMark

logger = logging.getLogger("kvpool")

LAYOUTS = ("layer_first", "page_first")
IO_BACKENDS = ("kernel", "direct")
#: Grid of the kernel backend: at most this many SMs copy, the rest stay with the model.
KERNEL_PROGRAMS = 8
#: Device staging of the direct backend: two buffers of this size per direction, allocated on first
#: direct use (a 32 MiB chunk takes ~0.6 ms at 55 GB/s, against ~15 us for its device-side gather).
STAGING_BYTES = 32 * 2**20
#: Host memory left free when sizing: min(this, a quarter of what is available).
HOST_RESERVE_BYTES = 8 * 2**30
_CUDA_HOST_REGISTER_PORTABLE_MAPPED = 3  # cudaHostRegisterPortable | cudaHostRegisterMapped

# What a device pool passed to a transfer must share with the one the host pool was built for.
_GEOMETRY = ("layer_num", "start_layer", "head_num", "head_dim", "v_head_dim", "dtype", "store_dtype", "device")


def _on(stream: Optional[torch.cuda.Stream]):
    return OnStream(stream) if stream is not None else contextlib.nullcontext()


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


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 10**7 else f"{nbytes:,} bytes"


class _PinnedRegion:
    """Whole pages of host memory page-locked in place with cudaHostRegister, unregistered when this
    object (held by the host pool) is collected; it holds the allocation until then."""

    def __init__(self, raw: torch.Tensor, ptr: int, nbytes: int) -> None:
        err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _CUDA_HOST_REGISTER_PORTABLE_MAPPED))
        if err != 0:
            raise RuntimeError(f"cudaHostRegister of {_gb(nbytes)} of host memory failed with cudaError {err}")
        self.raw, self.ptr, self.nbytes = raw, ptr, nbytes

    def __del__(self) -> None:
        try:
            torch.cuda.cudart().cudaHostUnregister(self.ptr)
        except Exception:  # interpreter shutdown: CUDA may be gone already
            pass


def _host_buffers(
    k_shape: tuple[int, ...], v_shape: tuple[int, ...], dtype: torch.dtype, pin: bool
) -> tuple[torch.Tensor, torch.Tensor, Optional[_PinnedRegion]]:
    """The K and V host buffers. Pinned ones are page-locked in place (exact size, where the caching
    host allocator would round a block up to a power of two): one allocation with a page of slack
    at each end, so that the registered range is whole pages that no other allocation shares
    (registering a page twice fails). The region stays registered while the returned handle lives;
    views kept past it are plain host memory."""
    if not pin:
        return torch.empty(k_shape, dtype=dtype), torch.empty(v_shape, dtype=dtype), None
    page = os.sysconf("SC_PAGE_SIZE")
    k_bytes = math.prod(k_shape) * dtype.itemsize
    v_bytes = math.prod(v_shape) * dtype.itemsize
    k_span = -(-k_bytes // page) * page
    span = k_span + -(-v_bytes // page) * page
    raw = torch.empty(span + 2 * page, dtype=torch.uint8)
    start = -raw.data_ptr() % page
    region = raw[start : start + span]
    handle = _PinnedRegion(raw, region.data_ptr(), span)
    k = region[:k_bytes].view(dtype).view(k_shape)
    v = region[k_span : k_span + v_bytes].view(dtype).view(v_shape)
    return k, v, handle


def _copy_rows(
    checked: bool, dst: rows.RowTable, dst_index, src: rows.RowTable, src_index, max_programs, names,
    stream: Optional[torch.cuda.Stream] = None,
) -> None:  # fmt: skip
    """``copy_rows`` for a transfer's copies, on ``stream`` (default: the current one). The first copy
    of a transfer is ``checked``; the later ones take the same checked indices (or slices of them)
    and siblings of the same tables (host, staging and pool memory never alias), so where the kernel
    runs they launch it without the checks, and without making ``stream`` current: with 32 layers
    moving one by one, the host cost per copy decides how soon the model's own work, queued after a
    load, can start."""
    if checked or not rows._use_kernel(dst.table_device):
        with _on(stream):
            rows.checked_copy(dst, dst_index, src, src_index, max_programs, False, names)
    else:
        rows.launch_copy_rows(dst, dst_index, src, src_index, max_programs=max_programs, stream=stream)


def _copy_segments(copies, *, to_host: bool) -> None:
    """The direct backend's copy-engine calls for one piece: per K/V, (segments ``(host offset,
    staging view)``, host buffer, host offset added to every segment), one ``cudaMemcpyAsync`` per
    segment on the current stream."""
    for seg, host, shift in copies:
        for h_off, staged in seg:
            h_off += shift
            if to_host:
                host[h_off : h_off + staged.shape[0]].copy_(staged, non_blocking=True)
            else:
                staged.copy_(host[h_off : h_off + staged.shape[0]], non_blocking=True)


def _staged_segments(seg: list, staged: torch.Tensor) -> list:
    """``[host offset, staging offset, length]`` segments as ``(host offset, staging view)``."""
    return [(h_off, staged[s_off : s_off + nbytes]) for h_off, s_off, nbytes in seg]


@dataclass
class _StagingHalf:
    """One staging buffer of the direct backend: K/V in the host layout with ``slots`` slots (all
    layers) and, over the same memory, a one-layer K/V pair with ``layer_slots`` slots."""

    slots: int
    table: rows.RowTable
    k_flat: torch.Tensor
    v_flat: torch.Tensor
    layer_slots: int
    layer_table: rows.RowTable
    layer_k_flat: torch.Tensor
    layer_v_flat: torch.Tensor


@dataclass
class _Staging:
    """A direction's staging: two buffers used in turn, so that the device gathers (scatters) of one
    chunk run on ``aux`` while the copy engine moves the other chunk on the transfer stream."""

    halves: tuple[_StagingHalf, _StagingHalf]
    positions: torch.Tensor  # arange(max slots) on the device
    aux: Optional[torch.cuda.Stream]
    device_done: list  # per half: its gather/scatter is done (CUDA events)
    copies_done: list  # per half: its copy-engine calls are done


class MHATokenToKVPoolHost:
    """Host-memory KV pages for a device ``MHATokenToKVPool``, with SGLang's API.

    Parameters
    ----------
    device_pool : the device pool whose rows this tier holds (its geometry and dtype).
    host_to_device_ratio : host slots per device slot, used when ``host_size`` <= 0.
    host_size : host memory in GB (1e9 bytes) when > 0.
    page_size : slots per host page; ``alloc`` and every transfer work in whole pages.
    layout : ``"layer_first"`` or ``"page_first"`` (see the module docstring).
    pin_memory : page-lock the host buffers when the device pool is on CUDA (the kernel backend
        needs it: the GPU reads and writes them through unified addressing).
    device : where the tier lives; ``"cpu"``.
    validate : also check device indices on the device (one synchronisation per transfer), and
        that host pages being moved are allocated. ``KVPOOL_VALIDATE=1`` turns it on too.
    kernel_programs : grid of the kernel backend (SMs it may occupy).
    staging_bytes : size of each of the direct backend's two device staging buffers per direction.

    Size in slots: ``host_size * 1e9 / size_per_token`` when ``host_size > 0``, else
    ``device_pool.size * host_to_device_ratio``, rounded down to whole pages; ``size_per_token`` is
    ``layer_num * head_num * (head_dim + v_head_dim)`` bytes of the storage dtype.

    Attributes
    ----------
    size, page_num, page_size, layout, layer_num, start_layer, end_layer, head_num, head_dim,
    v_head_dim : as the names say (layers use the device pool's global ids).
    dtype : the device pool's element type; ``store_dtype`` what the buffers hold (uint8 for FP8;
        SGLang's host pool calls that one ``dtype``).
    k_buffer, v_buffer : the host buffers (see the module docstring for their shapes).
    load_stream, backup_stream : the transfer streams (None on a CPU pool).
    layer_transfer_counter : per-layer load events, for ``register_layer_transfer_counter``.

    Raises
    ------
    ValueError
        Bad arguments, a size below one page, or more host memory than is available (before
        anything is allocated).

    Examples
    --------
    >>> host = MHATokenToKVPoolHost(pool, 4.0, 0, 16, "page_first")
    >>> h = host.alloc(32)                                   # two pages, int64 CPU slots
    >>> host.backup_from_device_all_layer(pool, h, device_slots, "kernel")
    >>> pool.register_layer_transfer_counter(host.layer_transfer_counter)
    >>> host.load_to_device_all_layer(pool, h, new_device_slots, "kernel")   # layer by layer
    """

    def __init__(
        self,
        device_pool,
        host_to_device_ratio: float,
        host_size: float,
        page_size: int,
        layout: str,
        pin_memory: bool = True,
        device: str = "cpu",
        *,
        validate: bool = False,
        kernel_programs: int = KERNEL_PROGRAMS,
        staging_bytes: int = STAGING_BYTES,
    ) -> None:
        for name in _GEOMETRY + ("k_buffer", "v_buffer", "size", "page_size"):
            if not hasattr(device_pool, name):
                raise TypeError(
                    f"device_pool must be an MHATokenToKVPool or MLATokenToKVPool, got {type(device_pool).__name__} "
                    f"(no .{name})"
                )
        self.device_pool = device_pool
        self.page_size = positive_int(page_size, "page_size")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        self.layout = layout
        if torch.device(device).type != "cpu":
            raise ValueError(f"device must be cpu (the host tier lives in host memory), got {device!r}")
        self.device = torch.device("cpu")
        self.validate = validate_enabled(validate)
        self.kernel_programs = positive_int(kernel_programs, "kernel_programs")
        self.staging_bytes = positive_int(staging_bytes, "staging_bytes")

        self.layer_num = device_pool.layer_num
        self.start_layer = device_pool.start_layer
        self.end_layer = device_pool.start_layer + device_pool.layer_num - 1
        self.head_num, self.head_dim, self.v_head_dim = device_pool.head_num, device_pool.head_dim, device_pool.v_head_dim
        self.dtype, self.store_dtype = device_pool.dtype, device_pool.store_dtype
        esz = self.store_dtype.itemsize
        self.k_row_bytes = self.head_num * self.head_dim * esz
        self.v_row_bytes = self.head_num * self.v_head_dim * esz
        self.size_per_token = self.layer_num * (self.k_row_bytes + self.v_row_bytes)

        if isinstance(host_size, bool) or not isinstance(host_size, (int, float)) or not math.isfinite(host_size):
            raise ValueError(f"host_size must be a number of GB (<= 0: use host_to_device_ratio), got {host_size!r}")
        if host_size > 0:
            size = int(host_size * 1e9 // self.size_per_token)
        else:
            ratio = host_to_device_ratio
            if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not (math.isfinite(ratio) and ratio > 0):
                raise ValueError(f"host_to_device_ratio must be a positive number when host_size <= 0, got {ratio!r}")
            size = int(device_pool.size * ratio)
        self.page_num = size // self.page_size
        self.size = self.page_num * self.page_size
        if self.page_num == 0:
            raise ValueError(
                f"the host pool must hold at least one page of {self.page_size} slots, got {size} slots "
                f"({size * self.size_per_token} bytes)"
            )
        requested = self.size * self.size_per_token
        available = available_host_bytes()
        reserve = min(HOST_RESERVE_BYTES, available // 4)
        if requested > available - reserve:
            raise ValueError(
                f"host memory: the host pool needs {_gb(requested)} ({self.size} slots x {self.size_per_token} B) "
                f"but only {_gb(max(0, available - reserve))} is available ({_gb(available)} free, "
                f"{_gb(reserve)} kept back); lower host_size or host_to_device_ratio"
            )

        cuda = device_pool.device.type == "cuda"
        self.pin_memory = bool(pin_memory) and cuda
        lead = (self.layer_num, self.size) if layout == "layer_first" else (self.size, self.layer_num)
        self.k_buffer, self.v_buffer, self._pinned = _host_buffers(
            (*lead, self.head_num, self.head_dim), (*lead, self.head_num, self.v_head_dim), self.store_dtype,
            self.pin_memory,
        )  # fmt: skip
        self._k_flat = self.k_buffer.view(-1).view(torch.uint8)
        self._v_flat = self.v_buffer.view(-1).view(torch.uint8)

        # Row tables: the host buffers per layer (K0, V0, K1, V1, ...), matching the device pool's.
        k_layers, v_layers = self._layer_views(self.k_buffer), self._layer_views(self.v_buffer)
        host_bufs = [t for pair in zip(k_layers, v_layers) for t in pair]
        self._host_rows = rows.RowTable.of(
            host_bufs, table_device=device_pool.device if self.pin_memory else None, pinned=self.pin_memory or None
        )
        self._host_layer_rows = [self._host_rows.select(2 * i, 2 * i + 2) for i in range(self.layer_num)]
        self._device_rows = kv_rows(device_pool)
        self._device_layer_rows = [self._device_rows.select(2 * i, 2 * i + 2) for i in range(self.layer_num)]

        self.layer_transfer_counter = LayerTransferCounter(self.layer_num, device_pool.device)
        self.load_stream: Optional[torch.cuda.Stream] = None
        self.backup_stream: Optional[torch.cuda.Stream] = None
        if cuda:
            # Loads gate the layers that wait for them: on a high-priority stream their few programs
            # are scheduled as soon as an SM frees instead of queueing behind the model's kernels.
            # Backups are off the forward pass's critical path and keep the default priority.
            self.load_stream = torch.cuda.Stream(device_pool.device, priority=-1)
            self.backup_stream = torch.cuda.Stream(device_pool.device)
            # One kept event per ordering the transfer calls make (kvpool.streams.StreamMark).
            self._backup_after_compute, self._backup_after_loads = StreamMark(), StreamMark()
            self._load_after_compute = StreamMark()
        self._staging: dict[str, _Staging] = {}
        # Ordering of transfers that touch the same host pages: per page, the sequence number of
        # the last backup that wrote it and of the last load that read it; events of transfers that
        # may still run, by sequence number.
        self._seq = 0
        self._page_written = np.full(self.page_num, -1, dtype=np.int64)
        self._page_read = np.full(self.page_num, -1, dtype=np.int64)
        self._events: dict[int, torch.cuda.Event] = {}
        self._last_load: Optional[tuple] = None
        # The thread that queues background loads (made on first use) and its job in progress.
        self._worker: Optional[ThreadPoolExecutor] = None
        self._job: Optional[Future] = None
        self.clear()

    def _layer_views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        if self.layout == "layer_first":
            return [buf[i] for i in range(self.layer_num)]
        return [buf[:, i] for i in range(self.layer_num)]

    # --- allocation (SGLang names) -------------------------------------------------------------------

    def clear(self) -> None:
        """Every page free again (contents are left as they are)."""
        self._free_pages = np.arange(self.page_num, dtype=np.int64)
        self._allocated = np.zeros(self.page_num, dtype=bool)

    def available_size(self) -> int:
        """Free slots (a multiple of ``page_size``)."""
        return int(self._free_pages.shape[0]) * self.page_size

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """``need_size`` slots in whole pages (each page's slots consecutive): an int64 CPU tensor, or
        None (nothing changes) when fewer are free. ``need_size`` must be a multiple of page_size."""
        if isinstance(need_size, bool) or not isinstance(need_size, int) or need_size < 0:
            raise ValueError(f"need_size must be a non-negative int, got {need_size!r}")
        if need_size % self.page_size:
            raise ValueError(f"need_size must be a multiple of page_size {self.page_size}, got {need_size}")
        pages = need_size // self.page_size
        if pages > self._free_pages.shape[0]:
            return None
        taken, self._free_pages = self._free_pages[:pages], self._free_pages[pages:]
        self._allocated[taken] = True
        slots = taken[:, None] * self.page_size + np.arange(self.page_size, dtype=np.int64)
        return torch.from_numpy(slots.reshape(-1))

    def free(self, indices: torch.Tensor) -> int:
        """Give back whole pages (as ``alloc`` returned them, any order of pages). Returns the number
        of slots freed. Raises ValueError for slots that are not whole allocated pages (a double free,
        say), before anything changes."""
        slots = self._host_slots(indices, "indices")
        pages = slots[:: self.page_size] // self.page_size
        if np.unique(pages).shape[0] != pages.shape[0]:
            raise ValueError("indices must name each page once, got a page twice")
        not_held = pages[~self._allocated[pages]]
        if not_held.shape[0]:
            raise ValueError(
                f"indices must be allocated host slots: page {int(not_held[0])} (slots "
                f"{int(not_held[0]) * self.page_size}..) is not allocated (double free?)"
            )
        self._allocated[pages] = False
        self._free_pages = np.concatenate((self._free_pages, pages))
        return int(slots.shape[0])

    def get_size_per_token(self) -> int:
        return self.size_per_token

    # --- checks --------------------------------------------------------------------------------------

    def _host_slots(self, indices: object, name: str) -> np.ndarray:
        """Host slots as int64 NumPy, checked: CPU int tensor, whole aligned pages, in range."""
        if not isinstance(indices, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(indices).__name__}")
        if indices.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {indices.dtype}")
        if indices.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(indices.shape)}")
        if indices.device.type != "cpu":
            raise ValueError(f"{name} must be on cpu (host slots), got {indices.device}")
        slots = indices.numpy().astype(np.int64, copy=True)
        n, ps = slots.shape[0], self.page_size
        if n % ps:
            raise ValueError(f"{name} must hold whole pages of {ps} slots, got {n} entries")
        if n and not self._whole_pages(slots):  # find and report the first problem
            bad = np.flatnonzero((slots < 0) | (slots >= self.size))
            if bad.shape[0]:
                pos = int(bad[0])
                raise IndexError(f"{name}[{pos}] = {int(slots[pos])} is out of range: host slots are 0..{self.size - 1}")
            pages = slots.reshape(-1, ps)
            misaligned = (pages[:, 0] % ps != 0) | np.any(pages != pages[:, :1] + np.arange(ps), axis=1)
            if misaligned.any():
                p = int(np.flatnonzero(misaligned)[0])
                raise ValueError(
                    f"{name} must be whole pages ({ps} consecutive slots from a multiple of {ps}): "
                    f"entries {p * ps}..{p * ps + ps - 1} are {pages[p].tolist()[:8]}"
                )
        return slots

    def _whole_pages(self, slots: np.ndarray) -> bool:
        """Whether ``slots`` are whole pages in range, in a few passes over the page starts (a
        backup's host time before its launch is part of its wall time): each page is ``ps``
        consecutive slots from a multiple of ``ps`` below ``size``, which is a whole number of pages."""
        ps = self.page_size
        starts = slots[::ps]
        if starts.min() < 0 or starts.max() >= self.size or (ps > 1 and (starts % ps).any()):
            return False
        return ps == 1 or np.array_equal(slots.reshape(-1, ps), starts[:, None] + np.arange(ps))

    def _check_device_pool(self, device_pool: object) -> None:
        for name in _GEOMETRY:
            want = getattr(self.device_pool, name)
            got = getattr(device_pool, name, "<missing>")
            if got != want:
                raise ValueError(
                    f"device_pool must have {name}={want} like the pool this host pool was built for, got {got}"
                )

    def _device_indices(self, device_pool, indices: object, n: int) -> torch.Tensor:
        dev = device_pool.device
        if not isinstance(indices, torch.Tensor):
            raise TypeError(f"device_indices must be a torch.Tensor, got {type(indices).__name__}")
        if indices.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"device_indices must be int32 or int64, got {indices.dtype}")
        if indices.dim() != 1:
            raise ValueError(f"device_indices must be 1-D, got shape {tuple(indices.shape)}")
        if indices.device != dev:
            raise ValueError(f"device_indices must be on {dev}, got {indices.device}")
        if indices.shape[0] != n:
            raise ValueError(f"device_indices must have as many entries as host_indices ({n}), got {indices.shape[0]}")
        # Checked eagerly where the data is on the CPU; on the GPU only under validate (one sync).
        if dev.type == "cpu" or self.validate or getattr(device_pool, "validate", False):
            rows.check_in_range([(indices, device_pool.size + device_pool.page_size, "device_indices")])
        return indices

    def _layer_index(self, layer_id: object) -> int:
        if isinstance(layer_id, bool) or not isinstance(layer_id, int):
            raise TypeError(f"layer_id must be an int, got {type(layer_id).__name__}")
        if not self.start_layer <= layer_id <= self.end_layer:
            raise IndexError(f"layer_id {layer_id} is outside the pool's layers [{self.start_layer}, {self.end_layer}]")
        return layer_id - self.start_layer

    def _prepare(self, device_pool, host_indices, device_indices, io_backend: str) -> tuple[np.ndarray, torch.Tensor]:
        if io_backend not in IO_BACKENDS:
            raise ValueError(f"io_backend must be one of {', '.join(IO_BACKENDS)}, got {io_backend!r}")
        self._check_device_pool(device_pool)
        if io_backend == "kernel" and device_pool.device.type == "cuda" and not self.pin_memory:
            raise ValueError("io_backend='kernel' reads host memory from the GPU and needs pin_memory=True; got pin_memory=False (use 'direct')")
        slots = self._host_slots(host_indices, "host_indices")
        d_idx = self._device_indices(device_pool, device_indices, slots.shape[0])
        if self.validate and slots.shape[0]:
            pages = slots[:: self.page_size] // self.page_size
            free = pages[~self._allocated[pages]]
            if free.shape[0]:
                raise ValueError(f"host_indices must be allocated host slots: page {int(free[0])} is free")
        return slots, d_idx

    def _tables(self, device_pool) -> tuple[rows.RowTable, list[rows.RowTable]]:
        if device_pool is self.device_pool:
            return self._device_rows, self._device_layer_rows
        table = kv_rows(device_pool)
        return table, [table.select(2 * i, 2 * i + 2) for i in range(self.layer_num)]

    # --- transfers -----------------------------------------------------------------------------------

    def backup_from_device_all_layer(
        self, device_pool, host_indices: torch.Tensor, device_indices: torch.Tensor, io_backend: str = "kernel"
    ) -> Optional[torch.cuda.Event]:
        """For every layer, host row ``host_indices[i]`` becomes a byte copy of device row
        ``device_indices[i]``, K and V.

        ``host_indices``: int32/int64 CPU tensor of whole allocated pages (``alloc``'s output);
        ``device_indices``: int32/int64 on the device pool's device, same length. Checked before
        anything is copied. On CUDA the copy is enqueued on ``backup_stream`` after the compute
        stream's work so far, and the returned event completes when it has read every row: wait on
        it (``torch.cuda.current_stream().wait_event(e)``, or ``wait_for_backups()``) before
        overwriting the device slots. On a CPU pool the copy is done on return (None is returned)."""
        self._drain()
        slots, d_idx = self._prepare(device_pool, host_indices, device_indices, io_backend)
        table, layer_tables = self._tables(device_pool)
        if slots.shape[0] == 0:
            return None
        pages = slots[:: self.page_size] // self.page_size
        if self.backup_stream is None:
            self._run(io_backend, "backup", table, layer_tables, slots, d_idx, None)
            return None
        stream = self.backup_stream
        compute = torch.cuda.current_stream(device_pool.device)  # before the context makes `stream` current
        with OnStream(stream):
            self._backup_after_compute.order(stream, compute)  # the rows' K/V writes come first
            self._backup_after_loads.order(stream, self.load_stream)  # and loads enqueued before (they may write these rows)
            self._wait_pages(stream, self._page_read, pages)  # loads still reading these pages
            h_dev = self._host_index_tensor(slots, device_pool.device) if io_backend == "kernel" else None
            try:
                self._run(io_backend, "backup", table, layer_tables, slots, d_idx, h_dev)
            finally:  # also after a failure part-way: what was queued is still ordered and kept
                event = self._finish(stream, self._page_written, pages)
                d_idx.record_stream(stream)
        return event

    def load_to_device_per_layer(
        self,
        device_pool,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        layer_id: int,
        io_backend: str = "kernel",
    ) -> None:
        """Layer ``layer_id`` (the global id, as the device pool's getters take it): device K/V row
        ``device_indices[i]`` becomes a byte copy of host row ``host_indices[i]``. Device rows out of
        range are never written. On CUDA it is enqueued on ``load_stream`` after the compute stream's
        work so far, and records the layer's event in ``layer_transfer_counter``."""
        layer = self._layer_index(layer_id)
        self._load(device_pool, host_indices, device_indices, io_backend, [layer])

    def load_to_device_all_layer(
        self,
        device_pool,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        io_backend: str = "kernel",
        *,
        background: bool = False,
    ) -> None:
        """Every layer, in order, each recording its event as it lands (so a model can start layer 0
        before the last layer arrives), when this host pool's ``layer_transfer_counter`` is registered
        on ``device_pool``. Without it nothing waits for a single layer, and the kernel backend moves
        every layer in one launch (a single layer's event then completes with the others). With the
        direct backend and the page_first layout the rows of all layers travel together (a token's
        layers are one block on the host) and every layer's event is recorded once all have landed.

        ``background=True`` (with the counter registered): the call checks its arguments, orders the
        load after the compute stream's work so far, and returns; a worker thread of this host pool
        queues the layers one by one (as SGLang's cache controller thread does), so the caller queues
        its model's work at once instead of after the whole load's host time (1-4 ms for 32 layers on
        an H200's host). A getter of a layer not queued yet waits on the host until it is (see
        :class:`~kvpool.pools.layer_transfer.LayerTransferCounter`); if the worker fails, the getters
        of the layers it did not queue raise, and so does the next call on this host pool. Every
        other transfer or page call on this host pool first waits (host) for the worker to finish
        queueing. Code that reads the device pool's buffers without the getters (a CUDA graph
        replay, a direct buffer read) or captures a CUDA graph must call ``wait_for_loads()`` first,
        and ``device_indices`` must not change before then (the worker reads it when it queues the
        layers; on a CPU pool it does the copies). Without the counter registered, or for a
        one-layer pool, the load is queued before returning, as with ``background=False``. A host
        pool is not thread-safe: call it from one thread (the worker is its own)."""
        self._load(device_pool, host_indices, device_indices, io_backend, list(range(self.layer_num)), background)

    def _drain(self) -> None:
        """Wait (host) until the background load in progress, if any, has queued all its work; raise
        its error if it failed."""
        job = self._job
        if job is None:
            return
        try:
            job.result()
        except BaseException as e:
            if job.done():  # (not when this wait itself was interrupted: the worker may still run)
                self._job = None
                if isinstance(e, Exception):
                    raise RuntimeError(f"the host pool's background load failed: {type(e).__name__}: {e}") from e
            raise
        self._job = None

    def _load(
        self, device_pool, host_indices, device_indices, io_backend: str, layers: list[int], background: bool = False
    ) -> None:
        self._drain()
        last = self._last_load
        if (
            last is not None
            and last[0] is host_indices
            and last[1] == host_indices._version
            and last[2] == io_backend
            and last[3] is device_pool
        ):
            # A controller loading layer by layer passes the same host_indices each time: reuse the
            # checked slots and their device copy (the tensor is held, so its identity is stable).
            slots, h_dev = last[4], last[5]
            d_idx = self._device_indices(device_pool, device_indices, slots.shape[0])
            cached = True
        else:
            slots, d_idx = self._prepare(device_pool, host_indices, device_indices, io_backend)
            h_dev, cached = None, False
        table, layer_tables = self._tables(device_pool)
        if slots.shape[0] == 0:
            return
        pages = slots[:: self.page_size] // self.page_size
        # Layer by layer only where a model waits layer by layer: with this pool's counter registered
        # on the device pool. Otherwise nobody can start on a layer before the others, and the
        # kernel backend moves every layer in one launch (fewer launches for the host to queue, and
        # a token's layers read together, which page_first memory favours).
        waits_per_layer = getattr(device_pool, "layer_transfer_counter", None) is self.layer_transfer_counter
        together = len(layers) > 1 and not waits_per_layer
        background = background and waits_per_layer and len(layers) > 1
        if self.load_stream is None:
            run = lambda: self._run(io_backend, "load", table, layer_tables, slots, d_idx, None, layers, together)  # noqa: E731
            if background:
                self._in_background(run, layers)
            else:
                run()
            return
        stream = self.load_stream
        compute = torch.cuda.current_stream(device_pool.device)
        with OnStream(stream):
            self._load_after_compute.order(stream, compute)  # earlier work on the target slots comes first
            self._wait_pages(stream, self._page_written, pages)  # the backup that wrote these pages
            if io_backend == "kernel" and not cached:
                h_dev = self._host_index_tensor(slots, device_pool.device)

            def queue() -> None:
                try:
                    self._run(io_backend, "load", table, layer_tables, slots, d_idx, h_dev, layers, together)
                finally:  # also after a failure part-way: what was queued is still ordered and kept
                    self._finish(stream, self._page_read, pages)
                    # After the last use is queued: the caching allocator then orders the tensor's
                    # reuse after the load stream's work, whenever the caller drops it.
                    d_idx.record_stream(stream)

            def run() -> None:
                with OnStream(stream):  # the worker's own current stream and device (both per thread)
                    queue()

            if background:
                self._in_background(run, layers)
            else:
                queue()
        if isinstance(host_indices, torch.Tensor):
            self._last_load = (host_indices, host_indices._version, io_backend, device_pool, slots, h_dev)

    def _in_background(self, run, layers: list[int]) -> None:
        """Hand ``run`` (the queueing of a load's ``layers``) to the worker thread."""
        counter = self.layer_transfer_counter
        counter.expect(layers)

        def job() -> None:
            try:
                run()
            except BaseException as e:
                counter.abandon(layers, e)  # waiters of the layers it did not queue raise instead of hanging
                raise

        try:
            if self._worker is None:
                self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpool-host-load")
            self._job = self._worker.submit(job)
        except BaseException as e:  # no worker (interpreter shutting down, say): nothing will record them
            counter.abandon(layers, e)
            raise

    def wait_for_loads(self) -> None:
        """Make the current stream wait for every load enqueued so far (no device sync; the host
        waits for a background load to finish queueing)."""
        self._drain()
        if self.load_stream is not None:
            torch.cuda.current_stream(self.device_pool.device).wait_stream(self.load_stream)

    def wait_for_backups(self) -> None:
        """Make the current stream wait for every backup enqueued so far (no host sync): after it,
        the compute stream may overwrite device slots that were backed up."""
        self._drain()
        if self.backup_stream is not None:
            torch.cuda.current_stream(self.device_pool.device).wait_stream(self.backup_stream)

    def _host_index_tensor(self, slots: np.ndarray, device: torch.device) -> torch.Tensor:
        """Host slots on the device for the kernel, through pinned memory on the current (transfer)
        stream: no synchronisation, and the pinned block is not reused before the copy is done."""
        return torch.from_numpy(slots).pin_memory().to(device, non_blocking=True)

    def _wait_pages(self, stream: torch.cuda.Stream, seqs: np.ndarray, pages: np.ndarray) -> None:
        last = int(seqs[pages].max())
        event = self._events.get(last)
        if event is not None:
            stream.wait_event(event)

    def _finish(self, stream: torch.cuda.Stream, seqs: np.ndarray, pages: np.ndarray) -> torch.cuda.Event:
        self._seq += 1
        event = torch.cuda.Event()
        event.record(stream)
        seqs[pages] = self._seq
        self._events[self._seq] = event
        if len(self._events) > 64:  # forget transfers that are done
            self._events = {s: e for s, e in self._events.items() if not e.query()}
        return event

    def _sync_pages(self, pages: np.ndarray, *, for_write: bool) -> None:
        """Host code is about to read (or write) these pages: wait for the transfers writing them
        (and, before a write, reading them). A host wait on transfer events, never on the compute
        stream."""
        self._drain()
        for seqs in (self._page_written, self._page_read) if for_write else (self._page_written,):
            event = self._events.get(int(seqs[pages].max()))
            if event is not None:
                event.synchronize()

    def _run(
        self,
        io_backend: str,
        direction: str,
        table: rows.RowTable,
        layer_tables: Optional[list[rows.RowTable]],
        slots: np.ndarray,
        d_idx: torch.Tensor,
        h_dev: Optional[torch.Tensor],
        layers: Optional[list[int]] = None,
        together: bool = False,
    ) -> None:
        """Enqueue the copies on the current stream (the transfer stream on CUDA). ``together``: a
        load of every layer in one kernel launch, every layer's event recorded after it."""
        if io_backend == "kernel":
            h_idx = h_dev if h_dev is not None else torch.from_numpy(slots)
            cap = self.kernel_programs
            if direction == "backup":
                rows.checked_copy(self._host_rows, h_idx, table, d_idx, cap, False, ("host_indices", "device_indices"))
                return
            if together:
                rows.checked_copy(table, d_idx, self._host_rows, h_idx, cap, False, ("device_indices", "host_indices"))
                for layer in layers:  # type: ignore[union-attr]
                    self._record_layer(layer, self.load_stream)
                return
            for i, layer in enumerate(layers):  # type: ignore[union-attr]
                dst, src = layer_tables[layer], self._host_layer_rows[layer]  # type: ignore[index]
                _copy_rows(i == 0, dst, d_idx, src, h_idx, cap, ("device_indices", "host_indices"))
                self._record_layer(layer, self.load_stream)
            return
        self._direct(direction, table, layer_tables, slots, d_idx, layers)

    def _record_layer(self, layer: int, stream: Optional[torch.cuda.Stream] = None) -> None:
        """Layer ``layer`` has landed once ``stream`` (default: the current one) gets here (on a CPU
        pool: now)."""
        if self.load_stream is not None:
            stream = stream or torch.cuda.current_stream(self.device_pool.device)
        self.layer_transfer_counter.record(layer, stream)

    # --- the direct backend --------------------------------------------------------------------------

    def _staging_for(self, direction: str, device: torch.device) -> _Staging:
        """The direction's staging, made on first use on the current stream (the transfer stream
        that will use it): no synchronisation."""
        staging = self._staging.get(direction)
        if staging is None:
            cuda = device.type == "cuda"
            halves = (self._make_half(device), self._make_half(device))
            most = max(halves[0].slots, halves[0].layer_slots)
            positions = torch.arange(most, dtype=torch.int64, device=device)
            # A load's scatters gate the layers a model waits for: high priority, as load_stream.
            aux = torch.cuda.Stream(device, priority=-1 if direction == "load" else 0) if cuda else None
            events = [[torch.cuda.Event(), torch.cuda.Event()] if cuda else [None, None] for _ in range(2)]
            staging = self._staging[direction] = _Staging(halves, positions, aux, events[0], events[1])
        return staging

    def _make_half(self, device: torch.device) -> _StagingHalf:
        cuda = device.type == "cuda"
        slots = max(1, self.staging_bytes // self.size_per_token)
        layer_slots = max(1, self.staging_bytes // (self.k_row_bytes + self.v_row_bytes))
        nbytes = max(slots * self.size_per_token, layer_slots * (self.k_row_bytes + self.v_row_bytes))
        mem = torch.empty(nbytes, dtype=torch.uint8, device=device)
        k_bytes = slots * self.layer_num * self.k_row_bytes
        v_bytes = slots * self.layer_num * self.v_row_bytes
        lead = (self.layer_num, slots) if self.layout == "layer_first" else (slots, self.layer_num)
        k = mem[:k_bytes].view(self.store_dtype).view(*lead, self.head_num, self.head_dim)
        v = mem[k_bytes : k_bytes + v_bytes].view(self.store_dtype).view(*lead, self.head_num, self.v_head_dim)
        bufs = [t for pair in zip(self._layer_views(k), self._layer_views(v)) for t in pair]
        table = rows.RowTable.of(bufs, non_blocking=cuda)
        lk_bytes, lv_bytes = layer_slots * self.k_row_bytes, layer_slots * self.v_row_bytes
        lk = mem[:lk_bytes].view(self.store_dtype).view(layer_slots, self.head_num, self.head_dim)
        lv = mem[lk_bytes : lk_bytes + lv_bytes].view(self.store_dtype).view(layer_slots, self.head_num, self.v_head_dim)
        layer_table = rows.RowTable.of([lk, lv], non_blocking=cuda)
        return _StagingHalf(
            slots, table, mem[:k_bytes], mem[k_bytes : k_bytes + v_bytes],
            layer_slots, layer_table, mem[:lk_bytes], mem[lk_bytes : lk_bytes + lv_bytes],
        )  # fmt: skip

    def _direct(
        self,
        direction: str,
        table: rows.RowTable,
        layer_tables: list[rows.RowTable],
        slots: np.ndarray,
        d_idx: torch.Tensor,
        layers: Optional[list[int]],
    ) -> None:
        """The copy engine, chunk by chunk through the two staging buffers in turn: a backup gathers
        a chunk on ``aux`` then copies it out on the transfer stream; a load copies a chunk in on the
        transfer stream then scatters it on ``aux``. Each buffer is refilled only after its previous
        chunk is through, and the transfer stream ends after everything (it waits for ``aux``), so
        one event on it marks the whole transfer.

        ``page_first`` moves every layer of a chunk together when more than one layer moves (a
        token's layers are one block on the host, so a run of host slots is one copy per K/V).
        ``layer_first`` moves layer by layer in both directions, so a run is one copy per layer
        and K/V as long as a layer's staging allows (16k slots of Llama-3-8B's 2 KiB): the copy
        engine needs pieces of several MiB for its full rate (on an H200's PCIe link 95-96% of a
        1 GiB copy in 4 MiB pieces, 86-87% in 1 MiB ones; ``benchmarks/probe_host_links.py``)."""
        st = self._staging_for(direction, table.table_device)
        n = slots.shape[0]
        if layers is None:  # a backup: every layer
            layers = list(range(self.layer_num))
        # (A one-layer page_first pool's backup is "all layers" too: one copy per run, not per row.)
        all_layers = self.layout == "page_first" and (len(layers) > 1 or self.layer_num == 1)
        s_slots = st.halves[0].slots if all_layers else st.halves[0].layer_slots  # a chunk's slots
        chunks = [(j, min(n, j + s_slots)) for j in range(0, n, s_slots)]
        # Per chunk, once for every layer that moves it: its positions in the staging buffer, its
        # device slots, and its copy plan per K/V (host runs; a layer's plan is layer 0's moved by a
        # fixed host offset).
        first = None if all_layers else 0
        plans = {}
        for j0, j1 in chunks:
            run = host_copy.runs(slots[j0:j1])
            k_seg, v_seg = (
                host_copy.segments(self.layout, run, row, self.size, self.layer_num, s_slots, first).tolist()
                for row in (self.k_row_bytes, self.v_row_bytes)
            )
            plans[(j0, j1)] = (st.positions[: j1 - j0], d_idx[j0:j1], k_seg, v_seg)
        per_layer = self.size if self.layout == "layer_first" else 1  # rows between a row's layers
        if all_layers:
            pieces: list[tuple[int, int, Optional[int]]] = [(j0, j1, None) for j0, j1 in chunks]
        else:
            pieces = [(j0, j1, layer) for layer in layers for j0, j1 in chunks]
        cuda = st.aux is not None
        transfer = torch.cuda.current_stream(table.table_device) if cuda else None
        if cuda:
            st.aux.wait_stream(transfer)  # the ordering the transfer stream already has
        queued = False
        try:
            views: dict = {}
            for k, (j0, j1, layer) in enumerate(pieces):
                h = k % 2
                half = st.halves[h]
                pos, dev, k_seg, v_seg = plans[(j0, j1)]
                if layer is None:
                    s_table, k_flat, v_flat, d_table, shift = half.table, half.k_flat, half.v_flat, table, 0
                else:
                    s_table, k_flat, v_flat = half.layer_table, half.layer_k_flat, half.layer_v_flat
                    d_table, shift = layer_tables[layer], layer * per_layer
                # The staging side of a chunk's segments is the same for every layer: its views are
                # made once per chunk and buffer (a slice costs the host as much as the copy call).
                seg_views = views.get((j0, h))
                if seg_views is None:
                    seg_views = views[(j0, h)] = (_staged_segments(k_seg, k_flat), _staged_segments(v_seg, v_flat))
                copies = (
                    (seg_views[0], self._k_flat, shift * self.k_row_bytes),
                    (seg_views[1], self._v_flat, shift * self.v_row_bytes),
                )
                # The device copies go to ``aux`` without making it current (one stream switch less per
                # piece: these calls are the host's cost of a layer-by-layer load).
                if direction == "backup":
                    if cuda and k >= 2:
                        st.aux.wait_event(st.copies_done[h])  # this buffer's previous chunk is out
                    _copy_rows(k == 0, s_table, pos, d_table, dev, None, ("positions", "device_indices"), st.aux)
                    if cuda:
                        st.device_done[h].record(st.aux)
                        transfer.wait_event(st.device_done[h])
                    _copy_segments(copies, to_host=True)
                    if cuda:
                        st.copies_done[h].record(transfer)
                else:
                    if cuda and k >= 2:
                        transfer.wait_event(st.device_done[h])  # this buffer's previous chunk is scattered
                    _copy_segments(copies, to_host=False)
                    if cuda:
                        st.copies_done[h].record(transfer)
                        st.aux.wait_event(st.copies_done[h])
                    _copy_rows(k == 0, d_table, dev, s_table, pos, None, ("device_indices", "positions"), st.aux)
                    if cuda:
                        st.device_done[h].record(st.aux)
                    last_of_layer = k + 1 == len(pieces) or pieces[k + 1][2] != layer
                    if layer is not None and last_of_layer:
                        self._record_layer(layer, st.aux)
            if direction == "load" and all_layers:  # a token's layers travel together: every layer lands at once
                for layer in layers:
                    self._record_layer(layer, st.aux)
            queued = True
        finally:  # also after a failure part-way: the transfer stream ends after what aux has queued
            if cuda:
                if direction == "load" or not queued:
                    transfer.wait_stream(st.aux)
                d_idx.record_stream(st.aux)

    # --- pages for a storage tier (SGLang names) -----------------------------------------------------

    def _page_index(self, index: object) -> int:
        if isinstance(index, torch.Tensor) and index.numel() == 1 and not index.dtype.is_floating_point:
            index = int(index)
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"index must be an int (the page's first host slot), got {type(index).__name__}")
        index = int(index)
        if not 0 <= index < self.size or index % self.page_size:
            raise IndexError(
                f"index must be the first slot of a page (a multiple of {self.page_size} in 0..{self.size - 1}), got {index}"
            )
        return index

    def _page_views(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        sl = slice(index, index + self.page_size)
        if self.layout == "layer_first":
            return self.k_buffer[:, sl], self.v_buffer[:, sl]
        return self.k_buffer[sl], self.v_buffer[sl]

    @property
    def page_bytes(self) -> tuple[int, int]:
        """Bytes of one page of every layer: (K, V)."""
        return self.page_size * self.layer_num * self.k_row_bytes, self.page_size * self.layer_num * self.v_row_bytes

    def get_data_page(self, index: int, flat: bool = True):
        """The page starting at host slot ``index``, every layer. ``flat=True``: a new 1-D tensor of
        the storage dtype, K's bytes then V's, each in the layout's order (``layer_first``: [layers,
        page_size, H, D]; ``page_first``: [page_size, layers, H, D]). ``flat=False``: the (K, V)
        views themselves. Waits (on the host) for a backup still writing the page."""
        index = self._page_index(index)
        self._sync_pages(np.array([index // self.page_size]), for_write=False)
        k, v = self._page_views(index)
        if not flat:
            return k, v
        return torch.cat((k.reshape(-1), v.reshape(-1)))

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        """A zero page in ``get_data_page``'s flat form."""
        return torch.zeros(sum(self.page_bytes) // self.k_buffer.element_size(), dtype=self.store_dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        """Write a page in ``get_data_page``'s flat form at host slot ``index``. Checked (a 1-D CPU
        tensor of the storage dtype and the page's size) before anything is written; waits for
        transfers still using the page."""
        index = self._page_index(index)
        if not isinstance(data_page, torch.Tensor):
            raise TypeError(f"data_page must be a torch.Tensor, got {type(data_page).__name__}")
        numel = sum(self.page_bytes) // self.k_buffer.element_size()
        if data_page.dtype != self.store_dtype:
            raise ValueError(f"data_page must be {self.store_dtype}, got {data_page.dtype}")
        if data_page.dim() != 1 or data_page.shape[0] != numel:
            raise ValueError(f"data_page must be 1-D with {numel} elements (one page, K then V), got shape {tuple(data_page.shape)}")
        if data_page.device.type != "cpu":
            raise ValueError(f"data_page must be on cpu, got {data_page.device}")
        self._sync_pages(np.array([index // self.page_size]), for_write=True)
        k, v = self._page_views(index)
        nk = k.numel()
        k.copy_(data_page[:nk].view(k.shape))
        v.copy_(data_page[nk:].view(v.shape))

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        """Host addresses and byte sizes of the pages of ``indices`` (whole pages), for zero-copy
        storage I/O, as SGLang's: ``page_first``: per page, K's block then V's (every layer of the
        page); ``layer_first``: per page, per layer, K's block then V's."""
        self._drain()
        slots = self._host_slots(indices, "indices")
        firsts = slots[:: self.page_size].tolist()
        ptrs: list[int] = []
        sizes: list[int] = []
        kb, vb = self.k_buffer.data_ptr(), self.v_buffer.data_ptr()
        if self.layout == "page_first":
            k_size, v_size = self.page_bytes
            for s in firsts:
                ptrs += [kb + s * self.layer_num * self.k_row_bytes, vb + s * self.layer_num * self.v_row_bytes]
                sizes += [k_size, v_size]
        else:
            k_size, v_size = self.page_size * self.k_row_bytes, self.page_size * self.v_row_bytes
            for s in firsts:
                for layer in range(self.layer_num):
                    ptrs += [kb + (layer * self.size + s) * self.k_row_bytes, vb + (layer * self.size + s) * self.v_row_bytes]
                    sizes += [k_size, v_size]
        return ptrs, sizes


class MLATokenToKVPoolHost(MHATokenToKVPoolHost):
    """Host-memory KV pages for a device ``MLATokenToKVPool``, with SGLang's name and the same API
    and behaviour as :class:`MHATokenToKVPoolHost`.

    A latent row travels as the device pool presents it to row copies: a K part (its
    ``kv_lora_rank`` latent columns) and a V part (its ``qk_rope_head_dim`` rotary columns), so
    ``k_buffer`` holds the latent parts and ``v_buffer`` the rotary parts, each in the layout's order
    ([layer_num, size, 1, kv_lora_rank] and [layer_num, size, 1, qk_rope_head_dim] for
    ``"layer_first"``), and a flat data page is the page's latent parts, then its rotary parts.
    ``size_per_token`` is ``layer_num * (kv_lora_rank + qk_rope_head_dim)`` bytes of the storage dtype.
    """

    def __init__(
        self,
        device_pool,
        host_to_device_ratio: float,
        host_size: float,
        page_size: int,
        layout: str,
        pin_memory: bool = True,
        device: str = "cpu",
        *,
        validate: bool = False,
        kernel_programs: int = KERNEL_PROGRAMS,
        staging_bytes: int = STAGING_BYTES,
    ) -> None:
        from kvpool.pools.mla_pool import MLATokenToKVPool

        if not isinstance(device_pool, MLATokenToKVPool):
            raise TypeError(f"device_pool must be an MLATokenToKVPool, got {type(device_pool).__name__}")
        super().__init__(
            device_pool, host_to_device_ratio, host_size, page_size, layout, pin_memory, device,
            validate=validate, kernel_programs=kernel_programs, staging_bytes=staging_bytes,
        )  # fmt: skip
        self.kv_lora_rank, self.qk_rope_head_dim = device_pool.kv_lora_rank, device_pool.qk_rope_head_dim
