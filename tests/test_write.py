"""The K/V write (docs/contract.md, "The write"), on every path a pool or a caller can take.

* The pool's write (``set_kv_buffer``): layer objects and overrides, fused and reference pools
  byte for byte, scales on 16-bit pools, validate.
* The eligibility gate's decisions and reasons, the three modes, ``KVPOOL_FUSED`` and ``pool.stats``.
* Bad input (docs/contract.md, "Bad input"): a clear error naming the argument, the expected and the
  actual value, and nothing written, on ``reference_set_kv_buffer``, ``fused_fp8_set_kv_buffer``
  (Triton's interpreter on CPU) and ``MHATokenToKVPool.set_kv_buffer``.
* NaN bit patterns and autograd on both write paths.
* The verify write of speculative decoding, ``set_kv_buffer_prefix_valid``.

Without CUDA the fused path is the Triton kernel under the interpreter (conftest switches it on);
with CUDA the same tests run the compiled kernel.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
import re
from typing import Any, Callable
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvpool
from kvassert import (
    CACHE_DTYPES,
    CUDA_D,
    CUDA_H,
    CUDA_ROWS,
    DEVICE,
    FORMAT_OF,
    FP8,
    INPUT_DTYPES,
    INTERPRETER,
    Layer,
    assert_codes_equal,
    assert_pools_equal,
    assert_same_bytes,
    bits,
    both_paths,
    codes_of,
    committed_tokens,
    cuda_gen,
    cuda_pool,
    cuda_scale,
    cuda_values,
    expected_cache,
    fused_runs,
    gpu,
    id_of,
    no_sync,
    poison_,
    poison_pool_,
    poisoned_caches,
    scale_of,
    skip_fused_without_interpreter,
    slots_for,
    spread_rows,
)
from kvpool import (
    FusedPathUnavailable,
    MHATokenToKVPool,
    fused_eligibility,
    fused_fp8_set_kv_buffer,
    quantize,
    reference_set_kv_buffer,
)
from kvpool.config import KernelOptions
from kvpool.kernels.store_kv import writer as store_kv
from kvpool.kernels.store_kv.op import launch_store_kv

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy inside Triton's interpreter


# ==============================================================================================
# The pool's write.


def test_layer_object_and_override():
    pool = MHATokenToKVPool(16, 1, torch.bfloat16, 1, 8, 2, DEVICE, warmup=False)
    k = torch.full((1, 1, 8), 2.0, device=DEVICE)
    pool.set_kv_buffer(Layer(1), torch.tensor([3], device=DEVICE), k, k)
    assert pool.get_key_buffer(1)[3].eq(2).all() and not pool.get_key_buffer(0).any()
    pool.set_kv_buffer(Layer(1), torch.tensor([4], device=DEVICE), k, k, layer_id_override=0)
    assert pool.get_key_buffer(0)[4].eq(2).all(), "layer_id_override wins over layer.layer_id"
    with pytest.raises(TypeError, match="layer_id_override"):
        pool.set_kv_buffer(None, torch.tensor([4], device=DEVICE), k, k)
    with pytest.raises(TypeError, match="layer_id"):
        pool.set_kv_buffer(object(), torch.tensor([4], device=DEVICE), k, k)


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=str)
def test_fused_and_reference_pools_agree_and_leave_other_rows_alone(dtype):
    if DEVICE == "cpu" and not store_kv.INTERPRETER:
        pytest.skip("the kernel cannot run here")
    geometry = (50, 2, dtype, 3, 24, 2, DEVICE)
    fused = MHATokenToKVPool(*geometry, v_head_dim=40, fused="always", warmup=False)
    ref = MHATokenToKVPool(*geometry, v_head_dim=40, fused="never")
    for pool in (fused, ref):
        poison_pool_(pool)
    g = torch.Generator().manual_seed(0)
    qkv = (torch.randn(6, 9, 40, generator=g) * 100).to(torch.bfloat16).to(DEVICE)
    k, v = qkv[:, :3, :24], qkv[:, 6:9]
    loc = torch.tensor([1, 7, -1, 51, 52, 30], device=DEVICE, dtype=torch.int32)
    for pool in (fused, ref):
        pool.set_kv_buffer(Layer(1), loc, k, v, 0.61, torch.tensor([1.7, 0.2, 9.0], device=DEVICE))
    assert fused.stats.fused_calls == 1 and ref.stats.reference_calls == 1
    for layer_id in (0, 1):
        for a, b in zip(fused.get_kv_buffer(layer_id), ref.get_kv_buffer(layer_id)):
            assert_same_bytes(a, b, f"layer {layer_id}")
    # written rows hold q(x); slots 51 (the last row) was written, 52 is out of range
    expect_k = quantize(k, dtype, 0.61)
    kbuf = ref.get_key_buffer(1)
    for t, slot in enumerate([1, 7, None, 51, None, 30]):
        if slot is not None:
            assert_same_bytes(kbuf[slot], expect_k[t], f"slot {slot}")
    untouched = [s for s in range(52) if s not in (1, 7, 51, 30)]
    assert (bits(kbuf)[untouched] == -1 if dtype.itemsize > 1 else bits(kbuf)[untouched] == 0xFF).all()


def test_scales_are_ignored_by_16_bit_pools():
    pool = MHATokenToKVPool(8, 1, torch.bfloat16, 1, 4, 1, DEVICE, warmup=False)
    x = torch.tensor([[[1.5, -2.0, 3.0, 0.25]]], device=DEVICE)
    pool.set_kv_buffer(None, torch.tensor([2], device=DEVICE), x, x, -5.0, "ignored", layer_id_override=0)
    assert torch.equal(pool.get_key_buffer(0)[2], x[0].to(torch.bfloat16))


def test_validate_checks_slots_on_request(monkeypatch):
    monkeypatch.setenv("KVPOOL_VALIDATE", "1")
    pool = MHATokenToKVPool(8, 2, torch.float8_e4m3fn, 1, 4, 1, DEVICE, warmup=False)
    assert pool.validate
    x = torch.ones(3, 1, 4, device=DEVICE)
    with pytest.raises(IndexError, match=r"loc\[2\] = 10 is out of range: slots are 0..9"):
        pool.set_kv_buffer(None, torch.tensor([1, -1, 10], device=DEVICE), x, x, layer_id_override=0)
    assert not pool.get_key_buffer(0).view(torch.uint8).any()


# ==============================================================================================
# The kernel against the reference.
# Without CUDA the kernel runs through Triton's interpreter on CPU tensors (its soft-cast mode, since
# the interpreter's own FP8/bf16 conversions are wrong); with CUDA the same tests run the compiled
# kernel. Shapes stay small: the interpreter costs about a millisecond per program.


@pytest.mark.parametrize("scale_kind", ["none", "float", "tensor", "tensor0d", "per_head", "per_head_col"])
@pytest.mark.parametrize("in_dtype", INPUT_DTYPES, ids=id_of)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=id_of)
def test_matches_reference_odd_shape(cache_dtype, in_dtype, scale_kind):
    t, h, d, slots = 7, 3, 96, 19
    k, v = spread_rows(t, h, d, in_dtype, 1), spread_rows(t, h, d, in_dtype, 2)
    ks, vs = scale_of(scale_kind, h, 3), scale_of(scale_kind, h, 4)
    (kf, vf), (kr, vr) = both_paths(k, v, slots_for(t, slots, torch.int64, 5), ks, vs, slots, cache_dtype)
    assert_same_bytes(kf, kr, "k_cache")
    assert_same_bytes(vf, vr, "v_cache")


@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64], ids=id_of)
@pytest.mark.parametrize("cache_dtype", FP8, ids=id_of)
def test_k_and_v_differ_in_heads_and_dims(cache_dtype, loc_dtype):
    t, slots = 9, 30
    k, v = spread_rows(t, 2, 32, torch.bfloat16, 6), spread_rows(t, 5, 24, torch.bfloat16, 7)
    (kf, vf), (kr, vr) = both_paths(
        k, v, slots_for(t, slots, loc_dtype, 8), 0.3, scale_of("per_head", 5), slots, cache_dtype
    )
    assert_same_bytes(kf, kr, "k_cache")
    assert_same_bytes(vf, vr, "v_cache")


@pytest.mark.parametrize("scale", [None, 0.37, 2.0**-7], ids=["none", "0.37", "pow2"])
@pytest.mark.parametrize("cache_dtype", FP8 + [torch.bfloat16, torch.float16], ids=id_of)
def test_every_bf16_bit_pattern(cache_dtype, scale):
    """All 65,536 bf16 values: every exponent, both zeros, subnormals, infinities, NaNs."""
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    k = every.reshape(512, 1, 128).to(DEVICE)
    loc = torch.arange(512, device=DEVICE)
    (kf, _), (kr, _) = both_paths(k, k, loc, scale, scale, 512, cache_dtype)
    assert_same_bytes(kf, kr, "k_cache")


def test_every_fp16_bit_pattern_into_e5m2():
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
    k = every.reshape(256, 2, 128).to(DEVICE)
    loc = torch.arange(256, device=DEVICE)
    (kf, _), (kr, _) = both_paths(k, k, loc, 3.3, None, 256, torch.float8_e5m2)
    assert_same_bytes(kf, kr, "k_cache")


def test_strided_inputs_need_no_copy():
    """K and V sliced out of a fused QKV projection, and a view whose head_dim is not contiguous."""
    t, hq, h, d, slots = 6, 4, 2, 64, 16
    qkv = spread_rows(t, hq + 2 * h, d, torch.bfloat16, 12)
    k, v = qkv[:, hq : hq + h], qkv[:, hq + h :]
    assert not k.is_contiguous() and not v.is_contiguous()
    (kf, vf), (kr, vr) = both_paths(k, v, slots_for(t, slots, torch.int64, 13), 0.25, 0.5, slots, torch.float8_e4m3fn)
    assert_same_bytes(kf, kr, "k_cache")
    assert_same_bytes(vf, vr, "v_cache")
    dhn = spread_rows(t, d, h, torch.float32, 14)  # [T, D, H] storage: head_dim stride is H
    kt = dhn.transpose(1, 2)
    (kf, _), (kr, _) = both_paths(kt, kt, slots_for(t, slots, torch.int64, 15), None, None, slots, torch.float8_e5m2)
    assert_same_bytes(kf, kr, "k_cache (transposed input)")


def test_out_of_range_and_negative_slots_touch_nothing_outside():
    """The caches are a window into a larger poisoned tensor; slots outside the window (negative,
    >= slots, huge) must leave every guard row untouched, on both paths."""
    t, h, d, slots, guard = 8, 2, 16, 10, 4
    loc = torch.tensor([0, -1, slots, slots + guard, 2**31 + 3, -(2**40), 9, 5], device=DEVICE)
    k = spread_rows(t, h, d, torch.bfloat16, 16, spread=False)
    for write in (fused_fp8_set_kv_buffer, reference_set_kv_buffer):
        backing = poison_(torch.empty(slots + 2 * guard, h, d, dtype=torch.float8_e4m3fn, device=DEVICE))
        backing_v = poison_(torch.empty_like(backing))
        before = bits(backing).clone()
        write(k, k, backing[guard : guard + slots], backing_v[guard : guard + slots], loc, 0.5, 0.5)
        after = bits(backing)
        assert torch.equal(after[:guard], before[:guard]), f"{write.__name__} wrote below the cache"
        assert torch.equal(after[guard + slots :], before[guard + slots :]), f"{write.__name__} wrote past the cache"
        written = {0, 9, 5}
        for row in range(slots):
            changed = not torch.equal(after[guard + row], before[guard + row])
            assert changed == (row in written), f"{write.__name__}: row {row} changed={changed}"


def test_inputs_and_scales_are_never_modified():
    t, h, d = 5, 2, 32
    k, v = spread_rows(t, h, d, torch.float32, 17), spread_rows(t, h, d, torch.float32, 18)
    ks = torch.tensor([0.3], device=DEVICE)
    loc = slots_for(t, 12, torch.int64, 19)
    snapshot = [bits(x).clone() for x in (k, v, ks, loc)]
    for write in (fused_fp8_set_kv_buffer, reference_set_kv_buffer):
        kc, vc = poisoned_caches(12, h, d, h, d, torch.float8_e4m3fn)
        write(k, v, kc, vc, loc, ks, 0.9)
        for x, s in zip((k, v, ks, loc), snapshot):
            assert torch.equal(bits(x), s), f"{write.__name__} modified an input"


def test_zero_tokens_is_a_no_op():
    kc, vc = poisoned_caches(8, 2, 16, 2, 16, torch.float8_e4m3fn)
    before = bits(kc).clone(), bits(vc).clone()
    empty = torch.empty(0, 2, 16, dtype=torch.bfloat16, device=DEVICE)
    loc = torch.empty(0, dtype=torch.int64, device=DEVICE)
    for write in (fused_fp8_set_kv_buffer, reference_set_kv_buffer):
        assert write(empty, empty, kc, vc, loc, 0.5, 0.5) is None
    assert torch.equal(bits(kc), before[0]) and torch.equal(bits(vc), before[1])


def test_duplicate_slots_take_one_of_the_rows():
    """Which token wins a shared slot is unspecified; the slot must still hold one of them."""
    h, d = 2, 16
    k = spread_rows(4, h, d, torch.bfloat16, 20, spread=False)
    loc = torch.tensor([3, 3, 7, 3], device=DEVICE)
    for write in (fused_fp8_set_kv_buffer, reference_set_kv_buffer):
        kc, vc = poisoned_caches(10, h, d, h, d, torch.float8_e4m3fn)
        write(k, k, kc, vc, loc, 0.5, 0.5)
        full = torch.zeros(10, h, d, dtype=torch.float8_e4m3fn, device=DEVICE)
        reference_set_kv_buffer(k, k, full, full.clone(), torch.arange(4, device=DEVICE), 0.5, 0.5)
        candidates = [bits(full[i]) for i in (0, 1, 3)]
        assert any(torch.equal(bits(kc[3]), c) for c in candidates)
        assert torch.equal(bits(kc[7]), bits(full[2]))


@pytest.mark.parametrize("write", [fused_fp8_set_kv_buffer, reference_set_kv_buffer], ids=lambda f: f.__name__)
def test_public_functions_follow_kvpool_validate(write, monkeypatch):
    kc, vc = poisoned_caches(8, 1, 16, 1, 16, torch.float8_e4m3fn)
    before = bits(kc).clone()
    x = torch.ones(2, 1, 16, device=DEVICE)
    loc = torch.tensor([1, 8], device=DEVICE)
    monkeypatch.setenv("KVPOOL_VALIDATE", "1")
    with pytest.raises(IndexError, match=r"cache_loc\[1\] = 8 is out of range"):
        write(x, x, kc, vc, loc)
    assert torch.equal(bits(kc), before)
    write(x, x, kc, vc, loc, validate=False)  # an explicit argument wins over the environment
    assert not torch.equal(bits(kc), before)


def test_head_major_cache_beyond_int32_offsets():
    """A caller's head-major cache [H, slots, D] viewed as [slots, H, D] has head stride slots * D;
    with (H - 1) * slots * D >= 2**31 the head offset must not wrap (it did, writing before the
    buffer). 3 GiB of lazily zeroed memory; only the written rows are touched."""
    if DEVICE == "cuda" and torch.cuda.mem_get_info()[0] < (4 << 30):
        pytest.skip("needs 3 GiB of device memory")
    h, slots, d = 3, 2**26, 16
    backing = torch.zeros(h, slots, d, dtype=torch.float8_e4m3fn, device=DEVICE)
    k_cache = backing.transpose(0, 1)  # [slots, H, D], stride (16, 2**30, 1)
    k = spread_rows(2, h, d, torch.bfloat16, 21, spread=False)
    loc = torch.tensor([5, slots - 1], device=DEVICE)
    fused_fp8_set_kv_buffer(k, k, k_cache, k_cache, loc, 0.5, 0.5)
    expected = quantize(k, torch.float8_e4m3fn, 0.5)
    for t, slot in enumerate([5, slots - 1]):
        assert_same_bytes(backing[:, slot], expected[t], f"slot {slot}")


def test_non_contiguous_per_head_scale_needs_no_copy():
    t, h, d, slots = 5, 3, 32, 12
    k = spread_rows(t, h, d, torch.bfloat16, 22)
    wide = (torch.rand(h, 4, device=DEVICE) * 3 + 0.1)
    for scale in (wide[:, 1], wide[:, 2:3]):  # [H] with stride 4, [H, 1] with stride (4, 1)
        assert not scale.is_contiguous()
        (kf, vf), (kr, vr) = both_paths(k, k, slots_for(t, slots, torch.int64, 23), scale, scale, slots, torch.float8_e4m3fn)
        assert_same_bytes(kf, kr, "k_cache")
        assert_same_bytes(vf, vr, "v_cache")


# ==============================================================================================
# The compiled kernel on CUDA, on real shapes.
# Every comparison is byte for byte (NaN: both NaN).


def _cuda_qkv_slices(t, h, d, dtype, seed):
    """K and V as strided views of a fused QKV projection (4 query heads per KV head)."""
    qkv = cuda_values((t, 6 * h, d), dtype, seed)
    return qkv[:, 4 * h : 5 * h], qkv[:, 5 * h :]


def _compare_on_cuda(k, v, loc, ks, vs, slots, cache_dtype, what, **launch):
    h, d, hv, dv = k.shape[1], k.shape[2], v.shape[1], v.shape[2]
    kf = poison_(torch.empty(slots, h, d, dtype=cache_dtype, device="cuda"))
    vf = poison_(torch.empty(slots, hv, dv, dtype=cache_dtype, device="cuda"))
    kr, vr = kf.clone(), vf.clone()
    if launch:
        launch_store_kv(k, v, kf, vf, loc, ks, vs, **launch)
    else:
        fused_fp8_set_kv_buffer(k, v, kf, vf, loc, ks, vs)
    reference_set_kv_buffer(k, v, kr, vr, loc, ks, vs)
    assert_same_bytes(kf, kr, f"{what} k_cache")
    assert_same_bytes(vf, vr, f"{what} v_cache")


@gpu
@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("h", [1, 3, 8])
@pytest.mark.parametrize("cache_dtype", FP8, ids=id_of)
def test_grid_matches_reference(cache_dtype, h, d):
    slots = 5000
    # bf16 inputs with every scale kind; fp16/fp32 inputs with per-head scales (fewer compiled variants)
    combos = [(torch.bfloat16, kind) for kind in ("none", "float", "tensor", "per_head")]
    combos += [(torch.float16, "per_head"), (torch.float32, "per_head")]
    for t, (in_dtype, scale_kind) in itertools.product([0, 1, 7, 128, 4096], combos):
        k, v = _cuda_qkv_slices(t, h, d, in_dtype, seed=t * 31 + h * 7 + d)
        loc = torch.randperm(slots, device="cuda")[:t]
        if t > 3:
            loc[0], loc[2] = -1, slots + 17
        ks, vs = cuda_scale(scale_kind, h), cuda_scale(scale_kind, h)
        _compare_on_cuda(k, v, loc, ks, vs, slots, cache_dtype, f"T={t} {in_dtype} scale={scale_kind}")


@gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=id_of)
@pytest.mark.parametrize("in_dtype", INPUT_DTYPES, ids=id_of)
def test_16_and_32_bit_pools_match_reference(cache_dtype, in_dtype):
    k, v = _cuda_qkv_slices(1000, 8, 128, in_dtype, seed=1)
    loc = torch.randperm(3000, device="cuda")[:1000].to(torch.int32)
    _compare_on_cuda(k, v, loc, 0.37, None, 3000, cache_dtype, "16-bit pool")


EDGES = [0.0, -0.0, 448.0, 449.0, 464.0, 465.0, 480.0, -448.0, -465.0, 57344.0, 61440.0, 1e6, -1e30,
         float("inf"), -float("inf"), float("nan"), 1.0625, 1.1875, 1.97, -1.97, 2.0**-6, 2.0**-7,
         2.0**-9, 2.0**-10, 3 * 2.0**-10, 2.0**-14, 2.0**-16, 2.0**-17, 3 * 2.0**-17, -(2.0**-17),
         1e-40, -1e-40, 65504.0, 3.0e38]  # fmt: skip


# The kernel's code paths: hardware cast with the reciprocal-and-FMA division (the default on
# sm_89+), hardware cast with div.rn, and the integer encoder with div.rn (interpreter, AMD, sm_80).
KERNEL_VARIANTS = {
    "native-fastdiv": dict(options=KernelOptions(soft_cast=False, fast_div=True)),
    "native-divrn": dict(options=KernelOptions(soft_cast=False, fast_div=False)),
    "soft-divrn": dict(options=KernelOptions(soft_cast=True, fast_div=False)),
}
EDGE_SCALES = (None, 0.37, 2.0**-7, 3.3, 1e-30, 1e30)  # the last two take div.rn even in fast-div builds


@gpu
@pytest.mark.parametrize("variant", list(KERNEL_VARIANTS))
@pytest.mark.parametrize("in_dtype", INPUT_DTYPES, ids=id_of)
@pytest.mark.parametrize("cache_dtype", FP8, ids=id_of)
def test_edge_values(cache_dtype, in_dtype, variant):
    x = torch.tensor(EDGES, device="cuda").to(in_dtype).reshape(-1, 1, 1).expand(-1, 2, 64)
    loc = torch.arange(x.shape[0], device="cuda")
    for scale in EDGE_SCALES + (torch.tensor([3.3], device="cuda"), torch.tensor([0.01, 7.5], device="cuda")):
        _compare_on_cuda(x, x, loc, scale, scale, x.shape[0], cache_dtype, f"edges scale={scale}", **KERNEL_VARIANTS[variant])


@gpu
@pytest.mark.parametrize("variant", list(KERNEL_VARIANTS))
@pytest.mark.parametrize("cache_dtype", FP8 + [torch.bfloat16, torch.float16], ids=id_of)
def test_every_bf16_and_fp16_bit_pattern(cache_dtype, variant):
    every = torch.arange(65536, dtype=torch.int32, device="cuda").to(torch.int16)
    loc = torch.arange(512, device="cuda")
    for in_dtype in (torch.bfloat16, torch.float16):
        x = every.view(in_dtype).reshape(512, 1, 128)
        for scale in EDGE_SCALES + (torch.tensor([3.3], device="cuda"),):
            _compare_on_cuda(x, x, loc, scale, None, 512, cache_dtype, f"{in_dtype} patterns scale={scale}", **KERNEL_VARIANTS[variant])


@gpu
@pytest.mark.parametrize("variant", list(KERNEL_VARIANTS))
@pytest.mark.parametrize("cache_dtype", FP8 + [torch.bfloat16, torch.float16], ids=id_of)
def test_random_float32_bit_patterns(cache_dtype, variant):
    """4M random float32 bit patterns: every exponent, NaN payloads, subnormals."""
    g = cuda_gen(7)
    raw = torch.randint(-(2**31), 2**31, (4096, 8, 128), device="cuda", generator=g, dtype=torch.int64)
    x = raw.to(torch.int32).view(torch.float32)
    loc = torch.randperm(4096, device="cuda", generator=g)
    for scale in (None, 0.37, 1e-30, torch.tensor([1e-3], device="cuda"), torch.logspace(-6, 6, 8, device="cuda")):
        _compare_on_cuda(x, x, loc, scale, scale, 4096, cache_dtype, f"fp32 patterns scale={scale}", **KERNEL_VARIANTS[variant])


@gpu
def test_all_variants_agree_on_the_device():
    """The integer encoder and div.rn (the interpreter's path in CI) equal the hardware conversion
    and the reciprocal-and-FMA division, on 8M values."""
    g = cuda_gen(3)
    x = cuda_values((8192, 8, 128), torch.bfloat16, 3)
    loc = torch.randperm(8192, device="cuda", generator=g)
    for cache_dtype in FP8:
        out = {}
        for name, variant in KERNEL_VARIANTS.items():
            kc = poison_(torch.empty(8192, 8, 128, dtype=cache_dtype, device="cuda"))
            launch_store_kv(x, x, kc, kc.clone(), loc, 0.37, None, **variant)
            out[name] = kc
        for name in KERNEL_VARIANTS:
            assert_same_bytes(out[name], out["soft-divrn"], f"{cache_dtype} {name} vs soft-divrn")


@gpu
def test_out_of_range_and_negative_slots_leave_guard_rows_untouched():
    slots, guard, h, d = 1000, 64, 8, 128
    backing = poison_(torch.empty(slots + 2 * guard, h, d, dtype=torch.float8_e4m3fn, device="cuda"))
    backing_v = poison_(torch.empty_like(backing))
    before, before_v = bits(backing).clone(), bits(backing_v).clone()
    t = 512
    loc = torch.randint(-(2**40), 2**40, (t,), device="cuda")  # almost all out of range
    loc[:100] = torch.randperm(slots, device="cuda")[:100]
    loc[100:120] = slots + torch.arange(20, device="cuda")
    loc[120:140] = -torch.arange(1, 21, device="cuda")
    k = cuda_values((t, h, d), torch.bfloat16, 11)
    for loc_dtype in (torch.int64, torch.int32):
        fused_fp8_set_kv_buffer(k, k, backing[guard:-guard], backing_v[guard:-guard], loc.to(loc_dtype), 0.5, 0.5)
        torch.cuda.synchronize()
        for b, ref in ((backing, before), (backing_v, before_v)):
            assert torch.equal(bits(b)[:guard], ref[:guard])
            assert torch.equal(bits(b)[-guard:], ref[-guard:])
    expected = poison_(torch.empty(slots, h, d, dtype=torch.float8_e4m3fn, device="cuda"))
    reference_set_kv_buffer(k, k, expected, expected.clone(), loc, 0.5, 0.5)
    assert_same_bytes(backing[guard:-guard], expected, "cache window")


@gpu
def test_fused_call_allocates_nothing_and_never_synchronises():
    pool = cuda_pool(fused="auto")
    x = cuda_values((300, 8, 128), torch.bfloat16, 6)
    qkv = cuda_values((300, 48, 128), torch.bfloat16, 7)
    loc32 = torch.randperm(4096, device="cuda")[:300].to(torch.int32)
    scale = torch.tensor([0.37], device="cuda")
    loc64 = loc32.long()
    per_head = torch.linspace(0.1, 2, 8, device="cuda")
    calls = [
        lambda: pool.set_kv_buffer(None, loc32, x, x, scale, scale, layer_id_override=0),
        lambda: pool.set_kv_buffer(None, loc64, qkv[:, 32:40], qkv[:, 40:48], 0.37, None, layer_id_override=1),
        lambda: pool.set_kv_buffer(None, loc32, x, x, layer_id_override=1),
        lambda: pool.set_kv_buffer(None, loc64, x, x, per_head, 0.5, layer_id_override=0),
    ]
    for call in calls:
        call()  # first call of each variant outside the measurement
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()
    allocs_before = stats.get("allocation.all.allocated", 0)
    with no_sync():
        for _ in range(3):
            for call in calls:
                call()
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats().get("allocation.all.allocated", 0) == allocs_before
    assert pool.stats.fused_calls == 4 * len(calls) and pool.stats.reference_calls == 0


@gpu
def test_reference_path_never_synchronises():
    pool = cuda_pool(fused="never")
    x = cuda_values((300, 8, 128), torch.bfloat16, 6)
    loc = torch.randperm(4096, device="cuda")[:300]
    loc[:5] = -1
    scale = torch.tensor([0.37], device="cuda")
    pool.set_kv_buffer(None, loc, x, x, scale, 0.5, layer_id_override=0)
    torch.cuda.synchronize()
    with no_sync():
        pool.set_kv_buffer(None, loc, x, x, scale, 0.5, layer_id_override=0)
        pool.set_kv_buffer(None, torch.full_like(loc, -1), x, x, scale, 0.5, layer_id_override=1)
    assert pool.stats.reference_calls == 3


# ==============================================================================================
# The gate, the modes and the stats.


CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


def gate(**overrides):
    args = dict(
        device=CUDA, cache_dtype=torch.float8_e4m3fn, k_dtype=torch.bfloat16, v_dtype=torch.bfloat16,
        head_dim=128, v_head_dim=128, k_cache_stride_d=1, v_cache_stride_d=1,
        k_scale=None, v_scale=None, triton_available=True, interpreter=False,
    )  # fmt: skip
    args.update(overrides)
    return fused_eligibility(**args)


def test_common_case_is_eligible():
    assert gate() == (True, "eligible")
    assert gate(k_scale=0.5, v_scale=torch.ones(1)) == (True, "eligible")
    assert gate(cache_dtype=torch.bfloat16, k_dtype=torch.float32) == (True, "eligible")
    assert gate(k_scale=torch.ones(8)) == (True, "eligible")  # per-head float32: fused too


@pytest.mark.parametrize(
    "overrides, words",
    [
        (dict(triton_available=False), ["triton"]),
        (dict(device=CPU), ["cpu", "TRITON_INTERPRET"]),
        (dict(device=torch.device("meta")), ["'meta'"]),
        (dict(interpreter=True), ["TRITON_INTERPRET", "CPU tensors"]),
        (dict(cache_dtype=torch.float64), ["torch.float64"]),
        (dict(k_dtype=torch.int8), ["torch.int8"]),
        (dict(v_dtype=torch.float64), ["torch.float64"]),
        (dict(head_dim=2048), ["2048", "1024"]),
        (dict(v_head_dim=1025), ["1025"]),
        (dict(k_cache_stride_d=8), ["NHD", "8"]),
        (dict(k_scale=torch.ones(1, dtype=torch.bfloat16)), ["k_scale", "bfloat16", "float32"]),
        (dict(v_scale=torch.ones(1, dtype=torch.float64)), ["v_scale", "float64"]),
    ],
    ids=lambda x: "-".join(x) if isinstance(x, list) else None,
)
def test_each_condition_refuses_with_a_reason(overrides, words):
    ok, reason = gate(**overrides)
    assert not ok
    for w in words:
        assert w in reason, (w, reason)


def test_interpreter_makes_cpu_eligible():
    assert gate(device=CPU, interpreter=True) == (True, "eligible")


def test_gate_is_pure():
    args = dict(k_scale=0.5)
    assert gate(**args) == gate(**args) == gate(**args)


def _gate_pool(**kw):
    return MHATokenToKVPool(64, 1, torch.float8_e4m3fn, 2, 16, 2, "cpu", **kw)


def _gate_write(pool, scale=0.5, layer_id=0):
    k = torch.randn(3, 2, 16, dtype=torch.bfloat16)
    pool.set_kv_buffer(None, torch.tensor([1, 2, 3]), k, k, scale, scale, layer_id_override=layer_id)


def test_auto_on_cpu_falls_back_and_counts_the_reason(caplog):
    pool = _gate_pool(fused="auto")
    with caplog.at_level(logging.INFO, logger="kvpool"):
        for _ in range(3):
            _gate_write(pool)
    assert pool.stats.fused_calls == 0 and pool.stats.reference_calls == 3
    [(reason, count)] = pool.stats.reasons.items()
    assert count == 3 and "cpu" in reason
    logged = [r for r in caplog.records if "reference path" in r.getMessage()]
    assert len(logged) == 1, "each new reason is logged once"


def test_never_takes_the_reference_path():
    pool = _gate_pool(fused="never")
    _gate_write(pool)
    assert pool.stats.reference_calls == 1 and pool.stats.reasons == {"fused='never'": 1}


def test_always_runs_the_kernel_on_cpu_through_the_interpreter():
    if not store_kv.INTERPRETER:
        pytest.skip("the interpreter is only switched on without CUDA")
    pool = _gate_pool(fused="always")
    _gate_write(pool)
    _gate_write(pool, scale=torch.ones(2))  # per-head scale: fused as well
    assert pool.stats.fused_calls == 2 and pool.stats.reference_calls == 0


def test_always_raises_with_the_reason_when_the_gate_refuses():
    if store_kv.INTERPRETER:
        pool = _gate_pool(fused="always")
        with pytest.raises(FusedPathUnavailable, match="k_scale is a torch.bfloat16 tensor"):
            _gate_write(pool, scale=torch.ones(1, dtype=torch.bfloat16))
        assert pool.stats.fused_calls == 0 and pool.stats.reference_calls == 0
    else:
        with pytest.raises(FusedPathUnavailable, match="device is cpu"):
            _gate_pool(fused="always")


def test_env_overrides_the_constructor(monkeypatch):
    monkeypatch.setenv("KVPOOL_FUSED", "never")
    pool = _gate_pool(fused="always")  # would raise on a plain CPU without the override
    assert pool.fused_mode == "never"
    monkeypatch.setenv("KVPOOL_FUSED", "sometimes")
    with pytest.raises(ValueError, match="KVPOOL_FUSED must be one of auto, always, never, got 'sometimes'"):
        _gate_pool()


def test_bad_mode_is_rejected():
    with pytest.raises(ValueError, match="fused must be one of auto, always, never, got 'fast'"):
        _gate_pool(fused="fast")


def test_cpu_pool_does_not_warm_up():
    assert _gate_pool().warmup_seconds is None


@gpu
def test_auto_mode_routes_by_the_gate():
    pool = cuda_pool(fused="auto")
    x = cuda_values((5, 8, 128), torch.bfloat16, 9)
    loc = torch.arange(1, 6, device="cuda")
    pool.set_kv_buffer(None, loc, x, x, torch.linspace(0.1, 2, 8, device="cuda"), 0.3, layer_id_override=0)
    assert pool.stats.fused_calls == 1
    pool.set_kv_buffer(None, loc, x, x, torch.tensor([0.5], device="cuda", dtype=torch.bfloat16), None, layer_id_override=0)
    assert pool.stats.reference_calls == 1
    assert any("bfloat16" in r for r in pool.stats.reasons)


# ==============================================================================================
# Bad input.
# Every case runs against the two functions and the pool. The base call is valid and names real
# slots, so a write that happens before the error shows up in the byte snapshots of the caches or
# pool buffers. A tensor on ``torch.device("meta")`` is "a tensor on another device".


# The base call: T=5 tokens, K [5, 2, 8], V [5, 3, 6] (H != Hv, D != Dv so every number is distinct).
T, H, D, HV, DV = 5, 2, 8, 3, 6
PAGE = 4
SIZE = 8
SLOTS = SIZE + PAGE  # 12 rows per buffer
START, LAYERS = 4, 3  # the pool holds global layers 4, 5, 6
LAYER = 5
CACHE_DTYPE = torch.float8_e4m3fn
BASE_LOC = [1, 5, -1, 7, 10]
GUARD = 2
META = torch.device("meta")
POOL_NAMES = {"k": "cache_k", "v": "cache_v", "cache_loc": "loc"}


def _base_args(hv: int = HV) -> dict:
    g = torch.Generator().manual_seed(0)
    return dict(
        k=torch.randn(T, H, D, generator=g).to(torch.bfloat16),
        v=torch.randn(T, hv, DV, generator=g).to(torch.bfloat16),
        cache_loc=torch.tensor(BASE_LOC, dtype=torch.int64),
        k_scale=0.5,
        v_scale=torch.tensor([0.25]),
        layer=Layer(LAYER),
        layer_id_override=None,
    )


# ----------------------------------------------------------------------------------------------
# Targets: the two functions (caller-owned, guarded caches) and the pool.


class FunctionTarget:
    hv = HV  # caller-owned caches may have H != Hv

    def __init__(self, fn: Callable, validate: bool = False, cache_dtype=CACHE_DTYPE):
        self.fn, self.validate = fn, validate
        self.k_outer = torch.empty(SLOTS + 2 * GUARD, H, D, dtype=cache_dtype)
        self.v_outer = torch.empty(SLOTS + 2 * GUARD, HV, DV, dtype=cache_dtype)
        self.k_outer.view(torch.uint8).fill_(0xA5)
        self.v_outer.view(torch.uint8).fill_(0x5A)
        self.k_cache = self.k_outer[GUARD:GUARD + SLOTS]
        self.v_cache = self.v_outer[GUARD:GUARD + SLOTS]

    def name(self, arg: str) -> str:
        return arg

    def snapshot(self):
        return [self.k_outer.clone(), self.v_outer.clone()]

    def current(self):
        return [self.k_outer, self.v_outer]

    def call(self, a: dict) -> None:
        kc = a.get("k_cache", self.k_cache)
        vc = a.get("v_cache", self.v_cache)
        return self.fn(a["k"], a["v"], kc, vc, a["cache_loc"], a["k_scale"], a["v_scale"], validate=self.validate)


class PoolTarget:
    hv = H  # the pool has head_num heads for K and V

    def __init__(self, mode: str, validate: bool = False, env_validate: bool = False, cache_dtype=CACHE_DTYPE):
        env = {"KVPOOL_VALIDATE": "1"} if env_validate else {}
        with mock.patch.dict(os.environ, env):
            os.environ.pop("KVPOOL_FUSED", None)
            if not env_validate:
                os.environ.pop("KVPOOL_VALIDATE", None)
            self.pool = kvpool.MHATokenToKVPool(SIZE, PAGE, cache_dtype, H, D, LAYERS, "cpu", v_head_dim=DV,
                                                start_layer=START, fused=mode, validate=validate)
        for lid in range(START, START + LAYERS):
            kb, vb = self.pool.get_kv_buffer(lid)
            kb.view(torch.uint8).fill_(0xA5 ^ lid)
            vb.view(torch.uint8).fill_(0x5A ^ lid)

    def name(self, arg: str) -> str:
        return POOL_NAMES.get(arg, arg)

    def buffers(self):
        out = []
        for lid in range(START, START + LAYERS):
            out.extend(self.pool.get_kv_buffer(lid))
        return out

    def snapshot(self):
        return [b.clone() for b in self.buffers()]

    def current(self):
        return self.buffers()

    def call(self, a: dict) -> None:
        return self.pool.set_kv_buffer(a["layer"], a["cache_loc"], a["k"], a["v"], a["k_scale"], a["v_scale"],
                                       layer_id_override=a["layer_id_override"])


TARGETS = {
    "reference": lambda: FunctionTarget(kvpool.reference_set_kv_buffer),
    "fused_interp": lambda: FunctionTarget(kvpool.fused_fp8_set_kv_buffer),
    "pool_never": lambda: PoolTarget("never"),
    "pool_always": lambda: PoolTarget("always"),
}
FUNCTION_TARGETS = ["reference", "fused_interp"]
POOL_TARGETS = ["pool_never", "pool_always"]


# ----------------------------------------------------------------------------------------------
# The cases.


@dataclasses.dataclass
class Bad:
    id: str
    change: Callable[[dict], None]
    exc: tuple
    names: tuple  # the error must name one of these arguments (function spelling; mapped for the pool)
    expected: Any  # regex of the expected value (or a function of the target giving it)
    actual: Any  # regex of the actual value (or a function of the target)
    targets: tuple = tuple(TARGETS)


def _set(**kw) -> Callable[[dict], None]:
    def change(a: dict) -> None:
        for key, val in kw.items():
            a[key] = val(a) if callable(val) and not isinstance(val, torch.Tensor) else val
    return change


def _num(n) -> str:
    return rf"(?<![\d.]){re.escape(str(n))}(?![\d.])"


VE = (ValueError,)
VTE = (ValueError, TypeError)
SHAPE, NDIM_3 = VE, r"3-?D|3 dim|ndim\D{0,4}3|\[T, ?\w+, ?\w+\]"

# fmt: off
CASES = [
    # wrong ndim
    Bad("k_2d", _set(k=lambda a: a["k"][:, 0]), SHAPE, ("k",), NDIM_3, r"\(5, 8\)|2-?D"),
    Bad("k_4d", _set(k=lambda a: a["k"][None]), SHAPE, ("k",), NDIM_3, r"\(1, 5, 2, 8\)|4-?D"),
    Bad("v_2d", _set(v=lambda a: a["v"][:, :, 0]), SHAPE, ("v",), NDIM_3, lambda t: rf"\(5, {t.hv}\)|2-?D"),
    # wrong head count / head dim
    Bad("k_heads_7", _set(k=torch.ones(T, 7, D, dtype=torch.bfloat16)), SHAPE, ("k",), _num(H), _num(7)),
    Bad("k_head_dim_9", _set(k=torch.ones(T, H, 9, dtype=torch.bfloat16)), SHAPE, ("k",), _num(D), _num(9)),
    Bad("v_heads_7", _set(v=torch.ones(T, 7, DV, dtype=torch.bfloat16)), SHAPE, ("v",), lambda t: _num(t.hv), _num(7)),
    Bad("v_head_dim_9", _set(v=lambda a: torch.ones(T, a["v"].shape[1], 9, dtype=torch.bfloat16)), SHAPE, ("v",),
        _num(DV), _num(9)),
    Bad("v_with_k_heads", _set(v=torch.ones(T, H, DV, dtype=torch.bfloat16)), SHAPE, ("v",), _num(HV), _num(H),
        targets=tuple(FUNCTION_TARGETS)),
    # T differing between k, v and loc
    Bad("v_T_4", _set(v=lambda a: a["v"][:4]), SHAPE, ("v", "k"), _num(5), _num(4)),
    Bad("k_T_4", _set(k=lambda a: a["k"][:4]), SHAPE, ("k", "v", "cache_loc"), _num(4), _num(5)),
    Bad("loc_T_6", _set(cache_loc=torch.tensor(BASE_LOC + [2])), SHAPE, ("cache_loc",), _num(5), _num(6)),
    Bad("loc_T_4", _set(cache_loc=torch.tensor(BASE_LOC[:4])), SHAPE, ("cache_loc",), _num(5), _num(4)),
    # loc dtype / ndim
    Bad("loc_float32", _set(cache_loc=torch.tensor(BASE_LOC, dtype=torch.float32)), VTE, ("cache_loc",), r"int32|int64|integer", r"float32"),
    Bad("loc_float64", _set(cache_loc=torch.tensor(BASE_LOC, dtype=torch.float64)), VTE, ("cache_loc",), r"int32|int64|integer", r"float64"),
    Bad("loc_bool", _set(cache_loc=torch.tensor([True, False, True, True, False])), VTE, ("cache_loc",), r"int32|int64|integer", r"bool"),
    Bad("loc_int16", _set(cache_loc=torch.tensor(BASE_LOC, dtype=torch.int16)), VTE, ("cache_loc",), r"int32|int64", r"int16"),
    Bad("loc_2d", _set(cache_loc=torch.tensor([BASE_LOC])), SHAPE, ("cache_loc",), r"1-?D|\[T\]|ndim\D{0,4}1", r"\(1, 5\)|2-?D"),
    Bad("loc_2d_column", _set(cache_loc=torch.tensor(BASE_LOC)[:, None]), SHAPE, ("cache_loc",), r"1-?D|\[T\]|ndim\D{0,4}1", r"\(5, 1\)|2-?D"),
    # non-float input dtypes
    Bad("k_int32", _set(k=torch.ones(T, H, D, dtype=torch.int32)), VTE, ("k",), r"bfloat16|float16|float32|floating", r"int32"),
    Bad("k_bool", _set(k=torch.ones(T, H, D, dtype=torch.bool)), VTE, ("k",), r"bfloat16|float16|float32|floating", r"bool"),
    Bad("k_fp8_e4m3", _set(k=torch.zeros(T, H, D, dtype=torch.float8_e4m3fn)), VTE, ("k",), r"bfloat16|float16|float32", r"float8_e4m3fn"),
    Bad("v_fp8_e5m2", _set(v=lambda a: torch.zeros(a["v"].shape, dtype=torch.float8_e5m2)), VTE, ("v",), r"bfloat16|float16|float32", r"float8_e5m2"),
    Bad("v_int64", _set(v=lambda a: torch.ones(a["v"].shape, dtype=torch.int64)), VTE, ("v",), r"bfloat16|float16|float32|floating", r"int64"),
    Bad("v_uint8", _set(v=lambda a: torch.ones(a["v"].shape, dtype=torch.uint8)), VTE, ("v",), r"bfloat16|float16|float32|floating", r"uint8"),
    # another device
    Bad("k_meta", _set(k=torch.empty(T, H, D, dtype=torch.bfloat16, device=META)), VE, ("k",), r"cpu", r"meta"),
    Bad("v_meta", _set(v=lambda a: torch.empty(a["v"].shape, dtype=torch.bfloat16, device=META)), VE, ("v",), r"cpu", r"meta"),
    Bad("loc_meta", _set(cache_loc=torch.empty(T, dtype=torch.int64, device=META)), VE, ("cache_loc",), r"cpu", r"meta"),
    Bad("k_scale_meta", _set(k_scale=torch.empty(1, device=META)), VE, ("k_scale",), r"cpu", r"meta"),
    Bad("v_scale_meta_per_head", _set(v_scale=lambda a: torch.empty(a["v"].shape[1], device=META)), VE, ("v_scale",), r"cpu", r"meta"),
    Bad("k_cache_meta", _set(k_cache=torch.empty(SLOTS, H, D, dtype=CACHE_DTYPE, device=META)), VE,
        ("k_cache", "v_cache", "k", "v", "cache_loc"), r"cpu|meta", r"cpu|meta", targets=tuple(FUNCTION_TARGETS)),
    # python float scales (also ints): <= 0, non-finite, not a normal float32
    *[Bad(f"{which}_float_{name}", _set(**{which: val}), VE, (which,), r"positive", re.escape(repr(val)))
      for which in ("k_scale", "v_scale")
      for name, val in [("0.0", 0.0), ("-0.0", -0.0), ("-1.0", -1.0), ("nan", math.nan), ("inf", math.inf),
                        ("-inf", -math.inf), ("1e39_f32_inf", 1e39), ("1e-45_f32_subnormal", 1e-45),
                        ("1e-40_f32_subnormal", 1e-40), ("int_0", 0), ("int_-2", -2)]],
    Bad("k_scale_bool", _set(k_scale=True), (TypeError,), ("k_scale",), r"float|tensor", r"bool"),
    Bad("v_scale_str", _set(v_scale="0.5"), (TypeError,), ("v_scale",), r"float|tensor", r"str"),
    # tensor scales: not floating, or neither per-tensor nor per-head
    Bad("k_scale_int64_tensor", _set(k_scale=torch.tensor(1)), VTE, ("k_scale",), r"float", r"int64"),
    Bad("v_scale_int32_per_head", _set(v_scale=lambda a: torch.ones(a["v"].shape[1], dtype=torch.int32)), VTE, ("v_scale",), r"float", r"int32"),
    Bad("k_scale_bool_tensor", _set(k_scale=torch.tensor([True])), VTE, ("k_scale",), r"float", r"bool"),
    Bad("k_scale_complex", _set(k_scale=torch.ones(1, dtype=torch.complex64)), VTE, ("k_scale",), r"float", r"complex64"),
    Bad("k_scale_shape_H+1", _set(k_scale=torch.ones(H + 1)), VE, ("k_scale",), _num(H), r"\(3,\)"),
    Bad("k_scale_shape_2x2", _set(k_scale=torch.ones(2, 2)), VE, ("k_scale",), _num(H), r"\(2, 2\)"),
    Bad("k_scale_shape_1xH", _set(k_scale=torch.ones(1, H)), VE, ("k_scale",), _num(H), r"\(1, 2\)"),
    Bad("k_scale_shape_Hx1x1", _set(k_scale=torch.ones(H, 1, 1)), VE, ("k_scale",), _num(H), r"\(2, 1, 1\)"),
    Bad("k_scale_empty", _set(k_scale=torch.ones(0)), VE, ("k_scale",), r"one|1|" + _num(H), r"\(0,\)"),
    Bad("v_scale_k_heads", _set(v_scale=torch.ones(H)), VE, ("v_scale",), _num(HV), r"\(2,\)",
        targets=tuple(FUNCTION_TARGETS)),
    Bad("v_scale_shape_Hvx2", _set(v_scale=lambda a: torch.ones(a["v"].shape[1], 2)), VE, ("v_scale",),
        lambda t: _num(t.hv), lambda t: rf"\({t.hv}, 2\)"),
]

LAYER_CASES = [
    *[Bad(f"layer_id_{lid}", _set(layer=Layer(lid)), (IndexError,), ("layer_id", "layer"), r"4\D{1,6}6", _num(lid),
          targets=tuple(POOL_TARGETS))
      for lid in (0, 3, 7, 100, -1, -3)],
    *[Bad(f"override_{lid}", _set(layer=None, layer_id_override=lid), (IndexError,), ("layer_id", "layer_id_override"),
          r"4\D{1,6}6", _num(lid), targets=tuple(POOL_TARGETS))
      for lid in (0, -2, 7)],
    Bad("override_out_of_range_wins_over_valid_layer", _set(layer=Layer(LAYER), layer_id_override=2), (IndexError,),
        ("layer_id", "layer_id_override"), r"4\D{1,6}6", _num(2), targets=tuple(POOL_TARGETS)),
    Bad("layer_none_without_override", _set(layer=None), (TypeError,), ("layer", "layer_id_override", "layer_id"),
        r"layer_id|override", r"None|neither", targets=tuple(POOL_TARGETS)),
]
# fmt: on


def _message_checks(err: BaseException, case: Bad, target) -> None:
    msg = str(err)
    names = [target.name(n) for n in case.names]
    assert any(re.search(rf"(?<![\w.]){re.escape(n)}(?!\w)", msg) for n in names), (
        f"message does not name any of {names}: {msg!r}")
    expected = case.expected(target) if callable(case.expected) else case.expected
    actual = case.actual(target) if callable(case.actual) else case.actual
    assert re.search(expected, msg), f"message lacks the expected value /{expected}/: {msg!r}"
    assert re.search(actual, msg), f"message lacks the actual value /{actual}/: {msg!r}"


def _run_bad(case: Bad, target_name: str) -> None:
    skip_fused_without_interpreter(target_name)
    target = TARGETS[target_name]()
    a = _base_args(target.hv)
    case.change(a)
    inputs = {k: v for k, v in a.items() if isinstance(v, torch.Tensor) and v.device != META}
    inputs_before = {k: v.clone() for k, v in inputs.items()}
    before = target.snapshot()
    with pytest.raises(case.exc) as info:
        target.call(a)
    _message_checks(info.value, case, target)
    for b, now in zip(before, target.current()):
        assert_same_bytes(now, b, f"{target_name}: cache/buffer after rejected call {case.id}")
    for k, v in inputs.items():
        assert_same_bytes(v, inputs_before[k], f"input {k} after rejected call {case.id}")


def _pairs(cases):
    return [pytest.param(c, t, id=f"{c.id}-{t}") for c in cases for t in c.targets]


@pytest.mark.parametrize("case, target_name", _pairs(CASES))
def test_bad_input_rejected_named_and_nothing_written(case, target_name):
    _run_bad(case, target_name)


@pytest.mark.parametrize("case, target_name", _pairs(LAYER_CASES))
def test_bad_layer_rejected_named_and_nothing_written(case, target_name):
    _run_bad(case, target_name)


def test_base_call_is_valid_and_writes():
    """The base call of every bad case is good: it writes rows 1, 5, 7 and 10 (so a partial write
    before an error would show up in the snapshots above)."""
    for name in TARGETS:
        if not INTERPRETER and ("fused" in name or "always" in name):
            continue
        target = TARGETS[name]()
        before = target.snapshot()
        a = _base_args(target.hv)
        assert target.call(a) is None
        changed = [not torch.equal(b.view(torch.uint8), n.view(torch.uint8)) for b, n in zip(before, target.current())]
        assert any(changed), f"{name}: the base call wrote nothing"
        if isinstance(target, FunctionTarget):
            exp = expected_cache(codes_of(before[0][GUARD:GUARD + SLOTS]), a["k"], BASE_LOC, CACHE_DTYPE, 0.5)
            assert_codes_equal(target.k_cache, exp, FORMAT_OF[CACHE_DTYPE], f"{name} base call")


@pytest.mark.parametrize("getter", ["get_key_buffer", "get_value_buffer", "get_kv_buffer"])
@pytest.mark.parametrize("lid", [0, 3, 7, -1, -3, 100])
def test_getters_reject_layer_ids_outside_the_pool(getter, lid):
    """A layer id outside [start_layer, end_layer] is an error, never a wrapped list index
    (docs/contract.md, "Pools")."""
    pool = PoolTarget("never").pool
    with pytest.raises(IndexError) as info:
        getattr(pool, getter)(lid)
    assert re.search(_num(lid), str(info.value)) and re.search(r"4\D{1,6}6", str(info.value)), str(info.value)


@pytest.mark.parametrize("target_name", POOL_TARGETS)
def test_layer_id_override_takes_precedence(target_name):
    skip_fused_without_interpreter(target_name)
    target = TARGETS[target_name]()
    before = target.snapshot()
    a = _base_args(target.hv)
    a["layer"], a["layer_id_override"] = Layer(4), 6
    target.call(a)
    after = target.current()
    # buffers are listed per layer: 4 (K, V), 5 (K, V), 6 (K, V)
    for i in range(4):
        assert_same_bytes(after[i], before[i], f"layer {START + i // 2} (not the override)")
    exp = expected_cache(codes_of(before[4]), a["k"], BASE_LOC, CACHE_DTYPE, 0.5)
    assert_codes_equal(after[4], exp, FORMAT_OF[CACHE_DTYPE], "override layer 6 K")


# ----------------------------------------------------------------------------------------------
# validate=True (constructor flag, function keyword, or KVPOOL_VALIDATE=1 at construction).

VALIDATING = {
    "reference": lambda: FunctionTarget(kvpool.reference_set_kv_buffer, validate=True),
    "fused_interp": lambda: FunctionTarget(kvpool.fused_fp8_set_kv_buffer, validate=True),
    "pool_never_flag": lambda: PoolTarget("never", validate=True),
    "pool_always_flag": lambda: PoolTarget("always", validate=True),
    "pool_never_env": lambda: PoolTarget("never", env_validate=True),
    "pool_always_env": lambda: PoolTarget("always", env_validate=True),
}

# (id, loc, dtype, bad position, bad value)
OOR_LOCS = [
    ("exactly_slots_at_3", [1, 5, -1, SLOTS, 10], torch.int64, 3, SLOTS),
    ("slots+1_at_0", [SLOTS + 1, 5, -1, 7, 10], torch.int32, 0, SLOTS + 1),
    ("int32_max_at_4", [1, 5, -1, 7, 2**31 - 1], torch.int32, 4, 2**31 - 1),
    ("2^40_at_2", [1, 5, 2**40, 7, -(2**40)], torch.int64, 2, 2**40),
]


def _validating_target(name, monkeypatch):
    skip_fused_without_interpreter(name)
    if name.endswith("_env"):
        monkeypatch.setenv("KVPOOL_VALIDATE", "1")
    return VALIDATING[name]()


@pytest.mark.parametrize("target_name", list(VALIDATING))
@pytest.mark.parametrize("case", OOR_LOCS, ids=[c[0] for c in OOR_LOCS])
def test_validate_rejects_out_of_range_slot(case, target_name, monkeypatch):
    _, loc, dtype, pos, val = case
    target = _validating_target(target_name, monkeypatch)
    monkeypatch.delenv("KVPOOL_VALIDATE", raising=False)  # read at construction only
    a = _base_args(target.hv)
    a["cache_loc"] = torch.tensor(loc, dtype=dtype)
    before = target.snapshot()
    with pytest.raises(IndexError) as info:
        target.call(a)
    msg = str(info.value)
    assert re.search(_num(val), msg), f"slot value {val} not in message: {msg!r}"
    assert re.search(rf"\[{pos}\]|position {pos}|index {pos}|entry {pos}", msg), f"position {pos} not in: {msg!r}"
    assert re.search(rf"(?<!\w){re.escape(target.name('cache_loc'))}(?!\w)", msg), msg
    for b, n in zip(before, target.current()):
        assert_same_bytes(n, b, f"{target_name}: buffers after rejected loc {loc}")


@pytest.mark.parametrize("target_name", list(VALIDATING))
def test_validate_accepts_padding_and_valid_slots(target_name, monkeypatch):
    """validate is not stricter than the spec: negative slots and slots < size + page_size pass."""
    target = _validating_target(target_name, monkeypatch)
    a = _base_args(target.hv)
    a["cache_loc"] = torch.tensor([0, SLOTS - 1, -1, -(2**31), 6], dtype=torch.int32)
    a["k_scale"] = torch.tensor([2.0**-126, 3.0e38])  # the extreme normal float32 values are fine
    assert target.call(a) is None


# (id, which scale, tensor, text of the bad value)
BAD_SCALE_VALUES = [
    ("k_zero", "k_scale", torch.tensor(0.0), r"0"),
    ("k_negative", "k_scale", torch.tensor([-1.0]), r"-1"),
    ("k_nan_per_head", "k_scale", torch.tensor([1.0, float("nan")]), r"nan"),
    ("k_inf", "k_scale", torch.tensor([[float("inf")]]), r"inf"),
    ("k_f32_subnormal", "k_scale", torch.tensor([1e-40]), r"1e-40|1\.0*e-40|9\.99\d*e-41"),
    ("v_neg_inf_per_head", "v_scale", lambda hv: torch.tensor([1.0] * (hv - 1) + [float("-inf")]), r"-inf"),
    ("v_zero_per_head_Hx1", "v_scale", lambda hv: torch.tensor([[1.0], [0.0]] + [[1.0]] * (hv - 2)), r"0"),
    ("v_bf16_negative", "v_scale", torch.tensor([-0.5], dtype=torch.bfloat16), r"-0\.5"),
]


@pytest.mark.parametrize("target_name", list(VALIDATING))
@pytest.mark.parametrize("case", BAD_SCALE_VALUES, ids=[c[0] for c in BAD_SCALE_VALUES])
def test_validate_rejects_bad_scale_values(case, target_name, monkeypatch):
    _, which, scale, text = case
    if target_name.startswith(("fused", "pool_always")) and case[0] == "v_bf16_negative":
        pytest.skip("the fused kernel reads float32 scale tensors only")
    target = _validating_target(target_name, monkeypatch)
    scale = scale(target.hv) if callable(scale) else scale
    a = _base_args(target.hv)
    a[which] = scale
    before = target.snapshot()
    scale_before = scale.clone()
    with pytest.raises(ValueError) as info:
        target.call(a)
    msg = str(info.value)
    assert re.search(rf"(?<!\w){which}(?!\w)", msg), msg
    assert re.search(text, msg), f"bad value /{text}/ not in message: {msg!r}"
    assert re.search(r"positive|finite|normal", msg), f"no expectation in message: {msg!r}"
    for b, n in zip(before, target.current()):
        assert_same_bytes(n, b, f"{target_name}: buffers after rejected scale")
    assert_same_bytes(scale, scale_before, "scale tensor")


# ----------------------------------------------------------------------------------------------
# Without validate: out-of-range entries are skipped and nothing outside the buffer is touched.

OOR_SKIP_LOC = [SLOTS, 3, SLOTS + 1, SLOTS + GUARD, 2**31 - 1, -1, -(2**31), 11]


@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("target_name", FUNCTION_TARGETS)
def test_out_of_range_slots_skipped_guard_rows_untouched(target_name, loc_dtype):
    skip_fused_without_interpreter(target_name)
    target = TARGETS[target_name]()
    k_before, v_before = target.snapshot()
    g = torch.Generator().manual_seed(3)
    n = len(OOR_SKIP_LOC)
    k = (torch.randn(n, H, D, generator=g) * 100).to(torch.float16)
    v = torch.randn(n, HV, DV, generator=g)
    loc = torch.tensor(OOR_SKIP_LOC, dtype=loc_dtype)
    target.fn(k, v, target.k_cache, target.v_cache, loc, 0.37, torch.tensor([3.3, 0.1, 1e-3]))
    for outer, before in ((target.k_outer, k_before), (target.v_outer, v_before)):
        for gr in list(range(GUARD)) + list(range(GUARD + SLOTS, SLOTS + 2 * GUARD)):
            assert_same_bytes(outer[gr], before[gr], f"{target_name}: guard row {gr}")
    fmt = FORMAT_OF[CACHE_DTYPE]
    exp_k = expected_cache(codes_of(k_before[GUARD:GUARD + SLOTS]), k, OOR_SKIP_LOC, CACHE_DTYPE, 0.37)
    exp_v = expected_cache(codes_of(v_before[GUARD:GUARD + SLOTS]), v, OOR_SKIP_LOC, CACHE_DTYPE,
                           torch.tensor([3.3, 0.1, 1e-3]))
    assert_codes_equal(target.k_cache, exp_k, fmt, f"{target_name} k_cache with out-of-range slots")
    assert_codes_equal(target.v_cache, exp_v, fmt, f"{target_name} v_cache with out-of-range slots")


@pytest.mark.parametrize("target_name", POOL_TARGETS)
def test_pool_out_of_range_slots_skipped_other_layers_untouched(target_name):
    skip_fused_without_interpreter(target_name)
    target = TARGETS[target_name]()
    before = target.snapshot()
    n = len(OOR_SKIP_LOC)
    k = torch.full((n, H, D), 3.0)
    v = torch.full((n, H, DV), -5.0, dtype=torch.bfloat16)
    a = dict(_base_args(H), k=k, v=v, cache_loc=torch.tensor(OOR_SKIP_LOC), layer=Layer(4), k_scale=None, v_scale=None)
    target.call(a)
    after = target.current()
    fmt = FORMAT_OF[CACHE_DTYPE]
    assert_codes_equal(after[0], expected_cache(codes_of(before[0]), k, OOR_SKIP_LOC, CACHE_DTYPE), fmt, "layer 4 K")
    assert_codes_equal(after[1], expected_cache(codes_of(before[1]), v, OOR_SKIP_LOC, CACHE_DTYPE), fmt, "layer 4 V")
    for i in range(2, 6):
        assert_same_bytes(after[i], before[i], f"{target_name}: buffer {i} of layers 5..6")


# ----------------------------------------------------------------------------------------------
# 16-bit caches ignore scales, unchecked (docs/contract.md, "The write"). The test also accepts the
# stricter reading, a clear error naming the scale with nothing written; anything else fails.

IGNORED_SCALES = [("neg_float", -1.0), ("nan_float", math.nan), ("int_tensor", torch.tensor([1])),
                  ("wrong_shape", torch.ones(7)), ("meta_tensor", torch.ones(1, device=META))]


@pytest.mark.parametrize("target_name", FUNCTION_TARGETS)
@pytest.mark.parametrize("case", IGNORED_SCALES, ids=[c[0] for c in IGNORED_SCALES])
def test_16bit_cache_with_bad_scale_errors_cleanly_or_casts(case, target_name):
    _, scale = case
    skip_fused_without_interpreter(target_name)
    target = FunctionTarget(kvpool.reference_set_kv_buffer if target_name == "reference"
                            else kvpool.fused_fp8_set_kv_buffer, cache_dtype=torch.bfloat16)
    before = target.snapshot()
    a = _base_args()
    a["k_scale"] = scale
    try:
        target.call(a)
    except (ValueError, TypeError) as err:
        assert "k_scale" in str(err), str(err)
        for b, n in zip(before, target.current()):
            assert_same_bytes(n, b, "buffers after a rejected scale")
        return
    exp = expected_cache(codes_of(before[0][GUARD:GUARD + SLOTS]), a["k"], BASE_LOC, torch.bfloat16)
    assert_codes_equal(target.k_cache, exp, FORMAT_OF[torch.bfloat16], "bf16 cache, scale ignored")


# ----------------------------------------------------------------------------------------------
# Float scales at the top of the float32 range. float32(s) is what divides (docs/contract.md, "The
# write"), so a Python
# float between FLT_MAX and FLT_MAX + half an ulp (3.4028235e38, the usual spelling of FLT_MAX) is
# a finite, normal float32 scale. Accepted: it must write q(x, FLT_MAX). Rejected: a ValueError that
# names the argument, before anything is written. Either reading passes; a crash half-way does not.

FLT_MAX = float(np.finfo(np.float32).max)  # 3.4028234663852886e38
FLT_MAX_SPELLED = 3.4028235e38  # > FLT_MAX as a double, == FLT_MAX once rounded to float32
assert FLT_MAX_SPELLED > FLT_MAX and float(np.float32(FLT_MAX_SPELLED)) == FLT_MAX

def _boundary_params():
    out = []
    for value, vid in ((FLT_MAX, "flt_max_exact"), (FLT_MAX_SPELLED, "3.4028235e38")):
        for which in ("k_scale", "v_scale"):
            for t in TARGETS:
                out.append(pytest.param(value, which, t, id=f"{vid}-{which}-{t}"))
    return out


@pytest.mark.parametrize("value, which, target_name", _boundary_params())
def test_float_scale_at_float32_max_is_taken_or_cleanly_rejected(value, which, target_name):
    skip_fused_without_interpreter(target_name)
    target = TARGETS[target_name]()
    a = _base_args(target.hv)
    a["k_scale"], a["v_scale"] = None, None
    a[which] = value
    before = target.snapshot()
    try:
        target.call(a)
    except ValueError as err:
        assert re.search(rf"(?<!\w){which}(?!\w)", str(err)), str(err)
        for b, n in zip(before, target.current()):
            assert_same_bytes(n, b, f"{target_name}: buffers after rejected {which}={value!r}")
        return
    fmt = FORMAT_OF[CACHE_DTYPE]
    k_now, v_now = target.current()[:2] if isinstance(target, FunctionTarget) else target.current()[2:4]
    k_before, v_before = before[:2] if isinstance(target, FunctionTarget) else before[2:4]
    if isinstance(target, FunctionTarget):
        k_now, v_now = k_now[GUARD:GUARD + SLOTS], v_now[GUARD:GUARD + SLOTS]
        k_before, v_before = k_before[GUARD:GUARD + SLOTS], v_before[GUARD:GUARD + SLOTS]
    exp_k = expected_cache(codes_of(k_before), a["k"], BASE_LOC, CACHE_DTYPE, a["k_scale"])
    exp_v = expected_cache(codes_of(v_before), a["v"], BASE_LOC, CACHE_DTYPE, a["v_scale"])
    assert_codes_equal(k_now, exp_k, fmt, f"{target_name} K with {which}={value!r}")
    assert_codes_equal(v_now, exp_v, fmt, f"{target_name} V with {which}={value!r}")


# ----------------------------------------------------------------------------------------------
# T == 0 is a no-op only for good input: bad input is still rejected.

# fmt: off
EMPTY_CASES = [
    ("loc_float", dict(cache_loc=torch.zeros(0)), VTE, "cache_loc"),
    ("k_heads", dict(k=torch.zeros(0, 7, D)), VE, "k"),
    ("v_head_dim", dict(v=lambda hv: torch.zeros(0, hv, 9)), VE, "v"),
    ("k_int", dict(k=torch.zeros(0, H, D, dtype=torch.int32)), VTE, "k"),
    ("v_meta", dict(v=lambda hv: torch.zeros(0, hv, DV, device=META)), VE, "v"),
    ("k_scale_negative", dict(k_scale=-1.0), VE, "k_scale"),
    ("v_scale_shape", dict(v_scale=torch.ones(5)), VE, "v_scale"),
    ("loc_T_1", dict(cache_loc=torch.tensor([1])), VE, "cache_loc"),
]
# fmt: on


@pytest.mark.parametrize("target_name", list(TARGETS))
@pytest.mark.parametrize("case", EMPTY_CASES, ids=[c[0] for c in EMPTY_CASES])
def test_bad_input_rejected_when_T_is_0(case, target_name):
    _, change, exc, name = case
    skip_fused_without_interpreter(target_name)
    target = TARGETS[target_name]()
    a = dict(_base_args(target.hv), k=torch.zeros(0, H, D), v=torch.zeros(0, target.hv, DV),
             cache_loc=torch.zeros(0, dtype=torch.int64))
    for key, val in change.items():
        a[key] = val(target.hv) if callable(val) else val
    before = target.snapshot()
    with pytest.raises(exc) as info:
        target.call(a)
    assert re.search(rf"(?<![\w.]){re.escape(target.name(name))}(?!\w)", str(info.value)), str(info.value)
    for b, n in zip(before, target.current()):
        assert_same_bytes(n, b, f"{target_name}: buffers after rejected empty call")


# ----------------------------------------------------------------------------------------------
# The fused path refuses what its gate refuses (docs/contract.md, "The gate"), before writing.


@pytest.mark.parametrize("target_name", ["fused_interp", "pool_always"])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_fused_refuses_non_float32_scale_tensor_without_writing(scale_dtype, target_name):
    skip_fused_without_interpreter(target_name)
    target = TARGETS[target_name]()
    a = _base_args(target.hv)
    a["v_scale"] = torch.tensor([0.25], dtype=scale_dtype)
    before = target.snapshot()
    with pytest.raises(kvpool.FusedPathUnavailable) as info:
        target.call(a)
    assert "v_scale" in str(info.value) and str(scale_dtype).split(".")[-1] in str(info.value), str(info.value)
    for b, n in zip(before, target.current()):
        assert_same_bytes(n, b, f"{target_name}: buffers after the gate refused")


# ==============================================================================================
# NaN bit patterns and autograd.
# Whenever a write converts between element types, a NaN is stored as the cache format's positive
# all-ones NaN (``EXPECTED_NAN_BITS``, the values of ``formats.NAN_BITS`` written out); a write whose
# input already has the cache's type copies NaN bits as they are, sign and payload included. A cache
# that requires grad is refused by both public functions with a ValueError naming it, before
# anything is written; inputs that require grad write exactly what their detached values write.


WRITES = [fused_fp8_set_kv_buffer, reference_set_kv_buffer]

#: The stored NaN of each cache format when a write converts (formats.NAN_BITS, spelled out).
EXPECTED_NAN_BITS = {
    torch.float8_e4m3fn: 0x7F,
    torch.float8_e5m2: 0x7F,
    torch.bfloat16: 0x7FFF,
    torch.float16: 0x7FFF,
    torch.float32: 0x7FFFFFFF,
}

#: NaNs of both signs per input format: quiet, signalling (lowest payload bit only), all-ones,
#: and an arbitrary payload.
NAN_PATTERNS = {
    torch.bfloat16: [0x7FC0, 0xFFC0, 0x7F81, 0xFF81, 0x7FFF, 0xFFFF, 0x7FA5, 0xFFA5],
    torch.float16: [0x7E00, 0xFE00, 0x7C01, 0xFC01, 0x7FFF, 0xFFFF, 0x7D55, 0xFD55],
    torch.float32: [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF,
                    0x7FA5A5A5, 0xFFC0FFEE],
}  # fmt: skip
_SIGNED = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _from_bits(patterns: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor of ``dtype`` holding exactly these bit patterns (no float conversion on the way)."""
    width = dtype.itemsize * 8
    signed = [p - (1 << width) if p >= 1 << (width - 1) else p for p in patterns]
    return torch.tensor(signed, dtype=torch.int64).to(_SIGNED[dtype.itemsize]).view(dtype)


def _unsigned(t: torch.Tensor) -> list[int]:
    width = t.element_size() * 8
    return [v & ((1 << width) - 1) for v in bits(t.cpu()).reshape(-1).tolist()]


def _nan_rows(in_dtype: torch.dtype, heads: int = 2, dim: int = 4) -> torch.Tensor:
    """[T, heads, dim]: token t holds NAN_PATTERNS[in_dtype][t] in every element."""
    patterns = _from_bits(NAN_PATTERNS[in_dtype], in_dtype)
    return patterns.reshape(-1, 1, 1).expand(-1, heads, dim).contiguous().to(DEVICE)


def _expected_row_bits(in_dtype: torch.dtype, cache_dtype: torch.dtype) -> list[int]:
    """Per token, the bits each element of its row must hold."""
    if in_dtype == cache_dtype:
        return list(NAN_PATTERNS[in_dtype])
    return [EXPECTED_NAN_BITS[cache_dtype]] * len(NAN_PATTERNS[in_dtype])


def _check_rows(cache: torch.Tensor, loc: list[int], in_dtype: torch.dtype, expected: list[int], what: str) -> None:
    for t, slot in enumerate(loc):
        got = set(_unsigned(cache[slot]))
        assert got == {expected[t]}, (
            f"{what}: token {t} (input bits {NAN_PATTERNS[in_dtype][t]:#x}) stored "
            f"{sorted(hex(g) for g in got)}, expected {expected[t]:#x}"
        )


def _nan_scales(cache_dtype: torch.dtype, kind: str):
    if kind == "none":
        return None
    if kind == "float":
        return 0.37
    return torch.tensor([0.5, 3.0], device=DEVICE)  # per head (FP8 only; 16-bit caches ignore it)


@fused_runs
@pytest.mark.parametrize("write", WRITES, ids=id_of)
@pytest.mark.parametrize("scale_kind", ["none", "float", "per_head"])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=id_of)
@pytest.mark.parametrize("in_dtype", INPUT_DTYPES, ids=id_of)
def test_public_functions_store_pinned_nan_bits(in_dtype, cache_dtype, scale_kind, write):
    """Every (input, cache) pair, NaNs of both signs and several payloads, on each public function:
    converting writes store the canonical NaN, same-type writes keep the bits."""
    x = _nan_rows(in_dtype)
    t = x.shape[0]
    slots = t + 3
    kc = poison_(torch.empty(slots, 2, 4, dtype=cache_dtype, device=DEVICE))
    vc = poison_(torch.empty(slots, 2, 4, dtype=cache_dtype, device=DEVICE))
    loc = list(range(2, 2 + t))
    scale = _nan_scales(cache_dtype, scale_kind)
    write(x, x, kc, vc, torch.tensor(loc, device=DEVICE), scale, scale)
    expected = _expected_row_bits(in_dtype, cache_dtype)
    _check_rows(kc, loc, in_dtype, expected, f"{id_of(in_dtype)} -> {id_of(cache_dtype)} k_cache")
    _check_rows(vc, loc, in_dtype, expected, f"{id_of(in_dtype)} -> {id_of(cache_dtype)} v_cache")


@fused_runs
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=id_of)
@pytest.mark.parametrize("in_dtype", INPUT_DTYPES, ids=id_of)
def test_both_paths_store_the_same_nan_bits(in_dtype, cache_dtype):
    """Without pinning any pattern: fused and reference bytes agree."""
    x = _nan_rows(in_dtype)
    t = x.shape[0]
    out = []
    for write in WRITES:
        kc = poison_(torch.empty(t, 2, 4, dtype=cache_dtype, device=DEVICE))
        write(x, x, kc, kc.clone(), torch.arange(t, device=DEVICE))
        out.append(_unsigned(kc))
    assert out[0] == out[1], [
        (hex(NAN_PATTERNS[in_dtype][i // 8]), hex(a), hex(b)) for i, (a, b) in enumerate(zip(*out)) if a != b
    ][:4]


@fused_runs
@pytest.mark.parametrize("fused", ["always", "never"])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=id_of)
def test_pools_store_pinned_nan_bits(cache_dtype, fused):
    """The same through a pool, every input dtype into one pool, both paths."""
    pool = MHATokenToKVPool(40, 1, cache_dtype, 2, 4, 1, DEVICE, fused=fused, warmup=False)
    poison_pool_(pool)
    start = 1
    for in_dtype in INPUT_DTYPES:
        x = _nan_rows(in_dtype)
        loc = list(range(start, start + x.shape[0]))
        start += x.shape[0]
        pool.set_kv_buffer(None, torch.tensor(loc, device=DEVICE), x, x, 0.37, None, layer_id_override=0)
        expected = _expected_row_bits(in_dtype, cache_dtype)
        k, v = pool.get_kv_buffer(0)
        _check_rows(k, loc, in_dtype, expected, f"{id_of(in_dtype)} -> {id_of(cache_dtype)} pool K fused={fused}")
        _check_rows(v, loc, in_dtype, expected, f"{id_of(in_dtype)} -> {id_of(cache_dtype)} pool V fused={fused}")


@fused_runs
@pytest.mark.parametrize("write", WRITES, ids=id_of)
def test_fp32_and_fp16_nans_into_bf16_and_fp16_caches(write):
    """fp32 NaN 0x7FC00000 into a bf16 cache; fp16 -NaN into an fp16 cache (keeps its sign and
    payload) and into a bf16 cache (canonical NaN)."""
    loc = torch.tensor([1], device=DEVICE)
    x32 = _from_bits([0x7FC00000], torch.float32).reshape(1, 1, 1).to(DEVICE)
    kc = poison_(torch.empty(3, 1, 1, dtype=torch.bfloat16, device=DEVICE))
    write(x32, x32, kc, kc.clone(), loc)
    assert _unsigned(kc[1]) == [0x7FFF]
    x16 = _from_bits([0xFE00], torch.float16).reshape(1, 1, 1).to(DEVICE)
    hc = poison_(torch.empty(3, 1, 1, dtype=torch.float16, device=DEVICE))
    write(x16, x16, hc, hc.clone(), loc)
    assert _unsigned(hc[1]) == [0xFE00], "a same-type write must keep the NaN's sign"
    write(x16, x16, kc, kc.clone(), loc)
    assert _unsigned(kc[1]) == [0x7FFF]


def test_nan_bits_table_is_the_pinned_one():
    from kvpool.kernels.formats import NAN_BITS

    assert NAN_BITS == EXPECTED_NAN_BITS


@fused_runs
def test_finite_values_around_nans_are_unaffected():
    """A row mixing NaNs with finite values and infinities: only the NaN elements take the
    canonical pattern (both paths agree byte for byte, and with the plain cast elsewhere)."""
    raw = [0x7FC00000, 0x3F800000, 0xFF800001, 0xFF800000, 0x7F800000, 0x80000000, 0x00000001, 0xC2F60000]
    x = _from_bits(raw, torch.float32).reshape(1, 2, 4).to(DEVICE)
    out = []
    for write in WRITES:
        kc = poison_(torch.empty(2, 2, 4, dtype=torch.bfloat16, device=DEVICE))
        write(x, x, kc, kc.clone(), torch.tensor([0], device=DEVICE))
        out.append(_unsigned(kc[0]))
    assert out[0] == out[1]
    plain = _unsigned(x.to(torch.bfloat16)[0])
    assert out[0] == [0x7FFF if i in (0, 2) else plain[i] for i in range(8)]


# --- autograd ------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["k_cache", "v_cache"])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn], ids=id_of)
@pytest.mark.parametrize("write", WRITES, ids=id_of)
def test_cache_requiring_grad_is_refused_and_nothing_written(write, cache_dtype, which):
    kc = poison_(torch.empty(6, 2, 4, dtype=cache_dtype, device=DEVICE))
    vc = poison_(torch.empty(6, 2, 4, dtype=cache_dtype, device=DEVICE))
    (kc if which == "k_cache" else vc).requires_grad_(True)
    before = bits(kc.detach()).clone(), bits(vc.detach()).clone()
    x = torch.randn(3, 2, 4, device=DEVICE)
    with pytest.raises(ValueError, match=rf"{which} must not require grad.*requires_grad=True"):
        write(x, x, kc, vc, torch.tensor([1, 2, 3], device=DEVICE), 0.5, 0.5)
    assert torch.equal(bits(kc.detach()), before[0]) and torch.equal(bits(vc.detach()), before[1])


@pytest.mark.parametrize("write", WRITES, ids=id_of)
def test_cache_that_is_a_view_of_a_tensor_requiring_grad_is_refused(write):
    base = torch.zeros(2, 6, 2, 4, device=DEVICE, requires_grad=True)
    kc, vc = base[0] * 1, base[1] * 1  # non-leaf, requires grad through base
    x = torch.ones(1, 2, 4, device=DEVICE)
    with pytest.raises(ValueError, match="k_cache must not require grad"):
        write(x, x, kc, vc, torch.tensor([1], device=DEVICE))
    assert not kc.detach().any()


def _grad_inputs(in_dtype: torch.dtype):
    g = torch.Generator().manual_seed(4)
    leaf = (torch.randn(5, 2, 8, generator=g) * 50).to(in_dtype).to(DEVICE).requires_grad_(True)
    v = leaf * 2 - 1  # non-leaf with a grad_fn
    scale = torch.tensor([0.61], device=DEVICE, requires_grad=True)
    return leaf, v, scale


@fused_runs
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.float32], ids=id_of)
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32], ids=id_of)
def test_inputs_requiring_grad_write_like_their_detached_values(in_dtype, cache_dtype):
    """Inputs and scale tensors that require grad: both public functions write exactly the bytes
    their detached values write, and the caches stay outside autograd."""
    k, v, scale = _grad_inputs(in_dtype)
    loc = torch.tensor([3, -1, 0, 7, 5], device=DEVICE)
    expected_k = poison_(torch.empty(8, 2, 8, dtype=cache_dtype, device=DEVICE))
    expected_v = expected_k.clone()
    reference_set_kv_buffer(k.detach(), v.detach(), expected_k, expected_v, loc, scale.detach(), 0.5)
    for write in WRITES:
        kc, vc = poison_(torch.empty_like(expected_k)), poison_(torch.empty_like(expected_v))
        write(k, v, kc, vc, loc, scale, 0.5)
        assert torch.equal(bits(kc), bits(expected_k)) and torch.equal(bits(vc), bits(expected_v)), write.__name__
        assert not kc.requires_grad and kc.grad_fn is None and vc.grad_fn is None, write.__name__
    assert k.grad is None and scale.grad is None


@fused_runs
@pytest.mark.parametrize("cache_dtype", [torch.float8_e5m2, torch.float16], ids=id_of)
def test_pool_inputs_requiring_grad_write_identically_on_both_paths(cache_dtype):
    k, v, scale = _grad_inputs(torch.float32)
    loc = torch.tensor([3, -1, 0, 9, 5], device=DEVICE)
    pools = {}
    for fused in ("always", "never"):
        pool = MHATokenToKVPool(8, 1, cache_dtype, 2, 8, 1, DEVICE, fused=fused, warmup=False)
        pool.set_kv_buffer(None, loc, k, v, scale, scale, layer_id_override=0)
        pools[fused] = pool
    plain = MHATokenToKVPool(8, 1, cache_dtype, 2, 8, 1, DEVICE, fused="never", warmup=False)
    plain.set_kv_buffer(None, loc, k.detach(), v.detach(), scale.detach(), scale.detach(), layer_id_override=0)
    for pool in pools.values():
        for a, b in zip(pool.get_kv_buffer(0), plain.get_kv_buffer(0)):
            assert torch.equal(bits(a), bits(b))
            assert not a.requires_grad



# Every 16-bit pattern and random fp32 ones on the compiled kernel, both casts.
CAST_VARIANTS = {
    "native": KernelOptions(soft_cast=False),
    "soft": KernelOptions(soft_cast=True),
}


@gpu
@pytest.mark.parametrize("variant", list(CAST_VARIANTS))
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=id_of)
def test_every_16_bit_pattern_and_random_fp32_patterns_into_16_and_32_bit_caches(cache_dtype, variant):
    """Every bf16 and fp16 bit pattern, and 1M random fp32 patterns (NaN payloads of both signs
    among them), into 16- and 32-bit caches: fused and reference bytes identical."""
    every = torch.arange(65536, dtype=torch.int32, device="cuda").to(torch.int16)
    raw = torch.randint(-(2**31), 2**31, (1024, 8, 128), device="cuda", generator=cuda_gen(91), dtype=torch.int64)
    inputs = [every.view(torch.bfloat16).reshape(512, 1, 128), every.view(torch.float16).reshape(512, 1, 128),
              raw.to(torch.int32).view(torch.float32)]  # fmt: skip
    for x in inputs:
        t = x.shape[0]
        loc = torch.randperm(t, device="cuda")
        kf = poison_(torch.empty(t, x.shape[1], 128, dtype=cache_dtype, device="cuda"))
        kr = kf.clone()
        launch_store_kv(x, x, kf, kf.clone(), loc, options=CAST_VARIANTS[variant])
        reference_set_kv_buffer(x, x, kr, kr.clone(), loc)
        assert_same_bytes(kf, kr, f"{id_of(x.dtype)} patterns -> {id_of(cache_dtype)}")


# ==============================================================================================
# The verify write.
# Token ``(i, j)`` (input row ``i * width + j``) is written to slot ``loc_2d[i, j]`` exactly as
# ``set_kv_buffer`` writes a token iff ``j < commit_lens[i]``; the rest write nothing. Every case runs
# on a fused pool and a reference pool, with all buffers poisoned first, and the two must agree byte
# for byte with each other and with an expected buffer built here from ``quantize`` row by row.
# K is [T, H, D] with the bad-input cases' H and D; V is [T, H, VERIFY_DV].


# A pool of 21 rows, two layers; layer 1 is written, layer 0 must stay poisoned. K [T, 2, 8], V [T, 2, 4].
VERIFY_DV = 4
VERIFY_SIZE, VERIFY_PAGE = 20, 1
VERIFY_ROWS = VERIFY_SIZE + VERIFY_PAGE  # 21 rows per buffer
VERIFY_LAYERS = 2
VERIFY_LAYER = 1


def _verify_pool(dtype, fused, **kw) -> MHATokenToKVPool:
    pool = MHATokenToKVPool(VERIFY_SIZE, VERIFY_PAGE, dtype, H, D, VERIFY_LAYERS, DEVICE, v_head_dim=VERIFY_DV, fused=fused, warmup=False, **kw)
    return poison_pool_(pool)


def _buffer_bits(pool) -> list[torch.Tensor]:
    return [bits(b).clone() for b in pool.k_buffer + pool.v_buffer]


def _assert_buffers_unchanged(pool, snapshot, what) -> None:
    for i, (b, s) in enumerate(zip(pool.k_buffer + pool.v_buffer, snapshot)):
        assert torch.equal(bits(b), s), f"{what}: buffer {i} changed"


def _verify_rows(t, heads, dim, dtype, seed):
    """Values with a wide magnitude range and the specials (NaN, +-inf, +-0, overflow)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, heads, dim, generator=g) * torch.exp2(torch.randint(-12, 12, (t, heads, dim), generator=g).float())
    flat = x.view(-1)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e5, -600.0])
    flat[: min(flat.numel(), 6)] = specials[: min(flat.numel(), 6)]
    return x.to(dtype).to(DEVICE)


def _verify_qkv_slice(t, heads, dim, dtype, seed):
    """[t, heads, dim] as a strided view (the V part of a fused projection)."""
    wide = _verify_rows(t, 3 * heads, dim, dtype, seed)
    return wide[:, heads : 2 * heads]


def _loc_layout(loc: list[list[int]], layout: str, dtype) -> torch.Tensor:
    """``loc`` [bs, width] as a tensor with the given memory layout (same logical values)."""
    t = torch.tensor(loc, dtype=dtype, device=DEVICE).reshape(len(loc), -1)
    bs, width = t.shape
    if layout == "slice":  # rows of a bigger table: stride (width + 5, 1), offset
        big = torch.full((bs + 2, width + 5), -77, dtype=dtype, device=DEVICE)
        big[1 : 1 + bs, 2 : 2 + width] = t
        out = big[1 : 1 + bs, 2 : 2 + width]
    elif layout == "transposed":  # stride (1, bs)
        out = t.t().contiguous().t()
    elif layout == "every_other_column":  # stride (2 * width, 2)
        big = torch.full((bs, 2 * width), -77, dtype=dtype, device=DEVICE)
        big[:, ::2] = t
        out = big[:, ::2]
    else:
        out = t
    assert torch.equal(out, t)
    assert layout == "contiguous" or not out.is_contiguous() or min(out.shape) <= 1
    return out


def _verify_expected(dtype, loc, commit, k, v, ks, vs):
    """Poisoned buffers of one layer with the committed, in-range tokens written row by row."""
    ek = poison_(torch.empty(VERIFY_ROWS, H, D, dtype=dtype, device=DEVICE))
    ev = poison_(torch.empty(VERIFY_ROWS, H, VERIFY_DV, dtype=dtype, device=DEVICE))
    width = len(loc[0]) if loc else 0
    for i, row in enumerate(loc):
        for j, slot in enumerate(row):
            t = i * width + j
            if j < commit[i] and 0 <= slot < VERIFY_ROWS:
                ek[slot] = quantize(k[t : t + 1], dtype, ks)[0]
                ev[slot] = quantize(v[t : t + 1], dtype, vs)[0]
    return ek, ev


def _verify_check(dtype, loc, commit, loc_t, commit_t, k, v, ks, vs) -> None:
    """Fused pool, reference pool, the explicit expectation, and set_kv_buffer of just the
    committed tokens must all hold the same bytes."""
    pools = {fused: _verify_pool(dtype, fused) for fused in ("always", "never")}
    for pool in pools.values():
        pool.set_kv_buffer_prefix_valid(None, loc_t, commit_t, k, v, ks, vs, layer_id_override=VERIFY_LAYER)
    assert_pools_equal(pools["always"], pools["never"], "fused vs reference", range(VERIFY_LAYERS))
    ek, ev = _verify_expected(dtype, loc, commit, k, v, ks, vs)
    assert_same_bytes(pools["never"].get_key_buffer(VERIFY_LAYER), ek, "K vs expected rows")
    assert_same_bytes(pools["never"].get_value_buffer(VERIFY_LAYER), ev, "V vs expected rows")
    # The same write as a plain set_kv_buffer of the committed tokens only.
    width = len(loc[0]) if loc else 0
    kept = [i * width + j for i, row in enumerate(loc) for j in range(width) if j < commit[i]]
    plain = _verify_pool(dtype, "never")
    idx = torch.tensor(kept, dtype=torch.int64, device=DEVICE)
    flat = torch.tensor([s for row in loc for s in row] or [0], dtype=torch.int64, device=DEVICE)[idx]
    plain.set_kv_buffer(None, flat, k[idx], v[idx], ks, vs, layer_id_override=VERIFY_LAYER)
    assert_pools_equal(plain, pools["never"], "set_kv_buffer of the committed tokens vs verify write", range(VERIFY_LAYERS))
    assert pools["always"].stats.fused_calls == 1 and pools["never"].stats.reference_calls == 1


# --- properties ------------------------------------------------------------------------------------


@st.composite
def verify_writes(draw):
    bs = draw(st.integers(0, 4))
    width = draw(st.integers(0, 4))
    loc_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    commit_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    # In-range slots are distinct (which duplicate wins is unspecified); padding and
    # out-of-range slots may repeat.
    in_range = draw(st.permutations(range(VERIFY_ROWS)))
    big = 2**31 - 1 if loc_dtype == torch.int32 else 2**40
    loc = []
    for i in range(bs):
        row = []
        for j in range(width):
            kind = draw(st.sampled_from(["slot", "slot", "slot", "negative", "out_of_range"]))
            if kind == "slot":
                row.append(in_range[i * width + j])
            elif kind == "negative":
                row.append(draw(st.sampled_from([-1, -5, -(2**31)])))
            else:
                row.append(draw(st.sampled_from([VERIFY_ROWS, VERIFY_ROWS + 3, big])))
        loc.append(row)
    commit = [draw(st.integers(-2, width + 2)) for _ in range(bs)]
    return dict(
        bs=bs, width=width, loc=loc, commit=commit, loc_dtype=loc_dtype, commit_dtype=commit_dtype,
        layout=draw(st.sampled_from(["contiguous", "slice", "transposed", "every_other_column"])),
        cache_dtype=draw(st.sampled_from([torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16])),
        in_dtype=draw(st.sampled_from([torch.bfloat16, torch.float32])),
        k_scale=draw(st.sampled_from(["none", "float", "tensor", "per_head"])),
        v_scale=draw(st.sampled_from(["none", "float", "tensor", "per_head"])),
        seed=draw(st.integers(0, 2**16)),
    )  # fmt: skip


@fused_runs
@given(verify_writes())
def test_verify_write_property(case):
    bs, width = case["bs"], case["width"]
    t = bs * width
    loc_t = (
        _loc_layout(case["loc"], case["layout"], case["loc_dtype"])
        if bs and width
        else torch.empty(bs, width, dtype=case["loc_dtype"], device=DEVICE)
    )
    commit_t = torch.tensor(case["commit"], dtype=case["commit_dtype"], device=DEVICE)
    k = _verify_rows(t, H, D, case["in_dtype"], case["seed"])
    v = _verify_qkv_slice(t, H, VERIFY_DV, case["in_dtype"], case["seed"] + 1)
    ks, vs = scale_of(case["k_scale"], H, case["seed"]), scale_of(case["v_scale"], H, case["seed"] + 2)
    if t == 0:
        for fused in ("always", "never"):
            pool = _verify_pool(case["cache_dtype"], fused)
            before = _buffer_bits(pool)
            pool.set_kv_buffer_prefix_valid(None, loc_t, commit_t, k, v, ks, vs, layer_id_override=VERIFY_LAYER)
            _assert_buffers_unchanged(pool, before, f"empty verify write ({bs}x{width})")
        return
    _verify_check(case["cache_dtype"], case["loc"], case["commit"], loc_t, commit_t, k, v, ks, vs)


# --- deliberate cases ------------------------------------------------------------------------------


@fused_runs
@pytest.mark.parametrize("layout", ["contiguous", "slice", "transposed"])
@pytest.mark.parametrize("commit_dtype", [torch.int32, torch.int64], ids=id_of)
@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64], ids=id_of)
def test_commit_lengths_at_and_beyond_the_edges(loc_dtype, commit_dtype, layout):
    """commit_lens 0, width, negative, beyond width and in between, in one batch of 5 requests."""
    width = 3
    loc = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12], [13, -1, VERIFY_ROWS + 1]]
    commit = [0, width, -1, width + 4, 2]
    k = _verify_rows(15, H, D, torch.bfloat16, 1)
    v = _verify_rows(15, H, VERIFY_DV, torch.bfloat16, 2)
    loc_t = _loc_layout(loc, layout, loc_dtype)
    commit_t = torch.tensor(commit, dtype=commit_dtype, device=DEVICE)
    _verify_check(torch.float8_e4m3fn, loc, commit, loc_t, commit_t, k, v, 0.5, torch.tensor([3.0], device=DEVICE))
    # slots 1-3 (commit 0), 7-9 (negative commit) and all others never named stay poisoned
    pool = _verify_pool(torch.float8_e4m3fn, "always")
    pool.set_kv_buffer_prefix_valid(None, loc_t, commit_t, k, v, 0.5, None, layer_id_override=VERIFY_LAYER)
    untouched = [0, 1, 2, 3, 7, 8, 9, 14, *range(15, VERIFY_ROWS)]
    assert (bits(pool.get_key_buffer(VERIFY_LAYER))[untouched] == 0xFF).all()
    assert not (bits(pool.get_key_buffer(VERIFY_LAYER))[[4, 5, 6, 10, 11, 12, 13]] == 0xFF).all(dim=(1, 2)).any()


@fused_runs
def test_verify_write_on_the_flat_plan_geometry_with_qkv_slices():
    """A geometry whose launcher takes the flat plan (H=3, D=96) and inputs sliced out of a fused
    projection: the prefix mask must hold for every block of the row."""
    h, d = 3, 96
    loc = [[3, 9, 4], [7, 1, 12]]
    commit = torch.tensor([2, 1], device=DEVICE)
    loc_t = torch.tensor(loc, device=DEVICE)
    wide = _verify_rows(6, 3 * h, d, torch.bfloat16, 5)
    k, v = wide[:, h : 2 * h], wide[:, 2 * h :]
    pools = {}
    for fused in ("always", "never"):
        pool = MHATokenToKVPool(16, 1, torch.float8_e4m3fn, h, d, 1, DEVICE, fused=fused, warmup=False)
        poison_pool_(pool)
        pool.set_kv_buffer_prefix_valid(None, loc_t, commit, k, v, 0.3, 0.7, layer_id_override=0)
        pools[fused] = pool
    assert pools["always"]._writer.plan((h * d, d, 1), (h * d, d, 1), (1, 1), False, 6).row_view  # a row plan exists
    for a, b in zip(pools["always"].get_kv_buffer(0), pools["never"].get_kv_buffer(0)):
        assert_same_bytes(a, b, "flat plan")
    written = {3, 9, 7}
    k_bits = bits(pools["always"].get_key_buffer(0))
    for slot in range(17):
        assert (k_bits[slot] == 0xFF).all() == (slot not in written), slot


@fused_runs
def test_commit_lens_is_read_when_the_write_runs():
    """Changing commit_lens in place between two writes changes what the second one writes (the
    kernel reads it on the device; nothing is cached from the first call)."""
    pool = _verify_pool(torch.bfloat16, "always")
    ref = _verify_pool(torch.bfloat16, "never")
    loc = torch.tensor([[1, 2], [3, 4]], device=DEVICE)
    commit = torch.tensor([0, 0], device=DEVICE)
    k = _verify_rows(4, H, D, torch.float32, 3)
    v = _verify_rows(4, H, VERIFY_DV, torch.float32, 4)
    ever = set()
    for lens, slots in (([0, 0], set()), ([1, 2], {1, 3, 4}), ([2, 0], {1, 2})):
        commit.copy_(torch.tensor(lens))
        for p in (pool, ref):
            p.set_kv_buffer_prefix_valid(None, loc, commit, k * (lens[0] + 1), v, layer_id_override=0)
        assert_pools_equal(pool, ref, f"commit_lens {lens}", range(VERIFY_LAYERS))
        ever |= slots
        for slot in (1, 2, 3, 4):
            poisoned = bool((bits(pool.get_key_buffer(0))[slot] == -1).all())
            assert poisoned == (slot not in ever), (lens, slot)


# --- bad input -------------------------------------------------------------------------------------

def _verify_base():
    return dict(
        layer=None,
        loc_2d=torch.tensor([[1, 2, 3], [4, 5, 6]], device=DEVICE),
        commit_lens=torch.tensor([2, 3], device=DEVICE, dtype=torch.int32),
        cache_k=torch.randn(6, H, D, device=DEVICE),
        cache_v=torch.randn(6, H, VERIFY_DV, device=DEVICE),
        k_scale=0.5,
        v_scale=None,
        layer_id_override=VERIFY_LAYER,
    )


VERIFY_BAD = {
    "loc_2d 1-D": (dict(loc_2d=torch.arange(1, 7)), ValueError, r"loc_2d must be 2-D \[bs, width\], got shape \(6,\)"),
    "loc_2d 3-D": (dict(loc_2d=torch.ones(2, 3, 1, dtype=torch.long)), ValueError, r"loc_2d must be 2-D \[bs, width\], got shape \(2, 3, 1\)"),
    "loc_2d bs*width != T": (dict(loc_2d=torch.ones(3, 3, dtype=torch.long)), ValueError, r"loc_2d must have bs \* width = T = 6 entries.*got shape \(3, 3\)"),
    "loc_2d float": (dict(loc_2d=torch.ones(2, 3)), ValueError, r"loc_2d must be int32 or int64, got torch.float32"),
    "loc_2d list": (dict(loc_2d=[[1, 2, 3], [4, 5, 6]]), TypeError, r"loc_2d must be a torch.Tensor, got list"),
    "loc_2d other device": (dict(loc_2d=torch.ones(2, 3, dtype=torch.long, device=META)), ValueError, rf"loc_2d must be on {DEVICE}.*got meta"),
    "commit_lens too long": (dict(commit_lens=torch.tensor([1, 1, 1])), ValueError, r"commit_lens must be 1-D \[bs\] with bs = 2 \(one per row of loc_2d\), got shape \(3,\)"),
    "commit_lens 2-D": (dict(commit_lens=torch.tensor([[1], [1]])), ValueError, r"commit_lens must be 1-D \[bs\] with bs = 2.*got shape \(2, 1\)"),
    "commit_lens 0-d": (dict(commit_lens=torch.tensor(2)), ValueError, r"commit_lens must be 1-D \[bs\] with bs = 2.*got shape \(\)"),
    "commit_lens float": (dict(commit_lens=torch.tensor([1.0, 2.0])), ValueError, r"commit_lens must be int32 or int64, got torch.float32"),
    "commit_lens bool": (dict(commit_lens=torch.tensor([True, False])), ValueError, r"commit_lens must be int32 or int64, got torch.bool"),
    "commit_lens int16": (dict(commit_lens=torch.tensor([1, 2], dtype=torch.int16)), ValueError, r"commit_lens must be int32 or int64, got torch.int16"),
    "commit_lens other device": (dict(commit_lens=torch.tensor([1, 2], device=META)), ValueError, rf"commit_lens must be on {DEVICE}.*got meta"),
    "commit_lens list": (dict(commit_lens=[2, 3]), TypeError, r"commit_lens must be a torch.Tensor, got list"),
    "commit_lens None": (dict(commit_lens=None), TypeError, r"commit_lens must be a torch.Tensor, got NoneType"),
    "cache_v T differs": (dict(cache_v=torch.randn(5, H, VERIFY_DV)), ValueError, r"cache_v must have T=6 tokens like cache_k, got 5"),
    "cache_k heads": (dict(cache_k=torch.randn(6, H + 1, D)), ValueError, r"cache_k must have 2 heads \(shape\[1\]\), got 3"),
    "cache_v head dim": (dict(cache_v=torch.randn(6, H, D)), ValueError, r"cache_v must have head dim 4 \(shape\[2\]\), got 8"),
    "cache_k int": (dict(cache_k=torch.ones(6, H, D, dtype=torch.int32)), ValueError, r"cache_k must be bfloat16, float16 or float32, got torch.int32"),
    "cache_k 2-D": (dict(cache_k=torch.randn(6, H * D)), ValueError, r"cache_k must be 3-D"),
    "k_scale negative": (dict(k_scale=-1.0), ValueError, r"k_scale must be a positive finite float.*got -1.0"),
    "v_scale shape": (dict(v_scale=torch.ones(3)), ValueError, r"v_scale must have one element \(per tensor\) or shape \[2\].*got shape \(3,\)"),
    "layer outside": (dict(layer_id_override=VERIFY_LAYERS), IndexError, rf"layer_id {VERIFY_LAYERS} is outside this pool's layers"),
    "no layer": (dict(layer_id_override=None), TypeError, r"layer_id_override"),
}  # fmt: skip


def _to_device(value):
    if isinstance(value, torch.Tensor) and value.device.type == "cpu" and DEVICE != "cpu":
        return value.to(DEVICE)
    return value


@fused_runs
@pytest.mark.parametrize("fused", ["always", "never"])
@pytest.mark.parametrize("case", list(VERIFY_BAD))
def test_verify_write_bad_input_raises_naming_the_argument_and_writes_nothing(case, fused):
    change, exc, message = VERIFY_BAD[case]
    pool = _verify_pool(torch.float8_e4m3fn, fused)
    args = _verify_base()
    args.update({name: _to_device(value) for name, value in change.items()})
    before = _buffer_bits(pool)
    with pytest.raises(exc, match=message):
        pool.set_kv_buffer_prefix_valid(**args)
    _assert_buffers_unchanged(pool, before, case)
    assert pool.stats.fused_calls == pool.stats.reference_calls == 0


# --- validate mode ---------------------------------------------------------------------------------

VALIDATE_BAD = {
    "commit_lens negative": ([[1, 2, 3], [4, 5, 6]], [-1, 3], ValueError, r"commit_lens\[0\] must be in 0..3 \(the width of loc_2d\), got -1"),
    "commit_lens beyond width": ([[1, 2, 3], [4, 5, 6]], [2, 4], ValueError, r"commit_lens\[1\] must be in 0..3 .*got 4"),
    "committed slot = rows": ([[1, 2, 3], [4, VERIFY_ROWS, 6]], [3, 2], IndexError, rf"loc_2d\[1, 1\] = {VERIFY_ROWS} is out of range: slots are 0..{VERIFY_ROWS - 1}"),
    "committed slot huge": ([[1, 2, 2**40], [4, 5, 6]], [3, 0], IndexError, rf"loc_2d\[0, 2\] = {2**40} is out of range"),
}  # fmt: skip


@fused_runs
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("fused", ["always", "never"])
@pytest.mark.parametrize("case", list(VALIDATE_BAD))
def test_verify_write_validate_rejects_bad_values_before_writing(case, fused, layout):
    loc, commit, exc, message = VALIDATE_BAD[case]
    pool = _verify_pool(torch.float8_e4m3fn, fused, validate=True)
    args = _verify_base()
    args.update(loc_2d=_loc_layout(loc, layout, torch.int64), commit_lens=torch.tensor(commit, device=DEVICE))
    before = _buffer_bits(pool)
    with pytest.raises(exc, match=message):
        pool.set_kv_buffer_prefix_valid(**args)
    _assert_buffers_unchanged(pool, before, case)


@fused_runs
@pytest.mark.parametrize("fused", ["always", "never"])
def test_verify_write_validate_accepts_uncommitted_out_of_range_and_committed_padding(fused):
    """Out-of-range slots that are not committed are never written, so validate lets them be;
    a committed negative slot is padding."""
    loc = [[1, 2, VERIFY_ROWS + 7], [-1, 5, 2**40]]
    commit = [2, 2]
    pool = _verify_pool(torch.float8_e4m3fn, fused, validate=True)
    args = _verify_base()
    args.update(loc_2d=_loc_layout(loc, "slice", torch.int64), commit_lens=torch.tensor(commit, device=DEVICE))
    pool.set_kv_buffer_prefix_valid(**args)
    ek, ev = _verify_expected(torch.float8_e4m3fn, loc, commit, args["cache_k"], args["cache_v"], 0.5, None)
    assert_same_bytes(pool.get_key_buffer(VERIFY_LAYER), ek, "K")
    assert_same_bytes(pool.get_value_buffer(VERIFY_LAYER), ev, "V")


@fused_runs
def test_verify_write_validate_checks_scale_tensor_values():
    pool = _verify_pool(torch.float8_e4m3fn, "never", validate=True)
    args = _verify_base()
    args.update(v_scale=torch.tensor([0.0], device=DEVICE))
    before = _buffer_bits(pool)
    with pytest.raises(ValueError, match=r"v_scale must hold positive finite normal float32 values, got 0.0"):
        pool.set_kv_buffer_prefix_valid(**args)
    _assert_buffers_unchanged(pool, before, "zero v_scale")


# On CUDA: real shapes, CUDA graphs, no synchronisation, no allocation, the compiled variants.


def _verify_inputs(bs, width, loc_dtype, commit_dtype, layout, seed):
    """loc_2d [bs, width] in the given layout (distinct in-range slots, some padding, some out of
    range), commit_lens [bs] covering 0, width, negative, beyond width and random values."""
    g = cuda_gen(seed)
    t = bs * width
    loc = torch.randperm(CUDA_ROWS, device="cuda", generator=g)[:t].reshape(bs, width)
    loc[5, 1], loc[6, 0], loc[7, width - 1] = -1, CUDA_ROWS, CUDA_ROWS + 100
    loc[8, 0] = 2**31 - 1 if loc_dtype == torch.int32 else 2**40
    loc = loc.to(loc_dtype)
    if layout == "slice":
        big = torch.full((bs + 3, width + 7), -5, dtype=loc_dtype, device="cuda")
        big[2 : 2 + bs, 3 : 3 + width] = loc
        loc_2d = big[2 : 2 + bs, 3 : 3 + width]
    elif layout == "transposed":
        loc_2d = loc.t().contiguous().t()
    else:
        loc_2d = loc
    assert torch.equal(loc_2d, loc)
    commit = torch.randint(-2, width + 3, (bs,), device="cuda", generator=g)
    commit[:4] = torch.tensor([0, width, -1, width + 5], device="cuda")
    commit[5:9] = width  # the rows holding padding and out-of-range slots are committed
    return loc_2d, commit.to(commit_dtype)


@gpu
@pytest.mark.parametrize("scale_kind", ["none", "float", "tensor", "per_head"])
@pytest.mark.parametrize("cache_dtype", FP8 + [torch.bfloat16], ids=id_of)
def test_verify_write_matches_reference_and_the_plain_write(cache_dtype, scale_kind):
    fused, ref, plain = cuda_pool(cache_dtype), cuda_pool(cache_dtype, "never"), cuda_pool(cache_dtype, "never")
    bs, width = 64, 8
    i32, i64 = torch.int32, torch.int64
    cases = [("contiguous", i64, i64), ("slice", i32, i32), ("transposed", i64, i32), ("slice", i64, i64), ("transposed", i32, i64)]
    for n, (layout, loc_dtype, commit_dtype) in enumerate(cases):
        what = f"{layout} loc {id_of(loc_dtype)} commit {id_of(commit_dtype)}"
        for pool in (fused, ref, plain):
            for buf in pool.k_buffer + pool.v_buffer:
                poison_(buf)
        loc_2d, commit = _verify_inputs(bs, width, loc_dtype, commit_dtype, layout, seed=n)
        qkv = cuda_values((bs * width, 6 * CUDA_H, CUDA_D), torch.bfloat16, seed=100 + n)
        k, v = qkv[:, 4 * CUDA_H : 5 * CUDA_H], qkv[:, 5 * CUDA_H :]  # strided views of a fused projection
        ks, vs = cuda_scale(scale_kind, CUDA_H), cuda_scale(scale_kind, CUDA_H)
        for pool in (fused, ref):
            pool.set_kv_buffer_prefix_valid(None, loc_2d, commit, k, v, ks, vs, layer_id_override=1)
        assert_pools_equal(fused, ref, f"{what}: fused vs reference", (0, 1))
        idx, slots = committed_tokens(loc_2d, commit)
        plain.set_kv_buffer(None, slots, k[idx], v[idx], ks, vs, layer_id_override=1)
        assert_pools_equal(plain, ref, f"{what}: verify write vs set_kv_buffer of the committed tokens", (0, 1))
        written = torch.zeros(CUDA_ROWS, dtype=torch.bool, device="cuda")
        written[slots[(slots >= 0) & (slots < CUDA_ROWS)]] = True
        untouched = bits(fused.get_key_buffer(1))[~written]
        assert (untouched == (0xFF if cache_dtype.itemsize == 1 else -1)).all(), f"{what}: a row not committed changed"
    assert fused.stats.fused_calls == len(cases) and fused.stats.reference_calls == 0


@gpu
def test_verify_writes_alternating_commit_lens_dtypes_on_one_pool():
    """The same loc_2d and inputs with commit_lens int32, then int64, then back: each call is a
    direct launch after the first of its kind, and must launch the variant compiled for its
    commit_lens type (an int64 [3, 1] read as int32 is [3, 0])."""
    pool, ref = cuda_pool(), cuda_pool(fused="never")
    bs, width = 32, 4
    loc_2d = torch.randperm(CUDA_ROWS, device="cuda")[: bs * width].reshape(bs, width)
    g = cuda_gen(8)
    for step, dtype in enumerate([torch.int32, torch.int64, torch.int32, torch.int64, torch.int64, torch.int32]):
        commit = torch.randint(0, width + 1, (bs,), device="cuda", generator=g).to(dtype)
        x = cuda_values((bs * width, CUDA_H, CUDA_D), torch.bfloat16, 200 + step)
        for p in (pool, ref):
            p.set_kv_buffer_prefix_valid(None, loc_2d, commit, x, x, 0.5, 0.5, layer_id_override=0)
        torch.cuda.synchronize()
        assert_pools_equal(pool, ref, f"step {step}: commit_lens {id_of(dtype)}", (0,))


@gpu
def test_verify_write_in_a_cuda_graph_reads_commit_lens_on_replay():
    pool, ref = cuda_pool(), cuda_pool(fused="never")
    bs, width = 16, 4
    static_loc = torch.randperm(CUDA_ROWS, device="cuda")[: bs * width].reshape(bs, width)
    static_commit = torch.zeros(bs, dtype=torch.int32, device="cuda")
    static_k = cuda_values((bs * width, CUDA_H, CUDA_D), torch.bfloat16, 1)
    static_v = cuda_values((bs * width, CUDA_H, CUDA_D), torch.bfloat16, 2)
    k_scale = torch.tensor([0.5], device="cuda")
    # compile the variant outside the capture (commit_lens all 0: writes nothing)
    pool.set_kv_buffer_prefix_valid(None, static_loc, static_commit, static_k, static_v, k_scale, 2.0, layer_id_override=1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pool.set_kv_buffer_prefix_valid(None, static_loc, static_commit, static_k, static_v, k_scale, 2.0, layer_id_override=1)
    g = cuda_gen(3)
    for step in range(5):
        if step == 2:
            static_commit.zero_()  # a replay that commits nothing
        else:
            static_commit.copy_(torch.randint(-1, width + 2, (bs,), device="cuda", generator=g).int())
        static_loc.copy_(torch.randperm(CUDA_ROWS, device="cuda", generator=g)[: bs * width].reshape(bs, width))
        static_loc[0, 0] = -1
        static_k.copy_(cuda_values((bs * width, CUDA_H, CUDA_D), torch.bfloat16, 10 + step))
        static_v.copy_(cuda_values((bs * width, CUDA_H, CUDA_D), torch.bfloat16, 20 + step))
        k_scale.fill_([0.37, 1e-3, 7.0, 3.3, 0.9][step])
        graph.replay()
        ref.set_kv_buffer_prefix_valid(None, static_loc, static_commit, static_k, static_v, k_scale, 2.0, layer_id_override=1)
        torch.cuda.synchronize()
        assert_pools_equal(pool, ref, f"replay {step}", (1,))


def _sync_free(calls, what):
    try:
        with no_sync():
            for _ in range(3):
                for call in calls:
                    call()
    except RuntimeError as exc:
        raise AssertionError(f"{what}: a call synchronised: {exc}") from exc


@gpu
def test_verify_and_observing_writes_neither_synchronise_nor_allocate_on_the_fused_path():
    plain, observing = cuda_pool(), cuda_pool(observe_amax=True)
    t = 96
    x = cuda_values((t, CUDA_H, CUDA_D), torch.bfloat16, 4)
    qkv = cuda_values((t, 6 * CUDA_H, CUDA_D), torch.float16, 5)
    loc_2d = torch.randperm(CUDA_ROWS, device="cuda")[:t].reshape(12, 8)
    loc_t = loc_2d.int().t().contiguous().t()  # int32, transposed layout
    loc_flat, loc_t_flat = loc_2d.reshape(-1), loc_t.reshape(-1)  # made here: a call must not allocate
    commit = torch.randint(0, 9, (12,), device="cuda", dtype=torch.int32)
    commit64 = commit.long()
    k16, v16 = qkv[:, 32:40], qkv[:, 40:48]
    scale = torch.tensor([0.37], device="cuda")
    calls = [
        lambda: plain.set_kv_buffer_prefix_valid(None, loc_2d, commit, x, x, scale, scale, layer_id_override=0),
        lambda: plain.set_kv_buffer_prefix_valid(None, loc_t, commit64, k16, v16, 0.5, None, layer_id_override=1),
        lambda: observing.set_kv_buffer(None, loc_flat, x, x, scale, 0.25, layer_id_override=0),
        lambda: observing.set_kv_buffer(None, loc_t_flat, k16, v16, None, None, layer_id_override=1),
        lambda: observing.set_kv_buffer_prefix_valid(None, loc_2d, commit, x, x, 0.5, scale, layer_id_override=1),
    ]
    for call in calls:
        call()  # first call of each variant outside the measurement
    torch.cuda.synchronize()
    allocs_before = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
    _sync_free(calls, "fused path")
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats().get("allocation.all.allocated", 0) == allocs_before, "a fused write allocated"
    assert plain.stats.reference_calls == observing.stats.reference_calls == 0
    assert plain.stats.fused_calls == 8 and observing.stats.fused_calls == 12


@gpu
def test_verify_and_observing_writes_never_synchronise_on_the_reference_path():
    pool = cuda_pool(fused="never", observe_amax=True)
    x = cuda_values((96, CUDA_H, CUDA_D), torch.bfloat16, 6)
    loc_2d = torch.randperm(CUDA_ROWS, device="cuda")[:96].reshape(12, 8)
    loc_2d[0, 0] = CUDA_ROWS + 3
    commit = torch.randint(-1, 10, (12,), device="cuda", dtype=torch.int32)
    scale = torch.tensor([0.37], device="cuda")
    loc_flat = loc_2d.reshape(-1)
    calls = [
        lambda: pool.set_kv_buffer_prefix_valid(None, loc_2d, commit, x, x, scale, 0.5, layer_id_override=0),
        lambda: pool.set_kv_buffer(None, loc_flat, x, x, 0.25, scale, layer_id_override=1),
    ]
    for call in calls:
        call()
    _sync_free(calls, "reference path")
    assert pool.stats.reference_calls == 8
