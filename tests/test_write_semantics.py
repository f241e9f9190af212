"""What the K/V write stores (docs/contract.md, "The write").

* The pool's write (``set_kv_buffer``): layer objects and overrides, fused and reference pools byte
  for byte, scales on 16-bit pools, validate on request.
* The kernel against the reference path on small deliberate shapes: every cache, input and scale
  kind, K and V of different heads and dims, every bf16 and fp16 bit pattern, strided inputs,
  out-of-range, negative and duplicate slots, zero tokens, inputs and scales left unmodified, offsets
  beyond int32.

Without CUDA the fused path is the Triton kernel under the interpreter (conftest switches it on);
with CUDA the same tests run the compiled kernel.
"""

from __future__ import annotations

import pytest
import torch

from kvassert import (
    CACHE_DTYPES,
    DEVICE,
    FORMAT_OF,
    FP8,
    INPUT_DTYPES,
    Layer,
    assert_codes_equal,
    assert_same_bytes,
    bits,
    both_paths,
    id_of,
    poison_,
    poison_pool_,
    poisoned_caches,
    q_codes_stored,
    scale_of,
    slots_for,
    spread_rows,
)
from kvpool import (
    MHATokenToKVPool,
    fused_fp8_set_kv_buffer,
    reference_set_kv_buffer,
)
from kvpool.kernels.store_kv import writer as store_kv

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
    # written rows hold q(x) (the oracle's codes); slot 51 (the last row) was written, 52 is out of range
    expect_k = q_codes_stored(k, dtype, 0.61)
    kbuf = ref.get_key_buffer(1)
    for t, slot in enumerate([1, 7, None, 51, None, 30]):
        if slot is not None:
            assert_codes_equal(kbuf[slot], expect_k[t], FORMAT_OF[dtype], f"slot {slot}", nan_equal=False)
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
    expected = q_codes_stored(k, torch.float8_e4m3fn, 0.5)
    for t, slot in enumerate([5, slots - 1]):
        assert_codes_equal(backing[:, slot], expected[t], FORMAT_OF[torch.float8_e4m3fn], f"slot {slot}", nan_equal=False)


def test_non_contiguous_per_head_scale_needs_no_copy():
    t, h, d, slots = 5, 3, 32, 12
    k = spread_rows(t, h, d, torch.bfloat16, 22)
    wide = (torch.rand(h, 4, device=DEVICE) * 3 + 0.1)
    for scale in (wide[:, 1], wide[:, 2:3]):  # [H] with stride 4, [H, 1] with stride (4, 1)
        assert not scale.is_contiguous()
        (kf, vf), (kr, vr) = both_paths(k, k, slots_for(t, slots, torch.int64, 23), scale, scale, slots, torch.float8_e4m3fn)
        assert_same_bytes(kf, kr, "k_cache")
        assert_same_bytes(vf, vr, "v_cache")
