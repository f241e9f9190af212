"""The host tier's ``"direct"`` backend: the copy engine (docs/contract.md, "Host tier", "Transfers").

The device side of a transfer is scattered by slot (``device_indices`` live on the GPU, and reading
them on the host would synchronise), so rows are gathered into (or scattered from) a device staging
buffer laid out like the host buffers, with one row-copy launch per piece; the host side is known
on the host (``host_indices`` are CPU data), so every run of consecutive host slots at consecutive
staging positions is one ``cudaMemcpyAsync`` per contiguous block (:func:`runs`, :func:`segments`):
per part for ``page_first`` (a token's layers are contiguous), per layer and part for
``layer_first``. The parts are a layer's buffers: K and V, or codes and the scales beside them.

A pair whose device row is skipped (negative: padding; past the pool's rows) leaves its host row as
it was: before a backup's staging goes out, those positions get the host row's own bytes back.
With a CPU device pool the staging is host memory and every copy a plain CPU copy.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from kvpool.host.memory import layer_views
# Through the module, so that a test's stand-in for one of its functions is the one called.
from kvpool.kernels.copy_rows import launcher as copy_launcher
from kvpool.kernels.launch import compiled_on
from kvpool.kernels.row_table import RowTable
from kvpool.streams import OnStream

if TYPE_CHECKING:
    from kvpool.host.schedule import Landed, Transfer

#: Each of the backend's two device staging buffers per direction: larger ones make longer
#: copy-engine pieces, at the cost of device memory the model does not get.
HOST_STAGING_BYTES = 32 * 2**20

# --- the copy plan (pure functions on NumPy arrays) --------------------------------------------------


def runs(slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Maximal runs of consecutive slots at consecutive positions: (first position, first slot,
    length) arrays. ``[4, 5, 6, 9, 10, 2]`` -> positions [0, 3, 5], slots [4, 9, 2], lengths [3, 2, 1]."""
    n = slots.shape[0]
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    starts = np.flatnonzero(np.diff(slots) != 1) + 1
    starts = np.concatenate(([0], starts)).astype(np.int64)
    lengths = np.diff(np.concatenate((starts, [n]))).astype(np.int64)
    return starts, slots[starts].astype(np.int64), lengths


def segments(
    layout: str,
    run: tuple[np.ndarray, np.ndarray, np.ndarray],
    row_bytes: int,
    size: int,
    layers: int,
    staging_slots: int,
    layer: Optional[int] = None,
) -> np.ndarray:
    """Byte ranges ``[host offset, staging offset, length]`` (int64 [k, 3]) copying the rows of the
    host slots at positions ``0..len-1`` of the staging buffer, given as their ``runs`` (found once
    per chunk of a transfer, whatever the layers that move it), for one of K or V.

    Host buffer: ``layer_first`` [layers, size, row], ``page_first`` [size, layers, row]. Staging:
    the same layout with ``staging_slots`` slots for all-layer transfers (``layer`` None), or
    [staging_slots, row] for one layer. A one-layer transfer of a ``page_first`` host buffer has
    strided host rows: one range per row.
    """
    pos, first, length = run
    r = row_bytes
    if layer is None and layout == "page_first":
        return np.stack((first * layers * r, pos * layers * r, length * layers * r), axis=1)
    if layer is None:  # layer_first, every layer: one range per run per layer
        lay = np.arange(layers, dtype=np.int64)[:, None]
        host = (lay * size + first[None, :]) * r
        staging = (lay * staging_slots + pos[None, :]) * r
        nbytes = np.broadcast_to(length[None, :] * r, host.shape)
        return np.stack((host.reshape(-1), staging.reshape(-1), nbytes.reshape(-1)), axis=1)
    if layout == "layer_first":
        return np.stack(((layer * size + first) * r, pos * r, length * r), axis=1)
    # page_first, one layer: rows are layers * r apart on the host
    p = np.arange(int(length.sum()), dtype=np.int64)
    s = np.repeat(first - pos, length) + p  # the host slot at each position
    return np.stack(((s * layers + layer) * r, p * r, np.full_like(p, r)), axis=1)


def copy_segments(copies, *, to_host: bool) -> None:
    """The copy-engine calls for one piece: per part, (segments ``(host offset, staging view)``, host
    buffer, host offset added to every segment), one ``cudaMemcpyAsync`` per segment on the current
    stream."""
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


# --- staging -----------------------------------------------------------------------------------------


@dataclass
class _StagingHalf:
    """One staging buffer: every part in the host layout with ``slots`` slots (all layers) and, over
    the same memory, one layer's parts with ``layer_slots`` slots; ``flats`` / ``layer_flats`` are
    each part's bytes."""

    slots: int
    table: RowTable
    flats: tuple[torch.Tensor, ...]
    layer_slots: int
    layer_table: RowTable
    layer_flats: tuple[torch.Tensor, ...]


#: Where each part starts in a staging buffer: a multiple of this, so every part's dtype can view it.
_ALIGN = 16


def _starts(sizes: list[int]) -> list[int]:
    """Aligned offsets of consecutive regions of ``sizes`` bytes, and their end as the last entry."""
    at = [0]
    for n in sizes:
        at.append(at[-1] + (n + _ALIGN - 1) // _ALIGN * _ALIGN)
    return at


@dataclass
class _Staging:
    """A direction's staging: two buffers used in turn, so that the device gathers (scatters) of one
    chunk run on ``aux`` while the copy engine moves the other chunk on the transfer stream."""

    halves: tuple[_StagingHalf, _StagingHalf]
    positions: torch.Tensor  # arange(max slots) on the device
    aux: Optional[torch.cuda.Stream]
    device_done: list  # per half: its gather/scatter is done (CUDA events)
    copies_done: list  # per half: its copy-engine calls are done


class DirectBackend:
    """Copy-engine transfers between host buffers and a device pool, through device staging.

    Parameters
    ----------
    layout : ``"layer_first"`` or ``"page_first"``.
    buffers : the host buffers of a layer's parts (K and V, or codes and scales; each
        ``[layer_num, size, ...]`` or ``[size, layer_num, ...]``, of its own dtype).
    host_rows : their row table, ``K0, V0, K1, V1, ...`` (every part of a layer in turn).
    staging_bytes : size of each of the two staging buffers per direction.
    """

    def __init__(self, layout: str, buffers, host_rows: RowTable, staging_bytes: int) -> None:
        self.layout = layout
        lead = tuple(buffers[0].shape[:2])
        self.layer_num, self.size = lead if layout == "layer_first" else lead[::-1]
        self.dtypes = tuple(b.dtype for b in buffers)
        self.part_rows = tuple(tuple(b.shape[2:]) for b in buffers)
        self.row_bytes = tuple(b[0, 0].nbytes for b in buffers)
        self.flats = tuple(b.view(-1).view(torch.uint8) for b in buffers)
        self.rows = host_rows
        n = len(buffers)
        self.layer_rows = [host_rows.select(n * i, n * i + n) for i in range(self.layer_num)]
        self.staging_bytes = staging_bytes
        self._staging: dict[str, _Staging] = {}

    def _staging_for(self, direction: str, device: torch.device) -> _Staging:
        """The direction's staging, made on first use on the current stream (the transfer stream
        that will use it): no synchronisation."""
        staging = self._staging.get(direction)
        if staging is None:
            cuda = device.type == "cuda"
            halves = (self._make_half(device), self._make_half(device))
            most = max(halves[0].slots, halves[0].layer_slots)
            positions = torch.arange(most, dtype=torch.int64, device=device)
            # A load's scatters gate the layers a model waits for: high priority, as the load stream.
            aux = torch.cuda.Stream(device, priority=-1 if direction == "load" else 0) if cuda else None
            events = [[torch.cuda.Event(), torch.cuda.Event()] if cuda else [None, None] for _ in range(2)]
            staging = self._staging[direction] = _Staging(halves, positions, aux, events[0], events[1])
        return staging

    def _make_half(self, device: torch.device) -> _StagingHalf:
        cuda = device.type == "cuda"
        token_bytes = sum(self.row_bytes)
        slots = max(1, self.staging_bytes // (self.layer_num * token_bytes))
        layer_slots = max(1, self.staging_bytes // token_bytes)
        at = _starts([slots * self.layer_num * r for r in self.row_bytes])
        layer_at = _starts([layer_slots * r for r in self.row_bytes])
        mem = torch.empty(max(at[-1], layer_at[-1]), dtype=torch.uint8, device=device)
        lead = (self.layer_num, slots) if self.layout == "layer_first" else (slots, self.layer_num)
        flats, layer_flats, parts, layer_parts = [], [], [], []
        for j, (r, dtype, row) in enumerate(zip(self.row_bytes, self.dtypes, self.part_rows)):
            flats.append(mem[at[j] : at[j] + slots * self.layer_num * r])
            parts.append(layer_views(flats[-1].view(dtype).view(*lead, *row), self.layout))
            layer_flats.append(mem[layer_at[j] : layer_at[j] + layer_slots * r])
            layer_parts.append(layer_flats[-1].view(dtype).view(layer_slots, *row))
        table = RowTable.of([t for layer in zip(*parts) for t in layer], non_blocking=cuda)
        layer_table = RowTable.of(layer_parts, non_blocking=cuda)
        return _StagingHalf(slots, table, tuple(flats), layer_slots, layer_table, tuple(layer_flats))

    # --- a transfer ---------------------------------------------------------------------------------

    def copy(self, t: Transfer, stream: Optional[torch.cuda.Stream], landed: Landed) -> None:
        """Chunk by chunk through the two staging buffers in turn: a backup gathers a chunk on ``aux``
        then copies it out on the transfer stream (``stream``); a load copies a chunk in on the
        transfer stream then scatters it on ``aux``. Each buffer is refilled only after its previous
        chunk is through, and the transfer stream ends after everything (it waits for ``aux``), so
        one event on it marks the whole transfer.

        ``page_first`` moves every layer of a chunk together when more than one layer moves (a
        token's layers are one block on the host, so a run of host slots is one copy per K/V).
        ``layer_first`` moves layer by layer in both directions, so a run is one copy per layer and
        K/V as long as a layer's staging allows: the copy engine needs pieces of several MiB for its
        full rate."""
        st = self._staging_for(t.direction, t.device_rows.table_device)
        slots, d_idx, layers = t.slots, t.device_index, t.layers
        backup = t.direction == "backup"
        n = slots.shape[0]
        # (A one-layer page_first pool's backup is "all layers" too: one copy per run, not per row.)
        all_layers = self.layout == "page_first" and (len(layers) > 1 or self.layer_num == 1)
        s_slots = st.halves[0].slots if all_layers else st.halves[0].layer_slots  # a chunk's slots
        chunks = [(j, min(n, j + s_slots)) for j in range(0, n, s_slots)]
        # Per chunk, once for every layer that moves it: its positions in the staging buffer, its
        # device slots, and its copy plan per part (host runs; a layer's plan is layer 0's moved by a
        # fixed host offset).
        first = None if all_layers else 0
        plans = {}
        for j0, j1 in chunks:
            run = runs(slots[j0:j1])
            segs = tuple(
                segments(self.layout, run, row, self.size, self.layer_num, s_slots, first).tolist()
                for row in self.row_bytes
            )
            plans[(j0, j1)] = (st.positions[: j1 - j0], d_idx[j0:j1], segs)
        per_layer = self.size if self.layout == "layer_first" else 1  # rows between a row's layers
        if all_layers:
            pieces: list[tuple[int, int, Optional[int]]] = [(j0, j1, None) for j0, j1 in chunks]
        else:
            pieces = [(j0, j1, layer) for layer in layers for j0, j1 in chunks]
        cuda = st.aux is not None
        transfer = stream
        restore, prefill = self._keep_skipped_rows(t) if backup else (None, False)
        move = self._row_copy(st.aux)
        if cuda:
            st.aux.wait_stream(transfer)  # the ordering the transfer stream already has
        queued = False
        try:
            views: dict = {}
            for k, (j0, j1, layer) in enumerate(pieces):
                h = k % 2
                half = st.halves[h]
                pos, dev, segs = plans[(j0, j1)]
                if layer is None:
                    s_table, flats = half.table, half.flats
                    d_table, h_table, shift = t.device_rows, self.rows, 0
                else:
                    s_table, flats = half.layer_table, half.layer_flats
                    d_table, h_table, shift = t.device_layers[layer], self.layer_rows[layer], layer * per_layer
                # The staging side of a chunk's segments is the same for every layer: its views are
                # made once per chunk and buffer (a slice costs the host as much as the copy call).
                seg_views = views.get((j0, h))
                if seg_views is None:
                    seg_views = views[(j0, h)] = tuple(_staged_segments(g, f) for g, f in zip(segs, flats))
                copies = tuple(
                    (seg_views[j], self.flats[j], shift * self.row_bytes[j]) for j in range(len(self.flats))
                )
                if backup:
                    if prefill:
                        copy_segments(copies, to_host=False)  # the host rows, for the pairs the gather skips
                        if cuda:
                            st.copies_done[h].record(transfer)
                    if cuda and (k >= 2 or prefill):
                        st.aux.wait_event(st.copies_done[h])  # this buffer's copy-engine work is done
                    move(s_table, pos, d_table, dev)
                    if restore is not None:
                        move(s_table, pos, h_table, restore[j0:j1])
                    if cuda:
                        st.device_done[h].record(st.aux)
                        transfer.wait_event(st.device_done[h])
                    copy_segments(copies, to_host=True)
                    if cuda:
                        st.copies_done[h].record(transfer)
                else:
                    if cuda and k >= 2:
                        transfer.wait_event(st.device_done[h])  # this buffer's previous chunk is scattered
                    copy_segments(copies, to_host=False)
                    if cuda:
                        st.copies_done[h].record(transfer)
                        st.aux.wait_event(st.copies_done[h])
                    move(d_table, dev, s_table, pos)
                    if cuda:
                        st.device_done[h].record(st.aux)
                    if layer is not None and (k + 1 == len(pieces) or pieces[k + 1][2] != layer):
                        landed(layer, st.aux)
            if not backup and all_layers:  # a token's layers travel together: every layer lands at once
                for layer in layers:
                    landed(layer, st.aux)
            queued = True
        finally:  # also after a failure part-way: the transfer stream ends after what aux has queued
            if cuda:
                if not backup or not queued:
                    transfer.wait_stream(st.aux)
                d_idx.record_stream(st.aux)
                if restore is not None:
                    restore.record_stream(st.aux)

    def _keep_skipped_rows(self, t: Transfer) -> tuple[Optional[torch.Tensor], bool]:
        """How a backup keeps the host rows of pairs whose device row is skipped (the staging holds
        an earlier chunk's bytes there): ``(restore, False)``, the host slot per pair to copy back
        into the staging after the gather (-1 where the device row is read), where the staging's
        device reaches the host buffers (pinned, or a CPU pool); else ``(None, True)``: the copy
        engine first fills each chunk's staging with its host rows."""
        if self.rows.table_device != t.device_rows.table_device:
            return None, True
        d = t.device_index
        read = (d >= 0) & (d < t.device_rows.rows)
        return torch.where(read, -1, t.host_index_on(self.rows.table_device)), False

    def _row_copy(self, aux: Optional[torch.cuda.Stream]):
        """``f(dst, dst_index, src, src_index)``: the staging's row copies, on ``aux``. The tables
        are the host pool's own and the device pool's, checked when the transfer was, so on CUDA
        they go straight to the kernel's launch (a partial adds no Python frame)."""
        if aux is None:
            return functools.partial(copy_launcher.checked_copy, max_programs=None, validate=False, names=_NAMES)
        if compiled_on(aux.device):
            return functools.partial(copy_launcher.launch_copy_rows, stream=aux)

        def on_aux(dst, dst_index, src, src_index) -> None:  # CUDA without the kernel: the reference
            with OnStream(aux):
                copy_launcher.checked_copy(dst, dst_index, src, src_index, None, False, _NAMES)

        return on_aux


_NAMES = ("dst_index", "src_index")
