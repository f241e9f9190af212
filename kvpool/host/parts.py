"""What the host tier copies of each layer of a device pool: its buffers ("parts") and their rows
(docs/contract.md, "Host tier", "What a host page holds").

A K/V pool (``MHATokenToKVPool``, ``MLATokenToKVPool``) has two parts a layer, K and V; a pool whose
rows carry their scales beside the codes (the FP4 pools, ``MHATokenToKVPoolFP8PerTokenHead``) names
its parts in ``part_names`` (codes, then scales) and the host tier copies every one of them, so a
code never travels without its scale. Pure description: no copies here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvpool.kernels.row_table import RowTable
from kvpool.pools.mha_fp4_pool import MHATokenToKVPoolFP4
from kvpool.pools.mha_fp8_token_pool import MHATokenToKVPoolFP8PerTokenHead
from kvpool.pools.mla_fp4_pool import MLATokenToKVPoolFP4
from kvpool.pools.nvfp4_scales import FP4_MX_BLOCK16


@dataclass(frozen=True)
class LayerParts:
    """The buffers of one layer of a device pool, as the host tier mirrors them.

    Attributes
    ----------
    kind : the device pool's class name (errors name it).
    names : the parts' attribute names, in the order of the pool's row table (``k_buffer``,
        ``v_buffer`` for a K/V pool).
    rows : per part, the shape of one row (``(head_num, head_dim)`` for K).
    dtypes : per part, the dtype the host buffer holds (the device buffer's storage dtype).
    fmt : the stored format, part of a storage namespace: the element dtype, and for a pool with
        scales beside its codes how they are laid out (``"nvfp4"``, ``"fp4_mx_block16"``,
        ``"fp8_per_token_head"``).
    """

    kind: str
    names: tuple[str, ...]
    rows: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    fmt: str

    @property
    def row_bytes(self) -> tuple[int, ...]:
        """Bytes of one row of each part."""
        return tuple(math.prod(r) * d.itemsize for r, d in zip(self.rows, self.dtypes))

    @property
    def kv_only(self) -> bool:
        """Whether these are a K/V pool's two parts (no scales stored beside the rows)."""
        return self.names == ("k_buffer", "v_buffer")


def _fmt(device_pool: object) -> str:
    dtype = str(getattr(device_pool, "dtype"))
    if isinstance(device_pool, MHATokenToKVPoolFP4):
        return f"{dtype}/{device_pool.fp4_format}"
    if isinstance(device_pool, MLATokenToKVPoolFP4):
        return f"{dtype}/{FP4_MX_BLOCK16}"
    if isinstance(device_pool, MHATokenToKVPoolFP8PerTokenHead):
        return f"{dtype}/fp8_per_token_head"
    return dtype


def layer_parts(device_pool: object) -> LayerParts:
    """The parts of ``device_pool``'s layers.

    Raises
    ------
    TypeError
        For an object that is not a pool the host tier can mirror, naming its type and what it lacks.
    """
    kind = type(device_pool).__name__
    names = getattr(device_pool, "part_names", None)
    needs = ("layer_num", "start_layer", "dtype", "store_dtype", "device", "size", "page_size")
    if names is None:
        needs += ("row_table", "head_num", "head_dim", "v_head_dim")
    for name in needs:
        if not hasattr(device_pool, name):
            raise TypeError(
                f"device_pool must be an MHATokenToKVPool, an MLATokenToKVPool, an FP4 pool or an "
                f"MHATokenToKVPoolFP8PerTokenHead, got {kind} (no .{name})"
            )
    if names is None:
        p = device_pool
        rows = ((p.head_num, p.head_dim), (p.head_num, p.v_head_dim))  # type: ignore[attr-defined]
        return LayerParts(kind, ("k_buffer", "v_buffer"), rows, (p.store_dtype,) * 2, _fmt(p))  # type: ignore[attr-defined]
    first = [getattr(device_pool, n)[0] for n in names]
    return LayerParts(
        kind, tuple(names), tuple(tuple(b.shape[1:]) for b in first), tuple(b.dtype for b in first), _fmt(device_pool)
    )


def device_rows(device_pool: object) -> RowTable:
    """``device_pool``'s row table over every part of every layer, layer by layer in part order (a
    per-token-head FP8 pool calls it ``parts_table``)."""
    table = getattr(device_pool, "parts_table", None)
    return table if table is not None else device_pool.row_table  # type: ignore[attr-defined]


def global_scales(device_pool: object) -> tuple[tuple[float, float], ...]:
    """An NVFP4 pool's per-layer ``(k, v)`` global scales (empty for any other pool): host-side values,
    reading them costs no synchronisation."""
    return tuple(getattr(device_pool, "global_scale_values", ()))
