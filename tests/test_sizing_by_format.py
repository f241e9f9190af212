"""Sizing for every pool format: bytes per token and tokens per GiB of each dtype and format (FP8,
the fnuz formats, 16/32-bit, both FP4 formats, per-token-head FP8), each checked against the bytes
a tiny pool of that kind really allocates, found by walking the pool's tensors (scale buffers and
NVFP4's global scales included), and the largest pool that fits a budget built and measured."""

from __future__ import annotations

import pytest
import torch

from kvpool import (
    HybridLinearKVPool,
    MHATokenToKVPool,
    MHATokenToKVPoolFP4,
    MHATokenToKVPoolFP8PerTokenHead,
    MLATokenToKVPool,
    MLATokenToKVPoolFP4,
    SWAKVPool,
)
from kvpool.kernels.formats import CACHE_DTYPES
from kvpool.pools.sizing import KVGeometry

FP4 = getattr(torch, "float4_e2m1fn_x2", None)
FP4_NAMES = ["fp4_e2m1", "nvfp4"] + ([FP4] if FP4 is not None else [])
H, D, DV, LAYERS = 3, 32, 16, 2


def allocated_bytes(obj: object, seen: set | None = None) -> int:
    """Bytes of every distinct tensor storage reachable from ``obj``'s attributes (tensors, lists
    and tuples of them, and pools inside it), each storage counted once."""
    seen = set() if seen is None else seen
    total = 0
    stack = list(vars(obj).values())
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            s = v.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, (MHATokenToKVPool, MLATokenToKVPool, MHATokenToKVPoolFP8PerTokenHead)):
            total += allocated_bytes(v, seen)
    return total


def fp4_pool(size, page, dtype, **kw):
    return MHATokenToKVPoolFP4(size, page, dtype, H, D, LAYERS, "cpu", v_head_dim=DV, **kw)


def pools():
    """(id, geometry, builder(size, page) -> pool) for every pool kind and dtype."""
    for dtype in CACHE_DTYPES:
        g = KVGeometry(H, D, LAYERS, dtype, v_head_dim=DV)
        yield str(dtype), g, lambda n, p, d=dtype: MHATokenToKVPool(n, p, d, H, D, LAYERS, "cpu", v_head_dim=DV, warmup=False)
        m = KVGeometry.mla(48, 16, LAYERS, dtype)
        yield f"mla-{dtype}", m, lambda n, p, d=dtype: MLATokenToKVPool(n, p, d, 48, 16, LAYERS, "cpu", warmup=False)
    for dtype in FP4_NAMES:
        g = KVGeometry(H, D, LAYERS, dtype, v_head_dim=DV)
        yield f"fp4-{dtype}", g, lambda n, p, d=dtype: fp4_pool(n, p, d)
        if dtype != "nvfp4":
            m = KVGeometry.mla(48, 16, LAYERS, dtype)
            yield f"mla-fp4-{dtype}", m, lambda n, p, d=dtype: MLATokenToKVPoolFP4(n, p, d, 48, 16, LAYERS, "cpu")
    yield "nvfp4-by-format", KVGeometry(H, D, LAYERS, "nvfp4", v_head_dim=DV), (
        lambda n, p: fp4_pool(n, p, "fp4_e2m1", fp4_format="nvfp4")
    )
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        g = KVGeometry(H, D, LAYERS, dtype, v_head_dim=DV, kv_scale_mode="per_token_head")
        yield f"token-head-{dtype}", g, lambda n, p, d=dtype: MHATokenToKVPoolFP8PerTokenHead(
            n, p, d, H, D, LAYERS, "cpu", v_head_dim=DV, warmup=False
        )


CASES = list(pools())


@pytest.mark.parametrize("name, geometry, build", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("size, page", [(7, 1), (32, 16)])
def test_pool_bytes_are_what_the_pool_allocates(name, geometry, build, size, page):
    pool = build(size, page)
    assert allocated_bytes(pool) == geometry.pool_bytes(size, page)
    assert geometry.tokens_per_gib == 2**30 // geometry.bytes_per_token


@pytest.mark.parametrize("name, geometry, build", CASES, ids=[c[0] for c in CASES])
def test_the_largest_pool_that_fits_a_budget_fits_and_one_page_more_does_not(name, geometry, build):
    budget, page = 60_013, 4
    size = geometry.max_pool_size(budget, page)
    assert allocated_bytes(build(size, page)) <= budget < geometry.pool_bytes(size + page, page)


def per_head_bytes(dtype, scale_mode="static") -> int:
    return KVGeometry(1, 128, 1, dtype, kv_scale_mode=scale_mode).bytes_per_token // 2


def test_bytes_per_head_and_token_at_head_dim_128_by_format():
    """K of one head at head_dim 128: 256 bytes in bf16, 128 in FP8 (fnuz too), 132 with a
    per-token-head scale, 72 in either FP4 format (64 code bytes, 8 scale bytes)."""
    table = {
        "bf16": per_head_bytes(torch.bfloat16),
        "fp8": per_head_bytes(torch.float8_e4m3fn),
        "fp8-fnuz": per_head_bytes(torch.float8_e4m3fnuz),
        "e5m2-fnuz": per_head_bytes(torch.float8_e5m2fnuz),
        "fp8-token-head": per_head_bytes(torch.float8_e4m3fn, "per_token_head"),
        "fp4": per_head_bytes("fp4_e2m1"),
        "nvfp4": per_head_bytes("nvfp4"),
    }
    assert table == {"bf16": 256, "fp8": 128, "fp8-fnuz": 128, "e5m2-fnuz": 128, "fp8-token-head": 132, "fp4": 72,
                     "nvfp4": 72}  # fmt: skip


def test_llama3_8b_tokens_per_gib_by_format():
    """Llama-3-8B (32 layers, 8 KV heads x 128): FP4 holds 16/9 as many tokens as FP8."""
    def tokens(dtype, mode="static"):
        return KVGeometry(8, 128, 32, dtype, kv_scale_mode=mode).tokens_per_gib

    assert tokens(torch.bfloat16) == 8192 and tokens(torch.float8_e4m3fn) == 16384
    assert tokens(torch.float8_e5m2fnuz) == 16384
    assert tokens(torch.float8_e4m3fn, "per_token_head") == 2**30 // (32 * 8 * 264) == 15887
    assert tokens("nvfp4") == tokens("fp4_e2m1") == 2**30 // (32 * 8 * 144) == 29127


@pytest.mark.parametrize("page", [1, 8])
def test_hybrid_and_swa_pools_with_per_token_head_scales_allocate_their_geometry(page):
    g = KVGeometry(H, D, 2, torch.float8_e4m3fn, kv_scale_mode="per_token_head")
    hybrid = HybridLinearKVPool(24, torch.float8_e4m3fn, page, H, D, [1, 3], False, "cpu", None, warmup=False,
                                kv_scale_mode="per_token_head")  # fmt: skip
    assert allocated_bytes(hybrid.full_kv_pool) == g.pool_bytes(24, page)
    swa = SWAKVPool(24, 16, page, torch.float8_e4m3fn, H, D, [0, 2, 4], [1, 3], False, "cpu", warmup=False,
                    kv_scale_mode="per_token_head")  # fmt: skip
    swa_g = KVGeometry(H, D, 3, torch.float8_e4m3fn, kv_scale_mode="per_token_head")
    assert allocated_bytes(swa.full_kv_pool) == g.pool_bytes(24, page)
    assert allocated_bytes(swa.swa_kv_pool) == swa_g.pool_bytes(16, page)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dtype=torch.bfloat16, kv_scale_mode="per_token_head"), "dtype must be torch.float8_e4m3fn or"),
        (dict(dtype=torch.float8_e4m3fnuz, kv_scale_mode="per_token_head"), "with kv_scale_mode='per_token_head'"),
        (dict(dtype=torch.float8_e4m3fn, kv_scale_mode="dynamic"), "kv_scale_mode must be one of"),
        (dict(dtype="fp4", head_dim=32), "dtype must be one of .*got 'fp4'"),
        (dict(dtype="nvfp4", head_dim=40), "head_dim must be a multiple of 16 for FP4, got 40"),
        (dict(dtype="fp4_e2m1", v_head_dim=24), "v_head_dim must be a multiple of 16 for FP4, got 24"),
    ],
    ids=["bf16-token-head", "fnuz-token-head", "mode", "name", "nvfp4-dim", "fp4-v-dim"],
)
def test_a_geometry_no_pool_can_have_is_refused(kwargs, message):
    args = dict(head_num=2, head_dim=32, layer_num=1) | kwargs
    with pytest.raises(ValueError, match=message):
        KVGeometry(**args)


def test_mla_geometries_without_a_pool_are_refused():
    with pytest.raises(ValueError, match="dtype must not be 'nvfp4' for an MLA geometry"):
        KVGeometry.mla(48, 16, 1, "nvfp4")
    with pytest.raises(ValueError, match="kv_scale_mode must be 'static' for an MLA geometry"):
        KVGeometry(1, 64, 1, torch.float8_e4m3fn, 0, kv_lora_rank=48, kv_scale_mode="per_token_head")
