"""GPU tests of the write features: the verify write, calibration (amax observation) and NaN bits,
on the compiled kernel (skipped without CUDA).

Every comparison is byte for byte, NaN bits included. tests/test_prefix_write.py,
tests/test_calibration.py and tests/test_nan_and_grad.py also run on a CUDA machine (on the device);
this file adds what needs one: real shapes, CUDA graphs, no synchronisation, no allocation, and the
compiled variants Triton holds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvassert import assert_same_bytes, bits, poison_
from kvpool import MHATokenToKVPool, reference_set_kv_buffer
from kvpool.config import KernelOptions
from kvpool.kernels import store_kv_kernel
from kvpool.kernels.store_kv_op import launch_store_kv

pytestmark = pytest.mark.gpu

DEV = "cuda"
H, D = 8, 128
SIZE = 4096
ROWS = SIZE + 1
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _name(x) -> str:
    return str(x).replace("torch.", "")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def _rows(t: int, h: int, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values over ~2^-24..2^14 (overflow, normals, subnormals of both FP8 formats)."""
    g = _gen(seed)
    x = torch.randn(t, h, d, device=DEV, generator=g)
    x = x * torch.exp2(torch.randint(-24, 14, (t, h, d), device=DEV, generator=g).float())
    return x.to(dtype)


def _pool(dtype=torch.float8_e4m3fn, fused="always", heads=H, dim=D, **kw) -> MHATokenToKVPool:
    pool = MHATokenToKVPool(SIZE, 1, dtype, heads, dim, 2, DEV, fused=fused, **kw)
    for buf in pool.k_buffer + pool.v_buffer:  # after warmup, which writes zeros to slot 0
        poison_(buf)
    return pool


def _assert_pools_equal(a, b, what, layers=(0, 1)) -> None:
    for layer in layers:
        for x, y, kv in zip(a.get_kv_buffer(layer), b.get_kv_buffer(layer), "KV"):
            assert_same_bytes(x, y, f"{what}: layer {layer} {kv}")


def _scale(kind: str, heads: int = H):
    return {
        "none": None,
        "float": 0.37,
        "tensor": torch.tensor([3.3], device=DEV),
        "per_head": torch.linspace(0.05, 7.0, heads, device=DEV),
    }[kind]


def _verify_inputs(bs, width, loc_dtype, commit_dtype, layout, seed):
    """loc_2d [bs, width] in the given layout (distinct in-range slots, some padding, some out of
    range), commit_lens [bs] covering 0, width, negative, beyond width and random values."""
    g = _gen(seed)
    t = bs * width
    loc = torch.randperm(ROWS, device=DEV, generator=g)[:t].reshape(bs, width)
    loc[5, 1], loc[6, 0], loc[7, width - 1] = -1, ROWS, ROWS + 100
    loc[8, 0] = 2**31 - 1 if loc_dtype == torch.int32 else 2**40
    loc = loc.to(loc_dtype)
    if layout == "slice":
        big = torch.full((bs + 3, width + 7), -5, dtype=loc_dtype, device=DEV)
        big[2 : 2 + bs, 3 : 3 + width] = loc
        loc_2d = big[2 : 2 + bs, 3 : 3 + width]
    elif layout == "transposed":
        loc_2d = loc.t().contiguous().t()
    else:
        loc_2d = loc
    assert torch.equal(loc_2d, loc)
    commit = torch.randint(-2, width + 3, (bs,), device=DEV, generator=g)
    commit[:4] = torch.tensor([0, width, -1, width + 5], device=DEV)
    commit[5:9] = width  # the rows holding padding and out-of-range slots are committed
    return loc_2d, commit.to(commit_dtype)


def _committed(loc_2d, commit):
    """(token indices, their slots) of the committed tokens, in token order."""
    width = loc_2d.shape[1]
    mask = torch.arange(width, device=DEV)[None, :] < commit.long()[:, None]
    idx = mask.reshape(-1).nonzero().squeeze(1)
    return idx, loc_2d.long().reshape(-1)[idx]


# --- the verify write ------------------------------------------------------------------------------


@pytest.mark.parametrize("scale_kind", ["none", "float", "tensor", "per_head"])
@pytest.mark.parametrize("cache_dtype", FP8 + [torch.bfloat16], ids=_name)
def test_verify_write_matches_reference_and_the_plain_write(cache_dtype, scale_kind):
    fused, ref, plain = _pool(cache_dtype), _pool(cache_dtype, "never"), _pool(cache_dtype, "never")
    bs, width = 64, 8
    i32, i64 = torch.int32, torch.int64
    cases = [("contiguous", i64, i64), ("slice", i32, i32), ("transposed", i64, i32), ("slice", i64, i64), ("transposed", i32, i64)]
    for n, (layout, loc_dtype, commit_dtype) in enumerate(cases):
        what = f"{layout} loc {_name(loc_dtype)} commit {_name(commit_dtype)}"
        for pool in (fused, ref, plain):
            for buf in pool.k_buffer + pool.v_buffer:
                poison_(buf)
        loc_2d, commit = _verify_inputs(bs, width, loc_dtype, commit_dtype, layout, seed=n)
        qkv = _rows(bs * width, 6 * H, D, torch.bfloat16, seed=100 + n)
        k, v = qkv[:, 4 * H : 5 * H], qkv[:, 5 * H :]  # strided views of a fused projection
        ks, vs = _scale(scale_kind), _scale(scale_kind)
        for pool in (fused, ref):
            pool.set_kv_buffer_prefix_valid(None, loc_2d, commit, k, v, ks, vs, layer_id_override=1)
        _assert_pools_equal(fused, ref, f"{what}: fused vs reference")
        idx, slots = _committed(loc_2d, commit)
        plain.set_kv_buffer(None, slots, k[idx], v[idx], ks, vs, layer_id_override=1)
        _assert_pools_equal(plain, ref, f"{what}: verify write vs set_kv_buffer of the committed tokens")
        written = torch.zeros(ROWS, dtype=torch.bool, device=DEV)
        written[slots[(slots >= 0) & (slots < ROWS)]] = True
        untouched = bits(fused.get_key_buffer(1))[~written]
        assert (untouched == (0xFF if cache_dtype.itemsize == 1 else -1)).all(), f"{what}: a row not committed changed"
    assert fused.stats.fused_calls == len(cases) and fused.stats.reference_calls == 0


def test_verify_writes_alternating_commit_lens_dtypes_on_one_pool():
    """The same loc_2d and inputs with commit_lens int32, then int64, then back: each call is a
    direct launch after the first of its kind, and must launch the variant compiled for its
    commit_lens type (an int64 [3, 1] read as int32 is [3, 0])."""
    pool, ref = _pool(), _pool(fused="never")
    bs, width = 32, 4
    loc_2d = torch.randperm(ROWS, device=DEV)[: bs * width].reshape(bs, width)
    g = _gen(8)
    for step, dtype in enumerate([torch.int32, torch.int64, torch.int32, torch.int64, torch.int64, torch.int32]):
        commit = torch.randint(0, width + 1, (bs,), device=DEV, generator=g).to(dtype)
        x = _rows(bs * width, H, D, torch.bfloat16, 200 + step)
        for p in (pool, ref):
            p.set_kv_buffer_prefix_valid(None, loc_2d, commit, x, x, 0.5, 0.5, layer_id_override=0)
        torch.cuda.synchronize()
        _assert_pools_equal(pool, ref, f"step {step}: commit_lens {_name(dtype)}", layers=(0,))


def test_verify_write_in_a_cuda_graph_reads_commit_lens_on_replay():
    pool, ref = _pool(), _pool(fused="never")
    bs, width = 16, 4
    static_loc = torch.randperm(ROWS, device=DEV)[: bs * width].reshape(bs, width)
    static_commit = torch.zeros(bs, dtype=torch.int32, device=DEV)
    static_k = _rows(bs * width, H, D, torch.bfloat16, 1)
    static_v = _rows(bs * width, H, D, torch.bfloat16, 2)
    k_scale = torch.tensor([0.5], device=DEV)
    # compile the variant outside the capture (commit_lens all 0: writes nothing)
    pool.set_kv_buffer_prefix_valid(None, static_loc, static_commit, static_k, static_v, k_scale, 2.0, layer_id_override=1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pool.set_kv_buffer_prefix_valid(None, static_loc, static_commit, static_k, static_v, k_scale, 2.0, layer_id_override=1)
    g = _gen(3)
    for step in range(5):
        if step == 2:
            static_commit.zero_()  # a replay that commits nothing
        else:
            static_commit.copy_(torch.randint(-1, width + 2, (bs,), device=DEV, generator=g).int())
        static_loc.copy_(torch.randperm(ROWS, device=DEV, generator=g)[: bs * width].reshape(bs, width))
        static_loc[0, 0] = -1
        static_k.copy_(_rows(bs * width, H, D, torch.bfloat16, 10 + step))
        static_v.copy_(_rows(bs * width, H, D, torch.bfloat16, 20 + step))
        k_scale.fill_([0.37, 1e-3, 7.0, 3.3, 0.9][step])
        graph.replay()
        ref.set_kv_buffer_prefix_valid(None, static_loc, static_commit, static_k, static_v, k_scale, 2.0, layer_id_override=1)
        torch.cuda.synchronize()
        _assert_pools_equal(pool, ref, f"replay {step}", layers=(1,))


def _sync_free(calls, what):
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            for call in calls:
                call()
    except RuntimeError as exc:
        raise AssertionError(f"{what}: a call synchronised: {exc}") from exc
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_verify_and_observing_writes_neither_synchronise_nor_allocate_on_the_fused_path():
    plain, observing = _pool(), _pool(observe_amax=True)
    t = 96
    x = _rows(t, H, D, torch.bfloat16, 4)
    qkv = _rows(t, 6 * H, D, torch.float16, 5)
    loc_2d = torch.randperm(ROWS, device=DEV)[:t].reshape(12, 8)
    loc_t = loc_2d.int().t().contiguous().t()  # int32, transposed layout
    loc_flat, loc_t_flat = loc_2d.reshape(-1), loc_t.reshape(-1)  # made here: a call must not allocate
    commit = torch.randint(0, 9, (12,), device=DEV, dtype=torch.int32)
    commit64 = commit.long()
    k16, v16 = qkv[:, 32:40], qkv[:, 40:48]
    scale = torch.tensor([0.37], device=DEV)
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


def test_verify_and_observing_writes_never_synchronise_on_the_reference_path():
    pool = _pool(fused="never", observe_amax=True)
    x = _rows(96, H, D, torch.bfloat16, 6)
    loc_2d = torch.randperm(ROWS, device=DEV)[:96].reshape(12, 8)
    loc_2d[0, 0] = ROWS + 3
    commit = torch.randint(-1, 10, (12,), device=DEV, dtype=torch.int32)
    scale = torch.tensor([0.37], device=DEV)
    loc_flat = loc_2d.reshape(-1)
    calls = [
        lambda: pool.set_kv_buffer_prefix_valid(None, loc_2d, commit, x, x, scale, 0.5, layer_id_override=0),
        lambda: pool.set_kv_buffer(None, loc_flat, x, x, 0.25, scale, layer_id_override=1),
    ]
    for call in calls:
        call()
    _sync_free(calls, "reference path")
    assert pool.stats.reference_calls == 8


# --- calibration -----------------------------------------------------------------------------------


def _fold(expected: np.ndarray, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Fold the finite |x| of the tokens written (slot in range) into ``expected`` [layers, 2, H]."""
    written = ((loc >= 0) & (loc < ROWS)).cpu().numpy()
    for kv, x in ((0, k), (1, v)):
        a = np.abs(x.detach().float().cpu().numpy())[written]  # [tokens written, H, D]
        a = np.where(np.isfinite(a), a, 0.0).astype(np.float32)
        if a.size:
            expected[layer, kv] = np.maximum(expected[layer, kv], a.max(axis=(0, 2)))


def test_observed_maxima_are_exact_on_the_device():
    """Maxima of plain and verify writes against NumPy, with NaN, infinities, padding and
    out-of-range slots carrying the largest values, and a head holding only subnormals."""
    pools = {f: _pool(fused=f, observe_amax=True) for f in ("always", "never")}
    expected = np.zeros((2, 2, H), dtype=np.float32)
    g = _gen(7)
    for step in range(4):
        t = 300
        k = _rows(t, H, D, [torch.bfloat16, torch.float16, torch.float32, torch.bfloat16][step], 30 + step)
        v = _rows(t, H, D, torch.float32, 40 + step)
        loc = torch.randperm(ROWS, device=DEV, generator=g)[:t]
        loc[:20] = -1 - torch.arange(20, device=DEV)
        loc[20:40] = ROWS + torch.arange(20, device=DEV)
        k[:40] = 6e4  # only on tokens never written
        v[:40] = -3e38
        k[50, 0, 0], k[51, 1, 5], v[52, 2, 7], v[53, 3, 1] = float("nan"), float("inf"), -float("inf"), float("nan")
        for pool in pools.values():
            pool.set_kv_buffer(None, loc, k, v, 0.5, torch.tensor([2.0], device=DEV), layer_id_override=step % 2)
        _fold(expected, step % 2, loc, k, v)
        for f, pool in pools.items():
            assert_same_bytes(pool.kv_amax.cpu(), torch.from_numpy(expected), f"step {step} fused={f}")
    # a verify write: uncommitted tokens carry huge values
    loc_2d = torch.randperm(ROWS, device=DEV, generator=g)[:96].reshape(12, 8)
    commit = torch.randint(-1, 10, (12,), device=DEV, generator=g)
    k = _rows(96, H, D, torch.bfloat16, 50)
    col = torch.arange(8, device=DEV)[None, :].expand(12, 8).reshape(-1)
    k[col >= commit.repeat_interleave(8)] = 5e4
    for pool in pools.values():
        pool.set_kv_buffer_prefix_valid(None, loc_2d, commit, k, k, layer_id_override=0)
    idx, slots = _committed(loc_2d, commit)
    _fold(expected, 0, slots, k[idx], k[idx])
    for f, pool in pools.items():
        assert_same_bytes(pool.kv_amax.cpu(), torch.from_numpy(expected), f"verify write fused={f}")
    _assert_pools_equal(pools["always"], pools["never"], "observing pools")
    # From zero again: one V head holds only float32 subnormals and zeros (no flush to zero).
    expected[:] = 0
    v = _rows(40, H, D, torch.float32, 51)
    v[:, 4] = torch.tensor([2.0**-149, -(2.0**-130), -0.0, 0.0], device=DEV).repeat(D // 4)
    loc = torch.arange(1, 41, device=DEV)
    for pool in pools.values():
        pool.reset_amax()
        pool.set_kv_buffer(None, loc, v, v, layer_id_override=1)
    _fold(expected, 1, loc, v, v)
    assert float(expected[1, 1, 4]) == 2.0**-130
    for f, pool in pools.items():
        assert_same_bytes(pool.kv_amax.cpu(), torch.from_numpy(expected), f"subnormal head fused={f}")


def test_observation_under_a_cuda_graph_keeps_accumulating():
    pool, ref = _pool(observe_amax=True), _pool(fused="never", observe_amax=True)
    t = 64
    static_k = _rows(t, H, D, torch.bfloat16, 60)
    static_v = _rows(t, H, D, torch.bfloat16, 61)
    static_loc = torch.randperm(ROWS, device=DEV)[:t]
    scale = torch.tensor([0.5], device=DEV)
    for p in (pool, ref):  # compile outside the capture; the same write on both pools
        p.set_kv_buffer(None, static_loc, static_k, static_v, scale, scale, layer_id_override=1)
        p.reset_amax()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pool.set_kv_buffer(None, static_loc, static_k, static_v, scale, scale, layer_id_override=1)
    assert not pool.kv_amax.any(), "capturing must not run the write"
    expected = np.zeros((2, 2, H), dtype=np.float32)
    g = _gen(62)
    for step, magnitude in enumerate([1.0, 100.0, 0.01, 10.0, 1e-3]):
        if step == 3:
            pool.reset_amax()
            ref.reset_amax()
            expected[:] = 0
        static_k.copy_(_rows(t, H, D, torch.bfloat16, 70 + step) * magnitude)
        static_v.copy_(_rows(t, H, D, torch.bfloat16, 80 + step) / magnitude)
        static_k[3, 2, 1] = float("nan")
        static_v[4, 5, 0] = float("inf")
        static_loc.copy_(torch.randperm(ROWS, device=DEV, generator=g)[:t])
        static_loc[:5] = -1
        static_loc[5:9] = ROWS + 1
        scale.fill_(magnitude)
        graph.replay()
        ref.set_kv_buffer(None, static_loc, static_k, static_v, scale, scale, layer_id_override=1)
        torch.cuda.synchronize()
        _fold(expected, 1, static_loc, static_k, static_v)
        assert_same_bytes(pool.kv_amax.cpu(), torch.from_numpy(expected), f"replay {step}")
        assert_same_bytes(ref.kv_amax.cpu(), torch.from_numpy(expected), f"eager {step}")
        _assert_pools_equal(pool, ref, f"replay {step}", layers=(1,))


# Geometry used by no other test, so that Triton's cache of compiled variants can be inspected for it:
# its per-head variants have D=72, its flat ones (a row as one "head") D=360.
UNIQUE_H, UNIQUE_D = 5, 72


def _jit_flags(pool) -> set:
    """(K scale kind, V scale kind, prefix, observe) of every variant the pool's writer has
    launched through Triton's JIT (every kind of fused call's first launch goes there)."""
    return {
        (e.ka, e.va, e.constexprs["PREFIX"], e.constexprs["OBSERVE"])
        for e in pool._writer._entries.values() if e.refused is None
    }  # fmt: skip


def _triton_observe_flags(d_values) -> list[bool] | None:
    """OBSERVE of each variant Triton has compiled whose D is in ``d_values``; None when this
    Triton keeps its compiled variants in a way not understood here."""
    kernel = store_kv_kernel._store_kv_kernel
    caches = getattr(kernel, "device_caches", None)
    names = list(getattr(kernel, "arg_names", []))
    if not isinstance(caches, dict) or "OBSERVE" not in names:
        return None
    found = []
    for entry in caches.values():
        if not isinstance(entry, tuple) or not isinstance(entry[0], dict):
            return None
        for compiled in entry[0].values():
            constants = getattr(getattr(compiled, "src", None), "constants", None)
            if not isinstance(constants, dict):
                return None
            named = {}
            for key, value in constants.items():
                if isinstance(key, tuple) and len(key) == 1 and isinstance(key[0], int):
                    key = names[key[0]]
                named[key] = getattr(value, "value", value)
            if "D" not in named or "OBSERVE" not in named:
                return None
            if named["D"] in d_values:
                found.append(bool(named["OBSERVE"]))
    return found


def _unique_writes(pool, per_head=False):
    """A plain and a verify write; ``per_head`` uses per-head scales, scale kinds nothing else uses
    on this geometry (so their variants are first launched by this call)."""
    x = _rows(9, UNIQUE_H, UNIQUE_D, torch.bfloat16, 90)
    loc = torch.arange(1, 10, device=DEV)
    ks, vs = (torch.linspace(0.1, 2.0, UNIQUE_H, device=DEV),) * 2 if per_head else (0.5, None)
    pool.set_kv_buffer(None, loc, x, x, ks, vs, layer_id_override=0)
    pool.set_kv_buffer_prefix_valid(None, loc.reshape(3, 3), torch.tensor([1, 3, 0], device=DEV), x, x, ks, None, layer_id_override=1)


def test_no_observing_variant_before_observation_is_turned_on():
    pool = _pool(heads=UNIQUE_H, dim=UNIQUE_D, fused="always")
    never = _pool(heads=UNIQUE_H, dim=UNIQUE_D, fused="always")
    _unique_writes(pool)
    _unique_writes(never)
    flags = _jit_flags(pool)
    assert flags and not any(f[3] for f in flags), f"an observing variant ran before observe_amax: {flags}"
    triton_flags = _triton_observe_flags((UNIQUE_D, UNIQUE_H * UNIQUE_D))
    if triton_flags is not None:
        assert triton_flags and not any(triton_flags), "Triton compiled an OBSERVE variant before observe_amax"
    pool.observe_amax(True)  # compiles the observing variants at once (warmup)
    assert any(f[3] for f in _jit_flags(pool))
    if triton_flags is not None:
        assert any(_triton_observe_flags((UNIQUE_D, UNIQUE_H * UNIQUE_D)))
    _unique_writes(pool)
    assert pool.kv_amax.any()
    pool.observe_amax(False)
    seen, before = pool.kv_amax.clone(), _jit_flags(pool)
    _unique_writes(pool, per_head=True)  # new variants: compiled without observation
    _unique_writes(never, per_head=True)
    new = _jit_flags(pool) - before
    assert new and not any(f[3] for f in new), f"variants first launched after observe_amax(False): {new}"
    assert torch.equal(bits(pool.kv_amax), bits(seen)), "maxima changed while not observing"
    # Everything but the padding slot 0, which observe_amax(True) rewrote with zeros when it
    # compiled the observing variants, holds what the never-observing pool holds.
    for layer in (0, 1):
        for a, b in zip(pool.get_kv_buffer(layer), never.get_kv_buffer(layer)):
            assert_same_bytes(a[1:], b[1:], f"layer {layer}")


# --- NaN bits over every pattern ---------------------------------------------------------------------

VARIANTS = {
    "native": KernelOptions(soft_cast=False),
    "soft": KernelOptions(soft_cast=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=_name)
def test_every_16_bit_pattern_and_random_fp32_patterns_into_16_and_32_bit_caches(cache_dtype, variant):
    """Every bf16 and fp16 bit pattern, and 1M random fp32 patterns (NaN payloads of both signs
    among them), into 16- and 32-bit caches: fused and reference bytes identical."""
    every = torch.arange(65536, dtype=torch.int32, device=DEV).to(torch.int16)
    raw = torch.randint(-(2**31), 2**31, (1024, 8, 128), device=DEV, generator=_gen(91), dtype=torch.int64)
    inputs = [every.view(torch.bfloat16).reshape(512, 1, 128), every.view(torch.float16).reshape(512, 1, 128),
              raw.to(torch.int32).view(torch.float32)]  # fmt: skip
    for x in inputs:
        t = x.shape[0]
        loc = torch.randperm(t, device=DEV)
        kf = poison_(torch.empty(t, x.shape[1], 128, dtype=cache_dtype, device=DEV))
        kr = kf.clone()
        launch_store_kv(x, x, kf, kf.clone(), loc, options=VARIANTS[variant])
        reference_set_kv_buffer(x, x, kr, kr.clone(), loc)
        assert_same_bytes(kf, kr, f"{_name(x.dtype)} patterns -> {_name(cache_dtype)}")
