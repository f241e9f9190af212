"""The storage tier's room of ``HiRadixCache``: host pages written through to a storage backend, and
prefetched back from it on a match (SGLang's HiCache storage; docs/contract.md, "With a storage
tier").

Write-through: once a node's host copy is complete (``backed_up``, then ``poll`` at every
``check_hicache_events``), its pages are copied out of the host pool (``get_data_page``, on the
caller's thread) and stored under their page keys (``kvpool.storage.keys.page_keys`` of the node's
whole prefix, kept on the node as a ``PageKeys`` record) by a worker thread.

Prefetch: ``prefetch_from_storage`` looks up the pages after a match's host part; a worker thread
reads the ones storage holds, in order, either straight into host pages the prefetch took when it
started (``kvpool.cache.storage_host_reads``: a backend that reads into given memory, this class's
``fetch``, and host room), or into pages of its own; it never calls the host pool, which is not
thread-safe. ``check_prefetch_progress`` decides by the policy when the request may go on
(``best_effort``: at once, with what has arrived; ``wait_complete``: once every page is read;
``timeout``: that, or once the time is up), then hangs the pages that arrived in the tree as
host-only nodes (``kvpool.cache.storage_take``: copied into new host pages first where they were
read into pages of their own), from where ``init_load_back`` brings them to the device like any
host hit.

Storage failures (a call that returns a miss or False, or raises) never change the tree, the host
pool or the device: a failed write leaves the page out of storage, a failed read ends the prefetch
with the pages read so far, and the tier backs off (no writes and no prefetches for a while,
doubling up to a bound) before trying again. A subclass stores more beside the pages through
``fetch`` and the hooks of ``_take`` (``kvpool.cache.himamba_storage``: a hybrid model's states).

A prefetch reads only what the tree lacks: the pages of ``new_input_tokens`` that the tree holds
already below ``last_host_node`` (on the device or the host) are skipped (``held_pages``). With
EAGLE's bigram keys (``is_eagle``) the tokens are turned into bigrams as the tree turns a key, so the
page keys are those of the pages the tree stores. The pages written and the pages found missing are
announced as KV events (``kvpool.cache.storage_events``). ``close`` ends the tier: the queued writes
are done, the workers joined, and storage work asked for afterwards is refused.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

import numpy as np
import torch

from kvpool.cache.key import RadixKey, encoded, to_bigram
from kvpool.cache.node import TreeNode
from kvpool.cache.records import HOST, STORAGE, PageKeys
from kvpool.cache.storage_events import StorageEvents, storage_medium
from kvpool.cache.storage_host_reads import HostReads
from kvpool.cache.storage_integrity import storage_problems
from kvpool.cache.storage_records import PrefetchOp, StorageTierStats
from kvpool.cache.storage_take import FetchedPages
from kvpool.cache.storage_policy import PREFETCH_POLICIES, StoragePolicy  # noqa: F401 (imported from here too)
from kvpool.cache.storage_workers import StorageWorkers
from kvpool.checks import non_negative_seconds
from kvpool.storage.base import HiCacheStorage
from kvpool.storage.keys import page_keys, token_array

class StorageTier(FetchedPages):
    """The storage room of one ``HiRadixCache`` (made by the cache; see the module).

    Parameters
    ----------
    cache : the ``HiRadixCache``.
    storage : a :class:`~kvpool.storage.base.HiCacheStorage`; its host pool is registered here.
    policy : a :class:`StoragePolicy`.
    owns_storage : ``close`` closes ``storage`` too (the cache made it from its server arguments).
    """

    def __init__(self, cache: Any, storage: HiCacheStorage, policy: StoragePolicy, owns_storage: bool = False) -> None:
        self.cache, self.storage, self.policy, self.owns_storage = cache, storage, policy, owns_storage
        self.host = cache.token_to_kv_pool_host
        storage.register_mem_pool_host(self.host)
        self.page_size = cache.page_size
        self.page_enc_bytes = cache.page_bytes  # one page of key elements, as the tree encodes them
        self.page_nbytes = sum(self.host.page_bytes)  # one stored page
        self.stats = StorageTierStats()
        self.ongoing_prefetch: dict[Any, PrefetchOp] = {}
        self.loaded_tokens: dict[Any, int] = {}
        self._lock = threading.Lock()
        self._pending: list[tuple[TreeNode, Any, Any, torch.Tensor]] = []  # (node, its host copy, the backup's event, slots)
        self._backoff = policy.backoff_s
        self._resume_at = 0.0
        #: Pages copied out of the host for storage that a worker has not written yet, and their bound
        #: (the host pool's size): beyond it writes are skipped, so a stalled store cannot fill memory.
        self.queued_pages = 0
        self.max_queued_pages = self.host.size // self.page_size
        #: Pages of the prefetches in flight (each may read them all into memory), and their bound.
        self.prefetch_pages = 0
        self.max_prefetch_pages = self.host.size // self.page_size
        self.events = StorageEvents(cache, storage_medium(storage))
        self.workers = StorageWorkers(policy.background)
        self.closed = False
        #: Prefetches read straight into host pages (``kvpool.cache.storage_host_reads``) where the
        #: backend and the host pool allow it and ``fetch`` is this class's; else into pages of their own.
        direct = type(self).fetch is StorageTier.fetch and storage.reads_into_regions is True
        direct = direct and hasattr(self.host, "sync_pages_for_write")
        self.host_reads: Optional[HostReads] = HostReads(self.host, storage, self._lock) if direct else None

    # --- write-through ---------------------------------------------------------------------------

    def backed_up(self, node: TreeNode, event: Any) -> None:
        """``node`` has a new host copy, complete once ``event`` is (None: now); it is written to
        storage at the next ``poll`` after that (at once for None; nothing once closed)."""
        if self.closed:
            return
        copy = node.records[HOST]
        self._pending.append((node, copy, event, copy.slots))
        if event is None:
            self.write_due()

    def poll(self) -> None:
        """``check_hicache_events``: write what is due (``write_due``), free the host pages of ended
        prefetches whose worker is done, and turn what the workers did since into KV events."""
        self.write_due()
        self.free_parked()
        self.events.publish()

    def write_due(self) -> None:
        """Write the host copies whose backup completed, if they are still the node's (with the
        parents a split gave the copy's first part meanwhile); nothing once closed. A copy whose
        pages cannot be read out of the host pool is a failed write, as a backend's failure is: it
        is counted, the tier backs off, and no cache call raises for it."""
        if self.closed:
            return
        queue, self._pending, left = self._pending, [], []
        for i, (node, copy, event, slots) in enumerate(queue):
            if event is not None and not event.query():
                left.append((node, copy, event, slots))
            elif node.records.get(HOST) is copy and self._attached(node):
                try:
                    self._write_copy(node, copy, slots)
                except BaseException:  # an interrupt: the copies after this one stay pending
                    self._pending = left + queue[i + 1 :] + self._pending
                    raise
        self._pending = left + self._pending

    def _write_copy(self, node: TreeNode, copy: Any, slots: torch.Tensor) -> None:
        """Write ``copy`` with the parents a split gave its first part, the prefix's first pages first."""
        parts, rest, n = [(node, copy)], len(slots) - len(copy.slots), node.parent
        while rest > 0 and n is not self.cache.root_node:
            head = n.records.get(HOST)
            if head is None or len(head.slots) > rest or not torch.equal(head.slots, slots[rest - len(head.slots) : rest]):
                break
            parts.append((n, head))
            rest, n = rest - len(head.slots), n.parent
        for part, part_copy in reversed(parts):
            self._write(part, part_copy)

    def _write(self, node: TreeNode, copy: Any) -> None:
        pages = len(copy.slots) // self.page_size
        keys = self.keys_of(node)
        if keys is None or not pages:
            return
        with self._lock:
            if time.monotonic() < self._resume_at or self.queued_pages + pages > self.max_queued_pages:
                self.stats.writes_skipped += pages
                return
            self.queued_pages += pages
        try:
            data = [self.host.get_data_page(int(s)) for s in copy.slots[:: self.page_size]]
            announced = self.events.pages_of(node, keys)
        except BaseException as e:
            with self._lock:
                self.queued_pages -= pages
                if isinstance(e, Exception):
                    self.stats.write_failures += 1
                    self._settle(False)
            if isinstance(e, Exception):
                return
            raise
        self.workers.submit("write", lambda: self._run_write(keys, data, announced))

    def _run_write(self, keys: list[str], data: list[torch.Tensor], announced: list) -> None:
        try:
            ok = self.storage.batch_set(keys, data) is True
        except Exception:
            ok = False
        if ok:
            self.events.stored(announced)
        with self._lock:
            self.queued_pages -= len(keys)
            if ok:
                self.stats.pages_written += len(keys)
            else:
                self.stats.write_failures += 1
            self._settle(ok)

    # --- keys ------------------------------------------------------------------------------------

    def keys_of(self, node: TreeNode) -> Optional[list[str]]:
        """The page keys of ``node``'s pages, computed once along its path; None when its
        ``extra_key`` has no stable encoding (such keys are kept out of storage)."""
        root, chain = self.cache.root_node, []
        n = node
        while n is not root and STORAGE not in n.records:
            chain.append(n)
            n = n.parent
        prior = None if n is root else n.records[STORAGE].keys[-1]
        try:
            for n in reversed(chain):
                keys = page_keys(self.elements(encoded(n.key)), self.page_size, n.key.extra_key, prior)
                n.records[STORAGE] = PageKeys(keys, self.page_size)
                prior = keys[-1]
        except ValueError:
            return None
        return node.records[STORAGE].keys if node is not root else []

    def elements(self, enc: bytes) -> np.ndarray:
        """Key bytes as the int64 tokens (or ``[n, 2]`` bigrams) they encode."""
        arr = np.frombuffer(enc, dtype="<i8")
        return arr.reshape(-1, 2) if self.cache.is_eagle else arr

    # --- prefetch --------------------------------------------------------------------------------

    def prefetch(self, req_id: Any, last_host_node: TreeNode, new_input_tokens: Any, extra_key: Any = None) -> None:
        """Start fetching the pages of ``new_input_tokens`` that follow ``last_host_node``'s prefix
        and that the tree lacks (see ``HiRadixCache.prefetch_from_storage``)."""
        if self.closed:
            raise RuntimeError("prefetch_from_storage: the cache's storage tier is closed (close() was called)")
        if req_id in self.ongoing_prefetch:
            raise ValueError(f"req_id {req_id!r} has a prefetch in flight already (check_prefetch_progress ends it)")
        if not isinstance(last_host_node, TreeNode):
            raise TypeError(f"last_host_node must be a TreeNode, got {type(last_host_node).__name__}")
        root = self.cache.root_node
        if last_host_node is not root and (HOST not in last_host_node.records or not self._attached(last_host_node)):
            raise ValueError(f"last_host_node must be a node of this tree with a host copy, got node {last_host_node.id}")
        extra = last_host_node.key.extra_key if last_host_node is not root else extra_key
        if isinstance(new_input_tokens, RadixKey):
            if last_host_node is not root and new_input_tokens.extra_key != extra:
                raise ValueError(
                    f"new_input_tokens' extra_key must be last_host_node's {extra!r}, got {new_input_tokens.extra_key!r}"
                )
            extra, new_input_tokens = new_input_tokens.extra_key, new_input_tokens.token_ids
        elements = self.tree_elements(new_input_tokens)
        prior = self.keys_of(last_host_node)
        if prior is None:
            return
        keys = page_keys(elements, self.page_size, extra, prior[-1] if prior else None)  # checks the extra_key
        if not keys or time.monotonic() < self._resume_at:
            return
        path, n = [], last_host_node
        while n is not root:
            path.append(encoded(n.key))
            n = n.parent
        start = sum(len(p) for p in path)
        enc = b"".join(reversed(path)) + elements[: len(keys) * self.page_size].tobytes()
        held = self.held_pages(last_host_node, enc, start, extra)
        keys, start = keys[held:], start + held * self.page_enc_bytes
        if not keys or len(keys) * self.page_size < self.policy.prefetch_threshold:
            return
        if self.prefetch_pages + len(keys) > self.max_prefetch_pages:
            return
        copy = last_host_node.records[HOST]
        op = PrefetchOp(enc, start, keys, extra, last_host_node, copy)
        if self.host_reads is not None:
            self.host_reads.give(op)  # (no host room now: the pages are read into pages of their own)
        copy.holds += 1  # the node the pages hang below stays on the host meanwhile
        self.ongoing_prefetch[req_id] = op
        self.prefetch_pages += len(keys)
        self.stats.prefetches += 1
        self.workers.submit("prefetch", lambda: self._run_prefetch(op))

    def tree_elements(self, tokens: Any) -> np.ndarray:
        """``tokens`` (ints, or ``(int, int)`` bigrams) as the elements the tree's keys hold: int64
        ``[n]``, or ``[n, 2]`` bigrams in an EAGLE cache, where plain tokens become their bigrams as
        the tree turns a key (element i is tokens i and i + 1). Raises ``ValueError`` for bad
        tokens, and for bigrams given to a cache of plain keys."""
        elements = token_array(tokens)
        if self.cache.is_eagle and elements.ndim == 1:
            elements = np.frombuffer(to_bigram(elements.tobytes()), dtype="<i8").reshape(-1, 2)
        if elements.ndim == 2 and not self.cache.is_eagle:
            raise ValueError(f"new_input_tokens must be tokens like the tree's keys (is_eagle=False), got shape {tuple(elements.shape)}")
        return elements

    def held_pages(self, node: TreeNode, enc: bytes, start: int, extra: Any) -> int:
        """How many whole pages of ``enc`` from ``start`` (the bytes after ``node``'s prefix) the tree
        holds below ``node`` already, on any tier: the prefetch reads none of them."""
        _, _, pos = self.cache.held_below(node, enc, start, extra)
        return (pos - start) // self.page_enc_bytes

    def _run_prefetch(self, op: PrefetchOp) -> None:
        ok = True
        try:
            hits = self.storage.batch_exists(op.keys)
            if hits < len(op.keys):
                self.events.missing(op.keys[hits])
            if hits * self.page_size < self.policy.prefetch_threshold:
                hits = 0
            self.fetch(op, hits)
        except Exception:
            ok = False
        with self._lock:
            op.finished = True
            self.stats.pages_read += len(op.pages) + op.read
            if not ok:
                self.stats.prefetch_failures += 1
            self._settle(ok)

    def fetch(self, op: PrefetchOp, hits: int) -> None:
        """Read the first ``hits`` pages of ``op`` in order into ``op.pages`` (on a worker thread),
        until one misses or ``op`` is terminated (into its host pages where it holds some, counted in
        ``op.read``); a subclass that reads more per page overrides it."""
        if op.slots is not None and self.host_reads is not None:
            missed = self.host_reads.fetch(op, hits)
            if missed is not None:
                self.events.missing(missed)
            return
        for key in op.keys[:hits]:
            if op.terminated:
                break
            page = torch.empty(self.page_nbytes, dtype=torch.uint8)
            if self.storage.get(key, page) is None:
                self.events.missing(key)
                break
            with self._lock:
                if op.terminated:  # ended meanwhile: what it took was counted then
                    break
                op.pages.append(page)

    def progress(self, req_id: Any) -> bool:
        """``HiRadixCache.check_prefetch_progress``: whether the request may go on now; when it may,
        the pages read so far enter the host tier."""
        self.free_parked()
        op = self.ongoing_prefetch.get(req_id)
        if op is None:
            return True
        policy = self.policy
        with self._lock:
            finished = op.finished
        if not finished and policy.prefetch_policy != "best_effort":
            limit = policy.prefetch_timeout_base_s + policy.prefetch_timeout_per_page_s * len(op.keys)
            if policy.prefetch_policy == "wait_complete" or time.monotonic() - op.started <= limit:
                return False
        with self._lock:
            op.terminated = True
            pages, read = list(op.pages), op.read
        del self.ongoing_prefetch[req_id]
        self.prefetch_pages -= len(op.keys)
        try:
            if op.slots is not None and self.host_reads is not None:
                self.loaded_tokens[req_id] = self._take_read(op, self.host_reads.end(op, read))
            else:
                self.loaded_tokens[req_id] = self._take(op, pages)
        finally:
            self._release_hold(op)
        return True

    def terminate(self, req_id: Any) -> None:
        """Stop the worker reading further pages for ``req_id`` (what has arrived is still taken)."""
        op = self.ongoing_prefetch.get(req_id)
        if op is not None:
            op.terminated = True

    def abort(self, req_id: Any) -> None:
        """``HiRadixCache.release_aborted_request``: end ``req_id``'s prefetch without taking its pages
        (the worker stops reading), and release its hold on the host copy."""
        self.loaded_tokens.pop(req_id, None)
        op = self.ongoing_prefetch.pop(req_id, None)
        if op is None:
            return
        self.prefetch_pages -= len(op.keys)
        with self._lock:
            op.terminated = True
            self.stats.tokens_dropped += (len(op.pages) + op.read) * self.page_size
        try:
            if self.host_reads is not None:
                self.host_reads.end(op, 0)
        finally:
            self._release_hold(op)

    def _release_hold(self, op: PrefetchOp) -> None:
        """Give back ``op``'s hold on the host copy of the node it continues; the cache then drops
        that node if it may no longer stay unheld (``hold_released``)."""
        op.copy.holds -= 1
        if op.copy.holds == 0 and op.node.records.get(HOST) is op.copy and self._attached(op.node):
            self.cache.hold_released(op.node)

    # --- housekeeping ----------------------------------------------------------------------------

    def reset(self) -> None:
        """Drop every prefetch and pending write (the cache was reset: its host pages are free)."""
        for op in self.ongoing_prefetch.values():
            op.terminated = True
        if self.host_reads is not None:
            self.host_reads.forget(list(self.ongoing_prefetch.values()))
        self.ongoing_prefetch.clear()
        self.prefetch_pages = 0
        self.loaded_tokens.clear()
        self._pending = []
        self.events.forget()

    def held_host_slots(self) -> list[torch.Tensor]:
        """The host slots the prefetches hold outside the tree (those reading into host pages, in
        flight or ended with their worker still running)."""
        return [] if self.host_reads is None else self.host_reads.held(list(self.ongoing_prefetch.values()))

    def free_parked(self) -> None:
        """Free the host pages of ended prefetches whose worker is done with them."""
        if self.host_reads is not None:
            self.host_reads.free_parked()

    def problems(self, nodes: list[TreeNode]) -> list[str]:
        """The storage room's part of ``check_integrity`` (``kvpool.cache.storage_integrity``)."""
        return storage_problems(self, nodes)

    def _attached(self, node: TreeNode) -> bool:
        root = self.cache.root_node
        while node is not root:
            parent = node.parent
            if parent is None or parent.children.get(node.child_key) is not node:
                return False
            node = parent
        return True

    def _settle(self, ok: bool) -> None:
        """Back off after a failure, reset after a success (lock held)."""
        if ok:
            self._backoff = self.policy.backoff_s
        else:
            self._resume_at = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, self.policy.max_backoff_s)

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until the workers have run every job queued so far; False if ``timeout_s`` passed."""
        done = self.workers.drain(non_negative_seconds(timeout_s, "timeout_s"))
        self.free_parked()
        return done

    def close(self, timeout_s: float = 30.0) -> None:
        """End the tier (idempotent): write the host copies whose backup is complete, end every
        prefetch in flight (as ``abort``: its pages are dropped, its hold released), let the workers
        finish what was queued and join them, withdraw the pages announced as KV events, and close
        the backend if the cache made it. Afterwards ``prefetch`` raises and host copies are no longer
        written through.

        Raises
        ------
        ValueError
            ``timeout_s`` is not a number of seconds >= 0 (nothing is closed).
        TimeoutError
            A worker still runs a storage call after ``timeout_s`` seconds; the tier is closed all
            the same, and the worker ends once that call returns.
        """
        non_negative_seconds(timeout_s, "timeout_s")  # before anything closes
        if not self.closed:
            self.write_due()
            self._pending = []
            for req_id in list(self.ongoing_prefetch):
                self.abort(req_id)
            self.closed = True
        alive = self.workers.stop(timeout_s)
        self.free_parked()
        if alive:
            raise TimeoutError(f"storage workers {', '.join(alive)} still run a storage call after {timeout_s} s")
        self.events.withdraw_all()
        if self.owns_storage:
            self.owns_storage = False
            self.storage.close()
