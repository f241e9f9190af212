"""The allocator's free lists and the counts it reads back without waiting.

The free list is a ``PageQueue`` (:mod:`kvpool.pools.allocator.free_queue`): taking pages from the
front and giving pages back at the end cost time proportional to the pages moved, never to the pages
listed. Its front is kept on the host, its end on the device, so that ``free`` can append pages
whose number only the device knows (the pages that came back) without waiting for it. The host
keeps a count that is exact or, after such an append, a lower bound: every page it counts is listed,
so pages taken within it are always real. Reading the end (``read``, a synchronisation on a GPU)
makes the count exact again.

``FreeLists`` keeps the free queue, the release list and their counts, with the counts' copy back
to the host in a ``CountMirror`` (:mod:`kvpool.pools.allocator.count_mirror`), and records the
pages a token allocator's ``alloc`` lent (``lend``) held in the next launch that takes slots back
(or, on the PyTorch path and before anything else reads or moves the books, in ``mark_lent``).
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Optional

import torch

from kvpool.kernels.allocator import launcher as allocator_kernels
from kvpool.pools.allocator.count_mirror import CountMirror
from kvpool.pools.allocator.free_queue import PageQueue
from kvpool.pools.allocator.ownership import add_holders
from kvpool.pools.allocator.state import AllocatorState

logger = logging.getLogger("kvpool")

#: The bookkeeping a launch updates: ``(owners, live, page_free, unrecorded)``.
Books = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
#: Most lent pages the give-back kernel records itself (its one program walks them); more are
#: recorded by PyTorch operations first.
MARK_MAX = 4096


class Take(NamedTuple):
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
    lends : the free queue keeps a copy to ``lend`` views of (a token allocator without validate).
    """

    def __init__(
        self, num_pages: int, device: torch.device, need_sort: bool, eager: bool, name: str, lends: bool = False
    ) -> None:
        self.need_sort, self.eager, self._name, self._lends = need_sort, eager, name, lends
        self._device, self._num_pages = device, num_pages
        # The counts the device keeps, side by side so that one copy brings them back: the free
        # queue's end, the release list's length, the rejected frees (never reset).
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
        self._ring_frees: Optional[allocator_kernels.RingFrees] = None  # a token free's kept launch
        self._changes = 0  # calls that left counts on the device, to tell whether a copy is the latest
        # Whether the last change of the counters was a kernel that also wrote them to the mirror.
        self._mirrored = False
        self.reset()

    def reset(self) -> None:
        """Every page free, in order, and nothing released (rejected frees stay counted)."""
        pages = torch.arange(1, self._num_pages + 1, dtype=torch.int64, device=self._device)
        self.queue = PageQueue(pages, self._num_pages, self.counters[0], self._lends)
        self._clear_release()

    # --- counts ----------------------------------------------------------------------------------

    def available(self) -> int:
        """Pages ``plan`` can take (a lower bound until ``read``); never waits."""
        self.poll()
        return len(self.queue) + self.release_known

    def exact(self) -> bool:
        """Whether the host's counts are exact (no free's counts still on their way back)."""
        return self.queue.exact and self._release_exact

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
            tag = self._tag()
            if mirrored:
                self._mirror.landed_behind(tag)
            else:
                self._mirror.queue(self._counters(), tag)

    def _tag(self) -> tuple:
        """What a copy of the counts queued now comes back with, for ``poll``."""
        return self._changes, self.queue.mark(), self.release_known

    def read(self) -> None:
        """Make every host count exact: one read of the device (a synchronisation on a GPU), skipped when
        nothing is outstanding."""
        if self.exact() and self._rejected_exact:
            return
        tail, release, rejected = self._counters().tolist()
        self._mirror.drop()
        self.queue.read(tail)
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
        self.queue.observe(tail, mark, latest)
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
        queue = self.queue
        if count > len(queue):  # the counts copied back may list more (a poll queries a CUDA event: only when short)
            self.poll()
            if count > len(queue) and not self.exact():
                self.read()
        if count <= len(queue):
            return Take(queue.buffer, queue.front_at(), queue.capacity, count, None)
        if count > len(queue) + self.release_known:
            return None
        merged = self._merged()
        return Take(merged, 0, max(merged.numel(), 1), count, merged)

    def commit(self, take: Take) -> None:
        """Remove ``take``'s pages from the lists (after ``plan``, nothing changed in between), recorded
        held by the caller (after ``mark_lent``)."""
        self._mirrored = False
        if take.merged is None:
            self.queue.drop_front(take.count)
        else:
            self.queue.reset(take.merged[take.count :])
            self._clear_release()

    def lend(self, count: int) -> torch.Tensor:
        """Remove the free list's first ``count`` pages (at most its host count, one slot per page:
        ``queue.lends``; a plan's ``Take`` from the free list is these) and return them as a view of
        the queue's lent copy, recorded held by the next launch that takes slots back or by
        ``mark_lent``; launches nothing."""
        self._mirrored = False
        return self.queue.lend(count)

    def mark_lent(self, books: Books) -> None:
        """Record held the pages lent since the last record, by PyTorch operations (nothing read
        back; nothing to do when none are lent)."""
        start, count = self.queue.unmarked()
        if count:
            pages = self.queue.buffer[start : start + count]
            add_holders(books, None, None, pages, 1, inside_range=False)
            self.queue.marked()

    def give_back(self, pages: torch.Tensor, keep: torch.Tensor, books: Books) -> None:
        """Append the ``pages`` where ``keep`` to the release list (need_sort) or the free list, on the
        device: O(len(pages)), nothing read back."""
        self._mirrored = False
        if self.need_sort:
            self._release.append(torch.where(keep, pages, -1))
            self.release_count += keep.sum()
            self._release_exact = False
        else:
            self._make_room(books)
            self.queue.extend(pages, keep)

    def take_back(
        self,
        slots: torch.Tensor,
        books: Books,
        page_size: int,
        group: Optional[list[torch.Tensor]],
        skip_padding: bool = False,
        mapping: Optional[torch.Tensor] = None,
    ) -> None:
        """A ``free`` in one launch of the bookkeeping kernel: ``slots`` (int64, any order) drop
        a holder in ``books`` and the pages they release go to ``group`` (a free group's pending
        list: one tensor, page or -1 per entry), the release list (need_sort) or the free list's
        end; entries that do not count are added to the rejected count (padding, entries <= 0,
        aside if ``skip_padding``). The pages lent since the last launch are recorded held first.
        Nothing read back.

        ``mapping`` (at most ``GIVE_BACK_SORT_MAX`` slots): ``slots`` are full slots of a
        sliding-window allocator, freed as their SWA slots through it, whose entries become 0."""
        scratch = None
        if mapping is not None or slots.numel() <= allocator_kernels.GIVE_BACK_SORT_MAX:  # the kernel sorts them itself
            scratch = self._scratch()
        else:
            slots = torch.sort(slots).values
        self._give_back_on_kernel(slots, books, page_size, group, scratch=scratch, skip_padding=skip_padding, mapping=mapping)
        self.add_rejected(None)

    def take_back_directly(self, free_index: object, books: Books) -> bool:
        """``take_back`` then ``changed`` of a token allocator's free outside a free group, when
        ``free_index`` is what a scheduler frees on every step: an int64 tensor [1 ..
        ``GIVE_BACK_SORT_MAX``] on the device, contiguous; through ``RingFrees``, the launch alone.
        False, with nothing done, where it does not apply (then the general path)."""
        queue = self.queue
        if (
            type(free_index) is not torch.Tensor or free_index.dtype is not torch.int64 or free_index.dim() != 1
            or not 0 < free_index.shape[0] <= allocator_kernels.GIVE_BACK_SORT_MAX or not free_index.is_contiguous()
            or free_index.device != self._device or self.need_sort or not queue.lends or queue.needs_room()
        ):  # fmt: skip
            return False
        start, count = queue.unmarked()
        if count > MARK_MAX:
            return False
        owners, live, page_free, unrecorded = books
        frees = self._ring_frees
        if frees is None or not frees.holds(owners, live, page_free, queue.buffer, queue.lent, unrecorded):
            if not allocator_kernels.RingFrees.fits(owners.shape[0], queue.capacity):
                return False
            frees = self._ring_frees = allocator_kernels.RingFrees(
                owners, live, page_free, queue.buffer, self.counters, self._scratch(), self._mirror.tagged,
                queue.lent, unrecorded, queue.capacity,
            )  # fmt: skip
        if not frees.launch(free_index, start, count, self._mirror.next_seq()):
            return False
        queue.appended_on_device()
        queue.marked()
        self._rejected_exact = False
        self._changes += 1  # changed(), after a launch that mirrored the counts
        self._mirror.landed_behind(self._tag())
        self._mirrored = False
        return True

    def _scratch(self) -> torch.Tensor:
        """Where the give-back kernel sorts a free (``GIVE_BACK_SORT_MAX`` int64, made at first use)."""
        if self._sort_scratch is None:
            self._sort_scratch = torch.empty(allocator_kernels.GIVE_BACK_SORT_MAX, dtype=torch.int64, device=self._device)
        return self._sort_scratch

    def give_back_pages(self, pages: torch.Tensor, books: Books) -> None:
        """Append ``pages`` (int64 page ids, -1 for none: a free group's pending list) to the release
        list (need_sort) or the free list: one launch of the bookkeeping kernel on kernels (which
        records the pages lent first), else ``give_back``; nothing read back."""
        if not allocator_kernels.on_kernels(self._device):
            self.give_back(pages, pages >= 0, books)
            return
        self._give_back_on_kernel(pages, books, 1, None, append=True)

    def _make_room(self, books: Books) -> None:
        """Before an append to the free queue: move it to a fresh buffer if the end could run past its
        buffer (the pages lent are recorded first, since their places are not copied)."""
        if self.queue.needs_room():
            self.mark_lent(books)
            self.queue.compact()

    def _give_back_on_kernel(
        self,
        entries: torch.Tensor,
        books: Books,
        page_size: int,
        group: Optional[list[torch.Tensor]],
        **kernel_args: object,
    ) -> None:
        """One launch of the give-back kernel whose released pages go to ``group`` (in place, page or
        -1 per entry), else the release list (need_sort, counted), else the free list's end. The
        pages lent since the last launch are recorded held in it first (by ``mark_lent`` before it
        when there are more than ``MARK_MAX``)."""
        owners, live, page_free, unrecorded = books
        queue = self.queue
        to_queue = group is None and not self.need_sort
        if to_queue and queue.needs_room():
            self._make_room(books)
        start, count = queue.unmarked()
        if count > MARK_MAX:
            self.mark_lent(books)
            start, count = queue.unmarked()
        kernel_args["mark"] = (queue.buffer, start, count, unrecorded) if count else None
        # Where the kernel writes the counters back to, and the launch's name there (not for an eager
        # list, which reads them at once).
        mirror = None if self.eager else (self._mirror.tagged, self._mirror.next_seq())
        kernel_args["mirror"] = mirror
        if not to_queue:
            dest = torch.empty_like(entries)
            to = allocator_kernels.TO_NONE if group is not None else allocator_kernels.TO_RELEASE
            launched = allocator_kernels.give_back(
                entries, owners, live, page_free, dest, self.counters, 1, page_size, allocator_kernels.LIST, to,
                **kernel_args,  # type: ignore[arg-type]
            )  # fmt: skip
            if group is not None:
                group.append(dest)
            else:
                self._release.append(dest)
                self._release_exact = False
        else:
            launched = allocator_kernels.give_back(
                entries, owners, live, page_free, queue.buffer, self.counters, queue.capacity, page_size,
                allocator_kernels.RING, allocator_kernels.TO_TAIL, lent=queue.lent, **kernel_args,  # type: ignore[arg-type]
            )  # fmt: skip
            queue.appended_on_device()
        queue.marked()
        self._mirrored = launched and mirror is not None  # no launch (nothing to take back): no words come

    def merge(self) -> None:
        """Move the release list into the free list, sorted (reads the counts first)."""
        self.read()
        if self.release_known:
            self.queue.reset(self._merged())
        self._clear_release()

    def _merged(self) -> torch.Tensor:
        """The free and release lists together, sorted (a new tensor); the counts must be exact."""
        raw = self.release_raw()
        both = torch.sort(torch.cat((self.queue.contents(), raw))).values
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
        self.queue.reset(pages)
        self._mirror.drop()

    def restore(self, state: AllocatorState) -> None:
        """Put back the lists of a snapshot (``AllocatorState``); reads nothing back."""
        self._mirrored = False
        self._mirror.drop()
        self.queue.restore(state.free_ring, state.free_count, state.free_known)
        self._release = [state.release_raw] if state.release_raw.numel() else []
        self.release_count.copy_(state.release_count)
        self.release_known, self._release_exact = state.release_known, False

    def _clear_release(self) -> None:
        self._mirrored = False
        self._release = []
        self.release_count.zero_()
        self.release_known, self._release_exact = 0, True
        self._mirror.drop()
