"""``MHATokenToKVPoolHost`` and ``MLATokenToKVPoolHost``: the host-memory tier below a device pool
(SGLang's HiCache host pool; the rules are docs/contract.md, "Host tier").

When the device pool fills, a scheduler parks KV pages here (``backup_from_device_all_layer``) and
brings them back layer by layer while the model runs (``load_to_device_per_layer``), or hands whole
pages to a storage tier (``get_data_page`` / ``set_from_flat_data_page`` / ``get_page_buffer_meta``).

This module holds the pool: its buffers and layout, its pages, the checks every call makes, and
each transfer's dispatch to a backend. Where and when the copies run (streams, ordering, the
background worker) is ``schedule.py``; how they run is ``kernel_backend.py`` (SM copies over pinned
memory) and ``direct_backend.py`` (the copy engine).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from kvpool.checks import check_in_range, check_index, check_same_length, layer_index, positive_int
from kvpool.config import validate_enabled
from kvpool.host.direct_backend import HOST_STAGING_BYTES, DirectBackend
from kvpool.host.kernel_backend import HOST_KERNEL_PROGRAMS, KernelBackend
from kvpool.host.layer_counter import LayerTransferCounter
from kvpool.host.memory import (
    LAYOUTS,
    check_host_memory,
    host_part_buffers,
    host_slots,
    layer_views,
    page_buffer_meta,
)
from kvpool.host.pages import HostPages
from kvpool.host.parts import LayerParts, device_rows, global_scales, layer_parts
from kvpool.host.schedule import Transfer, TransferScheduler
from kvpool.kernels.row_table import RowTable
from kvpool.pools.mla_fp4_pool import MLATokenToKVPoolFP4
from kvpool.pools.mla_pool import MLATokenToKVPool

IO_BACKENDS = ("kernel", "direct")

# What a device pool passed to a transfer must share with the one the host pool was built for (and
# its parts: names, row shapes, dtypes and format).
_GEOMETRY = ("layer_num", "start_layer", "dtype", "store_dtype", "device")


def check_device_indices(
    indices: object, host_indices: object, device_pool, rows: int, what: str, validate: bool
) -> torch.Tensor:
    """A transfer's ``device_indices``: int32/int64 on the device pool's device, as long as
    ``host_indices``, and below ``rows`` (``what`` names them in the error) where that is free to
    check: on a CPU pool, and on a GPU under ``validate`` (the host pool's or the device pool's: one
    synchronisation). Negative entries are padding. Raises ``TypeError``, ``ValueError`` or
    ``IndexError`` naming ``device_indices``."""
    check_index(indices, "device_indices", device=device_pool.device)
    check_same_length(host_indices, "host_indices", indices, "device_indices")  # type: ignore[arg-type]
    if device_pool.device.type == "cpu" or validate or getattr(device_pool, "validate", False):
        check_in_range([(indices, rows, "device_indices")], what=what)  # type: ignore[list-item]
    return indices  # type: ignore[return-value]


class MHATokenToKVPoolHost:
    """Host-memory KV pages for a device ``MHATokenToKVPool``, with SGLang's API; also for the pools
    whose rows carry scales beside their codes (``MHATokenToKVPoolFP4`` in either format,
    ``MHATokenToKVPoolFP8PerTokenHead``): every buffer of a layer travels, codes and scales together.

    Parameters
    ----------
    device_pool : the device pool whose rows this tier holds (its geometry and dtype).
    host_to_device_ratio : host slots per device slot, used when ``host_size`` <= 0.
    host_size : host memory in GB (1e9 bytes) when > 0.
    page_size : slots per host page; ``alloc`` and every transfer work in whole pages.
    layout : ``"layer_first"`` (K ``[layer_num, size, head_num, head_dim]``, V likewise with
        ``v_head_dim``) or ``"page_first"`` (``[size, layer_num, ...]``: a page of every layer is
        one block per K/V, ready for a storage tier).
    pin_memory : page-lock the host buffers when the device pool is on CUDA (the kernel backend
        needs it: the GPU reads and writes them through unified addressing).
    device : where the tier lives; ``"cpu"``.
    validate : also check device indices on the device (one synchronisation per transfer), and
        that host pages being moved are allocated. ``KVPOOL_VALIDATE=1`` turns it on too.
    kernel_programs : grid of the kernel backend (SMs it may occupy).
    staging_bytes : size of each of the direct backend's two device staging buffers per direction.

    Size in slots: ``host_size * 1e9 / size_per_token`` when ``host_size > 0``, else
    ``device_pool.size * host_to_device_ratio``, rounded down to whole pages; ``size_per_token`` is
    ``layer_num * head_num * (head_dim + v_head_dim)`` bytes of the storage dtype for a K/V pool,
    and the bytes of one row of every part of every layer for a pool with scales.

    Attributes
    ----------
    size, page_num, page_size, layout, layer_num, start_layer, end_layer, head_num, head_dim,
    v_head_dim : as the names say (layers use the device pool's global ids).
    dtype : the device pool's element type; ``store_dtype`` what the buffers hold (uint8 for FP8;
        SGLang's host pool calls that one ``dtype``).
    k_buffer, v_buffer : the host buffers (shapes as ``layout`` says); a pool with scales has one
        host buffer per device part, under the device pool's names (``k_scale_buffer``, ...).
    buffers : every host buffer, in the device pool's part order (``parts``).
    parts : the device pool's layer parts (:class:`~kvpool.host.parts.LayerParts`).
    global_scales : an NVFP4 pool's per-layer ``(k, v)`` global scales, as the device pool had
        them when this pool was built (empty otherwise); a transfer to or from a device pool with
        other global scales raises ``ValueError``.
    row_table : the host buffers' rows, ``K0, V0, K1, V1, ...`` like the device pool's (every part
        of a layer in turn for a pool with scales).
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
        kernel_programs: int = HOST_KERNEL_PROGRAMS,
        staging_bytes: int = HOST_STAGING_BYTES,
    ) -> None:
        #: What each layer of the device pool holds and this pool mirrors: every part (codes and scales).
        self.parts: LayerParts = layer_parts(device_pool)
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
        self.head_num = getattr(device_pool, "head_num", None)
        self.head_dim = getattr(device_pool, "head_dim", None)
        self.v_head_dim = getattr(device_pool, "v_head_dim", None)
        self.dtype, self.store_dtype = device_pool.dtype, device_pool.store_dtype
        #: An NVFP4 pool's per-layer (k, v) global scales when this pool was built: every page it holds
        #: was saved under them, so a transfer refuses a device pool with others.
        self.global_scales = global_scales(device_pool)
        self.part_row_bytes = self.parts.row_bytes
        self.size_per_token = self.layer_num * sum(self.part_row_bytes)

        size = host_slots(host_size, host_to_device_ratio, device_pool.size, self.size_per_token)
        self.page_num = size // self.page_size
        self.size = self.page_num * self.page_size
        if self.page_num == 0:
            raise ValueError(
                f"the host pool must hold at least one page of {self.page_size} slots, got {size} slots "
                f"({size * self.size_per_token} bytes)"
            )
        check_host_memory(self.size, self.size_per_token)

        cuda = device_pool.device.type == "cuda"
        self.pin_memory = bool(pin_memory) and cuda
        lead = (self.layer_num, self.size) if layout == "layer_first" else (self.size, self.layer_num)
        self.buffers, self._pinned = host_part_buffers(
            [((*lead, *row), dtype) for row, dtype in zip(self.parts.rows, self.parts.dtypes)], self.pin_memory
        )
        for name, buf in zip(self.parts.names, self.buffers):
            setattr(self, name, buf)
        layers = zip(*(layer_views(b, layout) for b in self.buffers))
        self.row_table = RowTable.of(
            [t for parts in layers for t in parts],
            table_device=device_pool.device if self.pin_memory else None,
            pinned=self.pin_memory or None,
        )
        self._device_tables = self._tables(device_pool)
        self._pages = HostPages(self.page_num, self.page_size)
        self.layer_transfer_counter = LayerTransferCounter(self.layer_num, device_pool.device)
        self._scheduler = TransferScheduler(device_pool.device, self.page_num, self.layer_transfer_counter)
        self.load_stream, self.backup_stream = self._scheduler.load_stream, self._scheduler.backup_stream
        self._backends = {
            "kernel": KernelBackend(self.row_table, self.kernel_programs, len(self.buffers)),
            "direct": DirectBackend(layout, self.buffers, self.row_table, self.staging_bytes),
        }
        self._all_layers = list(range(self.layer_num))
        # The last load's host side (host_indices, its version, backend, device pool, transfer): a
        # controller loading layer by layer passes the same host_indices each time.
        self._last_load: Optional[tuple] = None

    # --- allocation (SGLang names) -------------------------------------------------------------------

    def clear(self) -> None:
        """Every page free again (contents are left as they are)."""
        self._pages.clear()

    def available_size(self) -> int:
        """Free slots (a multiple of ``page_size``)."""
        return self._pages.available_size()

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """``need_size`` slots in whole pages (each page's slots consecutive): an int64 CPU tensor, or
        None (nothing changes) when fewer are free. ``need_size`` must be a multiple of page_size."""
        return self._pages.alloc(need_size)

    def free(self, indices: torch.Tensor) -> int:
        """Give back whole pages (as ``alloc`` returned them, any order of pages). Returns the number
        of slots freed. Raises ValueError for slots that are not whole allocated pages (a double free,
        say), before anything changes."""
        return self._pages.free(indices)

    def get_size_per_token(self) -> int:
        """Bytes of one slot over every layer, K and V together (SGLang's name)."""
        return self.size_per_token

    # --- checks --------------------------------------------------------------------------------------

    def _tables(self, device_pool) -> tuple[RowTable, list[RowTable]]:
        """A device pool's row table (every part of every layer: ``K0, V0, K1, V1, ...`` for a K/V
        pool) and each layer's parts."""
        table, n = device_rows(device_pool), len(self.buffers)
        return table, [table.select(n * i, n * i + n) for i in range(self.layer_num)]

    def _check_device_pool(self, device_pool: object) -> None:
        if device_pool is not self.device_pool:
            parts = layer_parts(device_pool)
            for name in ("head_num", "head_dim", "v_head_dim") + _GEOMETRY:
                want = getattr(self.device_pool, name, None)
                got = getattr(device_pool, name, None)
                if got != want:
                    raise ValueError(
                        f"device_pool must have {name}={want} like the pool this host pool was built for, got {got}"
                    )
            if parts != self.parts:
                raise ValueError(
                    f"device_pool must have the parts of the pool this host pool was built for "
                    f"({self.parts.kind}, {self.parts.fmt}: {dict(zip(self.parts.names, self.parts.rows))}), got "
                    f"{parts.kind}, {parts.fmt}: {dict(zip(parts.names, parts.rows))}"
                )
        scales = global_scales(device_pool)
        if scales != self.global_scales:
            raise ValueError(
                f"device_pool must have the NVFP4 global scales the host pages were saved under "
                f"{self.global_scales} (per layer (k, v)), got {scales}: set_global_scales before building the host pool"
            )

    def _transfer(
        self, direction: str, device_pool, host_indices, device_indices, io_backend: str, layers: list[int]
    ) -> Optional[Transfer]:
        """Every check of a transfer, before anything is copied; None when it moves nothing."""
        if io_backend not in IO_BACKENDS:
            raise ValueError(f"io_backend must be one of {', '.join(IO_BACKENDS)}, got {io_backend!r}")
        self._check_device_pool(device_pool)
        if io_backend == "kernel" and device_pool.device.type == "cuda" and not self.pin_memory:
            raise ValueError(
                "io_backend='kernel' reads host memory from the GPU and needs pin_memory=True; got "
                "pin_memory=False (use 'direct')"
            )
        table, layer_tables = self._device_tables if device_pool is self.device_pool else self._tables(device_pool)
        slots = self._pages.slots(host_indices, "host_indices")
        d_idx = check_device_indices(device_indices, host_indices, device_pool, table.rows, "rows", self.validate)
        pages = self._pages.transfer_pages(slots, direction == "backup", self.validate)
        if slots.shape[0] == 0:
            return None
        return Transfer(direction, slots, pages, d_idx, table, layer_tables, layers)

    def _load_transfer(self, device_pool, host_indices, device_indices, io_backend: str, layers: list[int]):
        """A load's checked transfer (None when it moves nothing). The host side of the previous load
        is reused when the same, unchanged ``host_indices`` come again (a controller loading layer by
        layer): its checked slots and their copy on the device."""
        self._scheduler.drain()
        last = self._last_load
        if (
            last is not None
            and last[0] is host_indices
            and last[1] == host_indices._version
            and last[2] == io_backend
            and last[3] is device_pool
            and global_scales(device_pool) == self.global_scales  # else _transfer refuses it
        ):
            prev: Transfer = last[4]
            rows = prev.device_rows.rows
            d_idx = check_device_indices(device_indices, host_indices, device_pool, rows, "rows", self.validate)
            t = Transfer("load", prev.slots, prev.pages, d_idx, prev.device_rows, prev.device_layers, layers)
            t.host_index = prev.host_index
        else:
            t = self._transfer("load", device_pool, host_indices, device_indices, io_backend, layers)
            if t is None:
                return None
            self._last_load = (host_indices, host_indices._version, io_backend, device_pool, t)
        # Layer by layer only where a model waits layer by layer: with this pool's counter registered
        # on the device pool. Otherwise nobody can start on a layer before the others, and the
        # kernel backend moves every layer in one launch (fewer launches for the host to queue, and
        # a token's layers read together, which page_first memory favours).
        waits_per_layer = getattr(device_pool, "layer_transfer_counter", None) is self.layer_transfer_counter
        t.together = len(layers) > 1 and not waits_per_layer
        return t

    # --- transfers (the host pool's dispatch: check, then one backend call through the scheduler) ----

    def backup_from_device_all_layer(
        self, device_pool, host_indices: torch.Tensor, device_indices: torch.Tensor, io_backend: str = "kernel"
    ) -> Optional[torch.cuda.Event]:
        """For every layer, host row ``host_indices[i]`` becomes a byte copy of device row
        ``device_indices[i]``, K and V.

        ``host_indices``: int32/int64 CPU tensor of whole allocated pages (``alloc``'s output), each
        page once; ``device_indices``: int32/int64 on the device pool's device, same length; a
        negative entry is padding (its host row is left as it is). Checked before anything is
        copied. On CUDA the copy is enqueued on ``backup_stream`` after the compute stream's work so
        far, and the returned event completes when it has read every row: wait on it
        (``torch.cuda.current_stream().wait_event(e)``, or ``wait_for_backups()``) before
        overwriting the device slots. On a CPU pool the copy is done on return (None is returned)."""
        return self.run_backup(self.check_backup(device_pool, host_indices, device_indices, io_backend), io_backend)

    def check_backup(
        self, device_pool, host_indices: torch.Tensor, device_indices: torch.Tensor, io_backend: str = "kernel"
    ) -> Optional[Transfer]:
        """Every check of ``backup_from_device_all_layer``, copying nothing: the transfer to hand to
        :meth:`run_backup`, or None when it moves nothing (a host pool above this one checks all
        its parts before any copies)."""
        self._scheduler.drain()
        return self._transfer("backup", device_pool, host_indices, device_indices, io_backend, self._all_layers)

    def run_backup(self, t: Optional[Transfer], io_backend: str = "kernel") -> Optional[torch.cuda.Event]:
        """Queue a backup :meth:`check_backup` returned (with the same ``io_backend``); its event on CUDA."""
        return None if t is None else self._scheduler.backup(self._backends[io_backend], t)

    def load_to_device_per_layer(
        self,
        device_pool,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        layer_id: int,
        io_backend: str = "kernel",
    ) -> None:
        """Layer ``layer_id`` (the global id, as the device pool's getters take it): device K/V row
        ``device_indices[i]`` becomes a byte copy of host row ``host_indices[i]``. Negative device
        indices are padding, and device rows out of range are never written. On CUDA it is enqueued
        on ``load_stream`` after the compute stream's work so far, and records the layer's event in
        ``layer_transfer_counter``."""
        t = self.check_load(device_pool, host_indices, device_indices, io_backend, layer_id)
        if t is not None:  # the scheduler directly: a per-layer load's frames down to its copy are few
            self._scheduler.load(self._backends[io_backend], t)

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
        its model's work at once instead of after the whole load's host time. A getter of a layer
        not queued yet waits on the host until it is (see
        :class:`~kvpool.host.layer_counter.LayerTransferCounter`); if the worker fails, the getters
        of the layers it did not queue raise, and so does the next call on this host pool. Every
        other transfer or page call on this host pool first waits (host) for the worker to finish
        queueing. Code that reads the device pool's buffers without the getters (a CUDA graph
        replay, a direct buffer read) or captures a CUDA graph must call ``wait_for_loads()`` first,
        and ``device_indices`` must not change before then (the worker reads it when it queues the
        layers; on a CPU pool it does the copies). Without the counter registered, or for a
        one-layer pool, the load is queued before returning, as with ``background=False``. A host
        pool is not thread-safe: call it from one thread (the worker is its own)."""
        t = self.check_load(device_pool, host_indices, device_indices, io_backend)
        self.run_load(t, io_backend, background)

    def check_load(
        self, device_pool, host_indices: torch.Tensor, device_indices: torch.Tensor, io_backend: str = "kernel",
        layer_id: Optional[int] = None,
    ) -> Optional[Transfer]:  # fmt: skip
        """Every check of a load of layer ``layer_id`` (global id; None: every layer), copying
        nothing: the transfer to hand to :meth:`run_load`, or None when it moves nothing."""
        if layer_id is None:
            return self._load_transfer(device_pool, host_indices, device_indices, io_backend, self._all_layers)
        layer = layer_index(layer_id, self.start_layer, self.end_layer, "the pool's")
        return self._load_transfer(device_pool, host_indices, device_indices, io_backend, [layer])

    def run_load(self, t: Optional[Transfer], io_backend: str = "kernel", background: bool = False) -> None:
        """Queue a load :meth:`check_load` returned (with the same ``io_backend``); ``background`` as
        for ``load_to_device_all_layer``."""
        if t is not None:
            background = background and not t.together and self.layer_num > 1
            self._scheduler.load(self._backends[io_backend], t, background)

    def wait_for_loads(self) -> None:
        """Make the current stream wait for every load enqueued so far (no device sync; the host
        waits for a background load to finish queueing)."""
        self._scheduler.wait_for_loads()

    def wait_for_backups(self) -> None:
        """Make the current stream wait for every backup enqueued so far (no host sync): after it,
        the compute stream may overwrite device slots that were backed up."""
        self._scheduler.wait_for_backups()

    # --- pages for a storage tier (SGLang names) -----------------------------------------------------

    def _page_views(self, index: int) -> tuple[torch.Tensor, ...]:
        sl = slice(index, index + self.page_size)
        if self.layout == "layer_first":
            return tuple(b[:, sl] for b in self.buffers)
        return tuple(b[sl] for b in self.buffers)

    @property
    def page_bytes(self) -> tuple[int, ...]:
        """Bytes of one page of every layer, per part: (K, V) for a K/V pool; codes then scales, in
        the device pool's ``part_names`` order, for a pool with scales beside its codes."""
        return tuple(self.page_size * self.layer_num * r for r in self.part_row_bytes)

    def _flat_numel(self) -> int:
        return sum(self.page_bytes) // self.store_dtype.itemsize

    def get_data_page(self, index: int, flat: bool = True):
        """The page starting at host slot ``index``, every layer. ``flat=True``: a new 1-D tensor of
        the storage dtype, the bytes of each part in turn (K's then V's; codes then scales for a pool
        with scales), each in the layout's order (``layer_first``: [layers, page_size, ...];
        ``page_first``: [page_size, layers, ...]). ``flat=False``: the parts' views themselves ((K, V)
        for a K/V pool). Waits (on the host) for a backup still writing the page."""
        index = self._pages.page_index(index)
        self._scheduler.sync_pages(np.array([index // self.page_size]), for_write=False)
        views = self._page_views(index)
        if not flat:
            return views
        return torch.cat([v.view(torch.uint8).reshape(-1) for v in views]).view(self.store_dtype)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        """A zero page in ``get_data_page``'s flat form."""
        return torch.zeros(self._flat_numel(), dtype=self.store_dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        """Write a page in ``get_data_page``'s flat form at host slot ``index``. Checked (a 1-D CPU
        tensor of the storage dtype and the page's size) before anything is written; waits for
        transfers still using the page."""
        index = self._pages.page_index(index)
        if not isinstance(data_page, torch.Tensor):
            raise TypeError(f"data_page must be a torch.Tensor, got {type(data_page).__name__}")
        numel = self._flat_numel()
        if data_page.dtype != self.store_dtype:
            raise ValueError(f"data_page must be {self.store_dtype}, got {data_page.dtype}")
        if data_page.dim() != 1 or data_page.shape[0] != numel:
            what = "K then V" if self.parts.kv_only else "every part"
            raise ValueError(
                f"data_page must be 1-D with {numel} elements (one page, {what}), got shape {tuple(data_page.shape)}"
            )
        if data_page.device.type != "cpu":
            raise ValueError(f"data_page must be on cpu, got {data_page.device}")
        self._scheduler.sync_pages(np.array([index // self.page_size]), for_write=True)
        data = data_page.view(torch.uint8)
        at = 0
        for view in self._page_views(index):
            dst = view.view(torch.uint8)
            dst.copy_(data[at : at + dst.numel()].view(dst.shape))
            at += dst.numel()

    def sync_pages_for_write(self, indices: torch.Tensor) -> None:
        """Wait (on the host) for the transfers still writing or reading the pages of ``indices``
        (whole aligned pages in range, checked first): host code may write their bytes afterwards."""
        firsts = self._pages.slots(indices, "indices")[:: self.page_size]
        if firsts.size:
            self._scheduler.sync_pages(firsts // self.page_size, for_write=True)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        """Host addresses and byte sizes of the pages of ``indices`` (whole pages), for zero-copy
        storage I/O, as SGLang's: ``page_first``: per page, each part's block (K's then V's; every
        layer of the page); ``layer_first``: per page, per layer, each part's block."""
        self._scheduler.drain()
        firsts = self._pages.slots(indices, "indices")[:: self.page_size].tolist()
        return page_buffer_meta(self.buffers, self.layout, self.layer_num, self.page_size, firsts)


class MLATokenToKVPoolHost(MHATokenToKVPoolHost):
    """Host-memory KV pages for a device ``MLATokenToKVPool`` or ``MLATokenToKVPoolFP4``: SGLang's
    name, and the arguments, API and behaviour of :class:`MHATokenToKVPoolHost`.

    A latent row travels as the device pool presents it to row copies: an ``MLATokenToKVPool``'s as
    a K part (its ``kv_lora_rank`` latent columns) and a V part (its ``qk_rope_head_dim`` rotary
    columns), so ``k_buffer`` holds the latent parts and ``v_buffer`` the rotary parts (``head_num``
    1), and a flat data page is the page's latent parts, then its rotary parts; ``size_per_token``
    is ``layer_num * (kv_lora_rank + qk_rope_head_dim)`` bytes of the storage dtype. An
    ``MLATokenToKVPoolFP4``'s as its packed codes and their scale bytes (``kv_buffer``,
    ``kv_scale_buffer``).
    """

    def __init__(self, device_pool, *args, **kwargs) -> None:
        if not isinstance(device_pool, (MLATokenToKVPool, MLATokenToKVPoolFP4)):
            raise TypeError(
                f"device_pool must be an MLATokenToKVPool or MLATokenToKVPoolFP4, got {type(device_pool).__name__}"
            )
        super().__init__(device_pool, *args, **kwargs)
        self.kv_lora_rank, self.qk_rope_head_dim = device_pool.kv_lora_rank, device_pool.qk_rope_head_dim
