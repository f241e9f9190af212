"""MLATokenToKVPool: construction, getters, both write entry points against the independent oracle
(reference path, and the kernel through Triton's interpreter on CPU or compiled on CUDA), the gather,
bad input with nothing written, calibration, and the row copies (moves, CPU copies, the host tier);
on CUDA the same at DeepSeek-V3's geometry and real sizes.

Every write lands in poisoned buffers, so a row written wrongly, or a row that should not have been
written, shows up; FP8 is compared code for code (the oracle's) or byte for byte (fused against
reference).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvpool
from kvassert import (
    CACHE_DTYPES,
    DEVICE,
    FORMAT_OF,
    FP8,
    INPUT_DTYPES,
    KERNEL_HERE,
    Layer,
    assert_codes_equal,
    assert_same_bytes,
    bits,
    codes_of,
    compiled_variants,
    cuda_gen,
    cuda_scale,
    cuda_values,
    expected_latent_cache,
    fill_random_,
    gpu,
    id_of,
    no_sync,
    poison_,
)
from kvpool import (
    MLATokenToKVPool,
    MLATokenToKVPoolHost,
    PagedTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
    reference_set_kv_buffer,
)
from kvpool import host as host_tier
from kvpool.config import KernelOptions
from kvpool.kernels.copy_rows import launcher as copy_rows
from kvpool.kernels.store_kv import writer as store_kv
from kvpool.kernels.store_kv.op import launch_store_kv
from kvpool.kernels.store_kv.plan import BAND_TOKENS, SMALL_TOKENS, plan_write

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy inside Triton's interpreter

MODES = ["never", "always"] if KERNEL_HERE else ["never"]
# Small geometries keep the interpreter quick; DeepSeek's 512 + 64 is in every grid too.
R, ROPE = 40, 24
SIZE, START, LAYERS = 11, 3, 2  # rows 0..11 (page_size 1); global layers 3 and 4


def make_pool(dtype, mode="never", r=R, rope=ROPE, size=SIZE, page_size=1, **kw) -> MLATokenToKVPool:
    with mock.patch.dict(os.environ):
        os.environ.pop("KVPOOL_FUSED", None)
        os.environ.pop("KVPOOL_VALIDATE", None)
        kw.setdefault("warmup", False)
        return MLATokenToKVPool(size, page_size, dtype, r, rope, LAYERS, DEVICE, start_layer=START, fused=mode, **kw)


def poison_pool(pool: MLATokenToKVPool, poison: int = 0xA5) -> list[torch.Tensor]:
    """Fill every layer with its own byte pattern; return copies of the poisoned buffers."""
    for i, b in enumerate(pool.kv_buffer):
        b.view(torch.uint8).fill_(poison ^ (17 * i))
    return [b.clone() for b in pool.kv_buffer]


def values(rng: np.random.Generator, shape: tuple, dtype: torch.dtype, centre: float = 0.0,
           specials: bool = True) -> torch.Tensor:
    """Magnitudes from subnormal to overflow around 2**centre, both signs, a few inf/NaN/zeros."""
    n = int(np.prod(shape))
    vals = rng.uniform(1.0, 2.0, n) * np.exp2(rng.integers(-24, 12, n) + centre) * rng.choice([-1.0, 1.0], n)
    if specials and n:
        idx = rng.choice(n, size=max(1, n // 40))
        vals[idx] = rng.choice([np.inf, -np.inf, np.nan, 0.0, -0.0, 448.0, 57344.0 * 2], size=idx.size)
    return torch.from_numpy(vals.reshape(shape)).to(dtype)


def layout(x: torch.Tensor, how: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [T, 1, W] in another memory layout; returns (view, the tensor owning its memory)."""
    t, _, w = x.shape
    if how == "contiguous":
        base = x.clone()
        return base, base
    if how == "projection_slice":  # columns of a wider projection output: token stride W + 7
        base = torch.full((t, 1, w + 7), 3.0, dtype=x.dtype)
        base[:, :, 2 : 2 + w] = x
        return base[:, :, 2 : 2 + w], base
    if how == "head_of_many":  # one head of [T, 3, W]: token stride 3W, head stride W
        base = torch.full((t, 3, w), -5.0, dtype=x.dtype)
        base[:, 1:2] = x
        return base[:, 1:2], base
    if how == "tokens_last":  # stored [W, T]
        base = x[:, 0].t().contiguous()
        return base.t().unsqueeze(1), base
    if how == "d_strided":  # every other element along the row
        base = torch.full((t, 1, 2 * w), 9.0, dtype=x.dtype)
        base[:, :, ::2] = x
        return base[:, :, ::2], base
    raise AssertionError(how)


LAYOUTS = ["contiguous", "projection_slice", "head_of_many", "tokens_last", "d_strided"]


def on_device(x):
    return x.to(DEVICE) if isinstance(x, torch.Tensor) else x


# ----------------------------------------------------------------------------------------------
# Construction and getters.


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=str)
def test_buffers_shapes_dtypes_and_views(dtype):
    pool = make_pool(dtype, r=512, rope=64, size=100, page_size=4)
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
    pool = make_pool(torch.float8_e4m3fn)
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
    pool = make_pool(torch.bfloat16)
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
        x, base = layout(values(rng, (T, 1, r + rope), draw(st.sampled_from(INPUT_DTYPES)), centre),
                         draw(st.sampled_from(LAYOUTS)))
        parts, bases = [x], [base]
    else:
        nope, nb = layout(values(rng, (T, 1, r), draw(st.sampled_from(INPUT_DTYPES)), centre),
                          draw(st.sampled_from(LAYOUTS)))
        rope_x, rb = layout(values(rng, (T, 1, rope), draw(st.sampled_from(INPUT_DTYPES)), centre),
                            draw(st.sampled_from(LAYOUTS)))
        parts, bases = [nope, rope_x], [nb, rb]
    slots = SIZE + 1
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
    pool = make_pool(ex.cache_dtype, mode, ex.r, ex.rope)
    before = poison_pool(pool, ex.poison)
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
    i = layer_id - START
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
    row, base = layout(values(rng, (7, 1, 576), torch.bfloat16, centre=-1), "projection_slice")
    parts = [row] if entry == "row" else [row[:, :, :512], row[:, :, 512:]]
    loc = torch.tensor([1, 11, -1, 12, 5, 0, 2**31 - 1], dtype=torch.int32)
    ex = MLAExample(7, 512, 64, torch.float8_e4m3fn, entry, parts, [base], loc, torch.tensor([0.37]), 0xFF)
    run_pool_example(ex, mode)


@pytest.mark.skipif(not KERNEL_HERE, reason="the kernel needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=str)
def test_fused_and_reference_pools_are_bit_identical(dtype):
    """Byte for byte, NaN patterns included (the oracle accepts any NaN code; the two paths must
    store the same one): both entry points, float and tensor scales, on poisoned buffers."""
    pools = {mode: make_pool(dtype, mode, 512, 64) for mode in ("always", "never")}
    rng = np.random.default_rng(3)
    row = values(rng, (6, 1, 576), torch.bfloat16, centre=2).to(DEVICE)
    nope = values(rng, (6, 1, 512), torch.float32, centre=2).to(DEVICE)
    rope = values(rng, (6, 3, 64), torch.float16, centre=2).to(DEVICE)[:, 1:2]
    loc = torch.tensor([1, 7, -1, 12, 11, 0], device=DEVICE)
    for pool in pools.values():
        poison_pool(pool, 0xFF)
        pool.set_kv_buffer(None, loc, row, None, 0.61, layer_id_override=3)
        pool.set_mla_kv_buffer(Layer(4), loc.flip(0), nope, rope, torch.tensor([2.5], device=DEVICE))
    assert pools["always"].stats.fused_calls == 2 and pools["never"].stats.reference_calls == 2
    for a, b in zip(pools["always"].kv_buffer, pools["never"].kv_buffer):
        assert_same_bytes(a, b, f"{dtype} layer buffer")


def test_both_entry_points_write_the_same_bytes():
    """set_mla_kv_buffer(nope, rope) == set_kv_buffer(concat(nope, rope)), byte for byte."""
    rng = np.random.default_rng(5)
    nope = values(rng, (5, 1, R), torch.bfloat16).to(DEVICE)
    rope = values(rng, (5, 1, ROPE), torch.bfloat16).to(DEVICE)
    loc = torch.tensor([4, 2, 9, -3, 11], device=DEVICE)
    a, b = make_pool(torch.float8_e5m2), make_pool(torch.float8_e5m2)
    a.set_mla_kv_buffer(Layer(3), loc, nope, rope, 0.25)
    b.set_kv_buffer(Layer(3), loc, torch.cat((nope, rope), dim=2), None, 0.25)
    assert_same_bytes(a.get_key_buffer(3), b.get_key_buffer(3), "latent rows")


def test_cache_v_and_v_scale_are_ignored_and_16_bit_pools_ignore_k_scale():
    x = torch.tensor([[[1.5, -2.0, 3.0, 0.25]]], device=DEVICE)
    pool = MLATokenToKVPool(8, 1, torch.float8_e4m3fn, 3, 1, 1, DEVICE, warmup=False)
    pool.set_kv_buffer(None, torch.tensor([2], device=DEVICE), x, "not a tensor", 0.5, -7.0, layer_id_override=0)
    assert_same_bytes(pool.get_key_buffer(0)[2], kvpool.quantize(x, torch.float8_e4m3fn, 0.5)[0], "row 2")
    bf16 = MLATokenToKVPool(8, 1, torch.bfloat16, 3, 1, 1, DEVICE, warmup=False)
    bf16.set_mla_kv_buffer(None, torch.tensor([2], device=DEVICE), x[:, :, :3], x[:, :, 3:], -5.0, layer_id_override=0)
    assert torch.equal(bf16.get_key_buffer(0)[2], x[0].to(torch.bfloat16))


def test_auto_mode_on_cpu_takes_the_reference_path_and_says_why():
    if DEVICE != "cpu":
        pytest.skip("CPU routing")
    pool = make_pool(torch.float8_e4m3fn, "auto")
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
    pool = make_pool(torch.float8_e4m3fn, "always", r=rank, rope=rope, size=64)
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
    pool = make_pool(dtype)
    poison_pool(pool, 0x7F)  # FP8: NaN codes, returned as they are
    rng = np.random.default_rng(11)
    x = values(rng, (4, 1, R + ROPE), torch.float32).to(DEVICE)
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
    pool = make_pool(torch.float8_e4m3fn)
    with pytest.raises(error, match=message):
        call(pool, torch.tensor([1, 2, 3], device=DEVICE))


def test_get_mla_kv_buffer_under_validate_raises_for_slots_past_the_end():
    pool = make_pool(torch.float8_e4m3fn, validate=True)
    with pytest.raises(IndexError, match=r"loc\[1\] = 12 is out of range: slots are 0..11"):
        pool.get_mla_kv_buffer(Layer(3), torch.tensor([1, 12, -1], device=DEVICE))
    nope, _ = pool.get_mla_kv_buffer(Layer(3), torch.tensor([1, -1], device=DEVICE))  # padding is fine
    assert nope.shape == (2, 1, R)


# ----------------------------------------------------------------------------------------------
# Bad input: a clear error, and nothing written.

T = 5
BASE_LOC = [1, 5, -1, 7, 10]


def _base(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    row = torch.randn(T, 1, R + ROPE, generator=g).to(dtype).to(DEVICE)
    return dict(row=row, nope=row[:, :, :R], rope=row[:, :, R:], loc=torch.tensor(BASE_LOC, device=DEVICE),
                k_scale=0.5, layer=Layer(4), override=None)  # fmt: skip


def _row(a):
    return lambda p: p.set_kv_buffer(a["layer"], a["loc"], a["row"], None, a["k_scale"], None, a["override"])


def _parts(a):
    return lambda p: p.set_mla_kv_buffer(a["layer"], a["loc"], a["nope"], a["rope"], a["k_scale"], a["override"])


META = torch.device("meta")
# (id, entry, changes to the base arguments, exception, message)
BAD = [
    ("row-not-tensor", _row, dict(row=[[1.0]]), TypeError, "cache_k must be a torch.Tensor, got list"),
    ("row-2d", _row, dict(row=torch.ones(T, R + ROPE)), ValueError, r"cache_k must be 3-D \[T, 1, 64\], got shape \(5, 64\)"),
    ("row-heads", _row, dict(row=torch.ones(T, 2, R + ROPE)), ValueError, r"cache_k must have 1 heads \(shape\[1\]\), got 2"),
    ("row-width", _row, dict(row=torch.ones(T, 1, R + ROPE - 1)), ValueError, r"cache_k must have head dim 64 \(shape\[2\]\), got 63"),
    ("row-int", _row, dict(row=torch.ones(T, 1, R + ROPE, dtype=torch.int32)), ValueError,
     "cache_k must be bfloat16, float16 or float32, got torch.int32"),
    ("row-float64", _row, dict(row=torch.ones(T, 1, R + ROPE, dtype=torch.float64)), ValueError,
     "cache_k must be bfloat16, float16 or float32, got torch.float64"),
    ("row-meta", _row, dict(row=torch.ones(T, 1, R + ROPE, device=META)), ValueError, "cache_k must be on .*, got meta"),
    ("row-loc-float", _row, dict(loc=torch.ones(T)), ValueError, "loc must be int32 or int64, got torch.float32"),
    ("row-loc-2d", _row, dict(loc=torch.ones(T, 1, dtype=torch.int64)), ValueError, r"loc must be 1-D \[T\], got shape \(5, 1\)"),
    ("row-loc-short", _row, dict(loc=torch.ones(4, dtype=torch.int64)), ValueError,
     r"loc must have T=5 entries \(one per token\), got 4"),
    ("row-loc-meta", _row, dict(loc=torch.ones(T, dtype=torch.int64, device=META)), ValueError, "loc must be on .*, got meta"),
    ("row-loc-list", _row, dict(loc=BASE_LOC), TypeError, "loc must be a torch.Tensor, got list"),
    ("row-scale-zero", _row, dict(k_scale=0.0), ValueError, "k_scale must be a positive finite float .*got 0.0"),
    ("row-scale-inf", _row, dict(k_scale=float("inf")), ValueError, "k_scale must be a positive finite float .*got inf"),
    ("row-scale-subnormal", _row, dict(k_scale=1e-40), ValueError, "k_scale must be a positive finite float .*got 1e-40"),
    ("row-scale-str", _row, dict(k_scale="0.5"), TypeError, "k_scale must be None, a positive float or a floating-point tensor, got str"),
    ("row-scale-bool", _row, dict(k_scale=True), TypeError, "k_scale must be None, a positive float .*got bool"),
    ("row-scale-int-tensor", _row, dict(k_scale=torch.ones(1, dtype=torch.int32)), ValueError,
     "k_scale must be a floating-point tensor, got torch.int32"),
    ("row-scale-shape", _row, dict(k_scale=torch.ones(2)), ValueError,
     r"k_scale must have one element \(per tensor\) or shape \[1\] or \[1, 1\] \(per head\), got shape \(2,\)"),
    ("row-scale-meta", _row, dict(k_scale=torch.ones(1, device=META)), ValueError, "k_scale must be on .*, got meta"),
    ("row-layer-range", _row, dict(layer=Layer(5)), IndexError, r"layer_id 5 is outside this pool's layers \[3, 4\]"),
    ("row-layer-none", _row, dict(layer=None), TypeError, "a write needs a layer with .layer_id or layer_id_override"),
    ("row-layer-str", _row, dict(layer=Layer("4")), TypeError, "layer_id must be an int, got str"),
    ("parts-nope-not-tensor", _parts, dict(nope=None), TypeError, "cache_k_nope must be a torch.Tensor, got NoneType"),
    ("parts-nope-width", _parts, dict(nope=torch.ones(T, 1, R + 1)), ValueError,
     r"cache_k_nope must have head dim 40 \(shape\[2\]\), got 41"),
    ("parts-rope-width", _parts, dict(rope=torch.ones(T, 1, R + ROPE)), ValueError,
     r"cache_k_rope must have head dim 24 \(shape\[2\]\), got 64"),
    ("parts-rope-heads", _parts, dict(rope=torch.ones(T, 2, ROPE)), ValueError, r"cache_k_rope must have 1 heads"),
    ("parts-rope-tokens", _parts, dict(rope=torch.ones(T - 1, 1, ROPE)), ValueError,
     "cache_k_rope must have T=5 tokens like cache_k_nope, got 4"),
    ("parts-rope-int", _parts, dict(rope=torch.ones(T, 1, ROPE, dtype=torch.int16)), ValueError,
     "cache_k_rope must be bfloat16, float16 or float32, got torch.int16"),
    ("parts-rope-meta", _parts, dict(rope=torch.ones(T, 1, ROPE, device=META)), ValueError, "cache_k_rope must be on .*, got meta"),
    ("parts-loc-long", _parts, dict(loc=torch.ones(6, dtype=torch.int32)), ValueError,
     r"loc must have T=5 entries \(one per token\), got 6"),
    ("parts-scale-negative", _parts, dict(k_scale=-2.0), ValueError, "k_scale must be a positive finite float .*got -2.0"),
    ("parts-scale-shape", _parts, dict(k_scale=torch.ones(1, 2)), ValueError, r"k_scale must have one element .*got shape \(1, 2\)"),
]


def _move(changes: dict) -> dict:
    """Put new tensors on the test device, except those meant to be on another device."""
    return {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) and v.device != META else v) for k, v in changes.items()}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_raises_before_anything_is_written(case, mode):
    _, entry, changes, error, message = case
    pool = make_pool(torch.float8_e4m3fn, mode)
    before = poison_pool(pool)
    args = _base()
    if mode == "never":  # the base call is valid and writes (once is enough: the interpreter is slow)
        entry(args)(pool)
        assert any(not torch.equal(a, b) for a, b in zip(pool.kv_buffer, before)), "the base call must write"
        before = [b.clone() for b in pool.kv_buffer]
    with pytest.raises(error, match=message):
        entry({**args, **_move(changes)})(pool)
    for a, b in zip(pool.kv_buffer, before):
        assert_same_bytes(a, b, "pool buffer after a rejected write")


@pytest.mark.parametrize("entry", [_row, _parts], ids=["row", "parts"])
@pytest.mark.parametrize("mode", MODES)
def test_validate_rejects_slots_past_the_end_and_bad_scale_values(mode, entry):
    pool = make_pool(torch.float8_e4m3fn, mode, validate=True)
    before = poison_pool(pool)
    args = _base()
    bad_loc = torch.tensor([1, 5, -1, 12, 10], device=DEVICE)
    with pytest.raises(IndexError, match=re.escape("loc[3] = 12 is out of range: slots are 0..11")):
        entry({**args, "loc": bad_loc})(pool)
    with pytest.raises(ValueError, match="k_scale must hold positive finite normal float32 values, got 0.0 at index 0"):
        entry({**args, "k_scale": torch.zeros(1, device=DEVICE)})(pool)
    for a, b in zip(pool.kv_buffer, before):
        assert_same_bytes(a, b, "pool buffer after a rejected write")


# ----------------------------------------------------------------------------------------------
# Calibration: one scale for the whole row.


@pytest.mark.parametrize("mode", MODES)
def test_observed_maxima_and_calibrated_scales(mode):
    pool = make_pool(torch.float8_e4m3fn, mode, observe_amax=True)
    assert pool.kv_amax.shape == (LAYERS, 2, 1)
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
    assert len(scales) == LAYERS
    for (k, v), amax in zip(scales, (300.0, 7.0)):
        assert k is v and k.shape == (1,) and k.dtype == torch.float32
        assert k.item() == np.float32(amax / 448.0)
    assert [k.item() for k, _ in pool.calibrated_scales(per_head=True)] == [k.item() for k, _ in scales]
    assert pool.calibrated_scales(margin=2.0, dtype=torch.float8_e5m2)[0][0].item() == np.float32(600.0 / 57344.0)


# ----------------------------------------------------------------------------------------------
# With the allocators.


@pytest.mark.parametrize("page_size", [1, 4])
def test_allocators_hand_out_slots_of_an_mla_pool(page_size):
    pool = make_pool(torch.float8_e4m3fn, size=16, page_size=page_size)
    if page_size == 1:
        allocator = TokenToKVPoolAllocator(pool.size, pool.dtype, DEVICE, kvcache=pool)
    else:
        allocator = PagedTokenToKVPoolAllocator(pool.size, page_size, pool.dtype, DEVICE, kvcache=pool)
    assert allocator.get_kvcache() is pool
    loc = allocator.alloc(8)
    assert loc is not None and int(loc.min()) >= 1 and int(loc.max()) < pool.rows
    rng = np.random.default_rng(2)
    nope = values(rng, (8, 1, R), torch.bfloat16, specials=False).to(DEVICE)
    rope = values(rng, (8, 1, ROPE), torch.bfloat16, specials=False).to(DEVICE)
    pool.set_mla_kv_buffer(Layer(3), loc, nope, rope, 0.1)
    got_nope, got_rope = pool.get_mla_kv_buffer(Layer(3), loc)
    assert_same_bytes(got_nope, kvpool.quantize(nope, torch.float8_e4m3fn, 0.1), "nope")
    assert_same_bytes(got_rope, kvpool.quantize(rope, torch.float8_e4m3fn, 0.1), "rope")
    allocator.free(loc)
    allocator.check_integrity()


# ----------------------------------------------------------------------------------------------
# Moves, CPU copies and the host tier: bytes, through the row-copy kernel (interpreter) or its
# reference; the pool's rows are seen as a latent (K) part and a rotary (V) part.


def random_pool(dtype=torch.float8_e4m3fn, seed=0, **kw) -> MLATokenToKVPool:
    """A CPU pool whose every byte is random (NaN patterns included): every row is distinguishable."""
    with mock.patch.dict(os.environ):
        os.environ.pop("KVPOOL_FUSED", None)
        os.environ.pop("KVPOOL_VALIDATE", None)
        pool = MLATokenToKVPool(kw.pop("size", 30), kw.pop("page_size", 2), dtype, R, ROPE, 3, "cpu",
                                warmup=False, **kw)  # fmt: skip
    fill_random_(pool.kv_buffer, seed)
    return pool


def latent_bytes(pool: MLATokenToKVPool) -> list[torch.Tensor]:
    return [b.view(torch.uint8).reshape(b.shape[0], -1).clone() for b in pool.kv_buffer]


def test_the_row_copy_view_of_the_pool():
    pool = random_pool()
    assert (pool.head_num, pool.head_dim, pool.v_head_dim) == (1, R, ROPE)
    for layer, (k, v, whole) in enumerate(zip(pool.k_buffer, pool.v_buffer, pool.kv_buffer)):
        assert k.data_ptr() == whole.data_ptr() and v.data_ptr() == whole[:, :, R:].data_ptr()
        assert torch.equal(torch.cat((k, v), dim=2), whole), f"layer {layer}: the parts are the row"


MLA_MOVES = {
    "cycle": ([1, 2, 3], [2, 3, 1]),
    "chain": ([4, 5, 6, 7], [5, 6, 7, 8]),
    "swap-and-same": ([1, 2, 9], [2, 1, 9]),
    "skips": ([-1, 40, 5, 6], [3, 4, 99, -2]),
}


@pytest.mark.parametrize("name", list(MLA_MOVES))
def test_move_kv_cache_moves_whole_rows_as_if_read_first(copy_path, name):
    pool = random_pool(seed=len(name))
    tgt, src = MLA_MOVES[name]
    before = latent_bytes(pool)
    pool.move_kv_cache(torch.tensor(tgt), torch.tensor(src, dtype=torch.int32))
    after = latent_bytes(pool)
    rows = pool.rows
    moved = {t: s for t, s in zip(tgt, src) if 0 <= t < rows and 0 <= s < rows}
    for layer in range(3):
        for r in range(rows):
            want = before[layer][moved.get(r, r)]
            assert torch.equal(after[layer][r], want), f"{name}: layer {layer} row {r}"


def test_move_kv_cache_through_staging(copy_path, monkeypatch):
    monkeypatch.setattr(copy_rows, "ONE_PASS_MAX_PAIRS", 4)
    pool = random_pool(seed=9)
    before = latent_bytes(pool)
    tgt, src = list(range(8)), [1, 2, 3, 4, 5, 6, 7, 0]  # an 8-cycle: more pairs than one pass takes
    pool.move_kv_cache(torch.tensor(tgt), torch.tensor(src))
    for layer, b in enumerate(latent_bytes(pool)):
        assert torch.equal(b[:8], before[layer][src]) and torch.equal(b[8:], before[layer][8:])


def test_move_kv_cache_rejects_bad_input_before_writing():
    pool = random_pool(validate=True)
    before = latent_bytes(pool)
    with pytest.raises(IndexError, match=r"src_loc\[1\] = 32 is out of range: rows are 0..31"):
        pool.move_kv_cache(torch.tensor([1, 2]), torch.tensor([3, 32]))
    with pytest.raises(ValueError, match=r"src_loc must have as many entries as tgt_loc \(2\), got 1"):
        pool.move_kv_cache(torch.tensor([1, 2]), torch.tensor([3]))
    with pytest.raises(ValueError, match="tgt_loc must be int32 or int64, got torch.float32"):
        pool.move_kv_cache(torch.tensor([1.0]), torch.tensor([3]))
    for a, b in zip(before, latent_bytes(pool)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=str)
def test_cpu_copy_round_trip_is_exact(copy_path, dtype):
    pool = random_pool(dtype, seed=4)
    slots = torch.tensor([7, 3, 8, 31, 0])
    copy = pool.get_cpu_copy(slots)
    assert len(copy) == 5 and copy.dtype == dtype and copy.start_layer == 0
    assert copy.k.shape == (3, 5, 1, R) and copy.v.shape == (3, 5, 1, ROPE)
    for layer in range(3):
        assert_same_bytes(torch.cat((copy.k[layer], copy.v[layer]), dim=2), pool.kv_buffer[layer][slots], f"layer {layer}")
    originals = [b[slots].clone() for b in pool.kv_buffer]
    before = latent_bytes(pool)
    targets = torch.tensor([20, 21, 22, 23, 24], dtype=torch.int32)
    pool.load_cpu_copy(copy, targets)
    untouched = torch.ones(pool.rows, dtype=torch.bool)
    untouched[targets.long()] = False
    for layer, b in enumerate(latent_bytes(pool)):
        assert torch.equal(b[targets.long()], originals[layer].view(torch.uint8).reshape(5, -1))
        assert torch.equal(b[untouched], before[layer][untouched])
    with pytest.raises(ValueError, match=r"kv_cache_cpu.k must have shape \(3, 4, 1, 40\)"):
        pool.load_cpu_copy(copy, targets[:4])
    with pytest.raises(IndexError, match=r"indices\[1\] = 32 is out of range: slots are 0..31"):
        pool.get_cpu_copy(torch.tensor([1, 32]))


def test_allocator_cpu_copies_go_through_the_mla_pool():
    pool = random_pool(seed=5, page_size=1)  # a token allocator hands out slots of a pool of one-slot pages
    allocator = TokenToKVPoolAllocator(pool.size, pool.dtype, "cpu", kvcache=pool)
    slots = allocator.alloc(4)
    copy = allocator.get_cpu_copy(slots)
    originals = [b[slots].clone() for b in pool.kv_buffer]
    for b in pool.kv_buffer:
        b[slots] = 0
    allocator.load_cpu_copy(copy, slots)
    for b, o in zip(pool.kv_buffer, originals):
        assert torch.equal(b[slots], o)


@pytest.mark.parametrize("backend", host_tier.IO_BACKENDS)
@pytest.mark.parametrize("layout", host_tier.LAYOUTS)
def test_host_tier_parks_and_reloads_latent_rows(copy_path, layout, backend):
    if copy_path == "kernel" and backend == "direct":
        pytest.skip("the direct backend's device side is the same row copy; the interpreter runs the kernel backend")
    pool = random_pool(seed=6, page_size=4, size=40)
    host = MLATokenToKVPoolHost(pool, 2.0, 0, 4, layout, staging_bytes=3000)  # a few rows per staging chunk
    assert host.size == 80 and host.size_per_token == 3 * (R + ROPE)
    assert (host.kv_lora_rank, host.qk_rope_head_dim) == (R, ROPE)
    h = host.alloc(8)
    h = torch.cat((h[4:], h[:4]))  # pages out of order
    d = torch.tensor([5, 6, 7, 8, 30, 2, 3, 43])
    before = latent_bytes(pool)
    host.backup_from_device_all_layer(pool, h, d, backend)
    other = random_pool(seed=7, page_size=4, size=40)
    untouched = latent_bytes(other)
    t = torch.tensor([1, 2, 3, 4, 9, 10, 11, 12])
    host.load_to_device_per_layer(other, h, t, 1, backend)
    got = latent_bytes(other)
    assert torch.equal(got[1][t], before[1][d]) and torch.equal(got[0], untouched[0]) and torch.equal(got[2], untouched[2])
    host.load_to_device_all_layer(other, h, t, backend)
    for layer, b in enumerate(latent_bytes(other)):
        assert torch.equal(b[t], before[layer][d]), f"layer {layer}"
        mask = torch.ones(other.rows, dtype=torch.bool)
        mask[t] = False
        assert torch.equal(b[mask], untouched[layer][mask])
    # a page for a storage tier: the latent parts of every layer, then the rotary parts
    page = host.get_data_page(int(h[0]))
    assert page.numel() == 4 * 3 * (R + ROPE)
    host.set_from_flat_data_page(int(h[4]), page)
    assert torch.equal(host.get_data_page(int(h[4])), page)


def test_host_tier_takes_only_an_mla_pool():
    mha = kvpool.MHATokenToKVPool(8, 1, torch.float8_e4m3fn, 1, R, 1, "cpu", v_head_dim=ROPE, warmup=False)
    with pytest.raises(TypeError, match="device_pool must be an MLATokenToKVPool, got MHATokenToKVPool"):
        MLATokenToKVPoolHost(mha, 2.0, 0, 1, "layer_first")


# ----------------------------------------------------------------------------------------------
# On CUDA, at DeepSeek-V3's geometry: the compiled kernel writing latent rows against the reference
# path and the oracle, CUDA graphs, no synchronisation, no allocation, and the row copies. Every
# comparison is byte for byte; the oracle's accepts any NaN code where both are NaN,
# fused-against-reference does not.

DS_R, DS_ROPE, DS_W = 512, 64, 576  # DeepSeek-V3


def _projection_row(t: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Latent rows [T, 1, 576] as columns of a wider projection output (token stride 576 + 128)."""
    return cuda_values((t, 1, DS_W + 128), dtype, seed)[:, :, 64 : 64 + DS_W]


def _cuda_pools(dtype: torch.dtype, slots: int = 5000, **kw) -> tuple[MLATokenToKVPool, MLATokenToKVPool]:
    fused = MLATokenToKVPool(slots, 1, dtype, DS_R, DS_ROPE, 2, "cuda", **kw)
    ref = MLATokenToKVPool(slots, 1, dtype, DS_R, DS_ROPE, 2, "cuda", fused="never", **kw)
    for pool in (fused, ref):
        for b in pool.kv_buffer:
            poison_(b)
    return fused, ref


def _same_mla_pools(fused: MLATokenToKVPool, ref: MLATokenToKVPool, what: str) -> None:
    for i, (a, b) in enumerate(zip(fused.kv_buffer, ref.kv_buffer)):
        assert_same_bytes(a, b, f"{what}: layer {i}")


@gpu
@pytest.mark.parametrize("cache_dtype", FP8 + [torch.bfloat16], ids=id_of)
def test_mla_pool_matches_reference_grid(cache_dtype):
    """Both entry points, every input dtype and scale kind, decode to prefill sizes, padding and
    out-of-range slots; fused pool and reference pool byte for byte."""
    fused, ref = _cuda_pools(cache_dtype)
    slots = fused.rows
    for t, in_dtype, kind in itertools.product([1, 7, 128, 4096], INPUT_DTYPES, ["none", "float", "tensor"]):
        seed = t * 7 + INPUT_DTYPES.index(in_dtype)
        row = _projection_row(t, in_dtype, seed)
        nope = cuda_values((t, 1, DS_R), in_dtype, seed + 1)
        rope = cuda_values((t, 2, DS_ROPE), in_dtype, seed + 2)[:, 1:]  # one head of a [T, 2, 64] tensor
        loc = torch.randperm(slots, device="cuda", generator=cuda_gen(seed))[:t]
        if t > 3:
            loc[0], loc[2] = -1, slots + 17
        s = cuda_scale(kind, 1)
        for pool in (fused, ref):
            pool.set_kv_buffer(Layer(0), loc, row, None, s)
            pool.set_mla_kv_buffer(Layer(1), loc.flip(0), nope, rope, s)
        _same_mla_pools(fused, ref, f"T={t} {in_dtype} scale={kind}")
    assert fused.stats.reference_calls == 0 and ref.stats.fused_calls == 0


@gpu
@pytest.mark.parametrize("entry", ["row", "parts"])
@pytest.mark.parametrize("cache_dtype", FP8 + [torch.bfloat16, torch.float16], ids=id_of)
def test_every_bf16_bit_pattern_through_the_mla_write(cache_dtype, entry):
    """All 65,536 bf16 patterns in the rotary columns (once each) and in the latent columns (eight
    times each), through the pool's fused write, against the reference pool (bytes) and the oracle
    (codes), for several scales."""
    every = torch.arange(65536, dtype=torch.int32, device="cuda").to(torch.int16).view(torch.bfloat16)
    rope = every.reshape(1024, 1, DS_ROPE)
    nope = every.repeat(8).reshape(1024, 1, DS_R).roll(1, dims=0)  # each token pairs different patterns
    row = torch.cat((nope, rope), dim=2)
    loc = torch.arange(1, 1025, device="cuda")
    for s in (None, 0.37, 2.0**-7, torch.tensor([3.3], device="cuda")):
        fused, ref = _cuda_pools(cache_dtype, slots=1100)
        for pool in (fused, ref):
            if entry == "row":
                pool.set_kv_buffer(Layer(0), loc, row, None, s)
            else:
                pool.set_mla_kv_buffer(Layer(0), loc, nope, rope, s)
        _same_mla_pools(fused, ref, f"scale={s}")
        fmt = FORMAT_OF[cache_dtype]
        poisoned = poison_(torch.empty(1101, 1, DS_W, dtype=cache_dtype))
        expected = expected_latent_cache(codes_of(poisoned), [nope.cpu(), rope.cpu()], loc.tolist(), cache_dtype,
                                         s.cpu() if isinstance(s, torch.Tensor) else s)
        assert_codes_equal(fused.get_key_buffer(0), expected, fmt, f"oracle, scale={s}")


KERNEL_VARIANTS = {
    "native-fastdiv": KernelOptions(soft_cast=False, fast_div=True),
    "native-divrn": KernelOptions(soft_cast=False, fast_div=False),
    "soft-divrn": KernelOptions(soft_cast=True, fast_div=False),
}


@gpu
@pytest.mark.parametrize("joined", [False, True], ids=["per-part", "joined"])
@pytest.mark.parametrize("variant", list(KERNEL_VARIANTS))
@pytest.mark.parametrize("cache_dtype", FP8, ids=id_of)
def test_kernel_variants_on_the_two_views_of_one_buffer(cache_dtype, variant, joined):
    """The kernel's code paths on the MLA geometry (the pool takes the default division and encoder,
    and the joined plan), launched on the latent and rotary column views of one caller-owned buffer
    inside guard rows: equal to the reference, and nothing outside the window or the named rows
    changes."""
    slots, guard, t = 3000, 16, 2048
    backing = poison_(torch.empty(slots + 2 * guard, 1, DS_W, dtype=cache_dtype, device="cuda"))
    before = bits(backing).clone()
    window = backing[guard:-guard]
    nope, rope = cuda_values((t, 1, DS_R), torch.bfloat16, 5), cuda_values((t, 1, DS_ROPE), torch.float32, 6)
    loc = torch.randperm(slots, device="cuda", generator=cuda_gen(7))[:t]
    loc[:64] = torch.randint(-(2**40), 2**40, (64,), device="cuda", generator=cuda_gen(8))  # mostly out of range
    loc[64:80] = slots + torch.arange(16, device="cuda")
    for s in (0.37, 1e-30, torch.tensor([2.0**-5], device="cuda")):
        launch_store_kv(nope, rope, window[:, :, :DS_R], window[:, :, DS_R:], loc, s, s, options=KERNEL_VARIANTS[variant],
                        joined=joined)  # fmt: skip
        expected = poison_(torch.empty(slots, 1, DS_W, dtype=cache_dtype, device="cuda"))
        reference_set_kv_buffer(nope, rope, expected[:, :, :DS_R], expected[:, :, DS_R:], loc, s, s)
        torch.cuda.synchronize()
        assert torch.equal(bits(backing)[:guard], before[:guard]), "wrote below the window"
        assert torch.equal(bits(backing)[-guard:], before[-guard:]), "wrote past the window"
        assert_same_bytes(window, expected, f"window, scale={s}")



@gpu
def test_mla_warmup_compiles_what_the_first_calls_need():
    pool = MLATokenToKVPool(4096, 1, torch.float8_e5m2, DS_R, DS_ROPE, 2, "cuda")
    assert pool.warmup_seconds is not None
    compiled = compiled_variants()
    for in_dtype, loc_dtype, s in itertools.product(
        INPUT_DTYPES, (torch.int32, torch.int64), (None, 0.25, torch.tensor([0.5], device="cuda"))
    ):
        row = _projection_row(7, in_dtype, 1)
        loc = torch.arange(1, 8, device="cuda", dtype=loc_dtype)
        pool.set_kv_buffer(None, loc, row.contiguous(), None, s, layer_id_override=1)
        pool.set_kv_buffer(None, loc[:1], row[:1].contiguous(), None, s, layer_id_override=0)
        nope = row[:, :, :DS_R].contiguous()  # e.g. a normalised latent: its own tensor
        pool.set_mla_kv_buffer(None, loc, nope, row.contiguous()[:, :, DS_R:], s, layer_id_override=0)
        pool.set_mla_kv_buffer(None, loc[:1], nope[:1], torch.zeros(1, 1, DS_ROPE, dtype=in_dtype, device="cuda"), s,
                               layer_id_override=1)  # fmt: skip
        big = _projection_row(SMALL_TOKENS + 1, in_dtype, 2).contiguous()  # large writes take another tile
        big_loc = torch.arange(1, SMALL_TOKENS + 2, device="cuda", dtype=loc_dtype)
        pool.set_kv_buffer(None, big_loc, big, None, s, layer_id_override=1)
        pool.set_mla_kv_buffer(None, big_loc, big[:, :, :DS_R].contiguous(), big[:, :, DS_R:], s, layer_id_override=0)
    assert compiled_variants() == compiled, "a first call compiled a variant the warmup missed"
    assert pool.stats.fused_calls == 6 * 3 * 2 * 3 and pool.stats.reference_calls == 0


@gpu
def test_mla_cuda_graph_replays_with_the_current_scale_and_slots():
    fused, ref = _cuda_pools(torch.float8_e4m3fn, slots=4096)
    scale = torch.tensor([0.5], device="cuda")
    static_row = cuda_values((64, 1, DS_W), torch.bfloat16, 1)
    static_loc = torch.randperm(4096, device="cuda")[:64] + 1
    fused.set_kv_buffer(None, static_loc, static_row, None, scale, layer_id_override=0)  # warm this variant
    fused.set_mla_kv_buffer(None, static_loc, static_row[:, :, :DS_R], static_row[:, :, DS_R:], scale, layer_id_override=1)
    ref.set_kv_buffer(None, static_loc, static_row, None, scale, layer_id_override=0)
    ref.set_mla_kv_buffer(None, static_loc, static_row[:, :, :DS_R], static_row[:, :, DS_R:], scale, layer_id_override=1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused.set_kv_buffer(None, static_loc, static_row, None, scale, layer_id_override=0)
        fused.set_mla_kv_buffer(None, static_loc, static_row[:, :, :DS_R], static_row[:, :, DS_R:], scale,
                                layer_id_override=1)  # fmt: skip
    for step, s in enumerate([0.37, 1e-3, 7.0]):
        scale.fill_(s)
        static_row.copy_(cuda_values((64, 1, DS_W), torch.bfloat16, 100 + step))
        static_loc.copy_(torch.randperm(4096, device="cuda")[:64] + 1)
        graph.replay()
        ref_scale = torch.tensor([s], device="cuda")
        ref.set_kv_buffer(None, static_loc, static_row, None, ref_scale, layer_id_override=0)
        ref.set_mla_kv_buffer(None, static_loc, static_row[:, :, :DS_R], static_row[:, :, DS_R:], ref_scale,
                              layer_id_override=1)  # fmt: skip
        torch.cuda.synchronize()
        _same_mla_pools(fused, ref, f"replay {step}")


@gpu
def test_mla_writes_allocate_nothing_and_reads_never_synchronise():
    pool = MLATokenToKVPool(4096, 1, torch.float8_e4m3fn, DS_R, DS_ROPE, 2, "cuda")
    row = _projection_row(300, torch.bfloat16, 6)
    nope = cuda_values((300, 1, DS_R), torch.bfloat16, 7)
    loc32 = (torch.randperm(4096, device="cuda")[:300] + 1).to(torch.int32)
    loc64 = loc32.long()
    scale = torch.tensor([0.37], device="cuda")
    writes = [
        lambda: pool.set_kv_buffer(None, loc32, row, None, scale, layer_id_override=0),
        lambda: pool.set_kv_buffer(Layer(1), loc64, row, None, 0.37),
        lambda: pool.set_mla_kv_buffer(None, loc64, nope, row[:, :, DS_R:], scale, layer_id_override=1),
        lambda: pool.set_mla_kv_buffer(Layer(0), loc32, nope, row[:, :, DS_R:]),
    ]
    for call in writes:
        call()
    torch.cuda.synchronize()
    allocs_before = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
    with no_sync():
        for _ in range(3):
            for call in writes:
                call()
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats().get("allocation.all.allocated", 0) == allocs_before
    with_padding = torch.cat((loc64[:5], torch.tensor([-1, 5000, 2**40], device="cuda")))
    torch.cuda.synchronize()
    with no_sync():  # the gather allocates its outputs, but never waits for the device
        for loc in (loc32, with_padding):
            pool.get_mla_kv_buffer(Layer(1), loc)
            pool.get_mla_kv_buffer(Layer(1), loc, dst_dtype=torch.bfloat16)
    assert pool.stats.fused_calls == 4 * len(writes) and pool.stats.reference_calls == 0


@gpu
def test_mla_get_mla_kv_buffer_on_the_device():
    pool = MLATokenToKVPool(1000, 1, torch.float8_e4m3fn, DS_R, DS_ROPE, 1, "cuda")
    poison_(pool.kv_buffer[0])
    row = cuda_values((8, 1, DS_W), torch.bfloat16, 9)
    pool.set_kv_buffer(Layer(0), torch.arange(10, 18, device="cuda"), row, None, 0.5)
    loc = torch.tensor([17, -1, 10, 1001, 2**33, 0], device="cuda")
    nope, rope = pool.get_mla_kv_buffer(Layer(0), loc)
    buf = pool.get_key_buffer(0)
    for t, slot in enumerate([17, None, 10, None, None, 0]):
        if slot is None:
            assert not bits(nope[t]).any() and not bits(rope[t]).any()
        else:
            assert_same_bytes(nope[t], buf[slot, :, :DS_R], f"nope {slot}")
            assert_same_bytes(rope[t], buf[slot, :, DS_R:], f"rope {slot}")
    as_bf16 = pool.get_mla_kv_buffer(Layer(0), loc, dst_dtype=torch.bfloat16)
    assert_same_bytes(as_bf16[0], nope.to(torch.bfloat16), "cast nope")


@gpu
def test_mla_observed_maxima_match_the_reference_path():
    fused, ref = _cuda_pools(torch.float8_e4m3fn, slots=3000, observe_amax=True)
    for t, seed in ((1, 1), (300, 2), (2048, 3)):
        row = _projection_row(t, torch.bfloat16, seed)
        loc = torch.randperm(3000, device="cuda", generator=cuda_gen(seed))[:t]
        loc[: t // 3] = -1  # padding tokens are not observed
        for pool in (fused, ref):
            pool.set_kv_buffer(Layer(0), loc, row, None, 0.5)
            pool.set_mla_kv_buffer(Layer(1), loc, row[:, :, :DS_R] * 3, row[:, :, DS_R:] / 7, 0.5)
    torch.cuda.synchronize()
    assert torch.equal(fused.kv_amax, ref.kv_amax)
    assert fused.stats.reference_calls == 0
    for (k, v), (rk, _) in zip(fused.calibrated_scales(), ref.calibrated_scales()):
        assert k is v and torch.equal(k, rk)


@gpu
def test_mla_reduce_overhead_compile_matches_eager():
    torch._dynamo.reset()
    layers = [Layer(0), Layer(1)]
    compiled_pool, eager_pool = _cuda_pools(torch.float8_e4m3fn, slots=4096)
    scale = torch.tensor([0.37], device="cuda")

    def step(pool, x, loc):
        pool.set_kv_buffer(layers[0], loc, x, None, scale)
        pool.set_mla_kv_buffer(layers[1], loc, x[:, :, :DS_R] * 2, x[:, :, DS_R:], scale)
        nope, rope = pool.get_mla_kv_buffer(layers[1], loc)
        # integer sums of the bytes: exact in any order, so compiled and eager agree bit for bit
        return nope.view(torch.uint8).to(torch.int64).sum() + rope.view(torch.uint8).to(torch.int64).sum()

    compiled = torch.compile(lambda x, loc: step(compiled_pool, x, loc), mode="reduce-overhead", fullgraph=True)
    for i in range(4):
        x = cuda_values((32, 1, DS_W), torch.bfloat16, 200 + i)
        loc = torch.randperm(4096, device="cuda")[:32] + 1
        out = compiled(x, loc)
        expected = step(eager_pool, x, loc)
        torch.cuda.synchronize()
        assert torch.equal(out, expected)
        _same_mla_pools(compiled_pool, eager_pool, f"step {i}")


# --- moves, CPU copies and the host tier on the device -------------------------------------------------


def _random_cuda_pool(slots: int, page_size: int, seed: int, layers: int = 3) -> MLATokenToKVPool:
    pool = MLATokenToKVPool(slots, page_size, torch.float8_e4m3fn, DS_R, DS_ROPE, layers, "cuda", warmup=False)
    g = cuda_gen(seed)
    for b in pool.kv_buffer:
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, device="cuda", generator=g))
    return pool


@gpu
def test_mla_moves_and_cpu_copies_on_the_device():
    pool = _random_cuda_pool(5000, 1, 1)
    for n in (7, 1000, 3000):  # one pass up to 1024 pairs; more go through a staging buffer
        perm = torch.randperm(pool.rows, device="cuda", generator=cuda_gen(n))[:n]
        tgt, src = perm, perm.roll(1)  # an n-cycle: every source is also a target
        expected = []
        for b in pool.kv_buffer:
            e = b.clone()
            e[tgt] = b[src]  # sources read before any target is written
            expected.append(e)
        pool.move_kv_cache(tgt, src)
        for layer, (b, e) in enumerate(zip(pool.kv_buffer, expected)):
            assert_same_bytes(b, e, f"move of {n} rows, layer {layer}")
    small = torch.tensor([3, 4, 5], device="cuda")
    torch.cuda.synchronize()
    with no_sync():
        pool.move_kv_cache(small, small.flip(0))
    slots = torch.randperm(pool.rows, device="cuda", generator=cuda_gen(9))[:300]
    copy = pool.get_cpu_copy(slots)
    assert copy.k.is_pinned() and copy.k.shape == (3, 300, 1, DS_R) and copy.v.shape == (3, 300, 1, DS_ROPE)
    rows = [b[slots].cpu() for b in pool.kv_buffer]
    for layer in range(3):
        assert_same_bytes(torch.cat((copy.k[layer], copy.v[layer]), dim=2), rows[layer], f"CPU copy layer {layer}")
    targets = torch.randperm(pool.rows, device="cuda", generator=cuda_gen(10))[:300]
    pool.load_cpu_copy(copy, targets)
    torch.cuda.synchronize()
    for layer in range(3):
        assert_same_bytes(pool.kv_buffer[layer][targets].cpu(), rows[layer], f"reloaded layer {layer}")


@gpu
@pytest.mark.parametrize("backend", ["kernel", "direct"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_mla_host_tier_on_the_device(layout, backend):
    from kvpool import MLATokenToKVPoolHost

    pool = _random_cuda_pool(4096, 16, 2, layers=4)
    host = MLATokenToKVPoolHost(pool, 2.0, 0, 16, layout, staging_bytes=1 << 20)
    # page-locked in place with cudaHostRegister (torch 2.11's is_pinned() ignores such memory)
    region = host._pinned
    assert host.pin_memory and region is not None
    for buf in (host.k_buffer, host.v_buffer):
        assert region.ptr <= buf.data_ptr() and buf.data_ptr() + buf.numel() * buf.element_size() <= region.ptr + region.nbytes
    h = host.alloc(1024)
    d = torch.randperm(pool.rows, device="cuda", generator=cuda_gen(3))[:1024]
    host.backup_from_device_all_layer(pool, h, d, backend).synchronize()
    other = _random_cuda_pool(4096, 16, 4, layers=4)
    before = [b.cpu() for b in other.kv_buffer]
    other.register_layer_transfer_counter(host.layer_transfer_counter)
    t = torch.randperm(other.rows, device="cuda", generator=cuda_gen(5))[:1024]
    host.load_to_device_all_layer(other, h, t, backend)
    untouched = torch.ones(other.rows, dtype=torch.bool)
    untouched[t.cpu()] = False
    for layer in range(4):
        got = other.get_key_buffer(layer).view(torch.uint8)[t]  # the getter waits for the layer's load
        assert_same_bytes(got.cpu(), pool.kv_buffer[layer][d].cpu(), f"{layout}/{backend} layer {layer}")
        assert torch.equal(other.kv_buffer[layer].cpu()[untouched], before[layer][untouched])
