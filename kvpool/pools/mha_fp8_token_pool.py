"""``MHATokenToKVPoolFP8PerTokenHead``: an FP8 K/V pool whose every row carries its own scale per
head, computed when the row is written (no calibration, no checkpoint scales): per layer FP8 codes
``[rows, H, D]`` and float32 scales ``[rows, H]`` beside them. The getters dequantize for reference
attention; ``get_fp8_buffers`` hands attention backends the codes and scales as stored. The format
and the rules are in docs/contract.md, "Per-token-head FP8"."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from kvpool.config import fused_mode
from kvpool.kernels.formats import INPUT_DTYPES, LOC_DTYPES
from kvpool.kernels.fused_path import check_always
from kvpool.kernels.store_fp8_token import TOKEN_HEAD_DTYPES, dequantize_token_head, mapped_slots
from kvpool.kernels.store_fp8_token.writer import token_head_cache_verdict, write_token_head
from kvpool.kernels.store_kv.checks import (
    check_commit_lens,
    check_loc,
    check_loc_2d,
    check_prefix_values,
    check_rows,
    check_scale,
    check_values,
)
from kvpool.kernels.store_kv.naive import prefix_slots
from kvpool.kernels.store_kv.writer import PathStats
from kvpool.pools.base import HasLayerId, check_sglang_keywords, head_geometry
from kvpool.pools.mha_pool import check_slot_map
from kvpool.pools.row_parts import RowPartsCache
from kvpool.write_types import Scale

#: How the pools that build their own inner pools (``HybridLinearKVPool``, ``SWAKVPool``) take their
#: FP8 scales (``kv_scale_mode``): ``"static"``, the scales each write is given (per tensor or per
#: head: a checkpoint's or calibrated); ``"per_token_head"``, a scale per token and head computed
#: when the row is written (this module's pool).
KV_SCALE_MODES = ("static", "per_token_head")


def check_kv_scale_mode(mode: object) -> str:
    """``mode`` if it is one of ``KV_SCALE_MODES``, else ValueError naming ``kv_scale_mode``."""
    if not isinstance(mode, str) or mode not in KV_SCALE_MODES:
        raise ValueError(f"kv_scale_mode must be one of {list(KV_SCALE_MODES)}, got {mode!r}")
    return mode


class Fp8TokenHeadLayer(NamedTuple):
    """One layer's stored buffers (views of the pool's memory, never copies)."""

    k: torch.Tensor  # [rows, H, D] of the pool's FP8 dtype (a view of the uint8 codes)
    v: torch.Tensor  # [rows, H, Dv]
    k_scale: torch.Tensor  # [rows, H] float32: K row (slot, head) is k[slot, head] * k_scale[slot, head]
    v_scale: torch.Tensor  # [rows, H] float32


class MHATokenToKVPoolFP8PerTokenHead(RowPartsCache):
    """FP8 K/V cache buffers with a scale per token and head, for the attention layers
    ``[start_layer, end_layer]`` of one rank.

    Per layer, zeroed: ``k_buffer`` ``[size + page_size, head_num, head_dim]`` and ``v_buffer``
    ``[.., head_num, v_head_dim]`` of uint8 (the FP8 codes), ``k_scale_buffer`` and
    ``v_scale_buffer`` ``[size + page_size, head_num]`` of float32. Slot 0 is the padding slot.
    The positional order of the arguments is SGLang's ``MHATokenToKVPool``'s.

    Parameters
    ----------
    size, page_size, head_num, head_dim, layer_num, device, v_head_dim, start_layer, end_layer :
        as ``MHATokenToKVPool``.
    dtype : ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
    swa_head_num, swa_head_dim, swa_v_head_dim : SGLang's; when given they replace the geometry.
    enable_memory_saver, enable_alt_stream, enable_kv_cache_copy : SGLang's (memory saver: False).
    fused : ``"auto"`` (the fused Triton write where the gate allows: CUDA; else the reference),
        ``"always"`` (raise ``FusedPathUnavailable`` with the gate's reason instead; on the CPU it runs
        the kernel through Triton's interpreter), ``"never"``. ``KVPOOL_FUSED`` overrides it.
    warmup : on CUDA, compile the kernel for every input and loc dtype at construction (writing
        nothing).
    validate : check slot range (and the form of ignored scales' values) on every write, one
        synchronisation each; ``KVPOOL_VALIDATE=1`` turns it on too.
    out_dtype : what the dequantizing getters return (default ``torch.bfloat16``).

    Examples
    --------
    >>> pool = MHATokenToKVPoolFP8PerTokenHead(64, 1, torch.float8_e4m3fn, head_num=2, head_dim=16,
    ...                                        layer_num=1, device="cpu")
    >>> k = torch.randn(3, 2, 16, dtype=torch.bfloat16)
    >>> pool.set_kv_buffer(None, torch.tensor([1, 2, 3]), k, k, layer_id_override=0)
    >>> pool.get_fp8_buffers(0).k_scale.shape, pool.get_key_buffer(0).dtype
    (torch.Size([65, 2]), torch.bfloat16)
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
        out_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        check_sglang_keywords(enable_memory_saver, enable_alt_stream, enable_kv_cache_copy)
        if dtype not in TOKEN_HEAD_DTYPES:
            raise ValueError(
                f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2 for a per-token-head FP8 pool, got {dtype!r}"
            )
        if out_dtype not in INPUT_DTYPES:
            raise ValueError(f"out_dtype must be torch.bfloat16, torch.float16 or torch.float32, got {out_dtype!r}")
        super().__init__(size, page_size, layer_num, device, start_layer, end_layer, validate)
        self.dtype, self.store_dtype, self.out_dtype = dtype, torch.uint8, out_dtype
        self.head_num, self.head_dim, self.v_head_dim = head_geometry(
            head_num, head_dim, v_head_dim, swa_head_num, swa_head_dim, swa_v_head_dim
        )
        h = self.head_num
        self._init_parts({
            "k_buffer": self._new_buffer((h, self.head_dim), torch.uint8),
            "v_buffer": self._new_buffer((h, self.v_head_dim), torch.uint8),
            "k_scale_buffer": self._new_buffer((h,), torch.float32),
            "v_scale_buffer": self._new_buffer((h,), torch.float32),
        })  # fmt: skip
        self.fused_mode = fused_mode(fused)
        #: The gate's verdict on these buffers, ``(eligible, reason)``: nothing else decides the path.
        self.fused_verdict = token_head_cache_verdict(
            self.device, dtype, self.head_dim, self.v_head_dim, self.fused_mode
        )
        check_always(self.fused_mode, self.fused_verdict)
        #: Writes per path, and why the reference path ran.
        self.stats = PathStats()
        fused_here = self.device.type == "cuda" and self.fused_verdict[0] and self.fused_mode != "never"
        self._warm = bool(warmup) and fused_here
        if self._warm:
            self._warmup()

    # --- readers ---------------------------------------------------------------------------------

    def get_fp8_buffers(self, layer_id: int) -> Fp8TokenHeadLayer:
        """The stored codes (as the pool's FP8 dtype) and scales of global layer ``layer_id``, for
        attention kernels that read per-token-head FP8 directly: views, never copies."""
        k, v, ks, vs = self._parts[self._wait_layer(layer_id)]
        return Fp8TokenHeadLayer(k.view(self.dtype), v.view(self.dtype), ks, vs)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """Global layer ``layer_id``'s K rows dequantized (``float32(code) * scale``), [rows,
        head_num, head_dim] of ``out_dtype``: a new tensor, for reference attention."""
        i = self._wait_layer(layer_id)
        return dequantize_token_head(self.k_buffer[i], self.k_scale_buffer[i], self.dtype, self.out_dtype)

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """Global layer ``layer_id``'s V rows dequantized, as :meth:`get_key_buffer`."""
        i = self._wait_layer(layer_id)
        return dequantize_token_head(self.v_buffer[i], self.v_scale_buffer[i], self.dtype, self.out_dtype)

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of global layer ``layer_id`` dequantized, with one wait."""
        i = self._wait_layer(layer_id)
        return (
            dequantize_token_head(self.k_buffer[i], self.k_scale_buffer[i], self.dtype, self.out_dtype),
            dequantize_token_head(self.v_buffer[i], self.v_scale_buffer[i], self.dtype, self.out_dtype),
        )

    def get_kv_size_bytes(self) -> tuple[int, int]:
        """(K bytes, V bytes) of all layers, each with its scales."""
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
        *,
        slot_map: Optional[torch.Tensor] = None,
    ) -> None:
        """Write one layer's K/V rows for T tokens: row ``loc[t]`` of the code buffers becomes the FP8
        of ``cache_k[t]`` and ``cache_v[t]`` with one scale per head, and the same row of the scale
        buffers those scales (docs/contract.md, "Per-token-head FP8").

        Parameters
        ----------
        layer : an object with ``.layer_id`` (global id), or None with ``layer_id_override``.
        loc : Tensor [T], int32/int64, on the pool's device. ``loc[t] < 0`` writes nothing;
            ``loc[t] >= size + page_size`` is never written (IndexError under ``validate``).
        cache_k, cache_v : Tensor [T, head_num, head_dim] / [T, head_num, v_head_dim], bf16/fp16/fp32,
            any strides. Never modified.
        k_scale, v_scale : checked as for ``MHATokenToKVPool.set_kv_buffer``, then not used: each row's
            own scale replaces a checkpoint's (SGLang's layers pass theirs on every write).
        layer_id_override : global layer id; takes precedence over ``layer.layer_id``.
        slot_map : Tensor [M] int64 on the pool's device, or None: as for
            ``MHATokenToKVPool.set_kv_buffer`` (``loc`` holds another pool's slots, token ``t`` goes to
            row ``slot_map[loc[t]]``, nothing for an entry outside ``[0, M)``), read by the fused
            kernel in the same launch.

        Raises
        ------
        TypeError, ValueError, IndexError
            On malformed arguments, before anything is written.
        FusedPathUnavailable
            With ``fused="always"``, when the gate refuses the write, before anything is written.

        No host-device synchronisation (unless ``validate``); CUDA-graph safe on the fused path.
        """
        i = self._write_index(layer, layer_id_override)
        t = self._check_inputs(cache_k, cache_v)
        check_loc(loc, "loc", t, self.device)
        k_scale, v_scale = self._check_scales(k_scale, v_scale)
        if slot_map is not None:
            check_slot_map(slot_map, self.device)
        if self.validate:
            check_values(loc if slot_map is None else mapped_slots(slot_map, loc), "loc", self.rows, k_scale, v_scale)
        self._write(i, cache_k, cache_v, loc, slot_map)

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
        """The speculative-decoding verify write (``MHATokenToKVPool.set_kv_buffer_prefix_valid``'s
        rules): token ``(i, j)`` (input row ``i * width + j``) is written to slot ``loc_2d[i, j]`` as
        :meth:`set_kv_buffer` writes a token, iff ``j < commit_lens[i]``. ``commit_lens`` is read on
        the device (no synchronisation). ``slot_map`` as for :meth:`set_kv_buffer`.

        Raises
        ------
        TypeError, ValueError, IndexError
            On malformed arguments, before anything is written; under ``validate`` also for a
            committed slot out of range or a ``commit_lens`` value outside ``0..width``.
        """
        i = self._write_index(layer, layer_id_override)
        t = self._check_inputs(cache_k, cache_v)
        check_loc_2d(loc_2d, "loc_2d", t, self.device)
        check_commit_lens(commit_lens, loc_2d.shape[0], self.device)
        k_scale, v_scale = self._check_scales(k_scale, v_scale)
        if slot_map is not None:
            check_slot_map(slot_map, self.device)
        if self.validate:
            rows_2d = loc_2d if slot_map is None else mapped_slots(slot_map, loc_2d)
            check_prefix_values(rows_2d, commit_lens, self.rows, k_scale, v_scale)
        self._write(i, cache_k, cache_v, prefix_slots(loc_2d, commit_lens), slot_map)

    def _check_inputs(self, cache_k: object, cache_v: object) -> int:
        """T of checked ``cache_k`` and ``cache_v``."""
        check_rows(cache_k, "cache_k", self.head_num, self.head_dim, self.device)
        check_rows(cache_v, "cache_v", self.head_num, self.v_head_dim, self.device)
        t, tv = cache_k.shape[0], cache_v.shape[0]  # type: ignore[union-attr]
        if tv != t:
            raise ValueError(f"cache_v must have T={t} tokens (cache_k's), got {tv}")
        return t

    def _check_scales(self, k_scale: Scale, v_scale: Scale) -> tuple[Scale, Scale]:
        return (
            check_scale(k_scale, "k_scale", self.head_num, self.device),
            check_scale(v_scale, "v_scale", self.head_num, self.device),
        )

    def _write(
        self, i: int, k: torch.Tensor, v: torch.Tensor, loc: torch.Tensor, slot_map: Optional[torch.Tensor] = None
    ) -> None:
        k_store, v_store = (self.k_buffer[i], self.k_scale_buffer[i]), (self.v_buffer[i], self.v_scale_buffer[i])
        write_token_head(
            self.fused_verdict, self.fused_mode, self.stats, k, v, k_store, v_store, loc, self.dtype, slot_map
        )

    def _warmup(self, slot_map: Optional[torch.Tensor] = None) -> None:
        """Compile the kernel for every input and loc dtype on the pool's device (with ``slot_map``,
        its mapped variants), writing nothing (every slot is -1), and uncounted."""
        h, dev = self.head_num, self.device
        for in_dtype in INPUT_DTYPES:
            k = torch.zeros((1, h, self.head_dim), dtype=in_dtype, device=dev)
            v = torch.zeros((1, h, self.v_head_dim), dtype=in_dtype, device=dev)
            for loc_dtype in LOC_DTYPES:
                self._write(0, k, v, torch.full((1,), -1, dtype=loc_dtype, device=dev), slot_map)
        self.stats = PathStats()

    def warm_mapped_writes(self) -> None:
        """Compile, on CUDA with warmup on, the kernel's variants for writes through a ``slot_map``
        (``SWAKVPool`` calls this for its sliding-window part), writing nothing."""
        if self._warm:
            self._warmup(slot_map=torch.full((1,), -1, dtype=torch.int64, device=self.device))

    # --- calibration (not used: every row carries its own scale) ---------------------------------

    def observe_amax(self, enabled: bool = True) -> None:
        """Calibration does not apply to this pool: ``observe_amax(True)`` raises ``ValueError``;
        ``observe_amax(False)`` does nothing."""
        if enabled is not False:
            raise ValueError(
                f"enabled must be False for a per-token-head FP8 pool (each row's scale is computed when it "
                f"is written, nothing to calibrate), got {enabled!r}"
            )

    @property
    def kv_amax(self) -> None:
        """Always None: this pool observes no maxima."""
        return None

    def reset_amax(self) -> None:
        """Nothing to reset."""

    def calibrated_scales(
        self, margin: float = 1.0, per_head: bool = False, dtype: Optional[torch.dtype] = None
    ) -> list:
        """Raises ``ValueError``: each row's scale is computed when it is written."""
        raise ValueError(
            "calibrated_scales needs a pool with static scales (kv_scale_mode='static'): a per-token-head "
            "FP8 pool computes each row's scale when it is written"
        )
