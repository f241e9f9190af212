"""What ``HybridLinearKVPool`` and ``SWAKVPool`` build their parts as, from SGLang's constructor
arguments and kvpool's keywords: the ``dtype`` (an FP4 dtype builds SGLang's FP4 pool, as SGLang
does for ``torch.float4_e2m1fn_x2``), ``kv_scale_mode`` and ``fp4_format``; and what those pools do
with an FP4 part where it lacks a method of the others (the verify write, calibration); and the
checks and listings both share (layer id lists, buffer registration). The rules are in
docs/contract.md, "Selecting it" and "FP4 parts"."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from kvpool.checks import non_negative_int
from kvpool.kernels.store_fp4 import FP4_DTYPE
from kvpool.kernels.store_kv.checks import check_commit_lens, check_loc_2d, check_prefix_values, check_rows
from kvpool.kernels.store_kv.naive import prefix_slots
from kvpool.pools.fp4_base import FP4_DTYPE_NAME, Fp4KVCache
from kvpool.pools.mha_fp4_pool import MHATokenToKVPoolFP4
from kvpool.pools.mha_fp8_token_pool import check_kv_scale_mode
from kvpool.pools.nvfp4_scales import FP4_MX_BLOCK16, NVFP4, fp4_format_of
from kvpool.pools.row_parts import RowPartsCache
from kvpool.write_types import Scale

#: The kinds of part: the scales each write is given; a scale per token and head
#: (``MHATokenToKVPoolFP8PerTokenHead``); SGLang's FP4 (``MHATokenToKVPoolFP4``, ``MLATokenToKVPoolFP4``).
STATIC, PER_TOKEN_HEAD, FP4 = "static", "per_token_head", "fp4"

#: How the FP4 dtypes are spelled in errors.
FP4_SPELLED = (f"{FP4_DTYPE}, " if FP4_DTYPE is not None else "") + f"{FP4_DTYPE_NAME!r} or {NVFP4!r}"


def is_fp4_dtype(dtype: object) -> bool:
    """Whether ``dtype`` names an FP4 pool: ``torch.float4_e2m1fn_x2`` (where torch has it),
    ``"fp4_e2m1"`` or ``"nvfp4"`` (SGLang's ``--kv-cache-dtype`` names)."""
    if isinstance(dtype, str):
        return dtype in (FP4_DTYPE_NAME, NVFP4)
    return FP4_DTYPE is not None and dtype is FP4_DTYPE


def part_options(
    dtype: object,
    kv_scale_mode: object,
    fp4_format: object,
    out_dtype: Optional[torch.dtype],
    observe_amax: object,
    k_global_scales: object,
    v_global_scales: object,
    use_mla: bool = False,
) -> tuple[str, dict]:
    """The kind of part these arguments build (``STATIC``, ``PER_TOKEN_HEAD``, ``FP4``) and the
    keywords its constructor takes beyond the shared ones (``out_dtype``; for MHA FP4 ``fp4_format``
    and the NVFP4 global scales). Raises ``ValueError`` naming the argument, the expected and the
    actual value, for a combination no part takes; nothing is built."""
    mode = check_kv_scale_mode(kv_scale_mode)
    scales_given = k_global_scales is not None or v_global_scales is not None
    if not is_fp4_dtype(dtype):
        if fp4_format is not None:
            raise ValueError(f"fp4_format must be None unless dtype is FP4 ({FP4_SPELLED}), got {fp4_format!r} "
                             f"with dtype={dtype!r}")  # fmt: skip
        if scales_given:
            raise ValueError(f"k_global_scales/v_global_scales must be None unless dtype is FP4 with fp4_format='nvfp4', "
                             f"got dtype={dtype!r}")  # fmt: skip
        kind = PER_TOKEN_HEAD if mode == PER_TOKEN_HEAD else STATIC
        if kind == STATIC:
            if out_dtype is not None:
                raise ValueError(
                    "out_dtype must be None for a part that hands out its buffers as stored (it is for an FP4 dtype "
                    f"or kv_scale_mode='per_token_head', whose getters dequantize), got {out_dtype!r}"
                )
            return kind, {}
        return kind, {"out_dtype": torch.bfloat16 if out_dtype is None else out_dtype}
    fmt = fp4_format_of(dtype, fp4_format)  # type: ignore[arg-type]
    if mode != STATIC:
        raise ValueError(f"kv_scale_mode must be 'static' with an FP4 dtype (FP4 rows carry their own block scales), "
                         f"got {mode!r}")  # fmt: skip
    if observe_amax is not False:
        raise ValueError(f"observe_amax must be False with an FP4 dtype (each block's scale is computed when its row "
                         f"is written, nothing to calibrate), got {observe_amax!r}")  # fmt: skip
    options: dict = {"out_dtype": torch.bfloat16 if out_dtype is None else out_dtype}
    if use_mla:
        if fmt != FP4_MX_BLOCK16:
            raise ValueError(f"fp4_format must be {FP4_MX_BLOCK16!r} (or None) with use_mla (MLATokenToKVPoolFP4 stores "
                             f"exponent scales only), got {fmt!r}")  # fmt: skip
        if scales_given:
            raise ValueError("k_global_scales/v_global_scales must be None with use_mla (they are NVFP4's)")
        return FP4, options
    options.update(fp4_format=fmt, k_global_scales=k_global_scales, v_global_scales=v_global_scales)
    return FP4, options


def fp4_prefix_write(
    pool: Fp4KVCache,
    layer_index: int,
    loc_2d: object,
    commit_lens: object,
    cache_k: object,
    cache_v: object,
    k_scale: Scale,
    v_scale: Scale,
) -> None:
    """The verify write (``MHATokenToKVPool.set_kv_buffer_prefix_valid``'s rules) on an MHA FP4 part:
    token ``(i, j)`` is written as the part's ``set_kv_buffer`` writes a token iff ``j <
    commit_lens[i]`` (read on the device: no synchronisation); ``layer_index`` is the part's own
    layer id. Everything is checked before anything is written; under the part's ``validate`` also
    the commit lengths and every committed slot."""
    if not isinstance(pool, MHATokenToKVPoolFP4):
        raise ValueError("set_kv_buffer_prefix_valid needs an MHA pool inside, and this one uses MLA")
    k = check_rows(cache_k, "cache_k", pool.head_num, pool.head_dim, pool.device)
    loc_2d = check_loc_2d(loc_2d, "loc_2d", k.shape[0], pool.device)
    commit_lens = check_commit_lens(commit_lens, loc_2d.shape[0], pool.device)
    if pool.validate:
        check_prefix_values(loc_2d, commit_lens, pool.rows, None, None)
    loc = prefix_slots(loc_2d, commit_lens)
    pool.set_kv_buffer(None, loc, k, cache_v, k_scale, v_scale, layer_id_override=layer_index)  # type: ignore[arg-type]


def check_fp4_observe(enabled: object) -> None:
    """An FP4 part observes no maxima: ``observe_amax(False)`` is allowed, anything else raises."""
    if enabled is not False:
        raise ValueError(
            f"enabled must be False for an FP4 pool (each block's scale is computed when its row is written, "
            f"nothing to calibrate), got {enabled!r}"
        )


#: What ``calibrated_scales`` raises for a pool with an FP4 part.
FP4_NOT_CALIBRATED = (
    "calibrated_scales needs a pool with static scales (a dtype that is not FP4): an FP4 pool computes each "
    "block's scale when its row is written"
)


def fp4_format_name(pool: object) -> Optional[str]:
    """The FP4 format a part stores (an MLA FP4 part: the exponent-scale one), None for another part."""
    if not isinstance(pool, Fp4KVCache):
        return None
    return getattr(pool, "fp4_format", FP4_MX_BLOCK16)


def layer_ids(ids: object, name: str) -> tuple[int, ...]:
    """``ids``, a sequence of distinct non-negative ints naming at least one layer, as a tuple;
    ``TypeError`` for a non-sequence, ``ValueError`` naming ``name`` otherwise."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise TypeError(f"{name} must be a sequence of ints, got {type(ids).__name__}")
    out = tuple(non_negative_int(x, f"{name}[{i}]") for i, x in enumerate(ids))
    if not out:
        raise ValueError(f"{name} must name at least one layer, got none")
    if len(set(out)) != len(out):
        raise ValueError(f"{name} must be distinct, got {list(out)}")
    return out


def part_buf_infos(pool: object) -> tuple[list[int], list[int], list[int]]:
    """Every buffer of a part for registration with a transfer engine, as SGLang lists them:
    (addresses, byte lengths, bytes per page), every layer's K buffers then V buffers (a part with
    scales beside its codes: each of its ``part_names`` in turn, the scales after the codes)."""
    names = pool.part_names if isinstance(pool, RowPartsCache) else ("k_buffer", "v_buffer")
    bufs = [b for name in names for b in getattr(pool, name)]
    page = pool.page_size  # type: ignore[attr-defined]
    return [b.data_ptr() for b in bufs], [b.nbytes for b in bufs], [b[0].nbytes * page for b in bufs]
