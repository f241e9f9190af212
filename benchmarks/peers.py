"""The alternatives a serving engine would otherwise use for the K/V write, written here for timing.

* ``sglang_fallback``: SGLang's eager path as upstream writes it: divide the inputs in place by the
  scale, cast to FP8, view as uint8 and scatter with ``index_put_`` (no saturation; it mutates the
  caller's K/V).
* ``compiled_index_copy``: ``torch.compile`` of divide, clamp, cast, and ``index_copy_`` into an FP8
  cache, the best a model runner gets from the compiler without a custom kernel.
* ``straightforward_triton``: the textbook design ported plainly: one program per (token, head), K and V
  on a third grid axis, ``/`` for the division and a cast.
* ``per_token_triton``: what a competent user writes in twenty lines: one program per token
  over its whole H x D row, K then V, Triton's ``/`` (approximate on NVIDIA GPUs), a clamp, the cast
  on store, and the scatter.
* ``per_layer_move``: SGLang-style ``move_kv_cache``: an index copy per layer, K then V.
* ``masked_loc_write``: a verify write without a prefix-valid kernel: mask the uncommitted slots to -1
  with ``torch.where``, then a plain ``set_kv_buffer`` of every draft token.
* ``cast_scatter``: the ceiling a write can reach (docs/contract.md, "How performance is measured"):
  the same bytes read from the inputs and cast to the cache type (no division, no checks), scattered
  to the same slots, every lane busy; ``CAST_SCATTER_TILES`` are its block shapes, the best counts.
* ``cast_scatter_fp4`` and ``cast_scatter_token_head``: the same ceiling for the writes that store
  scales beside the codes (FP4, NVFP4, FP8 with a scale per token and head): from the same inputs,
  the same number of code bytes and scale bytes to the same rows of the same buffers, each byte
  cut from the input's bits or cast, never computed from a block's maximum or rounded; their
  docstrings say which bits go where.

The two Triton ports are not exact by the write's definition (docs/contract.md, "The write":
approximate division; a clamp turns NaN into -fmax), so they do less work per element than kvpool's
write.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def sglang_fallback(k, v, k_store, v_store, loc, k_scale, v_scale, dtype):
    """k_store/v_store: uint8 storage. Mutates k and v (as upstream does)."""
    if k_scale is not None:
        k.div_(k_scale)
    if v_scale is not None:
        v.div_(v_scale)
    k_store[loc] = k.to(dtype).view(torch.uint8)
    v_store[loc] = v.to(dtype).view(torch.uint8)


def _index_copy_write(k, v, k_cache, v_cache, loc, k_scale, v_scale):
    fmax = torch.finfo(k_cache.dtype).max
    kq = (k.float() / k_scale).clamp(-fmax, fmax).to(k_cache.dtype)
    vq = (v.float() / v_scale).clamp(-fmax, fmax).to(v_cache.dtype)
    k_cache.index_copy_(0, loc, kq)
    v_cache.index_copy_(0, loc, vq)


_compiled = None


def compiled_index_copy(k, v, k_cache, v_cache, loc64, k_scale, v_scale):
    """k_cache/v_cache: FP8 tensors; loc64: int64 (index_copy_ needs it); scales: tensors."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_index_copy_write, fullgraph=True, dynamic=True)
    _compiled(k, v, k_cache, v_cache, loc64, k_scale, v_scale)


@triton.jit
def _straightforward_kernel(
    k_ptr,  # [T, H, D]
    v_ptr,  # [T, H, D]
    kc_ptr,  # [slots, H, D] uint8
    vc_ptr,  # [slots, H, D] uint8
    loc_ptr,  # [T]
    ks_ptr,  # [1] float32
    vs_ptr,  # [1] float32
    stride_t,
    stride_h,
    stride_ct,
    stride_ch,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FMAX: tl.constexpr,
    FP8_E4M3: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    is_v = tl.program_id(2)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    src = tl.where(is_v == 1, v_ptr, k_ptr) + t.to(tl.int64) * stride_t + h * stride_h + offs
    dst = tl.where(is_v == 1, vc_ptr, kc_ptr) + slot * stride_ct + h * stride_ch + offs
    scale = tl.load(tl.where(is_v == 1, vs_ptr, ks_ptr))
    x = tl.load(src, mask=mask).to(tl.float32) / scale
    x = tl.minimum(tl.maximum(x, -FMAX), FMAX)
    if FP8_E4M3:
        y = x.to(tl.float8e4nv)
    else:
        y = x.to(tl.float8e5)
    tl.store(dst, y.to(tl.uint8, bitcast=True), mask=mask)


def straightforward_triton(k, v, k_store, v_store, loc, k_scale, v_scale, dtype):
    """Contiguous k/v [T, H, D] with the same strides; uint8 caches; tensor scales."""
    t, h, d = k.shape
    if t == 0:
        return
    _straightforward_kernel[(t, h, 2)](
        k, v, k_store, v_store, loc, k_scale, v_scale,
        k.stride(0), k.stride(1), k_store.stride(0), k_store.stride(1),
        D=d, BLOCK_D=triton.next_power_of_2(d), FMAX=torch.finfo(dtype).max,
        FP8_E4M3=dtype == torch.float8_e4m3fn,
    )  # fmt: skip


@triton.jit
def _per_token_kernel(
    k_ptr,  # [T, H * D] input rows (heads contiguous within a row)
    v_ptr,  # [T, H * Dv]
    k_cache_ptr,  # [slots, H * D] FP8
    v_cache_ptr,  # [slots, H * Dv] FP8
    loc_ptr,  # [T] slot per token
    k_scale_ptr,  # [1] float32
    v_scale_ptr,  # [1] float32
    stride_k,
    stride_v,
    stride_kc,
    stride_vc,
    ROW: tl.constexpr,
    V_ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    V_BLOCK: tl.constexpr,
    FMAX: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    k = tl.load(k_ptr + t * stride_k + offs, mask=offs < ROW).to(tl.float32) / tl.load(k_scale_ptr)
    k = tl.minimum(tl.maximum(k, -FMAX), FMAX)
    tl.store(k_cache_ptr + slot * stride_kc + offs, k.to(k_cache_ptr.dtype.element_ty), mask=offs < ROW)
    offs_v = tl.arange(0, V_BLOCK)
    v = tl.load(v_ptr + t * stride_v + offs_v, mask=offs_v < V_ROW).to(tl.float32) / tl.load(v_scale_ptr)
    v = tl.minimum(tl.maximum(v, -FMAX), FMAX)
    tl.store(v_cache_ptr + slot * stride_vc + offs_v, v.to(v_cache_ptr.dtype.element_ty), mask=offs_v < V_ROW)


def _row_major(x: torch.Tensor, name: str) -> None:
    t, h, d = x.shape
    if x.stride(2) != 1 or (h > 1 and x.stride(1) != d):
        raise ValueError(f"{name} must keep each token's H x D row contiguous, got strides {tuple(x.stride())}")


def per_token_triton(k, v, k_cache, v_cache, loc, k_scale, v_scale):
    """k [T, H, D], v [T, H, Dv] with contiguous rows; k_cache/v_cache FP8 [slots, H, D]; one-element
    float32 scale tensors. One program per token."""
    t, h, d = k.shape
    if t == 0:
        return
    for x, name in ((k, "k"), (v, "v"), (k_cache, "k_cache"), (v_cache, "v_cache")):
        _row_major(x, name)
    row, v_row = h * d, v.shape[1] * v.shape[2]
    block, v_block = triton.next_power_of_2(row), triton.next_power_of_2(v_row)
    _per_token_kernel[(t,)](
        k, v, k_cache, v_cache, loc, k_scale, v_scale,
        k.stride(0), v.stride(0), k_cache.stride(0), v_cache.stride(0),
        ROW=row, V_ROW=v_row, BLOCK=block, V_BLOCK=v_block, FMAX=torch.finfo(k_cache.dtype).max,
        num_warps=per_token_warps(max(block, v_block)),
    )  # fmt: skip


def per_token_warps(block: int) -> int:
    """Warps for a row of ``block`` elements: the rule of Triton's layer-norm tutorial, which is where
    a user writing this kernel would take it from (about 256 elements per warp, 1 to 8 warps)."""
    return min(max(block // 256, 1), 8)


def per_layer_move(k_buffers, v_buffers, tgt, src):
    """For every layer, rows ``tgt`` of K and V become rows ``src`` (an index copy each)."""
    for k_buf, v_buf in zip(k_buffers, v_buffers):
        k_buf[tgt] = k_buf[src]
        v_buf[tgt] = v_buf[src]


def masked_loc_write(pool, layer_id, loc_2d, commit_lens, k, v, k_scale, v_scale):
    """The verify write with a plain ``set_kv_buffer``: uncommitted slots become -1 (written nowhere)."""
    width = loc_2d.shape[1]
    cols = torch.arange(width, device=loc_2d.device)
    loc = torch.where(cols[None, :] < commit_lens[:, None], loc_2d, -1).reshape(-1)
    pool.set_kv_buffer(None, loc, k, v, k_scale, v_scale, layer_id_override=layer_id)


@triton.jit
def _cast_scatter_part(src_ptr, dst_ptr, loc_ptr, map_ptr, T, stride_dst, ROW: tl.constexpr, BLOCK: tl.constexpr,
                       MAPPED: tl.constexpr):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # element of the [T, ROW] input rows
    ok = offs < T * ROW
    t = offs // ROW
    slot = tl.load(loc_ptr + t, mask=ok, other=0)
    if MAPPED:
        slot = tl.load(map_ptr + slot, mask=ok, other=0)
    slot = slot.to(tl.int64)
    x = tl.load(src_ptr + offs, mask=ok)
    tl.store(dst_ptr + slot * stride_dst + (offs - t * ROW), x.to(dst_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _cast_scatter_kernel(
    k_ptr,  # [T, ROW] input rows, contiguous
    v_ptr,  # [T, V_ROW]
    kc_ptr,  # [slots, ROW] cache rows (stride stride_kc)
    vc_ptr,  # [slots, V_ROW]
    loc_ptr,  # [T] slots, all valid (MAPPED: indices into map_ptr, whose entries are valid slots)
    map_ptr,  # [M] slot of each loc entry (MAPPED only)
    T,
    stride_kc,
    stride_vc,
    ROW: tl.constexpr,
    V_ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    MAPPED: tl.constexpr,
):
    if tl.program_id(1) == 0:
        _cast_scatter_part(k_ptr, kc_ptr, loc_ptr, map_ptr, T, stride_kc, ROW, BLOCK, MAPPED)
    else:
        _cast_scatter_part(v_ptr, vc_ptr, loc_ptr, map_ptr, T, stride_vc, V_ROW, BLOCK, MAPPED)


#: (elements per program, warps) of the cast-only scatter; a run takes the best of them.
CAST_SCATTER_TILES = ((1024, 4), (2048, 4), (4096, 8))


def cast_scatter(k, v, k_cache, v_cache, loc, block=2048, warps=4, slot_map=None):
    """k [T, H, D], v [T, Hv, Dv] contiguous; k_cache/v_cache [slots, H, D] / [slots, Hv, Dv] of the
    cache type (rows contiguous); loc [T] valid slots, or with ``slot_map`` (int64 [M], contiguous)
    indices into it whose entries are valid slots. One launch, K and V on grid axis 1."""
    t = k.shape[0]
    if t == 0:
        return
    row, v_row = k.shape[1] * k.shape[2], v.shape[1] * v.shape[2]
    grid = (triton.cdiv(t * max(row, v_row), block), 2)
    _cast_scatter_kernel[grid](
        k, v, k_cache, v_cache, loc, loc if slot_map is None else slot_map, t, k_cache.stride(0), v_cache.stride(0),
        ROW=row, V_ROW=v_row, BLOCK=block, MAPPED=slot_map is not None, num_warps=warps,
    )  # fmt: skip


@triton.jit
def _cast_scatter_fp4_part(src_ptr, codes_ptr, scales_ptr, loc_ptr, T, stride_c, stride_s, WORDS: tl.constexpr,
                           BLOCK: tl.constexpr):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # word (two inputs) of the [T, WORDS] rows
    ok = offs < T * WORDS
    t = offs // WORDS
    col = offs - t * WORDS
    slot = tl.load(loc_ptr + t, mask=ok, other=0).to(tl.int64)
    w = tl.load(src_ptr + offs, mask=ok, other=0)
    # Element 2j's top four bits in the low nibble, element 2j + 1's in the high one.
    code = ((w >> 12) & 0xF) | ((w >> 24) & 0xF0)
    tl.store(codes_ptr + slot * stride_c + col, code.to(tl.uint8), mask=ok)
    # The exponent byte of each 16-element block's first element, stored by the word holding it.
    tl.store(scales_ptr + slot * stride_s + col // 8, ((w >> 7) & 0xFF).to(tl.uint8), mask=ok & (col % 8 == 0))


@triton.jit
def _cast_scatter_fp4_kernel(
    k_ptr,  # [T, K_WORDS] int32: the K rows' 16-bit inputs, two a word
    v_ptr,  # [T, V_WORDS] int32
    kc_ptr,  # [slots, K_WORDS] uint8 code rows (stride stride_kc)
    vc_ptr,  # [slots, V_WORDS] uint8
    ks_ptr,  # [slots, K_WORDS // 8] uint8 scale rows (stride stride_ks)
    vs_ptr,  # [slots, V_WORDS // 8] uint8
    loc_ptr,  # [T] valid slots
    T,
    stride_kc,
    stride_vc,
    stride_ks,
    stride_vs,
    K_WORDS: tl.constexpr,
    V_WORDS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    if tl.program_id(1) == 0:
        _cast_scatter_fp4_part(k_ptr, kc_ptr, ks_ptr, loc_ptr, T, stride_kc, stride_ks, K_WORDS, BLOCK)
    else:
        _cast_scatter_fp4_part(v_ptr, vc_ptr, vs_ptr, loc_ptr, T, stride_vc, stride_vs, V_WORDS, BLOCK)


#: (input words per program, warps) of the FP4 scatter: the input bytes of ``CAST_SCATTER_TILES``.
CAST_SCATTER_FP4_TILES = ((512, 4), (1024, 4), (2048, 8))


def _rows_of(x: torch.Tensor, name: str) -> None:
    if x.dim() < 2 or not x[0].is_contiguous():
        raise ValueError(f"{name} must keep each row contiguous, got shape {tuple(x.shape)} strides {tuple(x.stride())}")


def cast_scatter_fp4(k, v, k_store, v_store, loc, block=1024, warps=4):
    """The ceiling of an FP4 write (either scale format, MHA or MLA rows): per row of R 16-bit
    inputs (bf16 or fp16), R / 2 code bytes and R / 16 scale bytes, the FP4 write's count, stored to
    rows ``loc`` of its buffers, in one launch.

    Code byte j holds the top four bits (sign and three exponent bits) of input 2j in its low
    nibble and those of input 2j + 1 in its high nibble, where the FP4 write puts those elements'
    e2m1 codes; scale byte b is bits 7-14 of input 16b (the exponent byte of a bf16). The inputs are
    read once, as 32-bit words (two inputs a word), and every output byte is stored once.

    Parameters
    ----------
    k : Tensor [T, H, D] (or an MLA row [T, 1, R]), contiguous, 2-byte elements, H * D a multiple of 16.
    v : Tensor [T, Hv, Dv] likewise, or None (one part: an MLA row).
    k_store, v_store : (codes [slots, ...] uint8 rows of H * D / 2 bytes, scales [slots, ...] uint8 rows
        of H * D / 16 bytes), each row contiguous; ``v_store`` is ignored without ``v``.
    loc : Tensor [T] of valid slots.
    """
    t = k.shape[0]
    if t == 0:
        return
    parts = [k] if v is None else [k, v]
    stores = [k_store] if v is None else [k_store, v_store]
    words = []
    for x, (codes, scales), name in zip(parts, stores, ("k", "v")):
        if x.element_size() != 2 or not x.is_contiguous() or (x[0].numel() % 16):
            raise ValueError(f"{name} must be contiguous 2-byte rows of a multiple of 16 elements, got {x.dtype} {tuple(x.shape)}")
        for buf, what, per in ((codes, "codes", 2), (scales, "scales", 16)):
            _rows_of(buf, f"{name} {what}")
            if buf[0].numel() != x[0].numel() // per:
                raise ValueError(f"{name} {what} rows must hold {x[0].numel() // per} bytes, got {buf[0].numel()}")
        words.append(x.view(torch.int32))
    (kc, ks), (vc, vs) = stores[0], stores[-1]
    kw, vw = k[0].numel() // 2, parts[-1][0].numel() // 2
    grid = (triton.cdiv(t * max(kw, vw), block), len(parts))
    _cast_scatter_fp4_kernel[grid](
        words[0], words[-1], kc, vc, ks, vs, loc, t, kc.stride(0), vc.stride(0), ks.stride(0), vs.stride(0),
        K_WORDS=kw, V_WORDS=vw, BLOCK=block, num_warps=warps,
    )  # fmt: skip


@triton.jit
def _cast_scatter_token_head_part(src_ptr, codes_ptr, scales_ptr, loc_ptr, T, stride_c, stride_s, ROW: tl.constexpr,
                                  D: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # element of the [T, ROW] input rows
    ok = offs < T * ROW
    t = offs // ROW
    col = offs - t * ROW
    slot = tl.load(loc_ptr + t, mask=ok, other=0).to(tl.int64)
    x = tl.load(src_ptr + offs, mask=ok)
    tl.store(codes_ptr + slot * stride_c + col, x.to(codes_ptr.dtype.element_ty), mask=ok)
    # Each head's first input, as float32, where the write stores the head's scale.
    tl.store(scales_ptr + slot * stride_s + col // D, x.to(tl.float32), mask=ok & (col % D == 0))


@triton.jit
def _cast_scatter_token_head_kernel(
    k_ptr,  # [T, H * D] input rows, contiguous
    v_ptr,  # [T, H * Dv]
    kc_ptr,  # [slots, H * D] FP8 code rows (stride stride_kc)
    vc_ptr,  # [slots, H * Dv] FP8
    ks_ptr,  # [slots, H] float32 scale rows (stride stride_ks)
    vs_ptr,  # [slots, H] float32
    loc_ptr,  # [T] valid slots
    T,
    stride_kc,
    stride_vc,
    stride_ks,
    stride_vs,
    ROW: tl.constexpr,
    V_ROW: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK: tl.constexpr,
):
    if tl.program_id(1) == 0:
        _cast_scatter_token_head_part(k_ptr, kc_ptr, ks_ptr, loc_ptr, T, stride_kc, stride_ks, ROW, D, BLOCK)
    else:
        _cast_scatter_token_head_part(v_ptr, vc_ptr, vs_ptr, loc_ptr, T, stride_vc, stride_vs, V_ROW, DV, BLOCK)


def cast_scatter_token_head(k, v, k_store, v_store, loc, block=2048, warps=4):
    """The ceiling of the per-token-head FP8 write: per token and head, D code bytes (each input
    cast to the cache's FP8 type, as ``cast_scatter`` does) and a 4-byte scale (the head's first
    input cast to float32), stored to rows ``loc`` of the codes and scales, K and V in one launch.
    The inputs are read once and every output byte is stored once.

    Parameters
    ----------
    k, v : Tensor [T, H, D] / [T, H, Dv], contiguous.
    k_store, v_store : (codes [slots, H, D] FP8, scales [slots, H] float32), rows contiguous.
    loc : Tensor [T] of valid slots.
    """
    t, h, d = k.shape
    if t == 0:
        return
    dv = v.shape[2]
    for x, (codes, scales), name in ((k, k_store, "k"), (v, v_store, "v")):
        if not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {tuple(x.stride())}")
        _rows_of(codes, f"{name} codes")
        _rows_of(scales, f"{name} scales")
    (kc, ks), (vc, vs) = k_store, v_store
    grid = (triton.cdiv(t * h * max(d, dv), block), 2)
    _cast_scatter_token_head_kernel[grid](
        k, v, kc, vc, ks, vs, loc, t, kc.stride(0), vc.stride(0), ks.stride(0), vs.stride(0),
        ROW=h * d, V_ROW=h * dv, D=d, DV=dv, BLOCK=block, num_warps=warps,
    )  # fmt: skip
