"""``SWAKVPool``: the KV cache of a model that mixes sliding-window and full-attention layers
(gpt-oss, Gemma 3, MiMo), as two ``MHATokenToKVPool`` behind one object (or two per-token-head FP8
or FP4 pools, as ``built_parts.py`` picks them).

A sliding-window (SWA) layer needs only the last window of each request's K/V, so its pool has
``size_swa`` slots where the full-attention layers have ``size``. Callers address both with the
full pool's slots: a full-to-SWA index mapping (``register_mapping``; ``SWATokenToKVPoolAllocator``
keeps it) translates them for the SWA layers. Every method takes the model's global layer ids. The
rules are in docs/contract.md, "Sliding-window attention".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from kvpool.checks import INDEX_DTYPES, check_in_range, check_index, layer_id_of
from kvpool.kernels.store_kv.layout import translate_slots
from kvpool.pools.built_parts import (
    FP4,
    PER_TOKEN_HEAD,
    STATIC,
    fp4_format_name,
    fp4_prefix_write,
    layer_ids,
    part_buf_infos,
    part_options,
)
from kvpool.pools.cpu_copy import KVCpuCopy, check_cpu_copy
from kvpool.pools.mha_fp4_pool import Fp4Layer, MHATokenToKVPoolFP4, Nvfp4Layer
from kvpool.pools.mha_fp8_token_pool import MHATokenToKVPoolFP8PerTokenHead
from kvpool.pools.mha_pool import MHATokenToKVPool
from kvpool.pools.row_parts import PartsCpuCopy, RowPartsCache
from kvpool.pools.swa_calibration import SWACalibration
from kvpool.write_types import Scale

#: What each part of the pool is: ``MHATokenToKVPool``; with ``kv_scale_mode="per_token_head"``
#: ``MHATokenToKVPoolFP8PerTokenHead``; with an FP4 ``dtype`` ``MHATokenToKVPoolFP4``.
PartPool = Union[MHATokenToKVPool, MHATokenToKVPoolFP8PerTokenHead, MHATokenToKVPoolFP4]

GB = 1024**3


@dataclass(frozen=True)
class SWALayerTransferCounters:
    """One layer-transfer counter per part of an ``SWAKVPool`` (``SWAKVPoolHost.layer_transfer_counter``):
    ``full`` counts the full part's dense layers, ``swa`` the sliding-window part's."""

    full: object
    swa: object


class SWAKVPool(SWACalibration):
    """K/V buffers of a hybrid sliding-window model: ``full_kv_pool`` holds the full-attention
    layers (``size`` slots), ``swa_kv_pool`` the sliding-window layers (``size_swa`` slots), both
    ``MHATokenToKVPool`` with dense layer ids; this object takes global ids and full slots.

    The positional order of the arguments is SGLang's, so SGLang call sites carry over; SGLang's
    keyword arguments (passed through its ``**kwargs``) are keywords here.

    Parameters
    ----------
    size, size_swa : usable slots of the full and the SWA pool.
    page_size, dtype, head_num, head_dim : as for ``MHATokenToKVPool`` (both pools).
    swa_attention_layer_ids, full_attention_layer_ids : global ids of the layers of each kind
        (distinct, disjoint, at least one of each); dense id ``i`` of a pool is entry ``i``.
    enable_kvcache_transpose : SGLang's; must be False.
    device : where the buffers live.
    token_to_kv_pool_class : SGLang's; must be ``MHATokenToKVPool`` (the default).
    v_head_dim : V head dim of both pools (default ``head_dim``).
    swa_head_num, swa_head_dim, swa_v_head_dim : the SWA pool's geometry where it differs.
    enable_memory_saver, enable_alt_stream, enable_kv_cache_copy, fused, warmup, validate,
        observe_amax : passed to both pools.
    kv_scale_mode : ``"static"`` (the scales each write is given) or ``"per_token_head"`` (an FP8
        ``dtype`` with a scale per token and head computed at write time: both pools are
        ``MHATokenToKVPoolFP8PerTokenHead``; no ``observe_amax``).
    dtype FP4 : ``torch.float4_e2m1fn_x2``, ``"fp4_e2m1"`` or ``"nvfp4"`` makes both pools SGLang's
        ``MHATokenToKVPoolFP4``; no ``observe_amax``, ``kv_scale_mode`` ``"static"``.
    fp4_format : an FP4 ``dtype``'s format, ``"fp4_mx_block16"`` or ``"nvfp4"`` (None: from ``dtype``);
        must be None for any other ``dtype``.
    k_global_scales, v_global_scales : NVFP4 only: one float for every layer of both pools (default
        1.0); :meth:`set_global_scales` sets one layer's.
    out_dtype : what the dequantizing getters of FP4 or per-token-head pools return (None:
        ``torch.bfloat16``); must be None for any other.

    Attributes
    ----------
    full_kv_pool, swa_kv_pool : the two pools.
    layers_mapping : dict, global id -> (dense id, is a SWA layer).
    full_to_swa_index_mapping : the registered mapping, or None.
    fp4_format, out_dtype : the parts' FP4 format (None unless FP4) and their getters' dtype (None
        for parts whose getters return their buffers).
    layer_transfer_counter : the registered ``SWALayerTransferCounters`` (a host tier's), or None.

    Examples
    --------
    >>> pool = SWAKVPool(64, 16, 1, torch.bfloat16, 2, 8, [0, 2], [1], False, "cpu")
    >>> pool.get_key_buffer(2).shape, pool.get_key_buffer(1).shape
    (torch.Size([17, 2, 8]), torch.Size([65, 2, 8]))
    """

    def __init__(
        self,
        size: int,
        size_swa: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        swa_attention_layer_ids: Sequence[int],
        full_attention_layer_ids: Sequence[int],
        enable_kvcache_transpose: bool,
        device: str | torch.device,
        token_to_kv_pool_class: type = MHATokenToKVPool,
        *,
        v_head_dim: Optional[int] = None,
        swa_head_num: Optional[int] = None,
        swa_head_dim: Optional[int] = None,
        swa_v_head_dim: Optional[int] = None,
        enable_memory_saver: bool = False,
        enable_alt_stream: bool = True,
        enable_kv_cache_copy: bool = False,
        fused: str = "auto",
        warmup: bool = True,
        validate: bool = False,
        observe_amax: bool = False,
        kv_scale_mode: str = "static",
        fp4_format: Optional[str] = None,
        k_global_scales: Optional[float] = None,
        v_global_scales: Optional[float] = None,
        out_dtype: Optional[torch.dtype] = None,
    ) -> None:
        kind, extra = part_options(dtype, kv_scale_mode, fp4_format, out_dtype, observe_amax, k_global_scales,
                                   v_global_scales)  # fmt: skip
        for name, value in (("k_global_scales", k_global_scales), ("v_global_scales", v_global_scales)):
            if isinstance(value, (list, tuple)):
                raise ValueError(f"{name} must be one float for every layer of both parts (set_global_scales sets one "
                                 f"layer's), got a sequence of {len(value)}")  # fmt: skip
        if kind == PER_TOKEN_HEAD and observe_amax:
            raise ValueError(
                "observe_amax must be False with kv_scale_mode='per_token_head' (each row's scale is computed "
                f"when it is written), got {observe_amax!r}"
            )
        if enable_kvcache_transpose not in (False, None):
            raise ValueError(
                f"enable_kvcache_transpose must be False (kvpool's buffers are [rows, H, D]), "
                f"got {enable_kvcache_transpose!r}"
            )
        if token_to_kv_pool_class is not MHATokenToKVPool:
            got = getattr(token_to_kv_pool_class, "__name__", token_to_kv_pool_class)
            raise ValueError(f"token_to_kv_pool_class must be MHATokenToKVPool (the dtype and kv_scale_mode pick "
                             f"the parts' kind), got {got!r}")  # fmt: skip
        swa = layer_ids(swa_attention_layer_ids, "swa_attention_layer_ids")
        full = layer_ids(full_attention_layer_ids, "full_attention_layer_ids")
        both = sorted(set(swa) & set(full))
        if both:
            raise ValueError(
                f"swa_attention_layer_ids and full_attention_layer_ids must be disjoint, got {both} in both"
            )
        self.swa_attention_layer_ids, self.full_attention_layer_ids = swa, full
        self.swa_layer_nums, self.full_layer_nums = len(swa), len(full)
        self.layers_mapping: dict[int, tuple[int, bool]] = {g: (i, False) for i, g in enumerate(full)}
        self.layers_mapping.update({g: (i, True) for i, g in enumerate(swa)})
        common = dict(
            enable_memory_saver=enable_memory_saver, v_head_dim=v_head_dim, enable_alt_stream=enable_alt_stream,
            enable_kv_cache_copy=enable_kv_cache_copy, fused=fused, validate=validate, **extra,
        )  # fmt: skip
        part: type = {STATIC: MHATokenToKVPool, PER_TOKEN_HEAD: MHATokenToKVPoolFP8PerTokenHead,
                      FP4: MHATokenToKVPoolFP4}[kind]  # fmt: skip
        if kind != FP4:  # the FP4 kernels compile on first use
            common["warmup"] = warmup
        if kind == STATIC:
            common["observe_amax"] = observe_amax
        self.full_kv_pool: PartPool = part(size, page_size, dtype, head_num, head_dim, len(full), device, **common)
        self.swa_kv_pool: PartPool = part(
            size_swa, page_size, dtype, head_num, head_dim, len(swa), device, swa_head_num=swa_head_num,
            swa_head_dim=swa_head_dim, swa_v_head_dim=swa_v_head_dim, **common,
        )  # fmt: skip
        f = self.full_kv_pool
        self.size, self.size_swa, self.page_size = f.size, self.swa_kv_pool.size, f.page_size
        self.dtype, self.store_dtype, self.device, self.validate = f.dtype, f.store_dtype, f.device, f.validate
        self.fp4_format, self.out_dtype = fp4_format_name(f), getattr(f, "out_dtype", None)
        #: Whether a sliding-window layer's write hands the mapping to its kernel (the FP4 kernels take
        #: SWA slots, translated first).
        self.mapped_writes = kind != FP4
        if not self.validate and self.mapped_writes:  # sliding-window layers' writes read the mapping in their launch
            self.swa_kv_pool.warm_mapped_writes()
        self.head_num, self.head_dim, self.v_head_dim = f.head_num, f.head_dim, f.v_head_dim
        self.start_layer, self.layer_num = 0, len(full) + len(swa)
        self.full_to_swa_index_mapping: Optional[torch.Tensor] = None
        self.swa_loc: Optional[torch.Tensor] = None
        self.layer_transfer_counter: Optional[SWALayerTransferCounters] = None
        self.mem_usage = sum(self.get_kv_size_bytes()) / GB

    # --- layers and the mapping ------------------------------------------------------------------

    def _route(self, layer_id: object) -> tuple[PartPool, int, bool]:
        """(pool, dense id, is SWA) of global layer ``layer_id``; ValueError naming both kinds' ids."""
        hit = self.layers_mapping.get(layer_id) if type(layer_id) is int else None  # type: ignore[call-overload]
        if hit is None:
            if isinstance(layer_id, bool) or not isinstance(layer_id, int):
                raise TypeError(f"layer_id must be an int, got {type(layer_id).__name__}")
            raise ValueError(
                f"layer_id {layer_id} is not a layer of this pool: its sliding-window layers are "
                f"{list(self.swa_attention_layer_ids)}, its full-attention layers {list(self.full_attention_layer_ids)}"
            )
        i, is_swa = hit
        return (self.swa_kv_pool if is_swa else self.full_kv_pool), i, is_swa

    def _route_write(self, layer: object, layer_id_override: Optional[int]) -> tuple[PartPool, int, bool]:
        layer_id = getattr(layer, "layer_id", None) if layer_id_override is None else layer_id_override
        if layer_id is None:
            layer_id = layer_id_of(layer)  # raises for a missing layer or layer_id
        return self._route(layer_id)

    def register_mapping(self, full_to_swa_index_mapping: torch.Tensor) -> None:
        """Use ``full_to_swa_index_mapping`` (kept by reference, so the allocator's updates apply) to
        translate full slots for the SWA layers.

        Parameters
        ----------
        full_to_swa_index_mapping : Tensor [size + page_size + 1] int64 on the pool's device: entry
            ``s`` is the SWA slot of full slot ``s`` (0: none), the last entry is -1 (checked under
            ``validate``, with every entry in ``0..size_swa + page_size - 1``).

        Raises
        ------
        TypeError, ValueError
            Naming the argument, the expected and the actual value; nothing is registered.
        """
        m = full_to_swa_index_mapping
        want = self.full_kv_pool.rows + 1
        check_index(m, "full_to_swa_index_mapping", dtypes=(torch.int64,), dims="[size + page_size + 1]",
                    length=want, per="one per full slot, then -1", device=self.device)  # fmt: skip
        if self.validate:
            if int(m[-1]) != -1:
                raise ValueError(f"full_to_swa_index_mapping[-1] must be -1, got {int(m[-1])}")
            check_in_range([(m[:-1], self.swa_kv_pool.rows, "full_to_swa_index_mapping")], what="SWA slots",
                           negative_ok=False)  # fmt: skip
        self.full_to_swa_index_mapping = m

    def _mapping(self, what: str) -> torch.Tensor:
        if self.full_to_swa_index_mapping is None:
            raise ValueError(
                f"{what} needs the full-to-SWA mapping: call register_mapping first (SWATokenToKVPoolAllocator "
                "does when given this pool as kvcache)"
            )
        return self.full_to_swa_index_mapping

    def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor) -> torch.Tensor:
        """SWA slots of full slots ``kv_indices`` (any shape, int32/int64, on the pool's device), int32
        as in SGLang: ``mapping[s]`` for a slot of the full pool (0 where it has no SWA part), -1 for
        any other entry (padding). No synchronisation.

        Raises
        ------
        TypeError, ValueError
            For a malformed ``kv_indices``, or no mapping registered.
        """
        mapping = self._mapping("translate_loc_from_full_to_swa")
        _indices(kv_indices, "kv_indices", None, self.device)
        return translate_slots(mapping, kv_indices).to(torch.int32)

    def set_swa_loc(self, loc: Optional[torch.Tensor]) -> None:
        """SGLang's override: SWA layers' writes use ``loc`` (SWA slots, [T] int32/int64 on the pool's
        device) instead of translating theirs, until ``set_swa_loc(None)``."""
        if loc is not None:
            check_index(loc, "loc", dtypes=INDEX_DTYPES, dims="[T]", device=self.device)
        self.swa_loc = loc

    def _slot_map(self, loc: object, name: str, ndim: int, tokens: object) -> Optional[torch.Tensor]:
        """The mapping for a sliding-window layer's write to read in its own launch (``loc`` checked);
        None under ``validate``, whose writes translate first (``_swa_slots``) to range-check, and for
        FP4 parts, whose writes take translated slots."""
        if self.validate or not self.mapped_writes:
            return None
        _indices(loc, name, ndim, self.device, tokens)
        return self._mapping("a write to a sliding-window layer")

    def _swa_slots(self, loc: object, name: str, ndim: int, tokens: object) -> torch.Tensor:
        """``loc`` (full slots, checked) translated to SWA slots; IndexError under validate for an
        entry past the full pool."""
        _indices(loc, name, ndim, self.device, tokens)
        mapping = self._mapping("a write to a sliding-window layer")
        if self.validate:
            check_in_range([(loc, self.full_kv_pool.rows, name)], what="full slots")  # type: ignore[list-item]
        return translate_slots(mapping, loc)  # type: ignore[arg-type]

    def register_layer_transfer_counter(self, layer_transfer_counter: Optional[SWALayerTransferCounters]) -> None:
        """Make each part's getters wait for its layers' loads (``SWAKVPoolHost``'s per-layer loads: a
        stream wait, never a host sync): ``layer_transfer_counter.full`` is registered on
        ``full_kv_pool``, ``.swa`` on ``swa_kv_pool``. None removes both.

        Raises
        ------
        TypeError
            For anything but an ``SWALayerTransferCounters`` or None; nothing is registered.
        """
        c = layer_transfer_counter
        if c is not None and not isinstance(c, SWALayerTransferCounters):
            raise TypeError(
                "layer_transfer_counter must be an SWALayerTransferCounters (SWAKVPoolHost.layer_transfer_counter) "
                f"or None, got {type(c).__name__}"
            )
        self.full_kv_pool.register_layer_transfer_counter(None if c is None else c.full)
        self.swa_kv_pool.register_layer_transfer_counter(None if c is None else c.swa)
        self.layer_transfer_counter = c

    # --- getters ---------------------------------------------------------------------------------

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """K buffer of global layer ``layer_id`` (its part's), a ``dtype`` view."""
        pool, i, _ = self._route(layer_id)
        return pool.get_key_buffer(i)

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """V buffer of global layer ``layer_id``, a ``dtype`` view."""
        pool, i, _ = self._route(layer_id)
        return pool.get_value_buffer(i)

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K buffer, V buffer) of global layer ``layer_id``."""
        pool, i, _ = self._route(layer_id)
        return pool.get_kv_buffer(i)

    def get_fp4_buffers(self, layer_id: int) -> Union[Fp4Layer, Nvfp4Layer]:
        """FP4 parts: the stored codes and scale bytes of global layer ``layer_id`` (its part's
        ``get_fp4_buffers``: views, an NVFP4 part's with its global scales)."""
        pool, i = self._fp4_route(layer_id, "get_fp4_buffers")
        return pool.get_fp4_buffers(i)

    def set_global_scales(self, layer_id: int, k_scale: float, v_scale: float) -> None:
        """NVFP4 parts: global layer ``layer_id``'s global scales (its part's ``set_global_scales``:
        rules and errors; nothing changes on an error)."""
        pool, i = self._fp4_route(layer_id, "set_global_scales")
        pool.set_global_scales(i, k_scale, v_scale)

    def _fp4_route(self, layer_id: object, what: str) -> tuple[MHATokenToKVPoolFP4, int]:
        pool, i, _ = self._route(layer_id)
        if not isinstance(pool, MHATokenToKVPoolFP4):
            raise ValueError(f"{what} needs an FP4 dtype, and this pool's dtype is {self.dtype!r}")
        return pool, i

    def get_kv_size_bytes(self) -> tuple[int, int]:
        """(K bytes, V bytes) of both pools together."""
        fk, fv = self.full_kv_pool.get_kv_size_bytes()
        sk, sv = self.swa_kv_pool.get_kv_size_bytes()
        return fk + sk, fv + sv

    def get_contiguous_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """The full pool's buffers for registration with a transfer engine, as SGLang lists them:
        (addresses, byte lengths, bytes per page), K buffers of every layer then V buffers."""
        return part_buf_infos(self.full_kv_pool)

    def get_state_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """The SWA pool's buffers, as ``get_contiguous_buf_infos`` lists the full pool's."""
        return part_buf_infos(self.swa_kv_pool)

    # --- writes ----------------------------------------------------------------------------------

    def set_kv_buffer(
        self,
        layer: object,
        loc: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        k_scale: Scale = None,
        v_scale: Scale = None,
        layer_id_override: Optional[int] = None,
    ) -> None:
        """Write layer ``layer.layer_id`` (or ``layer_id_override``) for T tokens at full slots
        ``loc``. A full-attention layer is its pool's ``set_kv_buffer``; a sliding-window layer's rows
        go to the SWA slots ``translate_slots(mapping, loc)`` (or ``swa_loc`` when set), written by
        the SWA pool's ``set_kv_buffer``: the same bytes as that write at those slots. A full slot
        with no SWA part writes the SWA padding slot 0; a negative ``loc`` writes nothing. The
        fused kernel reads the mapping itself (one launch, the slots translated inside it); under
        ``validate``, and for FP4 parts, the slots are translated first (under ``validate``
        range-checked too).

        Raises
        ------
        TypeError, ValueError, IndexError
            As ``MHATokenToKVPool.set_kv_buffer``; also ``ValueError`` for a layer of neither kind,
            a ``loc`` that is not [T] int32/int64 on the pool's device, or no mapping registered
            (SWA layers). Nothing is written.
        """
        pool, i, is_swa = self._route_write(layer, layer_id_override)
        if is_swa and self.swa_loc is not None:
            loc = self.swa_loc
        elif is_swa:
            tokens = cache_k.shape[0] if isinstance(cache_k, torch.Tensor) and cache_k.dim() else None
            slot_map = self._slot_map(loc, "loc", 1, tokens)
            if slot_map is None:
                loc = self._swa_slots(loc, "loc", 1, tokens)
            else:
                pool.set_kv_buffer(None, loc, cache_k, cache_v, k_scale, v_scale, layer_id_override=i, slot_map=slot_map)
                return
        pool.set_kv_buffer(None, loc, cache_k, cache_v, k_scale, v_scale, layer_id_override=i)

    def set_kv_buffer_prefix_valid(
        self,
        layer: object,
        loc_2d: torch.Tensor,
        commit_lens: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        k_scale: Scale = None,
        v_scale: Scale = None,
        layer_id_override: Optional[int] = None,
    ) -> None:
        """The verify write (``MHATokenToKVPool.set_kv_buffer_prefix_valid``) on a global layer; a
        sliding-window layer's ``loc_2d`` (full slots, [bs, width]) is translated as for
        ``set_kv_buffer``. Errors as there, nothing written."""
        pool, i, is_swa = self._route_write(layer, layer_id_override)
        slot_map = None
        if is_swa:
            slot_map = self._slot_map(loc_2d, "loc_2d", 2, None)
            if slot_map is None:
                loc_2d = self._swa_slots(loc_2d, "loc_2d", 2, None)
        if isinstance(pool, MHATokenToKVPoolFP4):
            fp4_prefix_write(pool, i, loc_2d, commit_lens, cache_k, cache_v, k_scale, v_scale)
            return
        pool.set_kv_buffer_prefix_valid(
            None, loc_2d, commit_lens, cache_k, cache_v, k_scale, v_scale, layer_id_override=i, slot_map=slot_map
        )

    # --- moves and CPU copies --------------------------------------------------------------------

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        """Every full layer's rows ``tgt_loc[i]`` become copies of rows ``src_loc[i]``
        (``MHATokenToKVPool.move_kv_cache``), and every SWA layer's rows of the translated targets
        copies of the translated sources (a slot with no SWA part is the SWA padding slot 0).
        Both sides are checked, and translated, before either pool moves anything."""
        mapping = self._mapping("move_kv_cache")
        _indices(tgt_loc, "tgt_loc", 1, self.device)
        _indices(src_loc, "src_loc", 1, self.device, tgt_loc.shape[0], "one per tgt_loc entry")
        if self.validate:
            rows = self.full_kv_pool.rows
            check_in_range([(tgt_loc, rows, "tgt_loc"), (src_loc, rows, "src_loc")], what="full slots")
        swa_tgt, swa_src = translate_slots(mapping, tgt_loc), translate_slots(mapping, src_loc)
        self.full_kv_pool.move_kv_cache(tgt_loc, src_loc)
        self.swa_kv_pool.move_kv_cache(swa_tgt, swa_src)

    def get_cpu_copy(self, indices: torch.Tensor) -> dict[str, KVCpuCopy | PartsCpuCopy]:
        """Both parts' rows of full slots ``indices`` in host memory, as SGLang's dict: ``"full"``,
        the full pool's ``get_cpu_copy(indices)``, and ``"swa"``, the SWA pool's at the translated
        slots (a slot with no SWA part copies the SWA padding row 0). Waits for the device."""
        mapping = self._mapping("get_cpu_copy")
        _indices(indices, "indices", 1, self.device)
        full = self.full_kv_pool.get_cpu_copy(indices)  # checks the range: every entry a full slot
        return {"full": full, "swa": self.swa_kv_pool.get_cpu_copy(translate_slots(mapping, indices))}

    def load_cpu_copy(self, kv_cache_cpu: dict[str, KVCpuCopy | PartsCpuCopy], indices: torch.Tensor) -> None:
        """Write a ``get_cpu_copy`` back at full slots ``indices``: its ``"full"`` rows there, its
        ``"swa"`` rows at their translated SWA slots. Both copies are checked before either is
        written (errors name ``kv_cache_cpu``)."""
        mapping = self._mapping("load_cpu_copy")
        if not isinstance(kv_cache_cpu, dict):
            raise TypeError(f"kv_cache_cpu must be a dict (from get_cpu_copy), got {type(kv_cache_cpu).__name__}")
        if set(kv_cache_cpu) != {"full", "swa"}:
            missing = [k for k in ("full", "swa") if k not in kv_cache_cpu]
            other = sorted((k for k in kv_cache_cpu if k not in ("full", "swa")), key=repr)
            raise ValueError(f"kv_cache_cpu must have the keys 'full' and 'swa' (from get_cpu_copy), got keys "
                             f"{sorted(kv_cache_cpu, key=repr)}: missing {missing}, unexpected {other}")  # fmt: skip
        _indices(indices, "indices", 1, self.device)
        n = indices.shape[0]
        for key, pool in (("full", self.full_kv_pool), ("swa", self.swa_kv_pool)):
            if isinstance(pool, RowPartsCache):
                pool.check_cpu_copy(kv_cache_cpu[key], n)
                continue
            rows = (pool.layer_num, n, pool.head_num)
            k_shape, v_shape = (*rows, pool.head_dim), (*rows, pool.v_head_dim)
            check_cpu_copy(kv_cache_cpu[key], pool.dtype, pool.store_dtype, 0, k_shape, v_shape)
        swa = translate_slots(mapping, indices)
        if self.validate:  # both parts' slots, before either part is written
            check_in_range([(indices, self.full_kv_pool.rows, "indices")], what="full slots")
            check_in_range([(swa, self.swa_kv_pool.rows, "full_to_swa_index_mapping[indices]")], what="SWA slots",
                           negative_ok=False)  # fmt: skip
        self.full_kv_pool.load_cpu_copy(kv_cache_cpu["full"], indices)  # type: ignore[arg-type]
        self.swa_kv_pool.load_cpu_copy(kv_cache_cpu["swa"], swa)  # type: ignore[arg-type]


def _indices(
    t: object, name: str, ndim: Optional[int], device: torch.device, length: object = None, per: str = "one per token"
) -> None:
    """``t`` an int32/int64 tensor on ``device`` (of ``ndim`` dims and ``length`` entries when given)."""
    if ndim is None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        ndim = t.dim()
    check_index(t, name, dtypes=INDEX_DTYPES, ndim=ndim, device=device,
                length=length if isinstance(length, int) else None, per=per)  # fmt: skip
