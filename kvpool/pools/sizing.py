"""How many KV-cache slots fit in a memory budget: the arithmetic a scheduler does at start-up.

An ``MHATokenToKVPool`` holds, per layer, a K buffer ``[size + page_size, head_num, head_dim]`` and a
V buffer ``[size + page_size, head_num, v_head_dim]``, so it takes
``(size + page_size) * bytes_per_token`` bytes, where ``bytes_per_token`` covers K and V of every layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kvpool.args import positive_int
from kvpool.kernels.formats import CACHE_DTYPES, store_dtype_for


@dataclass(frozen=True)
class KVGeometry:
    """The shape of one rank's KV cache, independent of how many slots it has.

    Parameters
    ----------
    head_num, head_dim : KV heads on this rank and the K head dim.
    layer_num : layers held by this rank.
    dtype : cache element type (FP8 takes one byte per element).
    v_head_dim : V head dim; None means ``head_dim``.

    Examples
    --------
    >>> g = KVGeometry(head_num=8, head_dim=128, layer_num=32, dtype=torch.float8_e4m3fn)
    >>> g.bytes_per_token  # K and V, 32 layers, 8 heads x 128, one byte each
    65536
    >>> g.max_pool_size(2**30, page_size=16)
    16368
    """

    head_num: int
    head_dim: int
    layer_num: int
    dtype: torch.dtype
    v_head_dim: Optional[int] = None

    def __post_init__(self) -> None:
        positive_int(self.head_num, "head_num")
        positive_int(self.head_dim, "head_dim")
        positive_int(self.layer_num, "layer_num")
        if self.dtype not in CACHE_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(map(str, CACHE_DTYPES))}, got {self.dtype}")
        if self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", self.head_dim)
        else:
            positive_int(self.v_head_dim, "v_head_dim")

    @property
    def bytes_per_token(self) -> int:
        """Bytes one slot takes across all layers, K and V together."""
        element = store_dtype_for(self.dtype).itemsize
        return self.layer_num * self.head_num * (self.head_dim + self.v_head_dim) * element  # type: ignore[operator]

    def pool_bytes(self, size: int, page_size: int = 1) -> int:
        """Bytes an ``MHATokenToKVPool(size, page_size, ...)`` of this geometry allocates."""
        positive_int(size, "size")
        positive_int(page_size, "page_size")
        return (size + page_size) * self.bytes_per_token

    def max_pool_size(self, budget_bytes: int, page_size: int = 1) -> int:
        """The largest pool ``size`` whose buffers fit in ``budget_bytes`` (see ``max_pool_size``)."""
        return max_pool_size(budget_bytes, self.bytes_per_token, page_size)


def kv_bytes_per_token(
    head_num: int, head_dim: int, v_head_dim: Optional[int], layer_num: int, dtype: torch.dtype
) -> int:
    """Bytes one KV-cache slot takes across ``layer_num`` layers, K and V together.

    ``layer_num * head_num * (head_dim + v_head_dim) * element size`` (FP8: one byte). SGLang calls
    this the cell size.

    Examples
    --------
    >>> kv_bytes_per_token(8, 128, None, 32, torch.bfloat16)
    131072
    """
    return KVGeometry(head_num, head_dim, layer_num, dtype, v_head_dim).bytes_per_token


def max_pool_size(budget_bytes: int, bytes_per_token: int, page_size: int = 1) -> int:
    """The largest ``size`` such that a pool of ``size + page_size`` rows fits in ``budget_bytes``.

    With ``page_size > 1`` the size is rounded down to whole pages, so a
    ``PagedTokenToKVPoolAllocator(size, page_size)`` uses every slot.

    Parameters
    ----------
    budget_bytes : memory set aside for the KV cache (non-negative int).
    bytes_per_token : from ``kv_bytes_per_token`` or ``KVGeometry.bytes_per_token``.
    page_size : the pool's page size.

    Returns
    -------
    int, at least ``page_size``.

    Raises
    ------
    ValueError
        If the budget cannot hold the ``page_size`` reserved rows plus one page.

    Examples
    --------
    >>> max_pool_size(10_000, bytes_per_token=100, page_size=16)
    80
    """
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ValueError(f"budget_bytes must be a non-negative int, got {budget_bytes!r}")
    positive_int(bytes_per_token, "bytes_per_token")
    positive_int(page_size, "page_size")
    rows = budget_bytes // bytes_per_token
    size = (rows - page_size) // page_size * page_size
    if size < page_size:
        need = 2 * page_size * bytes_per_token
        raise ValueError(
            f"budget_bytes must be at least {need} (the reserved page and one more of {page_size} slots "
            f"at {bytes_per_token} B each), got {budget_bytes}"
        )
    return size
