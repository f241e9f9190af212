"""The host tier for hybrid models: a ``MambaPool``'s state slots parked in host memory
(``MambaPoolHost``, SGLang's name), and a request's state parked and reloaded together with its KV
pages (``HybridPoolHost``).

``MambaPoolHost`` is built from the host tier's own parts (``kvpool.host``): its page allocator with
pages of one slot, its transfer scheduler (the transfer streams, the ordering between transfers
that share host slots, the events), and its two backends, so a state transfer follows the host
tier's rules (docs/contract.md, "Host tier"): bytes copied exactly, checked before anything is
copied, enqueued on the transfer streams after the compute stream's work so far, never
synchronising the host.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from kvpool.checks import positive_int
from kvpool.config import validate_enabled
from kvpool.host.pool import MHATokenToKVPoolHost, MLATokenToKVPoolHost, check_device_indices
from kvpool.host.direct_backend import HOST_STAGING_BYTES, DirectBackend
from kvpool.host.kernel_backend import HOST_KERNEL_PROGRAMS, KernelBackend
from kvpool.host.layer_counter import LayerTransferCounter
from kvpool.host.memory import LAYOUTS, check_host_memory, host_buffers, host_slots, layer_views
from kvpool.host.pages import HostPages
from kvpool.host.schedule import Transfer, TransferScheduler
from kvpool.kernels.row_table import RowTable
from kvpool.pools.hybrid_kv_pool import HybridLinearKVPool
from kvpool.pools.mamba_pool import MambaPool
from kvpool.pools.mla_pool import MLATokenToKVPool

IO_BACKENDS = ("kernel", "direct")


class MambaPoolHost:
    """Host-memory state slots for a device ``MambaPool``, with SGLang's arguments.

    Parameters
    ----------
    device_pool : the ``MambaPool`` whose states this tier holds.
    host_to_device_ratio : host slots per device slot, used when ``host_size`` <= 0.
    host_size : host memory in GB (1e9 bytes) when > 0.
    pin_memory : page-lock the host buffers when the device pool is on CUDA (the kernel backend needs it).
    device : ``"cpu"``.
    allocator_type : SGLang's; must be ``"default"``.
    layout : ``"layer_first"`` (``[layers, size, ...]`` per kind) or ``"page_first"`` (``[size,
        layers, ...]``: a slot of every layer is one block per kind).
    validate : also check device slots on the device (one synchronisation per transfer) and that
        host slots are allocated; ``KVPOOL_VALIDATE=1`` turns it on too.
    kernel_programs, staging_bytes : as for ``MHATokenToKVPoolHost``.

    Attributes
    ----------
    size : host slots ``0..size-1`` (pages of one slot: ``page_size`` is 1).
    conv, temporal : typed views of the host buffers (``conv`` one per convolution), shaped as the
        layout says.
    row_table : the host rows in the device pool's ``row_table`` order.
    load_stream, backup_stream : the transfer streams (None on a CPU pool).

    Examples
    --------
    >>> host = MambaPoolHost(mamba_pool, 2.0, 0)
    >>> h = host.alloc(3)                                         # int64 CPU slots
    >>> host.backup_from_device_all_layer(mamba_pool, h, device_slots)
    >>> host.load_to_device_all_layer(mamba_pool, h, new_device_slots)
    """

    def __init__(
        self,
        device_pool: MambaPool,
        host_to_device_ratio: float,
        host_size: float,
        pin_memory: bool = True,
        device: str = "cpu",
        allocator_type: str = "default",
        layout: str = "layer_first",
        *,
        validate: bool = False,
        kernel_programs: int = HOST_KERNEL_PROGRAMS,
        staging_bytes: int = HOST_STAGING_BYTES,
    ) -> None:
        if not isinstance(device_pool, MambaPool):
            raise TypeError(f"device_pool must be a MambaPool, got {type(device_pool).__name__}")
        if allocator_type != "default":
            raise ValueError(f"allocator_type must be 'default' (kvpool has one host allocator), got {allocator_type!r}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        if torch.device(device).type != "cpu":
            raise ValueError(f"device must be cpu (the host tier lives in host memory), got {device!r}")
        self.device_pool, self.layout, self.page_size = device_pool, layout, 1
        self.device = torch.device("cpu")
        self.validate = validate_enabled(validate)
        params = device_pool.cache_params
        self.num_mamba_layers = layers = params.num_layers
        self.size_per_slot = params.bytes_per_slot
        size = host_slots(host_size, host_to_device_ratio, device_pool.size, self.size_per_slot)
        if size < 1:
            raise ValueError(f"the host pool must hold at least one slot of {self.size_per_slot} bytes, got {size}")
        check_host_memory(size, self.size_per_slot)
        self.size = size

        cuda = device_pool.device.type == "cuda"
        self.pin_memory = bool(pin_memory) and cuda
        lead = (layers, size) if layout == "layer_first" else (size, layers)
        conv_bytes = [math.prod(c) * params.dtype.conv.itemsize for c in params.shape.conv]
        conv_buf, ssm_buf, self._pinned = host_buffers(
            (*lead, sum(conv_bytes)), (*lead, params.temporal_bytes), torch.uint8, self.pin_memory
        )
        self._slot_axis = 1 if layout == "layer_first" else 0
        self._bufs = (conv_buf, ssm_buf)  # a slot's bytes: conv_buf's, then ssm_buf's ([layers, bytes] each)
        self.slot_bytes = layers * (sum(conv_bytes) + params.temporal_bytes)
        offsets = [sum(conv_bytes[:c]) for c in range(len(conv_bytes))]
        self.conv = tuple(
            conv_buf[..., o : o + b].view(params.dtype.conv).view(*lead, *shape)
            for o, b, shape in zip(offsets, conv_bytes, params.shape.conv)
        )
        self.temporal = ssm_buf.view(params.dtype.temporal).view(*lead, *params.shape.temporal)
        rows = []
        for conv_layer, ssm_layer in zip(layer_views(conv_buf, layout), layer_views(ssm_buf, layout)):
            rows += [conv_layer[:, o : o + b] for o, b in zip(offsets, conv_bytes)] + [ssm_layer]
        self.row_table = RowTable.of(
            rows, table_device=device_pool.device if self.pin_memory else None, pinned=self.pin_memory or None
        )
        self._per_layer = len(conv_bytes) + 1
        self._pages = HostPages(size, 1)
        counter = LayerTransferCounter(layers, device_pool.device)
        self._scheduler = TransferScheduler(device_pool.device, size, counter)
        self.load_stream, self.backup_stream = self._scheduler.load_stream, self._scheduler.backup_stream
        self._backends = {"kernel": KernelBackend(self.row_table, positive_int(kernel_programs, "kernel_programs"))}
        if len(conv_bytes) == 1:  # the copy engine's plan takes two buffers per layer
            self._backends["direct"] = DirectBackend(
                layout, (conv_buf, ssm_buf), self.row_table, positive_int(staging_bytes, "staging_bytes")
            )

    # --- slots (SGLang names) ------------------------------------------------------------------------

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """``need_size`` host slots as an int64 CPU tensor, or None (nothing changes) when fewer are free."""
        return self._pages.alloc(need_size)

    def free(self, indices: torch.Tensor) -> int:
        """Give host slots back; returns how many. A slot not allocated (a double free), out of range
        or listed twice raises before anything changes."""
        return self._pages.free(indices)

    def available_size(self) -> int:
        """Free host slots."""
        return self._pages.available_size()

    def clear(self) -> None:
        """Every host slot free again (contents are left as they are)."""
        self._pages.clear()

    def get_size_per_token(self) -> int:
        """Bytes of one slot over every layer (SGLang's name: a state slot is this tier's token)."""
        return self.size_per_slot

    # --- a slot's bytes (what a storage tier stores) -------------------------------------------------

    def get_data_page(self, index: int) -> torch.Tensor:
        """Host slot ``index``'s bytes, every layer, as a new 1-D uint8 tensor of ``slot_bytes``: the
        convolution windows of every layer ([layers, conv bytes]), then the SSM states ([layers, SSM
        bytes]); the same bytes in either layout. Waits (on the host) for a backup still writing it."""
        slot = self._slot(index)
        self._scheduler.sync_pages(np.array([slot]), for_write=False)
        return torch.cat([b.select(self._slot_axis, slot).reshape(-1) for b in self._bufs])

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        """Write ``get_data_page``'s form of a slot at host slot ``index``. Checked (a 1-D uint8 CPU
        tensor of ``slot_bytes``) before anything is written; waits for transfers still using the slot."""
        slot = self._slot(index)
        if not isinstance(data_page, torch.Tensor):
            raise TypeError(f"data_page must be a torch.Tensor, got {type(data_page).__name__}")
        if data_page.dtype != torch.uint8 or data_page.dim() != 1 or data_page.device.type != "cpu":
            raise ValueError(
                f"data_page must be a 1-D uint8 CPU tensor, got {data_page.dtype} of shape {tuple(data_page.shape)} on "
                f"{data_page.device}"
            )
        if data_page.shape[0] != self.slot_bytes:
            raise ValueError(f"data_page must hold {self.slot_bytes} bytes (one slot, every layer), got {data_page.shape[0]}")
        self._scheduler.sync_pages(np.array([slot]), for_write=True)
        at = 0
        for b in self._bufs:
            view = b.select(self._slot_axis, slot)
            view.copy_(data_page[at : at + view.numel()].view(view.shape))
            at += view.numel()

    def _slot(self, index: object) -> int:
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or not 0 <= index < self.size:
            raise ValueError(f"index must be a host slot in [0, {self.size}), got {index!r}")
        return int(index)

    # --- transfers -----------------------------------------------------------------------------------

    def check(self, direction: str, device_pool: object, host_indices: object, device_indices: object,
              io_backend: str) -> Optional[Transfer]:  # fmt: skip
        """Every check of a transfer (``direction`` ``"backup"`` or ``"load"``), before anything is
        copied: the transfer to hand to :meth:`run`, or None when it moves nothing."""
        if io_backend not in self._backends:
            why = "" if io_backend not in IO_BACKENDS else " ('direct' needs one convolution per layer)"
            raise ValueError(f"io_backend must be one of {', '.join(self._backends)}{why}, got {io_backend!r}")
        if not isinstance(device_pool, MambaPool):
            raise TypeError(f"device_pool must be a MambaPool, got {type(device_pool).__name__}")
        mine = self.device_pool
        for name in ("cache_params", "device"):
            if getattr(device_pool, name) != getattr(mine, name):
                raise ValueError(f"device_pool must have the {name} of the pool this host pool was built for")
        if io_backend == "kernel" and device_pool.device.type == "cuda" and not self.pin_memory:
            raise ValueError("io_backend='kernel' reads host memory from the GPU and needs pin_memory=True (use 'direct')")
        slots = self._pages.slots(host_indices, "host_indices")
        check_device_indices(device_indices, host_indices, device_pool, device_pool.size + 1, "slots", self.validate)
        pages = self._pages.transfer_pages(slots, direction == "backup", self.validate)
        if slots.shape[0] == 0:
            return None
        table, k = device_pool.row_table, self._per_layer
        per_layer = [table.select(i * k, (i + 1) * k) for i in range(self.num_mamba_layers)]
        layers = list(range(self.num_mamba_layers))
        return Transfer(direction, slots, pages, device_indices, table, per_layer, layers, together=True)  # type: ignore[arg-type]

    def run(self, t: Optional[Transfer], io_backend: str) -> Optional[torch.cuda.Event]:
        """Queue a checked transfer; a backup returns its event on CUDA (complete once every slot has
        been read)."""
        if t is None:
            return None
        backend = self._backends[io_backend]
        if t.direction == "backup":
            return self._scheduler.backup(backend, t)
        self._scheduler.load(backend, t)
        return None

    def backup_from_device_all_layer(
        self, device_pool: MambaPool, host_indices: torch.Tensor, device_indices: torch.Tensor,
        io_backend: str = "kernel",
    ) -> Optional[torch.cuda.Event]:  # fmt: skip
        """For every layer, host slot ``host_indices[i]`` becomes a byte copy of device slot
        ``device_indices[i]`` (convolution windows and SSM state). ``host_indices``: int64/int32 CPU
        tensor of allocated host slots, each once; ``device_indices``: int32/int64 on the device
        pool's device, same length, negative entries padding. On CUDA it runs on ``backup_stream``
        after the compute stream's work so far and returns an event that completes once every slot
        has been read: reuse the device slots only after it (or ``wait_for_backups()``). On a CPU
        pool the copy is done on return (None)."""
        return self.run(self.check("backup", device_pool, host_indices, device_indices, io_backend), io_backend)

    def load_to_device_all_layer(
        self, device_pool: MambaPool, host_indices: torch.Tensor, device_indices: torch.Tensor,
        io_backend: str = "kernel",
    ) -> None:  # fmt: skip
        """For every layer, device slot ``device_indices[i]`` becomes a byte copy of host slot
        ``host_indices[i]``, on ``load_stream`` after the compute stream's work so far and after the
        backup that wrote those host slots; read the states after ``wait_for_loads()``. Negative
        device slots are padding; slots past the pool are never written."""
        self.run(self.check("load", device_pool, host_indices, device_indices, io_backend), io_backend)

    def wait_for_loads(self) -> None:
        """The current stream waits for every load queued so far (a stream wait)."""
        self._scheduler.wait_for_loads()

    def wait_for_backups(self) -> None:
        """The current stream waits for every backup queued so far (a stream wait)."""
        self._scheduler.wait_for_backups()


class HybridPoolHost:
    """A hybrid model's host tier: the full-attention layers' KV pages (``kv_host``, an
    ``MHATokenToKVPoolHost`` or ``MLATokenToKVPoolHost`` over ``device_pool.full_kv_pool``) and the
    linear layers' state slots (``state_host``, a ``MambaPoolHost`` over ``device_pool.mamba_pool``),
    so that a request's KV and its state are parked and reloaded by one call each.

    Parameters
    ----------
    device_pool : a ``HybridLinearKVPool`` built with its ``mamba_pool``.
    host_to_device_ratio, host_size, page_size, layout, pin_memory, device : for the KV host pool
        (``MHATokenToKVPoolHost``'s meaning).
    state_host_to_device_ratio, state_host_size : for the state host pool; default the same ratio
        and no size (``state_host_size`` in GB when > 0).
    validate, kernel_programs, staging_bytes : for both.

    Every call checks both halves before either copies anything.
    """

    def __init__(
        self,
        device_pool: HybridLinearKVPool,
        host_to_device_ratio: float,
        host_size: float,
        page_size: int,
        layout: str,
        pin_memory: bool = True,
        device: str = "cpu",
        *,
        state_host_to_device_ratio: Optional[float] = None,
        state_host_size: float = 0,
        validate: bool = False,
        kernel_programs: int = HOST_KERNEL_PROGRAMS,
        staging_bytes: int = HOST_STAGING_BYTES,
    ) -> None:
        if not isinstance(device_pool, HybridLinearKVPool):
            raise TypeError(f"device_pool must be a HybridLinearKVPool, got {type(device_pool).__name__}")
        if device_pool.mamba_pool is None:
            raise ValueError("device_pool must have a mamba_pool (its linear layers' states)")
        self.device_pool = device_pool
        inner = device_pool.full_kv_pool
        options = dict(validate=validate, kernel_programs=kernel_programs, staging_bytes=staging_bytes)
        cls = MLATokenToKVPoolHost if isinstance(inner, MLATokenToKVPool) else MHATokenToKVPoolHost
        self.kv_host = cls(inner, host_to_device_ratio, host_size, page_size, layout, pin_memory, device, **options)
        ratio = host_to_device_ratio if state_host_to_device_ratio is None else state_host_to_device_ratio
        self.state_host = MambaPoolHost(
            device_pool.mamba_pool, ratio, state_host_size, pin_memory, device, "default", layout, **options
        )

    def backup(
        self, kv_host_indices: torch.Tensor, kv_device_indices: torch.Tensor, state_host_slots: torch.Tensor,
        state_device_slots: torch.Tensor, io_backend: str = "kernel",
    ) -> tuple[Optional[torch.cuda.Event], Optional[torch.cuda.Event]]:  # fmt: skip
        """Park requests: their KV rows (``backup_from_device_all_layer`` of ``kv_host``) and their
        states (of ``state_host``). Returns the two backups' events (None on a CPU pool): the device
        slots may be reused once both completed (or after ``wait_for_backups()``)."""
        mamba = self.device_pool.mamba_pool
        state = self.state_host.check("backup", mamba, state_host_slots, state_device_slots, io_backend)
        kv = self.kv_host.backup_from_device_all_layer(self.device_pool.full_kv_pool, kv_host_indices,
                                                       kv_device_indices, io_backend)  # fmt: skip
        return kv, self.state_host.run(state, io_backend)

    def load(
        self, kv_host_indices: torch.Tensor, kv_device_indices: torch.Tensor, state_host_slots: torch.Tensor,
        state_device_slots: torch.Tensor, io_backend: str = "kernel",
    ) -> None:  # fmt: skip
        """Reload requests: their KV rows (every layer, ``kv_host``'s ``load_to_device_all_layer``)
        and their states, each on its host pool's load stream. Read them after ``wait_for_loads()``
        (or through the KV pool's getters with ``kv_host``'s counter registered, for the KV)."""
        mamba = self.device_pool.mamba_pool
        state = self.state_host.check("load", mamba, state_host_slots, state_device_slots, io_backend)
        self.kv_host.load_to_device_all_layer(self.device_pool.full_kv_pool, kv_host_indices, kv_device_indices,
                                              io_backend)  # fmt: skip
        self.state_host.run(state, io_backend)

    def wait_for_loads(self) -> None:
        """The current stream waits for every KV and state load queued so far (each host pool's
        ``wait_for_loads``)."""
        self.kv_host.wait_for_loads()
        self.state_host.wait_for_loads()

    def wait_for_backups(self) -> None:
        """The current stream waits for every KV and state backup queued so far (each host pool's
        ``wait_for_backups``): after it, the device slots that were backed up may be overwritten."""
        self.kv_host.wait_for_backups()
        self.state_host.wait_for_backups()
