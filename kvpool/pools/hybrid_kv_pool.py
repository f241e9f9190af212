"""``HybridLinearKVPool``: the KV cache of a hybrid linear-attention model, full-attention layers only.

Models such as Qwen3.5 and Qwen3-Next interleave full-attention layers, which keep K/V per token,
with linear-attention layers, which keep a fixed-size state per request (``MambaPool``). This pool
holds one ``MHATokenToKVPool`` (or ``MLATokenToKVPool``; with ``kv_scale_mode="per_token_head"`` an
``MHATokenToKVPoolFP8PerTokenHead``; with an FP4 ``dtype`` an ``MHATokenToKVPoolFP4`` or
``MLATokenToKVPoolFP4``) over the full-attention layers alone, densely numbered, and takes the
model's global layer ids everywhere: a linear layer's id raises ``ValueError`` naming it and the
full-attention layers.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from kvpool.checks import dense_layer_index, layer_id_of, non_negative_int, positive_int
from kvpool.pools.built_parts import (
    FP4,
    FP4_NOT_CALIBRATED,
    PER_TOKEN_HEAD,
    check_fp4_observe,
    fp4_format_name,
    fp4_prefix_write,
    layer_ids,
    part_options,
)
from kvpool.pools.cpu_copy import KVCpuCopy
from kvpool.pools.fp4_base import Fp4KVCache
from kvpool.pools.mamba_pool import MambaPool
from kvpool.pools.mha_fp4_pool import Fp4Layer, MHATokenToKVPoolFP4, Nvfp4Layer
from kvpool.pools.mha_fp8_token_pool import MHATokenToKVPoolFP8PerTokenHead
from kvpool.pools.mha_pool import MHATokenToKVPool
from kvpool.pools.mla_fp4_pool import Fp4LatentLayer, MLATokenToKVPoolFP4
from kvpool.pools.mla_pool import MLATokenToKVPool
from kvpool.pools.row_parts import PartsCpuCopy
from kvpool.write_types import Scale

GB = 1024**3
#: How a layer id that is not one of the pool's is named in errors.
_KIND, _LISTED = "full-attention", "full-attention layers"

#: What the inner pool is.
FullPool = Union[
    MHATokenToKVPool, MLATokenToKVPool, MHATokenToKVPoolFP8PerTokenHead, MHATokenToKVPoolFP4, MLATokenToKVPoolFP4
]
#: The inner pools of the MLA kind.
_MLA_POOLS = (MLATokenToKVPool, MLATokenToKVPoolFP4)


class _DenseLayer:
    """A stand-in for a model's layer object, carrying the inner pool's dense layer id."""

    __slots__ = ("layer_id",)

    def __init__(self, layer_id: int) -> None:
        self.layer_id = layer_id


class HybridLinearKVPool:
    """K/V buffers for the full-attention layers of a hybrid model, addressed by global layer id.

    The positional order of the arguments is SGLang's, so SGLang call sites carry over.

    Parameters
    ----------
    size, dtype, page_size, head_num, head_dim : as for ``MHATokenToKVPool`` (``head_num`` and
        ``head_dim`` are ignored with ``use_mla``).
    full_attention_layer_ids : global ids of the full-attention layers this rank holds (distinct);
        dense index ``i`` of the inner pool is ``full_attention_layer_ids[i]``.
    enable_kvcache_transpose : SGLang's; must be False.
    device : where the buffers live.
    mamba_pool : the ``MambaPool`` of the same model's linear layers (kept as ``mamba_pool``; its
        layers must not overlap ``full_attention_layer_ids``), or None.
    enable_memory_saver : must be False (kvpool has no memory saver).
    use_mla, kv_lora_rank, qk_rope_head_dim : an ``MLATokenToKVPool`` inside instead.
    start_layer : SGLang's; kept as ``start_layer`` (layer ids are global either way).
    v_head_dim, fused, warmup, validate, observe_amax : passed to the inner pool (keyword-only; an FP4
        pool takes no ``warmup``: its kernels compile on the first write).
    kv_scale_mode : ``"static"`` (the scales each write is given) or ``"per_token_head"`` (an FP8
        ``dtype`` with a scale per token and head computed at write time: the inner pool is an
        ``MHATokenToKVPoolFP8PerTokenHead``; MHA only, no ``observe_amax``).
    dtype FP4 : ``torch.float4_e2m1fn_x2``, ``"fp4_e2m1"`` or ``"nvfp4"`` builds SGLang's FP4 pool
        inside, as SGLang does: an ``MHATokenToKVPoolFP4`` (``MLATokenToKVPoolFP4`` with ``use_mla``,
        exponent scales only); no ``observe_amax``, ``kv_scale_mode`` ``"static"``.
    fp4_format : an FP4 ``dtype``'s format, ``"fp4_mx_block16"`` or ``"nvfp4"`` (None: from ``dtype``,
        as ``MHATokenToKVPoolFP4`` takes it); must be None for any other ``dtype``.
    k_global_scales, v_global_scales : NVFP4 only, as ``MHATokenToKVPoolFP4`` takes them (one per
        full-attention layer, in ``full_attention_layer_ids`` order); :meth:`set_global_scales`.
    out_dtype : what the dequantizing getters of an FP4 or per-token-head inner pool return (None:
        ``torch.bfloat16``); must be None for any other.

    Attributes
    ----------
    full_kv_pool : the inner pool (dense layer ids ``0..len(full_attention_layer_ids) - 1``).
    fp4_format : the FP4 format of an FP4 inner pool, else None; ``out_dtype`` its getters' (None
        for a pool whose getters return its buffers).
    full_attention_layer_id_mapping : dict, global id -> dense id.

    Examples
    --------
    >>> pool = HybridLinearKVPool(64, torch.bfloat16, 1, 2, 16, [3, 7], False, "cpu", None)
    >>> pool.get_key_buffer(7).shape
    torch.Size([65, 2, 16])
    >>> pool.get_key_buffer(4)
    Traceback (most recent call last):
    ValueError: layer_id 4 is not a full-attention layer of this pool: its full-attention layers are [3, 7]
    """

    def __init__(
        self,
        size: int,
        dtype: torch.dtype,
        page_size: int,
        head_num: int,
        head_dim: int,
        full_attention_layer_ids: Sequence[int],
        enable_kvcache_transpose: bool,
        device: str | torch.device,
        mamba_pool: Optional[MambaPool],
        enable_memory_saver: bool = False,
        use_mla: bool = False,
        kv_lora_rank: Optional[int] = None,
        qk_rope_head_dim: Optional[int] = None,
        start_layer: Optional[int] = None,
        *,
        v_head_dim: Optional[int] = None,
        fused: str = "auto",
        warmup: bool = True,
        validate: bool = False,
        observe_amax: bool = False,
        kv_scale_mode: str = "static",
        fp4_format: Optional[str] = None,
        k_global_scales: object = None,
        v_global_scales: object = None,
        out_dtype: Optional[torch.dtype] = None,
    ) -> None:
        kind, extra = part_options(
            dtype, kv_scale_mode, fp4_format, out_dtype, observe_amax, k_global_scales, v_global_scales, use_mla is True
        )
        if enable_kvcache_transpose not in (False, None):
            raise ValueError(
                f"enable_kvcache_transpose must be False (kvpool's buffers are [rows, H, D]), "
                f"got {enable_kvcache_transpose!r}"
            )
        ids = layer_ids(full_attention_layer_ids, "full_attention_layer_ids")
        if mamba_pool is not None:
            if not isinstance(mamba_pool, MambaPool):
                raise TypeError(f"mamba_pool must be a MambaPool or None, got {type(mamba_pool).__name__}")
            both = sorted(set(ids) & set(mamba_pool.layers))
            if both:
                raise ValueError(
                    f"full_attention_layer_ids must not include the mamba_pool's linear layers, got {both} in both"
                )
        if use_mla not in (True, False):
            raise ValueError(f"use_mla must be a bool, got {use_mla!r}")
        self.full_attention_layer_ids = ids
        self.full_attention_layer_id_mapping = {layer: i for i, layer in enumerate(ids)}
        self.full_layer_nums = len(ids)
        self.mamba_pool = mamba_pool
        self.use_mla = use_mla
        self.start_layer = 0 if start_layer is None else non_negative_int(start_layer, "start_layer")
        options = dict(fused=fused, warmup=warmup, validate=validate, observe_amax=observe_amax)
        layers, saver = len(ids), enable_memory_saver
        self.full_kv_pool: FullPool
        if kind == PER_TOKEN_HEAD:
            if use_mla or observe_amax:
                raise ValueError(
                    "kv_scale_mode='per_token_head' needs MHA layers and no calibration (use_mla=False, "
                    f"observe_amax=False), got use_mla={use_mla!r}, observe_amax={observe_amax!r}"
                )
            self.full_kv_pool = MHATokenToKVPoolFP8PerTokenHead(
                size, page_size, dtype, head_num, head_dim, layers, device, saver, v_head_dim,
                fused=fused, warmup=warmup, validate=validate, **extra,
            )  # fmt: skip
        elif use_mla:
            if v_head_dim is not None:
                raise ValueError(
                    f"v_head_dim must be None with use_mla (the rotary part is qk_rope_head_dim), got {v_head_dim!r}"
                )
            lora, rope = positive_int(kv_lora_rank, "kv_lora_rank"), positive_int(qk_rope_head_dim, "qk_rope_head_dim")
            if kind == FP4:
                self.full_kv_pool = MLATokenToKVPoolFP4(
                    size, page_size, dtype, lora, rope, layers, device, saver, fused=fused, validate=validate, **extra
                )
            else:
                self.full_kv_pool = MLATokenToKVPool(size, page_size, dtype, lora, rope, layers, device, saver, **options)
        elif kind == FP4:
            self.full_kv_pool = MHATokenToKVPoolFP4(
                size, page_size, dtype, head_num, head_dim, layers, device, saver, v_head_dim,
                fused=fused, validate=validate, **extra,
            )  # fmt: skip
        else:
            self.full_kv_pool = MHATokenToKVPool(
                size, page_size, dtype, head_num, head_dim, layers, device, saver, v_head_dim, **options
            )
        inner = self.full_kv_pool
        self.size, self.page_size = inner.size, inner.page_size
        self.dtype, self.store_dtype = inner.dtype, inner.store_dtype
        if isinstance(inner, MLATokenToKVPoolFP4):  # as MLATokenToKVPool names its row's parts
            self.head_num, self.head_dim, self.v_head_dim = 1, inner.kv_lora_rank, inner.qk_rope_head_dim
        else:
            self.head_num, self.head_dim, self.v_head_dim = inner.head_num, inner.head_dim, inner.v_head_dim
        self.fp4_format, self.out_dtype = fp4_format_name(inner), getattr(inner, "out_dtype", None)
        self.kv_lora_rank, self.qk_rope_head_dim = (kv_lora_rank, qk_rope_head_dim) if use_mla else (None, None)
        self.device, self.validate, self.stats = inner.device, inner.validate, inner.stats
        self.layer_num = len(ids)
        sizes = inner.get_kv_size_bytes()
        self.mem_usage = (sum(sizes) if isinstance(sizes, tuple) else sizes) / GB

    # --- layers ----------------------------------------------------------------------------------

    def dense_layer_id(self, layer_id: object) -> int:
        """The inner pool's id of global full-attention layer ``layer_id``. Raises ``TypeError`` for
        a non-int and ``ValueError`` naming the id and the full-attention layers otherwise."""
        return dense_layer_index(layer_id, self.full_attention_layer_id_mapping, _KIND, _LISTED)

    def _dense_of(self, layer: object, layer_id_override: Optional[int]) -> int:
        """The dense id of the layer a write names: ``layer_id_override`` or ``layer.layer_id``."""
        layer_id = getattr(layer, "layer_id", None) if layer_id_override is None else layer_id_override
        if layer_id is None:
            layer_id = layer_id_of(layer)  # raises for a missing layer or layer_id
        return dense_layer_index(layer_id, self.full_attention_layer_id_mapping, _KIND, _LISTED)

    # --- getters ---------------------------------------------------------------------------------

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """K buffer (MLA: whole rows) of global full-attention layer ``layer_id``, a ``dtype`` view."""
        return self.full_kv_pool.get_key_buffer(self.dense_layer_id(layer_id))

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """V buffer (MLA: the latent columns) of global full-attention layer ``layer_id``."""
        return self.full_kv_pool.get_value_buffer(self.dense_layer_id(layer_id))

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K buffer, V buffer) of global full-attention layer ``layer_id``, the inner pool's getter."""
        return self.full_kv_pool.get_kv_buffer(self.dense_layer_id(layer_id))

    def get_kv_size_bytes(self) -> tuple[int, int] | int:
        """The inner pool's: ``(k_bytes, v_bytes)`` for MHA, one int for MLA."""
        return self.full_kv_pool.get_kv_size_bytes()

    def get_v_head_dim(self) -> int:
        """The V buffer's last dimension: ``v_head_dim`` for MHA, the latent columns for MLA."""
        inner = self.full_kv_pool
        if isinstance(inner, MLATokenToKVPool):
            return inner.get_value_buffer(0).shape[-1]
        return inner.kv_lora_rank if isinstance(inner, MLATokenToKVPoolFP4) else inner.v_head_dim

    def get_fp4_buffers(self, layer_id: int) -> Union[Fp4Layer, Nvfp4Layer, Fp4LatentLayer]:
        """An FP4 inner pool's ``get_fp4_buffers`` on global full-attention layer ``layer_id``: its
        stored codes and scale bytes (an NVFP4 pool's with its global scales), views, never copies."""
        return self._fp4("get_fp4_buffers").get_fp4_buffers(self.dense_layer_id(layer_id))

    def set_global_scales(self, layer_id: int, k_scale: float, v_scale: float) -> None:
        """An NVFP4 inner pool's ``set_global_scales`` on global full-attention layer ``layer_id``
        (its rules and errors; nothing changes on an error)."""
        pool = self._fp4("set_global_scales")
        if not isinstance(pool, MHATokenToKVPoolFP4):
            raise ValueError("set_global_scales is for fp4_format='nvfp4', got fp4_format='fp4_mx_block16'")
        pool.set_global_scales(self.dense_layer_id(layer_id), k_scale, v_scale)

    def _fp4(self, what: str) -> Union[MHATokenToKVPoolFP4, MLATokenToKVPoolFP4]:
        if not isinstance(self.full_kv_pool, (MHATokenToKVPoolFP4, MLATokenToKVPoolFP4)):
            raise ValueError(f"{what} needs an FP4 dtype, and this pool's dtype is {self.dtype!r}")
        return self.full_kv_pool

    def get_state_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """The ``mamba_pool``'s ``get_contiguous_buf_infos()`` (SGLang's name)."""
        if self.mamba_pool is None:
            raise ValueError("get_state_buf_infos needs a mamba_pool, and this pool was built without one")
        return self.mamba_pool.get_contiguous_buf_infos()

    # --- writes ----------------------------------------------------------------------------------

    def set_kv_buffer(
        self,
        layer: object,
        loc: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: Optional[torch.Tensor],
        k_scale: Scale = None,
        v_scale: Scale = None,
        layer_id_override: Optional[int] = None,
    ) -> None:
        """The inner pool's ``set_kv_buffer`` on global layer ``layer.layer_id`` (or
        ``layer_id_override``): semantics, errors, fused path and statistics are the inner pool's."""
        i = self._dense_of(layer, layer_id_override)
        pool = self.full_kv_pool
        pool.set_kv_buffer(None, loc, cache_k, cache_v, k_scale, v_scale, layer_id_override=i)  # type: ignore[arg-type]

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
        """The verify write of ``MHATokenToKVPool`` on a global layer (MHA only; an FP4 inner pool's
        tokens are written as its ``set_kv_buffer`` writes them)."""
        if isinstance(self.full_kv_pool, _MLA_POOLS):
            raise ValueError("set_kv_buffer_prefix_valid needs an MHA pool inside, and this one uses MLA")
        i = self._dense_of(layer, layer_id_override)
        if isinstance(self.full_kv_pool, MHATokenToKVPoolFP4):
            fp4_prefix_write(self.full_kv_pool, i, loc_2d, commit_lens, cache_k, cache_v, k_scale, v_scale)
            return
        self.full_kv_pool.set_kv_buffer_prefix_valid(
            None, loc_2d, commit_lens, cache_k, cache_v, k_scale, v_scale, layer_id_override=i
        )

    def set_mla_kv_buffer(
        self,
        layer: object,
        loc: torch.Tensor,
        cache_k_nope: torch.Tensor,
        cache_k_rope: torch.Tensor,
        k_scale: Scale = None,
        layer_id_override: Optional[int] = None,
    ) -> None:
        """``MLATokenToKVPool.set_mla_kv_buffer`` on a global layer (MLA only)."""
        pool = self._mla("set_mla_kv_buffer")
        i = self._dense_of(layer, layer_id_override)
        pool.set_mla_kv_buffer(None, loc, cache_k_nope, cache_k_rope, k_scale, layer_id_override=i)

    def get_mla_kv_buffer(
        self, layer: object, loc: torch.Tensor, dst_dtype: Optional[torch.dtype] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``MLATokenToKVPool.get_mla_kv_buffer`` on global layer ``layer.layer_id`` (MLA only)."""
        pool = self._mla("get_mla_kv_buffer")
        return pool.get_mla_kv_buffer(_DenseLayer(self._dense_of(layer, None)), loc, dst_dtype)

    def _mla(self, what: str) -> Union[MLATokenToKVPool, MLATokenToKVPoolFP4]:
        if not isinstance(self.full_kv_pool, _MLA_POOLS):
            raise ValueError(f"{what} needs use_mla=True, and this pool holds MHA buffers")
        return self.full_kv_pool

    # --- moves, CPU copies, host tier ------------------------------------------------------------

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        """Every full-attention layer's rows ``tgt_loc[i]`` become copies of rows ``src_loc[i]``."""
        self.full_kv_pool.move_kv_cache(tgt_loc, src_loc)

    def get_cpu_copy(self, indices: torch.Tensor) -> KVCpuCopy | PartsCpuCopy:
        """The inner pool's ``get_cpu_copy`` (KV rows only, with their scales in an FP4 or per-token-head pool;
        layer ``l`` of the copy is ``full_attention_layer_ids[l]``). The state of the same requests:
        ``mamba_pool.get_cpu_copy``."""
        return self.full_kv_pool.get_cpu_copy(indices)

    def load_cpu_copy(self, kv_cache_cpu: KVCpuCopy | PartsCpuCopy, indices: torch.Tensor) -> None:
        """The inner pool's ``load_cpu_copy``: a ``get_cpu_copy``'s KV rows back into slots ``indices``."""
        self.full_kv_pool.load_cpu_copy(kv_cache_cpu, indices)  # type: ignore[arg-type]

    def register_layer_transfer_counter(self, layer_transfer_counter: object) -> None:
        """Registered on the inner pool: its getters wait for the load of dense layer ``i``."""
        self.full_kv_pool.register_layer_transfer_counter(layer_transfer_counter)

    @property
    def layer_transfer_counter(self) -> object:
        """The counter registered on the inner pool (None until one is)."""
        return self.full_kv_pool.layer_transfer_counter

    # --- calibration -----------------------------------------------------------------------------

    def observe_amax(self, enabled: bool = True) -> None:
        """The inner pool's ``observe_amax``: its writes fold their maxima into ``kv_amax`` (or stop).
        An FP4 inner pool observes nothing: only ``observe_amax(False)`` is allowed."""
        if isinstance(self.full_kv_pool, Fp4KVCache):
            check_fp4_observe(enabled)
            return
        self.full_kv_pool.observe_amax(enabled)

    def reset_amax(self) -> None:
        """The inner pool's ``reset_amax`` (nothing to reset for an FP4 inner pool)."""
        if not isinstance(self.full_kv_pool, Fp4KVCache):
            self.full_kv_pool.reset_amax()

    @property
    def kv_amax(self) -> Optional[torch.Tensor]:
        """The inner pool's maxima, ``[full layers, 2, heads]`` in dense order (None for an FP4 one)."""
        return None if isinstance(self.full_kv_pool, Fp4KVCache) else self.full_kv_pool.kv_amax

    def calibrated_scales(
        self, margin: float = 1.0, per_head: bool = False, dtype: Optional[torch.dtype] = None
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The inner pool's calibrated ``(k_scale, v_scale)`` keyed by global layer id (``ValueError``
        for an FP4 or per-token-head inner pool, which has nothing to calibrate)."""
        if isinstance(self.full_kv_pool, Fp4KVCache):
            raise ValueError(FP4_NOT_CALIBRATED)
        scales = self.full_kv_pool.calibrated_scales(margin, per_head, dtype)
        return dict(zip(self.full_attention_layer_ids, scales))
