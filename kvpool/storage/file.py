"""``HiCacheFile``: the embedded storage backend, one directory of page files (SGLang's name; the
rules are docs/contract.md, "Storage tier", "File backend").

Each page is one file named by :func:`~kvpool.storage.keys.storage_digest` (64 hex characters and
``.kvpage``), laid out as :mod:`kvpool.storage.record` says. A page is written to a temporary file
in the same directory and renamed over its name (``os.replace``, atomic within a filesystem), so a
writer that dies midway leaves only a temporary file, never a half page under a real name; every
read checks the header, name, sizes and checksum, so a torn or corrupted page is a miss. The directory
holds at most ``max_bytes`` of page files: beyond that the least recently used pages are removed.

A batch of writes sums its pages ahead where cores are free for it (``sum_ahead``): the checksum
threads sum page i + 1 while page i is written, and a page's header, which holds its sums, is put
together once they are done, just before its write. Where they are not, each page is summed on the
writing thread just before its write, which then copies bytes the sums brought into the cache (a
checksum thread beside the write would compete with it for the core and the cache).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import re
import threading
from collections import OrderedDict
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from kvpool.checks import positive_int
from kvpool.storage import record
from kvpool.storage.base import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo, StorageStats
from kvpool.storage.file_io import (
    TEMP_PREFIX, HostViews, as_bytes, default_file_path, owner_only_directory, usable_cores, value_bytes, vectored, write_all,
    writer_alive,
)  # fmt: skip
from kvpool.storage.keys import key_namespace, storage_digest, storage_name
from kvpool.storage.record import (
    PayloadChecksum, checksum_of, checksum_of_regions, chunk_sums, pack_header, parse_header,
    payload_offset, region_sums,
)  # fmt: skip

#: The directory's default bound: 8 GiB of page files.
DEFAULT_MAX_BYTES = 8 << 30
PAGE_SUFFIX = ".kvpage"
_PAGE_NAME = re.compile(r"^[0-9a-f]{64}\.kvpage$")
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
#: A batch of writes sums its pages ahead, on the checksum threads, by default on a host whose
#: process may run on at least this many cores (``HiCacheFile``'s ``sum_ahead``).
SUM_AHEAD_CORES = 4


class HiCacheFile(HiCacheStorage):
    """KV pages in one directory on a local disk (SGLang's ``HiCacheFile``: the same constructor and
    interface, :class:`~kvpool.storage.base.HiCacheStorage`).

    Parameters
    ----------
    storage_config : who is storing (:class:`~kvpool.storage.base.HiCacheStorageConfig`; None is the
        default config). With :meth:`register_mem_pool_host` it makes the namespace pages are stored
        under (:func:`~kvpool.storage.keys.key_namespace`).
    file_path : the directory (default :func:`default_file_path`); created with mode 0o700. An
        existing one must be a directory of this user's, mode 0o700 (else ValueError). Temporary
        files left there by a writer that died are removed; the page files there are taken over,
        least recently written first out.
    max_bytes : the bound on the page files' total size (header, name and payload), >= 1. A page
        larger than the bound is not stored (``set`` returns False).
    sum_ahead : whether a batch of writes (``batch_set``, ``batch_set_v1``) sums page i + 1 on the
        checksum threads while page i is written (None: where the process may run on at least
        :data:`SUM_AHEAD_CORES` cores); otherwise each page is summed by its writer just before its
        write. Either way a page's bytes and its guarantees are the same.

    Several threads may use one instance at once (writes take turns, reads do not wait for them; a
    page evicted while it is being read is still read whole). ``close`` waits for the calls in flight
    (a batch of writes stops after the page it is writing) and refuses later ones. Several processes may share a directory (each
    names its own pages by namespace); each keeps the bound over the pages it wrote or found when
    it was made, so give each one its own share of the disk.

    Examples
    --------
    >>> store = HiCacheFile(HiCacheStorageConfig(model_name="llama"), "/tmp/kv", max_bytes=1 << 30)
    >>> store.register_mem_pool_host(host_pool)
    >>> keys = page_keys(token_ids, host_pool.page_size)
    >>> store.batch_set_v1(keys, host_slots)             # [True, True, ...]
    >>> store.batch_get_v1(keys, other_host_slots)        # the same bytes in other host pages
    """

    def __init__(
        self,
        storage_config: Optional[HiCacheStorageConfig] = None,
        file_path: Optional[str] = None,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        sum_ahead: Optional[bool] = None,
    ) -> None:
        if storage_config is None:
            storage_config = HiCacheStorageConfig()
        if not isinstance(storage_config, HiCacheStorageConfig):
            raise ValueError(f"storage_config must be a HiCacheStorageConfig or None, got {type(storage_config).__name__}")
        self.max_bytes = positive_int(max_bytes, "max_bytes")
        if sum_ahead is not None and not isinstance(sum_ahead, bool):
            raise ValueError(f"sum_ahead must be None or a bool, got {sum_ahead!r}")
        self.sum_ahead = usable_cores() >= SUM_AHEAD_CORES if sum_ahead is None else sum_ahead
        self.storage_config = storage_config
        self.file_path = owner_only_directory(default_file_path() if file_path is None else file_path)
        self.namespace = key_namespace(storage_config)
        self._lock = threading.Lock()  # the index, the counters and the calls in flight
        self._idle = threading.Condition(self._lock)  # notified when the last call in flight returns
        self._calls = 0
        self.closed = False
        self._write_lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # digest -> file bytes, least recent first
        self._writing: set[str] = set()  # digests whose page a writer is putting in place now
        self._bytes = 0
        self._stats = StorageStats()
        self._temp_ids = itertools.count()
        self._views = HostViews([])
        self._adopt_directory()

    # --- the directory -------------------------------------------------------------------------------

    def _adopt_directory(self) -> None:
        """Remove temporary files a dead writer left (a live one's are its write in flight), index the
        page files oldest first, and trim."""
        found = []
        with os.scandir(self.file_path) as entries:
            for e in entries:
                if e.name.startswith(TEMP_PREFIX) and e.is_file(follow_symlinks=False):
                    if writer_alive(e.name):
                        continue
                    try:
                        os.unlink(e.path)
                    except FileNotFoundError:
                        pass
                elif _PAGE_NAME.match(e.name) and e.is_file(follow_symlinks=False):
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:  # evicted by another process since the listing
                        continue
                    found.append((st.st_mtime_ns, e.name[:64], st.st_size))
        with self._lock:
            for _, digest, size in sorted(found):
                self._index[digest] = size
                self._bytes += size
            self._trim(0)

    def _path(self, digest: str) -> str:
        return os.path.join(self.file_path, digest + PAGE_SUFFIX)

    def _trim(self, room: int) -> None:
        """Evict least recently used pages until ``room`` more bytes fit (lock held)."""
        while self._index and self._bytes + room > self.max_bytes:
            digest = next(iter(self._index))
            self._forget(digest)
            self._stats.evictions += 1
            try:
                os.unlink(self._path(digest))
            except FileNotFoundError:
                pass

    def _forget(self, digest: str) -> None:
        size = self._index.pop(digest, None)
        if size is not None:
            self._bytes -= size

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """As the interface says; the namespace takes in the host pool's page geometry."""
        super().register_mem_pool_host(mem_pool_host)
        self.namespace = key_namespace(self.storage_config, mem_pool_host)
        buffers = getattr(mem_pool_host, "buffers", None)
        if buffers is None:
            buffers = [getattr(mem_pool_host, n, None) for n in ("k_buffer", "v_buffer")]
        self._views = HostViews([b for b in buffers if isinstance(b, torch.Tensor) and b.device.type == "cpu"])

    # --- one page ------------------------------------------------------------------------------------

    def _store(
        self, key: str, parts: list[memoryview], blocks: Optional[list[tuple[int, int]]] = None, job: Optional[PayloadChecksum] = None
    ) -> bool:
        """Write one page, its payload given as consecutive buffers (``blocks``: the same bytes as host
        memory regions, when they are a host page's; ``job``: its checksum, started ahead), temporary
        file then rename; False when it cannot be stored. Writes are serialised (reads are not), so
        the index and the files agree whatever the threads do. No checksum thread reads the page once
        this returns."""
        try:
            with self._write_lock:
                return self._store_one(key, parts, blocks, job)
        finally:
            if job is not None:
                job.wait()

    def _store_one(
        self, key: str, parts: list[memoryview], blocks: Optional[list[tuple[int, int]]], job: Optional[PayloadChecksum]
    ) -> bool:
        name = storage_name(self.namespace, key)
        digest = storage_digest(self.namespace, key)
        path = self._path(digest)
        payload_len = sum(p.nbytes for p in parts)
        size = payload_offset(len(name)) + payload_len
        with self._lock:
            if digest in self._index and os.path.exists(path):
                self._index.move_to_end(digest)
                self._stats.writes += 1
                return True
            if size > self.max_bytes:
                self._stats.write_failures += 1
                return False
            self._forget(digest)
            self._trim(size)
            self._index[digest] = size  # reserved now, so concurrent writers keep the bound
            self._bytes += size
            self._writing.add(digest)
        temp = os.path.join(self.file_path, f"{TEMP_PREFIX}{os.getpid()}-{threading.get_ident()}-{next(self._temp_ids)}")
        made = False
        try:
            if job is None or job.name != name:  # summed here, just before the write
                job = self._checksum(name, parts, blocks, ahead=False)
            head = pack_header(name, payload_len, job.value())  # raises what a checksum thread raised
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
            made = True
            try:
                if len(parts) == 1:
                    write_all(fd, head)
                    write_all(fd, parts[0])
                else:  # a host page's blocks, behind the header, in one call
                    vectored(os.writev, fd, [memoryview(head), *parts])
            finally:
                os.close(fd)
            os.replace(temp, path)
        except BaseException as e:  # the key as before, the reservation given back
            if made:
                try:
                    os.unlink(temp)
                except OSError:
                    pass
            with self._lock:
                self._writing.discard(digest)
                self._forget(digest)
                self._stats.write_failures += 1
            if isinstance(e, Exception):  # an I/O error, or the checksum's: a failed write
                return False
            raise
        with self._lock:
            self._writing.discard(digest)
            self._stats.writes += 1
        return True

    @staticmethod
    def _checksum(name: bytes, parts: list[memoryview], blocks: Optional[list[tuple[int, int]]], ahead: bool) -> PayloadChecksum:
        """A page's checksum: on the checksum threads (``ahead``) or for the caller's ``value()``."""
        if blocks is None:
            return checksum_of(name, parts, threads=ahead, ahead=ahead)
        return checksum_of_regions(name, blocks, threads=ahead, ahead=ahead)

    def _store_batch(
        self, keys: Sequence[str], pages: Sequence[list[memoryview]], blocks: Optional[Sequence[list[tuple[int, int]]]], stop: bool
    ) -> list[bool]:
        """``_store`` of each page in order (``stop``: none after the first failure), page i + 1
        summed ahead while page i is written (``sum_ahead``); the pages not written are False. A
        ``close`` meanwhile ends the batch after the page being written."""
        done: list[bool] = []
        ahead = None
        try:
            for i, key in enumerate(keys):
                job, ahead = ahead, None
                if self.sum_ahead:
                    if job is None:  # the first page: its chunks on the threads and the caller
                        job = self._ahead(key, pages[i], None if blocks is None else blocks[i])
                    if i + 1 < len(keys):
                        ahead = self._ahead(keys[i + 1], pages[i + 1], None if blocks is None else blocks[i + 1])
                ok = self._store(key, pages[i], None if blocks is None else blocks[i], job)
                done.append(ok)
                if (stop and not ok) or self.closed:
                    break
        finally:
            if ahead is not None:
                ahead.wait()
        return done + [False] * (len(keys) - len(done))

    def _ahead(self, key: str, parts: list[memoryview], blocks: Optional[list[tuple[int, int]]]) -> Optional[PayloadChecksum]:
        """The checksum of a page about to be written, started on the checksum threads (None: the
        page is stored already)."""
        if storage_digest(self.namespace, key) in self._index:
            return None
        return self._checksum(storage_name(self.namespace, key), parts, blocks, ahead=True)

    @contextlib.contextmanager
    def _call(self) -> Iterator[None]:
        """One call that touches the directory, counted in flight; RuntimeError once closed."""
        with self._lock:
            if self.closed:
                raise RuntimeError("HiCacheFile is closed (close() was called): make a new one to use the directory")
            self._calls += 1
        try:
            yield
        finally:
            with self._lock:
                self._calls -= 1
                if not self._calls:
                    self._idle.notify_all()

    def _load(self, key: str, parts_for: Callable[[int], Optional[list[Any]]]) -> bool:
        """Read one page into the writable buffers or ``(address, size)`` regions ``parts_for(payload
        length)`` names (None: a size the caller cannot take) and check it: True for a hit, False for
        a miss (their bytes are then unspecified, or untouched where the header or the file's size
        already showed the miss)."""
        return self._finish(*self._begin(key, parts_for))

    def _begin(self, key: str, parts_for: Callable[[int], Optional[list[Any]]]) -> tuple[str, Any]:
        """Read one page as ``_load`` does, its chunks' checksums still running: ``(digest, outcome)``,
        the outcome "absent", "size", "corrupt", or ``(checksum job, stored checksum)``."""
        name = storage_name(self.namespace, key)
        digest = storage_digest(self.namespace, key)
        try:
            fd = os.open(self._path(digest), os.O_RDONLY | _NOFOLLOW)
        except OSError:
            return digest, "absent"
        try:
            return digest, self._read_page(fd, name, parts_for)
        except OSError:
            return digest, "absent"
        finally:
            os.close(fd)

    def _finish(self, digest: str, outcome: Any) -> bool:
        """Wait for a read's checksum, count it, and remove a page that failed its check: True for a hit."""
        if isinstance(outcome, tuple):
            job, crc = outcome
            outcome = "hit" if job.value() == crc else "corrupt"
        with self._lock:
            if outcome == "hit":
                self._stats.hits += 1
                if digest in self._index:
                    self._index.move_to_end(digest)
                return True
            self._stats.misses += 1
            if outcome == "corrupt":
                self._stats.corrupt += 1
            # A page being written now is the writer's to index (what this read saw is gone), and one
            # that is back on disk was written again since this read found it absent.
            if outcome == "size" or digest in self._writing:
                return False
            if outcome == "absent" and os.path.exists(self._path(digest)):
                return False
            self._forget(digest)
            if outcome == "corrupt":  # removed, so the next write of the key stores it again
                try:
                    os.unlink(self._path(digest))
                except OSError:
                    pass
        return False

    def _read_page(self, fd: int, name: bytes, parts_for: Callable[[int], Optional[list[Any]]]) -> Any:
        """"size" for a good header of a payload size ``parts_for`` refuses, "corrupt", "hit", or,
        with the payload of several chunks read, ``(its checksum job, the stored checksum)``. The
        payload is read with one read (``readv`` into its blocks or buffers), then checksummed."""
        size = os.fstat(fd).st_size
        raw = os.read(fd, payload_offset(len(name)))
        parsed = parse_header(raw, name)
        if parsed is None or size != len(raw) + parsed[0]:
            return "corrupt"
        payload_len, crc = parsed
        parts = parts_for(payload_len)
        if parts is None:
            return "size"
        blocks = all(type(p) is tuple for p in parts)  # host memory as (address, size), else buffers
        views = [self._views.view(ptr, n) for ptr, n in parts if n] if blocks else [p for p in parts if p.nbytes]
        # One read of the whole payload (as a plain read of the page would be).
        if not vectored(os.readv, fd, views):
            return "corrupt"
        if payload_len <= record.CHUNK_BYTES:  # one chunk: summed here, as a checksum job's caller would
            # The header's checksum (checked) covers the name and the stored sums: the sums decide.
            return "hit" if (region_sums(parts) if blocks else chunk_sums(views)) == (crc.a, crc.b) else "corrupt"
        # Its chunks' sums run on the checksum threads while the caller goes on (``batch_get_v1``: the next page).
        regions = parts if blocks else [(ctypes.addressof(ctypes.c_char.from_buffer(v)), v.nbytes) for v in views]
        return checksum_of_regions(name, regions), crc

    def _load_tensor(self, key: str, target: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Read one page into ``target`` (or a new uint8 tensor of the stored size): the tensor, or
        None for a miss."""
        made: list[torch.Tensor] = []

        def parts_for(payload_len: int) -> Optional[list[memoryview]]:
            if target is None:
                made.append(torch.empty(payload_len, dtype=torch.uint8))
                return [as_bytes(made[0])]
            return [as_bytes(target)] if target.numel() * target.element_size() == payload_len else None

        if not self._load(key, parts_for):
            return None
        return target if target is not None else made[0]

    # --- the interface -------------------------------------------------------------------------------

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None) -> Optional[torch.Tensor]:
        """As :meth:`HiCacheStorage.get`: the page of ``key`` read into ``target_location`` (a
        contiguous CPU tensor of the page's size) or a new uint8 tensor; None for a miss (absent,
        torn, corrupt, foreign or of another size)."""
        key = self.check_key(key)
        target = self.check_target(target_location, target_sizes, "target_location")
        with self._call():
            return self._load_tensor(key, target)

    def batch_get(
        self, keys: list[str], target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None
    ) -> list[Optional[torch.Tensor]]:
        """As :meth:`HiCacheStorage.batch_get`: :meth:`get` of each key, every argument checked first."""
        keys = self.check_keys(keys)
        targets = self.check_batch(target_locations, "target_locations", len(keys)) or [None] * len(keys)
        sizes = self.check_batch(target_sizes, "target_sizes", len(keys)) or [None] * len(keys)
        checked = [self.check_target(t, s, f"target_locations[{i}]") for i, (t, s) in enumerate(zip(targets, sizes))]
        with self._call():
            return [self._load_tensor(k, t) for k, t in zip(keys, checked)]

    def set(
        self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None
    ) -> bool:
        """As :meth:`HiCacheStorage.set`: ``value`` (a CPU tensor) stored as the page of ``key``,
        renamed into place; False when the write fails."""
        key = self.check_key(key)
        payload = value_bytes(value, target_location, target_sizes, "value")
        with self._call():
            return self._store(key, [payload])

    def batch_set(
        self, keys: list[str], values: Optional[Any] = None, target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None
    ) -> bool:
        """As :meth:`HiCacheStorage.batch_set`: :meth:`set` of each key in order, stopping at the first
        failure; every argument checked first."""
        keys = self.check_keys(keys)
        if values is None:
            raise ValueError("values must be a list of CPU tensors (one per key), got None")
        vals = self.check_batch(values, "values", len(keys))
        targets = self.check_batch(target_locations, "target_locations", len(keys)) or [None] * len(keys)
        sizes = self.check_batch(target_sizes, "target_sizes", len(keys)) or [None] * len(keys)
        payloads = [value_bytes(v, t, s, f"values[{i}]") for i, (v, t, s) in enumerate(zip(vals, targets, sizes))]  # type: ignore[arg-type]
        with self._call():
            return all(self._store_batch(keys, [[p] for p in payloads], None, stop=True))

    def exists(self, key: str) -> bool:
        """Whether a page file of ``key`` is in the directory (its contents are checked only when read)."""
        key = self.check_key(key)
        with self._call():
            return os.path.isfile(self._path(storage_digest(self.namespace, key)))

    def batch_exists(self, keys: list[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """As :meth:`HiCacheStorage.batch_exists`: the number of leading keys whose page file is in
        the directory, every key checked first."""
        keys = self.check_keys(keys)
        with self._call():
            for i, key in enumerate(keys):
                if not os.path.isfile(self._path(storage_digest(self.namespace, key))):
                    return i
            return len(keys)

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Optional[HiCacheStorageExtraInfo] = None
    ) -> list[bool]:
        """As the interface says: each page is read straight into its host page's blocks and checked
        there (a miss leaves that host page's bytes unspecified; one whose header, name or size
        already tells it is a miss, before any payload byte is read, leaves it as it was)."""
        regions = self.host_page_regions(keys, host_indices)
        with self._call():
            return self._load_pages(keys, regions)

    reads_into_regions = True

    def batch_get_regions(self, keys: list[str], regions: list[list[tuple[int, int]]]) -> list[bool]:
        """As :meth:`HiCacheStorage.batch_get_regions`: each page read straight into its blocks and
        checked there, as :meth:`batch_get_v1` reads into host pages."""
        keys = self.check_keys(keys)
        regions = self.check_regions(regions, len(keys))
        with self._call():
            return self._load_pages(keys, regions)

    def _load_pages(self, keys: list[str], regions: list[list[tuple[int, int]]]) -> list[bool]:
        """Read each page into its host blocks, each page's checksum running while the next is read."""
        done: list[bool] = []
        pending, pending_at = None, None  # the previous page, its checksum running while this one is read
        for key, blocks in zip(keys, regions):
            want = sum(n for _, n in blocks)
            if pending is not None and blocks[:1] == pending_at:  # the same host page again: checked first
                done.append(self._finish(*pending))
                pending = None
            started = self._begin(key, lambda n, blocks=blocks, want=want: blocks if n == want else None)
            if pending is not None:
                done.append(self._finish(*pending))
            pending, pending_at = started, blocks[:1]
        if pending is not None:
            done.append(self._finish(*pending))
        return done

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Optional[HiCacheStorageExtraInfo] = None
    ) -> list[bool]:
        """As the interface says: each page is written straight from its host page's blocks, in the
        flat page order (after the host pool's transfers in flight are done)."""
        regions = self.host_page_regions(keys, host_indices)
        pages = [[self._views.view(ptr, n) for ptr, n in blocks] for blocks in regions]
        with self._call():
            return self._store_batch(keys, pages, regions, stop=False)

    def clear(self) -> None:
        """Remove every page file of the directory (other files are left alone), after a write in
        flight has renamed its page."""
        with self._call(), self._write_lock, self._lock:
            with os.scandir(self.file_path) as entries:
                for e in entries:
                    if _PAGE_NAME.match(e.name):
                        try:
                            os.unlink(e.path)
                        except FileNotFoundError:
                            pass
            self._index.clear()
            self._bytes = 0

    def get_stats(self) -> StorageStats:
        """A copy of the counters, with the pages and bytes the directory holds now."""
        with self._lock:
            s = StorageStats(**vars(self._stats))
            s.pages, s.bytes = len(self._index), self._bytes
        return s

    def close(self) -> None:
        """Wait for the calls in flight (a batch of writes stops after the page it is writing: False
        for the rest, not written; no checksum thread reads a caller's memory afterwards) and refuse
        later calls with RuntimeError (``get_stats`` still answers). The directory and its pages
        stay. Idempotent."""
        with self._lock:
            self.closed = True
            while self._calls:
                self._idle.wait()
