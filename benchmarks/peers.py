"""The alternatives a serving engine would otherwise use for the K/V write, written here for timing.

* ``sglang_fallback``: SGLang's eager path as upstream writes it: divide the inputs in place by the
  scale, cast to FP8, view as uint8 and scatter with ``index_put_`` (no saturation; it mutates the
  caller's K/V).
* ``compiled_index_copy``: ``torch.compile`` of divide, clamp, cast, and ``index_copy_`` into an FP8
  cache, the best a model runner gets from the compiler without a custom kernel.
* ``straightforward_triton``: the seed's design ported plainly: one program per (token, head), K and V
  on a third grid axis, ``/`` for the division and a cast.
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
