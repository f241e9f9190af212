"""The copy-engine plan of the host tier's ``"direct"`` backend: which byte ranges of the host buffers
and of a device staging buffer laid out like them form one contiguous copy each.

The device side of a transfer is scattered by slot (``device_indices`` live on the GPU, and reading
them on the host would synchronise), so rows are gathered into (or scattered from) a staging buffer
with one kernel launch; the staging buffer has the host buffers' layout with ``staging_slots``
slots, filled in the order of the positions. The host side is known on the host (``host_indices``
are CPU data), so every run of consecutive host slots at consecutive positions is one copy per
contiguous block: per K/V for ``page_first`` (a token's layers are contiguous), per layer and K/V
for ``layer_first``. Pure functions on NumPy arrays, tested on their own.
"""

from __future__ import annotations

from typing import Optional

import numpy as np


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
