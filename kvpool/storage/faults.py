"""A failure injector around any storage backend: delays, failures, raised errors and short reads or
writes, chosen by a seeded probability or by call number, so tests can show that a cache loses no
data and stays consistent whatever its storage does.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any, Callable, Mapping, Optional

import torch

from kvpool.storage.base import HiCacheStorage, HiCacheStorageExtraInfo, StorageStats
from kvpool.storage.file_io import region

#: The calls faults are injected into, and whether each reads (a short read) or writes.
READS = ("get", "batch_get", "exists", "batch_exists", "batch_get_v1", "batch_get_regions")
WRITES = ("set", "batch_set", "batch_set_v1")
KINDS = ("delay", "raise", "fail", "short")
#: The byte a short read leaves in the pages it did not deliver.
SCRIBBLE = 0xA5


class StorageFault(RuntimeError):
    """An error the injector raised in place of the backend's call."""


def _calls(value: Optional[Mapping[str, Any]], name: str) -> dict[str, frozenset[int]]:
    out: dict[str, frozenset[int]] = {}
    for method, numbers in (value or {}).items():
        if method not in READS + WRITES:
            raise ValueError(f"{name} keys must be among {', '.join(READS + WRITES)}, got {method!r}")
        nums = frozenset(numbers)
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in nums):
            raise ValueError(f"{name}[{method!r}] must be call numbers (ints >= 1), got {sorted(nums, key=repr)!r}")
        out[method] = nums
    return out


def _rate(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a probability in [0, 1], got {value!r}")
    return float(value)


class FaultyStorage(HiCacheStorage):
    """``storage`` with faults injected into its calls (every other call passes through).

    Parameters
    ----------
    storage : any :class:`~kvpool.storage.base.HiCacheStorage` (register the host pool through the injector, or
        before wrapping).
    seed : seeds the draws, so a run repeats exactly.
    delay_rate, delay_s : probability that a call first sleeps ``delay_s`` seconds.
    raise_rate : probability that a call raises :class:`StorageFault` without reaching the backend.
    fail_rate : probability that a call returns its failure result without reaching the backend
        (None / False / 0 / all-False lists: nothing read or written).
    short_rate : probability that a call is cut short: a read reaches the backend, then only its
        first half (rounded down) is delivered and the rest are misses whose targets (tensors, host
        pages) are overwritten with ``0xA5`` bytes; ``exists`` says False, ``batch_exists`` the first
        half; a write stores only its first half and reports False for the rest (``set``: nothing,
        False).
    delay_calls, raise_calls, fail_calls, short_calls : ``{method: {call numbers}}`` (1-based, per
        method) that get that fault whatever the rates.

    Faults are chosen before the backend sees the call, its argument checks included. The rates
    (``rates[kind]``) and ``delay_s`` are attributes and may be changed between calls; ``log`` lists every injected fault as
    ``(method, call number, kind)``; ``calls`` counts calls per method.

    Examples
    --------
    >>> flaky = FaultyStorage(HiCacheFile(config, path), seed=3, fail_rate=0.2, short_calls={"batch_get_v1": {2}})
    """

    def __init__(
        self,
        storage: HiCacheStorage,
        *,
        seed: int = 0,
        delay_rate: float = 0.0,
        delay_s: float = 0.0,
        raise_rate: float = 0.0,
        fail_rate: float = 0.0,
        short_rate: float = 0.0,
        delay_calls: Optional[Mapping[str, Any]] = None,
        raise_calls: Optional[Mapping[str, Any]] = None,
        fail_calls: Optional[Mapping[str, Any]] = None,
        short_calls: Optional[Mapping[str, Any]] = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not isinstance(storage, HiCacheStorage):
            raise ValueError(f"storage must be a HiCacheStorage, got {type(storage).__name__}")
        if isinstance(delay_s, bool) or not isinstance(delay_s, (int, float)) or delay_s < 0:
            raise ValueError(f"delay_s must be a number of seconds >= 0, got {delay_s!r}")
        self.storage = storage
        self.mem_pool_host = storage.mem_pool_host
        self.delay_s = float(delay_s)
        self.rates = {k: _rate(v, f"{k}_rate") for k, v in zip(KINDS, (delay_rate, raise_rate, fail_rate, short_rate))}
        self.on_calls = {
            k: _calls(v, f"{k}_calls") for k, v in zip(KINDS, (delay_calls, raise_calls, fail_calls, short_calls))
        }
        self.sleep = sleep
        self.calls: dict[str, int] = {}
        self.log: list[tuple[str, int, str]] = []
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def _faults(self, method: str) -> set[str]:
        """The faults of this call: by call number, else one seeded draw per kind (always drawn, so
        the sequence does not depend on which faults fire)."""
        with self._lock:
            n = self.calls.get(method, 0) + 1
            self.calls[method] = n
            chosen = set()
            for kind in KINDS:
                drawn = self._rng.random() < self.rates[kind]
                if n in self.on_calls[kind].get(method, ()) or drawn:
                    chosen.add(kind)
                    self.log.append((method, n, kind))
        if "delay" in chosen and self.delay_s:
            self.sleep(self.delay_s)
        if "raise" in chosen:
            raise StorageFault(f"injected failure of {method} (call {n})")
        return chosen

    # --- the host pool and housekeeping pass through --------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The wrapped backend's, and kept here for the short reads that scribble on host pages."""
        self.storage.register_mem_pool_host(mem_pool_host)
        self.mem_pool_host = mem_pool_host

    def clear(self) -> None:
        """The wrapped backend's (no fault injected)."""
        self.storage.clear()

    def get_stats(self) -> StorageStats:
        """The wrapped backend's counters (the injected faults are in ``log``)."""
        return self.storage.get_stats()

    def close(self) -> None:
        """The wrapped backend's (no fault injected)."""
        self.storage.close()

    # --- reads ---------------------------------------------------------------------------------------

    def _scribble_page(self, host_indices: torch.Tensor, i: int) -> None:
        host = self.mem_pool_host
        ps = host.page_size
        page = torch.full((sum(host.page_bytes),), SCRIBBLE, dtype=torch.uint8).view(host.store_dtype)
        host.set_from_flat_data_page(int(host_indices[i * ps]), page)

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None) -> Optional[torch.Tensor]:
        """The wrapped backend's ``get``, unless this call fails (None) or reads short (the target's
        second half scribbled over, then None)."""
        faults = self._faults("get")
        if "fail" in faults:
            return None
        got = self.storage.get(key, target_location, target_sizes)
        if "short" in faults:
            if isinstance(got, torch.Tensor):
                got.view(torch.uint8).reshape(-1)[got.numel() * got.element_size() // 2 :] = SCRIBBLE
            return None
        return got

    def batch_get(
        self, keys: list[str], target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None
    ) -> list[Optional[torch.Tensor]]:
        """The wrapped backend's ``batch_get``, unless this call fails (all None) or reads short (the
        second half of the pages scribbled over and None)."""
        faults = self._faults("batch_get")
        if "fail" in faults:
            return [None] * len(keys)
        got = self.storage.batch_get(keys, target_locations, target_sizes)
        if "short" in faults:
            for i in range(len(got) // 2, len(got)):
                t = got[i]
                if isinstance(t, torch.Tensor):
                    t.view(torch.uint8).reshape(-1).fill_(SCRIBBLE)
                got[i] = None
        return got

    def exists(self, key: str) -> bool:
        """The wrapped backend's ``exists``, unless this call fails or reads short (False)."""
        faults = self._faults("exists")
        if faults & {"fail", "short"}:
            return False
        return self.storage.exists(key)

    def batch_exists(self, keys: list[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """The wrapped backend's ``batch_exists``, unless this call fails (0) or reads short (at most
        half the keys)."""
        faults = self._faults("batch_exists")
        if "fail" in faults:
            return 0
        n = self.storage.batch_exists(keys, extra_info)
        return min(n, len(keys) // 2) if "short" in faults else n

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Optional[HiCacheStorageExtraInfo] = None
    ) -> list[bool]:
        """The wrapped backend's ``batch_get_v1``, unless this call fails (all False) or reads short
        (the second half's host pages scribbled over and False)."""
        faults = self._faults("batch_get_v1")
        if "fail" in faults:
            return [False] * len(keys)
        got = list(self.storage.batch_get_v1(keys, host_indices, extra_info))
        if "short" in faults:
            for i in range(len(got) // 2, len(got)):
                self._scribble_page(host_indices, i)
                got[i] = False
        return got

    @property
    def reads_into_regions(self) -> bool:  # type: ignore[override]
        """The wrapped backend's."""
        return self.storage.reads_into_regions

    def batch_get_regions(self, keys: list[str], regions: list[list[tuple[int, int]]]) -> list[bool]:
        """The wrapped backend's ``batch_get_regions``, unless this call fails (all False) or reads
        short (the second half's blocks scribbled over and False)."""
        faults = self._faults("batch_get_regions")
        if "fail" in faults:
            return [False] * len(keys)
        got = list(self.storage.batch_get_regions(keys, regions))
        if "short" in faults:
            for i in range(len(got) // 2, len(got)):
                for ptr, n in regions[i]:
                    region(ptr, n)[:] = bytes([SCRIBBLE]) * n
                got[i] = False
        return got

    # --- writes --------------------------------------------------------------------------------------

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None) -> bool:
        """The wrapped backend's ``set``, unless this call fails or writes short (False, nothing
        stored)."""
        faults = self._faults("set")
        if faults & {"fail", "short"}:
            return False
        return self.storage.set(key, value, target_location, target_sizes)

    def batch_set(
        self, keys: list[str], values: Optional[Any] = None, target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None
    ) -> bool:
        """The wrapped backend's ``batch_set``, unless this call fails (False) or writes short (the
        first half stored, then False)."""
        faults = self._faults("batch_set")
        if "fail" in faults:
            return False
        if "short" in faults:
            half = len(keys) // 2
            cut = (lambda xs: None if xs is None else list(xs)[:half])
            self.storage.batch_set(keys[:half], cut(values), cut(target_locations), cut(target_sizes))
            return False
        return self.storage.batch_set(keys, values, target_locations, target_sizes)

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Optional[HiCacheStorageExtraInfo] = None
    ) -> list[bool]:
        """The wrapped backend's ``batch_set_v1``, unless this call fails (all False) or writes short
        (the first half stored, the rest False)."""
        faults = self._faults("batch_set_v1")
        if "fail" in faults:
            return [False] * len(keys)
        if "short" in faults:
            half = len(keys) // 2
            ps = self.mem_pool_host.page_size if self.mem_pool_host is not None else 0
            done = list(self.storage.batch_set_v1(keys[:half], host_indices[: half * ps], extra_info)) if half else []
            return done + [False] * (len(keys) - half)
        return self.storage.batch_set_v1(keys, host_indices, extra_info)
