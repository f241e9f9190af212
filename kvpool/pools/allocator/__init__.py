"""Slot allocators a scheduler uses to hand out rows of an ``MHATokenToKVPool``.

``BaseTokenToKVPoolAllocator`` hands out whole pages of ``page_size`` slots and takes slots back.
``TokenToKVPoolAllocator`` is that with pages of one slot; ``PagedTokenToKVPoolAllocator`` adds
``alloc_extend``/``alloc_decode``, which continue each request's last partial page. Page 0 (slot 0,
the padding slot, among its slots) is never handed out. ``alloc_extend_naive`` is ``alloc_extend``'s
slot computation on its own, under SGLang's name for it. An allocator built with a ``kvcache`` (a
pool) must fit it: at most the pool's ``size``, in the pool's ``page_size``.

The modules: ``base.py`` (the page allocator and the token allocator), ``paged.py`` (the paged
allocator's ``alloc_extend``/``alloc_decode``), ``freelist.py`` (the free and release lists and the
host counts that never wait), ``count_mirror.py`` (the device counts as they come back to the host),
``free_queue.py`` (the free list's buffer), ``ownership.py`` (what a free does to the per-slot
bookkeeping), ``checks.py`` (what is checked), ``state.py`` (the snapshot and its integrity check).
docs/contract.md, "Allocators and the request table", has the rules users rely on.

Bookkeeping, in tensors on ``device`` as in SGLang:

- ``free_pages``: page ids ready to be handed out, in a buffer whose front the host keeps and whose
  end the device keeps, so that taking pages and giving them back cost the pages moved, never the
  pages listed. The paged allocators' is a ring of ``num_pages`` entries. A token allocator's (one
  slot per page, without ``validate``) is never written where it has handed slots out: ``alloc``
  returns a view of its front, launching nothing, and the list moves to a fresh buffer when its end
  would run past (one copy of the list per ``num_pages // 2`` slots handed out). The slots lent so
  are recorded held (``owners``, ``live``, ``page_free`` below) by the next launch that takes slots
  back, before it takes any, or by PyTorch operations before anything else reads or replaces the
  books (``backup_state``, ``check_integrity``, ``errors``, another kind of allocation, an
  assignment to ``free_pages``, a merge); the view handed out is a second copy of the list, so a
  caller writing into it changes nothing the allocator records. ``release_pages``: pages freed under ``need_sort``,
  kept in chunks as freed and merged into ``free_pages``, sorted, when an allocation needs them.
  ``free_group``: pages freed inside a free group, made available by ``free_group_end()``. Chunks
  freed on the device hold -1 where an entry released no page.
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
``kvpool.pools.allocator.checks``: host arguments always; device arguments against each other
(lengths against their CPU copies, ``last_loc`` in range at the right page offset) always on a CPU
allocator and under ``validate`` elsewhere; arguments against the bookkeeping under ``validate``
(``KVPOOL_VALIDATE=1`` turns it on too), at the cost of reading the device in each call. Without those
checks on a GPU, a continuation slot outside the allocator's range is handed out but not recorded
(never an out-of-bounds index into the bookkeeping) and ``check_integrity()`` reports it; a bad free
is dropped and counted in ``rejected_frees``. The allocator does not know which request holds a
page, so a ``last_loc`` naming another request's last slot passes even ``validate``; the two
requests collide, and ``validate`` raises, when the other one continues.

No call waits for the device without ``validate``, except an allocation the host counts fall short
of. ``alloc``, ``alloc_extend`` and ``alloc_decode`` are sized by host counts (the CPU lengths);
a token allocator's ``alloc`` also launches nothing.
``free`` decides on the device which entries count and which pages come back, appends those pages
at the ring's end there, and leaves the counts on the device: the host's free count is then a
lower bound (every page it counts is free), brought up to date from the counts the free's launch
writes to pinned host memory, each tagged with the launch's sequence number
(``count_mirror.CountMirror``), folded in once they have landed. An allocation
larger than the host count while a copy is outstanding reads the counts (one synchronisation) and
decides exactly. A CPU allocator, and any under ``validate``, reads the counts after every call, so
its counts are always exact. ``errors()`` and ``check_integrity()`` read everything.

Where kvpool deliberately differs from SGLang's allocators
-----------------------------------------------------------
1. Partial frees: a page returns to the free list once every slot handed out from it is freed;
   SGLang returns a page when any of its slots is freed, which hands a still-held slot to another
   request.
2. Bad frees (double free, slot 0, a slot never handed out, one listed twice) raise ``ValueError``
   under ``validate`` and are otherwise dropped on the device and counted (``rejected_frees``, and
   ``errors()``, which waits for every queued free), never added to a free list; SGLang appends
   whatever it is given. SGLang's token ``free`` concatenates the whole free list; kvpool's appends
   to a ring buffer, and its paged ``free`` does not synchronise where SGLang's (``torch.unique``)
   does.
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
   ``available_size()`` on a GPU may lag behind frees whose counts have not come back (it never
   counts more than is free); SGLang's counts every slot it was given at once.
8. The token allocator's ``alloc`` returns a view of its free list, as SGLang's does, but kvpool never
   writes where it points and records the slots from its own copy; under ``validate``, and on the
   paged allocator, ``alloc`` returns a new tensor.
9. ``BaseTokenToKVPoolAllocator`` is the complete page allocator, and its constructor builds the
   state itself rather than relying on a subclass's ``clear()``; SGLang's is abstract.
10. ``get_cpu_copy``/``load_cpu_copy`` accept ``mamba_indices`` only as None: kvpool's pools hold no
    mamba state.
11. On a GPU every ``alloc_extend``, ``alloc_decode`` and ``free`` is one launch of kvpool's own
    bookkeeping kernels (``kvpool.kernels.allocator``); the slots they return are SGLang's.
12. ``debug_print()`` returns a one-line summary; SGLang's base allocator returns ``""``.
13. ``alloc_extend_naive`` checks its arguments (``ValueError``) before writing; SGLang's checks nothing.
14. A ``kvcache`` with ``size`` and ``page_size`` (a kvpool pool) is checked at construction: an
    allocator larger than it, or of another page size, raises ``ValueError``; SGLang accepts it and
    hands out slots past the pool.
"""

from kvpool.pools.allocator.base import BaseTokenToKVPoolAllocator, TokenToKVPoolAllocator
from kvpool.pools.allocator.paged import PagedTokenToKVPoolAllocator, alloc_extend_naive
from kvpool.pools.allocator.state import AllocatorErrors, AllocatorState

__all__ = [
    "AllocatorErrors",
    "AllocatorState",
    "BaseTokenToKVPoolAllocator",
    "PagedTokenToKVPoolAllocator",
    "TokenToKVPoolAllocator",
    "alloc_extend_naive",
]
