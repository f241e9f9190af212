"""Slot allocators a scheduler uses to hand out rows of an ``MHATokenToKVPool``.

``BaseTokenToKVPoolAllocator`` hands out whole pages of ``page_size`` slots and takes slots back.
``TokenToKVPoolAllocator`` is that with pages of one slot; ``PagedTokenToKVPoolAllocator`` adds
``alloc_extend``/``alloc_decode``, which continue each request's last partial page. Page 0 (slot 0,
the padding slot, among its slots) is never handed out. ``alloc_extend_naive`` is ``alloc_extend``'s
slot computation on its own, under SGLang's name for it.

Bookkeeping, in tensors on ``device`` as in SGLang:

- ``free_pages``: page ids ready to be handed out. ``release_pages``: pages freed under
  ``need_sort``, merged into ``free_pages`` and sorted when an allocation needs them.
  ``free_group``: pages freed inside a free group, made available by ``free_group_end()``.
- ``owners[slot]``: how many holders the slot has (handed out, not freed). It is a count, not a
  flag, so that a slot handed out while held, which only a wrong ``last_loc`` without ``validate`` can
  cause, shows in ``check_integrity()`` for as long as both holders keep it, and stays held until both
  have freed it. A flag would be overwritten by the second hand-out and hide it.
- ``live[page]``: the sum of its slots' owner counts. A page goes back to the free list only when
  this reaches 0, so freeing part of a page never hands a held slot to another request.
- ``page_free[page]``: the page is in ``free_pages``, ``release_pages`` or ``free_group``. A page
  joins a list only when this flag goes from False to True, so no list holds a page twice, whatever
  the caller frees.

The last three are private; ``backup_state()`` returns copies of them.

Every operation computes its result and runs its checks before it changes anything, so an error
leaves the allocator exactly as it was. What is checked, and when, is in
``kvpool.pools.allocator_checks``: host arguments always; device arguments against each other
(lengths against their CPU copies, ``last_loc`` in range at the right page offset) always on a CPU
allocator and under ``validate`` elsewhere; arguments against the bookkeeping under ``validate``
(``KVPOOL_VALIDATE=1`` turns it on too), at the cost of reading the device in each call. Without those
checks on a GPU, a continuation slot outside the allocator's range is handed out but not recorded
(never an out-of-bounds index into the bookkeeping) and ``check_integrity()`` reports it; a bad free
is dropped and counted in ``rejected_frees``. The allocator does not know which request holds a
page, so a ``last_loc`` naming another request's last slot passes even ``validate``; the two
requests collide, and ``validate`` raises, when the other one continues.

``alloc``, ``alloc_extend`` and ``alloc_decode`` read nothing back from the device (their sizes
come from the CPU lengths) unless ``validate``. ``free`` synchronises once: how many pages come back
is data dependent (SGLang's paged ``free`` synchronises in ``torch.unique`` too).

Where kvpool deliberately differs from SGLang's allocators
-----------------------------------------------------------
1. Partial frees: a page returns to the free list once every slot handed out from it is freed;
   SGLang returns a page when any of its slots is freed, which hands a still-held slot to another
   request.
2. Bad frees (double free, slot 0, a slot never handed out, one listed twice) raise ``ValueError``
   under ``validate`` and are otherwise dropped and counted (``rejected_frees``), never added to a
   free list; SGLang appends whatever it is given.
3. Errors are ``ValueError`` (``IndexError`` for a ``last_loc`` outside the slot range), raised
   before anything changes, where SGLang asserts under ``SGLANG_DEBUG_MEMORY_POOL`` or not at all;
   ``alloc(n)`` on the paged allocator raises when ``n`` is not a multiple of ``page_size``. kvpool
   does not read ``SGLANG_DEBUG_MEMORY_POOL``; ``validate`` (or ``KVPOOL_VALIDATE=1``) is its
   counterpart.
4. ``validate`` also checks ``last_loc`` against the bookkeeping and the requests of one batch against
   each other; on a CPU allocator, device lengths and ``last_loc``'s range and page offset are
   always checked (so a ``last_loc`` in page 0 raises there, where SGLang continues from it).
5. Free order: both allocators append freed pages to ``free_pages`` (oldest free first); SGLang's
   paged allocator puts them in front. With ``need_sort`` the release list is merged only when an
   allocation needs it; SGLang's paged ``alloc_extend`` merges by an estimate.
6. Free groups: ``free()`` inside a group drops ownership at once (so a double free in a group is
   caught) and ``free_group`` holds the pages that became free, made available at
   ``free_group_end()``; SGLang's ``free_group`` holds the freed slot tensors and frees them at the
   end. ``free_group_begin()`` inside a group keeps the pending frees (SGLang's drops them).
7. ``backup_state()`` returns an ``AllocatorState`` (free lists, owner counts, pages pending in a
   free group) instead of a ``(free_pages, release_pages)`` tuple, and ``restore_state()`` puts all of
   it back, so slots freed or handed out in between are undone rather than leaked. Pending pages of
   the snapshot stay pending if a group is open at restore time and become available if not.
8. ``alloc`` returns a new tensor (SGLang's token allocator returns a view of its free list).
9. ``BaseTokenToKVPoolAllocator`` is the complete page allocator, and its constructor builds the
   state itself rather than relying on a subclass's ``clear()``; SGLang's is abstract.
10. ``get_cpu_copy``/``load_cpu_copy`` accept ``mamba_indices`` only as None: kvpool's pools hold no
    mamba state.
11. ``alloc_extend``/``alloc_decode`` are PyTorch ops on the device rather than Triton kernels; the
    slots they return are the same.
12. ``debug_print()`` returns a one-line summary; SGLang's base allocator returns ``""``.
13. ``alloc_extend_naive`` checks its arguments (``ValueError``) before writing; SGLang's checks nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from kvpool.checks import non_negative_int, positive_int, resolve_device
from kvpool.config import validate_enabled
from kvpool.pools import allocator_checks as checks
from kvpool.pools.allocator_checks import Indices, IntegrityError, ceil_div

__all__ = [
    "AllocatorState",
    "BaseTokenToKVPoolAllocator",
    "IntegrityError",
    "PagedTokenToKVPoolAllocator",
    "TokenToKVPoolAllocator",
    "alloc_extend_naive",
]

logger = logging.getLogger("kvpool")


@dataclass(frozen=True)
class AllocatorState:
    """A snapshot taken by ``backup_state()``; ``restore_state()`` puts it back (any number of times).

    The free lists are shared with the allocator (it never modifies them in place); the other tensors
    are copies.
    """

    page_size: int
    num_pages: int
    free_pages: torch.Tensor  # [F] int64 page ids
    release_pages: torch.Tensor  # [R] int64 page ids
    free_group: tuple[torch.Tensor, ...]  # int64 page ids freed inside an open free group
    owners: torch.Tensor  # [(num_pages + 1) * page_size] int32 holders per slot
    live: torch.Tensor  # [num_pages + 1] int32 holders per page
    page_free: torch.Tensor  # [num_pages + 1] bool
    unrecorded: torch.Tensor  # [] int64 slots handed out outside the range (see check_integrity)


@dataclass(frozen=True)
class _Take:
    """Pages an allocation will take, and the free lists once it has."""

    pages: torch.Tensor
    free_pages: torch.Tensor
    release_pages: torch.Tensor


class BaseTokenToKVPoolAllocator:
    """Hands out pages ``1..size // page_size`` of ``page_size`` KV-cache slots and takes slots back.

    The complete page allocator that ``TokenToKVPoolAllocator`` and ``PagedTokenToKVPoolAllocator``
    derive from; use those. Subclasses may override ``clear()``: the constructor builds the state
    without calling it.

    Parameters
    ----------
    size : slots to manage (the pool's ``size``).
    page_size : slots per page (the pool's ``page_size``).
    dtype : the pool's element type; kept for SGLang compatibility, not used.
    device : where the bookkeeping and the returned indices live (the pool's device, usually).
    kvcache : the pool these slots index (``get_kvcache()``; ``get_cpu_copy`` reads it).
    need_sort : keep freed pages aside and merge them, sorted, only when an allocation needs them
        (hands out low pages first, for locality).
    validate : check calls against the bookkeeping and raise ``ValueError`` on a bad free instead of
        dropping it, at the cost of reading the device (a synchronisation) in each call;
        ``KVPOOL_VALIDATE=1`` turns it on too.

    Attributes
    ----------
    free_pages, release_pages : Tensor [F], [R] int64 page ids (slot ids when ``page_size`` is 1).
    free_group : list of int64 tensors of pages freed inside the open free group.
    is_not_in_free_group : bool.
    rejected_frees : int, entries dropped by ``free`` without ``validate``.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: Optional[torch.dtype] = None,
        device: str | torch.device = "cpu",
        kvcache: Any = None,
        need_sort: bool = False,
        *,
        validate: bool = False,
    ) -> None:
        self.size = positive_int(size, "size")
        self.page_size = positive_int(page_size, "page_size")
        if size < page_size:
            raise ValueError(f"size must be at least page_size = {page_size} (one page), got {size}")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype must be a torch.dtype or None, got {dtype!r}")
        self.dtype = dtype
        self.device = resolve_device(device)
        self._kvcache = kvcache
        self.need_sort = bool(need_sort)
        self.validate = validate_enabled(validate)
        self.num_pages = size // page_size
        self.rejected_frees = 0
        # On a CPU allocator the device arguments are already on the host, so comparing them costs
        # nothing; elsewhere it costs a synchronisation and runs only under validate.
        self._cheap_device_checks = self.device.type == "cpu"
        self._slot_offsets = torch.arange(page_size, dtype=torch.int64, device=self.device)
        self._reset()

    # --- SGLang surface --------------------------------------------------------------------------

    @property
    def size_full(self) -> int:
        return self.size

    def get_kvcache(self) -> Any:
        return self._kvcache

    def available_size(self) -> int:
        """Slots that ``alloc`` can hand out now (pages pending in a free group excluded)."""
        return (self.free_pages.numel() + self.release_pages.numel()) * self.page_size

    def debug_print(self) -> str:
        """One line on the free lists and holdings, for logs (reads the device once)."""
        held = int((self._live[1:] > 0).sum())
        pending = sum(t.numel() for t in self.free_group)
        return (
            f"{type(self).__name__}: {self.available_size()} slots available ({self.free_pages.numel()} free "
            f"+ {self.release_pages.numel()} released pages), {held} pages held, {pending} pages pending in a "
            f"free group, {self.rejected_frees} frees rejected"
        )

    def clear(self) -> None:
        """Every page free, nothing held, no free group open."""
        self._reset()

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """Hand out ``need_size`` slots (whole pages), or return None and change nothing.

        Returns
        -------
        Tensor [need_size] int64 on ``device`` (a new tensor), or None when fewer are free.

        Raises
        ------
        ValueError
            If ``need_size`` is not a non-negative multiple of ``page_size``.
        """
        n = non_negative_int(need_size, "need_size")
        p = self.page_size
        if n % p:
            raise ValueError(f"need_size must be a multiple of page_size = {p}, got {n}")
        take = self._plan_take(n // p)
        if take is None:
            return None
        if p == 1:
            slots = take.pages.clone()  # callers may modify it; the free list must not follow
        else:
            slots = (take.pages[:, None] * p + self._slot_offsets).reshape(-1)
        self._hand_out(take, slots, inside_range=True)
        return slots

    def alloc_extend(self, *args: Any, **kwargs: Any) -> Optional[torch.Tensor]:
        raise NotImplementedError(
            f"alloc_extend is for PagedTokenToKVPoolAllocator; {type(self).__name__} hands out slots with alloc(n)"
        )

    def alloc_decode(self, *args: Any, **kwargs: Any) -> Optional[torch.Tensor]:
        raise NotImplementedError(
            f"alloc_decode is for PagedTokenToKVPoolAllocator; {type(self).__name__} hands out slots with alloc(n)"
        )

    def get_cpu_copy(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} does not implement get_cpu_copy; TokenToKVPoolAllocator and "
            "PagedTokenToKVPoolAllocator delegate it to their kvcache"
        )

    def load_cpu_copy(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} does not implement load_cpu_copy; TokenToKVPoolAllocator and "
            "PagedTokenToKVPoolAllocator delegate it to their kvcache"
        )

    def free(self, free_index: Indices) -> None:
        """Give slots back. A page returns to the free list once all its handed-out slots are freed.

        Inside a free group the slots stop being held at once, but their pages become available only
        at ``free_group_end()``.

        Parameters
        ----------
        free_index : Tensor [N] integer, on ``device`` or the CPU, or a sequence of ints.

        Raises
        ------
        ValueError
            If ``free_index`` is malformed; under ``validate`` also for a slot that is not held
            (double free, never allocated, slot 0, reserved page, out of range) or is listed twice.
            Nothing is freed. Without ``validate`` such entries are dropped and counted in
            ``rejected_frees``.
        """
        slots = checks.free_index_slots(free_index, self.device)
        if slots.numel() == 0:
            return
        slots = self._accept(slots)
        if slots.numel() == 0:
            return
        p = self.page_size
        minus = torch.full_like(slots, -1, dtype=torch.int32)
        self._owners.index_add_(0, slots, minus)
        pages = slots // p  # sorted, since _accept returns sorted slots
        self._live.index_add_(0, pages, minus)
        touched = pages if p == 1 else torch.unique_consecutive(pages)
        emptied = touched[(self._live[touched] == 0) & ~self._page_free[touched]]
        if emptied.numel() == 0:
            return
        self._page_free[emptied] = True
        if self.is_not_in_free_group:
            self._give_back(emptied)
        else:
            self.free_group.append(emptied)

    def free_group_begin(self) -> None:
        """Start batching frees: pages freed from now on become available at ``free_group_end()``.
        Calling it again inside a group keeps the group (and its pending frees) open."""
        self.is_not_in_free_group = False

    def free_group_end(self) -> None:
        """Make the pages freed since ``free_group_begin()`` available, in one concatenation."""
        self.is_not_in_free_group = True
        pending, self.free_group = self.free_group, []
        if pending:
            self._give_back(torch.cat(pending))

    def backup_state(self) -> AllocatorState:
        """Snapshot of the free lists and holdings, for ``restore_state`` (speculative allocation)."""
        return AllocatorState(
            page_size=self.page_size,
            num_pages=self.num_pages,
            free_pages=self.free_pages,
            release_pages=self.release_pages,
            free_group=tuple(self.free_group),
            owners=self._owners.clone(),
            live=self._live.clone(),
            page_free=self._page_free.clone(),
            unrecorded=self._unrecorded.clone(),
        )

    def restore_state(self, state: AllocatorState) -> None:
        """Return to a snapshot from ``backup_state()`` of this allocator.

        Slots handed out or freed since the snapshot are undone. Pages the snapshot holds pending in a
        free group stay pending if a group is open now and become available if not, so none is lost.

        Raises
        ------
        ValueError
            If ``state`` is not an ``AllocatorState`` of an allocator of this geometry and device.
        """
        if not isinstance(state, AllocatorState):
            raise ValueError(f"state must be an AllocatorState from backup_state(), got {type(state).__name__}")
        if (state.page_size, state.num_pages) != (self.page_size, self.num_pages):
            raise ValueError(
                f"state must come from an allocator with page_size={self.page_size}, num_pages={self.num_pages}, "
                f"got page_size={state.page_size}, num_pages={state.num_pages}"
            )
        if state.owners.device != self.device:
            raise ValueError(f"state must come from an allocator on {self.device}, got {state.owners.device}")
        self.free_pages = state.free_pages
        self.release_pages = state.release_pages
        self._owners = state.owners.clone()
        self._live = state.live.clone()
        self._page_free = state.page_free.clone()
        self._unrecorded = state.unrecorded.clone()
        self.free_group = []
        if state.free_group:
            pending = torch.cat(state.free_group)
            if self.is_not_in_free_group:
                self._give_back(pending)
            else:
                self.free_group.append(pending)

    def merge_and_sort_free(self) -> None:
        """Move the pages freed under ``need_sort`` into the free list, sorted (low pages first)."""
        if self.release_pages.numel():
            self.free_pages = torch.sort(torch.cat((self.free_pages, self.release_pages))).values
            self.release_pages = self.release_pages[:0]

    def check_integrity(self) -> None:
        """Check the bookkeeping against itself (reads it to the host; for tests and debugging).

        Catches, among others, a page listed free twice or while it holds slots, a leaked page, and a
        slot owned more than once.

        Raises
        ------
        IntegrityError
            Listing every inconsistency found, with counts.
        """
        problems = checks.integrity_problems(self.backup_state())
        if problems:
            raise IntegrityError(f"{type(self).__name__} integrity check failed: " + "; ".join(problems))

    # --- internals -------------------------------------------------------------------------------

    def _reset(self) -> None:
        dev = self.device
        n_slots = (self.num_pages + 1) * self.page_size
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=dev)
        self.release_pages = torch.empty(0, dtype=torch.int64, device=dev)
        self.is_not_in_free_group = True
        self.free_group: list[torch.Tensor] = []
        self._owners = torch.zeros(n_slots, dtype=torch.int32, device=dev)
        self._live = torch.zeros(self.num_pages + 1, dtype=torch.int32, device=dev)
        self._page_free = torch.ones(self.num_pages + 1, dtype=torch.bool, device=dev)
        self._page_free[0] = False  # page 0 is never free: it is never handed out
        self._unrecorded = torch.zeros((), dtype=torch.int64, device=dev)
        # Slots ever handed out, kept only to tell "double free" from "never allocated" in errors.
        self._ever = torch.zeros(n_slots, dtype=torch.bool, device=dev) if self.validate else None

    def _plan_take(self, count: int) -> Optional[_Take]:
        """The first ``count`` free pages and the free lists without them; None if too few. Changes nothing."""
        free, release = self.free_pages, self.release_pages
        if count > free.numel():
            if count > free.numel() + release.numel():
                return None
            free, release = torch.sort(torch.cat((free, release))).values, release[:0]
        return _Take(free[:count], free[count:], release)

    def _hand_out(self, take: _Take, slots: torch.Tensor, inside_range: bool) -> None:
        """Commit an allocation: ``take``'s pages leave the free lists and ``slots`` gain a holder.

        Slots not known to be ``inside_range`` (cut from free pages) are masked: one outside the
        handed-out range (from an unchecked ``last_loc``) is counted in ``unrecorded`` instead, so that
        no index leaves the bookkeeping tensors.
        """
        if inside_range:
            at, add = slots, torch.ones_like(slots, dtype=torch.int32)
        else:
            inside = (slots >= self.page_size) & (slots < self._owners.numel())
            at, add = torch.where(inside, slots, 0), inside.to(torch.int32)
        # Everything above only computed; from here on the state changes, with in-range indices.
        self.free_pages, self.release_pages = take.free_pages, take.release_pages
        self._page_free[take.pages] = False
        self._owners.index_add_(0, at, add)
        self._live.index_add_(0, at // self.page_size, add)
        if not inside_range:
            self._unrecorded += add.numel() - add.sum()
        if self._ever is not None:
            self._ever[at] = True

    def _give_back(self, pages: torch.Tensor) -> None:
        if self.need_sort:
            self.release_pages = torch.cat((self.release_pages, pages))
        else:
            self.free_pages = torch.cat((self.free_pages, pages))

    def _accept(self, slots: torch.Tensor) -> torch.Tensor:
        """The slots that may be freed, sorted and unique; raises (validate) or drops the rest."""
        p = self.page_size
        n_slots = self._owners.numel()
        ok = (slots >= p) & (slots < n_slots) & (self._owners[slots.clamp(0, n_slots - 1)] > 0)
        if self.validate:
            if not bool(ok.all()):
                i = int((~ok).nonzero()[0])
                s = int(slots[i])
                ever = self._ever
                freed_before = bool(ever[s]) if ever is not None and 0 <= s < n_slots else None
                raise checks.bad_free(s, i, p, n_slots, freed_before)
            dup = checks.listed_twice(slots)
            if dup is not None:
                raise ValueError(f"free_index must list each slot once, got slot {dup} more than once (a double free)")
            return torch.sort(slots).values
        accepted = torch.unique(slots[ok])
        dropped = slots.numel() - accepted.numel()
        if dropped:
            if self.rejected_frees == 0:
                logger.warning(
                    "kvpool: %s.free dropped %d entries that were not handed-out slots (double free, "
                    "slot 0 or never allocated); construct with validate=True to raise instead",
                    type(self).__name__, dropped,
                )  # fmt: skip
            self.rejected_frees += dropped
        return accepted

    def _kvcache_method(self, name: str, mamba_indices: Optional[torch.Tensor]) -> Callable[..., Any]:
        if mamba_indices is not None:
            raise ValueError(f"mamba_indices must be None (kvpool's pools hold no mamba state), got {mamba_indices!r}")
        method = getattr(self._kvcache, name, None)
        if method is None:
            raise ValueError(
                f"{name} copies rows of the pool this allocator indexes: construct "
                f"{type(self).__name__} with kvcache=<a pool with {name}>, got kvcache={self._kvcache!r}"
            )
        return method


class TokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):
    """Hands out single KV-cache slots ``1..size`` of a pool; slot 0 is the padding slot.

    Parameters
    ----------
    size : number of slots to manage (the pool's ``size``).
    dtype, device, kvcache, need_sort, validate : as for ``BaseTokenToKVPoolAllocator``.

    Examples
    --------
    >>> a = TokenToKVPoolAllocator(8)
    >>> a.alloc(3)
    tensor([1, 2, 3])
    >>> a.free(torch.tensor([2]))
    >>> a.available_size()
    6
    """

    def __init__(
        self,
        size: int,
        dtype: Optional[torch.dtype] = None,
        device: str | torch.device = "cpu",
        kvcache: Any = None,
        need_sort: bool = False,
        *,
        validate: bool = False,
    ) -> None:
        super().__init__(size, 1, dtype, device, kvcache, need_sort, validate=validate)

    def get_cpu_copy(self, indices: torch.Tensor, mamba_indices: Optional[torch.Tensor] = None) -> Any:
        """``kvcache.get_cpu_copy(indices)``: the K/V rows of ``indices`` of every layer, in host memory."""
        return self._kvcache_method("get_cpu_copy", mamba_indices)(indices)

    def load_cpu_copy(
        self, kv_cache_cpu: Any, indices: torch.Tensor, mamba_indices: Optional[torch.Tensor] = None
    ) -> Any:
        """``kvcache.load_cpu_copy(kv_cache_cpu, indices)``: rows from ``get_cpu_copy`` back into ``indices``."""
        return self._kvcache_method("load_cpu_copy", mamba_indices)(kv_cache_cpu, indices)


class PagedTokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):
    """Hands out KV-cache slots a page at a time: pages ``1..size // page_size`` of ``page_size``
    slots; page 0 (slots ``0..page_size-1``, the padding slot among them) is never handed out.

    A request's slots fill its pages in order, so ``alloc_extend``/``alloc_decode`` continue its last
    partial page before taking a fresh one. A page returns to the free list only once every slot
    handed out from it has been freed.

    Parameters
    ----------
    size : slots to manage (the pool's ``size``); ``size // page_size`` pages are handed out.
    page_size : slots per page (the pool's ``page_size``).
    dtype, device, kvcache, need_sort, validate : as for ``BaseTokenToKVPoolAllocator``.

    Examples
    --------
    >>> a = PagedTokenToKVPoolAllocator(64, page_size=4)
    >>> one = torch.tensor([1])
    >>> a.alloc_extend(0 * one, 0 * one, 3 * one, 3 * one, -one, 3)  # a 3-token prompt, on page 1
    tensor([4, 5, 6])
    >>> # that request grows from 3 to 5 tokens (its last slot is 6); a new one brings 2 tokens
    >>> a.alloc_extend(torch.tensor([3, 0]), torch.tensor([3, 0]), torch.tensor([5, 2]),
    ...                torch.tensor([5, 2]), torch.tensor([6, -1]), 4)
    tensor([ 7,  8, 12, 13])
    >>> a.alloc_decode(torch.tensor([6, 3]), torch.tensor([6, 3]), torch.tensor([8, 13]))
    tensor([ 9, 14])
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: Optional[torch.dtype] = None,
        device: str | torch.device = "cpu",
        kvcache: Any = None,
        need_sort: bool = False,
        *,
        validate: bool = False,
    ) -> None:
        super().__init__(size, page_size, dtype, device, kvcache, need_sort, validate=validate)

    def get_cpu_copy(self, indices: torch.Tensor, mamba_indices: Optional[torch.Tensor] = None) -> Any:
        """``kvcache.get_cpu_copy(indices)``: the K/V rows of ``indices`` of every layer, in host memory."""
        return self._kvcache_method("get_cpu_copy", mamba_indices)(indices)

    def load_cpu_copy(
        self, kv_cache_cpu: Any, indices: torch.Tensor, mamba_indices: Optional[torch.Tensor] = None
    ) -> Any:
        """``kvcache.load_cpu_copy(kv_cache_cpu, indices)``: rows from ``get_cpu_copy`` back into ``indices``."""
        return self._kvcache_method("load_cpu_copy", mamba_indices)(kv_cache_cpu, indices)

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
    ) -> Optional[torch.Tensor]:
        """Slots for extending each request from ``prefix_lens[i]`` to ``seq_lens[i]`` tokens.

        Request i's new tokens first fill its last partial page (slots ``last_loc[i] + 1``, ...),
        then whole fresh pages, then the first slots of one more fresh page. Fresh pages are taken
        from the free list in request order.

        Parameters
        ----------
        prefix_lens, seq_lens : Tensor [B], int, on ``device``: tokens already held / held after.
        prefix_lens_cpu, seq_lens_cpu : the same values on the CPU (they size the allocation
            without a device synchronisation).
        last_loc : Tensor [B], int, on ``device``: slot of each request's last held token (any value,
            conventionally -1, when ``prefix_lens[i]`` is a multiple of ``page_size``).
        extend_num_tokens : ``sum(seq_lens - prefix_lens)``.

        Returns
        -------
        Tensor [extend_num_tokens] int64 on ``device``, request after request; or None, changing
        nothing, when too few pages are free.

        Raises
        ------
        ValueError
            On inconsistent lengths (the device ones checked against the CPU ones on a CPU allocator
            or under ``validate``); when a continuing request's ``last_loc`` is at the wrong page
            offset (same condition); under ``validate`` also when a continuation does not start after
            a held slot of a held page, runs onto a held slot, or meets another request's. Nothing
            changes.
        IndexError
            When a continuing request's ``last_loc`` is outside the slot range (same condition as
            the offset).
        """
        bs = checks.lens_vector(prefix_lens_cpu, "prefix_lens_cpu")
        checks.lens_vector(seq_lens_cpu, "seq_lens_cpu", bs)
        for t, name in ((prefix_lens, "prefix_lens"), (seq_lens, "seq_lens"), (last_loc, "last_loc")):
            checks.device_vector(t, name, bs, self.device)
        pre_c = prefix_lens_cpu.to(torch.int64)
        seq_c = seq_lens_cpu.to(torch.int64)
        total = checks.extend_lengths(pre_c, seq_c, extend_num_tokens)
        pre = prefix_lens.to(torch.int64)
        seq = seq_lens.to(torch.int64)
        last = last_loc.to(torch.int64)
        self._check_batch("alloc_extend", pre, seq, last, pre_c, seq_c)

        p = self.page_size
        take = self._plan_take(int((ceil_div(seq_c, p) - ceil_div(pre_c, p)).sum()))
        if take is None:
            return None
        if total == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        out = _extend_slots(take.pages, pre, seq, last, total, p)
        self._hand_out(take, out, inside_range=False)
        return out

    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
    ) -> Optional[torch.Tensor]:
        """One slot per request for its next token: ``last_loc[i] + 1`` when that is on the same page,
        else the first slot of a fresh page (fresh pages are taken in request order).

        Parameters
        ----------
        seq_lens : Tensor [B], int, on ``device``: tokens each request holds after this step
            (so the new token is at position ``seq_lens[i] - 1``).
        seq_lens_cpu : the same values on the CPU.
        last_loc : Tensor [B], int, on ``device``: slot of each request's last held token.

        Returns
        -------
        Tensor [B] int64 on ``device``, or None, changing nothing, when too few pages are free.

        Raises
        ------
        ValueError, IndexError
            As ``alloc_extend``, with ``seq_lens - 1`` as the prefix lengths. Nothing changes.
        """
        bs = checks.lens_vector(seq_lens_cpu, "seq_lens_cpu")
        checks.device_vector(seq_lens, "seq_lens", bs, self.device)
        checks.device_vector(last_loc, "last_loc", bs, self.device)
        seq_c = seq_lens_cpu.to(torch.int64)
        checks.decode_lengths(seq_c)
        seq = seq_lens.to(torch.int64)
        last = last_loc.to(torch.int64)
        self._check_batch("alloc_decode", None, seq, last, None, seq_c)

        p = self.page_size
        take = self._plan_take(int(((seq_c - 1) % p == 0).sum()))
        if take is None:
            return None
        if bs == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        out = last + 1
        if take.pages.numel():
            starts = (seq - 1) % p == 0
            rank = (torch.cumsum(starts, 0) - 1).clamp(0, take.pages.numel() - 1)
            out = torch.where(starts, take.pages[rank] * p, out)
        self._hand_out(take, out, inside_range=False)
        return out

    def _check_batch(
        self,
        what: str,
        pre: Optional[torch.Tensor],
        seq: torch.Tensor,
        last: torch.Tensor,
        pre_c: Optional[torch.Tensor],
        seq_c: torch.Tensor,
    ) -> None:
        """Device arguments against each other (on a CPU allocator or under validate) and against the
        bookkeeping (under validate), reading the device once. ``pre``/``pre_c`` are None for decode,
        whose prefix lengths are ``seq_lens - 1``."""
        if not (self.validate or self._cheap_device_checks):
            return
        given_pre = pre is not None
        if pre is None or pre_c is None:
            pre, pre_c = seq - 1, seq_c - 1
        p = self.page_size
        bs = pre.numel()
        if self.validate:
            n_slots = self._owners.numel()
            at = (last[:, None] + self._slot_offsets).clamp(0, n_slots - 1)  # last_loc and the slots after it
            host = torch.cat(
                (pre, seq, last, self._owners[at].reshape(-1).to(torch.int64),
                 self._page_free[at[:, 0] // p].to(torch.int64))
            ).cpu()  # fmt: skip
            pre, seq, last, owners_at, page_free_at = host.split([bs, bs, bs, bs * p, bs])
        if given_pre:
            checks.same_as_cpu(pre, pre_c, "prefix_lens")
        checks.same_as_cpu(seq, seq_c, "seq_lens")
        checks.last_loc_arguments(what, last, pre, seq, p, self._owners.numel())
        if self.validate:
            checks.continuations_against_state(
                what, last, pre, seq, owners_at.view(bs, p), page_free_at.bool(), p
            )


def _extend_slots(
    pages: torch.Tensor, pre: torch.Tensor, seq: torch.Tensor, last: torch.Tensor, total: int, page_size: int
) -> torch.Tensor:
    """The ``total`` slots of an extension (``total >= 1``), fresh pages taken from ``pages`` in
    request order, on ``pre``'s device.

    Every index is clamped into its tensor, so device lengths that disagree with the CPU ones
    (unchecked on a GPU without validate) give wrong slots, never an error or an out-of-bounds
    read; the request of each output token comes from ``searchsorted`` rather than
    ``repeat_interleave``, which fails (a device assert on CUDA) when the lengths disagree.
    """
    p = page_size
    ext = seq - pre
    held = ceil_div(pre, p)  # pages each request holds already (the last one maybe partial)
    new_pages = ceil_div(seq, p) - held
    first_page = torch.cumsum(new_pages, 0) - new_pages  # index into `pages` per request
    ends = torch.cumsum(ext, 0)
    t = torch.arange(total, device=pre.device)
    req = torch.searchsorted(ends, t, right=True).clamp_(max=pre.numel() - 1)
    k = t - (ends - ext)[req]  # offset in the request's extension
    pos = pre[req] + k  # token position in its sequence
    out = last[req] + 1 + k
    if pages.numel():
        rank = (first_page[req] + pos // p - held[req]).clamp(0, pages.numel() - 1)
        out = torch.where(pos < held[req] * p, out, pages[rank] * p + pos % p)
    return out


def alloc_extend_naive(
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    free_pages: torch.Tensor,
    out_indices: torch.Tensor,
    page_size: int,
    device: str | torch.device,
) -> None:
    """SGLang's plain-PyTorch ``alloc_extend`` step, on its own: write into ``out_indices`` the slots
    that extend each request from ``prefix_lens[i]`` to ``seq_lens[i]`` tokens, taking fresh pages
    from the front of ``free_pages`` in request order.

    Request i's new tokens first fill its last partial page (slots ``last_loc[i] + 1``, ...), then
    whole fresh pages, then the first slots of one more fresh page, exactly as
    ``PagedTokenToKVPoolAllocator.alloc_extend`` hands them out. Nothing else changes: the caller
    removes the ``sum(ceil(seq_lens / page_size) - ceil(prefix_lens / page_size))`` pages it used from
    its free list. It reads the lengths to the host (one synchronisation on a GPU).

    Parameters
    ----------
    prefix_lens, seq_lens, last_loc : Tensor [B], integer, on ``device``.
    free_pages : Tensor [F], integer page ids, on ``device``.
    out_indices : Tensor [sum(seq_lens - prefix_lens)], integer, on ``device``; written in place.
    page_size : slots per page.
    device : where the tensors live.

    Raises
    ------
    ValueError
        Before writing anything, where SGLang's helper checks nothing: tensors that are not 1-D
        integer tensors on ``device``, lengths that differ, ``prefix_lens`` negative or above
        ``seq_lens``, ``out_indices`` of another length, or too few ``free_pages``.
    """
    p = positive_int(page_size, "page_size")
    dev = resolve_device(device)
    bs = prefix_lens.shape[0] if isinstance(prefix_lens, torch.Tensor) and prefix_lens.dim() == 1 else 0
    for t, name in ((prefix_lens, "prefix_lens"), (seq_lens, "seq_lens"), (last_loc, "last_loc")):
        checks.device_vector(t, name, bs, dev)
    for t, name in ((free_pages, "free_pages"), (out_indices, "out_indices")):
        n = t.shape[0] if isinstance(t, torch.Tensor) and t.dim() == 1 else 0  # any length
        checks.device_vector(t, name, n, dev)
    pre_c, seq_c = prefix_lens.to("cpu", torch.int64), seq_lens.to("cpu", torch.int64)
    bad = ((pre_c < 0) | (seq_c < pre_c)).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(
            f"prefix_lens[{i}] must be in 0..seq_lens[{i}] = {int(seq_c[i])}, got {int(pre_c[i])}"
        )
    total = int((seq_c - pre_c).sum())
    if out_indices.shape[0] != total:
        raise ValueError(f"out_indices must have sum(seq_lens - prefix_lens) = {total} entries, got {out_indices.shape[0]}")
    needed = int((ceil_div(seq_c, p) - ceil_div(pre_c, p)).sum())
    if needed > free_pages.shape[0]:
        raise ValueError(f"free_pages must hold the {needed} pages this extension takes, got {free_pages.shape[0]}")
    if total == 0:
        return
    pre, seq = prefix_lens.to(torch.int64), seq_lens.to(torch.int64)
    out = _extend_slots(free_pages[:needed].to(torch.int64), pre, seq, last_loc.to(torch.int64), total, p)
    out_indices.copy_(out)
