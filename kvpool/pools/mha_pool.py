"""``MHATokenToKVPool``: per-layer K/V buffers and the writes every attention layer calls; the
getters, moves and CPU copies come from the pool base. The rules are in docs/contract.md, "Pools"."""

from __future__ import annotations

from typing import Optional

import torch

from kvpool.checks import check_index
from kvpool.kernels.formats import LOC_DTYPES
from kvpool.kernels.store_kv.checks import check_write
from kvpool.kernels.store_kv.op import store_kv_op
from kvpool.kernels.store_kv.layout import translate_slots
from kvpool.pools.base import HasLayerId, KVCache, check_sglang_keywords, head_geometry
from kvpool.write_types import POOL_NAMES, ArgNames, Geometry, Scale

PREFIX_NAMES = ArgNames("cache_k", "cache_v", "loc_2d")

#: Whether torch.compile is tracing the caller (bound once: one call, no attribute lookups).
_is_compiling = torch.compiler.is_compiling


def check_slot_map(slot_map: object, device: torch.device) -> None:
    """``slot_map`` a one-dimensional int64 tensor on ``device`` (a write's slot map)."""
    if type(slot_map) is torch.Tensor and slot_map.dtype is torch.int64 and slot_map.dim() == 1 and slot_map.device == device:
        return
    check_index(slot_map, "slot_map", dtypes=(torch.int64,), ndim=1, device=device, dims="[M]", per="one per slot of loc's pool")


class MHATokenToKVPool(KVCache):
    """K/V cache buffers for the attention layers ``[start_layer, end_layer]`` of one rank.

    Each layer owns a K buffer ``[size + page_size, head_num, head_dim]`` and a V buffer
    ``[size + page_size, head_num, v_head_dim]``, zeroed. Slot 0 is the padding slot: padded tokens of
    a CUDA-graph batch may write there, and no allocator hands it out. FP8 buffers are stored as uint8
    (``store_dtype``); the getters return ``dtype`` views of the same memory.

    The positional order of the arguments is SGLang's, so SGLang call sites carry over.

    Parameters
    ----------
    size : usable slots (the allocators hand out ``1..size``).
    page_size : slots per page; the buffers carry ``page_size`` extra rows, as SGLang's do.
    dtype : cache element type: ``torch.float8_e4m3fn``, ``torch.float8_e5m2``, ``torch.bfloat16``,
        ``torch.float16``, ``torch.float32``, or the MI300-class FP8 formats
        ``torch.float8_e4m3fnuz`` and ``torch.float8_e5m2fnuz``.
    head_num, head_dim : KV heads on this rank and the K head dim.
    layer_num : layers held by this rank (pipeline parallelism: consecutive global ids).
    device : where the buffers live. ``"cpu"`` works (reference path only). On CUDA, writes launch
        on the current device, so a pool on ``cuda:i`` is written while ``cuda:i`` is current, as in
        an engine process that calls ``torch.cuda.set_device(rank)`` once.
    enable_memory_saver : SGLang's; must be False (kvpool has no memory saver).
    v_head_dim : V head dim (default ``head_dim``).
    swa_head_num, swa_head_dim, swa_v_head_dim : SGLang's sliding-window geometry; when given they
        replace ``head_num``, ``head_dim`` and ``v_head_dim``, as in SGLang.
    start_layer, end_layer : global id of the first and last layer held, both included;
        ``start_layer`` defaults to 0 and ``end_layer`` to ``start_layer + layer_num - 1``.
    enable_alt_stream, enable_kv_cache_copy : SGLang's; accepted, no effect (kvpool writes K and V
        in one launch, and ``move_kv_cache`` is always available).
    fused : ``"auto"`` (fused kernel when the gate allows, else reference), ``"always"`` (raise
        ``FusedPathUnavailable`` with the gate's reason instead of falling back), ``"never"``.
        ``KVPOOL_FUSED`` overrides it.
    warmup : on CUDA, compile at construction the kernel variants of contiguous (or QKV-sliced)
        inputs for every input dtype, loc dtype and scale kind (None, float, one-element tensor).
        Per-head scale tensors, verify writes and unusual input strides compile on their first call.
    validate : check slot range and scale values on every write (one synchronisation each);
        ``KVPOOL_VALIDATE=1`` turns it on too.
    observe_amax : start observing per-head maxima for calibration (see ``observe_amax()``).

    Attributes
    ----------
    k_buffer, v_buffer : per layer, the storage (``store_dtype``) of the K and V rows.
    row_table : a :class:`~kvpool.kernels.copy_rows.RowTable` over the storage buffers ``K0, V0,
        K1, V1, ...`` (layer ``i`` is ``row_table.select(2 * i, 2 * i + 2)``): moves, CPU copies,
        the host tier and transfers copy rows of every layer over it in one launch.

    Examples
    --------
    >>> pool = MHATokenToKVPool(4096, 1, torch.float8_e4m3fn, head_num=8, head_dim=128,
    ...                         layer_num=2, device="cpu")
    >>> k = torch.randn(3, 8, 128, dtype=torch.bfloat16)
    >>> pool.set_kv_buffer(None, torch.tensor([1, 2, 3]), k, k, k_scale=0.1, layer_id_override=0)
    >>> pool.get_key_buffer(0).shape, pool.get_key_buffer(0).dtype
    (torch.Size([4097, 8, 128]), torch.float8_e4m3fn)
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
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
        warmup: bool = True,
        validate: bool = False,
        observe_amax: bool = False,
    ) -> None:
        check_sglang_keywords(enable_memory_saver, enable_alt_stream, enable_kv_cache_copy)
        super().__init__(size, page_size, dtype, layer_num, device, start_layer, end_layer, fused, validate)
        self.head_num, self.head_dim, self.v_head_dim = head_geometry(
            head_num, head_dim, v_head_dim, swa_head_num, swa_head_dim, swa_v_head_dim
        )
        #: Elements of one slot's K row and V row (SGLang's names).
        self.row_dim = self.head_num * self.head_dim
        self.v_row_dim = self.head_num * self.v_head_dim

        rows = self.rows
        k_buffer = [
            torch.zeros((rows, self.head_num, self.head_dim), dtype=self.store_dtype, device=self.device)
            for _ in range(self.layer_num)
        ]
        v_buffer = [
            torch.zeros((rows, self.head_num, self.v_head_dim), dtype=self.store_dtype, device=self.device)
            for _ in range(self.layer_num)
        ]
        self._init_rows(k_buffer, v_buffer)
        self._init_writer(
            Geometry(dtype, self.head_num, self.head_dim, self.head_num, self.v_head_dim, self.device),
            self.k_buffer[0].stride(), self.v_buffer[0].stride(),
        )  # fmt: skip
        self._warm = bool(warmup)
        if observe_amax:
            self.observe_amax(True)  # warms the observing variants (with warmup)
        elif warmup:
            self._warmup()

    # --- getters (SGLang names) ------------------------------------------------------------------

    def get_kv_size_bytes(self) -> tuple[int, int]:
        """Bytes held by all K buffers and by all V buffers."""
        k = sum(b.numel() * b.element_size() for b in self.k_buffer)
        v = sum(b.numel() * b.element_size() for b in self.v_buffer)
        return k, v

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
        *,
        slot_map: Optional[torch.Tensor] = None,
    ) -> None:
        """Write one layer's K/V rows for T tokens: row ``loc[t]`` of the layer's buffers becomes
        ``q(cache_k[t], k_scale)`` and ``q(cache_v[t], v_scale)`` (docs/contract.md, "The write").

        Parameters
        ----------
        layer : an object with ``.layer_id`` (global id), or None with ``layer_id_override``.
        loc : Tensor [T], int32/int64, on the pool's device. ``loc[t] < 0`` is a padding token (write
            nothing); ``loc[t] >= size + page_size`` is never written (IndexError under validate).
        cache_k, cache_v : Tensor [T, head_num, head_dim] / [T, head_num, v_head_dim], bf16/fp16/fp32,
            any strides. Never modified.
        k_scale, v_scale : None (1), a positive float, or a float tensor with one element or one per
            head. Read on the device when the kernel runs (so a CUDA graph replays the current value).
            Ignored by 16-bit and fp32 pools.
        layer_id_override : global layer id; takes precedence over ``layer.layer_id``.
        slot_map : Tensor [M] int64 on the pool's device, or None. When given, ``loc`` holds another
            pool's slots and token ``t`` goes to row ``slot_map[loc[t]]`` (nothing for an entry
            outside ``[0, M)``): ``SWAKVPool``'s sliding-window layers pass the full-to-SWA mapping,
            which the fused kernel reads in the same launch.

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
        if slot_map is not None:
            check_slot_map(slot_map, self.device)
        if _is_compiling():
            if slot_map is not None:
                check_index(loc, "loc", dims="[T]", dtypes=LOC_DTYPES, device=self.device)
                loc = translate_slots(slot_map, loc)
            self._write_compiled(i, loc, cache_k, cache_v, k_scale, v_scale)
            return
        self._writer.write(
            self.k_buffer[i], self.v_buffer[i], loc, cache_k, cache_v, k_scale, v_scale, POOL_NAMES,
            self._amax_views[i] if self._observing else None, slot_map=slot_map,  # type: ignore[index]
        )  # fmt: skip

    def set_kv_buffer_prefix_valid(
        self,
        layer: Optional[HasLayerId],
        loc_2d: torch.Tensor,
        commit_lens: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        k_scale: Scale = None,
        v_scale: Scale = None,
        layer_id_override: Optional[int] = None,
        *,
        slot_map: Optional[torch.Tensor] = None,
    ) -> None:
        """The speculative-decoding verify write: of each request's ``width`` draft tokens, write
        only the first ``commit_lens[i]`` (the accepted prefix); the others write nothing.

        Token ``(i, j)`` (input row ``i * width + j``) is written to slot ``loc_2d[i, j]`` exactly as
        :meth:`set_kv_buffer` writes a token, iff ``j < commit_lens[i]``. On the fused path this is
        one launch that reads ``commit_lens`` on the device: no synchronisation, CUDA-graph safe.

        Parameters
        ----------
        layer, layer_id_override : as for :meth:`set_kv_buffer`.
        loc_2d : Tensor [bs, width], int32/int64, on the pool's device (any strides).
        commit_lens : Tensor [bs], int32/int64, on the pool's device. Values <= 0 write nothing for
            that request; values >= width write all its tokens (``validate`` requires 0..width).
        cache_k, cache_v : Tensor [bs * width, head_num, head_dim] / [bs * width, head_num, v_head_dim].
        k_scale, v_scale, slot_map : as for :meth:`set_kv_buffer`.

        Raises
        ------
        TypeError, ValueError, IndexError
            On malformed arguments, before anything is written; under ``validate`` also for a
            committed slot out of range or a ``commit_lens`` value outside ``0..width``.
        """
        i = self._write_index(layer, layer_id_override)
        if slot_map is not None:
            check_slot_map(slot_map, self.device)
        self._writer.write(
            self.k_buffer[i], self.v_buffer[i], loc_2d, cache_k, cache_v, k_scale, v_scale, PREFIX_NAMES,
            self._amax_for(i), commit_lens, slot_map,
        )  # fmt: skip

    def _write_compiled(
        self, i: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, k_scale: Scale, v_scale: Scale
    ) -> None:
        """The write as traced by torch.compile: the metadata checks, then one custom op that
        declares the caches it mutates. Validate-mode checks read device memory and are skipped."""
        checked = check_write(self._writer.geometry, cache_k, cache_v, loc, k_scale, v_scale, POOL_NAMES)
        store_kv_op(
            cache_k, cache_v, self._k_views[i], self._v_views[i], loc,
            checked.k_scale, checked.v_scale, self.fused_mode, self._amax_for(i),
        )  # fmt: skip

    # --- warmup ----------------------------------------------------------------------------------

    def warm_mapped_writes(self) -> None:
        """Compile, on CUDA with warmup on, the variants of writes through a ``slot_map`` (as
        construction compiles the plain ones), so that ``SWAKVPool``'s first sliding-window write
        does not compile. The warmup's map sends the padding slot 0 to itself: it writes zeros to
        slot 0 only, whatever mapping is registered later."""
        if self._warm:
            self._warmup(slot_map=torch.tensor([0, -1], dtype=torch.int64, device=self.device))

    def _warmup_write(
        self, in_dtype: torch.dtype, loc_dtype: torch.dtype, scale: Scale, tokens: int,
        slot_map: Optional[torch.Tensor] = None,
    ) -> None:  # fmt: skip
        dev = self.device
        k = torch.zeros((tokens, self.head_num, self.head_dim), dtype=in_dtype, device=dev)
        v = torch.zeros((tokens, self.head_num, self.v_head_dim), dtype=in_dtype, device=dev)
        loc = self._warmup_loc(tokens, loc_dtype)
        self._writer.write(
            self.k_buffer[0], self.v_buffer[0], loc, k, v, scale, scale, POOL_NAMES, self._amax_for(0), slot_map=slot_map
        )

    def _amax_heads(self) -> tuple[int, int]:
        return self.head_num, self.head_num
