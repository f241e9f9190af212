"""``BaseTokenToKVPoolAllocator``, the page allocator every slot allocator is, and
``TokenToKVPoolAllocator``, that with pages of one slot.

How the bookkeeping works is in :mod:`kvpool.pools.allocator`; what is checked when, in
:mod:`kvpool.pools.allocator.checks`; the rules users rely on in docs/contract.md, "Allocators and
the request table".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from kvpool.checks import non_negative_int, positive_int, resolve_device
from kvpool.config import validate_enabled
from kvpool.errors import IntegrityError
from kvpool.pools.allocator import checks
from kvpool.pools.allocator.checks import Indices
from kvpool.pools.allocator.freelist import PageRing
from kvpool.pools.allocator.state import AllocatorState, integrity_problems

logger = logging.getLogger("kvpool")


@dataclass(frozen=True)
class _Take:
    """Pages an allocation will take: the front of the free list, or of ``merged`` (the free and
    release lists merged and sorted, which becomes the free list) when the free list is too short."""

    pages: torch.Tensor
    merged: Optional[torch.Tensor]


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
        checks.fits_kvcache(size, page_size, kvcache)
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
        """``size`` under SGLang's name for the full-attention slots (every slot here is one)."""
        return self.size

    def get_kvcache(self) -> Any:
        """The pool this allocator hands out slots of, ``kvcache`` as given (None if none was)."""
        return self._kvcache

    @property
    def free_pages(self) -> torch.Tensor:
        """Tensor [F] int64: the pages ready to be handed out, oldest free first (a view of the free
        list's buffer, valid until the next call that changes the allocator). Assigning a 1-D integer
        tensor replaces the list (no check: ``check_integrity()`` reports an inconsistent one)."""
        return self._free.contents()

    @free_pages.setter
    def free_pages(self, pages: torch.Tensor) -> None:
        self._free.reset(pages.to(device=self.device, dtype=torch.int64))

    @property
    def release_pages(self) -> torch.Tensor:
        """Tensor [R] int64: the pages freed under ``need_sort``, in free order, waiting to be merged
        (a new tensor). Assigning a 1-D integer tensor replaces them."""
        if not self._release:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return self._release[0] if len(self._release) == 1 else torch.cat(self._release)

    @release_pages.setter
    def release_pages(self, pages: torch.Tensor) -> None:
        pages = pages.to(device=self.device, dtype=torch.int64)
        self._release, self._release_count = ([pages] if pages.numel() else []), pages.numel()

    def available_size(self) -> int:
        """Slots that ``alloc`` can hand out now (pages pending in a free group excluded); known on the
        host, reads nothing from the device."""
        return (len(self._free) + self._release_count) * self.page_size

    def debug_print(self) -> str:
        """One line on the free lists and holdings, for logs (reads the device once)."""
        held = int((self._live[1:] > 0).sum())
        pending = sum(t.numel() for t in self.free_group)
        return (
            f"{type(self).__name__}: {self.available_size()} slots available ({len(self._free)} free "
            f"+ {self._release_count} released pages), {held} pages held, {pending} pages pending in a "
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
        """Raises ``NotImplementedError``: ``PagedTokenToKVPoolAllocator`` has SGLang's prefill
        allocation; this allocator hands out slots with ``alloc(n)``."""
        raise NotImplementedError(
            f"alloc_extend is for PagedTokenToKVPoolAllocator; {type(self).__name__} hands out slots with alloc(n)"
        )

    def alloc_decode(self, *args: Any, **kwargs: Any) -> Optional[torch.Tensor]:
        """Raises ``NotImplementedError``: ``PagedTokenToKVPoolAllocator`` has SGLang's decode
        allocation; this allocator hands out slots with ``alloc(n)``."""
        raise NotImplementedError(
            f"alloc_decode is for PagedTokenToKVPoolAllocator; {type(self).__name__} hands out slots with alloc(n)"
        )

    def get_cpu_copy(self, *args: Any, **kwargs: Any) -> Any:
        """Raises ``NotImplementedError``: ``TokenToKVPoolAllocator`` and ``PagedTokenToKVPoolAllocator``
        delegate it to their kvcache."""
        raise NotImplementedError(
            f"{type(self).__name__} does not implement get_cpu_copy; TokenToKVPoolAllocator and "
            "PagedTokenToKVPoolAllocator delegate it to their kvcache"
        )

    def load_cpu_copy(self, *args: Any, **kwargs: Any) -> Any:
        """Raises ``NotImplementedError``: ``TokenToKVPoolAllocator`` and ``PagedTokenToKVPoolAllocator``
        delegate it to their kvcache."""
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
        if self.validate:
            slots = self._validated(slots)
        emptied, dropped = self._take_back(slots)
        if dropped:
            self._count_rejected(dropped)
        if emptied.numel() == 0:
            return
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
            free_pages=self._free.copy(),
            release_pages=self.release_pages.clone(),
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
        self._free.reset(state.free_pages)
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
        if self._release_count:
            self._free.reset(self._merged())
            self._release, self._release_count = [], 0

    def check_integrity(self) -> None:
        """Check the bookkeeping against itself (reads it to the host; for tests and debugging).

        Catches, among others, a page listed free twice or while it holds slots, a leaked page, and a
        slot owned more than once.

        Raises
        ------
        IntegrityError
            Listing every inconsistency found, with counts.
        """
        problems = integrity_problems(self.backup_state())
        if problems:
            raise IntegrityError(f"{type(self).__name__} integrity check failed: " + "; ".join(problems))

    # --- internals -------------------------------------------------------------------------------

    def _reset(self) -> None:
        dev = self.device
        n_slots = (self.num_pages + 1) * self.page_size
        self._free = PageRing(torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=dev), self.num_pages)
        # Pages freed under need_sort, in chunks as freed (appending is O(pages freed)); merged into
        # the free list, sorted, when an allocation needs them.
        self._release: list[torch.Tensor] = []
        self._release_count = 0
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
        """The first ``count`` free pages, or None if too few (decided from host counts). Changes
        nothing; costs O(count) unless the release list must be merged in."""
        if count <= len(self._free):
            return _Take(self._free.front(count), None)
        if count > len(self._free) + self._release_count:
            return None
        merged = self._merged()
        return _Take(merged[:count], merged)

    def _merged(self) -> torch.Tensor:
        """The free and release lists together, sorted (a new tensor)."""
        return torch.sort(torch.cat((self._free.contents(), *self._release))).values

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
        self._page_free[take.pages] = False
        if take.merged is None:
            self._free.drop_front(take.pages.numel())
        else:
            self._free.reset(take.merged[take.pages.numel() :])
            self._release, self._release_count = [], 0
        self._owners.index_add_(0, at, add)
        self._live.index_add_(0, at // self.page_size, add)
        if not inside_range:
            self._unrecorded += add.numel() - add.sum()
        if self._ever is not None:
            self._ever[at] = True

    def _give_back(self, pages: torch.Tensor) -> None:
        """Append pages to the release list (need_sort) or the free list: O(len(pages))."""
        if self.need_sort:
            self._release.append(pages)
            self._release_count += pages.numel()
        else:
            self._free.extend(pages)

    def _validated(self, slots: torch.Tensor) -> torch.Tensor:
        """Under validate: raise ``ValueError`` for a slot that is not held or is listed twice (reading
        the device), else return the slots."""
        p = self.page_size
        n_slots = self._owners.numel()
        ok = (slots >= p) & (slots < n_slots) & (self._owners[slots.clamp(0, n_slots - 1)] > 0)
        if not bool(ok.all()):
            i = int((~ok).nonzero()[0])
            s = int(slots[i])
            ever = self._ever
            freed_before = bool(ever[s]) if ever is not None and 0 <= s < n_slots else None
            raise checks.bad_free(s, i, p, n_slots, freed_before)
        dup = checks.listed_twice(slots)
        if dup is not None:
            raise ValueError(f"free_index must list each slot once, got slot {dup} more than once (a double free)")
        return slots

    def _take_back(self, slots: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Drop one holder of each held slot in ``slots`` and mark the pages left without holders
        free; returns those pages (ascending, for a free list) and how many entries were not held
        slots (dropped). Costs O(len(slots)) on the device, whatever the pool's size, and reads two
        counts to the host (the one synchronisation).

        An entry counts only if it is a slot in the handed-out range, held, and its first occurrence
        in ``slots``; the rest change nothing, so no page is listed free twice.
        """
        p = self.page_size
        n_slots = self._owners.numel()
        s = torch.sort(slots).values
        at = torch.where((s >= p) & (s < n_slots), s, 0)  # entries outside the range count at slot 0
        first = torch.ones_like(s, dtype=torch.bool)
        first[1:] = s[1:] != s[:-1]
        ok = first & (at > 0) & (self._owners[at] > 0)
        minus = -ok.to(torch.int32)
        self._owners.index_add_(0, at, minus)
        page = at // p  # non-decreasing except at slot-0 entries, whose page is never released
        self._live.index_add_(0, page, minus)
        # One entry per run of a page (its first), and only for a run that freed something.
        start = torch.ones_like(first)
        start[1:] = page[1:] != page[:-1]
        run = torch.cumsum(start, 0) - 1
        freed = torch.zeros_like(minus).index_add_(0, run, ok.to(torch.int32))
        emptied = start & (freed[run] > 0) & (self._live[page] == 0) & ~self._page_free[page]
        self._page_free[torch.where(emptied, page, 0)] = emptied  # page 0 only ever gets False
        n_emptied, n_ok = torch.stack((emptied.sum(), ok.sum())).tolist()
        out = torch.empty(n_emptied + 1, dtype=torch.int64, device=s.device)  # the last entry is a sink
        out[torch.where(emptied, torch.cumsum(emptied, 0) - 1, n_emptied)] = page
        return out[:n_emptied], s.numel() - n_ok

    def _count_rejected(self, dropped: int) -> None:
        if self.rejected_frees == 0:
            logger.warning(
                "kvpool: %s.free dropped %d entries that were not handed-out slots (double free, "
                "slot 0 or never allocated); construct with validate=True to raise instead",
                type(self).__name__, dropped,
            )  # fmt: skip
        self.rejected_frees += dropped


class _CopiesThroughKVCache:
    """``get_cpu_copy``/``load_cpu_copy`` of the token and paged allocators: their kvcache's, as in
    SGLang (the base allocator leaves them to subclasses, as SGLang's does)."""

    _kvcache: Any

    def get_cpu_copy(self, indices: torch.Tensor, mamba_indices: Optional[torch.Tensor] = None) -> Any:
        """``kvcache.get_cpu_copy(indices)``: the K/V rows of ``indices`` of every layer, in host memory."""
        return self._kvcache_method("get_cpu_copy", mamba_indices)(indices)

    def load_cpu_copy(
        self, kv_cache_cpu: Any, indices: torch.Tensor, mamba_indices: Optional[torch.Tensor] = None
    ) -> Any:
        """``kvcache.load_cpu_copy(kv_cache_cpu, indices)``: rows from ``get_cpu_copy`` back into ``indices``."""
        return self._kvcache_method("load_cpu_copy", mamba_indices)(kv_cache_cpu, indices)

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


class TokenToKVPoolAllocator(_CopiesThroughKVCache, BaseTokenToKVPoolAllocator):
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
