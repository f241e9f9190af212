"""What a transfer moves of each layer of a KV pool: its row parts, each seen as ``[rows, heads,
per-head elements]`` so that a head range of every part is one slice, in the wire's order.

A K/V pool (``MHATokenToKVPool``, ``MLATokenToKVPool``) has two parts a layer, K and V. A pool whose
rows keep scales beside their codes has four, K codes, V codes, K scales, V scales, so a code never
travels without its scale. Bytes of one head's row, part by part:

- ``MHATokenToKVPoolFP4`` (``fp4_mx_block16``, or ``nvfp4``): ``D/2``, ``Dv/2`` codes, ``D/16``,
  ``Dv/16`` scales (exponents, or e4m3). The exponent buffer ``[rows, H * D / 16]`` is head-major
  (each head's row is whole 16-element blocks), so it is viewed as ``[rows, H, D / 16]``. NVFP4's
  global scales are per layer, not per row: the headers compare them, nothing carries them.
- ``MLATokenToKVPoolFP4`` (``fp4_mx_block16``): one head; its buffer of codes and its buffer of
  scales are each split at the latent/rotary boundary (whole blocks), which makes its layout that
  of a one-head FP4 MHA pool with ``head_dim = kv_lora_rank``, as a plain latent pool's is that of
  a one-head MHA pool.
- ``MHATokenToKVPoolFP8PerTokenHead`` (``fp8_per_token_head``): ``D``, ``Dv`` codes, one float32
  scale each.

docs/contract.md, "KV transfer between ranks", "Pools with scales beside their codes".
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import torch

from kvpool.kernels.row_table import RowTable
from kvpool.pools.hybrid_kv_pool import HybridLinearKVPool
from kvpool.pools.mha_fp4_pool import MHATokenToKVPoolFP4
from kvpool.pools.mha_fp8_token_pool import MHATokenToKVPoolFP8PerTokenHead
from kvpool.pools.mha_pool import MHATokenToKVPool
from kvpool.pools.mla_fp4_pool import MLATokenToKVPoolFP4
from kvpool.pools.mla_pool import MLATokenToKVPool
from kvpool.pools.nvfp4_scales import FP4_MX_BLOCK16, NVFP4
from kvpool.transfer.wire import TokenLayout

#: How a pool's rows keep their scales, by header code: none stored (a K/V pool; its writes take
#: per-tensor or per-head scales), or the formats with scales beside the codes.
PLAIN, FP8_PER_TOKEN_HEAD = "plain", "fp8_per_token_head"
KV_FORMATS = (PLAIN, FP4_MX_BLOCK16, NVFP4, FP8_PER_TOKEN_HEAD)
#: The pools a transfer takes (a ``HybridLinearKVPool`` holds one of them).
KV_POOLS = (MHATokenToKVPool, MLATokenToKVPool, MHATokenToKVPoolFP4, MLATokenToKVPoolFP4,
            MHATokenToKVPoolFP8PerTokenHead)  # fmt: skip


def format_name(code: int) -> str:
    """The format a header's ``kv_format`` code stands for, as text for messages."""
    return KV_FORMATS[code] if 0 <= code < len(KV_FORMATS) else f"unknown format code {code}"


def check_pool(pool: object) -> None:
    """Raise ``TypeError`` naming ``pool``'s type unless a transfer takes it."""
    inner = pool.full_kv_pool if isinstance(pool, HybridLinearKVPool) else pool
    if not isinstance(inner, KV_POOLS):
        raise TypeError(
            f"pool must be an MHATokenToKVPool, MLATokenToKVPool, MHATokenToKVPoolFP4, MLATokenToKVPoolFP4 or "
            f"MHATokenToKVPoolFP8PerTokenHead (or a HybridLinearKVPool holding one), got {type(pool).__name__}"
        )


@dataclass(frozen=True)
class KVParts:
    """A KV pool's layers as a transfer moves them.

    Attributes
    ----------
    pool : the pool (its buffers are the views' memory).
    kv_format : index in ``KV_FORMATS``.
    dtype : the pool's ``dtype`` (an FP4 pool's may be the name ``"fp4_e2m1"``).
    head_num, head_dim, v_head_dim : the geometry the headers compare (a latent pool: one head,
        ``kv_lora_rank``, ``qk_rope_head_dim``).
    layer_num, start_layer, page_size, rows : layers, the first's global id, the pool's page size,
        rows per buffer.
    layers : per layer, its parts in the wire order, each a ``[rows, head_num, ...]`` view.
    head_bytes : per part, the bytes of one head's row.
    global_scales : an NVFP4 pool's per-layer ``(k, v)`` float32 global scales, else empty.
    """

    pool: object
    kv_format: int
    dtype: object
    head_num: int
    head_dim: int
    v_head_dim: int
    layer_num: int
    start_layer: int
    page_size: int
    rows: int
    layers: tuple[tuple[torch.Tensor, ...], ...]
    head_bytes: tuple[int, ...]
    global_scales: tuple[tuple[float, float], ...] = ()

    @property
    def device(self) -> torch.device:
        """Where the pool's buffers live."""
        return self.layers[0][0].device

    def views(self, lo: int, hi: int) -> list[torch.Tensor]:
        """Local heads ``[lo, hi)`` of every part of every layer, in the wire order."""
        return [p[:, lo:hi] for layer in self.layers for p in layer]

    def layout(self, heads: int) -> TokenLayout:
        """The wire's bytes of one token for ``heads`` heads."""
        return TokenLayout.of_rows(tuple(heads * b for b in self.head_bytes) * self.layer_num)

    def table(self, lo: int, hi: int, non_blocking: bool) -> RowTable:
        """The row table of :meth:`views` (a K/V pool's own ``row_table`` for all its heads)."""
        if (lo, hi) == (0, self.head_num) and self.kv_format == 0:
            return self.pool.row_table  # type: ignore[attr-defined]
        return RowTable.of(self.views(lo, hi), non_blocking=non_blocking)

    def global_scales_crc(self) -> int:
        """crc32 of the float32 global scales, layer by layer (0 for none)."""
        return zlib.crc32(b"".join(struct.pack("<ff", k, v) for k, v in self.global_scales)) if self.global_scales else 0


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """A ``[rows, heads * n]`` scale buffer as ``[rows, heads, n]`` (a view)."""
    return t.view(t.shape[0], heads, -1)


def kv_parts(pool: object) -> KVParts:
    """The parts of ``pool`` (a pool of ``KV_POOLS``; check it first with :func:`check_pool`), with
    the global scales read now (host values, no synchronisation)."""
    fmt, scales = PLAIN, ()
    if isinstance(pool, (MHATokenToKVPool, MLATokenToKVPool)):
        h, d, dv = pool.head_num, pool.head_dim, pool.v_head_dim
        layers = tuple(zip(pool.k_buffer, pool.v_buffer))
    elif isinstance(pool, MHATokenToKVPoolFP4):
        fmt, scales = pool.fp4_format, pool.global_scale_values
        h, d, dv = pool.head_num, pool.head_dim, pool.v_head_dim
        layers = tuple((k, v, _heads(ks, h), _heads(vs, h)) for k, v, ks, vs in
                       zip(pool.k_buffer, pool.v_buffer, pool.k_scale_buffer, pool.v_scale_buffer))  # fmt: skip
    elif isinstance(pool, MLATokenToKVPoolFP4):
        fmt, h, d, dv = FP4_MX_BLOCK16, 1, pool.kv_lora_rank, pool.qk_rope_head_dim
        c, s = d // 2, d // 16
        layers = tuple((kv[:, :, :c], kv[:, :, c:], sc[:, None, :s], sc[:, None, s:])
                       for kv, sc in zip(pool.kv_buffer, pool.kv_scale_buffer))  # fmt: skip
    else:
        assert isinstance(pool, MHATokenToKVPoolFP8PerTokenHead)
        fmt, h, d, dv = FP8_PER_TOKEN_HEAD, pool.head_num, pool.head_dim, pool.v_head_dim
        layers = tuple((k, v, ks[:, :, None], vs[:, :, None]) for k, v, ks, vs in
                       zip(pool.k_buffer, pool.v_buffer, pool.k_scale_buffer, pool.v_scale_buffer))  # fmt: skip
    head_bytes = tuple(p[0, 0].numel() * p.element_size() for p in layers[0])
    return KVParts(
        pool, KV_FORMATS.index(fmt), pool.dtype, h, d, dv, pool.layer_num, pool.start_layer,  # type: ignore[attr-defined]
        pool.page_size, pool.size + pool.page_size, layers, head_bytes, tuple(scales),  # type: ignore[attr-defined]
    )  # fmt: skip
