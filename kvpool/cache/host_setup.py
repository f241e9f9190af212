"""How a ``HiRadixCache`` finds its host tier: the device pool, the host pool (given, or built from
SGLang's server arguments), the write policy and the copy backend, all checked before the cache
takes them."""

from __future__ import annotations

from typing import Any, Optional

from kvpool.host import IO_BACKENDS, MHATokenToKVPoolHost, MLATokenToKVPoolHost
from kvpool.pools.mla_pool import MLATokenToKVPool

#: When a node is backed up: on insert, on its second hit, or on eviction.
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


def host_tier_setup(
    allocator: Any, page_size: int, server_args: Any, host_pool: Any, write_policy: Optional[str], io_backend: Optional[str]
) -> tuple[Any, Any, str, str]:
    """(device pool, host pool, write policy, backend) for a ``HiRadixCache`` over ``allocator``.

    Raises
    ------
    ValueError
        For an allocator without a device pool, an unknown write policy or backend, no ``host_pool``
        and no ``server_args``, or a host pool over another device pool or page size (the storage
        tier is checked by ``kvpool.cache.storage_setup.storage_for``).
    """
    device_pool = allocator.get_kvcache() if hasattr(allocator, "get_kvcache") else None
    if device_pool is None:
        raise ValueError("token_to_kv_pool_allocator must be an allocator built with kvcache=<its device pool>")
    policy = write_policy or getattr(server_args, "hicache_write_policy", None) or "write_through"
    if policy not in WRITE_POLICIES:
        raise ValueError(f"write_policy must be one of {', '.join(WRITE_POLICIES)}, got {policy!r}")
    backend = io_backend or getattr(server_args, "hicache_io_backend", None) or "kernel"
    if backend not in IO_BACKENDS:
        raise ValueError(f"io_backend must be one of {', '.join(IO_BACKENDS)}, got {backend!r}")
    if host_pool is None:
        host_pool = host_pool_from(device_pool, page_size, server_args)
    if host_pool.device_pool is not device_pool:
        raise ValueError("host_pool must be built over the allocator's device pool (allocator.get_kvcache())")
    if host_pool.page_size != page_size:
        raise ValueError(f"host_pool's page_size must be the cache's {page_size}, got {host_pool.page_size}")
    return device_pool, host_pool, policy, backend


def host_pool_from(device_pool: Any, page_size: int, server_args: Any) -> Any:
    """The host pool SGLang's ``HiRadixCache`` builds from its server arguments (``hicache_ratio``,
    ``hicache_size``, ``hicache_mem_layout``).

    Raises
    ------
    ValueError
        Without ``server_args``.
    """
    if server_args is None:
        raise ValueError("HiRadixCache needs host_pool= or SGLang's server_args (hicache_ratio, hicache_size, ...)")
    cls = MLATokenToKVPoolHost if isinstance(device_pool, MLATokenToKVPool) else MHATokenToKVPoolHost
    return cls(
        device_pool, getattr(server_args, "hicache_ratio", 2.0), getattr(server_args, "hicache_size", 0), page_size,
        getattr(server_args, "hicache_mem_layout", "layer_first"),
    )  # fmt: skip
