"""MLATokenToKVPool: construction and getters, both write entry points against the independent oracle
(reference path, and the kernel through Triton's interpreter on CPU or compiled on CUDA), the gather,
the observed maxima and calibrated scales of a latent row, and the allocators handing out its slots.

Every write lands in poisoned buffers, so a row written wrongly, or a row that should not have been
written, shows up; FP8 is compared code for code (the oracle's) or byte for byte (fused against
reference). The pools and inputs are ``kvassert``'s MLA helpers.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvassert import (
    CACHE_DTYPES,
    DEVICE,
    FORMAT_OF,
    INPUT_DTYPES,
    KERNEL_HERE,
    LATENT_LAYOUTS,
    Layer,
    MLA_LAYERS,
    MLA_SIZE,
    MLA_START,
    MODES,
    R,
    ROPE,
    assert_codes_equal,
    assert_same_bytes,
    bits,
    codes_of,
    expected_latent_cache,
    latent_layout,
    make_mla_pool,
    on_device,
    poison_mla_pool,
    q_codes_stored,
    wide_values,
)
from kvpool import MLATokenToKVPool, PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from kvpool.kernels.store_kv import writer as store_kv
from kvpool.kernels.store_kv.plan import BAND_TOKENS, plan_write
from kvpool.kernels.store_kv.plan import SMALL_TOKENS

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy inside Triton's interpreter


# ----------------------------------------------------------------------------------------------
# Construction and getters.


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=str)
def test_buffers_shapes_dtypes_and_views(dtype):
    pool = make_mla_pool(dtype, r=512, rope=64, size=100, page_size=4)
    assert (pool.start_layer, pool.end_layer, pool.layer_num) == (3, 4, 2)
    assert (pool.kv_lora_rank, pool.qk_rope_head_dim, pool.kv_cache_dim) == (512, 64, 576)
    assert pool.store_dtype == (torch.uint8 if dtype.itemsize == 1 else dtype)
    for layer_id in (3, 4):
        k, v = pool.get_kv_buffer(layer_id)
        assert k.shape == (104, 1, 576) and v.shape == (104, 1, 512)
        assert k.dtype == dtype and v.dtype == dtype
        assert not bits(k).any(), "buffers start zeroed"
        assert pool.get_key_buffer(layer_id) is k and pool.get_value_buffer(layer_id) is v
        # views of the one storage: the value buffer is the first kv_lora_rank columns of each row
        assert k.data_ptr() == v.data_ptr() == pool.kv_buffer[layer_id - 3].data_ptr()
        assert v.stride() == k.stride() == (576, 576, 1)
        pool.get_key_buffer(layer_id).view(torch.uint8)[7, 0, 3] = 0x11
        assert pool.get_value_buffer(layer_id).view(torch.uint8)[7, 0, 3] == 0x11, "a getter returned a copy"
    assert pool.get_kv_size_bytes() == 2 * 104 * 576 * dtype.itemsize


def test_sglang_positional_order_and_keywords():
    # SGLang: (size, page_size, dtype, kv_lora_rank, qk_rope_head_dim, layer_num, device,
    #          enable_memory_saver, start_layer, end_layer, use_nsa, override_kv_cache_dim)
    pool = MLATokenToKVPool(16, 2, torch.bfloat16, 32, 8, 3, "cpu", False, 5, 7, False, 40, warmup=False)
    assert (pool.size, pool.page_size, pool.start_layer, pool.end_layer, pool.kv_cache_dim) == (16, 2, 5, 7, 40)
    with pytest.raises(ValueError, match="enable_memory_saver must be False: kvpool has no memory saver"):
        MLATokenToKVPool(16, 1, torch.bfloat16, 32, 8, 1, "cpu", enable_memory_saver=True)
    with pytest.raises(ValueError, match="use_nsa must be False: kvpool has no NSA .*got True"):
        MLATokenToKVPool(16, 1, torch.bfloat16, 32, 8, 1, "cpu", use_nsa=True)
    with pytest.raises(ValueError, match=r"override_kv_cache_dim must be None or kv_lora_rank \+ qk_rope_head_dim = 40, got 656"):
        MLATokenToKVPool(16, 1, torch.bfloat16, 32, 8, 1, "cpu", override_kv_cache_dim=656)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(size=0), "size must be a positive int, got 0"),
        (dict(page_size=-1), "page_size must be a positive int, got -1"),
        (dict(dtype=torch.int8), "dtype must be one of"),
        (dict(kv_lora_rank=0), "kv_lora_rank must be a positive int, got 0"),
        (dict(qk_rope_head_dim=6.5), "qk_rope_head_dim must be a positive int, got 6.5"),
        (dict(layer_num=True), "layer_num must be a positive int, got True"),
        (dict(end_layer=9), r"end_layer must be start_layer \+ layer_num - 1 = 1"),
        (dict(start_layer=-2), "start_layer must be a non-negative int, got -2"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs, message):
    args = dict(size=8, page_size=1, dtype=torch.float8_e4m3fn, kv_lora_rank=16, qk_rope_head_dim=8,
                layer_num=2, device=DEVICE)  # fmt: skip
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        MLATokenToKVPool(**args, warmup=False)


@pytest.mark.parametrize("layer_id", [-1, 0, 2, 5, 100])
def test_layer_ids_outside_the_rank_raise_and_never_wrap(layer_id):
    pool = make_mla_pool(torch.float8_e4m3fn)
    before = [b.clone() for b in pool.kv_buffer]
    msg = rf"layer_id {layer_id} is outside this pool's layers \[3, 4\]"
    x = torch.ones(1, 1, R + ROPE, device=DEVICE)
    loc = torch.tensor([1], device=DEVICE)
    for call in (
        lambda: pool.get_key_buffer(layer_id),
        lambda: pool.get_value_buffer(layer_id),
        lambda: pool.get_kv_buffer(layer_id),
        lambda: pool.set_kv_buffer(Layer(layer_id), loc, x, None),
        lambda: pool.set_mla_kv_buffer(None, loc, x[:, :, :R], x[:, :, R:], layer_id_override=layer_id),
        lambda: pool.get_mla_kv_buffer(Layer(layer_id), loc),
    ):
        with pytest.raises(IndexError, match=msg):
            call()
    for a, b in zip(pool.kv_buffer, before):
        assert torch.equal(a, b)


def test_layer_object_and_override():
    pool = make_mla_pool(torch.bfloat16)
    x = torch.full((1, 1, R + ROPE), 2.0, device=DEVICE)
    pool.set_kv_buffer(Layer(4), torch.tensor([3], device=DEVICE), x, None)
    assert pool.get_key_buffer(4)[3].eq(2).all() and not pool.get_key_buffer(3).any()
    pool.set_mla_kv_buffer(Layer(4), torch.tensor([5], device=DEVICE), x[:, :, :R], x[:, :, R:], layer_id_override=3)
    assert pool.get_key_buffer(3)[5].eq(2).all(), "layer_id_override wins over layer.layer_id"
    with pytest.raises(TypeError, match="layer_id_override"):
        pool.set_mla_kv_buffer(None, torch.tensor([4], device=DEVICE), x[:, :, :R], x[:, :, R:])


# ----------------------------------------------------------------------------------------------
# Writes against the oracle.


@dataclasses.dataclass
class MLAExample:
    T: int
    r: int
    rope: int
    cache_dtype: torch.dtype
    entry: str  # "row" (set_kv_buffer) or "parts" (set_mla_kv_buffer)
    parts: list  # the input tensors (one for "row", two for "parts"), as views
    bases: list  # the tensors owning their memory
    loc: torch.Tensor
    k_scale: object
    poison: int

    def __repr__(self) -> str:
        s = self.k_scale
        sc = f"tensor{tuple(s.shape)}:{s.dtype}={s.reshape(-1).tolist()}" if isinstance(s, torch.Tensor) else repr(s)
        parts = ", ".join(f"{tuple(p.shape)} {p.dtype} strides {p.stride()}" for p in self.parts)
        return (f"MLAExample(T={self.T}, r={self.r}, rope={self.rope}, cache={self.cache_dtype}, {self.entry}: "
                f"[{parts}], loc={self.loc.tolist()} ({self.loc.dtype}), k_scale={sc}, poison=0x{self.poison:02x})")


@st.composite
def mla_examples(draw, dims=((512, 64), (40, 24), (16, 8), (96, 32)), scale_dtypes=(torch.float32,)):
    T = draw(st.sampled_from([0, 1, 2, 3, 7, 8]))
    r, rope = draw(st.sampled_from(dims))
    cache_dtype = draw(st.sampled_from(CACHE_DTYPES))
    entry = draw(st.sampled_from(["row", "parts"]))
    kind = draw(st.sampled_from(["none", "float", "tensor"]))
    value = draw(st.sampled_from([1.0, 0.5, 0.37, 3.3, 1e-3, 1e3, 448.0 / 3]))
    if kind == "none":
        k_scale = None
    elif kind == "float":
        k_scale = value
    else:
        shape = draw(st.sampled_from([(), (1,), (1, 1)]))
        k_scale = torch.tensor(value, dtype=torch.float64).to(draw(st.sampled_from(scale_dtypes))).reshape(shape)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    centre = round(float(np.log2(value))) if k_scale is not None else 0
    if entry == "row":
        x, base = latent_layout(wide_values(rng, (T, 1, r + rope), draw(st.sampled_from(INPUT_DTYPES)), centre),
                         draw(st.sampled_from(LATENT_LAYOUTS)))
        parts, bases = [x], [base]
    else:
        nope, nb = latent_layout(wide_values(rng, (T, 1, r), draw(st.sampled_from(INPUT_DTYPES)), centre),
                          draw(st.sampled_from(LATENT_LAYOUTS)))
        rope_x, rb = latent_layout(wide_values(rng, (T, 1, rope), draw(st.sampled_from(INPUT_DTYPES)), centre),
                            draw(st.sampled_from(LATENT_LAYOUTS)))
        parts, bases = [nope, rope_x], [nb, rb]
    slots = MLA_SIZE + 1
    loc_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    big = 2**31 - 1 if loc_dtype == torch.int32 else 2**40
    free = list(draw(st.permutations(range(slots))))
    loc = []
    for _ in range(T):
        kind = draw(st.sampled_from(["valid", "valid", "valid", "negative", "out_of_range"]))
        if kind == "valid":
            loc.append(free.pop())
        elif kind == "negative":
            loc.append(draw(st.sampled_from([-1, -slots, -big])))
        else:
            loc.append(draw(st.sampled_from([slots, slots + 1, big])))
    poison = draw(st.sampled_from([0xFF, 0xA5]))
    return MLAExample(T, r, rope, cache_dtype, entry, parts, bases, torch.tensor(loc, dtype=loc_dtype),
                      k_scale, poison)


def run_pool_example(ex: MLAExample, mode: str, layer_id: int = 4, via_override: bool = False) -> MLATokenToKVPool:
    """Write ``ex`` into a fresh poisoned pool and check everything against the oracle."""
    pool = make_mla_pool(ex.cache_dtype, mode, ex.r, ex.rope)
    before = poison_mla_pool(pool, ex.poison)
    parts = [on_device(p) for p in ex.parts]
    bases_dev = [on_device(b) for b in ex.bases]
    if DEVICE != "cpu":  # rebuild the views on the device with the same strides
        # one base per part, or one base that every part is a view of
        bases_for = bases_dev if len(bases_dev) == len(ex.parts) else bases_dev * len(ex.parts)
        parts = [b.as_strided(p.shape, p.stride(), p.storage_offset()) for p, b in zip(ex.parts, bases_for)]
    snapshot = [b.clone() for b in bases_dev] + [ex.loc.clone()]
    loc, scale = on_device(ex.loc), on_device(ex.k_scale)
    stats_before = pool.stats.fused_calls, pool.stats.reference_calls
    layer, override = (None, layer_id) if via_override else (Layer(layer_id), None)
    if ex.entry == "row":
        ret = pool.set_kv_buffer(layer, loc, parts[0], None, scale, None, layer_id_override=override)
    else:
        ret = pool.set_mla_kv_buffer(layer, loc, parts[0], parts[1], scale, layer_id_override=override)
    assert ret is None
    for a, b in zip(bases_dev + [loc], snapshot):
        assert_same_bytes(a, b, f"an input changed; {ex!r}")
    i = layer_id - MLA_START
    fmt = FORMAT_OF[ex.cache_dtype]
    expected = expected_latent_cache(codes_of(before[i].view(ex.cache_dtype)), [p.cpu() for p in parts],
                                     ex.loc.tolist(), ex.cache_dtype, ex.k_scale)
    got = pool.get_key_buffer(layer_id)
    assert_codes_equal(got, expected, fmt, f"pool[{mode}] {ex.entry}; {ex!r}")
    named = {int(s) for s in ex.loc.tolist() if 0 <= int(s) < pool.rows}
    for slot in range(pool.rows):
        if slot not in named:
            assert_same_bytes(pool.kv_buffer[i][slot], before[i][slot], f"untouched row {slot}; {ex!r}")
    assert_same_bytes(pool.kv_buffer[1 - i], before[1 - i], f"the other layer; {ex!r}")
    if ex.T:
        fused = mode == "always"
        assert (pool.stats.fused_calls, pool.stats.reference_calls) == (
            stats_before[0] + fused, stats_before[1] + (not fused)
        ), pool.stats
    return pool


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(ex=mla_examples(scale_dtypes=(torch.float32, torch.bfloat16, torch.float64)), via_override=st.booleans())
def test_reference_pool_write_equals_oracle(ex, via_override):
    run_pool_example(ex, "never", via_override=via_override)


@pytest.mark.skipif(not KERNEL_HERE, reason="the kernel needs CUDA or TRITON_INTERPRET=1")
@settings(max_examples=20, suppress_health_check=[HealthCheck.too_slow])
@given(ex=mla_examples(), layer_id=st.sampled_from([3, 4]))
def test_fused_pool_write_equals_oracle(ex, layer_id):
    run_pool_example(ex, "always", layer_id)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("entry", ["row", "parts"])
def test_deepseek_geometry_equals_oracle(entry, mode):
    """DeepSeek-V3's 512 + 64 with the realistic inputs: the row sliced out of a wider projection,
    the parts as the two column ranges of one row (no copy), and a per-tensor scale tensor."""
    rng = np.random.default_rng(7)
    row, base = latent_layout(wide_values(rng, (7, 1, 576), torch.bfloat16, centre=-1), "projection_slice")
    parts = [row] if entry == "row" else [row[:, :, :512], row[:, :, 512:]]
    loc = torch.tensor([1, 11, -1, 12, 5, 0, 2**31 - 1], dtype=torch.int32)
    ex = MLAExample(7, 512, 64, torch.float8_e4m3fn, entry, parts, [base], loc, torch.tensor([0.37]), 0xFF)
    run_pool_example(ex, mode)


@pytest.mark.skipif(not KERNEL_HERE, reason="the kernel needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=str)
def test_fused_and_reference_pools_are_bit_identical(dtype):
    """Byte for byte, NaN patterns included (the oracle accepts any NaN code; the two paths must
    store the same one): both entry points, float and tensor scales, on poisoned buffers."""
    pools = {mode: make_mla_pool(dtype, mode, 512, 64) for mode in ("always", "never")}
    rng = np.random.default_rng(3)
    row = wide_values(rng, (6, 1, 576), torch.bfloat16, centre=2).to(DEVICE)
    nope = wide_values(rng, (6, 1, 512), torch.float32, centre=2).to(DEVICE)
    rope = wide_values(rng, (6, 3, 64), torch.float16, centre=2).to(DEVICE)[:, 1:2]
    loc = torch.tensor([1, 7, -1, 12, 11, 0], device=DEVICE)
    for pool in pools.values():
        poison_mla_pool(pool, 0xFF)
        pool.set_kv_buffer(None, loc, row, None, 0.61, layer_id_override=3)
        pool.set_mla_kv_buffer(Layer(4), loc.flip(0), nope, rope, torch.tensor([2.5], device=DEVICE))
    assert pools["always"].stats.fused_calls == 2 and pools["never"].stats.reference_calls == 2
    for a, b in zip(pools["always"].kv_buffer, pools["never"].kv_buffer):
        assert_same_bytes(a, b, f"{dtype} layer buffer")


def test_both_entry_points_write_the_same_bytes():
    """set_mla_kv_buffer(nope, rope) == set_kv_buffer(concat(nope, rope)), byte for byte."""
    rng = np.random.default_rng(5)
    nope = wide_values(rng, (5, 1, R), torch.bfloat16).to(DEVICE)
    rope = wide_values(rng, (5, 1, ROPE), torch.bfloat16).to(DEVICE)
    loc = torch.tensor([4, 2, 9, -3, 11], device=DEVICE)
    a, b = make_mla_pool(torch.float8_e5m2), make_mla_pool(torch.float8_e5m2)
    a.set_mla_kv_buffer(Layer(3), loc, nope, rope, 0.25)
    b.set_kv_buffer(Layer(3), loc, torch.cat((nope, rope), dim=2), None, 0.25)
    assert_same_bytes(a.get_key_buffer(3), b.get_key_buffer(3), "latent rows")


def test_cache_v_and_v_scale_are_ignored_and_16_bit_pools_ignore_k_scale():
    x = torch.tensor([[[1.5, -2.0, 3.0, 0.25]]], device=DEVICE)
    pool = MLATokenToKVPool(8, 1, torch.float8_e4m3fn, 3, 1, 1, DEVICE, warmup=False)
    pool.set_kv_buffer(None, torch.tensor([2], device=DEVICE), x, "not a tensor", 0.5, -7.0, layer_id_override=0)
    assert_codes_equal(pool.get_key_buffer(0)[2], q_codes_stored(x, torch.float8_e4m3fn, 0.5)[0],
                       FORMAT_OF[torch.float8_e4m3fn], "row 2", nan_equal=False)
    bf16 = MLATokenToKVPool(8, 1, torch.bfloat16, 3, 1, 1, DEVICE, warmup=False)
    bf16.set_mla_kv_buffer(None, torch.tensor([2], device=DEVICE), x[:, :, :3], x[:, :, 3:], -5.0, layer_id_override=0)
    assert torch.equal(bf16.get_key_buffer(0)[2], x[0].to(torch.bfloat16))


def test_auto_mode_on_cpu_takes_the_reference_path_and_says_why():
    if DEVICE != "cpu":
        pytest.skip("CPU routing")
    pool = make_mla_pool(torch.float8_e4m3fn, "auto")
    x = torch.ones(2, 1, R + ROPE)
    pool.set_kv_buffer(Layer(3), torch.tensor([1, 2]), x, None)
    pool.set_mla_kv_buffer(Layer(3), torch.tensor([1, 2]), x[:, :, :R], x[:, :, R:])
    assert pool.stats.reference_calls == 2 and pool.stats.fused_calls == 0
    assert any("device is cpu" in reason for reason in pool.stats.reasons)


def test_kernel_plan_for_the_deepseek_row():
    """The kernel's plan covers the 512 latent and 64 rotary columns with no idle lanes, no flat
    plan; the joined plan writes both parts of each row from one program (grid axis 1 has one
    entry), where the per-head plan alone gives each part its own programs."""
    big = SMALL_TOKENS + 1  # the large writes' tile
    plan = plan_write(1, 512, 1, 64, big)
    assert plan.lane_use == 1.0 and plan.grid_y == 2
    assert (plan.block_t, plan.block_d, plan.block_dv) == (4, 512, 64)
    assert not plan_write(1, 512, 1, 64, big, row=True).row_view
    joined = plan_write(1, 512, 1, 64, big, joined=True)
    assert joined.grid_y == 1 and (joined.block_t, joined.block_d, joined.block_dv) == (4, 512, 64)


@pytest.mark.skipif(not KERNEL_HERE, reason="the kernel needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("rank,rope", [(R, ROPE), (512, 64)], ids=["small-row", "deepseek-row"])
def test_eager_and_compiled_writes_take_the_same_joined_plans(rank, rope):
    """The pool's eager writes and the custom operator its compiled callers go through (given the
    same two column views) take the same joined plans, so the pool's warmup serves both; caches
    that are not two parts of one row keep the per-part plan."""
    pool = make_mla_pool(torch.float8_e4m3fn, "always", r=rank, rope=rope, size=64)
    eager = pool._writer
    compiled = store_kv.writer_for(pool._k_views[0], pool._v_views[0], "always")
    apart = store_kv.writer_for(
        torch.empty(8, 1, rank, dtype=torch.float8_e4m3fn, device=DEVICE),
        torch.empty(8, 1, rope, dtype=torch.float8_e4m3fn, device=DEVICE), "always",
    )  # fmt: skip
    inputs = ((rank, rank, 1), (rope, rope, 1))
    for tokens in BAND_TOKENS:  # both tiles; per-head scales keep row plans out, as the old per-head variants
        mine, op = (w.plan(*inputs, (3, 3), False, tokens) for w in (eager, compiled))
        assert mine.joined and mine.grid_y == 1 and mine == op
        assert not apart.plan(*inputs, (3, 3), False, tokens).joined


# ----------------------------------------------------------------------------------------------
# The gather.


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=str)
def test_get_mla_kv_buffer_gathers_the_stored_bytes(dtype):
    pool = make_mla_pool(dtype)
    poison_mla_pool(pool, 0x7F)  # FP8: NaN codes, returned as they are
    rng = np.random.default_rng(11)
    x = wide_values(rng, (4, 1, R + ROPE), torch.float32).to(DEVICE)
    pool.set_kv_buffer(Layer(4), torch.tensor([2, 9, 5, 1], device=DEVICE), x, None, 0.5)
    buf = pool.get_key_buffer(4)
    for loc_dtype in (torch.int32, torch.int64):
        loc = torch.tensor([9, -1, 2, 12, 2**30, 0, -(2**31)], dtype=loc_dtype, device=DEVICE)
        nope, rope = pool.get_mla_kv_buffer(Layer(4), loc)
        assert nope.shape == (7, 1, R) and rope.shape == (7, 1, ROPE)
        assert nope.dtype == rope.dtype == dtype and nope.is_contiguous() and rope.is_contiguous()
        for t, slot in enumerate([9, None, 2, None, None, 0, None]):
            if slot is None:  # outside the buffer: a row of zero bytes, nothing read out of bounds
                assert not bits(nope[t]).any() and not bits(rope[t]).any()
            else:
                assert_same_bytes(nope[t], buf[slot, :, :R], f"nope slot {slot}")
                assert_same_bytes(rope[t], buf[slot, :, R:], f"rope slot {slot}")
        as_f32 = pool.get_mla_kv_buffer(Layer(4), loc, dst_dtype=torch.float32)
        assert_same_bytes(as_f32[0], nope.to(torch.float32), "cast nope")
        assert_same_bytes(as_f32[1], rope.to(torch.float32), "cast rope")
    empty = pool.get_mla_kv_buffer(Layer(3), torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert empty[0].shape == (0, 1, R) and empty[1].shape == (0, 1, ROPE)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda p, loc: p.get_mla_kv_buffer(None, loc), TypeError, "layer must have a .layer_id attribute, got NoneType"),
        (lambda p, loc: p.get_mla_kv_buffer(Layer(3), loc.tolist()), TypeError, "loc must be a torch.Tensor, got list"),
        (lambda p, loc: p.get_mla_kv_buffer(Layer(3), loc.float()), ValueError, "loc must be int32 or int64, got torch.float32"),
        (lambda p, loc: p.get_mla_kv_buffer(Layer(3), loc[None]), ValueError, r"loc must be 1-D \[T\], got shape \(1, 3\)"),
        (lambda p, loc: p.get_mla_kv_buffer(Layer(3), loc.to("meta")), ValueError, "loc must be on .*, got meta"),
        (lambda p, loc: p.get_mla_kv_buffer(Layer(3), loc, torch.int32), ValueError,
         "dst_dtype must be None or a floating torch.dtype, got torch.int32"),
    ],
)
def test_get_mla_kv_buffer_rejects_bad_arguments(call, error, message):
    pool = make_mla_pool(torch.float8_e4m3fn)
    with pytest.raises(error, match=message):
        call(pool, torch.tensor([1, 2, 3], device=DEVICE))


def test_get_mla_kv_buffer_under_validate_raises_for_slots_past_the_end():
    pool = make_mla_pool(torch.float8_e4m3fn, validate=True)
    with pytest.raises(IndexError, match=r"loc\[1\] = 12 is out of range: slots are 0..11"):
        pool.get_mla_kv_buffer(Layer(3), torch.tensor([1, 12, -1], device=DEVICE))
    nope, _ = pool.get_mla_kv_buffer(Layer(3), torch.tensor([1, -1], device=DEVICE))  # padding is fine
    assert nope.shape == (2, 1, R)


# ----------------------------------------------------------------------------------------------
# Calibration: one scale for the whole row.


@pytest.mark.parametrize("mode", MODES)
def test_observed_maxima_and_calibrated_scales(mode):
    pool = make_mla_pool(torch.float8_e4m3fn, mode, observe_amax=True)
    assert pool.kv_amax.shape == (MLA_LAYERS, 2, 1)
    row = torch.zeros(4, 1, R + ROPE)
    row[0, 0, 3] = -100.0  # latent part
    row[1, 0, R + 2] = 300.0  # rotary part
    row[2, 0, 5] = float("nan")  # left out
    row[2, 0, R] = float("-inf")  # left out
    row[3] = 1e6  # a padding token: not written, not observed
    loc = torch.tensor([1, 2, 3, -1], device=DEVICE)
    pool.set_kv_buffer(Layer(3), loc, row.to(DEVICE), None)
    nope = torch.full((1, 1, R), -7.0, device=DEVICE)
    rope = torch.full((1, 1, ROPE), 2.0, device=DEVICE)
    pool.set_mla_kv_buffer(Layer(4), torch.tensor([5], device=DEVICE), nope, rope, 0.5)
    assert pool.kv_amax.cpu().tolist() == [[[100.0], [300.0]], [[7.0], [2.0]]]
    scales = pool.calibrated_scales()
    assert len(scales) == MLA_LAYERS
    for (k, v), amax in zip(scales, (300.0, 7.0)):
        assert k is v and k.shape == (1,) and k.dtype == torch.float32
        assert k.item() == np.float32(amax / 448.0)
    assert [k.item() for k, _ in pool.calibrated_scales(per_head=True)] == [k.item() for k, _ in scales]
    assert pool.calibrated_scales(margin=2.0, dtype=torch.float8_e5m2)[0][0].item() == np.float32(600.0 / 57344.0)


# ----------------------------------------------------------------------------------------------
# With the allocators.


@pytest.mark.parametrize("page_size", [1, 4])
def test_allocators_hand_out_slots_of_an_mla_pool(page_size):
    pool = make_mla_pool(torch.float8_e4m3fn, size=16, page_size=page_size)
    if page_size == 1:
        allocator = TokenToKVPoolAllocator(pool.size, pool.dtype, DEVICE, kvcache=pool)
    else:
        allocator = PagedTokenToKVPoolAllocator(pool.size, page_size, pool.dtype, DEVICE, kvcache=pool)
    assert allocator.get_kvcache() is pool
    loc = allocator.alloc(8)
    assert loc is not None and int(loc.min()) >= 1 and int(loc.max()) < pool.rows
    rng = np.random.default_rng(2)
    nope = wide_values(rng, (8, 1, R), torch.bfloat16, specials=False).to(DEVICE)
    rope = wide_values(rng, (8, 1, ROPE), torch.bfloat16, specials=False).to(DEVICE)
    pool.set_mla_kv_buffer(Layer(3), loc, nope, rope, 0.1)
    got_nope, got_rope = pool.get_mla_kv_buffer(Layer(3), loc)
    fmt = FORMAT_OF[torch.float8_e4m3fn]
    assert_codes_equal(got_nope, q_codes_stored(nope, torch.float8_e4m3fn, 0.1), fmt, "nope", nan_equal=False)
    assert_codes_equal(got_rope, q_codes_stored(rope, torch.float8_e4m3fn, 0.1), fmt, "rope", nan_equal=False)
    allocator.free(loc)
    allocator.check_integrity()
