"""The storage tier over host pools whose pages carry scales beside their codes (both FP4 formats,
the FP4 latent pool, per-token-head FP8): a stored page holds every part and comes back byte for
byte into a device pool; the namespace names the stored format, the parts and an NVFP4 pool's
global scales (and a static-scale FP8 pool's scales when a caller names them), so a page is never
read into a pool that would decode its bytes differently.
"""

from __future__ import annotations

import ctypes
import json

import pytest
import torch
from kvassert import (
    DEVICE,
    HOST_LAYOUTS,
    SCALED_KINDS,
    file_store,
    scaled_dev_rows,
    scaled_host,
    scaled_pool,
)

from kvpool.host.pool import MHATokenToKVPoolHost
from kvpool.pools.mha_pool import MHATokenToKVPool
from kvpool.storage import HiCacheStorageConfig, page_keys
from kvpool.storage.base import HiCacheStorage
from kvpool.storage.keys import key_namespace


@pytest.mark.parametrize("device", [DEVICE])
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
@pytest.mark.parametrize("kind", SCALED_KINDS)
def test_stored_pages_bring_every_part_back_to_a_device_pool(tmp_path, kind, layout, device):
    pool = scaled_pool(kind, device)
    host = scaled_host(pool, layout)
    src = host.alloc(4)
    d = torch.tensor([3, 4, 15, 16], device=device)
    host.backup_from_device_all_layer(pool, src, d)
    host.wait_for_backups()
    store = file_store(tmp_path / "kv", host, model_name="m")
    keys = page_keys([11, 12, 13, 14], host.page_size)
    assert store.batch_set_v1(keys, src) == [True, True]
    # A second process's host pool (fresh bytes everywhere) reads the pages and loads them.
    reader_pool = scaled_pool(kind, device, seed=7)
    reader = scaled_host(reader_pool, layout, seed=8)
    dst = reader.alloc(4)
    reader_store = file_store(tmp_path / "kv", reader, model_name="m")
    assert reader_store.batch_get_v1(keys, dst) == [True, True]
    target = torch.tensor([9, 10, 1, 2], device=device)
    reader.load_to_device_all_layer(reader_pool, dst, target)
    reader.wait_for_loads()
    for layer in range(2):
        for part, name in enumerate(pool.part_names):
            got = scaled_dev_rows(reader_pool, part, layer)[target.cpu()]
            assert torch.equal(got, scaled_dev_rows(pool, part, layer)[d.cpu()]), f"{name} layer {layer}"


@pytest.mark.parametrize("device", [DEVICE])
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
@pytest.mark.parametrize("kind", ["fp4", "fp8_token_head"])
def test_page_regions_are_the_flat_page_in_order(kind, layout, device):
    host = scaled_host(scaled_pool(kind, device), layout)
    h = host.alloc(4)
    regions = HiCacheStorage.host_page_regions(_Registered(host), page_keys([1, 2, 3, 4], 2), h)
    for i, blocks in enumerate(regions):
        raw = b"".join(ctypes.string_at(ptr, size) for ptr, size in blocks)
        assert raw == host.get_data_page(int(h[2 * i])).view(torch.uint8).numpy().tobytes()


class _Registered:
    """Just what ``host_page_regions`` reads of a backend: its registered host pool."""

    def __init__(self, host) -> None:
        self.mem_pool_host = host

    def host_page_starts(self, keys, host_indices):
        return host_indices[:: self.mem_pool_host.page_size].tolist()


def _namespace(host, **extra) -> dict:
    return json.loads(key_namespace(HiCacheStorageConfig(model_name="m", extra_config=extra or None), host))


@pytest.mark.parametrize("device", [DEVICE])
def test_the_namespace_names_the_format_parts_and_global_scales(device):
    fp4 = _namespace(scaled_host(scaled_pool("fp4", device), "layer_first"))
    nvfp4 = _namespace(scaled_host(scaled_pool("nvfp4", device), "layer_first"))
    # Same geometry and page bytes: only the format (and the NVFP4 global scales) tell them apart.
    assert fp4["geometry"]["page_bytes"] == nvfp4["geometry"]["page_bytes"]
    assert fp4["geometry"]["format"].endswith("/fp4_mx_block16") and nvfp4["geometry"]["format"].endswith("/nvfp4")
    assert nvfp4["geometry"]["global_scales"] == [[0.5, 2.0], [3.0, 0.25]]
    assert "global_scales" not in fp4["geometry"]
    names = [p[0] for p in fp4["geometry"]["parts"]]
    assert names == ["k_buffer", "v_buffer", "k_scale_buffer", "v_scale_buffer"]
    other_scales = _namespace(scaled_host(scaled_pool("nvfp4", device, k_global_scales=[0.5, 4.0]), "layer_first"))
    assert other_scales != nvfp4
    token = _namespace(scaled_host(scaled_pool("fp8_token_head", device), "layer_first"))
    assert token["geometry"]["format"] == "torch.float8_e4m3fn/fp8_per_token_head"
    assert token["geometry"]["parts"][2] == ["k_scale_buffer", [3], "torch.float32"]
    # A static-scale FP8 pool: its geometry as before, and the caller's scales when named.
    kv = MHATokenToKVPool(20, 2, torch.float8_e4m3fn, 3, 8, 2, device, v_head_dim=4, start_layer=2)
    kv_host = MHATokenToKVPoolHost(kv, 2.0, 0, 2, "layer_first")
    plain = _namespace(kv_host)
    assert "format" not in plain["geometry"] and "kv_scales" not in plain
    assert _namespace(kv_host, kv_scales=[[0.1, 0.2]]) != _namespace(kv_host, kv_scales=[[0.1, 0.3]])
    assert _namespace(kv_host, kv_scales=[[0.1, 0.2]])["kv_scales"] == [[0.1, 0.2]]


@pytest.mark.parametrize("device", [DEVICE])
def test_a_page_is_a_miss_for_a_pool_that_decodes_it_differently(tmp_path, device):
    nvfp4_host = scaled_host(scaled_pool("nvfp4", device), "layer_first")
    src = nvfp4_host.alloc(2)
    (key,) = page_keys([1, 2], 2)
    assert file_store(tmp_path / "kv", nvfp4_host, model_name="m").batch_set_v1([key], src) == [True]
    for other in (
        scaled_host(scaled_pool("fp4", device), "layer_first"),
        scaled_host(scaled_pool("nvfp4", device, v_global_scales=[2.0, 0.5]), "layer_first"),
    ):
        before = [b.clone() for b in other.buffers]
        store = file_store(tmp_path / "kv", other, model_name="m")
        assert not store.exists(key)
        assert store.batch_get_v1([key], other.alloc(2)) == [False]
        assert all(torch.equal(a, b) for a, b in zip(before, other.buffers)), "a miss wrote host bytes"
    same = scaled_host(scaled_pool("nvfp4", device, seed=5), "layer_first")
    assert file_store(tmp_path / "kv", same, model_name="m").batch_get_v1([key], same.alloc(2)) == [True]
