"""Per-token-head FP8 inside the pools that build their own parts (docs/contract.md, "Per-token-head
FP8", "Selecting it"): ``kv_scale_mode="per_token_head"`` makes the full-attention part of a
``HybridLinearKVPool`` and both parts of an ``SWAKVPool`` per-token-head pools, written, moved and
copied by global layer id and full slot with their scales; bad modes are refused."""

from __future__ import annotations

import pytest
import torch

from kvassert import DEVICE, assert_same_bytes, fill_random_, swa_mapping, translated
from kvpool import HybridLinearKVPool, SWAKVPool
from kvpool.pools.mha_fp8_token_pool import MHATokenToKVPoolFP8PerTokenHead

E4M3 = torch.float8_e4m3fn
H, D, DV = 3, 16, 8


def rows(t: int, dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, dim, generator=g) * torch.exp2(torch.randint(-8, 8, (t, H, 1), generator=g).float())
    return x.to(torch.bfloat16).to(DEVICE)


def part_buffers(pool: MHATokenToKVPoolFP8PerTokenHead) -> list[torch.Tensor]:
    return [b for name in pool.part_names for b in getattr(pool, name)]


def alone(size: int, layers: int) -> MHATokenToKVPoolFP8PerTokenHead:
    """The pool a part should behave as."""
    return MHATokenToKVPoolFP8PerTokenHead(size, 1, E4M3, H, D, layers, DEVICE, v_head_dim=DV)


def test_the_hybrid_pools_full_attention_part_is_a_per_token_head_pool():
    pool = HybridLinearKVPool(20, E4M3, 1, H, D, [3, 7], False, DEVICE, None, v_head_dim=DV, kv_scale_mode="per_token_head")
    inner, expected = pool.full_kv_pool, alone(20, 2)
    assert isinstance(inner, MHATokenToKVPoolFP8PerTokenHead) and pool.dtype == E4M3
    k, v, loc = rows(4, D, 1), rows(4, DV, 2), torch.tensor([2, 5, -1, 9], device=DEVICE)
    pool.set_kv_buffer(None, loc, k, v, layer_id_override=7)
    expected.set_kv_buffer(None, loc, k, v, layer_id_override=1)
    loc_2d, commit = torch.tensor([[11, 12], [13, 14]], device=DEVICE), torch.tensor([1, 2], device=DEVICE)
    pool.set_kv_buffer_prefix_valid(None, loc_2d, commit, k, v, layer_id_override=3)
    expected.set_kv_buffer_prefix_valid(None, loc_2d, commit, k, v, layer_id_override=0)
    for a, b in zip(part_buffers(inner), part_buffers(expected)):
        assert_same_bytes(a, b, "hybrid part vs the pool alone")
    k_back, _ = pool.get_kv_buffer(7)
    assert_same_bytes(k_back, expected.get_key_buffer(1), "dequantized K")
    copy = pool.get_cpu_copy(torch.tensor([2, 5], device=DEVICE))
    pool.load_cpu_copy(copy, torch.tensor([16, 17], device=DEVICE))
    pool.move_kv_cache(torch.tensor([18], device=DEVICE), torch.tensor([9], device=DEVICE))
    for b in part_buffers(inner):
        assert_same_bytes(b[[16, 17, 18]], b[[2, 5, 9]], "rows copied and moved with their scales")
    with pytest.raises(ValueError, match="layer_id 4 is not a full-attention layer"):
        pool.get_key_buffer(4)


@pytest.mark.parametrize("validate", [False, True], ids=["mapped_in_the_write", "translated_first"])
def test_the_swa_pools_parts_are_per_token_head_pools_addressed_by_full_slots(validate):
    pool = SWAKVPool(24, 12, 1, E4M3, H, D, [0, 2], [1], False, DEVICE, v_head_dim=DV, kv_scale_mode="per_token_head",
                     validate=validate)  # fmt: skip
    assert all(isinstance(p, MHATokenToKVPoolFP8PerTokenHead) for p in (pool.full_kv_pool, pool.swa_kv_pool))
    pairs = {3: 5, 4: 6, 9: 2}
    pool.register_mapping(swa_mapping(pool.full_kv_pool.rows, pairs))
    swa_alone = alone(12, 2)
    k, v, loc = rows(4, D, 3), rows(4, DV, 4), [3, 4, 9, 7]
    pool.set_kv_buffer(None, torch.tensor(loc, device=DEVICE), k, v, layer_id_override=2)
    swa_loc = torch.tensor(translated(loc, pairs, pool.full_kv_pool.rows), device=DEVICE)
    swa_alone.set_kv_buffer(None, swa_loc, k, v, layer_id_override=1)
    for a, b in zip(part_buffers(pool.swa_kv_pool), part_buffers(swa_alone)):
        assert_same_bytes(a, b, "SWA part vs the pool alone at the translated slots")
    copy = pool.get_cpu_copy(torch.tensor([3, 9], device=DEVICE))
    fill_random_(part_buffers(pool.swa_kv_pool), seed=5)
    pool.load_cpu_copy(copy, torch.tensor([3, 9], device=DEVICE))
    for a, b in zip(part_buffers(pool.swa_kv_pool), part_buffers(swa_alone)):
        assert_same_bytes(a[[5, 2]], b[[5, 2]], "SWA rows and scales back from the CPU copy")
    addrs, sizes, _ = pool.get_state_buf_infos()
    assert len(addrs) == 8 and sizes[4] == 13 * H * 4, "the transfer registration lists the scale buffers too"


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: SWAKVPool(8, 4, 1, E4M3, H, D, [0], [1], False, DEVICE, kv_scale_mode="per_head"),
         r"kv_scale_mode must be one of \['static', 'per_token_head'\], got 'per_head'"),
        (lambda: SWAKVPool(8, 4, 1, E4M3, H, D, [0], [1], False, DEVICE, kv_scale_mode="per_token_head", observe_amax=True),
         "observe_amax must be False with kv_scale_mode='per_token_head'"),
        (lambda: HybridLinearKVPool(8, E4M3, 1, H, D, [1], False, DEVICE, None, kv_scale_mode=None),
         "kv_scale_mode must be one of"),
        (lambda: HybridLinearKVPool(8, E4M3, 1, H, D, [1], False, DEVICE, None, use_mla=True, kv_lora_rank=16,
                                    qk_rope_head_dim=16, kv_scale_mode="per_token_head"),
         r"kv_scale_mode='per_token_head' needs MHA layers and no calibration \(use_mla=False, observe_amax=False\), got use_mla=True"),
        (lambda: HybridLinearKVPool(8, torch.bfloat16, 1, H, D, [1], False, DEVICE, None, kv_scale_mode="per_token_head"),
         "dtype must be torch.float8_e4m3fn or torch.float8_e5m2 for a per-token-head FP8 pool"),
    ],
    ids=["unknown_mode", "swa_with_calibration", "mode_not_a_string", "hybrid_mla", "not_fp8"],
)
def test_a_bad_scale_mode_is_refused(build, match):
    with pytest.raises(ValueError, match=match):
        build()
