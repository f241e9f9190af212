"""``SWARadixCache``: the prefix cache for models with sliding-window attention layers (SGLang's
names, ``sglang.srt.mem_cache.swa_radix_cache``).

Its allocator is an ``SWATokenToKVPoolAllocator``: every device slot of the tree is a full slot,
and a node's SWA KV is the SWA slots its full slots map to. A node holds its SWA KV (an
``SWAWindow`` record) or is a tombstone: SWA eviction freed it and kept the full KV, since a longer
prefix through the node needs only its full-attention KV. No leaf is a tombstone.

- ``match_prefix`` may pass tombstones but ends where the last ``sliding_window_size`` tokens have
  SWA KV (``kvpool.cache.swa_plan.window_end``), or on a path without tombstones.
- ``insert`` revives a tombstone whose tokens the caller has SWA KV for, and caches tokens whose SWA
  KV the caller freed (``swa_evicted_seqlen``) as a tombstone (``kvpool.cache.swa_plan``).
- ``evict(EvictParams(num_tokens, swa_num_tokens))``: full KV from leaves (both parts), then SWA KV
  from any unlocked node, least recently used first (nearer the root first on ties): an inner node
  becomes a tombstone, a leaf goes. Tombstones that become leaves go too.
- ``inc_lock_ref(node)`` locks the full KV of the node's path and the SWA KV of its last
  ``sliding_window_size`` tokens, and returns ``swa_uuid_for_lock`` for ``dec_lock_ref``.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Union

import torch

from kvpool.cache import integrity, requests, swa_integrity
from kvpool.cache.key import common_prefix, encoded
from kvpool.cache.node import TreeNode
from kvpool.cache.params import (
    CacheInitParams,
    EvictParams,
    EvictResult,
    evict_counts,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
    resolve_init_params,
)
from kvpool.cache.records import SWA
from kvpool.cache.swa_plan import Segment, SWAInsertPlan, not_taken, plan_insert, window_end
from kvpool.cache.swa_windows import SWAWindows
from kvpool.cache.tree import Undo
from kvpool.cache.tree_cache import InsertJob, TreeCache
from kvpool.checks import non_negative_int
from kvpool.errors import IntegrityError
from kvpool.pools.allocator.swa import SWATokenToKVPoolAllocator


class SWARadixCache(TreeCache):
    """A prefix cache over an ``SWATokenToKVPoolAllocator``, with tombstones for nodes whose SWA KV
    was freed.

    Parameters
    ----------
    params : CacheInitParams (or its fields by keyword): ``token_to_kv_pool_allocator`` an
        ``SWATokenToKVPoolAllocator`` (None for a simulated cache), ``sliding_window_size`` the
        window in tokens (a positive int), ``page_size`` the allocator's.
    validate : as for ``RadixCache``.

    Raises
    ------
    ValueError
        As ``RadixCache``; for another allocator, or a ``sliding_window_size`` that is not a
        positive int.

    Examples
    --------
    >>> cache = SWARadixCache.create_simulated(sliding_window_size=2)
    >>> cache.insert(InsertParams(key=RadixKey([1, 2, 3]), value=torch.tensor([5, 6, 7]), prev_prefix_len=0)).prefix_len
    0
    >>> cache.evict(EvictParams(swa_num_tokens=1)).swa_num_tokens_evicted
    3
    """

    def __init__(self, params: Optional[CacheInitParams] = None, *, validate: bool = False, **legacy_fields: Any) -> None:
        p = resolve_init_params(params, (), legacy_fields)
        alloc = p.token_to_kv_pool_allocator
        if alloc is not None and not isinstance(alloc, SWATokenToKVPoolAllocator):
            raise ValueError(f"token_to_kv_pool_allocator must be an SWATokenToKVPoolAllocator (or None), got {type(alloc).__name__}")
        window = p.sliding_window_size
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"sliding_window_size must be a positive int (the window in tokens), got {window!r}")
        self.sliding_window_size = window
        self._split_tails: list[TreeNode] = []
        super().__init__(p, validate=validate)
        self.windows = SWAWindows(self.eviction_strategy)

    # --- SGLang's API ---------------------------------------------------------------------------

    def supports_swa(self) -> bool:
        """True: the tree keeps sliding-window KV apart from full KV."""
        return True

    def reset(self) -> None:
        """Forget every node (their slots are not freed: clear the allocator too)."""
        super().reset()
        self.windows = SWAWindows(self.eviction_strategy)
        self._split_tails = []

    def match_prefix(self, params: Union[MatchPrefixParams, Any], **kwargs: Any) -> MatchResult:
        """The longest cached whole-page prefix whose last ``sliding_window_size`` tokens have SWA KV
        (or with no tombstone on its path), and the node it ends on.

        A match that ends inside a node splits it there; every node on the walked path counts a hit
        and becomes the most recently used (the nearer the root, the earlier it is evicted).

        Returns
        -------
        MatchResult: ``device_indices`` Tensor [M] int64 (full slots), ``last_device_node`` =
        ``last_host_node`` (the root for none).

        Raises
        ------
        TypeError, ValueError
            For a bad key. Nothing changes.
        """
        walked = self._match_key(params)
        if walked is None:
            return self._empty_match()
        path, _ = walked
        self._push_walked(path)
        pieces, pos = [], 0
        for node in path:
            pieces.append((pos, pos + len(node.device.value), SWA in node.records))
            pos += len(node.device.value)
        end = window_end(pieces, self.sliding_window_size)
        kept = [node for node, piece in zip(path, pieces) if piece[1] <= end]
        last = kept[-1] if kept else self.root_node
        indices = torch.cat([n.device.value for n in kept]) if kept else self._empty_match().device_indices
        return MatchResult(indices, last, last)

    def insert(self, params: InsertParams, *legacy_args: Any) -> InsertResult:
        """Cache ``params.key``'s whole pages with their full slots ``params.value``.

        ``prev_prefix_len`` (p): the first p slots are the tree's own (the caller's match); the
        insert then gives back the caller's slots of the other tokens the tree held (SGLang's
        form) and revives tombstones after p whose tokens the caller has SWA KV for (the tree's
        old full slots go back instead). None: as ``RadixCache``, the caller keeps the slots of the
        ``prefix_len`` tokens and nothing is revived. ``swa_evicted_seqlen`` (e, whole pages): the
        caller's slots before e have no SWA KV; new pages before e are cached as a tombstone, and
        if no new page is at or after e none is cached (the caller keeps them).

        Returns
        -------
        InsertResult: ``prefix_len``, the tokens the tree held already.

        Raises
        ------
        TypeError, ValueError
            As ``RadixCache.insert`` (``InsertParams`` only); for an ``swa_evicted_seqlen`` that is
            not a non-negative multiple of ``page_size``; when slots are checked (the CPU, or
            ``validate``), for a slot the tree would take as live without SWA KV or as a tombstone
            with it. Nothing changes; if the allocator's ``free`` raises, nothing changes either.
        """
        if not isinstance(params, InsertParams) or legacy_args:
            raise TypeError(f"params must be an InsertParams, got {type(params).__name__}")
        e = self._evicted_len(params.swa_evicted_seqlen, "insert: swa_evicted_seqlen")
        job = self._prepare_insert(params)
        if job is None:
            return InsertResult(prefix_len=0)
        plan = self._plan(job, job.prev, e, "insert: value")
        dups = [] if job.prev is None else not_taken(job.value, job.prev, plan.cached, plan.taken)
        self._free_slots(dups + plan.tree_old)
        self._carry_out(job, plan)
        return InsertResult(prefix_len=plan.cached)

    def evict(self, params: Union[EvictParams, int]) -> EvictResult:
        """Free at least ``params.num_tokens`` full tokens (unlocked leaves with both parts, and the
        tombstones they leave as leaves), then SWA tokens until at least ``params.swa_num_tokens``
        are freed counting those (unlocked nodes least recently used first: an inner node becomes a
        tombstone, a leaf goes), as far as there are. SWA slots of the new tombstones go back in one
        ``free_swa``, the nodes that left in one ``free``.

        Returns
        -------
        EvictResult with ``num_tokens_evicted`` (full) and ``swa_num_tokens_evicted``.

        Raises
        ------
        ValueError
            For counts that are not non-negative ints, a non-zero ``mamba_num``, or a disabled cache:
            nothing changes. If ``free_swa`` raises, nothing changes; if ``free`` raises after it,
            the nodes that left are put back and the new tombstones stay (their SWA slots are free).
        """
        num, swa_num = evict_counts(params, "SWARadixCache", "it holds no states", "swa_num_tokens", self.disable)
        gone, tombs = Undo(), Undo()
        full_parts: list[torch.Tensor] = []
        swa_parts: list[torch.Tensor] = []
        full = swa = 0
        while full < num:
            node = self._pop_evictable()
            if node is None:
                break
            f, s = self._remove_with_tombstones(node, full_parts, gone)
            full, swa = full + f, swa + s
        locked_leaves = []
        while swa < swa_num:
            node = self.windows.queue.pop()
            if node is None:
                break
            if not self.windows.evictable(node):
                continue
            if node.children:
                swa_parts.append(node.device.value)
                swa += len(node.device.value)
                self.windows.drop(node, tombs)
            elif node.device.lock_ref:
                locked_leaves.append(node)  # a leaf locked in full keeps its window: it cannot be a tombstone
            else:
                f, s = self._remove_with_tombstones(node, full_parts, gone)
                full, swa = full + f, swa + s
        self.windows.push(locked_leaves)
        alloc = self.token_to_kv_pool_allocator
        if alloc is not None:
            try:
                if swa_parts:
                    alloc.free_swa(torch.cat(swa_parts))
            except BaseException:
                gone.run()
                tombs.run()
                raise
            try:
                if full_parts:
                    alloc.free(torch.cat(full_parts))
            except BaseException:
                gone.run()  # the nodes go back; the tombstones' SWA slots are free, so they stay tombstones
                raise
        return EvictResult(num_tokens_evicted=full, swa_num_tokens_evicted=swa)

    def inc_lock_ref(self, node: TreeNode) -> Optional[int]:
        """Lock the full KV of ``node``'s path and the SWA KV of its last ``sliding_window_size``
        tokens (from ``node`` towards the root).

        Returns
        -------
        ``swa_uuid_for_lock``: the id of the node where the window ended, to give to ``dec_lock_ref``
        (None when the path is shorter than the window, the root, or a disabled cache).

        Raises
        ------
        TypeError, ValueError
            If ``node`` is not a node of this tree, or a tombstone lies within the window (a match
            never ends there). Nothing changes.
        """
        if self.disable:
            return None
        path = self._path(node, "inc_lock_ref")
        window, whole = self.windows.window_of(path, node, self.sliding_window_size, "inc_lock_ref")
        super().inc_lock_ref(node)
        return self.windows.lock(window, whole)

    def dec_lock_ref(self, node: TreeNode, swa_uuid_for_lock: Optional[int] = None) -> None:
        """Undo one ``inc_lock_ref(node)`` that returned ``swa_uuid_for_lock``: the full KV of the
        path, and the SWA KV up to the node of that id (to the root for None).

        Raises
        ------
        TypeError, ValueError
            If ``node`` is not a node of this tree or not locked, no node on its path has that id, or
            a node within the window is not locked there. Nothing changes.
        """
        if self.disable:
            return
        window = self._unlock_span(node, swa_uuid_for_lock, "dec_lock_ref")
        super().dec_lock_ref(node)
        self.windows.unlock(window)

    def total_size(self) -> tuple[int, int]:
        """(full tokens, SWA tokens) in the tree (SGLang's pair)."""
        return self.evictable_size_ + self.protected_size_, self.windows.evictable_size + self.windows.protected_size

    def full_evictable_size(self) -> int:
        """Full tokens in nodes no lock holds."""
        return self.evictable_size_

    def full_protected_size(self) -> int:
        """Full tokens in locked nodes."""
        return self.protected_size_

    def swa_evictable_size(self) -> int:
        """SWA tokens (of live nodes) no window lock holds: what ``swa_num_tokens`` may free."""
        return self.windows.evictable_size

    def swa_protected_size(self) -> int:
        """SWA tokens held by a lock's window."""
        return self.windows.protected_size

    def available_and_evictable_str(self) -> str:
        """Two log lines: per part, the allocator's free slots plus the tree's evictable tokens."""
        alloc = self.token_to_kv_pool_allocator
        lines = []
        for part, free, evictable in (
            ("full", alloc.full_available_size(), self.full_evictable_size()),
            ("swa", alloc.swa_available_size(), self.swa_evictable_size()),
        ):
            lines.append(f"Available {part} tokens: {free + evictable} ({part}_available_size={free} + {part}_evictable_size={evictable})\n")
        return "".join(lines)

    def pretty_print(self) -> None:
        """Print the tree, a node per line: id, tokens, first token ids, full and SWA locks, tombstone."""
        stack = [(self.root_node, 0)]
        while stack:
            node, depth = stack.pop()
            print(
                " " * depth, node.id, len(node.key), list(node.key.token_ids[:10]), f"fr={node.lock_ref}",
                f"sr={node.swa_lock_ref}", f"ts={node is not self.root_node and SWA not in node.records}",
            )  # fmt: skip
            stack.extend((c, depth + 2) for c in node.children.values())
        full, swa = self.total_size()
        print(f"#full_tokens: {full}, #swa_tokens: {swa}")

    def cache_finished_req(self, req: Any, is_insert: bool = True, **kwargs: Any) -> None:
        """As ``RadixCache.cache_finished_req``, with the SWA rules of ``insert`` (its
        ``prev_prefix_len`` the request's ``cache_protected_len``, its ``swa_evicted_seqlen`` the
        request's, 0 if absent) and the request's ``swa_uuid_for_lock`` for the unlock. Everything
        is checked first; the one ``free`` (the request's slots the tree does not take, and the
        tree's slots of the tombstones it revives) comes before the tree changes."""
        plan = requests.plan_finished(self, req, is_insert)
        uuid = getattr(req, "swa_uuid_for_lock", None)
        kv, protected = plan.kv, plan.protected
        job, splan = None, None
        if plan.last_node is not None:
            self._unlock_span(plan.last_node, uuid, "cache_finished_req: req.last_node")
            e = self._evicted_len(getattr(req, "swa_evicted_seqlen", 0) or 0, "cache_finished_req: req.swa_evicted_seqlen")
            if plan.insert is not None:
                plan.insert.prev_prefix_len = protected
                job = self._prepare_insert(plan.insert, "cache_finished_req")
                if job is not None:
                    splan = self._plan(job, protected, e, "cache_finished_req: the request's slots")
            if self._checks_slots():
                self._check_request_slots(kv, protected, plan.last_node, "cache_finished_req")
        taken = [] if splan is None else splan.taken
        self._free_slots(not_taken(kv, protected, len(kv), taken) + ([] if splan is None else splan.tree_old))
        if splan is not None:
            self._carry_out(job, splan)
        if plan.last_node is not None:
            self.dec_lock_ref(plan.last_node, uuid)

    def cache_unfinished_req(self, req: Any, chunked: bool = False, **kwargs: Any) -> None:
        """As ``RadixCache.cache_unfinished_req``, with the SWA rules of ``insert``: the insertion is
        cut where the match that follows it will end, so the request reads back from the tree every
        page the tree takes, and keeps its own slots after it. ``req.swa_uuid_for_lock`` is
        unlocked and set to the new lock's. Checked first; the one ``free`` comes before the tree
        changes."""
        plan = requests.plan_unfinished(self, req, chunked)
        if plan is None:
            row = req.req_pool_idx
            req.prefix_indices = self.req_to_token_pool.req_to_token[row, : len(req.fill_ids)].to(torch.int64, copy=True)
            return
        uuid = getattr(req, "swa_uuid_for_lock", None)
        what = "cache_unfinished_req"
        self._unlock_span(plan.last_node, uuid, f"{what}: req.last_node")
        e = self._evicted_len(getattr(req, "swa_evicted_seqlen", 0) or 0, f"{what}: req.swa_evicted_seqlen")
        kv, protected = plan.kv, plan.protected
        plan.insert.prev_prefix_len = protected
        job = self._prepare_insert(plan.insert, what)
        if self._checks_slots():
            self._check_request_slots(kv, protected, plan.last_node, what)
        if job is None:  # no whole page yet
            req.prefix_indices = kv.to(torch.int64, copy=True)
            return
        whole = self._plan(job, protected, e, f"{what}: the request's slots")
        cut = window_end(whole.pieces, self.sliding_window_size)
        splan = whole if cut >= whole.n else self._plan(job, protected, e, f"{what}: the request's slots", n=cut)
        reach = window_end(splan.pieces, self.sliding_window_size)
        if reach < protected:
            raise IntegrityError(
                f"{what}: the tree would return {reach} tokens for the request's {protected} protected ones (its window "
                "is not held: was req.last_node locked by inc_lock_ref?)"
            )
        self._free_slots(not_taken(kv, protected, reach, splan.taken) + splan.tree_old)
        self._carry_out(job, splan)
        match = self.match_prefix(MatchPrefixParams(key=plan.insert.key))
        indices, last = match.device_indices, match.last_device_node
        if len(indices) != reach:
            raise IntegrityError(f"{what}: the tree returned {len(indices)} slots where its plan said {reach}")
        self.req_to_token_pool.write((plan.row, slice(protected, reach)), indices[protected:].to(kv.dtype))
        new_uuid = self.inc_lock_ref(last)
        self.dec_lock_ref(plan.last_node, uuid)
        req.prefix_indices = torch.cat((indices, kv[reach:].to(indices.dtype))) if reach < len(kv) else indices
        req.cache_protected_len = reach
        req.last_node = last
        req.swa_uuid_for_lock = new_uuid

    def check_integrity(self, requests: Iterable[Any] = ()) -> None:
        """``RadixCache.check_integrity``, and the SWA part: no tombstone leaf, each window lock
        within its node's full lock, the SWA sizes, every evictable window queued; every live node's
        slots mapped to SWA slots and no tombstone's; each part's free + evictable + protected + held
        by the running requests equal to its size; each running request's last window with SWA KV.

        Raises
        ------
        IntegrityError
            Listing every inconsistency found.
        """
        reqs = list(requests)
        problems, slots = self.tree_problems()
        problems += self._tier_problems()
        problems += swa_integrity.swa_problems(self, reqs)
        integrity.check_integrity(self, reqs, problems, slots, {})

    # --- internals ------------------------------------------------------------------------------

    def _evicted_len(self, value: Any, name: str) -> int:
        e = non_negative_int(value, name)
        if e % self.page_size:
            raise ValueError(f"{name} must be a multiple of page_size = {self.page_size}, got {e}")
        return e

    def _owners(self) -> Optional[torch.Tensor]:
        """The full part's holders per slot (the slots calls are given are full slots)."""
        alloc = self.token_to_kv_pool_allocator
        if alloc is None:
            return None
        return alloc.full_attn_allocator.backup_state().owners.cpu().to(torch.int64)

    def _touched(self, node: TreeNode) -> None:
        """The lower part of a split takes its SWA queue entry after the walked path's (see
        ``_push_walked``): on the tie the upper part is older, as if it were still one node."""
        super()._touched(node)
        self._split_tails.append(node)

    def _push_walked(self, path: list[TreeNode]) -> None:
        """The walked ``path`` (root first) and then the lower parts of the nodes the walk split
        take their new priorities in the SWA queue."""
        tails, self._split_tails = self._split_tails, []
        self.windows.push(path)
        self.windows.push(tails)

    def _remove_with_tombstones(self, node: TreeNode, full_parts: list, undo: Undo) -> tuple[int, int]:
        """Evict leaf ``node`` and the tombstones above it that become unlocked leaves; their full
        slots go into ``full_parts``. Returns the (full, SWA) tokens freed."""
        full = swa = 0
        while True:
            size = len(node.device.value)
            full_parts.append(node.device.value)
            full += size
            if SWA in node.records:
                swa += size
                self.windows.drop(node, undo)
            parent = node.parent
            self._remove_leaf(node, undo)
            if parent is self.root_node or SWA in parent.records or parent.children or parent.device.lock_ref:
                return full, swa
            node = parent

    def _unlock_span(self, node: Any, uuid: Optional[int], what: str) -> list[TreeNode]:
        """The window ``dec_lock_ref(node, uuid)`` releases, with the full path checked to be locked;
        changes nothing."""
        path = self._path(node, what)
        self._check_locked(path, what)
        return self.windows.unlock_span(path, node, uuid, what)

    def _segments(self, enc: bytes, n: int, extra: Any) -> list[Segment]:
        """The existing nodes along ``enc[:n]``, changing nothing."""
        child_key, eb = self._child_key, self.elem_bytes
        node, pos, out = self.root_node, 0, []
        while pos < n:
            child = node.children.get(child_key(enc, pos, extra))
            if child is None:
                break
            kb = encoded(child.key)
            whole = pos + len(kb) <= n and enc.startswith(kb, pos)
            m = len(kb) if whole else common_prefix(enc, pos, kb, min(len(kb), n - pos), self.page_bytes)
            out.append(Segment(pos // eb, (pos + m) // eb, child))
            pos += m
            if not whole:
                break
            node = child
        return out

    def _plan(self, job: InsertJob, p: Optional[int], e: int, what: str, n: Optional[int] = None) -> SWAInsertPlan:
        """``plan_insert`` for a checked insertion (of its first ``n`` elements), and the caller's
        slots it takes checked against the SWA part (see ``_checks_slots``)."""
        full = job.n // self.elem_bytes
        n = full if n is None else n
        plan = plan_insert(self._segments(job.enc, job.n, job.extra), n, full if p is None else p, e)
        alloc = self.token_to_kv_pool_allocator
        if alloc is not None and self._checks_slots() and plan.taken:
            mapping = alloc.full_to_swa_index_mapping.cpu()
            for start, end, live in plan.taken:
                slots = job.value[start:end].cpu().to(torch.int64)
                bad = ((mapping[slots] <= 0) if live else (mapping[slots] != 0)).nonzero().flatten()
                if bad.numel():
                    i = int(bad[0])
                    need = f"SWA KV from swa_evicted_seqlen = {e} on" if live else f"no SWA KV before swa_evicted_seqlen = {e}"
                    raise ValueError(
                        f"{what} must have {need}, got slot {int(slots[i])} at position {start + i}, mapped to SWA slot "
                        f"{int(mapping[slots[i]])}"
                    )
        return plan

    def _carry_out(self, job: InsertJob, plan: SWAInsertPlan) -> None:
        """Change the tree as ``plan`` says (nothing here can fail once the plan is checked)."""
        eb = self.elem_bytes
        cached, last = self._insert(job.enc, plan.n * eb, job.value, job.priority, job.extra)
        if cached // eb < plan.n:  # ``last`` is the new leaf: its first part may be a tombstone
            tomb = [end - start for start, end, live in plan.taken if not live and start == cached // eb]
            if tomb:
                self._split(last, tomb[0] * eb)
            self.windows.add(last)
        path = []
        node = last
        while node is not self.root_node:
            path.append(node)
            node = node.parent
        path.reverse()
        starts, pos = {}, 0
        for node in path:
            starts[pos] = node
            pos += len(node.device.value)
        for _, start, split, end in plan.revive:
            node = starts[start]
            if split:
                self._split(node, split * eb)
            node.device.value = job.value[start + split : end].to(torch.int64, copy=True)
            self.windows.add(node)
        path = []
        node = last
        while node is not self.root_node:
            path.append(node)
            node = node.parent
        self._push_walked(path[::-1])

    def _tier_problems(self) -> list[str]:
        return self.windows.problems(n for n in self._nodes() if n is not self.root_node)
