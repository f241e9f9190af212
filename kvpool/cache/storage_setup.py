"""How a ``HiRadixCache`` finds its storage tier: the backend (given, or named in SGLang's server
arguments), its namespace's ranks and the prefetch policy, all checked before the cache changes
anything (docs/contract.md, "With a storage tier")."""

from __future__ import annotations

import json
from typing import Any, Optional

from kvpool.cache.storage_tier import StoragePolicy, StorageTier
from kvpool.pools.mla_pool import MLATokenToKVPool
from kvpool.storage.base import HiCacheStorage, HiCacheStorageConfig
from kvpool.storage.file import HiCacheFile
from kvpool.storage.mooncake import MooncakeStore


def storage_for(
    server_args: Any, storage: Any, policy: Optional[StoragePolicy], host_pool: Any, tp_group: Any = None, pp: tuple = (0, 1),
    tier_cls: type = StorageTier,
) -> Optional[Any]:
    """How a ``HiRadixCache`` makes its storage tier, checked before the cache changes anything: a
    function of the cache giving its ``StorageTier``, or None without storage. ``storage`` is a
    backend instance; without it ``server_args.hicache_storage_backend`` may name ``"file"``
    (``HiCacheFile``) or ``"mooncake"`` (``MooncakeStore``, its settings in the extra config).
    Without ``policy`` it is made from ``hicache_storage_prefetch_policy`` and
    SGLang's keys of ``hicache_storage_backend_extra_config`` (a dict or JSON of one):
    ``prefetch_threshold``, ``prefetch_timeout_base``, ``prefetch_timeout_per_ki_token`` (seconds
    per 1024 tokens); ``file_path`` and ``max_bytes`` go to ``HiCacheFile``. The backend's namespace
    takes the rank and size of ``tp_group`` (the cache's ``tp_cache_group``: ``rank()``, ``size()``)
    and the pipeline stage ``pp`` (rank, size), so ranks sharing a store never read each other's
    pages. ``tier_cls`` is the tier made (a ``StorageTier`` subclass: ``HiMambaRadixCache``'s stores
    its states too); ``host_pool`` is the KV host pool. A backend made here is the tier's to close
    (``close``); one given as ``storage`` stays the caller's.

    Raises
    ------
    ValueError
        Another backend name (pass it as ``storage=``), a ``storage`` that is not a
        ``HiCacheStorage``, a ``storage_policy`` that is not a ``StoragePolicy`` or without storage,
        a named backend for an MHA model with ``server_args.tp_size`` > 1 and no ``tp_group``.
    """
    name = getattr(server_args, "hicache_storage_backend", None)
    if storage is None and name is None:
        if policy is not None:
            raise ValueError("storage_policy needs a storage backend (storage=, or server_args.hicache_storage_backend)")
        return None
    extra = _extra_config(server_args)
    if policy is None:
        per_ki = extra.get("prefetch_timeout_per_ki_token", 0.25)
        policy = StoragePolicy(
            prefetch_policy=getattr(server_args, "hicache_storage_prefetch_policy", None) or "best_effort",
            prefetch_threshold=extra.get("prefetch_threshold", 256),
            prefetch_timeout_base_s=extra.get("prefetch_timeout_base", 1.0),
            prefetch_timeout_per_page_s=per_ki * host_pool.page_size / 1024 if isinstance(per_ki, (int, float)) else per_ki,
        )
    if not isinstance(policy, StoragePolicy):
        raise ValueError(f"storage_policy must be a StoragePolicy, got {type(policy).__name__}")
    owns = storage is None  # the cache closes what it made
    if storage is None:
        storage = _named_storage(name, server_args, host_pool, extra, tp_group, pp)  # the last check: it makes the directory
    if not isinstance(storage, HiCacheStorage):
        raise ValueError(f"storage must be a kvpool.storage.HiCacheStorage, got {type(storage).__name__}")
    return lambda cache: tier_cls(cache, storage, policy, owns)


def _extra_config(server_args: Any) -> dict:
    extra = getattr(server_args, "hicache_storage_backend_extra_config", None) or {}
    if isinstance(extra, str):
        try:
            extra = json.loads(extra)
        except ValueError as e:
            raise ValueError(f"hicache_storage_backend_extra_config must be a dict or JSON of one, got {extra!r} ({e})") from None
    if not isinstance(extra, dict):
        raise ValueError(f"hicache_storage_backend_extra_config must be a dict or JSON of one, got {type(extra).__name__}")
    return extra


def _named_storage(name: object, server_args: Any, host_pool: Any, extra: dict, tp_group: Any, pp: tuple) -> HiCacheStorage:
    if name not in ("file", "mooncake"):
        raise ValueError(
            f"hicache_storage_backend must be 'file', 'mooncake' or None (pass other backends as storage=), got {name!r}"
        )
    mla = isinstance(host_pool.device_pool, MLATokenToKVPool)
    if tp_group is not None:
        if not (callable(getattr(tp_group, "rank", None)) and callable(getattr(tp_group, "size", None))):
            raise ValueError(f"tp_cache_group must be a process group (rank(), size()), got {type(tp_group).__name__}")
        tp_rank, tp_size = tp_group.rank(), tp_group.size()
    else:
        tp_rank, tp_size = 0, getattr(server_args, "tp_size", 1)
        if not mla and isinstance(tp_size, int) and tp_size > 1:  # each rank's pages hold its own heads
            raise ValueError(
                f"tp_cache_group must be the rank's tensor-parallel group with hicache_storage_backend={name!r} and "
                f"tp_size {tp_size}, got None (the ranks' pages would share one namespace)"
            )
        tp_size = 1
    config = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp[0], pp_size=pp[1], model_name=getattr(server_args, "model_path", None),
        is_mla_model=mla, is_page_first_layout=host_pool.layout == "page_first", extra_config=extra,
    )  # fmt: skip
    if name == "mooncake":  # its connection settings are the extra config's MooncakeConfig keys
        return MooncakeStore(config)
    kwargs = {"max_bytes": extra["max_bytes"]} if "max_bytes" in extra else {}
    return HiCacheFile(config, extra.get("file_path"), **kwargs)
