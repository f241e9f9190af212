"""``HiCacheFile``: the embedded storage backend, one directory of page files (SGLang's name; the
rules are docs/contract.md, "Storage tier", "File backend").

Each page is one file named by :func:`~kvpool.storage.keys.storage_digest` (64 hex characters and
``.kvpage``), laid out as :mod:`kvpool.storage.record` says. A page is written to a temporary file
in the same directory and renamed over its name (``os.replace``, atomic within a filesystem), so a
writer that dies midway leaves only a temporary file, never a half page under a real name; every
read checks the header, name, sizes and checksum, so a torn or corrupted page is a miss. The directory
holds at most ``max_bytes`` of page files: beyond that the least recently used pages are removed.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import re
import stat
import tempfile
import threading
from collections import OrderedDict
from typing import Any, Callable, Optional

import torch

from kvpool.checks import positive_int
from kvpool.storage.base import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo, StorageStats
from kvpool.storage.keys import key_namespace, storage_digest, storage_name
from kvpool.storage.record import checksum_of, checksum_of_regions, pack_header, parse_header, payload_offset

#: The directory's default bound: 8 GiB of page files.
DEFAULT_MAX_BYTES = 8 << 30
PAGE_SUFFIX = ".kvpage"
TEMP_PREFIX = ".kvpage-tmp-"
_PAGE_NAME = re.compile(r"^[0-9a-f]{64}\.kvpage$")
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
#: Buffers per ``writev`` / ``readv`` call (the system's bound is at least 16 and usually 1024).
_IOV_MAX = min(512, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 16)


def default_file_path() -> str:
    """The directory used without ``file_path``: ``kvpool-hicache-<uid>`` in the temporary directory
    (one per user, so another user's directory is never picked up)."""
    return os.path.join(tempfile.gettempdir(), f"kvpool-hicache-{os.geteuid()}")


def owner_only_directory(path: object) -> str:
    """``path`` as an absolute directory that exists, is not a symlink, belongs to this user and is
    readable by its owner only, created (mode 0o700) if missing.

    Raises
    ------
    ValueError
        ``path`` not a non-empty str, or an existing entry that is a symlink, not a directory, owned
        by another user, or open to group or others (its mode is shown; ``chmod 700`` it).
    """
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ValueError(f"file_path must be a non-empty path, got {path!r}")
    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    if parent and not os.path.isdir(parent):
        os.makedirs(parent, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)  # the umask may have taken bits from 0o700
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"file_path must be a directory (not a symlink or a file), got {path}")
    if st.st_uid != os.geteuid():
        raise ValueError(f"file_path must belong to this user (uid {os.geteuid()}), got {path} owned by uid {st.st_uid}")
    if st.st_mode & 0o077:
        raise ValueError(
            f"file_path must be readable by its owner only (mode 0o700), got {path} with mode "
            f"{oct(stat.S_IMODE(st.st_mode))}"
        )
    return path


def _writer_alive(temp_name: str) -> bool:
    """Whether the process whose id a temporary file's name carries is running."""
    try:
        pid = int(temp_name[len(TEMP_PREFIX) :].split("-")[0])
        os.kill(pid, 0)
    except (ValueError, OverflowError, ProcessLookupError):
        return False
    except OSError:  # PermissionError: another user's process
        return True
    return pid > 0


def _write_all(fd: int, data: memoryview | bytes) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:
        n = os.write(fd, view)
        view = view[n:]


def _vectored(move: Callable[[int, list[memoryview]], int], fd: int, views: list[memoryview]) -> bool:
    """``os.writev`` or ``os.readv`` of all of ``views`` in order, as many at a time as the system
    takes; False when a read meets the end of the file first."""
    views = [v for v in views if v.nbytes]
    while views:
        batch = views[:_IOV_MAX]
        n = move(fd, batch)
        if n == 0:
            return False
        if n == sum(v.nbytes for v in batch):  # the usual case: all of them at once
            views = views[len(batch) :]
            continue
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if n:
            views[0] = views[0][n:]
    return True


def _region(ptr: int, size: int) -> memoryview:
    """``size`` bytes of host memory at ``ptr`` as a writable memoryview (no copy)."""
    return memoryview((ctypes.c_ubyte * size).from_address(ptr)).cast("B")


class _HostViews:
    """Writable memoryviews of a host pool's buffers, from which a block's view is a slice (far
    cheaper than a new view of its address, which every block of every page would need)."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self.spans = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size(), _as_bytes(b)) for b in buffers if b.is_contiguous()]

    def view(self, ptr: int, size: int) -> memoryview:
        """``size`` bytes at ``ptr`` (a slice of the buffer holding them, else a view of their own)."""
        for base, end, whole in self.spans:
            if base <= ptr and ptr + size <= end:
                return whole[ptr - base : ptr - base + size]
        return _region(ptr, size)


def _as_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, as a writable memoryview (no copy)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


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

    Several threads may use one instance at once (writes take turns, reads do not wait for them; a
    page evicted while it is being read is still read whole). Several processes may share a directory (each
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
    ) -> None:
        if storage_config is None:
            storage_config = HiCacheStorageConfig()
        if not isinstance(storage_config, HiCacheStorageConfig):
            raise ValueError(f"storage_config must be a HiCacheStorageConfig or None, got {type(storage_config).__name__}")
        self.max_bytes = positive_int(max_bytes, "max_bytes")
        self.storage_config = storage_config
        self.file_path = owner_only_directory(default_file_path() if file_path is None else file_path)
        self.namespace = key_namespace(storage_config)
        self._lock = threading.Lock()  # the index and the counters
        self._write_lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # digest -> file bytes, least recent first
        self._writing: set[str] = set()  # digests whose page a writer is putting in place now
        self._bytes = 0
        self._stats = StorageStats()
        self._temp_ids = itertools.count()
        self._views = _HostViews([])
        self._adopt_directory()

    # --- the directory -------------------------------------------------------------------------------

    def _adopt_directory(self) -> None:
        """Remove temporary files a dead writer left (a live one's are its write in flight), index the
        page files oldest first, and trim."""
        found = []
        with os.scandir(self.file_path) as entries:
            for e in entries:
                if e.name.startswith(TEMP_PREFIX) and e.is_file(follow_symlinks=False):
                    if _writer_alive(e.name):
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
        self._views = _HostViews([b for b in buffers if isinstance(b, torch.Tensor) and b.device.type == "cpu"])

    # --- one page ------------------------------------------------------------------------------------

    def _store(self, key: str, parts: list[memoryview], blocks: Optional[list[tuple[int, int]]] = None) -> bool:
        """Write one page, its payload given as consecutive buffers (``blocks``: the same bytes as host
        memory regions, when they are a host page's), temporary file then rename; False when it cannot
        be stored. Writes are serialised (reads are not), so the index and the files agree whatever the
        threads do."""
        with self._write_lock:
            return self._store_one(key, parts, blocks)

    def _store_one(self, key: str, parts: list[memoryview], blocks: Optional[list[tuple[int, int]]]) -> bool:
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
        # Summed on this thread, just before the write, which then copies bytes the sums brought into
        # the cache; a checksum thread beside the write competes with it for the core and the cache.
        job = checksum_of(name, parts, threads=False) if blocks is None else checksum_of_regions(name, blocks, threads=False)
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
            try:
                head = pack_header(name, payload_len, job.value())
                if len(parts) == 1:
                    _write_all(fd, head)
                    _write_all(fd, parts[0])
                else:  # a host page's blocks, behind the header, in one call
                    _vectored(os.writev, fd, [memoryview(head), *parts])
            finally:
                os.close(fd)
            os.replace(temp, path)
        except OSError:
            job.wait()
            try:
                os.unlink(temp)
            except OSError:
                pass
            with self._lock:
                self._writing.discard(digest)
                self._forget(digest)
                self._stats.write_failures += 1
            return False
        with self._lock:
            self._writing.discard(digest)
            self._stats.writes += 1
        return True

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
            # A page being written now is the writer's to index (what this read saw is gone).
            if outcome == "size" or digest in self._writing:
                return False
            self._forget(digest)
            if outcome == "corrupt":  # removed, so the next write of the key stores it again
                try:
                    os.unlink(self._path(digest))
                except OSError:
                    pass
        return False

    def _read_page(self, fd: int, name: bytes, parts_for: Callable[[int], Optional[list[Any]]]) -> Any:
        """"size" for a good header of a payload size ``parts_for`` refuses, "corrupt", or, with the
        payload read, ``(its checksum job, the stored checksum)``. The payload is read with one
        read (``readv`` into its blocks), then checksummed."""
        size = os.fstat(fd).st_size
        raw = os.read(fd, payload_offset(len(name)))
        parsed = parse_header(raw, name)
        if parsed is None or size != len(raw) + parsed[0]:
            return "corrupt"
        payload_len, crc = parsed
        parts = parts_for(payload_len)
        if parts is None:
            return "size"
        regions = [p if isinstance(p, tuple) else (ctypes.addressof(ctypes.c_char.from_buffer(p)), p.nbytes) for p in parts]
        # One read of the whole payload (as a plain read of the page would be); its checksum runs
        # on the checksum threads while the caller goes on (``batch_get_v1``: the next page).
        if not _vectored(os.readv, fd, [self._views.view(ptr, n) for ptr, n in regions if n]):
            return "corrupt"
        return checksum_of_regions(name, regions), crc

    def _load_tensor(self, key: str, target: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Read one page into ``target`` (or a new uint8 tensor of the stored size): the tensor, or
        None for a miss."""
        made: list[torch.Tensor] = []

        def parts_for(payload_len: int) -> Optional[list[memoryview]]:
            if target is None:
                made.append(torch.empty(payload_len, dtype=torch.uint8))
                return [_as_bytes(made[0])]
            return [_as_bytes(target)] if target.numel() * target.element_size() == payload_len else None

        if not self._load(key, parts_for):
            return None
        return target if target is not None else made[0]

    # --- the interface -------------------------------------------------------------------------------

    @staticmethod
    def _check_value(value: object, target: object, size: object, name: str) -> memoryview:
        if target is not None or size is not None:
            raise ValueError(f"{name} must be given as a tensor (HiCacheFile takes no target_location / target_sizes)")
        if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
            got = f"a tensor on {value.device}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{name} must be a CPU tensor, got {got}")
        return _as_bytes(value.detach().contiguous())

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None) -> Optional[torch.Tensor]:
        """As :meth:`HiCacheStorage.get`: the page of ``key`` read into ``target_location`` (a
        contiguous CPU tensor of the page's size) or a new uint8 tensor; None for a miss (absent,
        torn, corrupt, foreign or of another size)."""
        key = self.check_key(key)
        target = self.check_target(target_location, target_sizes, "target_location")
        return self._load_tensor(key, target)

    def batch_get(
        self, keys: list[str], target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None
    ) -> list[Optional[torch.Tensor]]:
        """As :meth:`HiCacheStorage.batch_get`: :meth:`get` of each key, every argument checked first."""
        keys = self.check_keys(keys)
        targets = self.check_batch(target_locations, "target_locations", len(keys)) or [None] * len(keys)
        sizes = self.check_batch(target_sizes, "target_sizes", len(keys)) or [None] * len(keys)
        checked = [self.check_target(t, s, f"target_locations[{i}]") for i, (t, s) in enumerate(zip(targets, sizes))]
        return [self._load_tensor(k, t) for k, t in zip(keys, checked)]

    def set(
        self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None
    ) -> bool:
        """As :meth:`HiCacheStorage.set`: ``value`` (a CPU tensor) stored as the page of ``key``,
        renamed into place; False when the write fails."""
        key = self.check_key(key)
        return self._store(key, [self._check_value(value, target_location, target_sizes, "value")])

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
        payloads = [self._check_value(v, t, s, f"values[{i}]") for i, (v, t, s) in enumerate(zip(vals, targets, sizes))]  # type: ignore[arg-type]
        return all(self._store(k, [p]) for k, p in zip(keys, payloads))

    def exists(self, key: str) -> bool:
        """Whether a page file of ``key`` is in the directory (its contents are checked only when read)."""
        key = self.check_key(key)
        return os.path.isfile(self._path(storage_digest(self.namespace, key)))

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Optional[HiCacheStorageExtraInfo] = None
    ) -> list[bool]:
        """As the interface says: each page is read straight into its host page's blocks and checked
        there (a miss leaves that host page's bytes unspecified; one whose header, name or size
        already tells it is a miss, before any payload byte is read, leaves it as it was)."""
        regions = self.host_page_regions(keys, host_indices)
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
        return [self._store(key, [self._views.view(ptr, n) for ptr, n in blocks], blocks) for key, blocks in zip(keys, regions)]

    def clear(self) -> None:
        """Remove every page file of the directory (other files are left alone), after a write in
        flight has renamed its page."""
        with self._write_lock, self._lock:
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
