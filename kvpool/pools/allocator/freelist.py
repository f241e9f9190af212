"""``PageRing``: a first-in first-out list of page ids in one preallocated buffer on the allocator's
device, so that taking pages from the front and giving pages back at the end cost time proportional
to the pages moved, never to the pages listed.

The host keeps the front position and the count, so every length is known without reading the device.
Pages taken are read as a view of the buffer (one or two pieces when the list wraps round its end);
the allocator copies what it hands out before the buffer is written again.
"""

from __future__ import annotations

import torch


class PageRing:
    """Page ids in order, oldest first, in a circular buffer of ``capacity`` entries.

    Parameters
    ----------
    pages : Tensor [F] int64 on the device, the initial contents (copied).
    capacity : entries the buffer holds before it must grow (the allocator's page count: a consistent
        allocator never lists more pages than it has).
    """

    def __init__(self, pages: torch.Tensor, capacity: int) -> None:
        self._buf = torch.empty(max(capacity, pages.numel(), 1), dtype=torch.int64, device=pages.device)
        self._head = 0
        self._count = 0
        self.reset(pages)

    def __len__(self) -> int:
        return self._count

    @property
    def capacity(self) -> int:
        """Entries the buffer holds without growing."""
        return self._buf.numel()

    def front(self, n: int) -> torch.Tensor:
        """The first ``n`` pages (``n <= len(self)``): a view of the buffer unless the list wraps, then a
        new tensor; either way valid only until the next ``extend``/``reset``. Changes nothing."""
        cap, h = self.capacity, self._head
        if h + n <= cap:
            return self._buf[h : h + n]
        return torch.cat((self._buf[h:], self._buf[: h + n - cap]))

    def contents(self) -> torch.Tensor:
        """Every listed page in order, as ``front(len(self))``."""
        return self.front(self._count)

    def copy(self) -> torch.Tensor:
        """Every listed page in order, as a new tensor (a snapshot the buffer's later writes leave alone)."""
        return self.contents().clone()

    def drop_front(self, n: int) -> None:
        """Remove the first ``n`` pages (``n <= len(self)``); nothing is read or written on the device."""
        self._head = (self._head + n) % self.capacity
        self._count -= n

    def extend(self, pages: torch.Tensor) -> None:
        """Append ``pages`` (1-D int64 on the buffer's device) at the end, in at most two copies."""
        m = pages.numel()
        if m == 0:
            return
        if self._count + m > self.capacity:
            # Only a list made inconsistent from outside (an assignment to free_pages) gets here.
            self.reset(torch.cat((self.contents(), pages)))
            return
        cap = self.capacity
        tail = (self._head + self._count) % cap
        first = min(m, cap - tail)
        self._buf[tail : tail + first] = pages[:first]
        if first < m:
            self._buf[: m - first] = pages[first:]
        self._count += m

    def reset(self, pages: torch.Tensor) -> None:
        """Make ``pages`` (1-D, on the buffer's device) the whole list, copied into the buffer; it grows
        when they do not fit."""
        m = pages.numel()
        if pages.untyped_storage().data_ptr() == self._buf.untyped_storage().data_ptr():
            pages = pages.clone()  # a view of this buffer (``free_pages = free_pages[k:]``)
        if m > self.capacity:
            self._buf = torch.empty(m, dtype=torch.int64, device=self._buf.device)
        self._buf[:m] = pages
        self._head, self._count = 0, m
