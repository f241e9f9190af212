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
