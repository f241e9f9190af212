"""``SWAKVPoolHost``: the host tier of a sliding-window model's ``SWAKVPool`` (docs/contract.md,
"Host tier for sliding-window models").

Two host pools of the host tier's own kind, one per part: ``full_host`` over the full-attention
layers, ``swa_host`` over the sliding-window layers, with the host memory split between them as the
device parts split theirs. Callers hold host full slots only, as they hold device full slots only:
its book (``swa_pages.py``) says, per host page of the full part, which page of the SWA part holds
its sliding-window rows (if any) and which of its slots hold one. Which device slots have an SWA
part the full-to-SWA mapping says, on the device; on a GPU a backup does not wait to read it (the
book says how). A load writes the SWA rows to the SWA slots the mapping gives the new full slots.
Every call checks both parts before either copies anything.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from kvpool.checks import INDEX_DTYPES, check_in_range, check_index
from kvpool.host.direct_backend import HOST_STAGING_BYTES
from kvpool.host.kernel_backend import HOST_KERNEL_PROGRAMS
from kvpool.host.parts import layer_parts
from kvpool.host.pool import MHATokenToKVPoolHost
from kvpool.host.schedule import Transfer
from kvpool.host.swa_pages import SWAPages, page_slots, to_device
from kvpool.pools.swa_pool import SWAKVPool, SWALayerTransferCounters, translate_slots

_CPU = torch.device("cpu")


def part_bytes(part) -> int:
    """Bytes a device part's usable slots hold over every layer, K and V and any scales beside them
    (its host pool's ``size_per_token`` times its ``size``)."""
    return part.size * part.layer_num * sum(layer_parts(part).row_bytes)


def split_host_size(host_size: object, full_bytes: int, swa_bytes: int) -> tuple[float, float]:
    """``host_size`` GB split between the full and the SWA part as ``full_bytes : swa_bytes`` (the
    device parts' bytes); a size <= 0 (use the ratio) is passed to both unchanged. Raises
    ``ValueError`` for a ``host_size`` that is not a finite number."""
    if isinstance(host_size, bool) or not isinstance(host_size, (int, float)) or not math.isfinite(host_size):
        raise ValueError(f"host_size must be a number of GB (<= 0: use host_to_device_ratio), got {host_size!r}")
    if host_size <= 0:
        return host_size, host_size
    full = host_size * full_bytes / (full_bytes + swa_bytes)
    return full, host_size - full


class SWAKVPoolHost:
    """Host-memory KV pages for a device ``SWAKVPool``: its full rows and, for the slots that have
    one, its sliding-window rows.

    Parameters
    ----------
    device_pool : the ``SWAKVPool`` whose rows this tier holds (a mapping registered before transfers).
    host_to_device_ratio : host slots per device slot of each part, used when ``host_size`` <= 0.
    host_size : host memory in GB (1e9 bytes) when > 0, split between the parts as the device
        parts' bytes split (``full.size * full bytes per token : size_swa * SWA bytes per token``).
    page_size, layout, pin_memory, device, validate, kernel_programs, staging_bytes : as for
        ``MHATokenToKVPoolHost``, for both parts.

    Attributes
    ----------
    full_host, swa_host : the parts' ``MHATokenToKVPoolHost`` (over ``full_kv_pool`` and ``swa_kv_pool``).
    book : the ``SWAPages`` saying which SWA page holds each host full page's SWA rows.
    size, page_size, layout : the full part's: host full slots ``0..size-1`` in whole pages.
    layer_transfer_counter : an ``SWALayerTransferCounters`` of both parts' counters, for
        ``SWAKVPool.register_layer_transfer_counter``.

    Examples
    --------
    >>> host = SWAKVPoolHost(pool, 2.0, 0, 1, "layer_first")
    >>> h = host.alloc(4)                                    # host full slots
    >>> host.backup_from_device_all_layer(pool, h, full_slots)
    >>> host.load_to_device_all_layer(pool, h, new_full_slots)  # SWA rows at the new slots' SWA slots
    """

    def __init__(
        self,
        device_pool: SWAKVPool,
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
        if not isinstance(device_pool, SWAKVPool):
            raise TypeError(f"device_pool must be an SWAKVPool, got {type(device_pool).__name__}")
        self.device_pool = device_pool
        full, swa = device_pool.full_kv_pool, device_pool.swa_kv_pool
        full_gb, swa_gb = split_host_size(host_size, part_bytes(full), part_bytes(swa))
        options = dict(validate=validate, kernel_programs=kernel_programs, staging_bytes=staging_bytes)
        self.full_host = MHATokenToKVPoolHost(full, host_to_device_ratio, full_gb, page_size, layout, pin_memory,
                                              device, **options)  # fmt: skip
        self.swa_host = MHATokenToKVPoolHost(swa, host_to_device_ratio, swa_gb, page_size, layout, pin_memory,
                                             device, **options)  # fmt: skip
        f = self.full_host
        self.size, self.page_size, self.layout, self.device = f.size, f.page_size, f.layout, f.device
        self.validate = f.validate
        self.layer_transfer_counter = SWALayerTransferCounters(
            f.layer_transfer_counter, self.swa_host.layer_transfer_counter
        )
        # Read which slots have an SWA part before a backup where that is free (a CPU pool) or
        # checked anyway (validate); on a GPU learn it afterwards instead of waiting for the device.
        self._exact_backup = device_pool.device.type == "cpu" or self.validate
        self._no_rows = torch.empty(0, dtype=torch.int64)
        self._no_device_rows = torch.empty(0, dtype=torch.int64, device=device_pool.device)
        self.book = SWAPages(f.page_num, f.page_size, self.swa_host, device_pool.device)
        self._last_load: Optional[tuple] = None

    # --- host slots -----------------------------------------------------------------------------------

    def clear(self) -> None:
        """Every page of both parts free again (contents are left as they are)."""
        self.full_host.clear()
        self.swa_host.clear()
        self.book.clear()
        self._last_load = None

    def available_size(self) -> int:
        """Free host full slots (a multiple of ``page_size``)."""
        return self.full_host.available_size()

    def swa_available_size(self) -> int:
        """Free slots of the SWA part. A backup takes a page of them per full page with SWA rows; on a
        GPU, per full page it parks, until a later call learns which pages needed none."""
        return self.swa_host.available_size()

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """``need_size`` host full slots in whole pages (``MHATokenToKVPoolHost.alloc``), or None."""
        return self.full_host.alloc(need_size)

    def free(self, indices: torch.Tensor) -> int:
        """Give back whole allocated pages of host full slots, and the SWA pages holding their
        sliding-window rows; returns the number of full slots. Raises as
        ``MHATokenToKVPoolHost.free``, before anything changes."""
        n = self.full_host.free(indices)  # checks everything first
        self.book.freed(indices.numpy().astype(np.int64))
        return n

    def has_swa_rows(self, host_indices: torch.Tensor) -> torch.Tensor:
        """Which of ``host_indices`` (host full slots, an int32/int64 CPU tensor) hold sliding-window
        rows: a bool CPU tensor of the same length. On a GPU it first waits (host) for what earlier
        backups read of the mapping to arrive."""
        check_index(host_indices, "host_indices", dtypes=INDEX_DTYPES, ndim=1, device=_CPU, where="cpu (host slots)")
        check_in_range([(host_indices, self.size, "host_indices")], what="host slots", negative_ok=False)
        return torch.from_numpy(self.book.has_swa(host_indices.numpy()))

    # --- checks ---------------------------------------------------------------------------------------

    def _mapping(self, device_pool: object, io_backend: str) -> torch.Tensor:
        """The checks of a transfer's device pool and backend that involve the SWA part; the mapping."""
        if device_pool is not self.device_pool:  # (the pool built for passes these checks by construction)
            if not isinstance(device_pool, SWAKVPool):
                raise TypeError(f"device_pool must be an SWAKVPool, got {type(device_pool).__name__}")
            if device_pool.layers_mapping != self.device_pool.layers_mapping:
                raise ValueError("device_pool must have the sliding-window and full-attention layer ids of the "
                                 "pool this host pool was built for")  # fmt: skip
            # The SWA part's geometry, on an empty transfer (it copies nothing); the backend and the
            # pinning are the full part's, checked by its own transfer.
            self.swa_host.check_backup(device_pool.swa_kv_pool, self._no_rows, self._no_device_rows, io_backend)
        mapping = device_pool.full_to_swa_index_mapping
        if mapping is None:
            raise ValueError("device_pool needs its full-to-SWA mapping: call register_mapping first "
                             "(SWATokenToKVPoolAllocator does when given the pool as kvcache)")  # fmt: skip
        return mapping

    # --- transfers ------------------------------------------------------------------------------------

    def backup_from_device_all_layer(
        self, device_pool: SWAKVPool, host_indices: torch.Tensor, device_indices: torch.Tensor,
        io_backend: str = "kernel",
    ) -> Optional[torch.cuda.Event]:  # fmt: skip
        """For every full-attention layer, host full row ``host_indices[i]`` becomes a byte copy of
        device full row ``device_indices[i]``; for every sliding-window layer, where the mapping
        gives ``device_indices[i]`` an SWA slot, a host SWA row (of the SWA page this pool keeps for
        that host page) becomes a copy of that SWA slot's row. Slots with no SWA part (mapping 0, or
        padding) keep no SWA row.

        Arguments and their checks are ``MHATokenToKVPoolHost.backup_from_device_all_layer``'s; a
        host page that held SWA rows from an earlier backup keeps its SWA page if it needs one again
        and gives it back otherwise. Which device slots have an SWA part the mapping says on the
        device. On CUDA (without ``validate``) the backup does not wait for it: it gives every page
        an SWA page and decides on the device which rows to keep; the pages that needed none go
        back once a later call (a backup, ``free``, ``has_swa_rows``) finds that record on the host,
        and a backup short of SWA pages waits for the earlier records, then, still short, for its
        own (one synchronisation). On CUDA returns an event that completes once both parts' rows
        have been read; None on a CPU pool (done on return).

        Raises
        ------
        TypeError, ValueError, IndexError
            As the MHA host pool's backup; also ``ValueError`` for a pool without a mapping, of other
            layers, or when the SWA part has too few free pages (``swa_available_size()``). Nothing
            is copied and no host slot changes.
        """
        mapping = self._mapping(device_pool, io_backend)
        t_full = self.full_host.check_backup(device_pool.full_kv_pool, host_indices, device_indices, io_backend)
        if t_full is None:
            return None
        book = self.book
        book.learn(wait=False)
        parts = None
        if not self._exact_backup:
            for wait in (False, True):  # room for an SWA page per page, if need be once earlier ones are known
                if wait:
                    book.learn(wait=True)
                if book.missing(t_full.pages) * self.page_size <= self.swa_host.available_size():
                    parts = self._park_unknown(device_pool, mapping, t_full, device_indices)
                    break
        if parts is None:  # a CPU pool, validate, or an SWA part too full to guess: read the mapping now
            parts = self._park_known(device_pool, mapping, t_full, device_indices)
        t_swa = self.swa_host.check_backup(device_pool.swa_kv_pool, parts[0], parts[1], io_backend)
        swa_event = self.swa_host.run_backup(t_swa, io_backend)
        if swa_event is not None:  # the returned event covers both parts
            self.full_host.backup_stream.wait_event(swa_event)  # type: ignore[union-attr]
        return self.full_host.run_backup(t_full, io_backend)

    def _park_known(
        self, device_pool: SWAKVPool, mapping: torch.Tensor, t_full: Transfer, device_indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A backup's SWA part, which slots have one read from the mapping first (on a GPU, a
        synchronisation): an SWA page for each page with SWA rows, given back by pages that need
        none now. Returns (host SWA slots, device SWA slots); raises before any bookkeeping changes."""
        swa = translate_slots(mapping, device_indices).cpu().numpy()
        rows = device_pool.swa_kv_pool.rows
        bad = np.flatnonzero(swa >= rows)
        if bad.shape[0]:  # a corrupt mapping: refused here, so that the SWA part's own check cannot fail later
            i = int(bad[0])
            raise IndexError(
                f"the full-to-SWA mapping gives device_indices[{i}] the SWA slot {int(swa[i])}, outside the SWA "
                f"pool's {rows} rows; nothing copied"
            )
        has = swa > 0  # 0: no SWA part; -1: padding
        kept = self.book.park_known(t_full.pages, t_full.slots, has)
        ps = self.page_size
        host_swa = torch.from_numpy(page_slots(self.book.swa_page[t_full.pages[kept]], ps))
        entries = (kept[:, None] * ps + np.arange(ps)).reshape(-1)
        return host_swa, torch.from_numpy(np.where(has[entries], swa[entries], -1)).to(device_pool.device)

    def _park_unknown(
        self, device_pool: SWAKVPool, mapping: torch.Tensor, t_full: Transfer, device_indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A backup's SWA part without waiting for the device: an SWA page for every page (the caller
        checked there is room), the slots' SWA part decided on the device and recorded there, and a
        copy of that record on its way to the host (``SWAPages.learn`` applies it)."""
        swa = translate_slots(mapping, device_indices)
        has = (swa > 0) & (swa < device_pool.swa_kv_pool.rows)  # a slot past the pool is never read
        self.book.park_unknown(t_full.pages, t_full.slots, has)
        host_swa = torch.from_numpy(page_slots(self.book.swa_page[t_full.pages], self.page_size))
        return host_swa, torch.where(has, swa, -1)

    def _swa_load(
        self, device_pool: SWAKVPool, mapping: torch.Tensor, t_full: Transfer, host_indices: torch.Tensor,
        device_indices: torch.Tensor,
    ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
        """The SWA part of a checked load: (host SWA slots, device SWA slots), or None when no host
        slot of it holds SWA rows. The host side is reused while ``host_indices`` and this pool's
        bookkeeping are unchanged (a controller loading layer by layer passes the same tensor)."""
        key = (host_indices, host_indices._version, self.book.generation, device_pool.device)
        last = self._last_load
        if last is not None and last[0] is key[0] and last[1:4] == key[1:]:
            side = last[4]
        else:
            ps, slots = self.page_size, t_full.slots
            held = self.book.swa_page[t_full.pages]
            kept = np.flatnonzero(held >= 0)
            side = None
            if kept.shape[0]:
                entries = (kept[:, None] * ps + np.arange(ps)).reshape(-1)
                host_swa = torch.from_numpy(page_slots(held[kept], ps))
                side = (host_swa, to_device(torch.from_numpy(entries), device_pool.device),
                        to_device(torch.from_numpy(slots[entries]), device_pool.device))  # fmt: skip
            self._last_load = (*key, side)
        if side is None:
            return None
        host_swa, entries_dev, slots_dev = side
        swa = translate_slots(mapping, device_indices[entries_dev])
        return host_swa, torch.where(self.book.has_dev[slots_dev] & (swa > 0), swa, -1)

    def _load(
        self, device_pool: SWAKVPool, host_indices: torch.Tensor, device_indices: torch.Tensor, io_backend: str,
        layer: Optional[tuple[int, bool]], background: bool,
    ) -> None:  # fmt: skip
        mapping = self._mapping(device_pool, io_backend)
        full_layer = None if layer is None or layer[1] else layer[0]
        full = device_pool.full_kv_pool
        t_full = self.full_host.check_load(full, host_indices, device_indices, io_backend, full_layer)
        if t_full is None:
            return
        t_swa = None
        if layer is None or layer[1]:
            swa = self._swa_load(device_pool, mapping, t_full, host_indices, device_indices)
            if swa is not None:
                swa_layer = None if layer is None else layer[0]
                t_swa = self.swa_host.check_load(device_pool.swa_kv_pool, swa[0], swa[1], io_backend, swa_layer)
        if layer is None or not layer[1]:
            self.full_host.run_load(t_full, io_backend, background)
        self.swa_host.run_load(t_swa, io_backend, background)

    def load_to_device_per_layer(
        self, device_pool: SWAKVPool, host_indices: torch.Tensor, device_indices: torch.Tensor, layer_id: int,
        io_backend: str = "kernel",
    ) -> None:  # fmt: skip
        """Global layer ``layer_id``: a full-attention layer's rows ``device_indices[i]`` become
        byte copies of host full rows ``host_indices[i]``; a sliding-window layer's SWA rows of the
        host slots that hold them land at the SWA slots the mapping gives ``device_indices[i]`` (a
        new slot with no SWA part, or a host slot without an SWA row, writes nothing). Records the
        layer's event in its part's counter. Checks as ``MHATokenToKVPoolHost``'s (both index
        tensors checked for either kind of layer); ``ValueError`` for a layer of neither kind."""
        if isinstance(layer_id, bool) or not isinstance(layer_id, int):
            raise TypeError(f"layer_id must be an int, got {type(layer_id).__name__}")
        layer = self.device_pool.layers_mapping.get(layer_id)
        if layer is None:
            raise ValueError(
                f"layer_id {layer_id} is not a layer of this pool: its sliding-window layers are "
                f"{list(self.device_pool.swa_attention_layer_ids)}, its full-attention layers "
                f"{list(self.device_pool.full_attention_layer_ids)}"
            )
        self._load(device_pool, host_indices, device_indices, io_backend, layer, False)

    def load_to_device_all_layer(
        self, device_pool: SWAKVPool, host_indices: torch.Tensor, device_indices: torch.Tensor,
        io_backend: str = "kernel", *, background: bool = False,
    ) -> None:  # fmt: skip
        """Every layer of both parts (``load_to_device_per_layer``'s rule for each), each part on its
        host pool's load stream, layer by layer where its counter is registered on the device part
        (``SWAKVPool.register_layer_transfer_counter(host.layer_transfer_counter)``);
        ``background`` as for ``MHATokenToKVPoolHost.load_to_device_all_layer``, in each part."""
        self._load(device_pool, host_indices, device_indices, io_backend, None, background)

    def wait_for_loads(self) -> None:
        """The current stream waits for every load of either part queued so far (a stream wait)."""
        self.full_host.wait_for_loads()
        self.swa_host.wait_for_loads()

    def wait_for_backups(self) -> None:
        """The current stream waits for every backup of either part queued so far (a stream wait)."""
        self.full_host.wait_for_backups()
        self.swa_host.wait_for_backups()
