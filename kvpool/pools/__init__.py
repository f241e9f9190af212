"""Pools (the K/V buffers) and the allocators a scheduler uses to hand out their slots."""

from kvpool.pools.mha_pool import MHATokenToKVPool, PathStats

__all__ = ["MHATokenToKVPool", "PathStats"]
