"""GPU tests: the compiled kernel against the reference on the device (skipped without CUDA).

Run on the device machine by scripts/gpu_check.sh. Every comparison is byte for byte (NaN: both NaN).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import triton
import triton.language as tl

from kvassert import assert_same_bytes, bits, compiled_variants, poison_
from kvpool.kernels.tuning import SMALL_TOKENS
from kvpool import MHATokenToKVPool, fused_fp8_set_kv_buffer, reference_set_kv_buffer
from kvpool.kernels import store_kv_kernel
from kvpool.config import KernelOptions
from kvpool.kernels.store_kv_op import launch_store_kv

pytestmark = pytest.mark.gpu

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
INPUTS = [torch.bfloat16, torch.float16, torch.float32]
DEV = "cuda"


def _name(x) -> str:
    return str(x).replace("torch.", "")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def _wide_rows(t: int, h: int, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values over ~2^-24..2^14, so overflow, normals and subnormals of both formats occur."""
    g = _gen(seed)
    x = torch.randn(t, h, d, device=DEV, generator=g)
    x = x * torch.exp2(torch.randint(-24, 14, (t, h, d), device=DEV, generator=g).float())
    return x.to(dtype)


def _qkv_slices(t, h, d, dtype, seed):
    """K and V as strided views of a fused QKV projection (4 query heads per KV head)."""
    qkv = _wide_rows(t, 6 * h, d, dtype, seed)
    return qkv[:, 4 * h : 5 * h], qkv[:, 5 * h :]


def _scale(kind, heads):
    return {
        "none": None,
        "float": 0.37,
        "tensor": torch.tensor([3.3], device=DEV),
        "per_head": torch.linspace(0.05, 7.0, heads, device=DEV),
    }[kind]


def _compare(k, v, loc, ks, vs, slots, cache_dtype, what, **launch):
    h, d, hv, dv = k.shape[1], k.shape[2], v.shape[1], v.shape[2]
    kf = poison_(torch.empty(slots, h, d, dtype=cache_dtype, device=DEV))
    vf = poison_(torch.empty(slots, hv, dv, dtype=cache_dtype, device=DEV))
    kr, vr = kf.clone(), vf.clone()
    if launch:
        launch_store_kv(k, v, kf, vf, loc, ks, vs, **launch)
    else:
        fused_fp8_set_kv_buffer(k, v, kf, vf, loc, ks, vs)
    reference_set_kv_buffer(k, v, kr, vr, loc, ks, vs)
    assert_same_bytes(kf, kr, f"{what} k_cache")
    assert_same_bytes(vf, vr, f"{what} v_cache")


@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("h", [1, 3, 8])
@pytest.mark.parametrize("cache_dtype", FP8, ids=_name)
def test_grid_matches_reference(cache_dtype, h, d):
    slots = 5000
    # bf16 inputs with every scale kind; fp16/fp32 inputs with per-head scales (fewer compiled variants)
    combos = [(torch.bfloat16, kind) for kind in ("none", "float", "tensor", "per_head")]
    combos += [(torch.float16, "per_head"), (torch.float32, "per_head")]
    for t, (in_dtype, scale_kind) in itertools.product([0, 1, 7, 128, 4096], combos):
        k, v = _qkv_slices(t, h, d, in_dtype, seed=t * 31 + h * 7 + d)
        loc = torch.randperm(slots, device=DEV)[:t]
        if t > 3:
            loc[0], loc[2] = -1, slots + 17
        ks, vs = _scale(scale_kind, h), _scale(scale_kind, h)
        _compare(k, v, loc, ks, vs, slots, cache_dtype, f"T={t} {in_dtype} scale={scale_kind}")


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=_name)
@pytest.mark.parametrize("in_dtype", INPUTS, ids=_name)
def test_16_and_32_bit_pools_match_reference(cache_dtype, in_dtype):
    k, v = _qkv_slices(1000, 8, 128, in_dtype, seed=1)
    loc = torch.randperm(3000, device=DEV)[:1000].to(torch.int32)
    _compare(k, v, loc, 0.37, None, 3000, cache_dtype, "16-bit pool")


EDGES = [0.0, -0.0, 448.0, 449.0, 464.0, 465.0, 480.0, -448.0, -465.0, 57344.0, 61440.0, 1e6, -1e30,
         float("inf"), -float("inf"), float("nan"), 1.0625, 1.1875, 1.97, -1.97, 2.0**-6, 2.0**-7,
         2.0**-9, 2.0**-10, 3 * 2.0**-10, 2.0**-14, 2.0**-16, 2.0**-17, 3 * 2.0**-17, -(2.0**-17),
         1e-40, -1e-40, 65504.0, 3.0e38]  # fmt: skip


# The kernel's code paths: hardware cast with the reciprocal-and-FMA division (the default on
# sm_89+), hardware cast with div.rn, and the integer encoder with div.rn (interpreter, AMD, sm_80).
VARIANTS = {
    "native-fastdiv": dict(options=KernelOptions(soft_cast=False, fast_div=True)),
    "native-divrn": dict(options=KernelOptions(soft_cast=False, fast_div=False)),
    "soft-divrn": dict(options=KernelOptions(soft_cast=True, fast_div=False)),
}
SCALES = (None, 0.37, 2.0**-7, 3.3, 1e-30, 1e30)  # the last two take div.rn even in fast-div builds


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("in_dtype", INPUTS, ids=_name)
@pytest.mark.parametrize("cache_dtype", FP8, ids=_name)
def test_edge_values(cache_dtype, in_dtype, variant):
    x = torch.tensor(EDGES, device=DEV).to(in_dtype).reshape(-1, 1, 1).expand(-1, 2, 64)
    loc = torch.arange(x.shape[0], device=DEV)
    for scale in SCALES + (torch.tensor([3.3], device=DEV), torch.tensor([0.01, 7.5], device=DEV)):
        _compare(x, x, loc, scale, scale, x.shape[0], cache_dtype, f"edges scale={scale}", **VARIANTS[variant])


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("cache_dtype", FP8 + [torch.bfloat16, torch.float16], ids=_name)
def test_every_bf16_and_fp16_bit_pattern(cache_dtype, variant):
    every = torch.arange(65536, dtype=torch.int32, device=DEV).to(torch.int16)
    loc = torch.arange(512, device=DEV)
    for in_dtype in (torch.bfloat16, torch.float16):
        x = every.view(in_dtype).reshape(512, 1, 128)
        for scale in SCALES + (torch.tensor([3.3], device=DEV),):
            _compare(x, x, loc, scale, None, 512, cache_dtype, f"{in_dtype} patterns scale={scale}", **VARIANTS[variant])


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("cache_dtype", FP8 + [torch.bfloat16, torch.float16], ids=_name)
def test_random_float32_bit_patterns(cache_dtype, variant):
    """4M random float32 bit patterns: every exponent, NaN payloads, subnormals."""
    g = _gen(7)
    raw = torch.randint(-(2**31), 2**31, (4096, 8, 128), device=DEV, generator=g, dtype=torch.int64)
    x = raw.to(torch.int32).view(torch.float32)
    loc = torch.randperm(4096, device=DEV, generator=g)
    for scale in (None, 0.37, 1e-30, torch.tensor([1e-3], device=DEV), torch.logspace(-6, 6, 8, device=DEV)):
        _compare(x, x, loc, scale, scale, 4096, cache_dtype, f"fp32 patterns scale={scale}", **VARIANTS[variant])


@triton.jit
def _divide_probe(x_ptr, s_ptr, out_ptr, BLOCK: tl.constexpr, FAST: tl.constexpr, SHARED: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    s = tl.load(s_ptr + tl.program_id(0))  # one scale per program, as the kernel reads a scale
    if SHARED:
        r = store_kv_kernel._reciprocal(s, store_kv_kernel.SCALE_TENSOR, FAST, True)
    else:
        r = s
    tl.store(out_ptr + offs, store_kv_kernel._divide_scalar(x, s, r, FAST, SHARED))


@pytest.mark.parametrize("shared", [False, True], ids=["reciprocal-per-tile", "reciprocal-shared"])
def test_fast_division_is_correctly_rounded_where_fp8_can_see_it(shared):
    """The reciprocal-and-FMA division against IEEE division (torch on the device), on 64M random
    (x, s) pairs: x any finite float32, s log-uniform over 2**-64..2**64 (the fast path takes
    2**-40..2**40, div.rn the rest). Quotients of magnitude 2**-20..2**17 (FP8 represents
    2**-16..57344) must match bit for bit; larger ones must stay above 2**17 (both saturate),
    smaller ones below 2**-19 (both round to zero); the sign always agrees, zeros included."""
    g = _gen(11)
    block = 1024
    for _ in range(4):
        n = 16 * 2**20
        x = torch.randint(-(2**31), 2**31, (n,), device=DEV, generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
        x = torch.where(torch.isfinite(x), x, torch.ones_like(x))
        x[:4096] = torch.tensor([0.0, -0.0, 2.0**64, -(2.0**70)], device=DEV).repeat(1024)
        mant = torch.rand(n // block, device=DEV, generator=g) + 1.0
        s = mant * torch.exp2(torch.randint(-64, 64, (n // block,), device=DEV, generator=g).float())
        out = torch.empty_like(x)
        _divide_probe[(n // block,)](x, s, out, BLOCK=block, FAST=True, SHARED=shared)
        ieee = x / s.repeat_interleave(block)
        mag = ieee.abs()
        visible = (mag >= 2.0**-20) & (mag <= 2.0**17)
        assert_same_bytes(torch.where(visible, out, 0.0), torch.where(visible, ieee, 0.0), "fast division")
        assert (out.abs()[mag > 2.0**17] > 2.0**17).all(), "a saturating quotient came out in range"
        assert (out.abs()[mag < 2.0**-20] < 2.0**-19).all(), "a vanishing quotient came out visible"
        assert torch.equal(torch.signbit(out), torch.signbit(ieee)), "sign differs"


def test_all_variants_agree_on_the_device():
    """The integer encoder and div.rn (the interpreter's path in CI) equal the hardware conversion
    and the reciprocal-and-FMA division, on 8M values."""
    g = _gen(3)
    x = _wide_rows(8192, 8, 128, torch.bfloat16, 3)
    loc = torch.randperm(8192, device=DEV, generator=g)
    for cache_dtype in FP8:
        out = {}
        for name, variant in VARIANTS.items():
            kc = poison_(torch.empty(8192, 8, 128, dtype=cache_dtype, device=DEV))
            launch_store_kv(x, x, kc, kc.clone(), loc, 0.37, None, **variant)
            out[name] = kc
        for name in VARIANTS:
            assert_same_bytes(out[name], out["soft-divrn"], f"{cache_dtype} {name} vs soft-divrn")


def test_out_of_range_and_negative_slots_leave_guard_rows_untouched():
    slots, guard, h, d = 1000, 64, 8, 128
    backing = poison_(torch.empty(slots + 2 * guard, h, d, dtype=torch.float8_e4m3fn, device=DEV))
    backing_v = poison_(torch.empty_like(backing))
    before, before_v = bits(backing).clone(), bits(backing_v).clone()
    t = 512
    loc = torch.randint(-(2**40), 2**40, (t,), device=DEV)  # almost all out of range
    loc[:100] = torch.randperm(slots, device=DEV)[:100]
    loc[100:120] = slots + torch.arange(20, device=DEV)
    loc[120:140] = -torch.arange(1, 21, device=DEV)
    k = _wide_rows(t, h, d, torch.bfloat16, 11)
    for loc_dtype in (torch.int64, torch.int32):
        fused_fp8_set_kv_buffer(k, k, backing[guard:-guard], backing_v[guard:-guard], loc.to(loc_dtype), 0.5, 0.5)
        torch.cuda.synchronize()
        for b, ref in ((backing, before), (backing_v, before_v)):
            assert torch.equal(bits(b)[:guard], ref[:guard])
            assert torch.equal(bits(b)[-guard:], ref[-guard:])
    expected = poison_(torch.empty(slots, h, d, dtype=torch.float8_e4m3fn, device=DEV))
    reference_set_kv_buffer(k, k, expected, expected.clone(), loc, 0.5, 0.5)
    assert_same_bytes(backing[guard:-guard], expected, "cache window")


def _pool(dtype=torch.float8_e4m3fn, **kw):
    return MHATokenToKVPool(4096, 1, dtype, 8, 128, 2, DEV, **kw)


def test_cuda_graph_replays_with_the_current_scale_and_slots():
    pool = _pool()
    ref = _pool(fused="never")
    k_scale = torch.tensor([0.5], device=DEV)
    v_scale = torch.tensor([2.0], device=DEV)
    x = _wide_rows(64, 8, 128, torch.bfloat16, 5)
    loc = torch.randperm(4096, device=DEV)[:64]
    static_x, static_loc = x.clone(), loc.clone()
    pool.set_kv_buffer(None, static_loc, static_x, static_x, k_scale, v_scale, layer_id_override=0)  # warm
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pool.set_kv_buffer(None, static_loc, static_x, static_x, k_scale, v_scale, layer_id_override=1)
    for step, (ks, vs) in enumerate([(0.37, 3.3), (1e-3, 0.01), (7.0, 0.9)]):
        k_scale.fill_(ks)
        v_scale.fill_(vs)
        static_x.copy_(_wide_rows(64, 8, 128, torch.bfloat16, 100 + step))
        static_loc.copy_(torch.randperm(4096, device=DEV)[:64])
        graph.replay()
        ref.set_kv_buffer(None, static_loc, static_x, static_x, torch.tensor([ks], device=DEV),
                          torch.tensor([vs], device=DEV), layer_id_override=1)  # fmt: skip
        torch.cuda.synchronize()
        for a, b in zip(pool.get_kv_buffer(1), ref.get_kv_buffer(1)):
            assert_same_bytes(a, b, f"replay {step}")


def test_fused_call_allocates_nothing_and_never_synchronises():
    pool = _pool()
    x = _wide_rows(300, 8, 128, torch.bfloat16, 6)
    qkv = _wide_rows(300, 48, 128, torch.bfloat16, 7)
    loc32 = torch.randperm(4096, device=DEV)[:300].to(torch.int32)
    scale = torch.tensor([0.37], device=DEV)
    loc64 = loc32.long()
    per_head = torch.linspace(0.1, 2, 8, device=DEV)
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
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            for call in calls:
                call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats().get("allocation.all.allocated", 0) == allocs_before
    assert pool.stats.fused_calls == 4 * len(calls) and pool.stats.reference_calls == 0


def test_reference_path_never_synchronises():
    pool = _pool(fused="never")
    x = _wide_rows(300, 8, 128, torch.bfloat16, 6)
    loc = torch.randperm(4096, device=DEV)[:300]
    loc[:5] = -1
    scale = torch.tensor([0.37], device=DEV)
    pool.set_kv_buffer(None, loc, x, x, scale, 0.5, layer_id_override=0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pool.set_kv_buffer(None, loc, x, x, scale, 0.5, layer_id_override=0)
        pool.set_kv_buffer(None, torch.full_like(loc, -1), x, x, scale, 0.5, layer_id_override=1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert pool.stats.reference_calls == 3



def test_warmup_compiles_what_the_first_calls_need():
    pool = _pool(dtype=torch.float8_e5m2)  # a geometry/format no other test has compiled
    assert pool.warmup_seconds is not None
    compiled = compiled_variants()
    qkv = _wide_rows(SMALL_TOKENS + 1, 48, 128, torch.bfloat16, 8)  # large writes take another tile
    for in_dtype, loc_dtype, scale in itertools.product(
        INPUTS, (torch.int32, torch.int64), (None, 0.25, torch.tensor([0.5], device=DEV))
    ):
        x = qkv.to(in_dtype)
        loc = torch.arange(1, SMALL_TOKENS + 2, device=DEV, dtype=loc_dtype)
        pool.set_kv_buffer(None, loc[:7], x[:7, 32:40], x[:7, 40:48], scale, scale, layer_id_override=1)
        pool.set_kv_buffer(None, loc[:1], x[:1, 32:40], x[:1, 40:48], scale, scale, layer_id_override=0)
        pool.set_kv_buffer(None, loc, x[:, 32:40], x[:, 40:48], scale, scale, layer_id_override=0)
    assert compiled_variants() == compiled, "a first call compiled a variant the warmup missed"


def test_auto_mode_routes_by_the_gate():
    pool = _pool()
    x = _wide_rows(5, 8, 128, torch.bfloat16, 9)
    loc = torch.arange(1, 6, device=DEV)
    pool.set_kv_buffer(None, loc, x, x, torch.linspace(0.1, 2, 8, device=DEV), 0.3, layer_id_override=0)
    assert pool.stats.fused_calls == 1
    pool.set_kv_buffer(None, loc, x, x, torch.tensor([0.5], device=DEV, dtype=torch.bfloat16), None, layer_id_override=0)
    assert pool.stats.reference_calls == 1
    assert any("bfloat16" in r for r in pool.stats.reasons)


def test_reduce_overhead_compile_matches_eager():
    class Layer:
        def __init__(self, i):
            self.layer_id = i

    torch._dynamo.reset()
    layers = [Layer(0), Layer(1)]
    compiled_pool, eager_pool = _pool(), _pool()
    scale = torch.tensor([0.37], device=DEV)

    def step(pool, x, loc):
        for layer in layers:
            pool.set_kv_buffer(layer, loc, x * (layer.layer_id + 1), x, scale, scale)
        return pool.get_key_buffer(1)[loc].float().sum()

    compiled = torch.compile(lambda x, loc: step(compiled_pool, x, loc), mode="reduce-overhead", fullgraph=True)
    for i in range(4):
        x = _wide_rows(32, 8, 128, torch.bfloat16, 200 + i)
        loc = torch.randperm(4096, device=DEV)[:32] + 0
        out = compiled(x, loc)
        expected = step(eager_pool, x, loc)
        torch.cuda.synchronize()
        assert torch.equal(out, expected)
        for layer in layers:
            for a, b in zip(compiled_pool.get_kv_buffer(layer.layer_id), eager_pool.get_kv_buffer(layer.layer_id)):
                assert_same_bytes(a, b, f"step {i}")
