"""The MLA pool on CUDA at DeepSeek-V3's geometry and real sizes (skipped without a CUDA device): the
compiled kernel writing latent rows against the reference path and the oracle, every bf16 bit
pattern, kernel variants, warmup, CUDA graphs, no synchronisation and no allocation, observed maxima,
``torch.compile``, and the moves, CPU copies and host tier on the device.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kvassert import (
    FORMAT_OF,
    FP8,
    INPUT_DTYPES,
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
    gpu,
    id_of,
    no_sync,
    poison_,
)
from kvpool import MLATokenToKVPool, MLATokenToKVPoolHost, reference_set_kv_buffer
from kvpool.config import KernelOptions
from kvpool.kernels.store_kv.op import launch_store_kv
from kvpool.kernels.store_kv.plan import SMALL_TOKENS

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy inside Triton's interpreter


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
