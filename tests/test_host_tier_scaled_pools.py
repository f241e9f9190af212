"""The host tier over pools whose rows carry scales beside their codes (the FP4 pools in both
formats, the per-token-head FP8 pool): every part of a layer (codes and scales) goes device -> host
-> device byte for byte, by backup, whole and per-layer loads and flat data pages (and through the
SWA and hybrid host tiers over per-token-head parts); an NVFP4 pool's
global scales must be those the host pages were saved under; what the host tier cannot move is
refused before anything is copied.
"""

from __future__ import annotations

import pytest
import torch
from kvassert import (
    DEVICE,
    HOST_LAYOUTS,
    SCALED_KINDS,
    SCALED_START,
    fill_random_,
    make_state_pool,
    scaled_dev_rows,
    scaled_host,
    scaled_host_rows,
    scaled_parts,
    scaled_pool,
    swa_mapping,
)

from kvpool.host.mamba_host import HybridPoolHost
from kvpool.host.pool import MHATokenToKVPoolHost, MLATokenToKVPoolHost
from kvpool.host.swa_host import SWAKVPoolHost
from kvpool.pools.hybrid_kv_pool import HybridLinearKVPool
from kvpool.pools.mha_pool import MHATokenToKVPool
from kvpool.pools.swa_pool import SWAKVPool

START = SCALED_START
KINDS = SCALED_KINDS


def _snapshot(pool) -> list[torch.Tensor]:
    return [b.view(torch.uint8).cpu().clone() for b in scaled_parts(pool)]


@pytest.mark.parametrize("device", [DEVICE])
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_backup_then_loads_carry_every_part_byte_for_byte(kind, layout, device):
    for backend, staging in (("kernel", None), ("direct", 1 << 20), ("direct", 150)):
        pool = scaled_pool(kind, device)
        host = scaled_host(pool, layout, **({} if staging is None else dict(staging_bytes=staging)))
        assert len(host.buffers) == len(pool.part_names)
        h = host.alloc(6)
        h = torch.cat((h[4:], h[:4]))  # pages out of order
        d = torch.tensor([5, 6, 7, 8, 19, 2], device=device)
        before = _snapshot(pool)
        host.backup_from_device_all_layer(pool, h, d, backend)
        host.wait_for_backups()
        assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(pool))), "a backup changed the device pool"
        for layer in range(2):
            for part in range(len(pool.part_names)):
                assert torch.equal(scaled_host_rows(host, part, layer)[h], scaled_dev_rows(pool, part, layer)[d.cpu()]), (
                    f"{backend}: host {pool.part_names[part]} layer {layer} differs from the device rows"
                )
        # Per-layer loads into a fresh pool, other slots: each layer's parts land, nothing else moves.
        fresh = scaled_pool(kind, device, seed=4)
        target = torch.tensor([9, 10, 3, 4, 11, 12], device=device)
        untouched = torch.ones(fresh.rows, dtype=torch.bool)
        untouched[target.cpu()] = False
        for layer in range(2):
            prior = _snapshot(fresh)
            host.load_to_device_per_layer(fresh, h, target, START + layer, backend)
            host.wait_for_loads()
            for part in range(len(pool.part_names)):
                name = pool.part_names[part]
                got, src = scaled_dev_rows(fresh, part, layer), scaled_dev_rows(pool, part, layer)
                assert torch.equal(got[target.cpu()], src[d.cpu()]), f"{backend}: {name} layer {layer} not loaded"
                old = prior[part * 2 + layer].reshape(fresh.rows, -1)
                assert torch.equal(got[untouched], old[untouched]), f"{backend}: {name} rows not named changed"
                if layer == 0:  # layer 1 is not loaded yet: every part of it is as it was
                    assert torch.equal(scaled_dev_rows(fresh, part, 1), prior[part * 2 + 1].reshape(fresh.rows, -1))
        # Every layer at once into a third pool.
        third = scaled_pool(kind, device, seed=5)
        host.load_to_device_all_layer(third, h, target, backend)
        host.wait_for_loads()
        for layer in range(2):
            for part in range(len(pool.part_names)):
                assert torch.equal(scaled_dev_rows(third, part, layer)[target.cpu()], scaled_dev_rows(pool, part, layer)[d.cpu()])


@pytest.mark.parametrize("device", [DEVICE])
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_flat_data_pages_hold_every_part(kind, layout, device):
    pool = scaled_pool(kind, device)
    host = scaled_host(pool, layout)
    h = host.alloc(4)
    d = torch.tensor([1, 2, 13, 14], device=device)
    host.backup_from_device_all_layer(pool, h, d)
    host.wait_for_backups()
    row_bytes = sum(b[0].nbytes for b in (getattr(pool, n)[0] for n in pool.part_names))
    assert sum(host.page_bytes) == 2 * 2 * row_bytes  # page_size 2, 2 layers, every part of a row
    assert len(host.page_bytes) == len(pool.part_names)
    assert host.size_per_token == 2 * row_bytes
    pages = [host.get_data_page(int(h[0])), host.get_data_page(int(h[2]))]
    assert pages[0].dtype == host.store_dtype and pages[0].numel() * pages[0].element_size() == sum(host.page_bytes)
    assert host.get_dummy_flat_data_page().shape == pages[0].shape
    # Into another host pool's pages, then to a fresh device pool: the device rows come back exact.
    other = scaled_host(pool, layout)
    h2 = other.alloc(4)
    other.set_from_flat_data_page(int(h2[0]), pages[0].clone())
    other.set_from_flat_data_page(int(h2[2]), pages[1].clone())
    for a, b in zip(other.get_data_page(int(h2[0]), flat=False), host.get_data_page(int(h[0]), flat=False)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    fresh = scaled_pool(kind, device, seed=6)
    target = torch.tensor([7, 8, 3, 4], device=device)
    other.load_to_device_all_layer(fresh, h2, target)
    other.wait_for_loads()
    for layer in range(2):
        for part in range(len(pool.part_names)):
            assert torch.equal(scaled_dev_rows(fresh, part, layer)[target.cpu()], scaled_dev_rows(pool, part, layer)[d.cpu()])
    ptrs, sizes = host.get_page_buffer_meta(h[:2])
    assert sum(sizes) == sum(host.page_bytes) and len(ptrs) == len(sizes)
    with pytest.raises(ValueError, match="data_page must be 1-D"):
        other.set_from_flat_data_page(int(h2[0]), pages[0][:-1].clone())


@pytest.mark.parametrize("device", [DEVICE])
def test_nvfp4_host_pages_need_the_global_scales_they_were_saved_under(device):
    pool = scaled_pool("nvfp4", device)
    host = scaled_host(pool, "page_first")
    assert host.global_scales == ((0.5, 2.0), (3.0, 0.25))
    h = host.alloc(2)
    d = torch.tensor([1, 2], device=device)
    host.backup_from_device_all_layer(pool, h, d)
    other = scaled_pool("nvfp4", device, seed=3, k_global_scales=[0.5, 4.0])
    before = _snapshot(other)
    with pytest.raises(ValueError, match="NVFP4 global scales the host pages were saved under"):
        host.load_to_device_per_layer(other, h, d, START, "kernel")
    with pytest.raises(ValueError, match="NVFP4 global scales"):
        host.load_to_device_all_layer(other, h, d)
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(other))), "a refused load wrote"
    host.load_to_device_per_layer(pool, h, d, START, "kernel")  # a layer-by-layer load begins
    pool.set_global_scales(START, 1.0, 1.0)  # the pages were saved under the old ones
    with pytest.raises(ValueError, match="NVFP4 global scales"):  # the same host_indices: still checked
        host.load_to_device_per_layer(pool, h, d, START + 1, "kernel")
    with pytest.raises(ValueError, match="set_global_scales before building the host pool"):
        host.load_to_device_all_layer(pool, h, d)
    with pytest.raises(ValueError, match="NVFP4 global scales"):
        host.backup_from_device_all_layer(pool, h, d)
    same = scaled_pool("nvfp4", device, seed=3)  # equal scales: loads
    host.load_to_device_all_layer(same, h, torch.tensor([5, 6], device=device))


@pytest.mark.parametrize("device", [DEVICE])
def test_a_device_pool_of_another_format_or_kind_is_refused(device):
    fp4, nvfp4 = scaled_pool("fp4", device), scaled_pool("nvfp4", device)
    host = scaled_host(fp4, "layer_first")
    h = host.alloc(2)
    d = torch.tensor([1, 2], device=device)
    with pytest.raises(ValueError, match="parts of the pool this host pool was built for"):
        host.backup_from_device_all_layer(nvfp4, h, d)
    kv = MHATokenToKVPool(20, 2, torch.float8_e4m3fn, 3, 32, 2, device, v_head_dim=16, start_layer=START)
    kv_host = MHATokenToKVPoolHost(kv, 2.0, 0, 2, "layer_first")
    with pytest.raises(ValueError, match="device_pool must have dtype"):
        kv_host.load_to_device_all_layer(fp4, kv_host.alloc(2), d)
    token = scaled_pool("fp8_token_head", device)
    with pytest.raises(ValueError, match="device_pool must have head_dim"):
        scaled_host(token, "layer_first").load_to_device_all_layer(kv, h, d)
    with pytest.raises(TypeError, match="MLATokenToKVPool or MLATokenToKVPoolFP4, got MHATokenToKVPoolFP4"):
        MLATokenToKVPoolHost(fp4, 2.0, 0, 2, "layer_first")
    with pytest.raises(TypeError, match="device_pool must be an MHATokenToKVPool, .* got object"):
        MHATokenToKVPoolHost(object(), 2.0, 0, 2, "layer_first")


@pytest.mark.parametrize("device", [DEVICE])
def test_the_swa_host_tier_carries_both_parts_scales(device):
    def swa_pool(seed: int) -> SWAKVPool:
        pool = SWAKVPool(24, 12, 1, torch.float8_e4m3fn, 2, 16, [0, 2], [1], False, device, v_head_dim=8,
                         kv_scale_mode="per_token_head")  # fmt: skip
        pool.register_mapping(swa_mapping(pool.full_kv_pool.rows, {3: 5, 4: 6, 9: 2}, device))
        fill_random_(scaled_parts(pool.full_kv_pool) + scaled_parts(pool.swa_kv_pool), seed)
        return pool

    pool, fresh = swa_pool(0), swa_pool(1)
    host = SWAKVPoolHost(pool, 2.0, 0, 1, "layer_first")
    h = host.alloc(3)
    slots = torch.tensor([3, 4, 9], device=device)
    host.backup_from_device_all_layer(pool, h, slots)
    host.wait_for_backups()
    host.load_to_device_all_layer(fresh, h, slots)
    host.wait_for_loads()
    for part, rows in (("full_kv_pool", [3, 4, 9]), ("swa_kv_pool", [5, 6, 2])):
        src, dst = getattr(pool, part), getattr(fresh, part)
        for i, name in enumerate(src.part_names):
            for layer in range(src.layer_num):
                got, want = scaled_dev_rows(dst, i, layer)[rows], scaled_dev_rows(src, i, layer)[rows]
                assert torch.equal(got, want), f"{part}.{name} layer {layer}"


@pytest.mark.parametrize("device", [DEVICE])
def test_the_hybrid_host_tier_carries_the_full_attention_scales(device):
    def hybrid(seed: int) -> HybridLinearKVPool:
        pool = HybridLinearKVPool(12, torch.float8_e4m3fn, 1, 2, 16, [0, 3], False, device,
                                  make_state_pool(device, seed=seed), kv_scale_mode="per_token_head")  # fmt: skip
        fill_random_(scaled_parts(pool.full_kv_pool), seed)
        return pool

    pool, fresh = hybrid(0), hybrid(1)
    host = HybridPoolHost(pool, 2.0, 0, 1, "page_first")
    assert len(host.kv_host.buffers) == 4
    kv_h, state_h = host.kv_host.alloc(3), host.state_host.alloc(1)
    slots, states = torch.tensor([2, 5, 7], device=device), torch.tensor([1], device=device)
    host.backup(kv_h, slots, state_h, states)
    host.wait_for_backups()
    host.kv_host.load_to_device_all_layer(fresh.full_kv_pool, kv_h, slots)
    host.kv_host.wait_for_loads()
    src, dst = pool.full_kv_pool, fresh.full_kv_pool
    for i, name in enumerate(src.part_names):
        for layer in range(src.layer_num):
            assert torch.equal(scaled_dev_rows(dst, i, layer)[[2, 5, 7]], scaled_dev_rows(src, i, layer)[[2, 5, 7]]), name
