"""NaN bit patterns and autograd on both write paths.

A NaN converted between element types is stored as the cache format's pinned NaN bits, and the
finite values around it are unaffected; a cache that requires grad (or views one that does) is
refused with nothing written; inputs that require grad write like their detached values; on CUDA,
every 16-bit pattern and random float32 patterns into 16- and 32-bit caches on each cast variant.
"""

from __future__ import annotations

import pytest
import torch

from kvassert import (
    CACHE_DTYPES,
    DEVICE,
    INPUT_DTYPES,
    assert_same_bytes,
    bits,
    cuda_gen,
    fused_runs,
    gpu,
    id_of,
    poison_,
    poison_pool_,
)
from kvpool import MHATokenToKVPool, fused_fp8_set_kv_buffer, reference_set_kv_buffer
from kvpool.config import KernelOptions
from kvpool.kernels.store_kv.op import launch_store_kv

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy inside Triton's interpreter


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
    torch.float8_e4m3fnuz: 0x80,  # the fnuz formats' only NaN
    torch.float8_e5m2fnuz: 0x80,
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
