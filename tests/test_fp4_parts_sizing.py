"""Sizing the hybrid and SWA pools with FP4 parts (docs/contract.md, "Sizing"): ``KVGeometry`` of an
FP4 dtype gives the bytes each part really allocates (codes, block scales and NVFP4's global scales,
found by summing the part's tensors), and the budgets ``plan_swa_pools`` and ``plan_hybrid_pools``
split build pools of exactly those bytes, 16/9 as many tokens as FP8 in the same memory."""

from __future__ import annotations

import pytest
import torch

from kvassert import FP4_POOL_DTYPE, scaled_parts, state_params
from kvpool import HybridLinearKVPool, SWAKVPool
from kvpool.pools.sizing import GIB, KVGeometry, plan_hybrid_pools, plan_swa_pools

H, D, DV, SWA_D = 3, 32, 16, 16
#: (pool dtype, fp4_format, the dtype KVGeometry names the same bytes by).
FORMATS = [
    (FP4_POOL_DTYPE, None, FP4_POOL_DTYPE),
    ("fp4_e2m1", None, "fp4_e2m1"),
    ("nvfp4", None, "nvfp4"),
    (FP4_POOL_DTYPE, "nvfp4", "nvfp4"),
]
IDS = ["fp4_dtype", "fp4_name", "nvfp4_name", "fp4_dtype_nvfp4"]


def held_bytes(part) -> int:
    """Bytes of every tensor the part holds: each buffer of each layer, and NVFP4's global scales."""
    scales = [t for t in (getattr(part, "k_global_scales", None), getattr(part, "v_global_scales", None)) if t is not None]
    return sum(b.nbytes for b in scaled_parts(part)) + sum(t.nbytes for t in scales)


@pytest.mark.parametrize("page", [1, 8])
@pytest.mark.parametrize("dtype, fmt, named", FORMATS, ids=IDS)
def test_fp4_parts_allocate_what_their_geometry_says(dtype, fmt, named, page):
    full_g = KVGeometry(H, D, 2, named, v_head_dim=DV)
    hybrid = HybridLinearKVPool(24, dtype, page, H, D, [1, 3], False, "cpu", None, v_head_dim=DV, fp4_format=fmt)
    assert held_bytes(hybrid.full_kv_pool) == full_g.pool_bytes(24, page)
    assert sum(hybrid.get_kv_size_bytes()) == full_g.pool_bytes(24, page) - full_g.fixed_bytes  # codes and block scales
    assert hybrid.mem_usage == sum(hybrid.get_kv_size_bytes()) / GIB
    swa = SWAKVPool(24, 16, page, dtype, H, D, [0, 2, 4], [1, 3], False, "cpu", v_head_dim=DV, swa_head_dim=SWA_D,
                    fp4_format=fmt)  # fmt: skip
    swa_g = KVGeometry(H, SWA_D, 3, named, v_head_dim=DV)
    assert held_bytes(swa.full_kv_pool) == full_g.pool_bytes(24, page)
    assert held_bytes(swa.swa_kv_pool) == swa_g.pool_bytes(16, page)


@pytest.mark.parametrize("dtype, fmt, named", FORMATS, ids=IDS)
def test_an_swa_budget_split_for_fp4_builds_pools_of_its_bytes(dtype, fmt, named):
    budget, page = 200_000, 4
    full_g, swa_g = KVGeometry(H, D, 2, named, v_head_dim=DV), KVGeometry(H, SWA_D, 3, named, v_head_dim=DV)
    s = plan_swa_pools(budget, full_g, swa_g, 0.5, page_size=page)
    pool = SWAKVPool(s.size, s.size_swa, page, dtype, H, D, [0, 2, 4], [1, 3], False, "cpu", v_head_dim=DV,
                     swa_head_dim=SWA_D, fp4_format=fmt)  # fmt: skip
    assert held_bytes(pool.full_kv_pool) == s.full_bytes and held_bytes(pool.swa_kv_pool) == s.swa_bytes
    assert s.total_bytes <= budget
    assert sum(pool.get_kv_size_bytes()) == s.total_bytes - full_g.fixed_bytes - swa_g.fixed_bytes
    for tight in range(20_000, 21_000, 7):  # every byte counted, global scales included, at any budget
        t = plan_swa_pools(tight, full_g, swa_g, 0.5, page_size=page)
        assert full_g.pool_bytes(t.size, page) + swa_g.pool_bytes(t.size_swa, page) == t.total_bytes <= tight
    fp8 = plan_swa_pools(budget, KVGeometry(H, D, 2, torch.float8_e4m3fn, v_head_dim=DV),
                         KVGeometry(H, SWA_D, 3, torch.float8_e4m3fn, v_head_dim=DV), 0.5, page_size=page)  # fmt: skip
    assert s.size >= fp8.size * 16 // 9 - 2 * page, "FP4 parts hold about 16/9 the tokens of FP8 parts"


@pytest.mark.parametrize("dtype, fmt, named", FORMATS, ids=IDS)
def test_a_hybrid_budget_split_for_fp4_builds_a_kv_pool_of_its_bytes(dtype, fmt, named):
    g = KVGeometry(H, D, 2, named, v_head_dim=DV)
    s = plan_hybrid_pools(300_000 - g.fixed_bytes, g.bytes_per_token, state_params(), page_size=4, max_running_requests=2)
    pool = HybridLinearKVPool(s.kv_size, dtype, 4, H, D, [1, 3], False, "cpu", None, v_head_dim=DV, fp4_format=fmt)
    assert sum(pool.get_kv_size_bytes()) == s.kv_bytes
    assert held_bytes(pool.full_kv_pool) == s.kv_bytes + g.fixed_bytes and s.total_bytes + g.fixed_bytes <= 300_000
