"""What the request code and the integrity check need from a prefix cache, as small protocols.

``kvpool.cache.requests`` and ``kvpool.cache.mamba_requests`` read a request and the cache's request
table and return what a call is to do (``kvpool.cache.requests.FinishedPlan``, ...); they never call
the cache. ``kvpool.cache.integrity`` checks requests, table and allocator against the problems and
slots the cache reports of its own tree. Each is typed against one of these protocols, which every
cache of ``kvpool.cache`` provides.
"""

from __future__ import annotations

from typing import Any, Protocol


class RequestCache(Protocol):
    """The settings of a cache that decide what a request's tokens become."""

    page_size: int
    is_eagle: bool
    disable: bool
    disable_finished_insert: bool
    enable_mamba_extra_buffer: bool
    req_to_token_pool: Any


class CheckedCache(Protocol):
    """The parts of a cache ``check_integrity`` compares with each other."""

    page_size: int
    root_node: Any
    req_to_token_pool: Any
    token_to_kv_pool_allocator: Any
