"""The host tier's sizing and page API (``MHATokenToKVPoolHost`` on CPU pools): the size from a ratio
or from gigabytes, bad constructor arguments, allocating and freeing pages, data pages for a storage
tier and their metadata, and pinned host buffers registering whole pages of their own
(``cudaHostRegister`` mocked).
"""

from __future__ import annotations

import pytest
import torch
from kvassert import HOST_LAYOUTS, make_device_pool, make_host

from kvpool.host import MHATokenToKVPoolHost, memory


# --- sizing and allocation --------------------------------------------------------------------------


def test_size_from_ratio_rounds_down_to_pages():
    pool = make_device_pool(size=40)
    host = MHATokenToKVPoolHost(pool, 1.7, 0, 16, "page_first")
    assert host.size == 64 and host.page_num == 4  # 40 * 1.7 = 68 -> 4 pages of 16
    assert host.size_per_token == host.get_size_per_token() == 3 * 3 * (8 + 4)
    assert host.k_buffer.shape == (64, 3, 3, 8) and host.v_buffer.shape == (64, 3, 3, 4)
    assert host.k_buffer.dtype == torch.uint8 and host.dtype == torch.float8_e4m3fn and not host.pin_memory


def test_size_from_gigabytes():
    pool = make_device_pool()
    host = MHATokenToKVPoolHost(pool, 99.0, 1e-5, 4, "layer_first")  # 10 kB / 108 B = 92 -> 92 slots
    assert host.size == 92 and host.k_buffer.shape == (3, 92, 3, 8)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(host_to_device_ratio=0.0), "host_to_device_ratio must be a positive number"),
        (dict(host_to_device_ratio=0.01), "at least one page of 4 slots, got 0 slots"),
        (dict(layout="page_head"), "layout must be one of layer_first, page_first, got 'page_head'"),
        (dict(device="cuda"), "device must be cpu"),
        (dict(page_size=0), "page_size must be a positive int, got 0"),
        (dict(host_size=float("nan")), "host_size must be a number of GB"),
    ],
)
def test_bad_constructor_arguments(kwargs, match):
    args = dict(host_to_device_ratio=2.0, host_size=0, page_size=4, layout="layer_first")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        MHATokenToKVPoolHost(make_device_pool(), **args)


def test_not_enough_host_memory_fails_before_allocating(monkeypatch):
    pool = make_device_pool()
    monkeypatch.setattr(memory, "available_host_bytes", lambda: 10_000)
    monkeypatch.setattr(torch, "empty", lambda *a, **k: pytest.fail("allocated host memory"))
    with pytest.raises(ValueError, match=r"host memory: the host pool needs 8,640 bytes \(80 slots x 108 B\) but only 7,500 bytes"):
        MHATokenToKVPoolHost(pool, 2.0, 0, 4, "layer_first")


def test_device_pool_must_be_a_pool():
    with pytest.raises(TypeError, match="device_pool must be an MHATokenToKVPool"):
        MHATokenToKVPoolHost(object(), 2.0, 0, 4, "layer_first")


def test_alloc_free_pages():
    host = make_host(make_device_pool(), ratio=0.5)  # 20 slots, 5 pages
    assert host.available_size() == 20
    a = host.alloc(8)
    assert a.dtype == torch.int64 and a.tolist() == list(range(8))
    b = host.alloc(12)
    assert host.available_size() == 0 and host.alloc(4) is None and host.available_size() == 0
    assert host.free(torch.cat((a[4:], a[:4]))) == 8  # pages in any order
    c = host.alloc(8)
    assert sorted(c.tolist()) == list(range(8))
    with pytest.raises(ValueError, match="multiple of page_size 4, got 6"):
        host.alloc(6)
    host.free(b[:4])
    with pytest.raises(ValueError, match=r"page 2 \(slots 8..\) is not allocated \(double free\?\)"):
        host.free(b[:4])
    host.clear()
    assert host.available_size() == 20


@pytest.mark.parametrize(
    "indices, exc, match",
    [
        (torch.tensor([0, 1, 2]), ValueError, "whole pages of 4 slots, got 3 entries"),
        (torch.tensor([1, 2, 3, 4]), ValueError, r"whole pages .*: entries 0..3 are \[1, 2, 3, 4\]"),
        (torch.tensor([0, 1, 3, 2]), ValueError, "whole pages"),
        (torch.tensor([80, 81, 82, 83]), IndexError, r"indices\[0\] = 80 is out of range: host slots are 0..79"),
        (torch.tensor([0.0, 1, 2, 3]), ValueError, "indices must be int32 or int64, got torch.float32"),
        (torch.tensor([0, 1, 2, 3, 0, 1, 2, 3]), ValueError, "each page once"),
    ],
)
def test_free_rejects_bad_indices(indices, exc, match):
    host = make_host(make_device_pool())
    host.alloc(80)
    with pytest.raises(exc, match=match):
        host.free(indices)
    assert host.available_size() == 0


# --- pages for a storage tier -----------------------------------------------------------------------


@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_data_pages_round_trip(layout):
    pool = make_device_pool()
    host = make_host(pool, layout)
    page = host.get_data_page(8)
    k, v = host.get_data_page(8, flat=False)
    assert page.dtype == torch.uint8 and page.shape == (4 * 3 * 3 * 12,)
    if layout == "layer_first":
        assert k.shape == (3, 4, 3, 8) and torch.equal(k, host.k_buffer[:, 8:12])
    else:
        assert k.shape == (4, 3, 3, 8) and torch.equal(k, host.k_buffer[8:12])
    assert torch.equal(page, torch.cat((k.reshape(-1), v.reshape(-1))))
    before = [host.k_buffer.clone(), host.v_buffer.clone()]
    host.set_from_flat_data_page(16, page)
    k2, v2 = host.get_data_page(16, flat=False)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    # Nothing outside page 16 moved.
    mask = torch.ones(host.size, dtype=torch.bool)
    mask[16:20] = False
    for buf, old in zip((host.k_buffer, host.v_buffer), before):
        if layout == "layer_first":
            assert torch.equal(buf[:, mask], old[:, mask])
        else:
            assert torch.equal(buf[mask], old[mask])
    dummy = host.get_dummy_flat_data_page()
    assert dummy.shape == page.shape and not dummy.any()


@pytest.mark.parametrize(
    "index, page, exc, match",
    [
        (6, None, IndexError, "first slot of a page .* got 6"),
        (80, None, IndexError, "got 80"),
        (1.0, None, TypeError, "index must be an int"),
        (8, torch.zeros(10, dtype=torch.uint8), ValueError, r"1-D with 432 elements"),
        (8, torch.zeros(432, dtype=torch.float16), ValueError, "data_page must be torch.uint8, got torch.float16"),
    ],
)
def test_bad_data_pages(index, page, exc, match):
    host = make_host(make_device_pool())
    before = [host.k_buffer.clone(), host.v_buffer.clone()]
    with pytest.raises(exc, match=match):
        if page is None:
            host.get_data_page(index)
        else:
            host.set_from_flat_data_page(index, page)
    assert torch.equal(before[0], host.k_buffer) and torch.equal(before[1], host.v_buffer)


@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_page_buffer_meta_points_at_the_pages(layout):
    host = make_host(make_device_pool(), layout)
    ptrs, sizes = host.get_page_buffer_meta(torch.tensor([12, 13, 14, 15, 4, 5, 6, 7]))
    if layout == "page_first":
        assert ptrs == [
            host.k_buffer[12].data_ptr(), host.v_buffer[12].data_ptr(), host.k_buffer[4].data_ptr(), host.v_buffer[4].data_ptr()
        ]  # fmt: skip
        assert sizes == [4 * 3 * 24, 4 * 3 * 12] * 2
    else:
        expect = []
        for s in (12, 4):
            for layer in range(3):
                expect += [host.k_buffer[layer, s].data_ptr(), host.v_buffer[layer, s].data_ptr()]
        assert ptrs == expect and sizes == [4 * 24, 4 * 12] * 6


# --- pinned host buffers (cudaHostRegister mocked: the arithmetic of the registered range) ----------


class FakeCudart:
    def __init__(self):
        self.registered: dict[int, int] = {}

    def cudaHostRegister(self, ptr, size, flags):
        assert flags == 3  # portable | mapped
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr):
        del self.registered[ptr]
        return 0


@pytest.mark.parametrize("k_shape, v_shape", [((3, 5, 2, 8), (3, 5, 2, 4)), ((2, 1000, 8, 128), (2, 1000, 8, 64))])
def test_pinned_buffers_register_whole_pages_of_their_own(monkeypatch, k_shape, v_shape):
    import os

    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    page = os.sysconf("SC_PAGE_SIZE")
    k, v, handle = memory.host_buffers(k_shape, v_shape, torch.uint8, True)
    assert k.shape == k_shape and v.shape == v_shape and k.is_contiguous() and v.is_contiguous()
    [(ptr, size)] = fake.registered.items()
    assert ptr % page == 0 and size % page == 0
    raw = handle.raw
    assert raw.data_ptr() <= ptr and ptr + size <= raw.data_ptr() + raw.numel()  # inside the allocation
    for t in (k, v):
        assert t.data_ptr() % page == 0 and ptr <= t.data_ptr() and t.data_ptr() + t.numel() <= ptr + size
    assert k.data_ptr() + k.numel() <= v.data_ptr()  # no overlap
    del handle
    assert not fake.registered  # unregistered with its handle; k and v stay valid host memory
    assert k.sum() >= 0 and v.sum() >= 0
