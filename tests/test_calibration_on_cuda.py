"""KV-scale calibration on CUDA (skipped without a CUDA device): the observed maxima exact on real
shapes, observation accumulating under a CUDA graph, and no observing kernel variant compiled before
observation is turned on.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvassert import (
    CUDA_D,
    CUDA_H,
    CUDA_ROWS,
    assert_pools_equal,
    assert_same_bytes,
    bits,
    committed_tokens,
    cuda_gen,
    cuda_pool,
    cuda_values,
    gpu,
)
from kvpool.kernels.store_kv import kernel as store_kv_kernel

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


# --- on CUDA: real shapes, CUDA graphs and the compiled variants ----------------------------------


def _fold(expected: np.ndarray, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Fold the finite |x| of the tokens written (slot in range) into ``expected`` [layers, 2, H]."""
    written = ((loc >= 0) & (loc < CUDA_ROWS)).cpu().numpy()
    for kv, x in ((0, k), (1, v)):
        a = np.abs(x.detach().float().cpu().numpy())[written]  # [tokens written, H, D]
        a = np.where(np.isfinite(a), a, 0.0).astype(np.float32)
        if a.size:
            expected[layer, kv] = np.maximum(expected[layer, kv], a.max(axis=(0, 2)))


@gpu
def test_observed_maxima_are_exact_on_the_device():
    """Maxima of plain and verify writes against NumPy, with NaN, infinities, padding and
    out-of-range slots carrying the largest values, and a head holding only subnormals."""
    pools = {f: cuda_pool(fused=f, observe_amax=True) for f in ("always", "never")}
    expected = np.zeros((2, 2, CUDA_H), dtype=np.float32)
    g = cuda_gen(7)
    for step in range(4):
        t = 300
        k = cuda_values((t, CUDA_H, CUDA_D), [torch.bfloat16, torch.float16, torch.float32, torch.bfloat16][step], 30 + step)
        v = cuda_values((t, CUDA_H, CUDA_D), torch.float32, 40 + step)
        loc = torch.randperm(CUDA_ROWS, device="cuda", generator=g)[:t]
        loc[:20] = -1 - torch.arange(20, device="cuda")
        loc[20:40] = CUDA_ROWS + torch.arange(20, device="cuda")
        k[:40] = 6e4  # only on tokens never written
        v[:40] = -3e38
        k[50, 0, 0], k[51, 1, 5], v[52, 2, 7], v[53, 3, 1] = float("nan"), float("inf"), -float("inf"), float("nan")
        for pool in pools.values():
            pool.set_kv_buffer(None, loc, k, v, 0.5, torch.tensor([2.0], device="cuda"), layer_id_override=step % 2)
        _fold(expected, step % 2, loc, k, v)
        for f, pool in pools.items():
            assert_same_bytes(pool.kv_amax.cpu(), torch.from_numpy(expected), f"step {step} fused={f}")
    # a verify write: uncommitted tokens carry huge values
    loc_2d = torch.randperm(CUDA_ROWS, device="cuda", generator=g)[:96].reshape(12, 8)
    commit = torch.randint(-1, 10, (12,), device="cuda", generator=g)
    k = cuda_values((96, CUDA_H, CUDA_D), torch.bfloat16, 50)
    col = torch.arange(8, device="cuda")[None, :].expand(12, 8).reshape(-1)
    k[col >= commit.repeat_interleave(8)] = 5e4
    for pool in pools.values():
        pool.set_kv_buffer_prefix_valid(None, loc_2d, commit, k, k, layer_id_override=0)
    idx, slots = committed_tokens(loc_2d, commit)
    _fold(expected, 0, slots, k[idx], k[idx])
    for f, pool in pools.items():
        assert_same_bytes(pool.kv_amax.cpu(), torch.from_numpy(expected), f"verify write fused={f}")
    assert_pools_equal(pools["always"], pools["never"], "observing pools", (0, 1))
    # From zero again: one V head holds only float32 subnormals and zeros (no flush to zero).
    expected[:] = 0
    v = cuda_values((40, CUDA_H, CUDA_D), torch.float32, 51)
    v[:, 4] = torch.tensor([2.0**-149, -(2.0**-130), -0.0, 0.0], device="cuda").repeat(CUDA_D // 4)
    loc = torch.arange(1, 41, device="cuda")
    for pool in pools.values():
        pool.reset_amax()
        pool.set_kv_buffer(None, loc, v, v, layer_id_override=1)
    _fold(expected, 1, loc, v, v)
    assert float(expected[1, 1, 4]) == 2.0**-130
    for f, pool in pools.items():
        assert_same_bytes(pool.kv_amax.cpu(), torch.from_numpy(expected), f"subnormal head fused={f}")


@gpu
def test_observation_under_a_cuda_graph_keeps_accumulating():
    pool, ref = cuda_pool(observe_amax=True), cuda_pool(fused="never", observe_amax=True)
    t = 64
    static_k = cuda_values((t, CUDA_H, CUDA_D), torch.bfloat16, 60)
    static_v = cuda_values((t, CUDA_H, CUDA_D), torch.bfloat16, 61)
    static_loc = torch.randperm(CUDA_ROWS, device="cuda")[:t]
    scale = torch.tensor([0.5], device="cuda")
    for p in (pool, ref):  # compile outside the capture; the same write on both pools
        p.set_kv_buffer(None, static_loc, static_k, static_v, scale, scale, layer_id_override=1)
        p.reset_amax()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pool.set_kv_buffer(None, static_loc, static_k, static_v, scale, scale, layer_id_override=1)
    assert not pool.kv_amax.any(), "capturing must not run the write"
    expected = np.zeros((2, 2, CUDA_H), dtype=np.float32)
    g = cuda_gen(62)
    for step, magnitude in enumerate([1.0, 100.0, 0.01, 10.0, 1e-3]):
        if step == 3:
            pool.reset_amax()
            ref.reset_amax()
            expected[:] = 0
        static_k.copy_(cuda_values((t, CUDA_H, CUDA_D), torch.bfloat16, 70 + step) * magnitude)
        static_v.copy_(cuda_values((t, CUDA_H, CUDA_D), torch.bfloat16, 80 + step) / magnitude)
        static_k[3, 2, 1] = float("nan")
        static_v[4, 5, 0] = float("inf")
        static_loc.copy_(torch.randperm(CUDA_ROWS, device="cuda", generator=g)[:t])
        static_loc[:5] = -1
        static_loc[5:9] = CUDA_ROWS + 1
        scale.fill_(magnitude)
        graph.replay()
        ref.set_kv_buffer(None, static_loc, static_k, static_v, scale, scale, layer_id_override=1)
        torch.cuda.synchronize()
        _fold(expected, 1, static_loc, static_k, static_v)
        assert_same_bytes(pool.kv_amax.cpu(), torch.from_numpy(expected), f"replay {step}")
        assert_same_bytes(ref.kv_amax.cpu(), torch.from_numpy(expected), f"eager {step}")
        assert_pools_equal(pool, ref, f"replay {step}", (1,))


# A geometry used by no other test, so that Triton's cache of compiled variants can be inspected for
# it: its per-head variants have D=72, its flat ones (a row as one "head") D=360.
UNIQUE_H, UNIQUE_D = 5, 72


def _jit_flags(pool) -> set:
    """(K scale kind, V scale kind, prefix, observe) of every variant the pool's writer has
    launched through Triton's JIT (every kind of fused call's first launch goes there)."""
    return {
        (e.k_kind, e.v_kind, e.constexprs["PREFIX"], e.constexprs["OBSERVE"])
        for e in pool._writer._entries.values() if e.refused is None
    }  # fmt: skip


def _triton_observe_flags(d_values) -> list[bool] | None:
    """OBSERVE of each variant Triton has compiled whose D is in ``d_values``; None when this
    Triton keeps its compiled variants in a way not understood here."""
    kernel = store_kv_kernel.store_kv
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
    x = cuda_values((9, UNIQUE_H, UNIQUE_D), torch.bfloat16, 90)
    loc = torch.arange(1, 10, device="cuda")
    ks, vs = (torch.linspace(0.1, 2.0, UNIQUE_H, device="cuda"),) * 2 if per_head else (0.5, None)
    pool.set_kv_buffer(None, loc, x, x, ks, vs, layer_id_override=0)
    pool.set_kv_buffer_prefix_valid(None, loc.reshape(3, 3), torch.tensor([1, 3, 0], device="cuda"), x, x, ks, None, layer_id_override=1)


@gpu
def test_no_observing_variant_before_observation_is_turned_on():
    pool = cuda_pool(heads=UNIQUE_H, dim=UNIQUE_D, fused="always")
    never = cuda_pool(heads=UNIQUE_H, dim=UNIQUE_D, fused="always")
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
