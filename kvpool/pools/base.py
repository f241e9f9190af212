"""``KVCache``: what every kvpool pool shares: slots and pages, the layers a rank holds, the getters,
the row table and what copies rows over it (moves, CPU copies), the write decision and its
statistics, warmup, and KV-scale calibration. A concrete pool allocates its buffers and adds its
write methods (``mha_pool.py``, ``mla_pool.py``). The rules are in docs/contract.md, "Pools" and
"Moves and CPU copies"."""

from __future__ import annotations

import functools
import logging
import math
import time
from dataclasses import replace
from typing import Callable, Optional, Protocol, Sequence

import torch

from kvpool.checks import (
    check_in_range,
    check_index,
    layer_id_of,
    layer_index,
    non_negative_int,
    positive_int,
    resolve_device,
)
from kvpool.config import FusedMode, fused_mode, validate_enabled
from kvpool.errors import FusedPathUnavailable
from kvpool.kernels.copy_rows import RowTable, checked_copy
from kvpool.kernels.formats import CACHE_DTYPES, FP8_FORMATS, INPUT_DTYPES, LOC_DTYPES, is_fp8, store_dtype_for
from kvpool.kernels.store_kv.layout import parts_of_one_row
from kvpool.kernels.store_kv.writer import KVWriter, PathStats
from kvpool.pools.cpu_copy import KVCpuCopy, check_cpu_copy, copy_rows_from_host, copy_rows_to_host
from kvpool.write_types import F32_MAX, F32_MIN_NORMAL, Geometry, Scale

logger = logging.getLogger("kvpool")


class HasLayerId(Protocol):
    """What a write's ``layer`` argument needs: a ``layer_id`` (SGLang's attention layer has one)."""

    layer_id: int


#: Keywords of SGLang's pool constructors that kvpool accepts for call-site compatibility, and the
#: values it can honour (anything else raises, naming the keyword).
def check_sglang_keywords(
    enable_memory_saver: object, enable_alt_stream: object = True, enable_kv_cache_copy: object = False
) -> None:
    """``enable_memory_saver=True`` asks for SGLang's torch_memory_saver (pausing and releasing the
    cache's memory), which kvpool does not have. ``enable_alt_stream`` (SGLang overlaps its separate
    K and V copies on a second stream; kvpool writes both in one launch) and ``enable_kv_cache_copy``
    (SGLang builds its move tables only on request; kvpool's ``move_kv_cache`` is always available)
    are accepted either way."""
    if enable_memory_saver not in (False, None):
        raise ValueError(
            f"enable_memory_saver must be False: kvpool has no memory saver (pausing and releasing the "
            f"KV cache's memory), got {enable_memory_saver!r}"
        )
    for name, value in (("enable_alt_stream", enable_alt_stream), ("enable_kv_cache_copy", enable_kv_cache_copy)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be a bool, got {value!r}")


def head_geometry(
    head_num: object,
    head_dim: object,
    v_head_dim: object,
    swa_head_num: object,
    swa_head_dim: object,
    swa_v_head_dim: object,
    check_dim: Callable[[object, str], int] = positive_int,
) -> tuple[int, int, int]:
    """``(head_num, head_dim, v_head_dim)`` of an MHA pool from SGLang's constructor arguments: each
    ``swa_*`` given replaces its plain one, ``v_head_dim`` defaults to ``head_dim``; ``head_num`` must
    be a positive int and the dims pass ``check_dim`` (ValueError naming the argument otherwise)."""
    h = positive_int(head_num if swa_head_num is None else swa_head_num, "head_num")
    d = check_dim(head_dim if swa_head_dim is None else swa_head_dim, "head_dim")
    v_dim = swa_v_head_dim if swa_v_head_dim is not None else v_head_dim
    return h, d, d if v_dim is None else check_dim(v_dim, "v_head_dim")


class KVCache:
    """The state every pool shares. Subclasses call ``__init__``, allocate their buffers, hand them to
    ``_init_rows`` (storage views for row copies, ``dtype`` views for the getters, the row tables),
    call ``_init_writer`` with the geometry the write kernel sees, and define ``_warmup_write`` and
    ``_amax_heads``.

    Attributes (SGLang names): ``size``, ``page_size``, ``dtype``, ``store_dtype``, ``layer_num``,
    ``start_layer``, ``end_layer``, ``device``, ``layer_transfer_counter``, ``k_buffer``,
    ``v_buffer``; kvpool's own: ``row_table``, ``fused_mode``, ``validate``, ``stats`` (a
    ``PathStats``), ``warmup_seconds``.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        layer_num: int,
        device: str | torch.device,
        start_layer: Optional[int],
        end_layer: Optional[int],
        fused: str,
        validate: bool,
    ) -> None:
        self.size = positive_int(size, "size")
        self.page_size = positive_int(page_size, "page_size")
        if dtype not in CACHE_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(map(str, CACHE_DTYPES))}, got {dtype}")
        self.dtype = dtype
        self.store_dtype = store_dtype_for(dtype)
        self.layer_num = positive_int(layer_num, "layer_num")
        self.start_layer = 0 if start_layer is None else non_negative_int(start_layer, "start_layer")
        last = self.start_layer + layer_num - 1
        if end_layer is not None and end_layer != last:
            raise ValueError(
                f"end_layer must be start_layer + layer_num - 1 = {last} (both ends included), got {end_layer!r}"
            )
        self.end_layer = last
        self.device = resolve_device(device)
        self.fused_mode: FusedMode = fused_mode(fused)
        self.validate = validate_enabled(validate)
        #: SGLang's hook for the host tier: an object with ``wait_until(layer_index)`` that the getters
        #: call before returning a layer's buffer (see ``register_layer_transfer_counter``).
        self.layer_transfer_counter = None
        self.warmup_seconds: Optional[float] = None
        self._amax: Optional[torch.Tensor] = None  # [layer_num, 2, max heads] float32, once observed
        self._amax_views: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None
        self._observing = False

    @property
    def rows(self) -> int:
        """Rows per layer buffer: ``size + page_size`` (slot 0 and the rest of page 0 are padding)."""
        return self.size + self.page_size

    def _init_rows(
        self, k_buffer: list[torch.Tensor], v_buffer: list[torch.Tensor], rows: Optional[list[torch.Tensor]] = None
    ) -> None:
        """Record the pool's storage, one buffer per layer each: ``k_buffer``/``v_buffer``, the K and
        V parts that writes and row copies address, and, for an MLA pool, ``rows``: the whole-row
        buffers the parts are column ranges of, which the key getter returns (the value getter
        returns the K part) and ``move_kv_cache`` copies."""
        self.k_buffer, self.v_buffer = k_buffer, v_buffer
        as_dtype = lambda b: b if b.dtype == self.dtype else b.view(self.dtype)  # noqa: E731
        # dtype views made once: the getters hand them out, the compiled write mutates them.
        self._k_views = [as_dtype(b) for b in k_buffer]
        self._v_views = [as_dtype(b) for b in v_buffer]
        #: The storage buffers ``K0, V0, K1, V1, ...`` as one table (layer ``i`` is
        #: ``row_table.select(2 * i, 2 * i + 2)``): CPU copies, the host tier and transfers copy rows
        #: of every layer over it in one launch. Built once (one synchronisation on CUDA).
        self.row_table = RowTable.of([b for pair in zip(k_buffer, v_buffer) for b in pair])
        if rows is None:
            self._key_views, self._value_views, self._move_table = self._k_views, self._v_views, self.row_table
        else:  # copy_rows refuses the two part views as one table to move over (their rows interleave)
            self._key_views, self._value_views = [as_dtype(b) for b in rows], self._k_views
            self._move_table = RowTable.of(rows)

    def _init_writer(self, geometry: Geometry, k_strides: Sequence[int], v_strides: Sequence[int]) -> None:
        """The writer of these buffers (every layer shares the geometry and strides): the one object
        every write of this pool goes through. Caches that are the two parts of one row buffer (the
        MLA pool's) take joined plans."""
        self._writer = KVWriter(
            geometry, tuple(k_strides), tuple(v_strides), self.rows, self.fused_mode, caches_aligned=True,
            validate=self.validate, joined=parts_of_one_row(geometry, k_strides, v_strides),
        )  # fmt: skip
        self.stats: PathStats = self._writer.stats
        if self.fused_mode == "always" and not self._writer.cache_ok:
            raise FusedPathUnavailable(f"fused='always' but {self._writer.cache_reason}")

    @property
    def writer(self) -> KVWriter:
        """The :class:`~kvpool.kernels.store_kv.KVWriter` every write of this pool goes through: its
        ``stats``, ``jit_launches`` and ``launches.recording()`` serve diagnostics and benchmarks."""
        return self._writer

    # --- layers ----------------------------------------------------------------------------------

    def _write_index(self, layer: Optional[HasLayerId], layer_id_override: Optional[int]) -> int:
        """Index of the layer a write names: ``layer_id_override`` or ``layer.layer_id``."""
        layer_id = getattr(layer, "layer_id", None) if layer_id_override is None else layer_id_override
        i = layer_id - self.start_layer if type(layer_id) is int else -1
        if not 0 <= i < self.layer_num:
            if layer_id_override is None:
                layer_id = layer_id_of(layer)  # raises for a missing layer or layer_id
            i = layer_index(layer_id, self.start_layer, self.end_layer)  # raises with the reason
        return i

    def _wait_layer(self, layer_id: object) -> int:
        """Index into this pool's buffers of global layer ``layer_id`` (raises for any other id), after
        the current stream waits for that layer's load when a layer-transfer counter is registered (a
        stream wait, not a host sync)."""
        i = layer_index(layer_id, self.start_layer, self.end_layer)
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(i)
        return i

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """K buffer of global layer ``layer_id`` (an MLA pool: the whole latent row), a ``dtype``
        view of the storage, never a copy. With a layer-transfer counter registered, the current
        stream first waits for that layer's load."""
        return self._key_views[self._wait_layer(layer_id)]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """V buffer of global layer ``layer_id`` (an MLA pool: the latent columns, a strided view of
        the key buffer), as :meth:`get_key_buffer`."""
        return self._value_views[self._wait_layer(layer_id)]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(key buffer, value buffer) of global layer ``layer_id``, with one wait."""
        i = self._wait_layer(layer_id)
        return self._key_views[i], self._value_views[i]

    def register_layer_transfer_counter(self, layer_transfer_counter: object) -> None:
        """Make the buffer getters call ``layer_transfer_counter.wait_until(layer_index)`` first (the
        host tier's per-layer loads: a stream wait, never a host sync). None removes it."""
        self.layer_transfer_counter = layer_transfer_counter

    # --- moves and CPU copies ------------------------------------------------------------------------

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        """For every layer, row ``tgt_loc[i]`` (K and V; an MLA pool's whole latent row) becomes a
        byte copy of row ``src_loc[i]`` (bytes, never re-quantised), as if every source were read
        before any target is written: chains, cycles and ``tgt_loc == src_loc`` are defined; a target
        named twice gets one of its sources.

        Parameters
        ----------
        tgt_loc, src_loc : Tensor [n], int32/int64, on the pool's device. Negative slots are padding;
            slots >= ``size + page_size`` are never read or written (IndexError under ``validate``).

        On CUDA one launch moves every layer (up to ``ONE_PASS_MAX_PAIRS`` pairs; more go through a
        staging buffer); no synchronisation; CUDA-graph safe.
        """
        table = self._move_table
        checked_copy(table, tgt_loc, table, src_loc, None, self.validate, ("tgt_loc", "src_loc"))

    def get_cpu_copy(self, indices: torch.Tensor) -> KVCpuCopy:
        """The rows ``indices`` of every layer in host memory, exact bytes.

        Parameters
        ----------
        indices : Tensor [n], int32/int64, on the pool's device; every entry in ``0..size +
            page_size - 1`` (the call waits for the device anyway, so the check costs nothing more).

        Returns
        -------
        KVCpuCopy with ``k`` [layer_num, n, H, D] and ``v`` [layer_num, n, H, Dv] of ``store_dtype``
        (an MLA pool: the latent parts [.., 1, kv_lora_rank] and the rotary parts [.., 1,
        qk_rope_head_dim]), pinned on CUDA. On CUDA one kernel writes every layer straight into the
        pinned memory, and the call waits for the current stream (the copy is complete on return).

        Raises
        ------
        TypeError, ValueError
            On a malformed ``indices``.
        IndexError
            Naming the first entry outside the buffers.
        """
        check_index(indices, "indices", device=self.device)
        check_in_range([(indices, self.rows, "indices")], what="slots", negative_ok=False)
        n = indices.shape[0]
        pinned = self.device.type == "cuda"
        k = torch.empty((self.layer_num, n, *self.k_buffer[0].shape[1:]), dtype=self.store_dtype, pin_memory=pinned)
        v = torch.empty((self.layer_num, n, *self.v_buffer[0].shape[1:]), dtype=self.store_dtype, pin_memory=pinned)
        copy = KVCpuCopy(k, v, self.dtype, self.start_layer)
        copy_rows_to_host(self.row_table, indices, copy.layers(), self.device)
        return copy

    def load_cpu_copy(self, kv_cache_cpu: KVCpuCopy, indices: torch.Tensor) -> None:
        """Write ``get_cpu_copy``'s rows back into slots ``indices`` (any slots, as many as the copy
        holds), byte for byte.

        Parameters
        ----------
        kv_cache_cpu : a KVCpuCopy of this pool's dtype, layers and head geometry.
        indices : Tensor [len(kv_cache_cpu)], int32/int64, on the pool's device. Entries outside the
            buffers are never written (IndexError under ``validate``).

        Raises
        ------
        TypeError, ValueError
            On a malformed ``indices`` or a copy of another geometry, dtype, length or layout,
            naming ``kv_cache_cpu``; nothing is written.

        No synchronisation on CUDA: the rows cross to the device with the copy engine
        (``non_blocking``, so host memory is released only after the copy), then one kernel scatters
        every layer.
        """
        check_index(indices, "indices", device=self.device)
        n = indices.shape[0]
        copy = check_cpu_copy(
            kv_cache_cpu, self.dtype, self.store_dtype, self.start_layer,
            (self.layer_num, n, *self.k_buffer[0].shape[1:]), (self.layer_num, n, *self.v_buffer[0].shape[1:]),
        )  # fmt: skip
        if self.validate:
            check_in_range([(indices, self.rows, "indices")])
        if n == 0:
            return
        if self.device.type == "cuda":
            copy = replace(copy, k=copy.k.to(self.device, non_blocking=True), v=copy.v.to(self.device, non_blocking=True))
        copy_rows_from_host(self.row_table, indices, copy.layers(), self.device)

    # --- warmup ----------------------------------------------------------------------------------

    def warmup_variants(self) -> list[tuple[torch.dtype, torch.dtype, Scale]]:
        """(input dtype, loc dtype, scale) combinations compiled at construction."""
        return [(i, l, s) for i in INPUT_DTYPES for l in LOC_DTYPES for s in self._warmup_scales()]

    def _warmup_calls(self, **write_options: object) -> list[Callable[[], None]]:
        """Calls that compile and run every kernel variant a first real write would meet, writing
        zeros to the padding slot 0 only (each subclass's ``_warmup_write`` makes one such write,
        with ``write_options``): one write per token band of the plan (all tokens but the first
        skipped)."""
        return [
            functools.partial(self._warmup_write, *variant, tokens, **write_options)
            for variant in self.warmup_variants()
            for tokens in self._writer.band_tokens
        ]

    def _warmup_write(
        self, in_dtype: torch.dtype, loc_dtype: torch.dtype, scale: Scale, tokens: int, **write_options: object
    ) -> None:
        raise NotImplementedError

    def _warmup_loc(self, tokens: int, loc_dtype: torch.dtype) -> torch.Tensor:
        """[tokens] slots: the padding slot 0, then -1 (written nowhere)."""
        loc = torch.full((tokens,), -1, dtype=loc_dtype, device=self.device)
        loc[0] = 0
        return loc

    def _warmup(self, **write_options: object) -> None:
        """Compile each variant once on the pool's device (the variants of writes with
        ``write_options``, e.g. a ``slot_map``). Each call writes zeros to slot 0 of the first
        layer: the padding slot, which no allocator hands out (at construction the buffers are
        still zero there, so nothing changes at all)."""
        if not self._writer.fused_possible or self.device.type != "cuda":
            return
        start = time.perf_counter()
        calls = self._warmup_calls(**write_options)
        with torch.cuda.device(self.device), self._writer.uncounted():
            for call in calls:
                call()
        torch.cuda.synchronize(self.device)
        self.warmup_seconds = time.perf_counter() - start
        logger.info(
            "kvpool: warmed %d fused-kernel variants x %d token bands in %.2f s", len(self.warmup_variants()),
            len(self._writer.band_tokens), self.warmup_seconds,
        )

    # --- calibration -----------------------------------------------------------------------------

    def _amax_heads(self) -> tuple[int, int]:
        """(K heads, V heads) whose maxima the writes observe."""
        raise NotImplementedError

    def observe_amax(self, enabled: bool = True) -> None:
        """Make every write also fold the per-layer, per-head maximum of the finite |k| and |v| it
        stores into a device buffer (``kv_amax``), in the same launch, with no synchronisation
        (CUDA-graph safe; a graph captured while observing keeps observing on replay). NaN and
        +-inf are left out: they store NaN or saturate whatever the scale. The maxima accumulate
        until ``reset_amax()``; ``observe_amax(False)`` stops observing (writes then take the
        variant with no observation code at all). On CUDA, turning it on compiles the observing
        variants at once, as construction does for the plain ones (unless the pool was built with
        ``warmup=False``)."""
        if not isinstance(enabled, bool):
            raise ValueError(f"enabled must be a bool, got {enabled!r}")
        if enabled and self._amax is None:
            kh, vh = self._amax_heads()
            self._amax = torch.zeros((self.layer_num, 2, max(kh, vh)), dtype=torch.float32, device=self.device)
            self._amax_views = [(a[0, :kh], a[1, :vh]) for a in self._amax]
        was = self._observing
        self._observing = enabled
        if enabled and not was and getattr(self, "_warm", True):
            self._warmup()

    @property
    def kv_amax(self) -> Optional[torch.Tensor]:
        """[layer_num, 2, heads] float32: the observed max |k| (index 0) and |v| (index 1) per local
        layer and head (V's heads first when V has fewer); None before ``observe_amax`` was called."""
        return self._amax

    def reset_amax(self) -> None:
        """Set the observed maxima back to zero (in place: a captured CUDA graph keeps its buffer)."""
        if self._amax is not None:
            self._amax.zero_()

    def calibrated_scales(
        self, margin: float = 1.0, per_head: bool = False, dtype: Optional[torch.dtype] = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """KV scales from the observed maxima: one ``(k_scale, v_scale)`` per layer this pool holds
        (list index = ``layer_id - start_layer``), ready to pass to ``set_kv_buffer``.

        Each scale is ``float32(amax * (margin / fmax))``, computed in float64 and rounded once, at
        most FLT_MAX and never below 2**-126 (the smallest valid scale: a layer or head never observed, or all zeros,
        gets it, and any nonzero value then saturates). ``fmax`` is the largest finite value of
        ``dtype`` (default: the pool's own, which must then be FP8; pass an FP8 dtype to calibrate a
        16-bit pool for a later FP8 deployment).

        Parameters
        ----------
        margin : > 0; values above 1 leave headroom for inputs larger than any observed.
        per_head : one scale per head ([head_num] tensors) instead of one per tensor ([1]).
        dtype : the FP8 format the scales are for.

        Returns
        -------
        list of (Tensor, Tensor), float32 on the pool's device, shape [1] or [heads].
        """
        target = self.dtype if dtype is None else dtype
        if target not in FP8_FORMATS:
            raise ValueError(
                f"dtype must be an FP8 format ({', '.join(map(str, FP8_FORMATS))}) for calibrated scales, "
                f"got {target}" + (" (the pool's own dtype; pass dtype=...)" if dtype is None else "")
            )
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not (0 < margin < math.inf):
            raise ValueError(f"margin must be a positive finite number, got {margin!r}")
        if not isinstance(per_head, bool):
            raise ValueError(f"per_head must be a bool, got {per_head!r}")
        if self._amax is None:
            raise ValueError("calibrated_scales needs observed maxima: call observe_amax(True) and write first")
        factor = float(margin) / FP8_FORMATS[target].max_finite
        kh, vh = self._amax_heads()
        k_amax, v_amax = self._amax[:, 0, :kh], self._amax[:, 1, :vh]
        if not per_head:
            k_amax, v_amax = k_amax.amax(dim=1, keepdim=True), v_amax.amax(dim=1, keepdim=True)
        # Clamped to [2**-126, FLT_MAX], the range set_kv_buffer accepts (an absurd margin would
        # otherwise overflow to inf).
        k_scale = (k_amax.double() * factor).float().clamp(F32_MIN_NORMAL, F32_MAX)
        v_scale = (v_amax.double() * factor).float().clamp(F32_MIN_NORMAL, F32_MAX)
        return [(k_scale[i], v_scale[i]) for i in range(self.layer_num)]

    def _amax_for(self, i: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        return self._amax_views[i] if self._observing else None  # type: ignore[index]

    def _warmup_scales(self) -> tuple[Scale, ...]:
        """The scale kinds warmup compiles: none, float and one-element tensor (FP8 pools), none
        otherwise."""
        if not is_fp8(self.dtype):
            return (None,)
        return (None, 1.0, torch.ones(1, dtype=torch.float32, device=self.device))
