"""The storage tier's interface: SGLang's ``HiCacheStorage``, with the exact semantics every kvpool
backend keeps (docs/contract.md, "Storage tier").

A storage backend holds KV pages below the host tier, under string keys (the page keys of
:mod:`kvpool.storage.keys`). A page is the bytes of one host page of every layer, in the flat form
of the host pool's ``get_data_page(index)``: K's bytes, then V's, each in the host layout's order.
Backends treat keys as opaque: they store a page under the pair (their namespace, the key), where
the namespace (:func:`kvpool.storage.keys.key_namespace`) names the model, the rank and the page
geometry, so that engines of another model, rank or layout sharing one store never read each
other's pages.

Rules every backend keeps:

- **A miss is never data.** A page that is absent, of another size, torn, corrupted, or stored under
  another (namespace, key) reads as a miss (``None`` / ``False``), counted in :class:`StorageStats`.
- **Bad input raises before anything is written or read**: ``ValueError`` naming the argument, the
  expected and the actual value. A key is a non-empty ``str``.
- **Storage failures are results, not exceptions**: an I/O error, a full store or an unreachable
  server makes ``set`` return False and ``get`` return None; the caller backs off. What a failed
  write leaves under its key is what was there before (nothing, or the earlier whole page).
- **Thread safety**: one backend may be called from several threads at once (SGLang's prefetch and
  backup threads); the host pool itself is only touched through its public page calls.

``HiRadixCache``'s storage tier (``kvpool.cache.storage_tier``) calls ``register_mem_pool_host``
once, then, from its worker threads, ``batch_set(keys, pages)`` (pages: 1-D CPU tensors in the flat
data-page form), ``batch_exists(keys)`` and ``get(key, page)`` (``page``: a 1-D uint8 CPU tensor of
one page's bytes), so those must work in every backend.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import Any, Optional, Sequence

import torch

from kvpool.checks import INDEX_DTYPES, check_index, is_int


@dataclasses.dataclass(frozen=True)
class HiCacheStorageConfig:
    """Who is storing (SGLang's ``HiCacheStorageConfig``; same fields, same order).

    Parameters
    ----------
    tp_rank, tp_size : tensor-parallel rank (``0 <= tp_rank < tp_size``) and world size. Each rank of
        an MHA model holds its own heads, so its pages are its own; an MLA model's pages are the same
        on every rank, and the rank is left out of the namespace.
    pp_rank, pp_size : pipeline-parallel rank and size (each stage holds its own layers).
    is_mla_model : the device pool is an ``MLATokenToKVPool``.
    is_page_first_layout : the host pool's layout is ``"page_first"``.
    model_name : any string naming the weights (a path, a hub name), or None.
    extra_config : backend options (a dict), or None.

    Raises
    ------
    ValueError
        A rank outside its size, a size below 1, a non-bool flag, a ``model_name`` that is not a str
        or None, an ``extra_config`` that is not a dict or None.

    Examples
    --------
    >>> HiCacheStorageConfig(tp_rank=0, tp_size=2, model_name="meta-llama/Llama-3-8B")
    """

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    is_mla_model: bool = False
    is_page_first_layout: bool = False
    model_name: Optional[str] = None
    extra_config: Optional[dict] = None

    def __post_init__(self) -> None:
        for rank, size in (("tp_rank", "tp_size"), ("pp_rank", "pp_size")):
            r, s = getattr(self, rank), getattr(self, size)
            if not is_int(s) or s < 1:
                raise ValueError(f"{size} must be an int >= 1, got {s!r}")
            if not is_int(r) or not 0 <= r < s:
                raise ValueError(f"{rank} must be an int in 0..{s - 1}, got {r!r}")
        for flag in ("is_mla_model", "is_page_first_layout"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        if self.model_name is not None and not isinstance(self.model_name, str):
            raise ValueError(f"model_name must be a str or None, got {type(self.model_name).__name__}")
        if self.extra_config is not None and not isinstance(self.extra_config, dict):
            raise ValueError(f"extra_config must be a dict or None, got {type(self.extra_config).__name__}")


@dataclasses.dataclass
class HiCacheStorageExtraInfo:
    """What SGLang's controller passes beside a batch: the keys of the pages before it
    (``prefix_keys``) and backend-specific data. kvpool's backends accept it and need none of it."""

    prefix_keys: Optional[list[str]] = None
    extra_info: Optional[dict] = None


@dataclasses.dataclass
class StorageStats:
    """Counters of one backend since it was made (``get_stats()`` returns a copy).

    hits, misses : pages read (``get`` returned data, a ``*_v1`` entry True) / not found.
    corrupt : reads of a page that was there but failed its check (torn, corrupted, another key's);
        each is also a miss. A good page of another size than the reader's target is a miss only.
    writes, write_failures : pages stored / ``set`` calls that could not store their page (skips of a
        page already stored count as writes).
    evictions : pages the backend dropped to stay within its bound.
    pages, bytes : what it holds now (as far as it knows).
    """

    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    writes: int = 0
    write_failures: int = 0
    evictions: int = 0
    pages: int = 0
    bytes: int = 0


class HiCacheStorage(ABC):
    """A key-value store of KV pages (SGLang 0.5.9's ``HiCacheStorage``: the same method names,
    arguments and results).

    Subclasses implement ``get``, ``batch_get``, ``set``, ``batch_set``, ``exists``, ``clear``,
    ``get_stats``, and the host-index forms ``batch_get_v1`` / ``batch_set_v1``; ``batch_exists`` and
    ``register_mem_pool_host`` have working defaults. The argument checks every backend makes are
    here too (:meth:`check_key`, :meth:`check_keys`, :meth:`host_page_starts`), so all backends
    refuse the same input with the same message.
    """

    mem_pool_host: Any = None

    # --- the host pool -------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Attach the host pool whose pages the ``*_v1`` forms read and write (an
        ``MHATokenToKVPoolHost`` or ``MLATokenToKVPoolHost``). Call it once, before the first
        ``*_v1`` call and before any page is stored: a backend may fold the pool's page geometry
        (dtype, page size, layers, heads, layout) into its namespace, so pages stored before it are
        not found after it.

        Raises
        ------
        ValueError
            ``mem_pool_host`` lacks the host pool's page calls (``get_data_page``,
            ``set_from_flat_data_page``, ``page_size``, ``page_bytes``, ``size``).
        """
        for name in ("get_data_page", "set_from_flat_data_page", "page_size", "page_bytes", "size"):
            if not hasattr(mem_pool_host, name):
                raise ValueError(
                    f"mem_pool_host must be a kvpool host pool (MHATokenToKVPoolHost), got "
                    f"{type(mem_pool_host).__name__} (no .{name})"
                )
        self.mem_pool_host = mem_pool_host

    # --- pages by host index (the forms a cache uses) ------------------------------------------------

    @abstractmethod
    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Optional[HiCacheStorageExtraInfo] = None
    ) -> list[bool]:
        """Read page ``keys[i]`` into host page ``i`` of ``host_indices``.

        ``host_indices``: a 1-D int32/int64 CPU tensor of ``len(keys) * page_size`` host slots, whole
        pages of the registered host pool in range (as its ``alloc`` hands them out); page ``i`` is
        ``host_indices[i * page_size:(i + 1) * page_size]``. Returns one bool per key: True when that
        host page now holds exactly the stored page (as ``set_from_flat_data_page`` would write it);
        False for a miss (absent, torn, corrupted, another size, another key's page, or a storage
        failure), after which that host page's bytes are unspecified (the caller frees or overwrites
        it) and no other host page is touched. Entries are independent: a miss does not stop the
        later keys (a caller that needs a prefix stops at the first False itself).

        Raises
        ------
        RuntimeError
            No host pool registered.
        ValueError
            A key that is not a non-empty str, ``host_indices`` not such a tensor or not
            ``len(keys)`` whole pages; before any page is read.
        """

    @abstractmethod
    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Optional[HiCacheStorageExtraInfo] = None
    ) -> list[bool]:
        """Store host page ``i`` of ``host_indices`` under ``keys[i]`` (the page's bytes as the host
        pool's ``get_data_page`` returns them).

        ``host_indices`` as in :meth:`batch_get_v1`. Returns one bool per key: True when the page is
        stored (or a page was already stored under that key: keys name their content, so it is not
        written again), False when it could not be (the store is full, an I/O error, a page larger
        than the store's bound). A False leaves under that key what was there before. Entries are
        independent.

        Raises
        ------
        RuntimeError
            No host pool registered.
        ValueError
            As :meth:`batch_get_v1`, before anything is written.
        """

    #: Whether :meth:`batch_get_regions` reads pages into caller-given host memory (False: it raises).
    reads_into_regions: bool = False

    def batch_get_regions(self, keys: list[str], regions: list[list[tuple[int, int]]]) -> list[bool]:
        """Read page ``keys[i]`` into the host memory ``regions[i]`` names: ``(address, size)``
        blocks, in the flat page order (as :meth:`host_page_regions` gives them), which the caller
        owns and nothing else touches until the call returns. Returns one bool per key, as
        :meth:`batch_get_v1` (a False leaves that page's blocks unspecified, no other memory
        touched). It never touches the host pool itself, so a worker thread may call it. Only a
        backend whose ``reads_into_regions`` is True implements it.

        Raises
        ------
        NotImplementedError
            ``reads_into_regions`` is False.
        ValueError
            Bad keys, or ``regions`` not a list of one list of ``(int address > 0, int size >= 0)``
            per key; before any page is read.
        """
        raise NotImplementedError(f"{type(self).__name__} does not read into host regions (reads_into_regions is False)")

    @staticmethod
    def check_regions(regions: object, count: int) -> list[list[tuple[int, int]]]:
        """``regions`` of a :meth:`batch_get_regions` call over ``count`` keys, as lists of tuples;
        ValueError naming the first bad entry otherwise."""
        if not isinstance(regions, (list, tuple)) or len(regions) != count:
            got = f"{len(regions)} entries" if isinstance(regions, (list, tuple)) else type(regions).__name__
            raise ValueError(f"regions must be a list of {count} entries (one per key), got {got}")
        out = []
        for i, blocks in enumerate(regions):
            if not isinstance(blocks, (list, tuple)):
                raise ValueError(f"regions[{i}] must be a list of (address, size) blocks, got {type(blocks).__name__}")
            page = []
            for j, b in enumerate(blocks):
                ok = isinstance(b, tuple) and len(b) == 2 and all(type(x) is int for x in b)
                if not ok or b[0] <= 0 or b[1] < 0:
                    raise ValueError(f"regions[{i}][{j}] must be an (int address > 0, int size >= 0) tuple, got {b!r}")
                page.append(b)
            out.append(page)
        return out

    # --- pages as tensors (SGLang's generic forms) ----------------------------------------------------

    @abstractmethod
    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None) -> Optional[torch.Tensor]:
        """The page stored under ``key``, or None for a miss (as :meth:`batch_get_v1`).

        ``target_location``: None, or a contiguous CPU tensor (any dtype) whose byte size is the
        page's: the page's bytes are read into it and it is returned; a page of another size is a
        miss. Without it a new 1-D uint8 CPU tensor of the page's bytes is returned. A backend that
        also reads into raw host addresses takes ``target_location`` as an int address and
        ``target_sizes`` as its byte count (documented by that backend); others raise ValueError for
        it. On a miss the target's bytes are unspecified.

        Raises
        ------
        ValueError
            A key that is not a non-empty str; a ``target_location`` of another kind (not contiguous,
            not on the CPU).
        """

    @abstractmethod
    def batch_get(
        self, keys: list[str], target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None
    ) -> list[Optional[torch.Tensor]]:
        """:meth:`get` for each key: ``target_locations`` None or a list as long as ``keys`` (same for
        ``target_sizes``); returns a list as long as ``keys``, a tensor or None per key. Every
        argument is checked before any page is read (ValueError)."""

    @abstractmethod
    def set(
        self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None
    ) -> bool:
        """Store ``value`` (a CPU tensor of any dtype and shape; its bytes in row-major order are the
        page) under ``key``. True when stored, or when a page is already stored under ``key`` (not
        written again); False when it could not be stored (as :meth:`batch_set_v1`), leaving what was
        there before. A backend that writes from raw host addresses takes ``target_location`` /
        ``target_sizes`` instead of ``value`` (documented by that backend); others raise ValueError
        for them.

        Raises
        ------
        ValueError
            A key that is not a non-empty str; ``value`` not a CPU tensor; before anything is written.
        """

    @abstractmethod
    def batch_set(
        self, keys: list[str], values: Optional[Any] = None, target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None
    ) -> bool:
        """:meth:`set` for each key in order: ``values`` a list as long as ``keys``. True when every
        page is stored; at the first page that cannot be, stops and returns False (the pages before it
        stay stored). Every argument is checked before any page is written (ValueError)."""

    # --- presence ----------------------------------------------------------------------------------

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether a page is stored under ``key``. Cheap (no payload read): a page that exists may
        still read as a miss if it is corrupted, or be evicted before it is read. ValueError for a
        key that is not a non-empty str."""

    def batch_exists(self, keys: list[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """The number of leading keys that exist (``keys[:n]`` all exist, ``keys[n]`` does not): how
        much of a prefix storage holds. Checks every key first (ValueError)."""
        self.check_keys(keys, "keys")
        for i, key in enumerate(keys):
            if not self.exists(key):
                return i
        return len(keys)

    # --- housekeeping --------------------------------------------------------------------------------

    @abstractmethod
    def clear(self) -> None:
        """Drop every page this backend can drop (the file backend: every page file of its directory;
        a shared store: this backend's namespace)."""

    @abstractmethod
    def get_stats(self) -> StorageStats:
        """A copy of the backend's counters (:class:`StorageStats`)."""

    def close(self) -> None:
        """Release connections and threads (SGLang calls it when storage is detached). Default: nothing."""

    # --- the checks every backend makes ----------------------------------------------------------------

    @staticmethod
    def check_key(key: object, name: str = "key") -> str:
        """``key`` if it is a non-empty str, else ValueError naming ``name``."""
        if not isinstance(key, str) or not key:
            raise ValueError(f"{name} must be a non-empty str, got {key!r}")
        return key

    @staticmethod
    def check_keys(keys: object, name: str = "keys") -> list[str]:
        """``keys`` as a list if it is a list or tuple of non-empty strs, else ValueError naming
        ``name`` and the first bad entry."""
        if not isinstance(keys, (list, tuple)):
            raise ValueError(f"{name} must be a list of str, got {type(keys).__name__}")
        for i, key in enumerate(keys):
            HiCacheStorage.check_key(key, f"{name}[{i}]")
        return list(keys)

    @staticmethod
    def check_batch(items: object, name: str, count: int) -> Optional[list]:
        """``items`` (None, or a list/tuple of ``count`` entries) as a list or None; ValueError naming
        ``name`` otherwise."""
        if items is None:
            return None
        if not isinstance(items, (list, tuple)) or len(items) != count:
            got = f"{len(items)} entries" if isinstance(items, (list, tuple)) else type(items).__name__
            raise ValueError(f"{name} must be None or a list of {count} entries (one per key), got {got}")
        return list(items)

    def check_target(self, target: object, size: object, name: str) -> Optional[torch.Tensor]:
        """A ``get``'s ``target_location`` (None, or a contiguous CPU tensor to read the page into)
        with its ``target_sizes`` None (backends that read into tensors take no sizes); ValueError
        naming ``name`` (or its ``sizes`` twin) otherwise."""
        backend = type(self).__name__
        if size is not None:
            raise ValueError(f"{name.replace('location', 'sizes')} must be None ({backend} reads into tensors), got {size!r}")
        if target is None:
            return None
        if not isinstance(target, torch.Tensor):
            raise ValueError(f"{name} must be None or a CPU tensor ({backend} reads into tensors), got {type(target).__name__}")
        if target.device.type != "cpu" or not target.is_contiguous():
            raise ValueError(f"{name} must be a contiguous CPU tensor, got device {target.device}, contiguous {target.is_contiguous()}")
        return target

    def host_page_starts(self, keys: Sequence[str], host_indices: object) -> list[int]:
        """The first host slot of each page of ``host_indices`` for a ``*_v1`` call over ``keys``,
        after every check (see :meth:`batch_get_v1`'s Raises)."""
        host = self.mem_pool_host
        if host is None:
            raise RuntimeError("no host pool registered: call register_mem_pool_host(host_pool) first")
        self.check_keys(keys, "keys")
        ps = host.page_size
        check_index(
            host_indices, "host_indices", device=torch.device("cpu"), dtypes=INDEX_DTYPES, length=len(keys) * ps,
            per=f"{ps} host slots per key",
        )  # fmt: skip
        if isinstance(host_indices, torch.Tensor) and host_indices.numel() == 0:
            return []
        pages = host_indices.to(torch.int64).reshape(-1, ps)  # type: ignore[union-attr]
        starts = pages[:, 0]
        bad = (starts < 0) | (starts >= host.size) | (starts % ps != 0)
        bad |= (pages != starts[:, None] + torch.arange(ps)).any(dim=1)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"host_indices must be whole host pages ({ps} consecutive slots from a multiple of {ps} below "
                f"{host.size}): page {i} is {pages[i].tolist()[:8]}"
            )
        return starts.tolist()

    def host_page_regions(self, keys: Sequence[str], host_indices: object) -> list[list[tuple[int, int]]]:
        """Per page of ``host_indices`` (after :meth:`host_page_starts`'s checks): its ``(address, size)``
        blocks in the host buffers, in the flat page order (every layer's K, then every layer's V; a
        host pool with scales beside its codes: every layer of each part in turn), for I/O straight to
        and from the host pool. Waits for the host pool's transfers in flight."""
        self.host_page_starts(keys, host_indices)
        if not keys:
            return []
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        per = len(ptrs) // len(keys)
        parts = len(getattr(self.mem_pool_host, "buffers", (None, None)))  # K and V, or every part
        regions = []
        for i in range(len(keys)):
            blocks = list(zip(ptrs[i * per : (i + 1) * per], sizes[i * per : (i + 1) * per]))
            regions.append([b for j in range(parts) for b in blocks[j::parts]])  # the meta cycles through the parts
        return regions
