"""``MHATokenToKVPool``: per-layer K/V buffers and the write every attention layer calls (SPEC 2-4)."""

from __future__ import annotations

import logging
import time
from typing import Optional, Protocol

import torch

from kvpool.args import positive_int, resolve_device
from kvpool.config import FusedMode, fused_mode, validate_enabled
from kvpool.kernels.checks import POOL_NAMES, Geometry, Scale, check_write
from kvpool.kernels.formats import CACHE_DTYPES, INPUT_DTYPES, LOC_DTYPES, is_fp8, store_dtype_for
from kvpool.kernels.write import FusedPathUnavailable, KVWriter, PathStats

logger = logging.getLogger("kvpool")


class HasLayerId(Protocol):
    layer_id: int


class MHATokenToKVPool:
    """K/V cache buffers for the attention layers ``[start_layer, end_layer]`` of one rank.

    Each layer owns a K buffer ``[size + page_size, head_num, head_dim]`` and a V buffer
    ``[size + page_size, head_num, v_head_dim]``, zeroed. Slot 0 is the padding slot: padded tokens of
    a CUDA-graph batch may write there, and no allocator hands it out. FP8 buffers are stored as uint8
    (``store_dtype``); the getters return ``dtype`` views of the same memory.

    Parameters
    ----------
    size : usable slots (the allocators hand out ``1..size``).
    page_size : slots per page; the buffers carry ``page_size`` extra rows, as SGLang's do.
    dtype : cache element type: ``torch.float8_e4m3fn``, ``torch.float8_e5m2``, ``torch.bfloat16``,
        ``torch.float16`` or ``torch.float32``.
    head_num, head_dim : KV heads on this rank and the K head dim.
    layer_num : layers held by this rank (pipeline parallelism: consecutive global ids).
    device : where the buffers live. ``"cpu"`` works (reference path only). On CUDA, writes launch
        on the current device, so a pool on ``cuda:i`` is written while ``cuda:i`` is current, as in
        an engine process that calls ``torch.cuda.set_device(rank)`` once.
    v_head_dim : V head dim (default ``head_dim``).
    start_layer, end_layer : global id of the first and last layer held, both included;
        ``end_layer`` defaults to ``start_layer + layer_num - 1``.
    fused : ``"auto"`` (fused kernel when the gate allows, else reference), ``"always"`` (raise
        ``FusedPathUnavailable`` with the gate's reason instead of falling back), ``"never"``.
        ``KVPOOL_FUSED`` overrides it.
    warmup : on CUDA, compile at construction the kernel variants of contiguous (or QKV-sliced)
        inputs for every input dtype, loc dtype and scale kind (None, float, one-element tensor).
        Per-head scale tensors and unusual input strides compile on their first call.
    validate : check slot range and scale values on every write (one synchronisation each);
        ``KVPOOL_VALIDATE=1`` turns it on too.

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
        *,
        v_head_dim: Optional[int] = None,
        start_layer: int = 0,
        end_layer: Optional[int] = None,
        fused: str = "auto",
        warmup: bool = True,
        validate: bool = False,
    ) -> None:
        self.size = positive_int(size, "size")
        self.page_size = positive_int(page_size, "page_size")
        if dtype not in CACHE_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(map(str, CACHE_DTYPES))}, got {dtype}")
        self.dtype = dtype
        self.store_dtype = store_dtype_for(dtype)
        self.head_num = positive_int(head_num, "head_num")
        self.head_dim = positive_int(head_dim, "head_dim")
        self.v_head_dim = self.head_dim if v_head_dim is None else positive_int(v_head_dim, "v_head_dim")
        self.layer_num = positive_int(layer_num, "layer_num")
        if isinstance(start_layer, bool) or not isinstance(start_layer, int) or start_layer < 0:
            raise ValueError(f"start_layer must be a non-negative int, got {start_layer!r}")
        self.start_layer = start_layer
        last = start_layer + layer_num - 1
        if end_layer is not None and end_layer != last:
            raise ValueError(
                f"end_layer must be start_layer + layer_num - 1 = {last} (both ends included), got {end_layer!r}"
            )
        self.end_layer = last
        self.device = resolve_device(device)
        self.fused_mode: FusedMode = fused_mode(fused)
        self.validate = validate_enabled(validate)

        rows = self.size + self.page_size
        self.k_buffer = [
            torch.zeros((rows, self.head_num, self.head_dim), dtype=self.store_dtype, device=self.device)
            for _ in range(self.layer_num)
        ]
        self.v_buffer = [
            torch.zeros((rows, self.head_num, self.v_head_dim), dtype=self.store_dtype, device=self.device)
            for _ in range(self.layer_num)
        ]
        fp8 = is_fp8(dtype)
        self._k_views = [b.view(dtype) if fp8 else b for b in self.k_buffer]
        self._v_views = [b.view(dtype) if fp8 else b for b in self.v_buffer]

        # The write decision for these buffers (every layer shares the geometry and strides).
        self._writer = KVWriter(
            Geometry(dtype, self.head_num, self.head_dim, self.head_num, self.v_head_dim, self.device),
            tuple(self.k_buffer[0].stride()), tuple(self.v_buffer[0].stride()), rows, self.fused_mode,
            caches_aligned=True, validate=self.validate,
        )  # fmt: skip
        self.stats: PathStats = self._writer.stats
        if self.fused_mode == "always" and not self._writer.cache_ok:
            raise FusedPathUnavailable(f"fused='always' but {self._writer.cache_reason}")
        self.warmup_seconds: Optional[float] = None
        if warmup and self._writer.launch is not None and self.device.type == "cuda":
            self._warmup()

    # --- getters (SGLang names) ------------------------------------------------------------------

    def _layer_index(self, layer_id: object) -> int:
        if isinstance(layer_id, bool) or not isinstance(layer_id, int):
            raise TypeError(f"layer_id must be an int, got {type(layer_id).__name__}")
        if not self.start_layer <= layer_id <= self.end_layer:
            raise IndexError(
                f"layer_id {layer_id} is outside this pool's layers [{self.start_layer}, {self.end_layer}]"
            )
        return layer_id - self.start_layer

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """K buffer of global layer ``layer_id``: ``[size + page_size, head_num, head_dim]`` of
        ``dtype`` (a view of the storage, never a copy)."""
        return self._k_views[self._layer_index(layer_id)]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """V buffer of global layer ``layer_id``: ``[size + page_size, head_num, v_head_dim]``."""
        return self._v_views[self._layer_index(layer_id)]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = self._layer_index(layer_id)
        return self._k_views[i], self._v_views[i]

    def get_kv_size_bytes(self) -> tuple[int, int]:
        """Bytes held by all K buffers and by all V buffers."""
        k = sum(b.numel() * b.element_size() for b in self.k_buffer)
        v = sum(b.numel() * b.element_size() for b in self.v_buffer)
        return k, v

    # --- the write -------------------------------------------------------------------------------

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
        """Write one layer's K/V rows for T tokens: row ``loc[t]`` of the layer's buffers becomes
        ``q(cache_k[t], k_scale)`` and ``q(cache_v[t], v_scale)`` (SPEC 3.1).

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
        if torch.compiler.is_compiling():
            self._write_compiled(i, loc, cache_k, cache_v, k_scale, v_scale)
            return
        self._writer.store(self.k_buffer[i], self.v_buffer[i], loc, cache_k, cache_v, k_scale, v_scale, POOL_NAMES)

    def _write_index(self, layer: Optional[HasLayerId], layer_id_override: Optional[int]) -> int:
        """Index into this pool's buffers of the layer a write names (raises for any other id)."""
        layer_id = _layer_id_of(layer) if layer_id_override is None else layer_id_override
        i = layer_id - self.start_layer if type(layer_id) is int else -1
        if not 0 <= i < self.layer_num:
            i = self._layer_index(layer_id)  # raises with the reason
        return i

    def _write_compiled(
        self, i: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, k_scale: Scale, v_scale: Scale
    ) -> None:
        """The write as traced by torch.compile: the metadata checks, then one custom op that
        declares the caches it mutates. Validate-mode checks read device memory and are skipped."""
        from kvpool.kernels.op import store_kv_op

        checked = check_write(self._writer.geometry, cache_k, cache_v, loc, k_scale, v_scale, POOL_NAMES)
        store_kv_op(
            cache_k, cache_v, self._k_views[i], self._v_views[i], loc,
            checked.k_scale, checked.v_scale, self.fused_mode,
        )  # fmt: skip

    # --- warmup ----------------------------------------------------------------------------------

    def warmup_variants(self) -> list[tuple[torch.dtype, torch.dtype, str]]:
        """(input dtype, loc dtype, scale kind) combinations compiled at construction."""
        scales = ("none", "float", "tensor") if is_fp8(self.dtype) else ("none",)
        return [(i, l, s) for i in INPUT_DTYPES for l in LOC_DTYPES for s in scales]

    def _warmup(self) -> None:
        """Compile and run each kernel variant once, writing zeros to the padding slot 0 only (the
        buffers are still zero, so nothing changes)."""
        start = time.perf_counter()
        dev = self.device
        variants = self.warmup_variants()
        with torch.cuda.device(dev):
            self._warmup_variants(variants)
        torch.cuda.synchronize(dev)
        self.warmup_seconds = time.perf_counter() - start
        logger.info("kvpool: warmed %d fused-kernel variants in %.2f s", len(variants), self.warmup_seconds)

    def _warmup_variants(self, variants: list[tuple[torch.dtype, torch.dtype, str]]) -> None:
        dev = self.device
        for in_dtype, loc_dtype, scale_kind in variants:
            k = torch.zeros((1, self.head_num, self.head_dim), dtype=in_dtype, device=dev)
            v = torch.zeros((1, self.head_num, self.v_head_dim), dtype=in_dtype, device=dev)
            loc = torch.zeros(1, dtype=loc_dtype, device=dev)
            scale: Scale = None
            if scale_kind == "float":
                scale = 1.0
            elif scale_kind == "tensor":
                scale = torch.ones(1, dtype=torch.float32, device=dev)
            key, scale, _ = check_write(self._writer.geometry, k, v, loc, scale, scale, POOL_NAMES)
            self._writer.launch(key, k, v, self.k_buffer[0], self.v_buffer[0], loc, scale, scale)


def _layer_id_of(layer: object) -> object:
    if layer is None:
        raise TypeError("set_kv_buffer needs a layer with .layer_id or layer_id_override, got neither")
    try:
        return layer.layer_id  # type: ignore[attr-defined]
    except AttributeError:
        raise TypeError(f"layer must have a .layer_id attribute, got {type(layer).__name__}") from None
