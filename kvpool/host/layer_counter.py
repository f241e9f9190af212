"""Per-layer load events that let a model run layer 0 while later layers are still arriving
(docs/contract.md, "Host tier", "Streams and events").

A host pool's loads record event ``i`` on their transfer stream once layer ``i`` has landed in the
device pool; a device pool with this counter registered (``register_layer_transfer_counter``) makes
the current stream wait for event ``i`` whenever a getter hands out layer ``i``'s buffers. Waiting is
``cudaStreamWaitEvent``: the GPU waits, the host never does.

The events are created "external" where torch supports it, so that a getter called while a CUDA graph
is being captured puts an event-wait node in the graph: each replay then waits for the load recorded
before it, outside the graph.

A load queued by a background thread (``load_to_device_all_layer(..., background=True)``) names its
layers with :meth:`LayerTransferCounter.expect` first; until the thread records a layer's event, a
getter of that layer waits on the host for the thread to queue it (a condition variable; on CUDA the
thread only queues work, on a CPU pool it does the copies), then the stream waits as above, as
SGLang's layer-done counter lets a model runner start while its cache controller's thread is still
queueing the load.
"""

from __future__ import annotations

import threading
from typing import Iterable, Optional

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
    device : the device pool's device. On a CPU a transfer is done when its call returns, and a wait
        returns at once unless a background load has yet to copy the layer.

    ``wait_until(i)`` (``i`` = layer id - start_layer) makes the current stream wait for the latest
    ``record(i, stream)``. Every event is recorded once at construction, so a wait before any load
    returns at once, and a wait captured into a CUDA graph always becomes a node.
    """

    def __init__(self, layer_num: int, device: torch.device) -> None:
        self.layer_num = layer_num
        self.device = device
        # Layers a background load will record but has not yet (read without the lock on the fast
        # path: a list item read is atomic), and why a background load gave up on a layer.
        self._pending = [False] * layer_num
        self._failed: list[Optional[BaseException]] = [None] * layer_num
        self._cond = threading.Condition()
        self._events: Optional[list[torch.cuda.Event]] = None
        if device.type == "cuda":
            with torch.cuda.device(device):
                self._events = [_event() for _ in range(layer_num)]
                stream = torch.cuda.current_stream(device)
                for e in self._events:
                    e.record(stream)

    def record(self, layer_index: int, stream: Optional[torch.cuda.Stream]) -> None:
        """Layer ``layer_index`` is complete once ``stream`` reaches this point (on a CPU: now)."""
        if self._events is not None:
            self._events[layer_index].record(stream)
        if self._pending[layer_index] or self._failed[layer_index] is not None:
            with self._cond:
                self._pending[layer_index] = False
                self._failed[layer_index] = None
                self._cond.notify_all()

    def expect(self, layers: Iterable[int]) -> None:
        """A background load will ``record`` these layers: until it does, ``wait_until`` of one of
        them waits on the host for it."""
        with self._cond:
            for i in layers:
                self._pending[i] = True
                self._failed[i] = None

    def abandon(self, layers: Iterable[int], error: BaseException) -> None:
        """The background load of these layers failed: their pending waits raise ``error``'s story."""
        with self._cond:
            for i in layers:
                if self._pending[i]:
                    self._pending[i] = False
                    self._failed[i] = error
            self._cond.notify_all()

    def wait_until(self, layer_index: int) -> None:
        """The current stream waits for layer ``layer_index``'s latest recorded load (no device sync;
        the host waits only while a background load has not queued the layer yet).

        Raises
        ------
        RuntimeError
            If the background load of this layer failed before queueing it (the layer was not loaded).
        """
        if self._pending[layer_index]:
            with self._cond:
                while self._pending[layer_index]:
                    self._cond.wait()
        failed = self._failed[layer_index]
        if failed is not None:
            raise RuntimeError(
                f"layer {layer_index} was not loaded: its background load failed ({type(failed).__name__}: {failed})"
            ) from failed
        if self._events is not None:
            torch.cuda.current_stream(self.device).wait_event(self._events[layer_index])

    def event(self, layer_index: int) -> Optional[torch.cuda.Event]:
        """Layer ``layer_index``'s event (None on a CPU), e.g. to ``synchronize()`` on it in a test."""
        return None if self._events is None else self._events[layer_index]
