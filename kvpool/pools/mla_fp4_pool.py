"""``MLATokenToKVPoolFP4``: SGLang's FP4 latent cache (DeepSeek-V2/V3 MLA): per layer one packed e2m1
row of ``kv_lora_rank + qk_rope_head_dim`` values a token and its exponent scale bytes, one per 16
elements. The format and the rules are in docs/contract.md, "FP4 pools"."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from kvpool.checks import check_in_range, check_index, layer_id_of
from kvpool.config import fused_mode
from kvpool.kernels.fused_path import check_always
from kvpool.kernels.store_fp4 import FP4_BLOCK, dequantize_fp4, fp4_scale_tensor
from kvpool.kernels.store_fp4.writer import fp4_cache_verdict, write_fp4
from kvpool.kernels.store_kv.checks import check_loc, check_rows, check_scale, check_values
from kvpool.kernels.store_kv.writer import PathStats
from kvpool.pools.base import HasLayerId, check_sglang_keywords
from kvpool.pools.fp4_base import Fp4KVCache, fp4_dim
from kvpool.write_types import Scale


class Fp4LatentLayer(NamedTuple):
    """One layer's stored FP4 latent buffers (views of the pool's memory, never copies)."""

    kv: torch.Tensor  # [rows, 1, (kv_lora_rank + qk_rope_head_dim) // 2] uint8, element 2j low nibble
    kv_scale: torch.Tensor  # [rows, (kv_lora_rank + qk_rope_head_dim) // 16] uint8


class MLATokenToKVPoolFP4(Fp4KVCache):
    """SGLang's FP4 latent cache for the MLA layers ``[start_layer, end_layer]`` of one rank.

    Per layer, zeroed: ``kv_buffer`` ``[size + page_size, 1, kv_cache_dim // 2]`` uint8 (two e2m1
    codes a byte; the latent part first, then the rotary part) and ``kv_scale_buffer`` ``[size +
    page_size, kv_cache_dim // 16]`` uint8, ``kv_cache_dim = kv_lora_rank + qk_rope_head_dim``;
    SGLang's layout. Both parts are whole scale blocks (multiples of 16), so quantizing them apart, as
    SGLang's ``set_mla_kv_buffer`` does, stores what quantizing the whole row stores.

    Parameters
    ----------
    size, page_size, layer_num, device, start_layer, end_layer : as ``MLATokenToKVPool``.
    dtype : ``torch.float4_e2m1fn_x2`` or ``"fp4_e2m1"``.
    kv_lora_rank, qk_rope_head_dim : the row's parts, multiples of 16.
    enable_memory_saver, use_nsa, override_kv_cache_dim : SGLang's (False, False, None or the row).
    fused, validate, out_dtype : as ``MHATokenToKVPoolFP4``.

    Examples
    --------
    >>> pool = MLATokenToKVPoolFP4(64, 1, torch.float4_e2m1fn_x2, 512, 64, 1, "cpu")
    >>> pool.kv_buffer[0].shape, pool.kv_scale_buffer[0].shape
    (torch.Size([65, 1, 288]), torch.Size([65, 36]))
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: object,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        layer_num: int,
        device: str | torch.device,
        enable_memory_saver: bool = False,
        start_layer: Optional[int] = None,
        end_layer: Optional[int] = None,
        use_nsa: bool = False,
        override_kv_cache_dim: Optional[int] = None,
        *,
        fused: str = "auto",
        validate: bool = False,
        out_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        check_sglang_keywords(enable_memory_saver)
        if use_nsa is not False:
            raise ValueError(f"use_nsa must be False: kvpool has no NSA (sparse attention) cache layout, got {use_nsa!r}")
        super().__init__(size, page_size, dtype, layer_num, device, start_layer, end_layer, validate)
        self.kv_lora_rank = fp4_dim(kv_lora_rank, "kv_lora_rank")
        self.qk_rope_head_dim = fp4_dim(qk_rope_head_dim, "qk_rope_head_dim")
        self.kv_cache_dim = self.kv_lora_rank + self.qk_rope_head_dim
        if override_kv_cache_dim is not None and override_kv_cache_dim != self.kv_cache_dim:
            raise ValueError(
                f"override_kv_cache_dim must be None or kv_lora_rank + qk_rope_head_dim = {self.kv_cache_dim}, "
                f"got {override_kv_cache_dim!r}"
            )
        if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"out_dtype must be torch.bfloat16, torch.float16 or torch.float32, got {out_dtype}")
        self.out_dtype = out_dtype
        self._init_parts({
            "kv_buffer": self._new_buffer((1, self.kv_cache_dim // 2), torch.uint8),
            "kv_scale_buffer": self._new_buffer((self.kv_cache_dim // FP4_BLOCK,), torch.uint8),
        })  # fmt: skip
        r2, r16 = self.kv_lora_rank // 2, self.kv_lora_rank // FP4_BLOCK
        # The write's two parts: (codes, scales) column ranges of the latent and of the rotary values.
        self._latent = [(kv[:, :, :r2], sc[:, :r16]) for kv, sc in self._parts]
        self._rope = [(kv[:, :, r2:], sc[:, r16:]) for kv, sc in self._parts]
        self.fused_mode = fused_mode(fused)
        self.fused_verdict = fp4_cache_verdict(self.device, self.kv_lora_rank, self.qk_rope_head_dim, self.fused_mode)
        check_always(self.fused_mode, self.fused_verdict)
        self.stats = PathStats()

    # --- readers ---------------------------------------------------------------------------------

    def get_fp4_buffers(self, layer_id: int) -> Fp4LatentLayer:
        """The stored codes and scale bytes of global layer ``layer_id`` (views, never copies)."""
        return Fp4LatentLayer(*self._parts[self._wait_layer(layer_id)])

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """Global layer ``layer_id``'s whole rows dequantized, [rows, 1, kv_cache_dim] of
        ``out_dtype``: a new tensor (SGLang's getter)."""
        i = self._wait_layer(layer_id)
        return dequantize_fp4(*self._parts[i], self.out_dtype)

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """The latent columns of :meth:`get_key_buffer` ([rows, 1, kv_lora_rank], a view of a new
        tensor)."""
        return self.get_key_buffer(layer_id)[..., : self.kv_lora_rank]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(whole rows, latent columns) dequantized: one new tensor and a view of it."""
        rows = self.get_key_buffer(layer_id)
        return rows, rows[..., : self.kv_lora_rank]

    def get_kv_size_bytes(self) -> int:
        """Bytes of all layers' code and scale buffers."""
        return sum(self.part_bytes().values())

    def get_mla_kv_buffer(
        self, layer: HasLayerId, loc: torch.Tensor, dst_dtype: Optional[torch.dtype] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of slots ``loc`` dequantized: ``(k_nope [T, 1, kv_lora_rank], k_rope [T, 1,
        qk_rope_head_dim])`` of ``dst_dtype`` (None: ``out_dtype``), new tensors. A slot outside the
        buffers reads as zeros (IndexError under ``validate`` for one past the end). No
        synchronisation (unless ``validate``)."""
        i = self._wait_layer(layer_id_of(layer))
        check_index(loc, "loc", device=self.device, dims="[T]")
        if dst_dtype is not None and dst_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"dst_dtype must be None, torch.bfloat16, torch.float16 or torch.float32, got {dst_dtype!r}")
        if self.validate:
            check_in_range([(loc, self.rows, "loc")], what="slots")
        slots = loc.to(torch.int64)
        valid = (slots >= 0) & (slots < self.rows)
        index = torch.where(valid, slots, 0)  # in range everywhere: no device-side assert, no sync
        kv, scale = (b.index_select(0, index) for b in self._parts[i])
        kv = torch.where(valid[:, None, None], kv, 0)
        scale = torch.where(valid[:, None], scale, 0)
        rows = dequantize_fp4(kv, scale, dst_dtype or self.out_dtype)
        return rows[..., : self.kv_lora_rank].contiguous(), rows[..., self.kv_lora_rank :].contiguous()

    # --- writes ----------------------------------------------------------------------------------

    def set_kv_buffer(
        self,
        layer: Optional[HasLayerId],
        loc: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: Optional[torch.Tensor] = None,
        k_scale: Scale = None,
        v_scale: Scale = None,
        layer_id_override: Optional[int] = None,
    ) -> None:
        """Write whole rows ``cache_k [T, 1, kv_cache_dim]`` (bf16/fp16/fp32, any strides, never
        modified) to slots ``loc`` as the FP4 of ``cache_k / k_scale``; ``cache_v`` and ``v_scale``
        are ignored (SGLang's signature). Slots, scales and errors as ``MHATokenToKVPoolFP4``'s."""
        i = self._write_index(layer, layer_id_override)
        check_rows(cache_k, "cache_k", 1, self.kv_cache_dim, self.device)
        r = self.kv_lora_rank
        self._write(i, loc, cache_k[..., :r], cache_k[..., r:], k_scale)

    def set_mla_kv_buffer(
        self,
        layer: Optional[HasLayerId],
        loc: torch.Tensor,
        cache_k_nope: torch.Tensor,
        cache_k_rope: torch.Tensor,
        k_scale: Scale = None,
        layer_id_override: Optional[int] = None,
    ) -> None:
        """Write the rows from their parts ``cache_k_nope [T, 1, kv_lora_rank]`` and ``cache_k_rope
        [T, 1, qk_rope_head_dim]``, without concatenating them: the same bytes as
        :meth:`set_kv_buffer` of the joined row."""
        i = self._write_index(layer, layer_id_override)
        check_rows(cache_k_nope, "cache_k_nope", 1, self.kv_lora_rank, self.device)
        check_rows(cache_k_rope, "cache_k_rope", 1, self.qk_rope_head_dim, self.device)
        if cache_k_rope.shape[0] != cache_k_nope.shape[0]:
            raise ValueError(
                f"cache_k_rope must have T={cache_k_nope.shape[0]} tokens (cache_k_nope's), got {cache_k_rope.shape[0]}"
            )
        self._write(i, loc, cache_k_nope, cache_k_rope, k_scale)

    def _write(self, i: int, loc: torch.Tensor, nope: torch.Tensor, rope: torch.Tensor, k_scale: Scale) -> None:
        check_loc(loc, "loc", nope.shape[0], self.device)
        k_scale = check_scale(k_scale, "k_scale", 1, self.device)
        if self.validate:
            check_values(loc, "loc", self.rows, k_scale, None)
        s = fp4_scale_tensor(k_scale, 1, self.device)
        write_fp4(self.fused_verdict, self.fused_mode, self.stats, nope, rope, self._latent[i], self._rope[i], loc, s, s)
