"""The allocator's free list and the counts it reads back without waiting.

``PageRing`` is a first-in first-out list of page ids in one preallocated buffer on the allocator's
device: taking pages from the front and giving pages back at the end cost time proportional to the
pages moved, never to the pages listed. Its front is kept on the host, its end on the device, so
that ``free`` can append pages whose number only the device knows (the pages that came back) without
waiting for it. The host keeps a count that is exact or, after such an append, a lower bound: every
page it counts is listed, so pages taken within it are always real. Reading the end (``read``,
a synchronisation on a GPU) makes the count exact again.

``FreeLists`` keeps the free ring, the release list and their counts, with the counts' copy back
to the host in a ``CountMirror`` (:mod:`kvpool.pools.allocator.count_mirror`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from kvpool.kernels.allocator import launcher as allocator_kernels
from kvpool.pools.allocator.count_mirror import CountMirror
from kvpool.pools.allocator.state import AllocatorState

logger = logging.getLogger("kvpool")


class PageRing:
    """Page ids in order, oldest first, in a circular buffer of ``capacity`` entries (plus one sink
    entry that masked writes go to).

    Parameters
    ----------
    pages : Tensor [F] int64 on the device, the initial contents (copied).
    capacity : entries the buffer holds (the allocator's page count: a consistent allocator never
        lists more pages than it has).
    tail : Tensor [] int64 on the device, where the ring keeps its absolute end position (a view into
        the allocator's counters, so that one copy brings every count back).
    """

    def __init__(self, pages: torch.Tensor, capacity: int, tail: torch.Tensor) -> None:
        self._cap = max(capacity, pages.numel(), 1)
        self._buf = torch.empty(self._cap + 1, dtype=torch.int64, device=pages.device)
        self._tail = tail  # absolute end position
        self._head = 0  # absolute position of the first page
        self._known = 0  # pages the host knows are listed (a lower bound of tail - head)
        self.exact = True  # whether the host count is exact
        self.reset(pages)

    def __len__(self) -> int:
        """Pages the host knows are listed; exact when ``exact``, else a lower bound."""
        return self._known

    @property
    def capacity(self) -> int:
        """Pages the ring can list at once (every page of the allocator)."""
        return self._cap

    @property
    def buffer(self) -> torch.Tensor:
        """Tensor [capacity + 1] int64: the circular buffer itself (its last entry is a sink)."""
        return self._buf

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
        """The first ``n`` pages (``n <= len(self)``): a view of the buffer unless the list wraps round
        its end, then a new tensor; either way valid only until the buffer is written again."""
        cap, h = self._cap, self._head % self._cap
        if h + n <= cap:
            return self._buf[h : h + n]
        return torch.cat((self._buf[h:cap], self._buf[: h + n - cap]))

    def contents(self) -> torch.Tensor:
        """Every listed page in order (``exact`` must hold)."""
        return self.front(self._known)

    def rotated(self) -> torch.Tensor:
        """The whole buffer as a new tensor [capacity], starting at the front: its first ``tail - head``
        entries are the list, whatever the host knows of that count."""
        h = self._head % self._cap
        return torch.cat((self._buf[h : self._cap], self._buf[:h]))

    def appended_on_device(self) -> None:
        """Pages were appended by a kernel that moved the end on the device: the host count is now a
        lower bound."""
        self.exact = False

    def drop_front(self, n: int) -> None:
        """Remove the first ``n`` pages (``n <= len(self)``); reads and writes nothing on the device."""
        self._head += n
        self._known -= n

    def extend(self, pages: torch.Tensor, keep: Optional[torch.Tensor] = None) -> None:
        """Append ``pages`` (1-D int64 on the buffer's device) at the end, or only those where ``keep``
        (bool, same length) is true, in order; reads nothing from the device. O(len(pages)).

        Without ``keep`` the host count grows by ``len(pages)``; with it the count stays (a lower
        bound) until ``read`` or ``observe``.
        """
        m = pages.numel()
        if m == 0:
            return
        if keep is None and self.exact and self._known + m > self._cap:
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
        self._tail += added
        if keep is None:
            self._known += m
        else:
            self.exact = False

    def read(self, tail: int) -> None:
        """Make the host count exact from ``tail``, the end read from the device (``int(self.tail)``)."""
        self._known = tail - self._head
        self.exact = True

    def observe(self, tail: int, mark: tuple[int, int], exact: bool) -> None:
        """Fold in ``tail``, the end as it was when ``mark()`` returned ``mark`` (and nothing was reset
        since): the pages the device had listed beyond the host count then are listed now too.
        ``exact``: no page was appended by the device since, so the count becomes exact."""
        head, known = mark
        self._known += max(tail - head - known, 0)
        self.exact = self.exact or exact

    def reset(self, pages: torch.Tensor) -> None:
        """Make ``pages`` (1-D, on the buffer's device) the whole list, copied into the buffer; it grows
        when they do not fit."""
        m = pages.numel()
        if pages.untyped_storage().data_ptr() == self._buf.untyped_storage().data_ptr():
            pages = pages.clone()  # a view of this buffer (``free_pages = free_pages[k:]``)
        if m > self._cap:
            self._cap = m
            self._buf = torch.empty(m + 1, dtype=torch.int64, device=self._buf.device)
        self._buf[:m] = pages
        self._head, self._known, self.exact = 0, m, True
        self._tail.fill_(m)

    def restore(self, rotated: torch.Tensor, count: torch.Tensor, known: int) -> None:
        """Put back a ``rotated()`` buffer whose first ``count`` (device) entries are the list, of which
        the host knows ``known``; reads nothing from the device."""
        if rotated.numel() != self._cap:
            self._cap = rotated.numel()
            self._buf = torch.empty(self._cap + 1, dtype=torch.int64, device=self._buf.device)
        self._buf[: self._cap] = rotated
        self._tail.copy_(count)
        self._head, self._known, self.exact = 0, known, False


@dataclass(frozen=True)
class Take:
    """Pages an allocation will take: the front of the free list, or of ``merged`` (the free and
    release lists merged and sorted, which becomes the free list) when the free list is too short.
    They are ``source[(start + r) % cap]`` for ``r < count`` (what the hand-out kernel reads);
    ``pages`` is them as one tensor."""

    source: torch.Tensor
    start: int
    cap: int
    count: int
    merged: Optional[torch.Tensor]

    @property
    def pages(self) -> torch.Tensor:
        """Tensor [count] int64: the pages (a view where they do not wrap round the buffer's end)."""
        s, c, n = self.start, self.cap, self.count
        if s + n <= c:
            return self.source[s : s + n]
        return torch.cat((self.source[s:c], self.source[: s + n - c]))


class FreeLists:
    """An allocator's free list, release list (``need_sort``) and rejected-free count, with host counts
    that never wait for the device.

    ``give_back`` appends pages where a device mask says so and ``add_rejected`` adds a device count;
    neither reads anything back. ``changed()`` then either reads the counts at once (``eager``: a CPU
    allocator, or validate) or queues their copy back to the host (``CountMirror``), folded in by
    ``poll()`` once it has landed. Until then the host counts are lower bounds: what they count is
    listed. ``read()`` makes them exact (a synchronisation on a GPU); ``plan`` calls it only when an
    allocation asks for more than the host counts while a count is outstanding.

    Parameters
    ----------
    num_pages : pages of the allocator (ids ``1..num_pages``), all free at first.
    device : the bookkeeping's device.
    need_sort : freed pages go to the release list, merged into the free list sorted when needed.
    eager : read the counts after every change.
    name : the allocator's class name, for the warning on the first rejected free.
    """

    def __init__(self, num_pages: int, device: torch.device, need_sort: bool, eager: bool, name: str) -> None:
        self.need_sort, self.eager, self._name = need_sort, eager, name
        self._device, self._num_pages = device, num_pages
        # The counts the device keeps, side by side so that one copy brings them back: the free
        # ring's end, the release list's length, the rejected frees (never reset).
        self.counters = torch.zeros(3, dtype=torch.int64, device=device)
        # Pages freed under need_sort, in chunks as freed (-1: no page); counted on the device and,
        # as a lower bound until read, on the host.
        self._release: list[torch.Tensor] = []
        self.release_count = self.counters[1]
        self.release_known, self._release_exact = 0, True
        self._rejected = self.counters[2]
        self.rejected_seen, self._rejected_exact = 0, True
        self._mirror = CountMirror(3, device)
        self._sort_scratch: Optional[torch.Tensor] = None  # where the give-back kernel sorts a free
        self._changes = 0  # calls that left counts on the device, to tell whether a copy is the latest
        # Whether the last change of the counters was a kernel that also wrote them to the mirror.
        self._mirrored = False
        self.reset()

    def reset(self) -> None:
        """Every page free, in order, and nothing released (rejected frees stay counted)."""
        pages = torch.arange(1, self._num_pages + 1, dtype=torch.int64, device=self._device)
        self.ring = PageRing(pages, self._num_pages, self.counters[0])
        self._clear_release()

    # --- counts ----------------------------------------------------------------------------------

    def available(self) -> int:
        """Pages ``plan`` can take (a lower bound until ``read``); never waits."""
        self.poll()
        return len(self.ring) + self.release_known

    def exact(self) -> bool:
        """Whether the host's counts are exact (no free's counts still on their way back)."""
        return self.ring.exact and self._release_exact

    def add_rejected(self, dropped: Optional[torch.Tensor]) -> None:
        """Count ``dropped`` (a device scalar) rejected frees, or note that a kernel counted some in
        ``counters``; nothing read back."""
        if dropped is not None:
            self._rejected += dropped
            self._mirrored = False
        self._rejected_exact = False

    def changed(self) -> None:
        """After calls that left counts on the device: read them (eager) or queue their copy back
        (none to launch when the kernel that changed them last wrote them to the mirror itself)."""
        self._changes += 1
        mirrored, self._mirrored = self._mirrored, False
        if self.eager:
            self.read()
        elif not (self.exact() and self._rejected_exact):
            tag = (self._changes, self.ring.mark(), self.release_known)
            if mirrored:
                self._mirror.landed_behind(tag)
            else:
                self._mirror.queue(self._counters(), tag)

    def read(self) -> None:
        """Make every host count exact: one read of the device (a synchronisation on a GPU), skipped when
        nothing is outstanding."""
        if self.exact() and self._rejected_exact:
            return
        tail, release, rejected = self._counters().tolist()
        self._mirror.drop()
        self.ring.read(tail)
        self.release_known, self._release_exact = release, True
        self._note_rejected(rejected)
        self._rejected_exact = True

    def poll(self) -> None:
        """Fold in the counts copied back, if they have landed; never waits."""
        got = self._mirror.poll()
        if got is None:
            return
        (tail, release, rejected), (changes, mark, release_known) = got
        latest = changes == self._changes  # nothing left counts on the device since the copy
        self.ring.observe(tail, mark, latest)
        self.release_known += max(release - release_known, 0)
        self._note_rejected(rejected)
        if latest:
            self._release_exact = self._rejected_exact = True

    def _counters(self) -> torch.Tensor:
        return self.counters

    def _note_rejected(self, total: int) -> None:
        if total <= self.rejected_seen:
            return
        if self.rejected_seen == 0:
            logger.warning(
                "kvpool: %s.free dropped %d entries that were not handed-out slots (double free, "
                "slot 0 or never allocated); construct with validate=True to raise instead",
                self._name, total,
            )  # fmt: skip
        self.rejected_seen = total

    # --- taking and giving back ------------------------------------------------------------------

    def plan(self, count: int) -> Optional[Take]:
        """The first ``count`` free pages, or None if too few. Changes nothing. Decided from the host
        counts; reads the device only when they are short of ``count`` while a count is outstanding.
        O(count) unless the release list must be merged in."""
        if count < 0:
            raise ValueError(f"count must be >= 0 pages, got {count}")
        self.poll()
        ring = self.ring
        if count > len(ring) and not self.exact():
            self.read()
        if count <= len(ring):
            return Take(ring.buffer, ring.front_at(), ring.capacity, count, None)
        if count > len(ring) + self.release_known:
            return None
        merged = self._merged()
        return Take(merged, 0, max(merged.numel(), 1), count, merged)

    def commit(self, take: Take) -> None:
        """Remove ``take``'s pages from the lists (after ``plan``, nothing changed in between)."""
        self._mirrored = False
        if take.merged is None:
            self.ring.drop_front(take.count)
        else:
            self.ring.reset(take.merged[take.count :])
            self._clear_release()

    def give_back(self, pages: torch.Tensor, keep: torch.Tensor) -> None:
        """Append the ``pages`` where ``keep`` to the release list (need_sort) or the free list, on the
        device: O(len(pages)), nothing read back."""
        self._mirrored = False
        if self.need_sort:
            self._release.append(torch.where(keep, pages, -1))
            self.release_count += keep.sum()
            self._release_exact = False
        else:
            self.ring.extend(pages, keep)

    def take_back(
        self,
        slots: torch.Tensor,
        books: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        page_size: int,
        group: Optional[list[torch.Tensor]],
        skip_padding: bool = False,
        mapping: Optional[torch.Tensor] = None,
    ) -> None:
        """A ``free`` in one launch of the bookkeeping kernel: ``slots`` (int64, any order) drop
        a holder in ``books`` (owners, live, page_free) and the pages they release go to ``group``
        (a free group's pending list: one tensor, page or -1 per entry), the release list
        (need_sort) or the free list's end; entries that do not count are added to the rejected
        count (padding, entries <= 0, aside if ``skip_padding``). Nothing read back.

        ``mapping`` (at most ``GIVE_BACK_SORT_MAX`` slots): ``slots`` are full slots of a
        sliding-window allocator, freed as their SWA slots through it, whose entries become 0."""
        scratch = None
        if mapping is not None or slots.numel() <= allocator_kernels.GIVE_BACK_SORT_MAX:  # the kernel sorts them itself
            if self._sort_scratch is None:
                self._sort_scratch = torch.empty(allocator_kernels.GIVE_BACK_SORT_MAX, dtype=torch.int64, device=self._device)
            scratch = self._sort_scratch
        else:
            slots = torch.sort(slots).values
        self._give_back_on_kernel(slots, books, page_size, group, scratch=scratch, skip_padding=skip_padding, mapping=mapping)
        self.add_rejected(None)

    def give_back_pages(self, pages: torch.Tensor) -> None:
        """Append ``pages`` (int64 page ids, -1 for none: a free group's pending list) to the release
        list (need_sort) or the free list: one launch of the bookkeeping kernel on kernels, else
        ``give_back``; nothing read back."""
        if not allocator_kernels.on_kernels(self._device):
            self.give_back(pages, pages >= 0)
            return
        none = (pages, pages, pages)  # no bookkeeping in an append: any tensor stands in for it
        self._give_back_on_kernel(pages, none, 1, None, append=True)

    def _give_back_on_kernel(
        self,
        entries: torch.Tensor,
        books: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        page_size: int,
        group: Optional[list[torch.Tensor]],
        **kernel_args: object,
    ) -> None:
        """One launch of the give-back kernel whose released pages go to ``group`` (in place, page or
        -1 per entry), else the release list (need_sort, counted), else the free list's end."""
        owners, live, page_free = books
        # Where the counters are copied back from (not for an eager list, which reads them at once).
        mirror = None if self.eager else self._mirror.host
        kernel_args["mirror"] = mirror
        if group is not None or self.need_sort:
            dest = torch.empty_like(entries)
            to = allocator_kernels.TO_NONE if group is not None else allocator_kernels.TO_RELEASE
            allocator_kernels.give_back(
                entries, owners, live, page_free, dest, self.counters, 1, page_size, allocator_kernels.LIST, to,
                **kernel_args,  # type: ignore[arg-type]
            )  # fmt: skip
            if group is not None:
                group.append(dest)
            else:
                self._release.append(dest)
                self._release_exact = False
        else:
            ring = self.ring
            allocator_kernels.give_back(
                entries, owners, live, page_free, ring.buffer, self.counters, ring.capacity, page_size,
                allocator_kernels.RING, allocator_kernels.TO_TAIL, **kernel_args,  # type: ignore[arg-type]
            )  # fmt: skip
            ring.appended_on_device()
        self._mirrored = mirror is not None

    def merge(self) -> None:
        """Move the release list into the free list, sorted (reads the counts first)."""
        self.read()
        if self.release_known:
            self.ring.reset(self._merged())
        self._clear_release()

    def _merged(self) -> torch.Tensor:
        """The free and release lists together, sorted (a new tensor); the counts must be exact."""
        raw = self.release_raw()
        both = torch.sort(torch.cat((self.ring.contents(), raw))).values
        return both[raw.numel() - self.release_known :]  # the -1 entries (no page) sort first

    def release_raw(self) -> torch.Tensor:
        """The release list as kept, -1 for no page (one tensor)."""
        if not self._release:
            return torch.empty(0, dtype=torch.int64, device=self._device)
        if len(self._release) > 1:
            self._release = [torch.cat(self._release)]
        return self._release[0]

    def set_release(self, pages: torch.Tensor) -> None:
        """Make ``pages`` (int64, on the device) the release list."""
        self._mirrored = False
        self._release = [pages] if pages.numel() else []
        self.release_count.fill_(pages.numel())
        self.release_known, self._release_exact = pages.numel(), True
        self._mirror.drop()

    def set_free(self, pages: torch.Tensor) -> None:
        """Make ``pages`` (int64, on the device) the free list."""
        self._mirrored = False
        self.ring.reset(pages)
        self._mirror.drop()

    def restore(self, state: AllocatorState) -> None:
        """Put back the lists of a snapshot (``AllocatorState``); reads nothing back."""
        self._mirrored = False
        self._mirror.drop()
        self.ring.restore(state.free_ring, state.free_count, state.free_known)
        self._release = [state.release_raw] if state.release_raw.numel() else []
        self.release_count.copy_(state.release_count)
        self.release_known, self._release_exact = state.release_known, False

    def _clear_release(self) -> None:
        self._mirrored = False
        self._release = []
        self.release_count.zero_()
        self.release_known, self._release_exact = 0, True
        self._mirror.drop()
