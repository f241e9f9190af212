"""``MHATokenToKVPoolFP4``: SGLang's FP4 K/V pool, in either of SGLang's FP4 formats: per layer
packed e2m1 K and V rows and their scale bytes, one per 16 elements (exponent scales, or, for
two-level NVFP4, e4m3 block scales with a float32 global scale per layer for K and for V); writes
quantize as the format's quantizer does, the getters dequantize, and a reader hands attention
backends the stored bytes. The formats and the rules are in docs/contract.md, "FP4 pools"."""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch

from kvpool.config import fused_mode
from kvpool.kernels.fused_path import check_always
from kvpool.kernels.store_fp4 import FP4_BLOCK, FP4_DTYPE, dequantize_fp4, fp4_scale_tensor
from kvpool.kernels.store_fp4.writer import fp4_cache_verdict, write_fp4
from kvpool.kernels.store_kv.checks import check_loc, check_rows, check_scale, check_values
from kvpool.kernels.store_kv.writer import PathStats
from kvpool.kernels.store_nvfp4 import dequantize_nvfp4
from kvpool.kernels.store_nvfp4.writer import write_nvfp4
from kvpool.pools.base import HasLayerId, check_sglang_keywords, head_geometry
from kvpool.pools.fp4_base import FP4_DTYPE_NAME, Fp4KVCache, fp4_dim
from kvpool.pools.nvfp4_scales import NVFP4, check_global_scale_arg, fp4_format_of, global_scale_list
from kvpool.write_types import Scale


class Fp4Layer(NamedTuple):
    """One layer's stored FP4 buffers (views of the pool's memory, never copies)."""

    k: torch.Tensor  # [rows, H, D // 2] uint8, two e2m1 codes a byte (element 2j in the low nibble)
    v: torch.Tensor  # [rows, H, Dv // 2] uint8
    k_scale: torch.Tensor  # [rows, H * D // 16] uint8, 2 ** (byte - 127) per 16 elements of the row
    v_scale: torch.Tensor  # [rows, H * Dv // 16] uint8


class Nvfp4Layer(NamedTuple):
    """One layer's stored NVFP4 buffers and global scales (views of the pool's memory, never copies)."""

    k: torch.Tensor  # [rows, H, D // 2] uint8, two e2m1 codes a byte (element 2j in the low nibble)
    v: torch.Tensor  # [rows, H, Dv // 2] uint8
    k_scale: torch.Tensor  # [rows, H, D // 16] uint8, e4m3fn block scales
    v_scale: torch.Tensor  # [rows, H, Dv // 16] uint8
    k_global_scale: torch.Tensor  # [1] float32: K values are e2m1 * block scale * this
    v_global_scale: torch.Tensor  # [1] float32


class MHATokenToKVPoolFP4(Fp4KVCache):
    """SGLang's FP4 K/V cache buffers for the attention layers ``[start_layer, end_layer]`` of one rank.

    Per layer, zeroed: ``k_buffer`` ``[size + page_size, head_num, head_dim // 2]`` and ``v_buffer``
    ``[.., head_num, v_head_dim // 2]`` of uint8 (two e2m1 codes a byte), ``k_scale_buffer``
    ``[size + page_size, head_num * head_dim // 16]`` and ``v_scale_buffer`` ``[.., head_num *
    v_head_dim // 16]`` of uint8 exponent scales, one per 16 elements of the flattened row. With
    ``fp4_format="nvfp4"`` the scale buffers are ``[size + page_size, head_num, head_dim // 16]``
    (and ``v_head_dim``) of e4m3fn block scales, and ``k_global_scales`` / ``v_global_scales``
    ``[layer_num]`` float32 tensors hold each layer's global scales. The layouts are SGLang's (which
    has ``v_head_dim == head_dim``). Slot 0 is the padding slot.

    The positional order of the arguments is SGLang's ``MHATokenToKVPool``'s.

    Parameters
    ----------
    size, page_size, head_num, layer_num, device, start_layer, end_layer : as ``MHATokenToKVPool``.
    dtype : ``torch.float4_e2m1fn_x2`` (SGLang's), or ``"fp4_e2m1"`` (also on a torch without it), or
        ``"nvfp4"`` (SGLang's ``--kv-cache-dtype`` name of two-level NVFP4: ``fp4_format="nvfp4"``).
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
    fp4_format : ``"fp4_mx_block16"`` (exponent scales; the default) or ``"nvfp4"`` (two-level
        NVFP4); None takes it from ``dtype``.
    k_global_scales, v_global_scales : NVFP4 only: each layer's global scale, a positive normal
        float for every layer or a sequence of ``layer_num`` of them, from the checkpoint's per-layer
        KV scales as SGLang loads them (default 1.0; :meth:`set_global_scales` sets them later).

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
        fp4_format: Optional[str] = None,
        k_global_scales: object = None,
        v_global_scales: object = None,
    ) -> None:
        check_sglang_keywords(enable_memory_saver, enable_alt_stream, enable_kv_cache_copy)
        self.fp4_format = fp4_format_of(dtype, fp4_format)
        if dtype == NVFP4:
            dtype = FP4_DTYPE if FP4_DTYPE is not None else FP4_DTYPE_NAME
        nvfp4 = self.fp4_format == NVFP4
        if not nvfp4 and (k_global_scales is not None or v_global_scales is not None):
            raise ValueError(f"k_global_scales/v_global_scales are for fp4_format='nvfp4', got fp4_format={self.fp4_format!r}")
        super().__init__(size, page_size, dtype, layer_num, device, start_layer, end_layer, validate)
        self.head_num, self.head_dim, self.v_head_dim = head_geometry(
            head_num, head_dim, v_head_dim, swa_head_num, swa_head_dim, swa_v_head_dim, fp4_dim
        )
        if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"out_dtype must be torch.bfloat16, torch.float16 or torch.float32, got {out_dtype}")
        self.out_dtype = out_dtype
        h, d, dv = self.head_num, self.head_dim, self.v_head_dim
        ks, vs = ((h, d // FP4_BLOCK), (h, dv // FP4_BLOCK)) if nvfp4 else ((h * d // FP4_BLOCK,), (h * dv // FP4_BLOCK,))
        self._init_parts({
            "k_buffer": self._new_buffer((h, d // 2), torch.uint8),
            "v_buffer": self._new_buffer((h, dv // 2), torch.uint8),
            "k_scale_buffer": self._new_buffer(ks, torch.uint8),
            "v_scale_buffer": self._new_buffer(vs, torch.uint8),
        })  # fmt: skip
        self.k_global_scales: Optional[torch.Tensor] = None
        self.v_global_scales: Optional[torch.Tensor] = None
        if nvfp4:
            k_values = global_scale_list(k_global_scales, "k_global_scales", self.layer_num)
            v_values = global_scale_list(v_global_scales, "v_global_scales", self.layer_num)
            #: Each layer's K and V global scales, [layer_num] float32 on the device (layer i - start_layer).
            self.k_global_scales = torch.tensor(k_values, dtype=torch.float32, device=self.device)
            self.v_global_scales = torch.tensor(v_values, dtype=torch.float32, device=self.device)
            self.global_scale_values = tuple(zip(k_values, v_values))
        self.fused_mode = fused_mode(fused)
        #: The gate's verdict on these buffers, ``(eligible, reason)``; the scales decide the rest.
        self.fused_verdict = fp4_cache_verdict(self.device, d, dv, self.fused_mode)
        check_always(self.fused_mode, self.fused_verdict)
        #: Writes per path, and why the reference path ran.
        self.stats = PathStats()

    # --- readers ---------------------------------------------------------------------------------

    def get_fp4_buffers(self, layer_id: int) -> Union[Fp4Layer, Nvfp4Layer]:
        """The stored codes and scale bytes of global layer ``layer_id`` (an NVFP4 pool's with its
        global scales), for attention kernels that read FP4 directly: views of the pool's memory,
        never copies."""
        i = self._wait_layer(layer_id)
        if self.fp4_format == NVFP4:
            return Nvfp4Layer(*self._parts[i], *self._global_scales(i))
        return Fp4Layer(*self._parts[i])

    def _global_scales(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.k_global_scales is not None and self.v_global_scales is not None
        return self.k_global_scales[i : i + 1], self.v_global_scales[i : i + 1]

    def _dequantized(self, i: int, codes: list[torch.Tensor], scales: list[torch.Tensor], j: int) -> torch.Tensor:
        """Layer index ``i``'s K (``j = 0``) or V (``j = 1``) rows dequantized in the pool's format."""
        if self.fp4_format == NVFP4:
            return dequantize_nvfp4(codes[i], scales[i], self._global_scales(i)[j], self.out_dtype)
        return dequantize_fp4(codes[i], scales[i], self.out_dtype)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """Global layer ``layer_id``'s K rows dequantized, [rows, head_num, head_dim] of
        ``out_dtype``: a new tensor (SGLang's getter for reference attention)."""
        return self._dequantized(self._wait_layer(layer_id), self.k_buffer, self.k_scale_buffer, 0)

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """Global layer ``layer_id``'s V rows dequantized, as :meth:`get_key_buffer`."""
        return self._dequantized(self._wait_layer(layer_id), self.v_buffer, self.v_scale_buffer, 1)

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of global layer ``layer_id`` dequantized, with one wait."""
        i = self._wait_layer(layer_id)
        return (
            self._dequantized(i, self.k_buffer, self.k_scale_buffer, 0),
            self._dequantized(i, self.v_buffer, self.v_scale_buffer, 1),
        )

    def set_global_scales(self, layer_id: int, k_scale: float, v_scale: float) -> None:
        """An NVFP4 pool's global scales of global layer ``layer_id`` (as SGLang loads a checkpoint's
        per-layer KV scales). Rows already written keep their bytes and are read with the new
        scales, so set them before the layer is written. No synchronisation.

        Raises
        ------
        ValueError
            On a pool of another format, or a scale that is not a positive normal float32; nothing
            changes.
        IndexError
            For a ``layer_id`` outside the pool's layers.
        """
        if self.fp4_format != NVFP4:
            raise ValueError(f"set_global_scales is for fp4_format='nvfp4', got fp4_format={self.fp4_format!r}")
        i = self._write_index(None, layer_id)
        k = global_scale_list(k_scale, "k_scale", 1)[0]
        v = global_scale_list(v_scale, "v_scale", 1)[0]
        k_global, v_global = self._global_scales(i)
        k_global.fill_(k)
        v_global.fill_(v)
        values = list(self.global_scale_values)
        values[i] = (k, v)
        self.global_scale_values = tuple(values)

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
            is quantized (SGLang's order; SGLang divides in place). NVFP4: the layer's global scale
            is the scale, and a given one must be it (a float: checked on every call; a
            one-element tensor: under ``validate``).
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
        if self.fp4_format == NVFP4:
            kg, vg = self._global_scales(i)
            (k_known, v_known) = self.global_scale_values[i]
            check_global_scale_arg(k_scale, "k_scale", k_known, kg, dev, self.validate)
            check_global_scale_arg(v_scale, "v_scale", v_known, vg, dev, self.validate)
            if self.validate:
                check_values(loc, "loc", self.rows, None, None)
            write_nvfp4(
                self.fused_verdict, self.fused_mode, self.stats, cache_k, cache_v,
                (self.k_buffer[i], self.k_scale_buffer[i]), (self.v_buffer[i], self.v_scale_buffer[i]), loc, kg, vg,
            )  # fmt: skip
            return
        k_scale = check_scale(k_scale, "k_scale", h, dev)
        v_scale = check_scale(v_scale, "v_scale", h, dev)
        if self.validate:
            check_values(loc, "loc", self.rows, k_scale, v_scale)
        write_fp4(
            self.fused_verdict, self.fused_mode, self.stats, cache_k, cache_v,
            (self.k_buffer[i], self.k_scale_buffer[i]), (self.v_buffer[i], self.v_scale_buffer[i]),
            loc, fp4_scale_tensor(k_scale, h, dev), fp4_scale_tensor(v_scale, h, dev),
        )  # fmt: skip
