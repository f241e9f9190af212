"""``MHATokenToKVPoolFP4``: SGLang's FP4 K/V pool: per layer packed e2m1 K and V rows and their
exponent scale bytes, one per 16 elements; writes quantize as SGLang's KV FP4 quantizer does, the
getters dequantize as SGLang's do, and a reader hands attention backends the stored bytes. The format
and the rules are in docs/contract.md, "FP4 pools"."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from kvpool.checks import positive_int
from kvpool.config import fused_mode
from kvpool.errors import FusedPathUnavailable
from kvpool.kernels.store_fp4 import FP4_BLOCK, dequantize_fp4, fp4_scale_tensor
from kvpool.kernels.store_fp4.writer import fp4_cache_verdict, write_fp4
from kvpool.kernels.store_kv.checks import check_loc, check_rows, check_scale, check_values
from kvpool.kernels.store_kv.writer import PathStats
from kvpool.pools.base import HasLayerId, check_sglang_keywords
from kvpool.pools.fp4_base import Fp4KVCache, fp4_dim
from kvpool.write_types import Scale


class Fp4Layer(NamedTuple):
    """One layer's stored FP4 buffers (views of the pool's memory, never copies)."""

    k: torch.Tensor  # [rows, H, D // 2] uint8, two e2m1 codes a byte (element 2j in the low nibble)
    v: torch.Tensor  # [rows, H, Dv // 2] uint8
    k_scale: torch.Tensor  # [rows, H * D // 16] uint8, 2 ** (byte - 127) per 16 elements of the row
    v_scale: torch.Tensor  # [rows, H * Dv // 16] uint8


class MHATokenToKVPoolFP4(Fp4KVCache):
    """SGLang's FP4 K/V cache buffers for the attention layers ``[start_layer, end_layer]`` of one rank.

    Per layer, zeroed: ``k_buffer`` ``[size + page_size, head_num, head_dim // 2]`` and ``v_buffer``
    ``[.., head_num, v_head_dim // 2]`` of uint8 (two e2m1 codes a byte), ``k_scale_buffer``
    ``[size + page_size, head_num * head_dim // 16]`` and ``v_scale_buffer`` ``[.., head_num *
    v_head_dim // 16]`` of uint8 exponent scales, one per 16 elements of the flattened row. The
    layout is SGLang's (which has ``v_head_dim == head_dim``). Slot 0 is the padding slot.

    The positional order of the arguments is SGLang's ``MHATokenToKVPool``'s.

    Parameters
    ----------
    size, page_size, head_num, layer_num, device, start_layer, end_layer : as ``MHATokenToKVPool``.
    dtype : ``torch.float4_e2m1fn_x2`` (SGLang's), or ``"fp4_e2m1"`` (also on a torch without it).
    head_dim, v_head_dim : multiples of 16 (``v_head_dim`` defaults to ``head_dim``).
    swa_head_num, swa_head_dim, swa_v_head_dim : SGLang's; when given they replace the geometry.
    enable_memory_saver, enable_alt_stream, enable_kv_cache_copy : SGLang's (memory saver: False).
    fused : ``"auto"`` (the fused Triton write where the gate allows: CUDA, no scale; else the
        reference), ``"always"`` (raise ``FusedPathUnavailable`` with the gate's reason instead; on
        the CPU it runs the kernel through Triton's interpreter), ``"never"``. ``KVPOOL_FUSED``
        overrides it.
    validate : check slot range and scale values on every write (one synchronisation each);
        ``KVPOOL_VALIDATE=1`` turns it on too.
    out_dtype : what the dequantizing getters return (SGLang's: ``torch.bfloat16``).

    Examples
    --------
    >>> pool = MHATokenToKVPoolFP4(64, 1, torch.float4_e2m1fn_x2, head_num=2, head_dim=32,
    ...                            layer_num=1, device="cpu")
    >>> k = torch.randn(3, 2, 32, dtype=torch.bfloat16)
    >>> pool.set_kv_buffer(None, torch.tensor([1, 2, 3]), k, k, layer_id_override=0)
    >>> pool.get_fp4_buffers(0).k.shape, pool.get_key_buffer(0).dtype
    (torch.Size([65, 2, 16]), torch.bfloat16)
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: object,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: str | torch.device,
        enable_memory_saver: bool = False,
        v_head_dim: Optional[int] = None,
        swa_head_num: Optional[int] = None,
        swa_head_dim: Optional[int] = None,
        swa_v_head_dim: Optional[int] = None,
        start_layer: Optional[int] = None,
        end_layer: Optional[int] = None,
        enable_alt_stream: bool = True,
        enable_kv_cache_copy: bool = False,
        *,
        fused: str = "auto",
        validate: bool = False,
        out_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        check_sglang_keywords(enable_memory_saver, enable_alt_stream, enable_kv_cache_copy)
        super().__init__(size, page_size, dtype, layer_num, device, start_layer, end_layer, validate)
        self.head_num = positive_int(head_num if swa_head_num is None else swa_head_num, "head_num")
        self.head_dim = fp4_dim(head_dim if swa_head_dim is None else swa_head_dim, "head_dim")
        v_dim = swa_v_head_dim if swa_v_head_dim is not None else v_head_dim
        self.v_head_dim = self.head_dim if v_dim is None else fp4_dim(v_dim, "v_head_dim")
        if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"out_dtype must be torch.bfloat16, torch.float16 or torch.float32, got {out_dtype}")
        self.out_dtype = out_dtype
        h, d, dv = self.head_num, self.head_dim, self.v_head_dim
        self._init_parts({
            "k_buffer": self._new_buffer((h, d // 2)),
            "v_buffer": self._new_buffer((h, dv // 2)),
            "k_scale_buffer": self._new_buffer((h * d // FP4_BLOCK,)),
            "v_scale_buffer": self._new_buffer((h * dv // FP4_BLOCK,)),
        })  # fmt: skip
        self.fused_mode = fused_mode(fused)
        #: The gate's verdict on these buffers, ``(eligible, reason)``; the scales decide the rest.
        self.fused_verdict = fp4_cache_verdict(self.device, d, dv, self.fused_mode)
        if self.fused_mode == "always" and not self.fused_verdict[0]:
            raise FusedPathUnavailable(f"fused='always' but {self.fused_verdict[1]}")
        #: Writes per path, and why the reference path ran.
        self.stats = PathStats()

    # --- readers ---------------------------------------------------------------------------------

    def get_fp4_buffers(self, layer_id: int) -> Fp4Layer:
        """The stored codes and scale bytes of global layer ``layer_id``, for attention kernels that
        read FP4 directly: views of the pool's memory, never copies."""
        return Fp4Layer(*self._parts[self._wait_layer(layer_id)])

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """Global layer ``layer_id``'s K rows dequantized, [rows, head_num, head_dim] of
        ``out_dtype``: a new tensor (SGLang's getter for reference attention)."""
        i = self._wait_layer(layer_id)
        return dequantize_fp4(self.k_buffer[i], self.k_scale_buffer[i], self.out_dtype)

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """Global layer ``layer_id``'s V rows dequantized, as :meth:`get_key_buffer`."""
        i = self._wait_layer(layer_id)
        return dequantize_fp4(self.v_buffer[i], self.v_scale_buffer[i], self.out_dtype)

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of global layer ``layer_id`` dequantized, with one wait."""
        i = self._wait_layer(layer_id)
        return (
            dequantize_fp4(self.k_buffer[i], self.k_scale_buffer[i], self.out_dtype),
            dequantize_fp4(self.v_buffer[i], self.v_scale_buffer[i], self.out_dtype),
        )

    def get_kv_size_bytes(self) -> tuple[int, int]:
        """(K bytes, V bytes) of all layers, each with its scale bytes (SGLang's count leaves the
        scale buffers out)."""
        b = self.part_bytes()
        return b["k_buffer"] + b["k_scale_buffer"], b["v_buffer"] + b["v_scale_buffer"]

    # --- writes ----------------------------------------------------------------------------------

    def set_kv_buffer(
        self,
        layer: Optional[HasLayerId],
        loc: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        k_scale: Scale = None,
        v_scale: Scale = None,
        layer_id_override: Optional[int] = None,
    ) -> None:
        """Write one layer's K/V rows for T tokens: rows ``loc[t]`` of the layer's code and scale
        buffers become SGLang's KV FP4 of ``cache_k[t] / k_scale`` and ``cache_v[t] / v_scale``.

        Parameters
        ----------
        layer : an object with ``.layer_id`` (global id), or None with ``layer_id_override``.
        loc : Tensor [T], int32/int64, on the pool's device. ``loc[t] < 0`` writes nothing;
            ``loc[t] >= size + page_size`` is never written (IndexError under ``validate``).
        cache_k, cache_v : Tensor [T, head_num, head_dim] / [T, head_num, v_head_dim], bf16/fp16/fp32,
            any strides. Never modified.
        k_scale, v_scale : None (1), a positive float, or a float tensor with one element or one per
            head. The input is divided by it in float32 and rounded back to its own dtype before it
            is quantized (SGLang's order; SGLang divides in place).
        layer_id_override : global layer id; takes precedence over ``layer.layer_id``.

        Raises
        ------
        TypeError, ValueError, IndexError
            On malformed arguments, before anything is written.
        FusedPathUnavailable
            With ``fused="always"``, when the gate refuses the write (a scale), before anything is
            written.
        """
        i = self._write_index(layer, layer_id_override)
        h, dev = self.head_num, self.device
        check_rows(cache_k, "cache_k", h, self.head_dim, dev)
        check_rows(cache_v, "cache_v", h, self.v_head_dim, dev)
        if cache_v.shape[0] != cache_k.shape[0]:
            raise ValueError(f"cache_v must have T={cache_k.shape[0]} tokens (cache_k's), got {cache_v.shape[0]}")
        check_loc(loc, "loc", cache_k.shape[0], dev)
        k_scale = check_scale(k_scale, "k_scale", h, dev)
        v_scale = check_scale(v_scale, "v_scale", h, dev)
        if self.validate:
            check_values(loc, "loc", self.rows, k_scale, v_scale)
        write_fp4(
            self.fused_verdict, self.fused_mode, self.stats, cache_k, cache_v,
            (self.k_buffer[i], self.k_scale_buffer[i]), (self.v_buffer[i], self.v_scale_buffer[i]),
            loc, fp4_scale_tensor(k_scale, h, dev), fp4_scale_tensor(v_scale, h, dev),
        )  # fmt: skip
