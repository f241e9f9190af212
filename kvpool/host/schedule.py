"""When and where the host tier's copies run: the transfer streams, the ordering between transfers
that share host pages, and the worker thread that queues background loads (docs/contract.md,
"Host tier", "Streams and events" and "Loads queued in the background").

A backend (``kernel_backend.py``, ``direct_backend.py``) only enqueues a :class:`Transfer`'s copies
on the stream it is handed and says when each layer has landed; the :class:`TransferScheduler`
picks that stream, orders it after the work it depends on, and remembers what later transfers and
page calls must wait for. On a CPU device pool there are no streams: the copies run in the call
(or on the worker) and are done when it returns.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import numpy as np
import torch

from kvpool.host.layer_counter import LayerTransferCounter
from kvpool.kernels.row_table import RowTable
from kvpool.streams import OnStream, StreamMark

#: How a backend says that a layer has landed: ``landed(layer, stream)`` once ``stream`` (None on a
#: CPU pool) gets there.
Landed = Callable[[int, Optional[torch.cuda.Stream]], None]


@dataclass
class Transfer:
    """One checked transfer, as the scheduler queues it and a backend copies it.

    Attributes
    ----------
    direction : ``"backup"`` (device rows to host rows) or ``"load"`` (host rows to device rows).
    slots : int64 [n] NumPy array, the host slots (whole pages).
    pages : int64 [n / page_size] NumPy array, the pages of ``slots``.
    device_index : Tensor [n] int32/int64 on the device pool's device: the device rows.
    device_rows : the device pool's row table (``K0, V0, K1, V1, ...``).
    device_layers : per layer, its (K, V) pair of ``device_rows``.
    layers : the layers that move, in order (0-based; a backup moves every layer).
    together : a load no model waits for layer by layer (the kernel backend moves every layer in
        one copy, and every layer lands at its end).
    host_index : the host slots as a tensor where the copies run, once :meth:`host_index_on` made it.
    """

    direction: str
    slots: np.ndarray
    pages: np.ndarray
    device_index: torch.Tensor
    device_rows: RowTable
    device_layers: list[RowTable]
    layers: list[int]
    together: bool = False
    host_index: Optional[torch.Tensor] = None

    def host_index_on(self, device: torch.device) -> torch.Tensor:
        """``slots`` as an int64 tensor on ``device``, made once: on CUDA through pinned memory on the
        current (transfer) stream, without synchronising."""
        if self.host_index is None:
            index = torch.from_numpy(self.slots)
            self.host_index = index if device.type == "cpu" else index.pin_memory().to(device, non_blocking=True)
        return self.host_index


class Backend(Protocol):
    """How a host pool's transfers are copied (``kernel_backend.py``, ``direct_backend.py``): the
    :class:`TransferScheduler` hands it each transfer with the stream to copy on."""

    def copy(self, t: Transfer, stream: Optional[torch.cuda.Stream], landed: Landed) -> None:
        """Enqueue ``t``'s copies on ``stream`` (the current stream; None on a CPU pool, where they run
        now) and call ``landed`` for each layer of a load once it is complete."""


class TransferScheduler:
    """The streams, ordering events and background worker of one host pool's transfers.

    Parameters
    ----------
    device : the device pool's device.
    page_num : the host pool's pages (transfers are ordered per page).
    counter : the layer-transfer counter that loads record their layers in.

    Attributes
    ----------
    load_stream, backup_stream : the transfer streams (None on a CPU pool).
    """

    def __init__(self, device: torch.device, page_num: int, counter: LayerTransferCounter) -> None:
        self.device = device
        self.counter = counter
        self.load_stream: Optional[torch.cuda.Stream] = None
        self.backup_stream: Optional[torch.cuda.Stream] = None
        if device.type == "cuda":
            # Loads gate the layers that wait for them: on a high-priority stream their few programs
            # are scheduled as soon as an SM frees instead of queueing behind the model's kernels.
            # Backups are off the forward pass's critical path and keep the default priority.
            self.load_stream = torch.cuda.Stream(device, priority=-1)
            self.backup_stream = torch.cuda.Stream(device)
            self._backup_after_compute, self._backup_after_loads = StreamMark(), StreamMark()
            self._load_after_compute = StreamMark()
        # Per page, the sequence number of the last backup that wrote it and of the last load that
        # read it; events of transfers that may still run, by sequence number.
        self._seq = 0
        self._page_written = np.full(page_num, -1, dtype=np.int64)
        self._page_read = np.full(page_num, -1, dtype=np.int64)
        self._events: dict[int, torch.cuda.Event] = {}
        # The thread that queues background loads (made on first use) and its job in progress.
        self._worker: Optional[ThreadPoolExecutor] = None
        self._job: Optional[Future] = None

    # --- transfers ------------------------------------------------------------------------------

    def backup(self, backend: Backend, t: Transfer) -> Optional[torch.cuda.Event]:
        """Queue a backup on ``backup_stream`` after the current stream's work so far, the loads
        queued before it and the loads still reading its pages; returns the event that completes
        once every row has been read (None on a CPU pool: done on return)."""
        stream = self.backup_stream
        if stream is None:
            backend.copy(t, None, self.counter.record)
            return None
        compute = torch.cuda.current_stream(self.device)  # before the context makes `stream` current
        with OnStream(stream):
            self._backup_after_compute.order(stream, compute)  # the rows' K/V writes come first
            self._backup_after_loads.order(stream, self.load_stream)  # loads queued before may write these rows
            self._wait_pages(stream, self._page_read, t.pages)
            try:
                backend.copy(t, stream, self.counter.record)
            finally:  # also after a failure part-way: what was queued is still ordered and kept
                event = self._finish(stream, self._page_written, t.pages)
                t.device_index.record_stream(stream)
        return event

    def load(self, backend: Backend, t: Transfer, background: bool = False) -> None:
        """Queue a load on ``load_stream`` after the current stream's work so far and the backup that
        wrote its pages; with ``background``, the worker thread queues its copies."""
        stream = self.load_stream
        if stream is not None:
            compute = torch.cuda.current_stream(self.device)
            with OnStream(stream):
                self._load_after_compute.order(stream, compute)  # earlier work on the target slots first
                self._wait_pages(stream, self._page_written, t.pages)
                if not background:
                    try:
                        backend.copy(t, stream, self.counter.record)
                    finally:  # also after a failure part-way
                        self._finish_load(t)
                    return
        elif not background:
            backend.copy(t, None, self.counter.record)
            return
        self._submit(backend, t)

    def _finish_load(self, t: Transfer) -> None:
        stream = self.load_stream
        self._finish(stream, self._page_read, t.pages)
        # After the last use is queued: the caching allocator then orders the tensor's reuse after
        # the load stream's work, whenever the caller drops it.
        t.device_index.record_stream(stream)

    # --- the background worker ------------------------------------------------------------------

    def _submit(self, backend: Backend, t: Transfer) -> None:
        """Hand the queueing of a load to the worker thread; until it records a layer, a getter of
        that layer waits on the host (``LayerTransferCounter.expect``)."""
        counter = self.counter
        counter.expect(t.layers)

        def job() -> None:
            try:
                self._queue_on_worker(backend, t)
            except BaseException as e:
                counter.abandon(t.layers, e)  # waiters of the layers it did not queue raise instead of hanging
                raise

        try:
            if self._worker is None:
                self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpool-host-load")
            self._job = self._worker.submit(job)
        except BaseException as e:  # no worker (interpreter shutting down, say): nothing will record them
            counter.abandon(t.layers, e)
            raise

    def _queue_on_worker(self, backend: Backend, t: Transfer) -> None:
        stream = self.load_stream
        if stream is None:
            backend.copy(t, None, self.counter.record)
            return
        with OnStream(stream):  # the worker's own current stream and device (both per thread)
            try:
                backend.copy(t, stream, self.counter.record)
            finally:
                self._finish_load(t)

    def drain(self) -> None:
        """Wait (host) until the background load in progress, if any, has queued all its work; raise
        its error (once) if it failed."""
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

    # --- waits ----------------------------------------------------------------------------------

    def wait_for_loads(self) -> None:
        """The current stream waits for every load queued so far (the host waits only for a
        background load to finish queueing)."""
        self.drain()
        if self.load_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.load_stream)

    def wait_for_backups(self) -> None:
        """The current stream waits for every backup queued so far (no host wait)."""
        self.drain()
        if self.backup_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.backup_stream)

    def sync_pages(self, pages: np.ndarray, *, for_write: bool) -> None:
        """Host code is about to read (or write) these pages: wait on the host for the transfers
        writing them (and, before a write, reading them); never for the compute stream."""
        self.drain()
        for seqs in (self._page_written, self._page_read) if for_write else (self._page_written,):
            event = self._events.get(int(seqs[pages].max()))
            if event is not None:
                event.synchronize()

    def _wait_pages(self, stream: torch.cuda.Stream, seqs: np.ndarray, pages: np.ndarray) -> None:
        event = self._events.get(int(seqs[pages].max()))
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
