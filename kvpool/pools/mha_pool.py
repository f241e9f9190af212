"""``MHATokenToKVPool``: per-layer K/V buffers and the write every attention layer calls (SPEC 2-4)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch

from kvpool.args import positive_int, resolve_device
from kvpool.config import FusedMode, fused_mode, validate_enabled
from kvpool.kernels import reference, store_kv
from kvpool.kernels.checks import F32_MIN_NORMAL, F32_MAX, POOL_NAMES, Scale
from kvpool.kernels.checks import check_values, check_write
from kvpool.kernels.formats import CACHE_DTYPES, INPUT_DTYPES, LOC_DTYPES, is_fp8, store_dtype_for
from kvpool.kernels.gate import fused_eligibility
from kvpool.pools import kv_moves
from kvpool.pools.layer_transfer import LayerTransferCounter

logger = logging.getLogger("kvpool")


class HasLayerId(Protocol):
    layer_id: int


@dataclass
class PathStats:
    """How many eager ``set_kv_buffer`` calls took each path, and why the fallbacks happened.

    Calls made from ``torch.compile``d code are not counted (counting would put Python side effects
    into the compiled graph).
    """

    fused_calls: int = 0
    reference_calls: int = 0
    reasons: dict[str, int] = field(default_factory=dict)  # reason -> reference calls


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
        self.stats = PathStats()

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
        self._kv_rows = kv_moves.pool_row_table(self)  # moves, CPU copies, host tier: one launch for all layers

        self._scales_apply = fp8
        # The gate's verdict on what is fixed at construction (device, dtype, layout), and a memo
        # of its verdicts for the common call signatures (input dtypes, scale kinds).
        self._kernel_device_ok, self._device_reason = self._device_gate()
        self._verdicts: dict[tuple[torch.dtype, torch.dtype, int], tuple[bool, str]] = {}
        self._launch: Optional[store_kv.PreparedLaunch] = None
        if self._kernel_device_ok:
            self._launch = store_kv.PreparedLaunch(
                self.head_num, self.head_dim, self.head_num, self.v_head_dim, dtype,
                tuple(self.k_buffer[0].stride()), tuple(self.v_buffer[0].stride()), rows,
                store_kv.soft_cast_for(self.device), caches_aligned=True,
            )  # fmt: skip
        if self.fused_mode == "always" and not self._kernel_device_ok:
            raise store_kv.FusedPathUnavailable(f"fused='always' but {self._device_reason}")
        self.warmup_seconds: Optional[float] = None
        if warmup and self.fused_mode != "never" and self._kernel_device_ok and self.device.type == "cuda":
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
        ``dtype`` (a view of the storage, never a copy). With a layer-transfer counter registered,
        the current stream first waits for that layer's load (a stream wait, not a host sync)."""
        i = self._layer_index(layer_id)
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(i)
        return self._k_views[i]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """V buffer of global layer ``layer_id``: ``[size + page_size, head_num, v_head_dim]``."""
        i = self._layer_index(layer_id)
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(i)
        return self._v_views[i]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = self._layer_index(layer_id)
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(i)
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
        if layer_id_override is not None:
            layer_id = layer_id_override
        else:
            layer_id = _layer_id_of(layer)
        i = layer_id - self.start_layer if type(layer_id) is int else -1
        if not 0 <= i < self.layer_num:
            i = self._layer_index(layer_id)  # raises with the reason
        if torch.compiler.is_compiling():
            self._write_compiled(i, loc, cache_k, cache_v, k_scale, v_scale)
            return
        kinds = self._fast_kinds(loc, cache_k, cache_v, k_scale, v_scale)
        if kinds is None:
            # Anything off the common path (per-head or non-float32 scale tensors, numpy scalars,
            # other devices, bad shapes, ...) goes through the full checks, which raise on bad input.
            checked = check_write(
                cache_k, cache_v, loc, k_scale, v_scale,
                cache_dtype=self.dtype, heads=self.head_num, head_dim=self.head_dim,
                v_heads=self.head_num, v_head_dim=self.v_head_dim, device=self.device,
                names=POOL_NAMES,
            )  # fmt: skip
            k_scale, v_scale = checked.k_scale, checked.v_scale
        elif not self._scales_apply:
            k_scale = v_scale = None
        if self.validate:
            check_values(loc, POOL_NAMES.loc, self.size + self.page_size, k_scale, v_scale)
        if cache_k.shape[0] == 0:
            return
        if self.fused_mode != "never":
            if kinds is not None:
                verdict = self._verdicts.get((cache_k.dtype, cache_v.dtype, kinds))
                if verdict is None:
                    verdict = self._verdicts[(cache_k.dtype, cache_v.dtype, kinds)] = self._gate(
                        cache_k, cache_v, k_scale, v_scale
                    )
            else:
                verdict = self._gate(cache_k, cache_v, k_scale, v_scale)
            ok, reason = verdict
            if ok:
                self.stats.fused_calls += 1
                self._launch(
                    cache_k, cache_v, self.k_buffer[i], self.v_buffer[i], loc,
                    k_scale, v_scale,
                )  # fmt: skip
                return
            if self.fused_mode == "always":
                raise store_kv.FusedPathUnavailable(f"fused='always' but {reason}")
        else:
            reason = "fused='never'"
        self._count_reference(reason)
        reference.write_reference(
            cache_k, cache_v, self._k_views[i], self._v_views[i], loc, k_scale, v_scale
        )

    def _fast_kinds(self, loc: object, k: object, v: object, k_scale: object, v_scale: object) -> Optional[int]:
        """Accept the common case with a few comparisons: plain tensors of the pool's geometry on
        its device, and scales that are None, a float in range, or a one-element float32 tensor on
        the device. Returns a small int naming the scale kinds, or None to run the full checks.
        Accepts a strict subset of what ``check_write`` accepts."""
        if type(loc) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor:
            return None
        if loc.dim() != 1:
            return None
        tokens = loc.shape[0]
        if k.shape != (tokens, self.head_num, self.head_dim) or v.shape != (tokens, self.head_num, self.v_head_dim):
            return None
        if k.dtype not in _INPUT_DTYPES or v.dtype not in _INPUT_DTYPES or loc.dtype not in _LOC_DTYPES:
            return None
        dev = self.device
        if k.device != dev or v.device != dev or loc.device != dev:
            return None
        ka = _fast_scale_kind(k_scale, dev)
        va = _fast_scale_kind(v_scale, dev)
        if ka < 0 or va < 0:
            return None
        return ka * 3 + va

    def _write_compiled(
        self, i: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, k_scale: Scale, v_scale: Scale
    ) -> None:
        """The write as traced by torch.compile: the metadata checks, then one custom op that
        declares the caches it mutates. Validate-mode checks read device memory and are skipped."""
        from kvpool.kernels.op import store_kv_op

        checked = check_write(
            cache_k, cache_v, loc, k_scale, v_scale,
            cache_dtype=self.dtype, heads=self.head_num, head_dim=self.head_dim,
            v_heads=self.head_num, v_head_dim=self.v_head_dim, device=self.device, names=POOL_NAMES,
        )  # fmt: skip
        store_kv_op(
            cache_k, cache_v, self._k_views[i], self._v_views[i], loc,
            checked.k_scale, checked.v_scale, self.fused_mode,
        )  # fmt: skip

    def _count_reference(self, reason: str) -> None:
        self.stats.reference_calls += 1
        seen = self.stats.reasons.get(reason)
        if seen is None:
            logger.info("kvpool: set_kv_buffer takes the reference path: %s", reason)
            self.stats.reasons[reason] = 1
        else:
            self.stats.reasons[reason] = seen + 1

    def _device_gate(self) -> tuple[bool, str]:
        """The gate's verdict on everything fixed at construction (device, dtype, layout)."""
        return fused_eligibility(
            device=self.device, cache_dtype=self.dtype, k_dtype=torch.bfloat16, v_dtype=torch.bfloat16,
            head_dim=self.head_dim, v_head_dim=self.v_head_dim,
            k_cache_stride_d=self.k_buffer[0].stride(2), v_cache_stride_d=self.v_buffer[0].stride(2),
            k_scale=None, v_scale=None,
            triton_available=store_kv.TRITON_AVAILABLE,
            interpreter=store_kv.INTERPRETER and self.fused_mode == "always",
        )  # fmt: skip

    def _gate(self, k: torch.Tensor, v: torch.Tensor, k_scale: Scale, v_scale: Scale) -> tuple[bool, str]:
        if not self._kernel_device_ok:
            return False, self._device_reason
        return fused_eligibility(
            device=self.device, cache_dtype=self.dtype, k_dtype=k.dtype, v_dtype=v.dtype,
            head_dim=self.head_dim, v_head_dim=self.v_head_dim,
            k_cache_stride_d=self.k_buffer[0].stride(2), v_cache_stride_d=self.v_buffer[0].stride(2),
            k_scale=k_scale, v_scale=v_scale,
            triton_available=store_kv.TRITON_AVAILABLE, interpreter=store_kv.INTERPRETER,
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
            self._launch(k, v, self.k_buffer[0], self.v_buffer[0], loc, scale, scale)

    # --- moves, CPU copies, host tier (kvpool/pools/kv_moves.py, kvpool/pools/host_pool.py) ----------

    #: Set by ``register_layer_transfer_counter``; the getters wait on it when it is not None.
    layer_transfer_counter: Optional[LayerTransferCounter] = None

    def register_layer_transfer_counter(self, counter: Optional[LayerTransferCounter]) -> None:
        """Make ``get_key_buffer``/``get_value_buffer``/``get_kv_buffer(layer_id)`` call
        ``counter.wait_until(layer_id - start_layer)`` first, as SGLang's pool does: with a host
        pool's ``layer_transfer_counter`` the current stream waits for that layer's load event (a
        stream wait, never a host sync; inside a CUDA graph an external-event wait). None removes it."""
        self.layer_transfer_counter = counter

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        """For every layer, K and V row ``tgt_loc[i]`` becomes a byte copy of row ``src_loc[i]``
        (bytes, never re-quantised), as if every source were read before any target is written:
        chains, cycles and ``tgt_loc == src_loc`` are defined; a target named twice gets one of its
        sources. ``tgt_loc``, ``src_loc``: Tensor [n], int32/int64, on the pool's device. Negative
        slots are padding; slots >= ``size + page_size`` are never read or written (IndexError under
        ``validate``). On CUDA one launch moves every layer (up to 1024 pairs; more go through a
        staging buffer); no synchronisation; CUDA-graph safe."""
        kv_moves.move_kv_cache(self, tgt_loc, src_loc)

    def get_cpu_copy(self, indices: torch.Tensor) -> kv_moves.KVCpuCopy:
        """The K/V rows ``indices`` of every layer in host memory (pinned on CUDA), exact bytes, as
        a :class:`~kvpool.pools.kv_moves.KVCpuCopy` (``k`` [layer_num, n, H, D], ``v`` [layer_num, n,
        H, Dv], store dtype). Waits for the current stream (the copy is complete on return)."""
        return kv_moves.get_cpu_copy(self, indices)

    def load_cpu_copy(self, kv_cache_cpu: kv_moves.KVCpuCopy, indices: torch.Tensor) -> None:
        """Write ``get_cpu_copy``'s rows back into slots ``indices`` (any slots, same count), byte for
        byte. A copy of another geometry, dtype or length raises before anything is written. No
        synchronisation."""
        kv_moves.load_cpu_copy(self, kv_cache_cpu, indices)


_INPUT_DTYPES = frozenset(INPUT_DTYPES)
_LOC_DTYPES = frozenset(LOC_DTYPES)


def _layer_id_of(layer: object) -> object:
    if layer is None:
        raise TypeError("set_kv_buffer needs a layer with .layer_id or layer_id_override, got neither")
    try:
        return layer.layer_id  # type: ignore[attr-defined]
    except AttributeError:
        raise TypeError(f"layer must have a .layer_id attribute, got {type(layer).__name__}") from None


def _fast_scale_kind(scale: object, device: torch.device) -> int:
    """0: None, 1: a float that is a valid scale, 2: a one-element float32 tensor on ``device``;
    -1: anything else (left to the full checks)."""
    if scale is None:
        return 0
    if type(scale) is float:
        return 1 if F32_MIN_NORMAL <= scale <= F32_MAX else -1
    if type(scale) is torch.Tensor and scale.dtype is torch.float32 and scale.device == device and scale.numel() == 1:
        return 2
    return -1
