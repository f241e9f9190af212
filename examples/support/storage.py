"""What the examples share for a storage tier below the host tier (``--storage file|mooncake``): the
command-line options, the checked ``StorageOptions`` they make, and ``StorageSite``, the place the
pages live for one run and the backends that engines open on it.

- ``file``: a ``HiCacheFile`` directory, ``--storage-dir`` or a fresh temporary one (owner-only)
  removed when the site closes.
- ``mooncake``: a ``MooncakeStore`` client per engine; the site starts its own ``mooncake_master``
  (every port on 127.0.0.1) and stops it by its process id when it closes, or joins the master
  given by ``--mooncake-master`` and ``--mooncake-metadata``.

With ``--storage-faults P`` each backend is wrapped in a ``FaultyStorage`` that fails, raises, cuts
short and delays its calls, each at probability P, seeded, so a run shows that a cache loses no data
whatever its storage does.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Optional

from kvpool.cache.storage_tier import StoragePolicy
from kvpool.storage import HiCacheFile, HiCacheStorageConfig, MooncakeStore
from kvpool.storage.faults import FaultyStorage
from kvpool.storage.mooncake_config import import_store_class
from kvpool.storage.mooncake_master import MooncakeMaster

BACKENDS = ("file", "mooncake")
#: What one Mooncake client lends the store and buffers: far more than an example's pages.
MOONCAKE_SEGMENT_BYTES = 64 << 20
#: The file directory's bound: far more than an example's pages.
FILE_MAX_BYTES = 1 << 30
#: A delayed call sleeps this long (long enough to reorder the worker threads' calls, short enough
#: for a CPU run).
FAULT_DELAY_S = 0.002


@dataclass(frozen=True)
class StorageOptions:
    """A run's storage tier, as the command line gives it.

    Parameters
    ----------
    backend : ``"file"`` or ``"mooncake"``.
    directory : the file backend's directory (None: a fresh temporary one).
    master, metadata : an existing Mooncake master's RPC address (``host:port``) and metadata URL,
        both or neither (neither: the run starts its own on 127.0.0.1).
    faults : the probability of each injected fault (0: none).
    seed : seeds the injected faults.
    """

    backend: str
    directory: Optional[str] = None
    master: Optional[str] = None
    metadata: Optional[str] = None
    faults: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"--storage must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.directory is not None and self.backend != "file":
            raise ValueError(f"--storage-dir is the file backend's directory: needs --storage file, got --storage {self.backend}")
        if (self.master is None) != (self.metadata is None):
            raise ValueError(
                "--mooncake-master and --mooncake-metadata join a running master together: give both or neither, "
                f"got --mooncake-master {self.master!r} --mooncake-metadata {self.metadata!r}"
            )
        if self.master is not None and self.backend != "mooncake":
            raise ValueError(f"--mooncake-master needs --storage mooncake, got --storage {self.backend}")
        f = self.faults
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0:
            raise ValueError(f"--storage-faults must be a probability in [0, 1], got {f!r}")

    def describe(self) -> str:
        if self.backend == "file":
            where = self.directory or "a temporary directory"
        else:
            where = f"master {self.master}" if self.master else "its own mooncake_master on 127.0.0.1"
        faults = f", faults injected at p={self.faults:g} (seed {self.seed})" if self.faults else ""
        return f"{self.backend} ({where}){faults}"


def add_storage_arguments(p: argparse.ArgumentParser) -> None:
    """``--storage`` and its options (they need ``--prefix-cache --host-tier``)."""
    p.add_argument("--storage", choices=BACKENDS, default=None,
                   help="a storage tier below the host tier (needs --prefix-cache --host-tier)")  # fmt: skip
    p.add_argument("--storage-dir", default=None,
                   help="--storage file: the page directory (default: a fresh temporary one, removed at exit)")  # fmt: skip
    p.add_argument("--mooncake-master", default=None, metavar="HOST:PORT",
                   help="--storage mooncake: join this master (default: start one on 127.0.0.1, stopped at exit)")  # fmt: skip
    p.add_argument("--mooncake-metadata", default=None, metavar="URL",
                   help="--storage mooncake: the joined master's metadata server, http://host:port/metadata")  # fmt: skip
    p.add_argument("--storage-faults", type=float, default=0.0, metavar="P",
                   help="wrap the store in a failure injector: failures, errors, short reads and delays, each at probability P")  # fmt: skip


def storage_options(a: argparse.Namespace, seed: int) -> Optional[StorageOptions]:
    """The ``StorageOptions`` of parsed ``add_storage_arguments`` options (None without ``--storage``)."""
    if a.storage is None:
        given = [f for f, v in (("--storage-dir", a.storage_dir), ("--mooncake-master", a.mooncake_master),
                                ("--mooncake-metadata", a.mooncake_metadata)) if v is not None]  # fmt: skip
        if a.storage_faults:
            given.append("--storage-faults")
        if given:
            verb = "need" if len(given) > 1 else "needs"
            raise ValueError(f"{', '.join(given)} {verb} --storage file or --storage mooncake, got no --storage")
        return None
    return StorageOptions(a.storage, a.storage_dir, a.mooncake_master, a.mooncake_metadata, a.storage_faults, seed)


def storage_policy(page_size: int) -> StoragePolicy:
    """How the examples' caches use storage: worker threads; a prefetch of one page or more, held
    until every page is read (``wait_complete``, so a run's hits do not depend on thread timing);
    after a failure a short pause (a CPU run is short)."""
    return StoragePolicy(prefetch_policy="wait_complete", prefetch_threshold=page_size, backoff_s=0.001, max_backoff_s=0.01)


class StorageSite:
    """Where one run's pages live, and the backends its engines open there (closed with the site).

    Use it as a context manager: entering makes the directory or starts the master, leaving closes
    every backend opened, then stops the master it started and removes the temporary directory.

    Raises
    ------
    ImportError
        ``mooncake`` when Mooncake Store cannot be imported (the message says what to install).
    ConnectionError, RuntimeError, FileNotFoundError
        The master could not be started or reached.
    """

    def __init__(self, options: StorageOptions) -> None:
        self.options = options
        self.directory: Optional[str] = None
        self.master: Optional[MooncakeMaster] = None
        self.stores: list[Any] = []
        self._temporary = False
        self._opened = 0

    def __enter__(self) -> "StorageSite":
        o = self.options
        try:
            if o.backend == "file":
                self._temporary = o.directory is None
                self.directory = tempfile.mkdtemp(prefix="kvpool-example-pages-") if self._temporary else o.directory
            elif o.master is None:
                import_store_class()  # a missing Mooncake fails here, before a master is started
                self.master = MooncakeMaster().start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self, model_name: str, page_first: bool = False) -> Any:
        """A new backend on the site for one engine's cache, its pages under ``model_name`` (which
        names the weights and how they are stored: pages of another pool dtype or scale never mix);
        ``page_first``: the host pool's layout is ``"page_first"``."""
        o = self.options
        config = HiCacheStorageConfig(model_name=model_name, is_page_first_layout=page_first)
        if o.backend == "file":
            store: Any = HiCacheFile(config, self.directory, max_bytes=FILE_MAX_BYTES)
        else:
            master = self.master.master_server_address if self.master is not None else o.master
            metadata = self.master.metadata_server if self.master is not None else o.metadata
            store = MooncakeStore(
                config, master_server_address=master, metadata_server=metadata,
                global_segment_size=MOONCAKE_SEGMENT_BYTES, local_buffer_size=MOONCAKE_SEGMENT_BYTES,
            )  # fmt: skip
        self.stores.append(store)  # a Mooncake client's pages live in its segment: it stays open with the site
        if o.faults:
            p = o.faults
            self._opened += 1
            store = FaultyStorage(store, seed=o.seed * 1000 + self._opened, delay_rate=p, delay_s=FAULT_DELAY_S,
                                  raise_rate=p, fail_rate=p, short_rate=p)  # fmt: skip
            self.stores.append(store)
        return store

    def faults(self) -> dict[str, int]:
        """The faults injected so far into every backend of the site, by kind (``KINDS`` of
        ``kvpool.storage.faults``)."""
        out: dict[str, int] = {}
        for s in self.stores:
            for _, _, kind in s.log if isinstance(s, FaultyStorage) else []:
                out[kind] = out.get(kind, 0) + 1
        return out

    def close(self) -> None:
        stores, self.stores = self.stores, []
        for s in stores:
            if not isinstance(s, FaultyStorage):
                s.close()
        if self.master is not None:
            self.master.stop()
            self.master = None
        if self._temporary and self.directory is not None and os.path.isdir(self.directory):
            shutil.rmtree(self.directory, ignore_errors=True)
        self._temporary = False
