"""The write's compiled kernel on CUDA, on real shapes (skipped without a CUDA device).

The grid of head counts and head dims, 16- and 32-bit pools, edge values and every bf16 and fp16 bit
pattern on each kernel variant, random float32 bit patterns, the guard rows around out-of-range
slots, and a fused call that allocates nothing and never synchronises. Every comparison is byte for
byte (NaN: both NaN).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kvassert import (
    FP8,
    INPUT_DTYPES,
    assert_same_bytes,
    bits,
    cuda_gen,
    cuda_pool,
    cuda_scale,
    cuda_values,
    gpu,
    id_of,
    no_sync,
    poison_,
)
from kvpool import fused_fp8_set_kv_buffer, reference_set_kv_buffer
from kvpool.config import KernelOptions
from kvpool.kernels.store_kv.op import launch_store_kv

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy inside Triton's interpreter


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
