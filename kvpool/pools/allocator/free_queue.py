"""``PageQueue``: an allocator's free list, page ids oldest first in a buffer on its device that is
never rewritten under the slots it has lent out.

Pages are taken from the front, whose position the host keeps, and given back at the end, whose
position the device keeps (``free`` appends pages whose number only the device knows, without
waiting for it). A position is written only while it lies at or past the front, so a view of the
positions taken, which a token allocator's ``alloc`` returns, keeps its values: when the end would
run past the buffer, the list moves to the start of a fresh buffer (``compact``: one copy of the
list every ``num_pages // 2`` pages taken), and the old one lives on for as long as views of it do.
``lend`` takes pages without recording them held: the allocator records the pages lent since its
last record (``unmarked``) in its next launch.

Such a queue (``lends``) keeps two copies of the list: ``lent``, of which ``alloc`` returns views (a
caller may write into them), and ``buffer``, from which the bookkeeping reads the pages it records,
written only by the allocator. A queue that lends nothing (the paged allocators, validate) is a ring
instead: one buffer of ``num_pages`` entries whose positions wrap round its end, never moved.
"""

from __future__ import annotations

from typing import Optional

import torch


class PageQueue:
    """Page ids in order, oldest first, in a buffer of ``capacity`` entries (plus one sink entry that
    masked writes go to).

    Parameters
    ----------
    pages : Tensor [F] int64 on the device, the initial contents (copied).
    num_pages : pages of the allocator: a consistent allocator never lists more at once.
    tail : Tensor [] int64 on the device, where the queue keeps its absolute end position (a view into
        the allocator's counters, so that one copy brings every count back).
    lends : keep the second copy, ``lent``, that ``lend`` returns views of.
    """

    def __init__(self, pages: torch.Tensor, num_pages: int, tail: torch.Tensor, lends: bool) -> None:
        self._num_pages = max(num_pages, 1)
        self._lends = lends
        self._tail = tail  # absolute end position
        self._cap = 0
        self._buf = self._lent = pages[:0]
        self._head = 0  # absolute position of the first page
        self._marked = 0  # pages before this position are recorded held; those up to head are lent
        self._known = 0  # pages the host knows are listed (a lower bound of tail - head)
        self._most = self._num_pages  # the most pages listed at once (more only if assigned so)
        self._lent_out = False  # whether a view of the buffer has been lent since it was made
        self.exact = True  # whether the host count is exact
        self.reset(pages)

    def __len__(self) -> int:
        """Pages the host knows are listed; exact when ``exact``, else a lower bound."""
        return self._known

    @property
    def capacity(self) -> int:
        """Positions of the buffer (taken modulo it in a ring; in a lending queue the end never passes
        it, ``compact`` sees to that)."""
        return self._cap

    @property
    def buffer(self) -> torch.Tensor:
        """Tensor [capacity + 1] int64: the pages the bookkeeping reads (its last entry is a sink)."""
        return self._buf

    @property
    def lent(self) -> torch.Tensor:
        """Tensor [capacity + 1] int64: the copy ``lend`` returns views of (``buffer`` if none)."""
        return self._lent

    @property
    def lends(self) -> bool:
        """Whether ``lend`` may be used (the queue keeps a copy to lend views of)."""
        return self._lends

    @property
    def tail(self) -> torch.Tensor:
        """Tensor [] int64 on the device: the absolute end position (``head + true count``)."""
        return self._tail

    def count(self) -> torch.Tensor:
        """Tensor [] int64 on the device: the true count (a new tensor; nothing read back)."""
        return self._tail - self._head

    def mark(self) -> tuple[int, int]:
        """``(head, known count)`` now, for ``observe`` of a later read of ``tail``."""
        return self._head, self._known

    def front_at(self) -> int:
        """Where the list starts in the buffer (``front(n)`` is ``buffer[(front_at() + r) % capacity]``)."""
        return self._head % self._cap

    def front(self, n: int) -> torch.Tensor:
        """The first ``n`` pages (``n <= len(self)``): a view of ``buffer`` unless they wrap round its
        end (a ring only), then a new tensor."""
        cap, h = self._cap, self._head % self._cap
        if h + n <= cap:
            return self._buf[h : h + n]
        return torch.cat((self._buf[h:cap], self._buf[: h + n - cap]))

    def contents(self) -> torch.Tensor:
        """Every listed page in order (``exact`` must hold), as a view of ``buffer``."""
        return self.front(self._known)

    def rotated(self) -> torch.Tensor:
        """The list's part of the buffer as a new tensor, from the front: its first ``tail - head``
        entries are the list, whatever the host knows of that count."""
        if self._lends:
            return self._buf[self._head : min(self._head + self._most, self._cap)].clone()
        h = self._head % self._cap
        return torch.cat((self._buf[h : self._cap], self._buf[:h]))

    def appended_on_device(self) -> None:
        """Pages were appended by a kernel that moved the end on the device: the host count is now a
        lower bound."""
        self.exact = False

    # --- taking ----------------------------------------------------------------------------------

    def drop_front(self, n: int) -> None:
        """Remove the first ``n`` pages (``n <= len(self)``), recorded held by the caller (every page
        lent before must be recorded already); reads and writes nothing on the device."""
        assert self._marked == self._head, "pages lent but not recorded held before an allocation that records its own"
        self._head += n
        self._known -= n
        self._marked = self._head

    def lend(self, n: int) -> torch.Tensor:
        """Remove the first ``n`` pages (``n <= len(self)``) and return them as a view of ``lent``,
        not recorded held yet (``unmarked``); launches nothing."""
        h = self._head
        self._head += n
        self._known -= n
        self._lent_out = True
        return self._lent[h : h + n]

    def unmarked(self) -> tuple[int, int]:
        """``(position, count)`` in ``buffer`` of the pages lent and not recorded held yet."""
        return self._marked, self._head - self._marked

    def marked(self) -> None:
        """The pages lent so far are recorded held (the caller recorded ``unmarked()``)."""
        self._marked = self._head

    # --- giving back -----------------------------------------------------------------------------

    def needs_room(self) -> bool:
        """Whether an append could run past a lending queue's buffer: ``compact`` first (with nothing
        unmarked)."""
        return self._lends and self._head + self._most > self._cap

    def compact(self) -> None:
        """Move the list to the start of fresh buffers (the old ones stay valid for views of them):
        copies ``num_pages`` entries on the device, nothing read back. Lent pages must be marked."""
        assert self._marked == self._head, "pages lent but not recorded held before a compaction"
        h, m = self._head, min(self._most, self._cap - self._head)
        old_buf, old_lent = self._buf, self._lent
        self._fresh(self._cap)
        self._buf[:m] = old_buf[h : h + m]
        if self._lends:
            self._lent[:m] = old_lent[h : h + m]
        self._tail -= h
        self._head = self._marked = 0

    def extend(self, pages: torch.Tensor, keep: Optional[torch.Tensor] = None) -> None:
        """Append ``pages`` (1-D int64 on the buffer's device) at the end, or only those where ``keep``
        (bool, same length) is true, in order; reads nothing from the device. O(len(pages)). The
        caller has made room (``needs_room``).

        Without ``keep`` the host count grows by ``len(pages)``; with it the count stays (a lower
        bound) until ``read`` or ``observe``.
        """
        m = pages.numel()
        if m == 0:
            return
        if keep is None and self.exact and self._known + m > (self._most if self._lends else self._cap):
            # Only a list made inconsistent from outside (an assignment to free_pages) gets here.
            self.reset(torch.cat((self.contents(), pages)))
            return
        if keep is None:
            rank = torch.arange(m, dtype=torch.int64, device=pages.device)
            pos = (self._tail + rank) % self._cap
            added: torch.Tensor | int = m
        else:
            pos = torch.where(keep, (self._tail + torch.cumsum(keep, 0) - 1) % self._cap, self._cap)
            added = keep.sum()
        self._buf[pos] = pages
        if self._lends:
            self._lent[pos] = pages
        self._tail += added
        if keep is None:
            self._known += m
        else:
            self.exact = False

    # --- counts and resets -----------------------------------------------------------------------

    def read(self, tail: int) -> None:
        """Make the host count exact from ``tail``, the end read from the device (``int(self.tail)``)."""
        self._known = tail - self._head
        self.exact = True

    def observe(self, tail: int, mark: tuple[int, int], exact: bool) -> None:
        """Fold in ``tail``, the end as it was when ``mark()`` returned ``mark`` (and nothing was reset
        since; a compaction moves both ends alike): the pages the device had listed beyond the host
        count then are listed now too. ``exact``: no page was appended by the device since, so the
        count becomes exact."""
        head, known = mark
        self._known += max(tail - head - known, 0)
        self.exact = self.exact or exact

    def reset(self, pages: torch.Tensor) -> None:
        """Make ``pages`` (1-D, on the buffer's device) the whole list; the pages lent and not marked
        are forgotten (the caller marked them, or undoes them)."""
        m = pages.numel()
        if pages.untyped_storage().data_ptr() in (self._buf.untyped_storage().data_ptr(), self._lent.untyped_storage().data_ptr()):
            pages = pages.clone()  # a view of this buffer (``free_pages = free_pages[k:]``)
        self._most = max(self._num_pages, m)
        self._writable(self._most)
        self._buf[:m] = pages
        if self._lends:
            self._lent[:m] = pages
        self._head = self._marked = 0
        self._known, self.exact = m, True
        self._tail.fill_(m)

    def restore(self, rotated: torch.Tensor, count: torch.Tensor, known: int) -> None:
        """Put back a ``rotated()`` buffer whose first ``count`` (device) entries are the list, of which
        the host knows ``known``; reads nothing from the device. The pages lent and not marked are
        forgotten (the snapshot is from before them)."""
        m = rotated.numel()
        self._most = max(self._num_pages, m)
        self._writable(self._most)
        self._buf[:m] = rotated
        if self._lends:
            self._lent[:m] = rotated
        self._tail.copy_(count)
        self._head = self._marked = 0
        self._known, self.exact = known, False

    def _writable(self, most: int) -> None:
        """Buffers for a list of up to ``most`` pages from position 0: the present ones unless too
        small or lent out (a view of them must keep its values), else fresh ones."""
        cap = most + max(most // 2, 64) if self._lends else most
        if self._lent_out or self._cap < cap:
            self._fresh(cap)

    def _fresh(self, cap: int) -> None:
        device = self._buf.device
        self._cap = cap
        self._buf = torch.empty(cap + 1, dtype=torch.int64, device=device)
        self._lent = torch.empty(cap + 1, dtype=torch.int64, device=device) if self._lends else self._buf
        self._lent_out = False
