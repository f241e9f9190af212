"""``MooncakeStore``: KV pages in a Mooncake Store shared by engines on several machines (SGLang's
name; the rules are docs/contract.md, "Storage tier").

Every engine runs a store client that lends ``global_segment_size`` bytes of its memory to the
store; one ``mooncake_master`` (with its HTTP metadata server, see
:mod:`kvpool.storage.mooncake_master`) places pages in those segments. A page is one store object
laid out exactly as a page file of the file backend (:mod:`kvpool.storage.record`: header, the name
it belongs to, payload, checksums over all three), under the store key ``kvpool-<namespace digest>-<page
digest>`` (digests only, never caller text). Every read checks header, name, size and checksums, so a
read never returns another prefix's or another namespace's page.

The host-index forms move pages between the store and the registered host pool without a copy: the
host pool's buffers are registered with the client, and each page travels as its header (from a small
staging buffer) followed by the host pool's K and V blocks, in the flat page order.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
import threading
import time
from typing import Any, Optional

import numpy as np
import torch

from kvpool.storage.base import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo, StorageStats
from kvpool.storage.keys import key_namespace, storage_digest, storage_name
from kvpool.storage.mooncake_config import (
    OBJECT_NOT_FOUND,
    RPC_FAIL,
    MooncakeConfig,
    check_reachable,
    import_store_class,
    pin_transport_address,
)
from kvpool.storage.mooncake_master import port_open
from kvpool.storage.mooncake_memory import RegisteredMemory
from kvpool.storage.record import checksum_of_regions, pack_header, parse_header, payload_offset

log = logging.getLogger(__name__)


#: A batch travels in up to 4 calls of at least this many bytes each, so that one call's pages are
#: checksummed while the next call's travel (a call has a fixed cost, more than a smaller call's overlap gains).
PIPELINE_BYTES = 32 << 20


def _groups(regions: list[list[tuple[int, int]]], split_repeats: bool) -> list[range]:
    """``range(len(regions))`` in consecutive groups, one call each: up to 4 of about equal size and
    :data:`PIPELINE_BYTES` or more; with ``split_repeats`` (a read), a new group also before a page
    whose memory an earlier page of its group names, so that one is checked before the other lands."""
    n = len(regions)
    k = max(1, min(4, n, sum(size for r in regions for _, size in r) // PIPELINE_BYTES))
    cuts, groups, start, seen = {n * g // k for g in range(1, k)}, [], 0, set()
    for i, r in enumerate(regions):
        first = r[0][0] if r else None
        if i > start and (i in cuts or (split_repeats and first in seen)):
            groups.append(range(start, i))
            start, seen = i, set()
        if r:
            seen.add(first)
    return groups + [range(start, n)] if n > start else groups


class MooncakeStore(HiCacheStorage):
    """KV pages in a Mooncake Store (SGLang's ``MooncakeStore``; the interface is
    :class:`~kvpool.storage.base.HiCacheStorage`).

    Parameters
    ----------
    storage_config : who is storing (:class:`~kvpool.storage.base.HiCacheStorageConfig`; None is the
        default). Its ``extra_config``, when it gives ``master_server_address`` and
        ``metadata_server``, supplies the :class:`MooncakeConfig` fields.
    mem_pool_host : a host pool to register at once (SGLang passes it second), or None.
    mooncake_config : a :class:`MooncakeConfig` (instead of ``extra_config``).
    **settings : :class:`MooncakeConfig` fields, over either of the above.

    Raises
    ------
    ValueError
        Bad settings, or none given.
    ImportError
        Mooncake Store is not installed or cannot load (the message says what to install).
    ConnectionError
        The master or the metadata server does not accept connections within
        ``connect_timeout_s``, or the client's setup fails (before any page moves).

    ``global_segment_size`` is what this client (one rank) lends; SGLang's backend divides its setting
    by ``tp_size`` instead. Several threads may use one instance at once. Once the master stops answering, reads are misses
    and writes False (counted, and ``last_error`` says why) without waiting on the network, and the
    master is probed again every ``retry_interval_s``; a master that comes back (empty, if it was
    restarted) serves again. Mooncake's master and client listen on more than the given addresses
    (see the README's "Storage tier: Mooncake"): keep the store on a trusted network.

    Examples
    --------
    >>> store = MooncakeStore(HiCacheStorageConfig(model_name="llama"),
    ...                       master_server_address="10.0.0.5:50051",
    ...                       metadata_server="http://10.0.0.5:8080/metadata", local_hostname="10.0.0.7")
    >>> store.register_mem_pool_host(host_pool)
    >>> store.batch_set_v1(page_keys(token_ids, host_pool.page_size), host_slots)
    """

    def __init__(
        self,
        storage_config: Optional[HiCacheStorageConfig] = None,
        mem_pool_host: Any = None,
        *,
        mooncake_config: Optional[MooncakeConfig] = None,
        **settings: Any,
    ) -> None:
        if storage_config is None:
            storage_config = HiCacheStorageConfig()
        if not isinstance(storage_config, HiCacheStorageConfig):
            raise ValueError(f"storage_config must be a HiCacheStorageConfig or None, got {type(storage_config).__name__}")
        if mooncake_config is not None and not isinstance(mooncake_config, MooncakeConfig):
            raise ValueError(f"mooncake_config must be a MooncakeConfig or None, got {type(mooncake_config).__name__}")
        unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(MooncakeConfig)})
        if unknown:
            raise ValueError(f"settings must be MooncakeConfig fields, got unknown {', '.join(unknown)}")
        if mooncake_config is None:
            mooncake_config = MooncakeConfig.from_dict({**(storage_config.extra_config or {}), **settings})
        elif settings:
            mooncake_config = dataclasses.replace(mooncake_config, **settings)
        self.storage_config, self.config = storage_config, mooncake_config
        self._set_namespace(key_namespace(storage_config))
        self._lock = threading.Lock()
        self._stats = StorageStats()
        self._down_until: Optional[float] = None
        self.last_error: Optional[str] = None

        store_class = import_store_class()
        check_reachable(self.config)
        if self.config.protocol == "tcp":
            pin_transport_address(self.config)
        self.store = store_class()
        c = self.config
        rc = self.store.setup(
            c.local_hostname, c.metadata_server, c.global_segment_size, c.local_buffer_size, c.protocol,
            c.device_name, c.master_server_address,
        )  # fmt: skip
        self.memory = RegisteredMemory(self.store)
        if rc != 0:
            raise ConnectionError(
                f"Mooncake Store setup failed with code {rc} (master {c.master_server_address}, metadata "
                f"{c.metadata_server}, local_hostname {c.local_hostname}, protocol {c.protocol})"
            )
        if mem_pool_host is not None:
            self.register_mem_pool_host(mem_pool_host)

    # --- naming --------------------------------------------------------------------------------------

    def _set_namespace(self, namespace: str) -> None:
        self.namespace = namespace
        self.key_prefix = "kvpool-" + hashlib.sha256(namespace.encode("utf-8", "surrogatepass")).hexdigest()[:32] + "-"

    def store_key(self, key: str) -> str:
        """The store key page ``key`` lives under in this namespace."""
        return self.key_prefix + storage_digest(self.namespace, key)

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """As the interface says; the namespace takes in the host pool's page geometry, and the host
        pool's buffers are registered with the client for zero-copy page moves."""
        if self.store is None:
            raise RuntimeError("this MooncakeStore is closed")
        super().register_mem_pool_host(mem_pool_host)
        self._set_namespace(key_namespace(self.storage_config, mem_pool_host))
        buffers = getattr(mem_pool_host, "buffers", None)  # every part of a pool with scales beside its codes
        self.memory.set_host(list(buffers) if buffers is not None else [mem_pool_host.k_buffer, mem_pool_host.v_buffer])

    # --- reachability ----------------------------------------------------------------------------------

    def _usable(self) -> bool:
        """False while the master is known to be down (no network wait); probes it once the retry
        interval has passed."""
        if self.store is None:
            raise RuntimeError("this MooncakeStore is closed")
        with self._lock:
            until = self._down_until
            if until is None:
                return True
            if time.monotonic() < until:
                return False
            self._down_until = time.monotonic() + self.config.retry_interval_s
        if port_open(*self.config.master_host_port(), timeout=self.config.connect_timeout_s):
            with self._lock:
                self._down_until = None
            log.info("Mooncake master %s answers again", self.config.master_server_address)
            return True
        return False

    def _failed(self, code: int, what: str) -> None:
        """Note a failure code; RPC failures mark the master as down for the retry interval."""
        self.last_error = f"{what} failed with Mooncake code {code}"
        if code == RPC_FAIL:
            with self._lock:
                first = self._down_until is None
                self._down_until = time.monotonic() + self.config.retry_interval_s
            if first:
                log.warning(
                    "Mooncake master %s does not answer (%s): reads miss and writes fail until it does",
                    self.config.master_server_address, self.last_error,
                )  # fmt: skip

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, d in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + d)

    # --- records -----------------------------------------------------------------------------------------

    def _drop_corrupt(self, skey: str) -> None:
        # Removed so the next write of the key stores a good page; force skips the read lease.
        self.store.remove(skey, True)

    # --- the two moves: objects from and into registered memory -------------------------------------

    def _put(self, keys: list[str], regions: list[list[tuple[int, int]]], stop_at_failure: bool = False) -> list[bool]:
        """Store page ``keys[i]`` from the registered memory ``regions[i]`` (its payload's ``(address,
        size)`` blocks in order) in one batch (up to 4 calls of :data:`PIPELINE_BYTES` or more, a call's pages sent while the next ones'
        checksums are computed), each object its header (from a staging buffer) and
        then those blocks; keys already stored are not sent again. With ``stop_at_failure`` pages
        after the first that fails are not left stored (``batch_set``'s rule)."""
        if not self._usable():
            self._count(write_failures=len(keys))
            return [False] * len(keys)
        skeys = [self.store_key(k) for k in keys]
        present = self.store.batch_is_exist(skeys)
        if any(p < 0 for p in present):
            self._failed(min(present), "batch_is_exist")
            self._count(write_failures=len(keys))
            return [False] * len(keys)
        done = [p == 1 for p in present]
        todo = [i for i, p in enumerate(present) if p != 1]
        if not todo:
            self._count(writes=len(keys))
            return done
        names = [storage_name(self.namespace, keys[i]) for i in todo]
        # Every page's checksum started at once, on the checksum threads (``value()`` waits).
        jobs = [checksum_of_regions(name, regions[i]) for name, i in zip(names, todo)]
        heads: list[bytes] = []
        codes: list[int] = []
        try:
            with self.memory.staging(sum(payload_offset(len(n)) for n in names)) as staging:
                at = 0
                # In groups: a group is sent while the checksum threads go on with the next ones.
                for group in _groups([regions[i] for i in todo], split_repeats=False):
                    ptrs, sizes = [], []
                    for g in group:
                        i, h = todo[g], pack_header(names[g], jobs[g].payload_len, jobs[g].value())
                        heads.append(h)
                        staging[at : at + len(h)] = np.frombuffer(h, dtype=np.uint8)
                        ptrs.append([staging.ctypes.data + at] + [ptr for ptr, _ in regions[i]])
                        sizes.append([len(h)] + [n for _, n in regions[i]])
                        at += len(h)
                    codes += self.store.batch_put_from_multi_buffers([skeys[todo[g]] for g in group], ptrs, sizes)
                    if stop_at_failure and any(c != 0 for c in codes):
                        break
        finally:
            for job in jobs[len(codes) :]:  # not sent: no thread may still read their regions
                job.wait()
        todo = todo[: len(codes)]
        code_of = dict(zip(todo, codes))
        failed = [i for i in todo if code_of[i] != 0]
        end = len(keys)  # the entries this call answers for
        if failed:
            self._failed(code_of[failed[0]], "batch_put_from_multi_buffers")
            if stop_at_failure:
                end = failed[0] + 1
                later = [i for i in todo if i >= end and code_of[i] == 0]
                if later:  # stored beside the failure in the same batch: not left stored
                    self.store.batch_remove([skeys[i] for i in later], True)
        stored = [(i, h) for i, h in zip(todo, heads) if code_of[i] == 0 and i < end]
        for i, _ in stored:
            done[i] = True
        done[end:] = [False] * (len(keys) - end)
        self._count(pages=len(stored), bytes=sum(len(h) + sum(n for _, n in regions[i]) for i, h in stored))
        self._count(writes=sum(done), write_failures=sum(1 for i in failed if i < end))
        return done

    def _get(self, keys: list[str], regions: list[list[tuple[int, int]]]) -> list[bool]:
        """Read page ``keys[i]`` into the registered memory ``regions[i]`` in one batch and check it
        there (in the calls :func:`_groups` makes, a call's pages checked while the next ones are read): True where
        the record is whole, of that size, names the key and its checksum agrees. A
        record that fails its check is removed from the store; its regions' bytes are unspecified."""
        if not self._usable():
            self._count(misses=len(keys))
            return [False] * len(keys)
        skeys = [self.store_key(k) for k in keys]
        names = [storage_name(self.namespace, k) for k in keys]
        lens = [payload_offset(len(n)) for n in names]
        offsets = np.cumsum([0] + lens[:-1]).tolist()
        payload_lens = [sum(n for _, n in r) for r in regions]
        codes: list[int] = []
        jobs: dict[int, Any] = {}  # page -> its checksum job, for pages read whole
        stored: dict[int, Any] = {}  # page -> the digest its header gives (None: a bad header)
        checked: dict[int, bool] = {}  # page -> whether its checksum agreed, where known already
        pending: dict[int, list[int]] = {}  # a region's first address -> pages checked there, still running
        try:
            with self.memory.staging(sum(lens)) as staging:
                base = staging.ctypes.data
                # In groups: a group's checksums run on the checksum threads while the next is read.
                for group in _groups(regions, split_repeats=True):
                    for i in group:  # a host page an earlier group's page was read into: checked first
                        for j in pending.pop(regions[i][0][0] if regions[i] else -1, ()):
                            checked[j] = jobs[j].value() == stored[j]
                    codes += self.store.batch_get_into_multi_buffers(
                        [skeys[i] for i in group],
                        [[base + offsets[i]] + [ptr for ptr, _ in regions[i]] for i in group],
                        [[lens[i]] + [size for _, size in regions[i]] for i in group],
                    )  # fmt: skip
                    for i in group:
                        if codes[i] != lens[i] + payload_lens[i]:
                            continue
                        parsed = parse_header(staging[offsets[i] : offsets[i] + lens[i]].tobytes(), names[i])
                        stored[i] = parsed[1] if parsed is not None and parsed[0] == payload_lens[i] else None
                        if stored[i] is not None:
                            jobs[i] = checksum_of_regions(names[i], regions[i])
                            pending.setdefault(regions[i][0][0] if regions[i] else -1, []).append(i)
        except BaseException:
            for job in jobs.values():
                job.wait()
            raise
        for i, code in enumerate(codes):
            if code < 0 and code != OBJECT_NOT_FOUND:
                self._failed(code, "batch_get_into_multi_buffers")
        done, corrupt = [False] * len(keys), 0
        for i, digest in stored.items():
            if checked[i] if i in checked else digest is not None and jobs[i].value() == digest:
                done[i] = True
            else:
                corrupt += 1
                self._drop_corrupt(skeys[i])
        self._count(hits=sum(done), misses=len(keys) - sum(done), corrupt=corrupt)
        return done

    # --- pages by host index (zero-copy) ---------------------------------------------------------------

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Optional[HiCacheStorageExtraInfo] = None
    ) -> list[bool]:
        """As the interface says. Keys already in the store are not sent again; the others travel in
        one batch (up to 4 calls of :data:`PIPELINE_BYTES` or more), each as its header and then the host pool's blocks themselves."""
        regions = self.host_page_regions(keys, host_indices)
        return self._put(keys, regions) if keys else []

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Optional[HiCacheStorageExtraInfo] = None
    ) -> list[bool]:
        """As the interface says. Pages are read in one batch (a few calls) straight into their host pages and
        checked there; a page that fails its check leaves its host page's bytes unspecified (and is
        removed from the store)."""
        regions = self.host_page_regions(keys, host_indices)
        return self._get(keys, regions) if keys else []

    # --- pages as tensors (through a registered staging buffer) ------------------------------------------

    @staticmethod
    def _check_value(value: object, target: object, size: object, name: str) -> torch.Tensor:
        if target is not None or size is not None:
            raise ValueError(f"{name} must be given as a tensor (MooncakeStore takes no target_location / target_sizes)")
        if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
            got = f"a tensor on {value.device}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{name} must be a CPU tensor, got {got}")
        return value.detach().contiguous().reshape(-1).view(torch.uint8)

    def _store(self, keys: list[str], payloads: list[torch.Tensor], stop_at_failure: bool) -> list[bool]:
        """Tensor payloads, copied into one registered staging buffer, then stored as ``_put``."""
        with self.memory.staging(sum(p.numel() for p in payloads)) as staging:
            regions, at = [], 0
            for p in payloads:
                torch.from_numpy(staging[at : at + p.numel()]).copy_(p)
                regions.append([(staging.ctypes.data + at, p.numel())])
                at += p.numel()
            return self._put(keys, regions, stop_at_failure)

    def _load(self, keys: list[str], targets: list[Optional[torch.Tensor]]) -> list[Optional[torch.Tensor]]:
        """Pages read through one registered staging buffer into ``targets`` (a new uint8 tensor of
        the stored size where a target is None); None for a miss."""
        if not keys:
            return []
        if not self._usable():
            self._count(misses=len(keys))
            return [None] * len(keys)
        nbytes = []
        for key, t in zip(keys, targets):
            if t is not None:
                nbytes.append(t.numel() * t.element_size())
                continue
            size = self.store.get_size(self.store_key(key))  # no target: the stored size decides
            if size < 0 and size != OBJECT_NOT_FOUND:
                self._failed(size, "get_size")
            nbytes.append(max(size - payload_offset(len(storage_name(self.namespace, key))), 0))
        with self.memory.staging(sum(nbytes)) as staging:
            regions, at = [], 0
            for n in nbytes:
                regions.append([(staging.ctypes.data + at, n)])
                at += n
            done = self._get(keys, regions)
            out: list[Optional[torch.Tensor]] = []
            at = 0
            for ok, n, t in zip(done, nbytes, targets):
                if ok:
                    t = torch.empty(n, dtype=torch.uint8) if t is None else t
                    t.reshape(-1).view(torch.uint8).copy_(torch.from_numpy(staging[at : at + n]))
                out.append(t if ok else None)
                at += n
            return out

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None) -> Optional[torch.Tensor]:
        """As the interface says; the page travels through a registered staging buffer."""
        key = self.check_key(key)
        return self._load([key], [self.check_target(target_location, target_sizes, "target_location")])[0]

    def batch_get(
        self, keys: list[str], target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None
    ) -> list[Optional[torch.Tensor]]:
        """As the interface says, in one batch (and one size query per key without a target)."""
        keys = self.check_keys(keys)
        targets = self.check_batch(target_locations, "target_locations", len(keys)) or [None] * len(keys)
        sizes = self.check_batch(target_sizes, "target_sizes", len(keys)) or [None] * len(keys)
        checked = [self.check_target(t, s, f"target_locations[{i}]") for i, (t, s) in enumerate(zip(targets, sizes))]
        return self._load(keys, checked)

    def set(
        self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None
    ) -> bool:
        """As the interface says; the page travels through a registered staging buffer."""
        key = self.check_key(key)
        return self._store([key], [self._check_value(value, target_location, target_sizes, "value")], False)[0]

    def batch_set(
        self, keys: list[str], values: Optional[Any] = None, target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None
    ) -> bool:
        """As the interface says, in one batch: pages after the first that fails are removed again."""
        keys = self.check_keys(keys)
        if values is None:
            raise ValueError("values must be a list of CPU tensors (one per key), got None")
        vals = self.check_batch(values, "values", len(keys))
        targets = self.check_batch(target_locations, "target_locations", len(keys)) or [None] * len(keys)
        sizes = self.check_batch(target_sizes, "target_sizes", len(keys)) or [None] * len(keys)
        payloads = [self._check_value(v, t, s, f"values[{i}]") for i, (v, t, s) in enumerate(zip(vals, targets, sizes))]  # type: ignore[arg-type]
        return all(self._store(keys, payloads, True)) if keys else True

    # --- presence and housekeeping -------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        """Whether the store holds an object under ``key``'s store key (False while the master is
        unreachable; its contents are checked only when read)."""
        key = self.check_key(key)
        if not self._usable():
            return False
        code = self.store.is_exist(self.store_key(key))
        if code < 0:
            self._failed(code, "is_exist")
        return code == 1

    def batch_exists(self, keys: list[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """As the interface says, in one round trip."""
        keys = self.check_keys(keys, "keys")
        if not keys or not self._usable():
            return 0
        codes = self.store.batch_is_exist([self.store_key(k) for k in keys])
        n = 0
        while n < len(codes) and codes[n] == 1:
            n += 1
        if n < len(codes) and codes[n] < 0:
            self._failed(codes[n], "batch_is_exist")
        return n

    def clear(self) -> None:
        """Remove every page of this backend's namespace from the store (other namespaces' pages, of
        other models, ranks or geometries, stay)."""
        if not self._usable():
            return
        code = self.store.remove_by_regex("^" + re.escape(self.key_prefix), True)
        if code < 0:
            self._failed(code, "remove_by_regex")
            return
        with self._lock:
            self._stats.pages, self._stats.bytes = 0, 0

    def get_stats(self) -> StorageStats:
        """A copy of the counters. ``pages`` / ``bytes`` are those this client stored since it was
        made or last cleared (the store is shared: other clients' pages and the master's evictions
        are not seen here)."""
        with self._lock:
            return StorageStats(**vars(self._stats))

    def close(self) -> None:
        """Unregister the buffers and leave the store (this client's segment and the pages in it go
        with it). A call after it raises RuntimeError; a second ``close`` does nothing."""
        store = getattr(self, "store", None)
        if store is None:
            return
        self.memory.release_all()
        store.close()
        self.store = None
