"""``BaseTokenToKVPoolAllocator``, the page allocator every slot allocator is, and
``TokenToKVPoolAllocator``, that with pages of one slot.

How the bookkeeping works is in :mod:`kvpool.pools.allocator`; what is checked when, in
:mod:`kvpool.pools.allocator.checks`; the rules users rely on in docs/contract.md, "Allocators and
the request table".
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from kvpool.checks import non_negative_int, positive_int, resolve_device
from kvpool.config import validate_enabled
from kvpool.errors import IntegrityError
from kvpool.kernels.allocator import launcher as allocator_kernels
from kvpool.pools.allocator import checks
from kvpool.pools.allocator.checks import Indices
from kvpool.pools.allocator.freelist import Books, FreeLists, Take
from kvpool.pools.allocator.ownership import add_holders, drop_holders
from kvpool.pools.allocator.state import AllocatorErrors, AllocatorState, integrity_problems


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
    free_pages, release_pages : Tensor [F], [R] int64 page ids (slot ids when ``page_size`` is 1);
        reading them reads the device's counts (a synchronisation on a GPU after a ``free``).
    free_group : list of int64 tensors of pages freed inside the open free group (reads the device).
    is_not_in_free_group : bool.
    rejected_frees : int, entries dropped by ``free`` without ``validate``, as far as counted on the
        host (``errors()`` waits for every queued free).
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
        # Counts a free leaves on the device (pages released, entries dropped) are read at once on a
        # CPU allocator and under validate, where reading costs nothing or is paid for anyway;
        # elsewhere they are copied back behind the queued work, or read when something waits anyway.
        eager = self.device.type == "cpu" or self.validate
        # One slot per page without validate: alloc lends a view of the free list and its slots are
        # recorded held by the next launch that happens anyway (see kvpool.pools.allocator).
        lends = self.page_size == 1 and not self.validate
        self._lists = FreeLists(self.num_pages, self.device, self.need_sort, eager, type(self).__name__, lends)
        # Whether a free of int64 device slots may take the kept launch (compiled kernels on a GPU).
        self._direct_frees = lends and not eager and allocator_kernels.on_kernels(self.device)
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
        """Tensor [F] int64: the pages ready to be handed out, oldest free first (a new tensor; reads
        the counts, a synchronisation on a GPU after a ``free``). Assigning a 1-D integer tensor
        replaces the list (no check: ``check_integrity()`` reports an inconsistent one)."""
        self._lists.read()
        return self._lists.queue.contents().clone()

    @free_pages.setter
    def free_pages(self, pages: torch.Tensor) -> None:
        self._lists.mark_lent(self._books())
        self._lists.set_free(checks.page_list(pages, "free_pages").to(device=self.device, dtype=torch.int64))

    @property
    def release_pages(self) -> torch.Tensor:
        """Tensor [R] int64: the pages freed under ``need_sort``, in free order, waiting to be merged
        (a new tensor; reads the device). Assigning a 1-D integer tensor replaces them."""
        raw = self._lists.release_raw()
        return raw[raw >= 0]

    @release_pages.setter
    def release_pages(self, pages: torch.Tensor) -> None:
        self._lists.set_release(checks.page_list(pages, "release_pages").to(device=self.device, dtype=torch.int64))

    @property
    def free_group(self) -> list[torch.Tensor]:
        """int64 tensors of the pages freed inside the open free group, one per ``free`` that
        released some (reads the device)."""
        pages = (t[t >= 0] for t in self._group)
        return [t for t in pages if t.numel()]

    @free_group.setter
    def free_group(self, groups: list[torch.Tensor]) -> None:
        """Replace the pending pages (SGLang subclasses' ``clear()`` assigns ``[]``)."""
        if not isinstance(groups, (list, tuple)):
            raise ValueError(f"free_group must be a list of page tensors, got {type(groups).__name__}")
        self._group = [checks.page_list(t, "free_group").to(device=self.device, dtype=torch.int64) for t in groups]

    @property
    def rejected_frees(self) -> int:
        """Entries ``free`` dropped without ``validate``, as far as counted (``errors()`` waits for
        every queued free to be counted)."""
        self._lists.poll()
        return self._lists.rejected_seen

    def errors(self) -> AllocatorErrors:
        """The bad calls survived so far, every queued call counted (waits for the device)."""
        self._lists.mark_lent(self._books())
        self._lists.read()
        return AllocatorErrors(rejected_frees=self._lists.rejected_seen, unrecorded=int(self._unrecorded))

    def available_size(self) -> int:
        """Slots that ``alloc`` can hand out now (pages pending in a free group excluded), known on the
        host: it never waits. Exact on a CPU allocator and under ``validate``; on a GPU, pages released
        by frees the device has not run yet count once their counts have been copied back (the count
        is never more than what is free)."""
        return self._lists.available() * self.page_size

    def debug_print(self) -> str:
        """One line on the free lists and holdings, for logs (reads the device)."""
        lists = self._lists
        lists.mark_lent(self._books())
        lists.read()
        held = int((self._live[1:] > 0).sum())
        pending = sum(t.numel() for t in self.free_group)
        return (
            f"{type(self).__name__}: {self.available_size()} slots available ({len(lists.queue)} free "
            f"+ {lists.release_known} released pages), {held} pages held, {pending} pages pending in a "
            f"free group, {lists.rejected_seen} frees rejected"
        )

    def clear(self) -> None:
        """Every page free, nothing held, no free group open."""
        self._reset()

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """Hand out ``need_size`` slots (whole pages), or return None and change nothing.

        Returns
        -------
        Tensor [need_size] int64 on ``device``, or None when fewer are free. With one slot per page
        and without ``validate`` it is a view of the free list's buffer (as in SGLang), made without
        a launch; the allocator never writes where it points, and writing into it changes nothing
        the allocator keeps. Otherwise a new tensor.

        Raises
        ------
        ValueError
            If ``need_size`` is not a non-negative multiple of ``page_size``.
        """
        queue = self._lists.queue
        if type(need_size) is int and 0 <= need_size <= len(queue) and queue.lends and self.page_size == 1:
            return self._lists.lend(need_size)  # the scheduler's common call: a view, no launch
        n = non_negative_int(need_size, "need_size")
        p = self.page_size
        if n % p:
            raise ValueError(f"need_size must be a multiple of page_size = {p}, got {n}")
        take = self._plan_take(n // p)
        if take is None:
            return None
        if take.merged is None and self._lists.queue.lends:
            return self._lists.lend(take.count)  # no launch: recorded held by the next one
        if allocator_kernels.on_kernels(self.device):
            return self._hand_out_on_kernel(take, n, allocator_kernels.PLAIN, None)
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

    def free(self, free_index: Indices, *, skip_padding: bool = False) -> None:
        """Give slots back. A page returns to the free list once all its handed-out slots are freed.

        Inside a free group the slots stop being held at once, but their pages become available only
        at ``free_group_end()``.

        Parameters
        ----------
        free_index : Tensor [N] integer, on ``device`` or the CPU, or a sequence of ints.
        skip_padding : entries <= 0 are padding, skipped without an error or a count (a caller whose
            index tensor holds them where it has no slot, as a full-to-SWA mapping does, frees it
            without picking them out, which would wait for the device).

        Raises
        ------
        ValueError
            If ``free_index`` is malformed; under ``validate`` also for a slot that is not held
            (double free, never allocated, slot 0, reserved page, out of range) or is listed twice.
            Nothing is freed. Without ``validate`` such entries are dropped and counted in
            ``rejected_frees`` (on a GPU once the device has run the free: ``errors()`` waits for it).

        Without ``validate`` a device tensor is freed without waiting for the device: the pages that
        come back join the free list there, and the host counts them once their count is read.
        """
        if self._direct_frees and not skip_padding and self.is_not_in_free_group:
            if self._lists.take_back_directly(free_index, self._books()):
                return  # a free of int64 device slots, through its kept launch
        slots = checks.free_index_slots(free_index, self.device)
        if slots.numel() == 0:
            return
        if self.validate:
            slots = checks.held_once(slots[slots > 0] if skip_padding else slots, self._owners, self._ever, self.page_size)
            if slots.numel() == 0:
                return
        if allocator_kernels.on_kernels(self.device):
            group = None if self.is_not_in_free_group else self._group
            self._lists.take_back(slots, self._books(), self.page_size, group, skip_padding)
            self._lists.changed()
            return
        self._lists.mark_lent(self._books())  # a slot lent and not recorded yet is held
        pages, released, dropped = drop_holders(
            self._owners, self._live, self._page_free, slots, self.page_size, skip_padding
        )  # fmt: skip
        self._lists.add_rejected(dropped)
        if self.is_not_in_free_group:
            self._lists.give_back(pages, released, self._books())
        else:
            self._group.append(torch.where(released, pages, -1))
        self._lists.changed()

    def frees_through_mapping(self, n: int) -> bool:
        """Whether ``free_through_mapping`` takes ``n`` slots: on the kernel path, without
        ``validate``, at most ``GIVE_BACK_SORT_MAX`` of them."""
        return allocator_kernels.on_kernels(self.device) and not self.validate and n <= allocator_kernels.GIVE_BACK_SORT_MAX

    def free_through_mapping(self, full_slots: torch.Tensor, mapping: torch.Tensor) -> None:
        """The SWA part's free of a sliding-window allocator in one launch: give back the slots
        ``mapping[full_slots]`` as ``free(..., skip_padding=True)`` does (entries outside the
        mapping, or mapped to 0, skipped) and set those mapping entries to 0, every entry translated
        before any is cleared. ``full_slots``: int64 on the device, ``frees_through_mapping`` of its
        length true; ``mapping``: int64 ``[rows + 1]`` on the device, its last entry -1. Unchecked."""
        group = None if self.is_not_in_free_group else self._group
        self._lists.take_back(full_slots, self._books(), self.page_size, group, True, mapping=mapping)
        self._lists.changed()

    def free_group_begin(self) -> None:
        """Start batching frees: pages freed from now on become available at ``free_group_end()``.
        Calling it again inside a group keeps the group (and its pending frees) open."""
        self.is_not_in_free_group = False

    def free_group_end(self) -> None:
        """Make the pages freed since ``free_group_begin()`` available, in one append."""
        self.is_not_in_free_group = True
        pending, self._group = self._group, []
        if pending:
            self._lists.give_back_pages(pending[0] if len(pending) == 1 else torch.cat(pending), self._books())
            self._lists.changed()

    def backup_state(self) -> AllocatorState:
        """Snapshot of the free lists and holdings, for ``restore_state`` (speculative allocation).
        Copies the bookkeeping on the device (the slots lent by ``alloc`` recorded held first); reads
        nothing back."""
        self._lists.mark_lent(self._books())
        queue = self._lists.queue
        return AllocatorState(
            page_size=self.page_size,
            num_pages=self.num_pages,
            free_ring=queue.rotated(),
            free_count=queue.count(),
            free_known=len(queue),
            release_raw=self._lists.release_raw().clone(),
            release_count=self._lists.release_count.clone(),
            release_known=self._lists.release_known,
            group_raw=tuple(self._group),
            owners=self._owners.clone(),
            live=self._live.clone(),
            page_free=self._page_free.clone(),
            unrecorded=self._unrecorded.clone(),
        )

    def restore_state(self, state: AllocatorState) -> None:
        """Return to a snapshot from ``backup_state()`` of this allocator; reads nothing back.

        Slots handed out or freed since the snapshot are undone. Pages the snapshot holds pending in a
        free group stay pending if a group is open now and become available if not, so none is lost.
        Rejected frees stay counted.

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
        self._lists.restore(state)
        self._owners = state.owners.clone()
        self._live = state.live.clone()
        self._page_free = state.page_free.clone()
        self._unrecorded = state.unrecorded.clone()
        self._group = []
        if state.group_raw:
            pending = torch.cat(state.group_raw)
            if self.is_not_in_free_group:
                self._lists.give_back_pages(pending, self._books())
            else:
                self._group.append(pending)
        self._lists.changed()

    def merge_and_sort_free(self) -> None:
        """Move the pages freed under ``need_sort`` into the free list, sorted (low pages first).
        Waits for the device if a free's count is not read yet."""
        self._lists.mark_lent(self._books())
        self._lists.merge()

    def check_integrity(self) -> None:
        """Check the bookkeeping against itself (reads it to the host; for tests and debugging).

        Catches, among others, a page listed free twice or while it holds slots, a leaked page, and a
        slot owned more than once. Counts the frees rejected so far (``rejected_frees``).

        Raises
        ------
        IntegrityError
            Listing every inconsistency found, with counts.
        """
        self._lists.read()
        problems = integrity_problems(self.backup_state())
        if problems:
            raise IntegrityError(f"{type(self).__name__} integrity check failed: " + "; ".join(problems))

    # --- internals -------------------------------------------------------------------------------

    def _reset(self) -> None:
        dev = self.device
        n_slots = (self.num_pages + 1) * self.page_size
        self._lists.reset()
        self.is_not_in_free_group = True
        self._group: list[torch.Tensor] = []  # pages freed inside the open group (-1: no page)
        self._owners = torch.zeros(n_slots, dtype=torch.int32, device=dev)
        self._live = torch.zeros(self.num_pages + 1, dtype=torch.int32, device=dev)
        self._page_free = torch.ones(self.num_pages + 1, dtype=torch.bool, device=dev)
        self._page_free[0] = False  # page 0 is never free: it is never handed out
        self._unrecorded = torch.zeros((), dtype=torch.int64, device=dev)
        # Slots ever handed out, kept only to tell "double free" from "never allocated" in errors.
        self._ever = torch.zeros(n_slots, dtype=torch.bool, device=dev) if self.validate else None

    def _plan_take(self, count: int) -> Optional[Take]:
        """The first ``count`` free pages, or None if too few; see ``FreeLists.plan``."""
        return self._lists.plan(count)

    def _hand_out_on_kernel(
        self, take: Take, n: int, kind: int, lens: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """Commit an allocation of ``n`` slots in one launch of the bookkeeping kernel (``kind`` and
        ``lens`` as for ``kvpool.kernels.allocator.hand_out``): the slots it returns are computed,
        held and their pages taken off the free lists, as ``_hand_out`` does."""
        self._lists.mark_lent(self._books())
        out = torch.empty(n, dtype=torch.int64, device=self.device)
        allocator_kernels.hand_out(
            out, take.source, take.start, take.cap, take.count, lens, self._owners, self._live, self._page_free,
            self._ever, self._unrecorded, self.page_size, kind,
        )  # fmt: skip
        self._lists.commit(take)
        return out

    def _hand_out(self, take: Take, slots: torch.Tensor, inside_range: bool) -> None:
        """Commit an allocation: ``take``'s pages leave the free lists and ``slots`` gain a holder
        (``ownership.add_holders``: slots not known to be ``inside_range`` are masked)."""
        self._lists.mark_lent(self._books())
        add_holders(self._books(), self._ever, take.pages, slots, self.page_size, inside_range)
        self._lists.commit(take)

    def _books(self) -> Books:
        """The bookkeeping a launch updates: ``(owners, live, page_free, unrecorded)``."""
        return self._owners, self._live, self._page_free, self._unrecorded


class CopiesThroughKVCache:
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


class TokenToKVPoolAllocator(CopiesThroughKVCache, BaseTokenToKVPoolAllocator):
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
