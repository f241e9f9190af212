"""How many KV-cache slots fit in a memory budget: the arithmetic a scheduler does at start-up.

An ``MHATokenToKVPool`` holds, per layer, a K buffer ``[size + page_size, head_num, head_dim]`` and a
V buffer ``[size + page_size, head_num, v_head_dim]``; an ``MLATokenToKVPool`` holds, per layer, one
latent buffer ``[size + page_size, 1, kv_lora_rank + qk_rope_head_dim]``. Either takes
``(size + page_size) * bytes_per_token`` bytes, where ``bytes_per_token`` covers every buffer of every
layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kvpool.checks import positive_int
from kvpool.kernels.formats import CACHE_DTYPES, store_dtype_for


@dataclass(frozen=True)
class KVGeometry:
    """The shape of one rank's KV cache, independent of how many slots it has.

    Parameters
    ----------
    head_num, head_dim : KV heads on this rank and the K head dim.
    layer_num : layers held by this rank.
    dtype : cache element type (FP8 takes one byte per element).
    v_head_dim : V head dim; None means ``head_dim``. 0 for an MLA geometry (no V buffer).
    kv_lora_rank : MLA only (build it with :meth:`mla`): the latent part of the row, whose width
        ``head_dim`` is ``kv_lora_rank + qk_rope_head_dim`` with ``head_num`` 1.

    Examples
    --------
    >>> g = KVGeometry(head_num=8, head_dim=128, layer_num=32, dtype=torch.float8_e4m3fn)
    >>> g.bytes_per_token  # K and V, 32 layers, 8 heads x 128, one byte each
    65536
    >>> g.max_pool_size(2**30, page_size=16)
    16368
    >>> KVGeometry.mla(kv_lora_rank=512, qk_rope_head_dim=64, layer_num=61, dtype=torch.bfloat16).bytes_per_token
    70272
    """

    head_num: int
    head_dim: int
    layer_num: int
    dtype: torch.dtype
    v_head_dim: Optional[int] = None
    kv_lora_rank: Optional[int] = None

    def __post_init__(self) -> None:
        positive_int(self.head_num, "head_num")
        positive_int(self.head_dim, "head_dim")
        positive_int(self.layer_num, "layer_num")
        if self.dtype not in CACHE_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(map(str, CACHE_DTYPES))}, got {self.dtype}")
        if self.kv_lora_rank is not None:  # MLA: one latent row per token and layer, no V buffer
            positive_int(self.kv_lora_rank, "kv_lora_rank")
            if self.head_num != 1:
                raise ValueError(f"head_num must be 1 for an MLA geometry (one latent row), got {self.head_num}")
            if self.kv_lora_rank >= self.head_dim:
                raise ValueError(
                    f"kv_lora_rank must be less than head_dim = kv_lora_rank + qk_rope_head_dim = {self.head_dim}, "
                    f"got {self.kv_lora_rank}"
                )
            if self.v_head_dim not in (None, 0):
                raise ValueError(f"v_head_dim must be 0 for an MLA geometry (no V buffer), got {self.v_head_dim!r}")
            object.__setattr__(self, "v_head_dim", 0)
        elif self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", self.head_dim)
        else:
            positive_int(self.v_head_dim, "v_head_dim")

    @classmethod
    def mla(cls, kv_lora_rank: int, qk_rope_head_dim: int, layer_num: int, dtype: torch.dtype) -> "KVGeometry":
        """The geometry of an ``MLATokenToKVPool``: one row of ``kv_lora_rank + qk_rope_head_dim``
        elements per token and layer (``head_num`` 1, ``head_dim`` the row, ``v_head_dim`` 0)."""
        positive_int(kv_lora_rank, "kv_lora_rank")
        positive_int(qk_rope_head_dim, "qk_rope_head_dim")
        return cls(1, kv_lora_rank + qk_rope_head_dim, layer_num, dtype, v_head_dim=0, kv_lora_rank=kv_lora_rank)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def qk_rope_head_dim(self) -> Optional[int]:
        """The rotary part of an MLA row (None for MHA)."""
        return None if self.kv_lora_rank is None else self.head_dim - self.kv_lora_rank

    @property
    def bytes_per_token(self) -> int:
        """Bytes one slot takes across all layers, K and V together (MLA: the latent row)."""
        element = store_dtype_for(self.dtype).itemsize
        return self.layer_num * self.head_num * (self.head_dim + self.v_head_dim) * element  # type: ignore[operator]

    def pool_bytes(self, size: int, page_size: int = 1) -> int:
        """Bytes an ``MHATokenToKVPool(size, page_size, ...)`` (for an MLA geometry, an
        ``MLATokenToKVPool``) of this geometry allocates."""
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


def mla_kv_bytes_per_token(kv_lora_rank: int, qk_rope_head_dim: int, layer_num: int, dtype: torch.dtype) -> int:
    """Bytes one MLA KV-cache slot takes across ``layer_num`` layers: ``layer_num * (kv_lora_rank +
    qk_rope_head_dim) * element size`` (one latent row per layer, no V).

    Examples
    --------
    >>> mla_kv_bytes_per_token(512, 64, 61, torch.float8_e4m3fn)  # DeepSeek-V3, FP8
    35136
    """
    return KVGeometry.mla(kv_lora_rank, qk_rope_head_dim, layer_num, dtype).bytes_per_token


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
