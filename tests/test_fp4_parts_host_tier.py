"""The host tiers over pools with FP4 parts (docs/contract.md, "Host tier for sliding-window
models", "Host tier for hybrid models"): ``SWAKVPoolHost`` and ``HybridPoolHost`` park every buffer
of an FP4 part, codes and block scales, and load them back byte for byte (an SWA part's rows at the
SWA slots the mapping gives the new full slots); NVFP4 pages load only under the global scales they
were saved under, and a refused load writes nothing."""

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
    HOST_LAYOUTS,
    assert_same_bytes,
    assert_tensors_unchanged,
    changed_rows,
    fill_random_,
    make_state_pool,
    scaled_dev_rows,
    scaled_parts,
    swa_mapping,
)
from kvpool import HybridLinearKVPool, SWAKVPool, SWAKVPoolHost
from kvpool.host.mamba_host import HybridPoolHost

FULL_ROWS = 25
OLD = {3: 5, 4: 6, 9: 2}  # full slot -> SWA slot when backed up; full slot 7 has no SWA part
NEW = {10: 3, 11: 8, 12: 9, 13: 1}  # the new full slots' SWA slots when loaded


def slots(xs) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64, device=DEVICE)


def swa(fmt: str, pairs: dict[int, int], seed: int, **scales) -> SWAKVPool:
    pool = SWAKVPool(24, 12, 1, FP4_POOL_DTYPE, FP4_H, FP4_D, [0, 2], [1], False, DEVICE, v_head_dim=FP4_DV,
                     fp4_format=fmt, **scales)  # fmt: skip
    pool.register_mapping(swa_mapping(FULL_ROWS, pairs))
    fill_random_(scaled_parts(pool.full_kv_pool) + scaled_parts(pool.swa_kv_pool), seed)
    return pool


def assert_rows(dst, dst_rows: list[int], src, src_rows: list[int], what: str) -> None:
    """Rows ``dst_rows`` of every part of every layer of ``dst`` are byte copies of ``src``'s ``src_rows``."""
    for part, name in enumerate(src.part_names):
        for layer in range(src.layer_num):
            got, want = scaled_dev_rows(dst, part, layer)[dst_rows], scaled_dev_rows(src, part, layer)[src_rows]
            assert_same_bytes(got, want, f"{what}: {name} layer {layer}")


@pytest.mark.parametrize("backend", ["kernel", "direct"])
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
@pytest.mark.parametrize("fmt", FP4_PART_FORMATS)
def test_the_swa_host_tier_carries_fp4_parts_byte_for_byte(fmt, layout, backend):
    pool, fresh = swa(fmt, OLD, seed=1), swa(fmt, NEW, seed=2)
    host = SWAKVPoolHost(pool, 2.0, 0, 1, layout)
    assert len(host.full_host.buffers) == len(host.swa_host.buffers) == 4, "codes and scales of K and V"
    h = host.alloc(4)
    host.backup_from_device_all_layer(pool, h, slots([3, 4, 9, 7]), backend)
    host.wait_for_backups()
    assert host.has_swa_rows(h).tolist() == [True, True, True, False]
    untouched = [b.clone() for b in scaled_parts(fresh.swa_kv_pool)]
    host.load_to_device_all_layer(fresh, h, slots([10, 11, 12, 13]), backend)
    host.wait_for_loads()
    assert_rows(fresh.full_kv_pool, [10, 11, 12, 13], pool.full_kv_pool, [3, 4, 9, 7], "full rows")
    assert_rows(fresh.swa_kv_pool, [3, 8, 9], pool.swa_kv_pool, [5, 6, 2], "SWA rows at the new SWA slots")
    assert changed_rows(scaled_parts(fresh.swa_kv_pool), untouched) <= {3, 8, 9}, "an SWA row without a host row was written"
    # One sliding-window layer alone: global layer 2 is the SWA part's layer 1.
    third = swa(fmt, NEW, seed=3)
    before = [b.clone() for b in scaled_parts(third.swa_kv_pool)]
    host.load_to_device_per_layer(third, h, slots([10, 11, 12, 13]), 2, backend)
    host.wait_for_loads()
    for part, name in enumerate(third.swa_kv_pool.part_names):
        layer0, layer1 = scaled_dev_rows(third.swa_kv_pool, part, 0), scaled_dev_rows(third.swa_kv_pool, part, 1)
        assert torch.equal(layer1[[3, 8, 9]], scaled_dev_rows(pool.swa_kv_pool, part, 1)[[5, 6, 2]]), name
        assert torch.equal(layer0, before[2 * part].reshape(third.swa_kv_pool.rows, -1).view(torch.uint8).cpu()), name


def test_nvfp4_swa_host_pages_load_only_under_their_global_scales():
    pool = swa("nvfp4", OLD, seed=1, k_global_scales=0.5)
    host = SWAKVPoolHost(pool, 2.0, 0, 1, "layer_first")
    h = host.alloc(3)
    host.backup_from_device_all_layer(pool, h, slots([3, 4, 9]))
    host.wait_for_backups()
    other = swa("nvfp4", NEW, seed=2, k_global_scales=2.0)
    parts = scaled_parts(other.full_kv_pool) + scaled_parts(other.swa_kv_pool)
    before = [b.clone() for b in parts]
    with pytest.raises(ValueError, match="NVFP4 global scales"):
        host.load_to_device_all_layer(other, h, slots([10, 11, 12]))
    assert_tensors_unchanged(parts, before, "a refused load wrote")
    same = swa("nvfp4", NEW, seed=2, k_global_scales=0.5)
    host.load_to_device_all_layer(same, h, slots([10, 11, 12]))
    host.wait_for_loads()
    assert_rows(same.full_kv_pool, [10, 11, 12], pool.full_kv_pool, [3, 4, 9], "full rows")


@pytest.mark.parametrize("fmt", FP4_PART_FORMATS + ["mla"])
def test_the_hybrid_host_tier_carries_an_fp4_full_attention_part(fmt):
    def hybrid(seed: int) -> HybridLinearKVPool:
        if fmt == "mla":
            geometry = dict(use_mla=True, kv_lora_rank=32, qk_rope_head_dim=16)
        else:
            geometry = dict(v_head_dim=FP4_DV, fp4_format=fmt)
        pool = HybridLinearKVPool(12, FP4_POOL_DTYPE, 1, FP4_H, FP4_D, [0, 3], False, DEVICE,
                                  make_state_pool(DEVICE, seed=seed), **geometry)  # fmt: skip
        fill_random_(scaled_parts(pool.full_kv_pool), seed)
        return pool

    pool, fresh = hybrid(0), hybrid(1)
    host = HybridPoolHost(pool, 2.0, 0, 1, "page_first")
    assert len(host.kv_host.buffers) == len(pool.full_kv_pool.part_names)
    kv_h, state_h = host.kv_host.alloc(3), host.state_host.alloc(1)
    host.backup(kv_h, slots([2, 5, 7]), state_h, slots([1]))
    host.wait_for_backups()
    host.load(kv_h, slots([8, 9, 10]), state_h, slots([2]))
    host.wait_for_loads()
    assert_rows(pool.full_kv_pool, [8, 9, 10], pool.full_kv_pool, [2, 5, 7], "loaded back into the same pool")
    host.kv_host.load_to_device_all_layer(fresh.full_kv_pool, kv_h, slots([2, 5, 7]))
    host.kv_host.wait_for_loads()
    assert_rows(fresh.full_kv_pool, [2, 5, 7], pool.full_kv_pool, [2, 5, 7], "into another pool")
