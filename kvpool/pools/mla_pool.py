"""``MLATokenToKVPool``: one latent row per token and layer, for multi-head latent attention
(DeepSeek-V2/V3/R1, Kimi K2): ``kv_lora_rank`` latent values then ``qk_rope_head_dim`` rotary key
values, in one buffer ``[size + page_size, 1, kv_lora_rank + qk_rope_head_dim]`` per layer.

Writes and row copies see a row as one head with a K part (the latent columns) and a V part (the
rotary columns), two strided views of the buffer: the write is the MHA write's kernel over those two
caches (one launch for both entry points, one ``k_scale``), and CPU copies, the host tier and
transfers move the two parts byte for byte; getters and ``move_kv_cache`` see whole rows. The rules
are in docs/contract.md, "MLATokenToKVPool".
"""

from __future__ import annotations

from typing import Optional

import torch

from kvpool.checks import check_in_range, check_index, layer_index, positive_int
from kvpool.kernels.formats import bits_dtype
from kvpool.kernels.store_kv.checks import check_rows, check_write
from kvpool.kernels.store_kv.op import store_kv_op
from kvpool.pools.base import HasLayerId, KVCache, check_sglang_keywords
from kvpool.write_types import ArgNames, Geometry, Scale

#: Argument names for errors: the latent row's two halves share ``k_scale`` (``v_scale`` is ignored).
ROW_NAMES = ArgNames("cache_k", "cache_k", "loc", "k_scale", "k_scale")
PARTS_NAMES = ArgNames("cache_k_nope", "cache_k_rope", "loc", "k_scale", "k_scale")

#: Whether torch.compile is tracing the caller (bound once: one call, no attribute lookups).
_is_compiling = torch.compiler.is_compiling


class MLATokenToKVPool(KVCache):
    """Latent KV-cache buffers for the MLA layers ``[start_layer, end_layer]`` of one rank.

    Each layer owns one buffer ``[size + page_size, 1, kv_lora_rank + qk_rope_head_dim]``, zeroed.
    Slot 0 is the padding slot: padded tokens of a CUDA-graph batch may write there, and no allocator
    hands it out. FP8 buffers are stored as uint8 (``store_dtype``); the getters return ``dtype``
    views of the same memory.

    The positional order of the arguments is SGLang's, so SGLang call sites carry over.

    Parameters
    ----------
    size : usable slots (the allocators hand out ``1..size``).
    page_size : slots per page; the buffers carry ``page_size`` extra rows, as SGLang's do.
    dtype : cache element type: ``torch.float8_e4m3fn``, ``torch.float8_e5m2``, ``torch.bfloat16``,
        ``torch.float16``, ``torch.float32``, or the MI300-class FP8 formats
        ``torch.float8_e4m3fnuz`` and ``torch.float8_e5m2fnuz``.
    kv_lora_rank : latent values per token (DeepSeek-V3: 512).
    qk_rope_head_dim : rotary key values per token, stored after the latent ones (DeepSeek-V3: 64).
    layer_num : layers held by this rank (pipeline parallelism: consecutive global ids).
    device : where the buffers live. ``"cpu"`` works (reference path only). On CUDA, writes launch
        on the current device.
    enable_memory_saver : SGLang's; must be False (kvpool has no memory saver).
    start_layer, end_layer : global id of the first and last layer held, both included;
        ``start_layer`` defaults to 0 and ``end_layer`` to ``start_layer + layer_num - 1``.
    use_nsa : SGLang's sparse-attention (NSA) cache layout; must be False (not provided here).
    override_kv_cache_dim : SGLang's; None or ``kv_lora_rank + qk_rope_head_dim`` (the row width
        is not configurable here).
    fused, warmup, validate, observe_amax : as for ``MHATokenToKVPool``.

    Attributes
    ----------
    kv_lora_rank, qk_rope_head_dim, kv_cache_dim : the row's parts and its width (SGLang's names).
    kv_buffer : per layer, the storage (``store_dtype``) of the layer's rows (SGLang's name).
    head_num, head_dim, v_head_dim : 1, ``kv_lora_rank``, ``qk_rope_head_dim``: the row as the write
        kernel and the row copies see it, one head with a K part (the latent columns) and a V part
        (the rotary columns). SGLang's MLA pool has none of these names; note that ``head_dim`` is
        not the row width, and that ``get_value_buffer`` (the latent columns, SGLang's meaning) is
        the K part here.
    k_buffer, v_buffer : per layer, the storage views of the latent and of the rotary columns of
        ``kv_buffer`` (the K and V parts above).
    row_table : the row table over ``K0, V0, K1, V1, ...`` of those parts (as ``MHATokenToKVPool``'s).

    Examples
    --------
    >>> pool = MLATokenToKVPool(4096, 1, torch.float8_e4m3fn, kv_lora_rank=512, qk_rope_head_dim=64,
    ...                         layer_num=2, device="cpu")
    >>> nope = torch.randn(3, 1, 512, dtype=torch.bfloat16)
    >>> rope = torch.randn(3, 1, 64, dtype=torch.bfloat16)
    >>> pool.set_mla_kv_buffer(None, torch.tensor([1, 2, 3]), nope, rope, k_scale=0.1, layer_id_override=0)
    >>> pool.get_key_buffer(0).shape, pool.get_value_buffer(0).shape
    (torch.Size([4097, 1, 576]), torch.Size([4097, 1, 512]))
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
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
        warmup: bool = True,
        validate: bool = False,
        observe_amax: bool = False,
    ) -> None:
        check_sglang_keywords(enable_memory_saver)
        if use_nsa is not False:
            raise ValueError(
                f"use_nsa must be False: kvpool has no NSA (sparse attention) cache layout, got {use_nsa!r}"
            )
        super().__init__(size, page_size, dtype, layer_num, device, start_layer, end_layer, fused, validate)
        self.kv_lora_rank = positive_int(kv_lora_rank, "kv_lora_rank")
        self.qk_rope_head_dim = positive_int(qk_rope_head_dim, "qk_rope_head_dim")
        #: Elements of one slot's latent row (SGLang's name).
        self.kv_cache_dim = self.kv_lora_rank + self.qk_rope_head_dim
        if override_kv_cache_dim is not None and override_kv_cache_dim != self.kv_cache_dim:
            raise ValueError(
                f"override_kv_cache_dim must be None or kv_lora_rank + qk_rope_head_dim = {self.kv_cache_dim}, "
                f"got {override_kv_cache_dim!r}"
            )
        self._row_shape = (1, self.kv_cache_dim)
        self._split = (self.kv_lora_rank, self.qk_rope_head_dim)

        r = self.kv_lora_rank
        self.kv_buffer = [
            torch.zeros((self.rows, 1, self.kv_cache_dim), dtype=self.store_dtype, device=self.device)
            for _ in range(self.layer_num)
        ]
        # Writes and row copies see each row as one head: a K part (the latent columns) and a V part
        # (the rotary columns); getters and moves see whole rows.
        self.head_num, self.head_dim, self.v_head_dim = 1, self.kv_lora_rank, self.qk_rope_head_dim
        self._init_rows([b[:, :, :r] for b in self.kv_buffer], [b[:, :, r:] for b in self.kv_buffer], self.kv_buffer)
        self._init_writer(
            Geometry(dtype, 1, r, 1, self.qk_rope_head_dim, self.device),
            self.k_buffer[0].stride(), self.v_buffer[0].stride(),
        )  # fmt: skip
        self._warm = bool(warmup)
        if observe_amax:
            self.observe_amax(True)  # warms the observing variants (with warmup)
        elif warmup:
            self._warmup()

    # --- getters (SGLang names) ------------------------------------------------------------------

    def get_kv_size_bytes(self) -> int:
        """Bytes held by all layer buffers (one number: MLA has no separate V buffer, as in SGLang)."""
        return sum(b.numel() * b.element_size() for b in self.kv_buffer)

    def get_mla_kv_buffer(
        self, layer: HasLayerId, loc: torch.Tensor, dst_dtype: Optional[torch.dtype] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather the latent rows of slots ``loc``: ``(k_nope [T, 1, kv_lora_rank], k_rope [T, 1,
        qk_rope_head_dim])``, new contiguous tensors.

        The stored bytes come back as they are, in ``dtype`` (FP8 stays FP8); with ``dst_dtype`` the
        values are cast with a plain ``.to(dst_dtype)`` (no scale is applied: multiply by the write's
        ``k_scale`` to dequantize). A slot outside ``0..size + page_size - 1`` (negative: padding)
        reads as a row of zero bytes; under ``validate`` a slot past the end raises IndexError.
        No synchronisation (unless ``validate``).

        Parameters
        ----------
        layer : an object with ``.layer_id`` (global id).
        loc : Tensor [T], int32/int64, on the pool's device.
        dst_dtype : None (the pool's ``dtype``) or a floating dtype to cast to.

        Raises
        ------
        TypeError, ValueError, IndexError
            On a bad layer, ``loc`` or ``dst_dtype``.
        """
        layer_id = getattr(layer, "layer_id", None)
        if layer_id is None:
            raise TypeError(f"layer must have a .layer_id attribute, got {type(layer).__name__}")
        i = layer_index(layer_id, self.start_layer, self.end_layer)
        check_index(loc, "loc", device=self.device, dims="[T]")
        if dst_dtype is not None and not (isinstance(dst_dtype, torch.dtype) and dst_dtype.is_floating_point):
            raise ValueError(f"dst_dtype must be None or a floating torch.dtype, got {dst_dtype!r}")
        if self.validate:
            check_in_range([(loc, self.rows, "loc")], what="slots")
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(i)
        slots = loc.to(torch.int64)
        valid = (slots >= 0) & (slots < self.rows)
        index = torch.where(valid, slots, 0)  # every index in range: no device-side assert, no sync
        invalid = ~valid[:, None, None]
        bits = bits_dtype(self.dtype)
        out = []
        for part in (self._k_views[i], self._v_views[i]):
            gathered = part.view(bits).index_select(0, index)
            gathered.masked_fill_(invalid, 0)
            gathered = gathered.view(self.dtype)
            out.append(gathered if dst_dtype is None or dst_dtype == self.dtype else gathered.to(dst_dtype))
        return out[0], out[1]

    # --- writes ----------------------------------------------------------------------------------

    def set_kv_buffer(
        self,
        layer: Optional[HasLayerId],
        loc: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: object = None,
        k_scale: Scale = None,
        v_scale: Scale = None,
        layer_id_override: Optional[int] = None,
    ) -> None:
        """Write one layer's latent rows for T tokens: row ``loc[t]`` of the layer's buffer becomes
        ``q(cache_k[t], k_scale)``, exactly as ``MHATokenToKVPool.set_kv_buffer`` writes a K row.

        Parameters
        ----------
        layer : an object with ``.layer_id`` (global id), or None with ``layer_id_override``.
        loc : Tensor [T], int32/int64, on the pool's device. ``loc[t] < 0`` is a padding token (write
            nothing); ``loc[t] >= size + page_size`` is never written (IndexError under validate).
        cache_k : Tensor [T, 1, kv_lora_rank + qk_rope_head_dim], bf16/fp16/fp32, any strides (the
            latent part first, then the rotary part). Never modified.
        cache_v : ignored, as in SGLang (the latent row is the whole cache entry).
        k_scale : None (1), a positive float, or a float tensor with one element, for the whole row.
            Read on the device when the kernel runs. Ignored by 16-bit and fp32 pools.
        v_scale : ignored (there is no separate V).
        layer_id_override : global layer id; takes precedence over ``layer.layer_id``.

        Raises
        ------
        TypeError, ValueError, IndexError
            On malformed arguments, before anything is written.
        FusedPathUnavailable
            With ``fused="always"``, when the gate refuses the write.

        No host-device synchronisation (unless ``validate``), no device allocation on the fused path,
        safe to capture in a CUDA graph and to call from ``torch.compile(fullgraph=True)`` code.
        """
        i = self._write_index(layer, layer_id_override)
        if type(cache_k) is not torch.Tensor or cache_k.shape[1:] != self._row_shape:
            # Check the row as the caller passed it, so errors name cache_k and its full width.
            check_rows(cache_k, "cache_k", 1, self.kv_cache_dim, self.device)
        nope, rope = cache_k.split(self._split, dim=2)  # two views, no copy
        if _is_compiling():
            self._write_compiled(i, loc, nope, rope, k_scale, ROW_NAMES)
            return
        self._writer.write(
            self.k_buffer[i], self.v_buffer[i], loc, nope, rope, k_scale, k_scale, ROW_NAMES,
            self._amax_views[i] if self._observing else None,  # type: ignore[index]
        )  # fmt: skip

    def set_mla_kv_buffer(
        self,
        layer: Optional[HasLayerId],
        loc: torch.Tensor,
        cache_k_nope: torch.Tensor,
        cache_k_rope: torch.Tensor,
        k_scale: Scale = None,
        layer_id_override: Optional[int] = None,
    ) -> None:
        """Write one layer's latent rows from their two parts, without concatenating them: row
        ``loc[t]`` becomes ``q(concat(cache_k_nope[t], cache_k_rope[t]), k_scale)``, in one launch.

        Parameters
        ----------
        layer, loc, k_scale, layer_id_override : as for :meth:`set_kv_buffer`.
        cache_k_nope : Tensor [T, 1, kv_lora_rank], bf16/fp16/fp32, any strides. Never modified.
        cache_k_rope : Tensor [T, 1, qk_rope_head_dim], bf16/fp16/fp32, any strides (a slice of the
            projection output needs no copy). Never modified.

        Raises
        ------
        TypeError, ValueError, IndexError, FusedPathUnavailable
            As for :meth:`set_kv_buffer`, naming ``cache_k_nope`` or ``cache_k_rope``.
        """
        i = self._write_index(layer, layer_id_override)
        if _is_compiling():
            self._write_compiled(i, loc, cache_k_nope, cache_k_rope, k_scale, PARTS_NAMES)
            return
        self._writer.write(
            self.k_buffer[i], self.v_buffer[i], loc, cache_k_nope, cache_k_rope, k_scale, k_scale,
            PARTS_NAMES, self._amax_views[i] if self._observing else None,  # type: ignore[index]
        )  # fmt: skip

    def _write_compiled(
        self, i: int, loc: torch.Tensor, nope: torch.Tensor, rope: torch.Tensor, k_scale: Scale, names: ArgNames
    ) -> None:
        """The write as traced by torch.compile: the metadata checks, then the one custom op, given
        the two column views of the layer's buffer as its two caches (it declares both mutated)."""
        checked = check_write(self._writer.geometry, nope, rope, loc, k_scale, k_scale, names)
        store_kv_op(
            nope, rope, self._k_views[i], self._v_views[i], loc,
            checked.k_scale, checked.v_scale, self.fused_mode, self._amax_for(i),
        )  # fmt: skip

    # --- warmup ----------------------------------------------------------------------------------

    def _warmup_write(self, in_dtype: torch.dtype, loc_dtype: torch.dtype, scale: Scale, tokens: int) -> None:
        # Contiguous [tokens, 1, kv_cache_dim] rows split in two: their parts have the strides (all
        # multiples of 16 for DeepSeek's 512 + 64) that Triton specializes on for both entry points.
        dev = self.device
        row = torch.zeros((tokens, 1, self.kv_cache_dim), dtype=in_dtype, device=dev)
        nope, rope = row.split(self._split, dim=2)
        loc = self._warmup_loc(tokens, loc_dtype)
        self._writer.write(self.k_buffer[0], self.v_buffer[0], loc, nope, rope, scale, scale, ROW_NAMES, self._amax_for(0))

    # --- calibration -----------------------------------------------------------------------------

    def _amax_heads(self) -> tuple[int, int]:
        return 1, 1  # index 0: the latent part, index 1: the rotary part

    def calibrated_scales(
        self, margin: float = 1.0, per_head: bool = False, dtype: Optional[torch.dtype] = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One KV scale per layer from the observed maxima, as ``MHATokenToKVPool.calibrated_scales``
        computes them, for the whole latent row: the latent and rotary parts share the one
        ``k_scale`` of a write, so the scale covers the larger of their maxima.

        Returns a list (index ``layer_id - start_layer``) of pairs ``(s, s)`` holding the same [1]
        float32 tensor twice, so ``set_kv_buffer(layer, loc, cache_k, None, *scales[i])`` and
        ``set_mla_kv_buffer(layer, loc, nope, rope, scales[i][0])`` both work. ``per_head`` changes
        nothing (the row is one head). ``kv_amax`` keeps the two maxima apart ([layer, 2, 1]:
        latent, rotary).
        """
        pairs = super().calibrated_scales(margin, per_head, dtype)
        # float32(amax * factor) clamped below is monotone in amax, so the larger scale is the scale
        # of the larger maximum.
        return [(s, s) for s in (torch.maximum(k, v) for k, v in pairs)]
