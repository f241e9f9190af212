"""Transfers between a device pool and the host tier on CPU pools, both backends and both layouts:
backup and load against the device bytes, bit-identical backends, global layer ids, empty
transfers, bad transfers raising before any copy, host-page checks, the direct backend's copy plan,
the kernel backend through Triton's interpreter, padding device indices, a host page named twice,
and how many frames a per-layer load goes down to its copy.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvassert import (
    HOST_BACKENDS,
    HOST_LAYOUTS,
    dev_rows,
    frames_up_to,
    host_rows,
    host_tier_snapshot,
    host_tier_unchanged,
    make_device_pool,
    make_host,
    needs_interpreter,
)

from kvpool.kernels.copy_rows import launcher as C
from kvpool.host import direct_backend
from kvpool.host.pages import HostPages


# --- transfers --------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
@pytest.mark.parametrize("staging_bytes", [1 << 20, 150], ids=["one-chunk", "chunks"])
def test_backup_then_load_moves_exact_bytes(copy_path, layout, backend, staging_bytes):
    if copy_path == "kernel" and (backend == "direct" or staging_bytes != 1 << 20):
        pytest.skip("the interpreter runs the kernel backend once per layout")
    pool = make_device_pool(seed=3)
    host = make_host(pool, layout, staging_bytes=staging_bytes)
    h = host.alloc(12)
    h = torch.cat((h[8:], h[:8]))  # pages out of order: runs of one and two pages
    d = torch.tensor([5, 6, 7, 8, 30, 2, 3, 31, 0, 43, 17, 16])
    before_pool = [b.clone() for b in pool.k_buffer + pool.v_buffer]
    host_before = [host.k_buffer.clone(), host.v_buffer.clone()]
    assert host.backup_from_device_all_layer(pool, h, d, backend) is None
    assert all(torch.equal(a, b) for a, b in zip(before_pool, pool.k_buffer + pool.v_buffer))
    named = torch.zeros(host.size, dtype=torch.bool)
    named[h] = True
    for layer in range(3):
        for which in "kv":
            got = host_rows(host, layer, which)
            assert torch.equal(got[h], dev_rows(pool, layer, which)[d])
            ref = host_before[0] if which == "k" else host_before[1]
            ref_rows = (ref[layer] if layout == "layer_first" else ref[:, layer]).reshape(host.size, -1).view(torch.uint8)
            assert torch.equal(got[~named], ref_rows[~named]), "host rows not named changed"
    # Load into a fresh pool, one layer, then every layer, into other slots.
    other = make_device_pool(seed=4)
    untouched = [b.clone() for b in other.k_buffer + other.v_buffer]
    t = torch.tensor([1, 2, 3, 4, 9, 10, 11, 12, 20, 21, 22, 23], dtype=torch.int32)
    host.load_to_device_per_layer(other, h, t, 1, backend)
    for layer in range(3):
        for which in "kv":
            got = dev_rows(other, layer, which)
            base = untouched[layer if which == "k" else 3 + layer]
            base = base.reshape(base.shape[0], -1).view(torch.uint8)
            if layer == 1:
                assert torch.equal(got[t.long()], dev_rows(pool, layer, which)[d])
                mask = torch.ones(got.shape[0], dtype=torch.bool)
                mask[t.long()] = False
                assert torch.equal(got[mask], base[mask])
            else:
                assert torch.equal(got, base), f"layer {layer} {which} changed by a load of layer 1"
    host.load_to_device_all_layer(other, h, t, backend)
    for layer in range(3):
        for which in "kv":
            assert torch.equal(dev_rows(other, layer, which)[t.long()], dev_rows(pool, layer, which)[d])


@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_backends_are_bit_identical(layout):
    pool = make_device_pool(seed=8, dtype=torch.bfloat16)
    hosts = {b: make_host(pool, layout, seed=9, staging_bytes=200) for b in HOST_BACKENDS}
    d = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])  # a device row backed up twice is fine
    for backend, host in hosts.items():
        h = host.alloc(8)
        host.backup_from_device_all_layer(pool, h, d, backend)
    assert torch.equal(hosts["kernel"].k_buffer.view(torch.uint8), hosts["direct"].k_buffer.view(torch.uint8))
    assert torch.equal(hosts["kernel"].v_buffer.view(torch.uint8), hosts["direct"].v_buffer.view(torch.uint8))


def test_start_layer_and_global_layer_ids():
    pool = make_device_pool(start_layer=10)
    host = make_host(pool)
    h = host.alloc(4)
    host.backup_from_device_all_layer(pool, h, torch.tensor([1, 2, 3, 4]), "kernel")
    other = make_device_pool(start_layer=10, seed=5)
    host.load_to_device_per_layer(other, h, torch.tensor([5, 6, 7, 8]), 12, "direct")
    assert torch.equal(dev_rows(other, 2, "k")[5:9], dev_rows(pool, 2, "k")[1:5])
    with pytest.raises(IndexError, match=r"layer_id 3 is outside the pool's layers \[10, 12\]"):
        host.load_to_device_per_layer(other, h, torch.tensor([5, 6, 7, 8]), 3, "direct")


def test_empty_transfers_are_no_ops():
    pool = make_device_pool()
    host = make_host(pool)
    before = host_tier_snapshot(pool, host)
    e = torch.empty(0, dtype=torch.int64)
    host.backup_from_device_all_layer(pool, e, e, "kernel")
    host.load_to_device_all_layer(pool, e, e, "direct")
    assert host_tier_unchanged(pool, host, before)


def test_one_layer_page_first_direct_backup_copies_runs_not_rows(monkeypatch):
    """A page of a one-layer page_first pool is one block per K/V: consecutive pages are one copy."""
    pool = make_device_pool(layer_num=1)
    host = make_host(pool, "page_first")
    h = host.alloc(8)
    segments = []
    real = direct_backend.copy_segments
    monkeypatch.setattr(direct_backend, "copy_segments", lambda copies, **kw: (segments.extend(seg for c in copies for seg in c[0]), real(copies, **kw)))
    host.backup_from_device_all_layer(pool, h, torch.tensor([9, 3, 4, 5, 6, 7, 8, 1]), "direct")
    assert len(segments) == 2  # K and V, one run each
    assert torch.equal(host_rows(host, 0, "k")[h], dev_rows(pool, 0, "k")[torch.tensor([9, 3, 4, 5, 6, 7, 8, 1])])


def _bad_transfer(case):
    pool = make_device_pool()
    host = make_host(pool)
    h = host.alloc(8)
    d = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])
    backend = "kernel"
    target = pool
    if case == "counts":
        d = d[:4]
        match = (ValueError, r"device_indices must have as many entries as host_indices \(8\), got 4")
    elif case == "not-whole-pages":
        h, d = h[:6], d[:6]
        match = (ValueError, "host_indices must hold whole pages of 4 slots, got 6 entries")
    elif case == "misaligned":
        h = h + 1
        match = (ValueError, "host_indices must be whole pages")
    elif case == "host-out-of-range":
        h = torch.arange(80, 88)
        match = (IndexError, r"host_indices\[0\] = 80 is out of range: host slots are 0..79")
    elif case == "host-dtype":
        h = h.float()
        match = (ValueError, "host_indices must be int32 or int64, got torch.float32")
    elif case == "host-device":
        h = h.to("meta")
        match = (ValueError, "host_indices must be on cpu")
    elif case == "device-dtype":
        d = d.to(torch.int16)
        match = (ValueError, "device_indices must be int32 or int64, got torch.int16")
    elif case == "device-device":
        d = d.to("meta")
        match = (ValueError, "device_indices must be on cpu, got meta")
    elif case == "device-out-of-range":
        d = torch.tensor([1, 2, 3, 4, 5, 6, 7, 44])
        match = (IndexError, r"device_indices\[7\] = 44 is out of range: rows are 0..43")
    elif case == "geometry":
        target = make_device_pool(head_dim=16)
        match = (ValueError, "device_pool must have head_dim=8 like the pool this host pool was built for, got 16")
    elif case == "layers":
        target = make_device_pool(layer_num=2)
        match = (ValueError, "device_pool must have layer_num=3")
    elif case == "dtype":
        target = make_device_pool(dtype=torch.float8_e5m2)
        match = (ValueError, "device_pool must have dtype=torch.float8_e4m3fn")
    elif case == "backend":
        backend = "dma"
        match = (ValueError, "io_backend must be one of kernel, direct, got 'dma'")
    else:
        raise AssertionError(case)
    return pool, host, target, h, d, backend, match


BAD_TRANSFERS = [
    "counts", "not-whole-pages", "misaligned", "host-out-of-range", "host-dtype", "host-device", "device-dtype",
    "device-device", "device-out-of-range", "geometry", "layers", "dtype", "backend",
]  # fmt: skip


@pytest.mark.parametrize("direction", ["backup", "load"])
@pytest.mark.parametrize("case", BAD_TRANSFERS)
def test_bad_transfers_raise_before_copying(case, direction):
    pool, host, target, h, d, backend, (exc, match) = _bad_transfer(case)
    before = host_tier_snapshot(target, host)
    with pytest.raises(exc, match=match):
        if direction == "backup":
            host.backup_from_device_all_layer(target, h, d, backend)
        else:
            host.load_to_device_per_layer(target, h, d, 0, backend)
    assert host_tier_unchanged(target, host, before)


def _slot_problems(slots: np.ndarray, size: int, ps: int) -> bool:
    """The per-slot definition: any slot out of range, or any page not ps consecutive slots from
    a multiple of ps."""
    if ((slots < 0) | (slots >= size)).any():
        return True
    pages = slots.reshape(-1, ps)
    return bool(((pages[:, 0] % ps != 0) | np.any(pages != pages[:, :1] + np.arange(ps), axis=1)).any())


@settings(max_examples=300, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4]),
    pages=st.lists(st.integers(-3, 24), min_size=1, max_size=6),
    nudges=st.lists(st.tuples(st.integers(0, 23), st.integers(-5, 5)), max_size=2),
)
def test_quick_page_check_agrees_with_the_per_slot_checks(page_size, pages, nudges):
    """``whole_pages`` (page starts, one comparison) accepts exactly the slot lists the per-slot
    checks accept, and ``slots`` reports problems as before whichever path finds them."""
    allocator = HostPages(80 // page_size, page_size)  # 80 slots, as a host pool of ratio 2 over 40 slots
    slots = (np.array(pages, dtype=np.int64)[:, None] * page_size + np.arange(page_size)).reshape(-1)
    for pos, delta in nudges:  # break a page here and there
        slots[pos % slots.shape[0]] += delta
    bad = _slot_problems(slots, allocator.size, page_size)
    assert allocator.whole_pages(slots) == (not bad)
    if bad:
        with pytest.raises((IndexError, ValueError)):
            allocator.slots(torch.from_numpy(slots.copy()), "host_indices")
    else:
        assert np.array_equal(allocator.slots(torch.from_numpy(slots.copy()), "host_indices"), slots)


def test_validate_checks_host_pages_are_allocated():
    pool = make_device_pool()
    host = make_host(pool, validate=True)
    with pytest.raises(ValueError, match="host_indices must be allocated host slots: page 0 is free"):
        host.backup_from_device_all_layer(pool, torch.arange(4), torch.arange(4), "kernel")


# --- the direct backend's copy plan -----------------------------------------------------------------


def test_runs():
    pos, first, length = direct_backend.runs(np.array([4, 5, 6, 9, 10, 2]))
    assert pos.tolist() == [0, 3, 5] and first.tolist() == [4, 9, 2] and length.tolist() == [3, 2, 1]
    assert all(x.shape == (0,) for x in direct_backend.runs(np.zeros(0, dtype=np.int64)))


@given(
    slots=st.lists(st.integers(0, 15), min_size=1, max_size=10, unique=True),
    layout=st.sampled_from(HOST_LAYOUTS),
    layer=st.one_of(st.none(), st.integers(0, 2)),
)
def test_segments_cover_exactly_the_rows(slots, layout, layer):
    """Every byte the plan copies is the byte a row-by-row copy would copy, and nothing else."""
    size, layers, row, staging = 16, 3, 5, 12
    seg = direct_backend.segments(layout, direct_backend.runs(np.array(slots)), row, size, layers, staging, layer)
    got = {}
    for h, s, n in seg.tolist():
        for i in range(n):
            got[h + i] = s + i
    want = {}
    for p, slot in enumerate(slots):
        for lay in ([layer] if layer is not None else range(layers)):
            if layout == "layer_first":
                h0 = (lay * size + slot) * row
            else:
                h0 = (slot * layers + lay) * row
            if layer is not None:
                s0 = p * row
            elif layout == "layer_first":
                s0 = (lay * staging + p) * row
            else:
                s0 = (p * layers + lay) * row
            for i in range(row):
                want[h0 + i] = s0 + i
    assert got == want


def test_segments_merge_runs():
    seg = direct_backend.segments("page_first", direct_backend.runs(np.arange(8, 16)), 24, 64, 3, 8)
    assert seg.tolist() == [[8 * 3 * 24, 0, 8 * 3 * 24]]  # one copy for two consecutive pages
    seg = direct_backend.segments("layer_first", direct_backend.runs(np.arange(8, 16)), 24, 64, 3, 8)
    assert seg.shape == (3, 3)  # one per layer


# --- the kernel backend through the interpreter -----------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_kernel_backend_runs_the_kernel(monkeypatch, layout):
    """With the kernel enabled on CPU tables, the host pool's kernel backend launches copy_rows's
    kernel (counted) and matches the direct backend."""
    monkeypatch.setattr(C, "kernel_on_cpu", True)
    launches = []
    real = C.launch_copy_rows
    monkeypatch.setattr(C, "launch_copy_rows", lambda *a, **k: launches.append(k.get("max_programs")) or real(*a, **k))
    pool = make_device_pool(seed=12)
    host = make_host(pool, layout, kernel_programs=2)
    h = host.alloc(8)
    d = torch.tensor([9, 8, 7, 6, 1, 2, 3, 4])
    host.backup_from_device_all_layer(pool, h, d, "kernel")
    assert launches == [2]
    other = make_device_pool(seed=13)
    host.load_to_device_all_layer(other, h, torch.arange(10, 18), "kernel")
    assert launches == [2, 2]  # nothing waits per layer: every layer in one launch
    third = make_device_pool(seed=14)
    third.register_layer_transfer_counter(host.layer_transfer_counter)
    host.load_to_device_all_layer(third, h, torch.arange(20, 28), "kernel")
    assert launches == [2, 2, 2, 2, 2]  # a model waits per layer: one launch per layer
    for target, start in ((other, 10), (third, 20)):
        for layer in range(3):
            for which in "kv":
                assert torch.equal(dev_rows(target, layer, which)[start : start + 8], dev_rows(pool, layer, which)[d])


# --- padding device indices, host pages named twice -------------------------------------------------


@pytest.mark.parametrize("keep", ["row-copy", "copy-engine"])
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
@pytest.mark.parametrize("staging_bytes", [1 << 20, 150], ids=["one-chunk", "chunks"])
def test_padding_device_indices_are_skipped_by_both_backends(monkeypatch, layout, staging_bytes, keep):
    """A pair whose device index is negative is padding: a backup leaves that host row as it was and
    a load writes no device row for it, with either backend, byte for byte alike (the direct
    backend's staging still holds an earlier backup's rows there). ``keep``: how the direct backend
    keeps those rows, by a row copy from the host buffers, or (pageable host memory on CUDA) by the
    copy engine filling the staging first."""
    if keep == "copy-engine":
        monkeypatch.setattr(direct_backend.DirectBackend, "_keep_skipped_rows", lambda self, t: (None, True))
    pool = make_device_pool(seed=20)
    hosts = {b: make_host(pool, layout, seed=21, staging_bytes=staging_bytes) for b in HOST_BACKENDS}
    d = torch.tensor([10, -1, 12, 13, -1, 15, 16, -1])
    pad = d < 0
    loaded = {}
    for backend, host in hosts.items():
        earlier = host.alloc(8)
        host.backup_from_device_all_layer(pool, earlier, torch.arange(30, 38), backend)  # fills the staging
        h = host.alloc(8)
        before = [host_rows(host, layer, w)[h].clone() for layer in range(3) for w in "kv"]
        host.backup_from_device_all_layer(pool, h, d, backend)
        for i, (layer, w) in enumerate((layer, w) for layer in range(3) for w in "kv"):
            got = host_rows(host, layer, w)[h]
            assert torch.equal(got[pad], before[i][pad]), f"{backend}: padded host rows changed ({w}{layer})"
            assert torch.equal(got[~pad], dev_rows(pool, layer, w)[d[~pad]]), f"{backend}: {w}{layer}"
        target = make_device_pool(seed=22)
        untouched = host_tier_snapshot(target, host)
        host.load_to_device_all_layer(target, h, d, backend)
        host.load_to_device_per_layer(target, h, torch.tensor([-1, 3, -2, 4, 5, 6, 7, -1]), 1, backend)
        loaded[backend] = host_tier_snapshot(target, host)
        written = torch.zeros(target.size + target.page_size, dtype=torch.bool)
        written[d[~pad]] = True
        written[torch.tensor([3, 4, 5, 6, 7])] = True
        for b in range(6):
            assert torch.equal(loaded[backend][b][~written], untouched[b][~written]), f"{backend}: device buffer {b}"
    for a, b in zip(loaded["kernel"], loaded["direct"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_a_backup_rejects_a_host_page_named_twice(backend):
    """Two device rows for one host row would leave it with either; free refuses the same list."""
    pool = make_device_pool()
    host = make_host(pool)
    h = host.alloc(8)
    twice = torch.cat((h[4:], h[4:]))
    before = host_tier_snapshot(pool, host)
    with pytest.raises(ValueError, match=r"host_indices must name each page once, got page 1 \(slots 4\.\.\) twice"):
        host.backup_from_device_all_layer(pool, twice, torch.arange(1, 9), backend)
    assert host_tier_unchanged(pool, host, before)
    host.load_to_device_all_layer(make_device_pool(), twice, torch.arange(1, 9), backend)  # reading twice is fine


# --- how deep a per-layer load goes -----------------------------------------------------------------


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_a_per_layer_load_reaches_its_copy_in_five_frames(monkeypatch, layout, backend):
    """From ``load_to_device_per_layer`` to the row copy itself (``copy_rows_reference`` on a CPU pool,
    where a CUDA pool calls ``launch_copy_rows``), counting both: the scheduler, the backend and
    ``checked_copy`` between them."""
    depths = []
    real = C.copy_rows_reference

    def copy(*a):
        depths.append(frames_up_to("load_to_device_per_layer"))
        return real(*a)

    monkeypatch.setattr(C, "copy_rows_reference", copy)
    src = make_device_pool(seed=30)
    host = make_host(src, layout)
    h = host.alloc(8)
    host.backup_from_device_all_layer(src, h, torch.arange(1, 9), backend)
    pool = make_device_pool(seed=31)
    depths.clear()
    host.load_to_device_per_layer(pool, h, torch.arange(10, 18), 1, backend)
    assert depths and max(depths) <= 5, depths
    assert torch.equal(dev_rows(pool, 1, "k")[10:18], dev_rows(src, 1, "k")[1:9])
