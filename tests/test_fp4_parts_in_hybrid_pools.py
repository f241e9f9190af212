"""FP4 parts inside the pools that build their own parts (docs/contract.md, "FP4 parts"): an FP4
``dtype`` makes the full-attention part of a ``HybridLinearKVPool`` and both parts of an
``SWAKVPool`` SGLang's FP4 pool, in either format; written (plainly and by the verify write), read,
moved and copied by global layer id and full slot, they hold byte for byte what the standalone FP4
pool's reference path stores for the same rows at the (translated) slots, and slots outside the
pool write nothing, whatever the mapping holds."""

from __future__ import annotations

import pytest
import torch

from kvassert import (
    DEVICE,
    FP4_D,
    FP4_DV,
    FP4_H,
    FP4_PART_FORMATS,
    FP4_POOL_DTYPE,
    assert_rows_copied,
    assert_same_bytes,
    assert_same_parts,
    changed_rows,
    fill_random_,
    fp4_alone,
    fp4_rows,
    fused_runs,
    scaled_parts,
    swa_mapping,
    translated,
)
from kvpool import HybridLinearKVPool, SWAKVPool
from kvpool.pools.fp4_base import Fp4CpuCopy
from kvpool.pools.mha_fp4_pool import MHATokenToKVPoolFP4
from kvpool.pools.mla_fp4_pool import MLATokenToKVPoolFP4

#: The path of the pool under test (its FP4 part's own gate decides); the standalone pool it is
#: compared with always takes the reference path.
PATHS = [pytest.param("never", id="reference"), pytest.param("always", id="kernel", marks=fused_runs)]
HYBRID_SCALES = dict(k_global_scales=[0.5, 2.0], v_global_scales=[4.0, 0.25])
SWA_SCALES = dict(k_global_scales=0.5, v_global_scales=2.0)
PAIRS = {3: 5, 4: 6, 9: 2}  # full slot -> SWA slot; full slot 7 is held without an SWA part
FULL_ROWS, SWA_ROWS = 25, 13  # SWAKVPool(24, 12, page_size=1)


def slots(xs) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64, device=DEVICE)


def hybrid(fmt: str, **kw) -> HybridLinearKVPool:
    scales = HYBRID_SCALES if fmt == "nvfp4" else {}
    return HybridLinearKVPool(20, FP4_POOL_DTYPE, 1, FP4_H, FP4_D, [3, 7], False, DEVICE, None, v_head_dim=FP4_DV,
                              fp4_format=fmt, **scales, **kw)  # fmt: skip


def swa(fmt: str, **kw) -> SWAKVPool:
    scales = SWA_SCALES if fmt == "nvfp4" else {}
    return SWAKVPool(24, 12, 1, FP4_POOL_DTYPE, FP4_H, FP4_D, [0, 2], [1], False, DEVICE, v_head_dim=FP4_DV,
                     fp4_format=fmt, **scales, **kw)  # fmt: skip


def snapshot(pool) -> list[torch.Tensor]:
    return [b.clone() for b in scaled_parts(pool)]


@pytest.mark.parametrize("mode", PATHS)
@pytest.mark.parametrize("fmt", FP4_PART_FORMATS)
def test_the_hybrid_pools_fp4_part_stores_the_fp4_pools_bytes(fmt, mode):
    pool = hybrid(fmt, fused=mode)
    alone = fp4_alone(fmt, 20, 2, **(HYBRID_SCALES if fmt == "nvfp4" else {}))
    inner = pool.full_kv_pool
    assert isinstance(inner, MHATokenToKVPoolFP4) and inner.fp4_format == fmt == pool.fp4_format
    assert pool.dtype == inner.dtype and pool.store_dtype == torch.uint8
    fill_random_(scaled_parts(inner), seed=1)
    fill_random_(scaled_parts(alone), seed=1)
    before = snapshot(inner)
    k, v = fp4_rows(6, FP4_D, 2), fp4_rows(6, FP4_DV, 3)
    loc = [2, 5, -1, 9, 21, 10**6]  # padding, the first slot past the pool, one far past it
    pool.set_kv_buffer(None, slots(loc), k, v, layer_id_override=7)
    alone.set_kv_buffer(None, slots(loc), k, v, layer_id_override=1)
    loc_2d, commit = slots([[11, 12, 13], [14, 15, 16]]), slots([1, 3])
    pool.set_kv_buffer_prefix_valid(None, loc_2d, commit, k, v, layer_id_override=3)
    alone.set_kv_buffer(None, slots([11, -1, -1, 14, 15, 16]), k, v, layer_id_override=0)  # the committed tokens
    assert_same_parts(inner, alone)
    assert changed_rows(scaled_parts(inner), before) == {2, 5, 9, 11, 14, 15, 16}, "rows outside the written slots changed"
    assert_same_bytes(pool.get_key_buffer(7), alone.get_key_buffer(1), "dequantized K")
    assert_same_bytes(pool.get_kv_buffer(3)[1], alone.get_value_buffer(0), "dequantized V")
    stored = pool.get_fp4_buffers(7)
    assert stored.k.data_ptr() == inner.k_buffer[1].data_ptr(), "the reader hands out the stored buffers"
    if fmt == "nvfp4":
        assert float(stored.k_global_scale) == 2.0 and float(stored.v_global_scale) == 0.25
    assert pool.get_v_head_dim() == FP4_DV
    assert pool.get_kv_size_bytes() == alone.get_kv_size_bytes()
    assert (inner.stats.fused_calls > 0) == (mode == "always"), "the part's path is the one asked for"


@pytest.mark.parametrize("fmt", FP4_PART_FORMATS)
def test_the_hybrid_pools_fp4_rows_move_and_round_trip_through_a_cpu_copy(fmt):
    pool = hybrid(fmt, out_dtype=torch.float32)
    inner = pool.full_kv_pool
    assert pool.out_dtype == torch.float32 and pool.get_key_buffer(3).dtype == torch.float32
    fill_random_(scaled_parts(inner), seed=4)
    before = snapshot(inner)
    pool.move_kv_cache(slots([16, 17]), slots([2, 9]))
    assert_rows_copied(scaled_parts(inner), before, [16, 17], [2, 9], "moved with their scales")
    kept = snapshot(inner)
    copy = pool.get_cpu_copy(slots([2, 5, 9]))
    assert isinstance(copy, Fp4CpuCopy) and copy.part_names == inner.part_names
    assert copy.global_scales == (((0.5, 4.0), (2.0, 0.25)) if fmt == "nvfp4" else ())
    fill_random_(scaled_parts(inner), seed=5)
    pool.load_cpu_copy(copy, slots([2, 5, 9]))
    for a, b in zip(scaled_parts(inner), kept):
        assert_same_bytes(a[[2, 5, 9]], b[[2, 5, 9]], "codes and scales back from the CPU copy")


def test_the_hybrid_pools_mla_part_is_the_fp4_latent_pool():
    pool = HybridLinearKVPool(20, FP4_POOL_DTYPE, 1, 1, 1, [3, 7], False, DEVICE, None, use_mla=True,
                              kv_lora_rank=32, qk_rope_head_dim=16)  # fmt: skip
    alone = MLATokenToKVPoolFP4(20, 1, FP4_POOL_DTYPE, 32, 16, 2, DEVICE, fused="never")
    inner = pool.full_kv_pool
    assert isinstance(inner, MLATokenToKVPoolFP4) and pool.fp4_format == "fp4_mx_block16"
    assert (pool.head_num, pool.head_dim, pool.v_head_dim, pool.get_v_head_dim()) == (1, 32, 16, 32)
    fill_random_(scaled_parts(inner), seed=6)
    fill_random_(scaled_parts(alone), seed=6)
    g = torch.Generator().manual_seed(7)
    nope = torch.randn(3, 1, 32, generator=g).to(torch.bfloat16).to(DEVICE)
    rope = torch.randn(3, 1, 16, generator=g).to(torch.bfloat16).to(DEVICE)
    loc = slots([4, -1, 8])
    pool.set_mla_kv_buffer(None, loc, nope, rope, layer_id_override=7)
    alone.set_mla_kv_buffer(None, loc, nope, rope, layer_id_override=1)
    assert_same_parts(inner, alone)
    layer = type("Layer", (), {"layer_id": 7})()
    for got, want in zip(pool.get_mla_kv_buffer(layer, slots([4, 8])), alone.get_mla_kv_buffer(
            type("Layer", (), {"layer_id": 1})(), slots([4, 8]))):  # fmt: skip
        assert_same_bytes(got, want, "the rows read back")
    assert pool.get_fp4_buffers(7).kv.data_ptr() == inner.kv_buffer[1].data_ptr()


@pytest.mark.parametrize("validate", [False, True], ids=["unchecked", "validate"])
@pytest.mark.parametrize("mode", PATHS)
@pytest.mark.parametrize("fmt", FP4_PART_FORMATS)
def test_the_swa_pools_fp4_parts_store_the_fp4_pools_bytes_at_the_translated_slots(fmt, mode, validate):
    pool = swa(fmt, fused=mode, validate=validate)
    scales = SWA_SCALES if fmt == "nvfp4" else {}
    full_alone, swa_alone = fp4_alone(fmt, 24, 1, **scales), fp4_alone(fmt, 12, 2, **scales)
    assert all(isinstance(p, MHATokenToKVPoolFP4) for p in (pool.full_kv_pool, pool.swa_kv_pool))
    if fmt == "nvfp4":  # a layer of its own global scales, set by global layer id
        pool.set_global_scales(2, 4.0, 0.25)
        swa_alone.set_global_scales(1, 4.0, 0.25)
    pairs = dict(PAIRS)
    if not validate:  # a corrupt mapping: SWA slots past the pool and negative; never written
        pairs.update({10: SWA_ROWS, 11: 10**6, 12: -7})
    pool.register_mapping(swa_mapping(FULL_ROWS, pairs))
    for seed, (mine, theirs) in enumerate(((pool.full_kv_pool, full_alone), (pool.swa_kv_pool, swa_alone))):
        fill_random_(scaled_parts(mine), seed=10 + seed)
        fill_random_(scaled_parts(theirs), seed=10 + seed)
    before = snapshot(pool.swa_kv_pool)
    loc = [3, 4, 9, 7, -1] + ([] if validate else [FULL_ROWS, 10, 11, 12])
    k, v = fp4_rows(len(loc), FP4_D, 8), fp4_rows(len(loc), FP4_DV, 9)
    swa_loc = translated(loc, pairs, FULL_ROWS)
    pool.set_kv_buffer(None, slots(loc), k, v, layer_id_override=2)
    swa_alone.set_kv_buffer(None, slots(swa_loc), k, v, layer_id_override=1)
    pool.set_kv_buffer(None, slots(loc), k, v, layer_id_override=1)
    full_alone.set_kv_buffer(None, slots(loc), k, v, layer_id_override=0)
    loc_2d, commit = slots([[3, 4], [9, 7]]).to(torch.int32), slots([1, 2]).to(torch.int32)  # int32 slots too
    pool.set_kv_buffer_prefix_valid(None, loc_2d, commit, k[:4], v[:4], layer_id_override=0)
    swa_alone.set_kv_buffer(None, slots(translated([3, -1, 9, 7], pairs, FULL_ROWS)), k[:4], v[:4], layer_id_override=0)
    assert_same_parts(pool.swa_kv_pool, swa_alone)
    assert_same_parts(pool.full_kv_pool, full_alone)
    # The mapped slots and the SWA padding slot 0 (full slot 7 has no SWA part): nothing else.
    assert changed_rows(scaled_parts(pool.swa_kv_pool), before) == {5, 6, 2, 0}
    assert_same_bytes(pool.get_key_buffer(2), swa_alone.get_key_buffer(1), "dequantized SWA K")
    assert_same_bytes(pool.get_value_buffer(1), full_alone.get_value_buffer(0), "dequantized full V")
    assert pool.get_fp4_buffers(0).v_scale.data_ptr() == pool.swa_kv_pool.v_scale_buffer[0].data_ptr()
    assert (pool.swa_kv_pool.stats.fused_calls > 0) == (mode == "always"), "the part's path is the one asked for"


@pytest.mark.parametrize("fmt", FP4_PART_FORMATS)
def test_the_swa_pools_fp4_rows_move_and_round_trip_through_cpu_copies_at_the_translated_slots(fmt):
    pool = swa(fmt)
    pool.register_mapping(swa_mapping(FULL_ROWS, PAIRS))
    full, part = pool.full_kv_pool, pool.swa_kv_pool
    fill_random_(scaled_parts(full) + scaled_parts(part), seed=12)
    before_full, before_swa = snapshot(full), snapshot(part)
    pool.move_kv_cache(slots([4, 7]), slots([9, 3]))  # SWA: 6 <- 2, and 0 (no SWA part) <- 5
    assert_rows_copied(scaled_parts(full), before_full, [4, 7], [9, 3], "full rows moved")
    assert_rows_copied(scaled_parts(part), before_swa, [6, 0], [2, 5], "SWA rows moved at the translated slots")
    kept_full, kept_swa = snapshot(full), snapshot(part)
    copy = pool.get_cpu_copy(slots([3, 9]))
    assert isinstance(copy["full"], Fp4CpuCopy) and isinstance(copy["swa"], Fp4CpuCopy)
    fill_random_(scaled_parts(full) + scaled_parts(part), seed=13)
    pool.load_cpu_copy(copy, slots([3, 9]))
    for a, b in zip(scaled_parts(full), kept_full):
        assert_same_bytes(a[[3, 9]], b[[3, 9]], "full codes and scales back")
    for a, b in zip(scaled_parts(part), kept_swa):
        assert_same_bytes(a[[5, 2]], b[[5, 2]], "SWA codes and scales back at the translated slots")
    addrs, sizes, per_page = pool.get_state_buf_infos()
    assert len(addrs) == 8, "the transfer registration lists the scale buffers after the codes"
    assert sizes[4] == SWA_ROWS * FP4_H * FP4_D // 16  # layer 0's K scale bytes, one per 16 elements
    assert per_page[2] == FP4_H * FP4_DV // 2
