"""Host memory registered with a Mooncake Store client: what the client reads objects from and writes
them into (the host pool's buffers, and staging buffers for record headers and tensor pages).

Registered memory must stay allocated while it is registered (a region freed and reallocated while
still registered is refused by the client as an overlap), so :class:`RegisteredMemory` keeps a
reference to each registered buffer until it unregisters it.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import numpy as np

#: Staging buffers up to this size are kept registered for reuse; a larger one is released after its call.
KEEP_STAGING_BYTES = 64 << 20


class RegisteredMemory:
    """The buffers one client has registered: the host pool's (replaced by ``set_host``) and a pool
    of staging buffers that concurrent calls each take one of (``staging``)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._lock = threading.Lock()
        self._owners: dict[int, object] = {}  # address -> the memory registered there
        self._host: list[int] = []
        self._spare: list[np.ndarray] = []

    def register(self, owner: object, ptr: int, size: int) -> int:
        """Register ``size`` bytes at ``ptr`` with the client, kept alive by ``owner`` while registered;
        returns ``ptr``. ``RuntimeError`` when Mooncake refuses."""
        rc = self.client.register_buffer(ptr, size)
        if rc != 0:
            raise RuntimeError(f"Mooncake Store could not register {size} bytes of host memory at {ptr:#x} (code {rc})")
        with self._lock:
            self._owners[ptr] = owner
        return ptr

    def unregister(self, ptr: int) -> None:
        """Unregister the memory at ``ptr`` and drop its owner."""
        self.client.unregister_buffer(ptr)
        with self._lock:
            self._owners.pop(ptr, None)

    def set_host(self, buffers: list[Any]) -> None:
        """Register a host pool's buffers (tensors), unregistering the previous host pool's."""
        for ptr in self._host:
            self.unregister(ptr)
        self._host = [self.register(b, b.data_ptr(), b.numel() * b.element_size()) for b in buffers]

    @contextlib.contextmanager
    def staging(self, nbytes: int) -> Iterator[np.ndarray]:
        """A registered uint8 buffer of at least ``nbytes`` for the duration of a ``with``."""
        buf = None
        with self._lock:
            for i, spare in enumerate(self._spare):
                if spare.nbytes >= nbytes:
                    buf = self._spare.pop(i)
                    break
        if buf is None:
            buf = np.zeros(max(nbytes, 4096), dtype=np.uint8)
            self.register(buf, buf.ctypes.data, buf.nbytes)
        try:
            yield buf
        finally:
            if buf.nbytes > KEEP_STAGING_BYTES:
                self.unregister(buf.ctypes.data)
            else:
                with self._lock:
                    self._spare.append(buf)

    def release_all(self) -> None:
        """Unregister everything (before the client closes)."""
        with self._lock:
            ptrs = list(self._owners)
        for ptr in ptrs:
            self.unregister(ptr)
        self._host, self._spare = [], []
