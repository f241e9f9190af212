"""The host tier's ``"kernel"`` backend: ``copy_rows``'s kernel reads and writes pinned host memory
directly, on a grid of a few programs so that the other SMs stay with the model (docs/contract.md,
"Host tier", "Transfers").

One copy over every layer (a backup, or a load no model waits for layer by layer), or one per layer,
each layer landing as its copy ends. With a CPU device pool the same calls are plain CPU copies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

# Through the module, so that a test's stand-in for one of its functions is the one called.
from kvpool.kernels.copy_rows import launcher as copy_launcher
from kvpool.kernels.launch import compiled_on
from kvpool.kernels.row_table import RowTable

if TYPE_CHECKING:
    from kvpool.host.schedule import Landed, Transfer

#: The backend's default grid: at most this many SMs copy, the rest stay with the model.
HOST_KERNEL_PROGRAMS = 8

_BACKUP_NAMES = ("host_indices", "device_indices")
_LOAD_NAMES = ("device_indices", "host_indices")


class KernelBackend:
    """Row copies between the host buffers and a device pool's, on ``programs`` programs.

    Parameters
    ----------
    host_rows : the host buffers' row table, ``K0, V0, K1, V1, ...`` (on the device for pinned ones).
    programs : the grid cap.
    parts : buffers per layer in ``host_rows`` (2 for K/V; a pool with scales has more).
    """

    def __init__(self, host_rows: RowTable, programs: int, parts: int = 2) -> None:
        self.rows = host_rows
        self.layer_rows = [host_rows.select(parts * i, parts * i + parts) for i in range(len(host_rows) // parts)]
        self.programs = programs
        # Later copies of a transfer take its first copy's checked indices and sibling tables, so
        # they skip the checks (the host's cost per layer delays the model's work queued after it).
        self._unchecked = compiled_on(host_rows.table_device)

    def copy(self, t: Transfer, stream: Optional[torch.cuda.Stream], landed: Landed) -> None:
        """Enqueue ``t``'s copies on the current stream (``stream``)."""
        host = t.host_index_on(self.rows.table_device)
        cap = self.programs
        if t.direction == "backup":
            copy_launcher.checked_copy(self.rows, host, t.device_rows, t.device_index, cap, False, _BACKUP_NAMES)
        elif t.together:
            copy_launcher.checked_copy(t.device_rows, t.device_index, self.rows, host, cap, False, _LOAD_NAMES)
            for layer in t.layers:
                landed(layer, stream)
        else:
            for i, layer in enumerate(t.layers):
                dst, src = t.device_layers[layer], self.layer_rows[layer]
                if i and self._unchecked:
                    copy_launcher.launch_copy_rows(dst, t.device_index, src, host, max_programs=cap)
                else:
                    copy_launcher.checked_copy(dst, t.device_index, src, host, cap, False, _LOAD_NAMES)
                landed(layer, stream)
