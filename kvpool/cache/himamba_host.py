"""How a ``HiMambaRadixCache`` finds its host tier, and the record of a state parked there.

The host tier of a hybrid model is a ``HybridPoolHost`` (``kvpool.host.mamba_host``): host KV pages
for the full-attention layers and host state slots for the linear layers. Built from SGLang's server
arguments it takes **one host budget** for both: ``hicache_ratio`` is the host's bytes over the
device's bytes of the two pools together, and ``hicache_size`` GB is turned into that ratio, so both
host pools get the same ratio of their device pool and together take at most the budget (KV pages
and state slots in the proportion the device holds them). Everything is checked before the cache
takes it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from kvpool.cache.host_setup import WRITE_POLICIES
from kvpool.host import IO_BACKENDS, HybridPoolHost
from kvpool.pools.hybrid_kv_pool import HybridLinearKVPool

#: The name a node's host state record is filed under in ``node.records``.
HOST_STATE = "host_state"


class HostState:
    """A node's linear-attention state parked on the host: ``slot`` Tensor [1] int64, a host state
    slot of the ``HybridPoolHost``'s ``state_host``. It moves with the node's host KV copy (a host
    state record is only on a node that has one)."""

    __slots__ = ("slot", "queue_entry")

    def __init__(self, slot: torch.Tensor) -> None:
        self.slot = slot
        self.queue_entry: Optional[tuple] = None

    def split(self, tokens: int) -> None:
        """None: the state is the one after the node's last token, so it stays with the second part."""
        return None


def hybrid_host_setup(
    allocator: Any, mamba_pool: Any, page_size: int, server_args: Any, host_pool: Any, write_policy: Optional[str],
    io_backend: Optional[str],
) -> tuple[HybridLinearKVPool, HybridPoolHost, str, str]:  # fmt: skip
    """(device pool, host pool, write policy, backend) for a ``HiMambaRadixCache`` over ``allocator``
    and the request table's ``mamba_pool``.

    Raises
    ------
    ValueError
        For an allocator whose device pool is not a ``HybridLinearKVPool`` over ``mamba_pool``, no
        ``mamba_pool``, an unknown write policy or backend, no ``host_pool`` and no ``server_args``,
        or a host pool that is not a
        ``HybridPoolHost`` over that device pool with the cache's page size.
    """
    if mamba_pool is None:
        raise ValueError("req_to_token_pool must be a HybridReqToTokenPool (its mamba_pool holds the states), got none")
    device_pool = allocator.get_kvcache() if hasattr(allocator, "get_kvcache") else None
    if not isinstance(device_pool, HybridLinearKVPool):
        raise ValueError(
            "token_to_kv_pool_allocator must be built with kvcache=<a HybridLinearKVPool>, got "
            f"{type(device_pool).__name__}"
        )
    if device_pool.mamba_pool is not mamba_pool:
        raise ValueError("the allocator's HybridLinearKVPool must hold the request table's mamba_pool")
    policy = write_policy or getattr(server_args, "hicache_write_policy", None) or "write_through"
    if policy not in WRITE_POLICIES:
        raise ValueError(f"write_policy must be one of {', '.join(WRITE_POLICIES)}, got {policy!r}")
    backend = io_backend or getattr(server_args, "hicache_io_backend", None) or "kernel"
    if backend not in IO_BACKENDS:
        raise ValueError(f"io_backend must be one of {', '.join(IO_BACKENDS)}, got {backend!r}")
    if host_pool is None:
        host_pool = hybrid_host_pool_from(device_pool, page_size, server_args)
    if not isinstance(host_pool, HybridPoolHost):
        raise ValueError(f"host_pool must be a HybridPoolHost, got {type(host_pool).__name__}")
    if host_pool.device_pool is not device_pool:
        raise ValueError("host_pool must be built over the allocator's device pool (allocator.get_kvcache())")
    if host_pool.kv_host.page_size != page_size:
        raise ValueError(f"host_pool's page_size must be the cache's {page_size}, got {host_pool.kv_host.page_size}")
    return device_pool, host_pool, policy, backend


def device_bytes(device_pool: HybridLinearKVPool) -> int:
    """The bytes of a hybrid device pool's KV buffers and state slots together (what one host
    budget is a ratio of)."""
    kv = device_pool.get_kv_size_bytes()
    kv_bytes = sum(kv) if isinstance(kv, tuple) else kv
    mamba = device_pool.mamba_pool
    return int(kv_bytes) + mamba.size * mamba.cache_params.bytes_per_slot


def hybrid_host_pool_from(device_pool: HybridLinearKVPool, page_size: int, server_args: Any) -> HybridPoolHost:
    """The ``HybridPoolHost`` for SGLang's server arguments: one budget (``hicache_size`` GB when > 0,
    else ``hicache_ratio`` times the device pools' bytes) for KV pages and state slots, each host pool
    the same ratio of its device pool; ``hicache_mem_layout`` for both.

    Raises
    ------
    ValueError
        Without ``server_args``, or for a ratio or size that is not a positive number.
    """
    if server_args is None:
        raise ValueError("HiMambaRadixCache needs host_pool= or SGLang's server_args (hicache_ratio, hicache_size, ...)")
    size = getattr(server_args, "hicache_size", 0) or 0
    ratio = getattr(server_args, "hicache_ratio", 2.0)
    if isinstance(size, bool) or not isinstance(size, (int, float)) or size < 0:
        raise ValueError(f"hicache_size must be a number of GB (0: use hicache_ratio), got {size!r}")
    if size > 0:
        ratio = size * 1e9 / device_bytes(device_pool)
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not ratio > 0:
        raise ValueError(f"hicache_ratio must be a positive number, got {ratio!r}")
    layout = getattr(server_args, "hicache_mem_layout", "layer_first")
    return HybridPoolHost(device_pool, ratio, 0, page_size, layout, state_host_to_device_ratio=ratio)
