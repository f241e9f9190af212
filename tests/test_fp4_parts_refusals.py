"""Calls the hybrid and SWA pools refuse with FP4 parts (docs/contract.md, "FP4 parts"): bad writes,
slots past the pool under ``validate``, the methods FP4 parts do not have (calibration, another
format's global scales), malformed CPU copies; each raises naming the argument before anything is
written, and every byte of both parts is as it was."""

from __future__ import annotations

import pytest
import torch

from kvassert import (
    DEVICE,
    FP4_D,
    FP4_DV,
    FP4_H,
    FP4_POOL_DTYPE,
    assert_tensors_unchanged,
    fill_random_,
    fp4_rows,
    scaled_parts,
    swa_mapping,
)
from kvpool import HybridLinearKVPool, SWAKVPool

FULL_ROWS = 25
PAIRS = {3: 5, 4: 6, 9: 2}


def slots(xs) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64, device=DEVICE)


def hybrid(dtype=FP4_POOL_DTYPE, **kw) -> HybridLinearKVPool:
    pool = HybridLinearKVPool(20, dtype, 1, FP4_H, FP4_D, [3, 7], False, DEVICE, None, v_head_dim=FP4_DV, **kw)
    fill_random_(every_part(pool), seed=1)
    return pool


def swa(dtype=FP4_POOL_DTYPE, mapped: bool = True, **kw) -> SWAKVPool:
    pool = SWAKVPool(24, 12, 1, dtype, FP4_H, FP4_D, [0, 2], [1], False, DEVICE, v_head_dim=FP4_DV, **kw)
    if mapped:
        pool.register_mapping(swa_mapping(FULL_ROWS, PAIRS))
    fill_random_(every_part(pool), seed=2)
    return pool


def every_part(pool) -> list[torch.Tensor]:
    parts = [pool.full_kv_pool] + ([pool.swa_kv_pool] if isinstance(pool, SWAKVPool) else [])
    return [b for p in parts for b in (scaled_parts(p) if hasattr(p, "part_names") else p.k_buffer + p.v_buffer)]


def refused(pool, error: type, match: str, call) -> None:
    """``call()`` raises ``error`` matching ``match``, and no byte of the pool's parts changed."""
    before = [b.clone() for b in every_part(pool)]
    with pytest.raises(error, match=match):
        call()
    assert_tensors_unchanged(every_part(pool), before, "a refused call wrote")


K, V = fp4_rows(2, FP4_D, 3), fp4_rows(2, FP4_DV, 4)


@pytest.mark.parametrize("fmt", ["fp4_mx_block16", "nvfp4"])
def test_a_slot_past_the_pool_raises_under_validate_and_nothing_is_written(fmt):
    pool = swa(validate=True, fp4_format=fmt)
    refused(pool, IndexError, r"loc\[1\]", lambda: pool.set_kv_buffer(None, slots([3, FULL_ROWS]), K, V, layer_id_override=2))
    refused(pool, IndexError, r"loc_2d", lambda: pool.set_kv_buffer_prefix_valid(
        None, slots([[3, FULL_ROWS]]), slots([1]), K, V, layer_id_override=0))  # uncommitted entries are checked too
    refused(pool, IndexError, r"loc\[1\]", lambda: pool.set_kv_buffer(None, slots([3, FULL_ROWS]), K, V, layer_id_override=1))
    checked = hybrid(validate=True, fp4_format=fmt)
    refused(checked, IndexError, r"loc_2d", lambda: checked.set_kv_buffer_prefix_valid(
        None, slots([[4, 21]]), slots([2]), K, V, layer_id_override=3))
    refused(checked, ValueError, r"commit_lens\[0\] must be in 0..2 \(the width of loc_2d\), got 3",
            lambda: checked.set_kv_buffer_prefix_valid(None, slots([[4, 5]]), slots([3]), K, V, layer_id_override=3))


def test_a_malformed_write_is_refused_before_anything_is_written():
    pool, plain = hybrid(), swa()
    bad_v = fp4_rows(2, FP4_D, 5)  # V rows of K's head dim
    cases = [
        (pool, ValueError, r"loc_2d must have bs \* width = T = 2 entries",
         lambda: pool.set_kv_buffer_prefix_valid(None, slots([[4, 5, 6]]), slots([1]), K, V, layer_id_override=3)),
        (pool, ValueError, r"commit_lens must be 1-D \[bs\] with bs = 2",
         lambda: pool.set_kv_buffer_prefix_valid(None, slots([[4], [5]]), slots([1]), K, V, layer_id_override=3)),
        (pool, ValueError, "cache_v must have head dim 16",
         lambda: pool.set_kv_buffer_prefix_valid(None, slots([[4, 5]]), slots([2]), K, bad_v, layer_id_override=3)),
        (pool, ValueError, "layer_id 4 is not a full-attention layer of this pool",
         lambda: pool.set_kv_buffer(None, slots([4, 5]), K, V, layer_id_override=4)),
        (plain, ValueError, "cache_v must have head dim 16",
         lambda: plain.set_kv_buffer(None, slots([3, 4]), K, bad_v, layer_id_override=2)),
        (plain, ValueError, "loc_2d must be",
         lambda: plain.set_kv_buffer_prefix_valid(None, slots([3, 4]), slots([1]), K, V, layer_id_override=0)),
        (plain, ValueError, r"loc must have 2 entries \(one per token\), got 1",
         lambda: plain.set_kv_buffer(None, slots([3]), K, V, layer_id_override=2)),
    ]
    for target, error, match, call in cases:
        refused(target, error, match, call)
    unmapped = swa(mapped=False)
    refused(unmapped, ValueError, "needs the full-to-SWA mapping: call register_mapping first",
            lambda: unmapped.set_kv_buffer(None, slots([3, 4]), K, V, layer_id_override=2))


def test_an_nvfp4_write_takes_only_the_layers_global_scale():
    pool = swa(fp4_format="nvfp4", k_global_scales=0.5)
    refused(pool, ValueError, r"k_scale must be None or the layer's NVFP4 global scale 0.5",
            lambda: pool.set_kv_buffer(None, slots([3, 4]), K, V, 2.0, None, layer_id_override=2))
    pool.set_kv_buffer(None, slots([3, 4]), K, V, 0.5, 1.0, layer_id_override=2)  # its own scales: written


@pytest.mark.parametrize("build", [hybrid, swa], ids=["hybrid", "swa"])
def test_fp4_parts_have_nothing_to_calibrate(build):
    pool = build()
    refused(pool, ValueError, "enabled must be False for an FP4 pool .*, got True", lambda: pool.observe_amax(True))
    pool.observe_amax(False)
    pool.reset_amax()
    assert pool.kv_amax is None
    refused(pool, ValueError, "calibrated_scales needs a pool with static scales", pool.calibrated_scales)


@pytest.mark.parametrize("build", [hybrid, swa], ids=["hybrid", "swa"])
def test_global_scales_are_refused_but_for_nvfp4_parts(build):
    mx, plain, nv = build(), build(torch.bfloat16), build(fp4_format="nvfp4")
    refused(mx, ValueError, "set_global_scales is for fp4_format='nvfp4', got fp4_format='fp4_mx_block16'",
            lambda: mx.set_global_scales(7 if build is hybrid else 2, 2.0, 2.0))
    refused(plain, ValueError, "set_global_scales needs an FP4 dtype, and this pool's dtype is torch.bfloat16",
            lambda: plain.set_global_scales(7 if build is hybrid else 2, 2.0, 2.0))
    with pytest.raises(ValueError, match="get_fp4_buffers needs an FP4 dtype"):
        plain.get_fp4_buffers(3 if build is hybrid else 1)
    part = nv.full_kv_pool if build is hybrid else nv.swa_kv_pool
    values = part.global_scale_values
    refused(nv, ValueError, "k_scale must be a positive finite float", lambda: nv.set_global_scales(
        7 if build is hybrid else 2, 0.0, 2.0))
    assert part.global_scale_values == values, "a refused scale was kept"
    with pytest.raises(ValueError, match="is not a"):
        nv.set_global_scales(5, 2.0, 2.0)  # a layer of neither pool


def test_the_hybrid_pools_fp4_latent_part_has_no_verify_write():
    pool = HybridLinearKVPool(20, FP4_POOL_DTYPE, 1, 1, 1, [3, 7], False, DEVICE, None, use_mla=True,
                              kv_lora_rank=32, qk_rope_head_dim=16)  # fmt: skip
    refused(pool, ValueError, "set_kv_buffer_prefix_valid needs an MHA pool inside, and this one uses MLA",
            lambda: pool.set_kv_buffer_prefix_valid(None, slots([[4, 5]]), slots([1]), K, V, layer_id_override=3))
    refused(pool, ValueError, "set_global_scales is for fp4_format='nvfp4'", lambda: pool.set_global_scales(3, 2.0, 2.0))


@pytest.mark.parametrize("dtype", [FP4_POOL_DTYPE, torch.bfloat16], ids=["fp4", "bf16"])
def test_a_malformed_swa_cpu_copy_is_refused_naming_what_is_wrong(dtype):
    pool = swa(dtype)
    copy = pool.get_cpu_copy(slots([3, 9]))
    at = slots([4, 3])
    refused(pool, ValueError, r"kv_cache_cpu must have the keys 'full' and 'swa' \(from get_cpu_copy\), got keys "
            r"\['full'\]: missing \['swa'\], unexpected \[\]", lambda: pool.load_cpu_copy({"full": copy["full"]}, at))
    refused(pool, ValueError, r"missing \[\], unexpected \['extra'\]",
            lambda: pool.load_cpu_copy({**copy, "extra": copy["swa"]}, at))
    refused(pool, TypeError, "kv_cache_cpu must be a dict \\(from get_cpu_copy\\), got list",
            lambda: pool.load_cpu_copy([copy["full"], copy["swa"]], at))
    refused(pool, ValueError, "kv_cache_cpu", lambda: pool.load_cpu_copy({"full": copy["swa"], "swa": copy["full"]}, at))
    pool.load_cpu_copy(copy, at)  # the copy itself loads


@pytest.mark.parametrize("dtype", [FP4_POOL_DTYPE, torch.bfloat16], ids=["fp4", "bf16"])
def test_under_validate_a_cpu_copy_whose_swa_slots_leave_the_pool_writes_neither_part(dtype):
    """The mapping changed in place after registration (its check then): a slot it now sends past
    the SWA part refuses the load before the full part is written."""
    pool = swa(dtype, validate=True)
    copy = pool.get_cpu_copy(slots([3, 9]))
    at = slots([4, 3])
    pool.full_to_swa_index_mapping[3] = 99
    refused(pool, IndexError, "full_to_swa_index_mapping\\[indices\\]", lambda: pool.load_cpu_copy(copy, at))


def test_an_nvfp4_cpu_copy_loads_only_under_the_global_scales_it_was_taken_with():
    pool = swa(fp4_format="nvfp4")
    copy = pool.get_cpu_copy(slots([3, 9]))
    pool.set_global_scales(2, 3.0, 3.0)  # the SWA part's layer 1: its rows would read under another scale
    refused(pool, ValueError, "kv_cache_cpu.global_scales must be this pool's", lambda: pool.load_cpu_copy(copy, slots([3, 9])))
