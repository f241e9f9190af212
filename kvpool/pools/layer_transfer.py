"""Per-layer load events that let a model run layer 0 while later layers are still arriving.

A host pool's loads record event ``i`` on their transfer stream once layer ``i`` has landed in the
device pool; a device pool with this counter registered (``register_layer_transfer_counter``) makes
the current stream wait for event ``i`` whenever a getter hands out layer ``i``'s buffers. Waiting is
``cudaStreamWaitEvent``: the GPU waits, the host never does.

The events are created "external" where torch supports it, so that a getter called while a CUDA graph
is being captured puts an event-wait node in the graph: each replay then waits for the load recorded
before it, outside the graph.
"""

from __future__ import annotations

from typing import Optional

import torch


def _event() -> torch.cuda.Event:
    try:
        return torch.cuda.Event(external=True)
    except TypeError:  # torch without external events: waits work eagerly, not inside captured graphs
        return torch.cuda.Event()


class LayerTransferCounter:
    """One load-completion event per layer of a device pool (SGLang's layer-transfer counter).

    Parameters
    ----------
    layer_num : layers of the device pool.
    device : the device pool's device. On a CPU every transfer is synchronous and waits are no-ops.

    ``wait_until(i)`` (``i`` = layer id - start_layer) makes the current stream wait for the latest
    ``record(i, stream)``. Every event is recorded once at construction, so a wait before any load
    returns at once, and a wait captured into a CUDA graph always becomes a node.
    """

    def __init__(self, layer_num: int, device: torch.device) -> None:
        self.layer_num = layer_num
        self.device = device
        self._events: Optional[list[torch.cuda.Event]] = None
        if device.type == "cuda":
            with torch.cuda.device(device):
                self._events = [_event() for _ in range(layer_num)]
                stream = torch.cuda.current_stream(device)
                for e in self._events:
                    e.record(stream)

    def record(self, layer_index: int, stream: torch.cuda.Stream) -> None:
        """Layer ``layer_index`` is complete once ``stream`` reaches this point."""
        if self._events is not None:
            self._events[layer_index].record(stream)

    def wait_until(self, layer_index: int) -> None:
        """The current stream waits for layer ``layer_index``'s latest recorded load (no host sync)."""
        if self._events is not None:
            torch.cuda.current_stream(self.device).wait_event(self._events[layer_index])

    def event(self, layer_index: int) -> Optional[torch.cuda.Event]:
        """Layer ``layer_index``'s event (None on a CPU), e.g. to ``synchronize()`` on it in a test."""
        return None if self._events is None else self._events[layer_index]
