"""The host tier: MHATokenToKVPoolHost on CPU pools (the whole host tier's logic, both backends, both
layouts): sizing, page allocation, transfers against a model of the bytes (including a hypothesis
state machine), storage-tier pages, bad input, the direct backend's copy plan, the kernel backend
through Triton's interpreter, and the device pool's layer-transfer hook; on a GPU, the same transfers
on real sizes, their ordering and the stream helpers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kvassert import assert_same_bytes, fill_random_, frames_up_to, gpu, needs_interpreter, no_sync, random_cuda_pool

from kvpool import MHATokenToKVPool
from kvpool.kernels.copy_rows import launcher as C
from kvpool.host import MHATokenToKVPoolHost, direct_backend, memory
from kvpool.host.pages import HostPages
from kvpool.streams import OnStream, StreamMark

LAYOUTS = ["layer_first", "page_first"]
BACKENDS = ["kernel", "direct"]
# H=3, D=8, Dv=4 in FP8: 24- and 12-byte rows; 3 layers.
GEOM = dict(head_num=3, head_dim=8, v_head_dim=4, layer_num=3)


def make_device_pool(size=40, page_size=4, dtype=torch.float8_e4m3fn, seed=0, validate=False, **over):
    g = {**GEOM, **over}
    pool = MHATokenToKVPool(
        size, page_size, dtype, g["head_num"], g["head_dim"], g["layer_num"], "cpu",
        v_head_dim=g["v_head_dim"], start_layer=g.get("start_layer", 0), validate=validate,
    )  # fmt: skip
    fill_random_(pool.k_buffer + pool.v_buffer, seed)
    return pool


def make_host(pool, layout="layer_first", page_size=4, ratio=2.0, seed=1, **kw):
    host = MHATokenToKVPoolHost(pool, ratio, 0, page_size, layout, **kw)
    fill_random_([host.k_buffer, host.v_buffer], seed)
    return host


def host_rows(host: MHATokenToKVPoolHost, layer: int, which: str) -> torch.Tensor:
    """[size, row bytes] uint8 view of one layer's K or V on the host."""
    buf = host.k_buffer if which == "k" else host.v_buffer
    view = buf[layer] if host.layout == "layer_first" else buf[:, layer]
    return view.reshape(host.size, -1).view(torch.uint8)


def dev_rows(pool, layer: int, which: str) -> torch.Tensor:
    buf = pool.k_buffer[layer] if which == "k" else pool.v_buffer[layer]
    return buf.reshape(buf.shape[0], -1).view(torch.uint8)


def snapshot(pool, host):
    return [b.view(torch.uint8).clone() for b in pool.k_buffer + pool.v_buffer + [host.k_buffer, host.v_buffer]]


def unchanged(pool, host, before):
    return all(torch.equal(a, b) for a, b in zip(before, snapshot(pool, host)))


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


# --- transfers --------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
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


@pytest.mark.parametrize("layout", LAYOUTS)
def test_backends_are_bit_identical(layout):
    pool = make_device_pool(seed=8, dtype=torch.bfloat16)
    hosts = {b: make_host(pool, layout, seed=9, staging_bytes=200) for b in BACKENDS}
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
    before = snapshot(pool, host)
    e = torch.empty(0, dtype=torch.int64)
    host.backup_from_device_all_layer(pool, e, e, "kernel")
    host.load_to_device_all_layer(pool, e, e, "direct")
    assert unchanged(pool, host, before)


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
    before = snapshot(target, host)
    with pytest.raises(exc, match=match):
        if direction == "backup":
            host.backup_from_device_all_layer(target, h, d, backend)
        else:
            host.load_to_device_per_layer(target, h, d, 0, backend)
    assert unchanged(target, host, before)


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


# --- pages for a storage tier -----------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
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


@pytest.mark.parametrize("layout", LAYOUTS)
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


# --- the direct backend's copy plan -----------------------------------------------------------------


def test_runs():
    pos, first, length = direct_backend.runs(np.array([4, 5, 6, 9, 10, 2]))
    assert pos.tolist() == [0, 3, 5] and first.tolist() == [4, 9, 2] and length.tolist() == [3, 2, 1]
    assert all(x.shape == (0,) for x in direct_backend.runs(np.zeros(0, dtype=np.int64)))


@given(
    slots=st.lists(st.integers(0, 15), min_size=1, max_size=10, unique=True),
    layout=st.sampled_from(LAYOUTS),
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


# --- a state machine against a model of the bytes ---------------------------------------------------


class HostTierMachine(RuleBasedStateMachine):
    """Random backups, loads (one layer or all), frees and allocations; before each step every
    device row is refilled with fresh bytes, so a load that writes the wrong row or misses one shows.
    The model is the full byte contents of both pools."""

    @initialize(layout=st.sampled_from(LAYOUTS), staging=st.sampled_from([100, 1 << 20]), seed=st.integers(0, 99))
    def setup(self, layout, staging, seed):
        self.pool = make_device_pool(size=24, page_size=2, seed=seed, layer_num=2)
        self.host = make_host(self.pool, layout, page_size=2, ratio=1.0, seed=seed + 1, staging_bytes=staging)
        self.rows = self.pool.size + self.pool.page_size
        self.held: list[torch.Tensor] = []  # allocated host pages, a tensor per allocation
        self.model_host = [host_rows(self.host, l, w).clone() for l in range(2) for w in "kv"]
        self.seed = seed

    def _model_dev(self):
        return [dev_rows(self.pool, l, w).clone() for l in range(2) for w in "kv"]

    def _poison_device(self, data):
        self.seed += 1
        fill_random_(self.pool.k_buffer + self.pool.v_buffer, self.seed)
        return self._model_dev()

    @rule(pages=st.integers(1, 4))
    def alloc(self, pages):
        got = self.host.alloc(pages * 2)
        if pages * 2 > self.host.available_size() + (0 if got is None else pages * 2):
            assert got is None
        if got is not None:
            self.held.append(got)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data):
        i = data.draw(st.integers(0, len(self.held) - 1))
        self.host.free(self.held.pop(i))

    @precondition(lambda self: self.held)
    @rule(data=st.data(), backend=st.sampled_from(BACKENDS))
    def backup(self, data, backend):
        h = data.draw(st.sampled_from(self.held))
        d = data.draw(st.lists(st.integers(0, self.rows - 1), min_size=h.shape[0], max_size=h.shape[0]))
        model_dev = self._poison_device(data)
        self.host.backup_from_device_all_layer(self.pool, h, torch.tensor(d), backend)
        for i, rows in enumerate(model_dev):
            self.model_host[i][h] = rows[torch.tensor(d)]
        self.check(model_dev)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), backend=st.sampled_from(BACKENDS), layer=st.one_of(st.none(), st.integers(0, 1)))
    def load(self, data, backend, layer):
        h = data.draw(st.sampled_from(self.held))
        d = data.draw(st.permutations(range(self.rows)))[: h.shape[0]]
        model_dev = self._poison_device(data)
        d_t = torch.tensor(d, dtype=torch.int32)
        if layer is None:
            self.host.load_to_device_all_layer(self.pool, h, d_t, backend)
        else:
            self.host.load_to_device_per_layer(self.pool, h, d_t, layer, backend)
        for i in range(len(model_dev)):
            if layer is None or i // 2 == layer:
                model_dev[i][d_t.long()] = self.model_host[i][h]
        self.check(model_dev)

    def check(self, model_dev):
        for i, rows in enumerate(model_dev):
            assert torch.equal(dev_rows(self.pool, i // 2, "kv"[i % 2]), rows), f"device buffer {i}"
        for i, rows in enumerate(self.model_host):
            assert torch.equal(host_rows(self.host, i // 2, "kv"[i % 2]), rows), f"host buffer {i}"

    @invariant()
    def accounting(self):
        if hasattr(self, "host"):
            held = sum(t.shape[0] for t in self.held)
            assert self.host.available_size() + held == self.host.size


TestHostTierMachine = HostTierMachine.TestCase
TestHostTierMachine.settings = settings(max_examples=25, stateful_step_count=12, deadline=None)


# --- the kernel backend through the interpreter -----------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kernel_backend_runs_the_kernel(monkeypatch, layout):
    """With the kernel enabled on CPU tables, the host pool's kernel backend launches copy_rows's
    kernel (counted) and matches the direct backend."""
    monkeypatch.setattr(C, "_kernel_on_cpu", True)
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


# --- loads queued by the host pool's worker thread (background=True) --------------------------------


def _gate_copies(monkeypatch, backend, gate, fail_at=None):
    """Make the worker's per-layer copies wait for ``gate`` (and the one of layer ``fail_at`` raise):
    the test then sees the state while the background load is still queueing."""
    calls = []
    module, name = (C, "checked_copy") if backend == "kernel" else (direct_backend, "copy_segments")  # once per layer
    real = getattr(module, name)

    def copy(*a, **k):
        calls.append(1)
        assert gate.wait(10), "gate never opened"
        if fail_at is not None and len(calls) == fail_at + 1:
            raise RuntimeError("copy failed")
        return real(*a, **k)

    monkeypatch.setattr(module, name, copy)
    return calls


def _loaded_pair(layout, backend):
    """A device pool with this host pool's counter registered, and the host slots and device slots
    of a backup from another pool (whose rows the load must bring)."""
    src = make_device_pool(seed=5)
    host = make_host(src, layout)
    h = host.alloc(8)
    d = torch.tensor([3, 9, 10, 4, 20, 21, 22, 23])
    host.backup_from_device_all_layer(src, h, d, backend)
    pool = make_device_pool(seed=6)
    pool.register_layer_transfer_counter(host.layer_transfer_counter)
    return src, host, pool, h, d


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_background_load_returns_before_the_copies_and_getters_wait_for_them(monkeypatch, layout, backend):
    import threading

    src, host, pool, h, d = _loaded_pair(layout, backend)
    before = [b.clone() for b in pool.k_buffer + pool.v_buffer]
    gate = threading.Event()
    calls = _gate_copies(monkeypatch, backend, gate)
    host.load_to_device_all_layer(pool, h, d, backend, background=True)  # returns with nothing copied
    assert all(torch.equal(a, b) for a, b in zip(before, pool.k_buffer + pool.v_buffer))
    assert host.layer_transfer_counter._pending == [True, True, True]
    threading.Timer(0.05, gate.set).start()
    k, v = pool.get_kv_buffer(2)  # waits on the host until the worker has copied layer 2
    assert torch.equal(k.view(torch.uint8)[d], src.k_buffer[2].view(torch.uint8)[d])
    assert torch.equal(v.view(torch.uint8)[d], src.v_buffer[2].view(torch.uint8)[d])
    host.wait_for_loads()
    assert host._scheduler._job is None and calls
    for layer in range(3):
        for which in "kv":
            got, want = dev_rows(pool, layer, which), dev_rows(src, layer, which)
            base = before[layer if which == "k" else 3 + layer]
            base = base.reshape(base.shape[0], -1).view(torch.uint8)
            assert torch.equal(got[d], want[d])
            mask = torch.ones(got.shape[0], dtype=torch.bool)
            mask[d] = False
            assert torch.equal(got[mask], base[mask]), "rows not named changed"


@pytest.mark.parametrize("backend", BACKENDS)
def test_background_load_failure_reaches_the_getters_and_the_next_call(monkeypatch, backend):
    import threading

    src, host, pool, h, d = _loaded_pair("layer_first", backend)
    gate = threading.Event()
    gate.set()
    _gate_copies(monkeypatch, backend, gate, fail_at=1)  # layer 0 lands, layer 1's copy raises
    host.load_to_device_all_layer(pool, h, d, backend, background=True)
    k, _ = pool.get_kv_buffer(0)
    assert torch.equal(k.view(torch.uint8)[d], src.k_buffer[0].view(torch.uint8)[d])
    for layer in (1, 2):
        with pytest.raises(RuntimeError, match=f"layer {layer} was not loaded: its background load failed"):
            pool.get_key_buffer(layer)
    with pytest.raises(RuntimeError, match="background load failed: RuntimeError: copy failed"):
        host.backup_from_device_all_layer(src, h, d, backend)
    monkeypatch.undo()
    pool.register_layer_transfer_counter(host.layer_transfer_counter)
    host.load_to_device_all_layer(pool, h, d, backend, background=True)  # the pool works again
    for layer in range(3):
        assert torch.equal(pool.get_key_buffer(layer).view(torch.uint8)[d], src.k_buffer[layer].view(torch.uint8)[d])


def test_background_needs_the_counter_registered_else_the_call_queues_the_load():
    src, host, pool, h, d = _loaded_pair("page_first", "kernel")
    pool.register_layer_transfer_counter(None)
    host.load_to_device_all_layer(pool, h, d, "kernel", background=True)
    assert host._scheduler._worker is None and host._scheduler._job is None
    assert torch.equal(pool.k_buffer[1].view(torch.uint8)[d], src.k_buffer[1].view(torch.uint8)[d])


@pytest.mark.parametrize("call", ["backup", "load", "get_data_page", "set_from_flat_data_page", "get_page_buffer_meta", "wait_for_backups"])
def test_every_other_call_waits_for_the_background_queueing(monkeypatch, call):
    import threading

    src, host, pool, h, d = _loaded_pair("layer_first", "direct")
    gate = threading.Event()
    _gate_copies(monkeypatch, "direct", gate)
    host.load_to_device_all_layer(pool, h, d, "direct", background=True)
    threading.Timer(0.05, gate.set).start()
    page = int(h[0])
    {
        "backup": lambda: host.backup_from_device_all_layer(src, h, d, "direct"),
        "load": lambda: host.load_to_device_per_layer(pool, h, d, 0, "direct"),
        "get_data_page": lambda: host.get_data_page(page),
        "set_from_flat_data_page": lambda: host.set_from_flat_data_page(page, host.get_dummy_flat_data_page()),
        "get_page_buffer_meta": lambda: host.get_page_buffer_meta(h),
        "wait_for_backups": host.wait_for_backups,
    }[call]()
    assert host._scheduler._job is None and host.layer_transfer_counter._pending == [False] * 3
    assert torch.equal(pool.v_buffer[2].view(torch.uint8)[d], src.v_buffer[2].view(torch.uint8)[d])


def test_a_worker_that_cannot_start_leaves_no_getter_waiting(monkeypatch):
    import threading
    from concurrent.futures import ThreadPoolExecutor

    src, host, pool, h, d = _loaded_pair("layer_first", "kernel")

    def refuse(self, fn, *a, **k):
        raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    monkeypatch.setattr(ThreadPoolExecutor, "submit", refuse)
    with pytest.raises(RuntimeError, match="cannot schedule"):
        host.load_to_device_all_layer(pool, h, d, "kernel", background=True)
    outcome = []

    def getter():
        try:
            pool.get_key_buffer(0)
        except RuntimeError as e:
            outcome.append(str(e))

    t = threading.Thread(target=getter, daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive(), "the getter waits for a layer no worker will record"
    assert outcome and "layer 0 was not loaded" in outcome[0]


def test_a_failed_background_load_reports_once(monkeypatch):
    import threading

    src, host, pool, h, d = _loaded_pair("layer_first", "kernel")
    gate = threading.Event()
    gate.set()
    _gate_copies(monkeypatch, "kernel", gate, fail_at=1)
    host.load_to_device_all_layer(pool, h, d, "kernel", background=True)
    with pytest.raises(RuntimeError, match="background load failed"):
        host.wait_for_loads()
    host.wait_for_loads()  # the error is reported once
    assert torch.equal(pool.get_key_buffer(0).view(torch.uint8)[d], src.k_buffer[0].view(torch.uint8)[d])


# --- padding device indices, host pages named twice -------------------------------------------------


@pytest.mark.parametrize("keep", ["row-copy", "copy-engine"])
@pytest.mark.parametrize("layout", LAYOUTS)
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
    hosts = {b: make_host(pool, layout, seed=21, staging_bytes=staging_bytes) for b in BACKENDS}
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
        untouched = snapshot(target, host)
        host.load_to_device_all_layer(target, h, d, backend)
        host.load_to_device_per_layer(target, h, torch.tensor([-1, 3, -2, 4, 5, 6, 7, -1]), 1, backend)
        loaded[backend] = snapshot(target, host)
        written = torch.zeros(target.size + target.page_size, dtype=torch.bool)
        written[d[~pad]] = True
        written[torch.tensor([3, 4, 5, 6, 7])] = True
        for b in range(6):
            assert torch.equal(loaded[backend][b][~written], untouched[b][~written]), f"{backend}: device buffer {b}"
    for a, b in zip(loaded["kernel"], loaded["direct"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_backup_rejects_a_host_page_named_twice(backend):
    """Two device rows for one host row would leave it with either; free refuses the same list."""
    pool = make_device_pool()
    host = make_host(pool)
    h = host.alloc(8)
    twice = torch.cat((h[4:], h[4:]))
    before = snapshot(pool, host)
    with pytest.raises(ValueError, match=r"host_indices must name each page once, got page 1 \(slots 4\.\.\) twice"):
        host.backup_from_device_all_layer(pool, twice, torch.arange(1, 9), backend)
    assert unchanged(pool, host, before)
    host.load_to_device_all_layer(make_device_pool(), twice, torch.arange(1, 9), backend)  # reading twice is fine


# --- how deep a per-layer load goes -----------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
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


# --- the layer-transfer hook: the device pool's getters wait for a layer's load ---------------------


class RecordingCounter:
    def __init__(self):
        self.calls: list[int] = []

    def wait_until(self, layer_index: int) -> None:
        self.calls.append(layer_index)


def test_getters_wait_on_a_registered_counter():
    pool = make_device_pool(start_layer=5)
    counter = RecordingCounter()
    pool.get_key_buffer(6)
    assert pool.layer_transfer_counter is None
    pool.register_layer_transfer_counter(counter)
    pool.get_key_buffer(5)
    pool.get_value_buffer(7)
    k, v = pool.get_kv_buffer(6)
    assert counter.calls == [0, 2, 1] and k is pool.get_key_buffer(6)
    with pytest.raises(IndexError):
        pool.get_kv_buffer(8)  # checked before any wait
    assert counter.calls == [0, 2, 1, 1]
    pool.register_layer_transfer_counter(None)
    pool.get_key_buffer(5)
    assert len(counter.calls) == 4


# --- on a GPU: both backends and layouts against the device bytes, bit-identical backends, pinned
# buffers, the kernel backend's capped grid, no host synchronisation, ordering of transfers that share
# host pages, and the layer-wait path (eagerly, with the load queued by the call or by the host pool's
# worker thread, and inside a replayed CUDA graph) while later layers are still loading.


def device_pages(pool, tokens, page_size, gen) -> torch.Tensor:
    """Random whole device pages (not slot 0's page) for ``tokens`` slots, as an allocator gives."""
    pages = torch.randperm(pool.size // page_size - 1, generator=gen)[: tokens // page_size] + 1
    return (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1).to("cuda")


def host_pages(host, tokens, gen) -> torch.Tensor:
    """Whole host pages in random order."""
    slots = host.alloc(tokens)
    pages = slots.view(-1, host.page_size)
    return pages[torch.randperm(pages.shape[0], generator=gen)].reshape(-1)


def rows_of(pool, layer, which, idx):
    buf = pool.k_buffer[layer] if which == "k" else pool.v_buffer[layer]
    return buf.view(torch.uint8)[idx].cpu()


@gpu
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_backup_and_load_move_exact_bytes(layout, backend, page_size):
    if backend == "direct" and page_size == 1 and layout == "layer_first":
        tokens = 256  # one copy per token and layer: keep it short
    else:
        tokens = 4096
    gen = torch.Generator().manual_seed(page_size)
    pool = random_cuda_pool(size=16384, page_size=page_size, v_head_dim=64)
    host = MHATokenToKVPoolHost(pool, 2.0, 0, page_size, layout, staging_bytes=8 << 20)
    # Page-locked in place with cudaHostRegister (torch's is_pinned() answers only for its own
    # pinned allocator on some versions): both buffers lie inside the registered region.
    region = host._pinned
    assert host.pin_memory and region is not None
    for buf in (host.k_buffer, host.v_buffer):
        start = buf.data_ptr()
        assert region.ptr <= start and start + buf.numel() * buf.element_size() <= region.ptr + region.nbytes
    h = host_pages(host, tokens, gen)
    d = device_pages(pool, tokens, page_size, gen)
    event = host.backup_from_device_all_layer(pool, h, d, backend)
    assert isinstance(event, torch.cuda.Event)
    event.synchronize()
    for layer in range(pool.layer_num):
        hk = host.k_buffer[layer] if layout == "layer_first" else host.k_buffer[:, layer]
        hv = host.v_buffer[layer] if layout == "layer_first" else host.v_buffer[:, layer]
        assert_same_bytes(hk[h], rows_of(pool, layer, "k", d), f"host K {layer}")
        assert_same_bytes(hv[h], rows_of(pool, layer, "v", d), f"host V {layer}")
    other = random_cuda_pool(size=16384, page_size=page_size, v_head_dim=64, seed=1)
    before = [b.view(torch.uint8).cpu() for b in other.k_buffer + other.v_buffer]
    t = device_pages(other, tokens, page_size, gen)
    host.load_to_device_all_layer(other, h, t, backend)
    host.wait_for_loads()
    torch.cuda.synchronize()
    untouched = torch.ones(other.size + other.page_size, dtype=torch.bool)
    untouched[t.cpu()] = False
    for layer in range(pool.layer_num):
        for i, which in enumerate("kv"):
            assert_same_bytes(rows_of(other, layer, which, t), rows_of(pool, layer, which, d), f"{which} {layer}")
            buf = (other.k_buffer if which == "k" else other.v_buffer)[layer].view(torch.uint8).cpu()
            assert torch.equal(buf[untouched], before[i * pool.layer_num + layer][untouched])


@gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_backends_are_bit_identical_on_cuda(layout):
    gen = torch.Generator().manual_seed(5)
    pool = random_cuda_pool(size=16384)
    d = device_pages(pool, 4096, 16, gen)
    hosts = {}
    for backend in BACKENDS:
        host = hosts[backend] = MHATokenToKVPoolHost(pool, 1.0, 0, 16, layout)
        host.k_buffer.view(torch.uint8).fill_(0xFF)
        host.v_buffer.view(torch.uint8).fill_(0xFF)
        h = host.alloc(4096)
        host.backup_from_device_all_layer(pool, h, d, backend)
    torch.cuda.synchronize()
    assert torch.equal(hosts["kernel"].k_buffer, hosts["direct"].k_buffer)
    assert torch.equal(hosts["kernel"].v_buffer, hosts["direct"].v_buffer)
    loaded = {}
    for backend, host in hosts.items():
        target = random_cuda_pool(size=16384, seed=9)
        host.load_to_device_per_layer(target, torch.arange(4096), d, 2, backend)
        torch.cuda.synchronize()
        loaded[backend] = [b.view(torch.uint8).cpu() for b in target.k_buffer + target.v_buffer]
    for a, b in zip(loaded["kernel"], loaded["direct"]):
        assert torch.equal(a, b)


@gpu
def test_kernel_backend_grid_is_capped(monkeypatch):
    programs = []
    real = C.launch_copy_rows

    def spy(dst, di, src, si, **kw):
        plan = C.plan_copy(di.shape[0], len(dst), dst.distinct_row_bytes, min(dst.align, src.align),
                           kw.get("one_pass", False), kw["max_programs"], C.FEW_PROGRAMS_TILE)  # fmt: skip
        programs.append(plan.programs)
        return real(dst, di, src, si, **kw)

    monkeypatch.setattr(C, "launch_copy_rows", spy)
    pool = random_cuda_pool(size=16384)
    host = MHATokenToKVPoolHost(pool, 1.0, 0, 16, "layer_first")
    h = host.alloc(8192)
    host.backup_from_device_all_layer(pool, h, torch.arange(16, 8208, device="cuda"), "kernel")
    host.load_to_device_all_layer(pool, h, torch.arange(16, 8208, device="cuda"), "kernel")  # one launch
    pool.register_layer_transfer_counter(host.layer_transfer_counter)
    host.load_to_device_all_layer(pool, h, torch.arange(16, 8208, device="cuda"), "kernel")  # one per layer
    torch.cuda.synchronize()
    assert programs == [8] * (2 + pool.layer_num)


@gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_transfers_do_not_synchronise(layout, backend):
    pool = random_cuda_pool(size=16384)
    host = MHATokenToKVPoolHost(pool, 1.0, 0, 16, layout)
    h = host.alloc(2048)
    d = torch.arange(16, 2064, device="cuda")
    host.backup_from_device_all_layer(pool, h, d, backend)  # compiles and makes the staging buffers
    host.load_to_device_all_layer(pool, h, d, backend)
    with no_sync():
        host.backup_from_device_all_layer(pool, h, d, backend)
        host.load_to_device_all_layer(pool, h, d, backend)
        host.load_to_device_per_layer(pool, h, d, 1, backend)
        host.wait_for_loads()
        host.wait_for_backups()


@gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_transfers_on_shared_host_pages_are_ordered(backend):
    """A load right after a backup of the same pages sees the backup's bytes; a backup right after
    a load from the same pages does not overwrite them before the load has read them. No sync in
    between: the streams' ordering alone must do it."""
    gen = torch.Generator().manual_seed(7)
    tokens = 32768
    a = random_cuda_pool(size=40960, layers=8, seed=1)
    b = random_cuda_pool(size=40960, layers=8, seed=2)
    host = MHATokenToKVPoolHost(a, 1.0, 0, 16, "page_first")
    h = host_pages(host, tokens, gen)
    d = device_pages(a, tokens, 16, gen)
    want_a = [rows_of(a, l, "k", d) for l in range(8)]
    want_b = [rows_of(b, l, "k", d) for l in range(8)]
    target = random_cuda_pool(size=40960, layers=8, seed=3)
    target2 = random_cuda_pool(size=40960, layers=8, seed=4)
    torch.cuda.synchronize()
    host.backup_from_device_all_layer(a, h, d, backend)  # host <- a
    host.load_to_device_all_layer(target, h, d, backend)  # target <- host: must see a's bytes
    host.backup_from_device_all_layer(b, h, d, backend)  # host <- b: only after that load read them
    host.load_to_device_all_layer(target2, h, d, backend)  # target2 <- host: b's bytes
    torch.cuda.synchronize()
    for layer in range(8):
        assert_same_bytes(rows_of(target, layer, "k", d), want_a[layer], f"first load, layer {layer}")
        assert_same_bytes(rows_of(target2, layer, "k", d), want_b[layer], f"second load, layer {layer}")


def _stand_in_attention(pool, d, out):
    """A model step reading each layer's loaded rows as attention would, through the getters."""
    for layer in range(pool.layer_num):
        k, v = pool.get_kv_buffer(layer)
        torch.index_select(k.view(torch.uint8), 0, d, out=out[0][layer])
        torch.index_select(v.view(torch.uint8), 0, d, out=out[1][layer])


@gpu
@pytest.mark.parametrize("background", [False, True], ids=["queued-by-the-call", "background"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_wait_reads_each_layer_after_it_lands(backend, background):
    gen = torch.Generator().manual_seed(11)
    tokens, layers = 32768, 8
    src = random_cuda_pool(size=40960, layers=layers, seed=1)
    host = MHATokenToKVPoolHost(src, 1.0, 0, 16, "layer_first")
    h = host_pages(host, tokens, gen)
    d = device_pages(src, tokens, 16, gen)
    host.backup_from_device_all_layer(src, h, d, backend)
    want = [[rows_of(src, l, w, d) for l in range(layers)] for w in "kv"]
    pool = random_cuda_pool(size=40960, layers=layers, seed=2)
    pool.register_layer_transfer_counter(host.layer_transfer_counter)
    out = [torch.empty((layers, tokens, 8, 128), dtype=torch.uint8, device="cuda") for _ in range(2)]
    torch.cuda.synchronize()
    for trial in range(3):
        for buf in pool.k_buffer + pool.v_buffer:  # stale bytes the model must never see
            buf.view(torch.uint8).fill_(trial)
        # Queued (or, in the background, being queued); the model starts right away.
        host.load_to_device_all_layer(pool, h, d, backend, background=background)
        _stand_in_attention(pool, d, out)
        torch.cuda.synchronize()
        for w in range(2):
            for layer in range(layers):
                assert_same_bytes(out[w][layer].cpu(), want[w][layer], f"trial {trial} {'kv'[w]} layer {layer}")


@gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_wait_inside_a_cuda_graph(backend):
    """The getters' waits captured in a graph are external event waits: every replay waits for the
    loads enqueued before it, outside the graph."""
    gen = torch.Generator().manual_seed(12)
    tokens, layers = 16384, 8
    sources = [random_cuda_pool(size=20480, layers=layers, seed=s) for s in (1, 2)]
    host = MHATokenToKVPoolHost(sources[0], 2.0, 0, 16, "page_first")
    d = device_pages(sources[0], tokens, 16, gen)
    hs = []
    for src in sources:
        h = host_pages(host, tokens, gen)
        host.backup_from_device_all_layer(src, h, d, backend)
        hs.append(h)
    want = [[[rows_of(src, l, w, d) for l in range(layers)] for w in "kv"] for src in sources]
    pool = random_cuda_pool(size=20480, layers=layers, seed=3)
    pool.register_layer_transfer_counter(host.layer_transfer_counter)
    out = [torch.empty((layers, tokens, 8, 128), dtype=torch.uint8, device="cuda") for _ in range(2)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _stand_in_attention(pool, d, out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _stand_in_attention(pool, d, out)
    torch.cuda.synchronize()
    for trial in range(4):
        which = trial % 2
        for buf in pool.k_buffer + pool.v_buffer:
            buf.view(torch.uint8).fill_(0x40 + trial)
        host.load_to_device_all_layer(pool, hs[which], d, backend)
        graph.replay()
        torch.cuda.synchronize()
        for w in range(2):
            for layer in range(layers):
                assert_same_bytes(out[w][layer].cpu(), want[which][w][layer], f"replay {trial} {'kv'[w]} {layer}")


@gpu
def test_a_failed_background_load_still_orders_what_it_queued(monkeypatch):
    """A worker that fails part-way still records the pages its queued copies read (later backups
    into them wait) and keeps its index tensors until they ran; the layers it queued land."""
    gen = torch.Generator().manual_seed(21)
    tokens, layers = 4096, 4
    src = random_cuda_pool(size=16384, layers=layers, seed=1)
    host = MHATokenToKVPoolHost(src, 1.0, 0, 16, "layer_first")
    h = host_pages(host, tokens, gen)
    d = device_pages(src, tokens, 16, gen)
    host.backup_from_device_all_layer(src, h, d, "kernel")
    want = rows_of(src, 0, "k", d)
    pool = random_cuda_pool(size=16384, layers=layers, seed=2)
    pool.register_layer_transfer_counter(host.layer_transfer_counter)
    real, calls = C.launch_copy_rows, []

    def copy(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("copy failed")
        return real(*a, **k)

    monkeypatch.setattr(C, "launch_copy_rows", copy)  # layer 0's checked copy launches through it too
    seq = host._scheduler._seq
    host.load_to_device_all_layer(pool, h, d.clone(), "kernel", background=True)  # the clone is dropped at once
    with pytest.raises(RuntimeError, match="background load failed"):
        host.wait_for_loads()
    pages = h.numpy()[:: host.page_size] // host.page_size
    assert host._scheduler._seq == seq + 1 and (host._scheduler._page_read[pages] == host._scheduler._seq).all()
    torch.cuda.synchronize()
    assert_same_bytes(rows_of(pool, 0, "k", d), want, "layer 0, queued before the failure")
    with pytest.raises(RuntimeError, match="layer 1 was not loaded"):
        pool.get_key_buffer(1)


@gpu
@pytest.mark.parametrize(
    "backend, pin", [("kernel", True), ("direct", True), ("direct", False)], ids=["kernel", "direct", "direct-pageable"]
)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_padding_device_indices_leave_host_rows_as_they_were(layout, backend, pin):
    """Negative device indices (padding) and indices past the pool's rows are skipped: a backup
    keeps those host rows, bit for bit, though the direct backend's staging holds an earlier
    backup's rows there; a load writes nothing for them."""
    gen = torch.Generator().manual_seed(31)
    tokens = 2048
    pool = random_cuda_pool(size=16384, layers=3)
    host = MHATokenToKVPoolHost(pool, 1.0, 0, 16, layout, pin_memory=pin, staging_bytes=1 << 20)
    host.k_buffer.view(torch.uint8).copy_(torch.randint(0, 256, host.k_buffer.shape, dtype=torch.uint8, generator=gen))
    host.v_buffer.view(torch.uint8).copy_(torch.randint(0, 256, host.v_buffer.shape, dtype=torch.uint8, generator=gen))
    earlier = host_pages(host, tokens, gen)
    host.backup_from_device_all_layer(pool, earlier, device_pages(pool, tokens, 16, gen), backend)  # fills the staging
    h = host_pages(host, tokens, gen)
    d = device_pages(pool, tokens, 16, gen)
    skipped = torch.rand(tokens, generator=gen) < 0.25
    d[skipped.to("cuda")] = -1
    d[:: 97] = pool.size + pool.page_size + 5  # past the rows: skipped too (IndexError only under validate)
    skipped[:: 97] = True
    torch.cuda.synchronize()
    before = [b.view(torch.uint8).clone() for b in (host.k_buffer, host.v_buffer)]
    host.backup_from_device_all_layer(pool, h, d, backend)
    torch.cuda.synchronize()
    kept = ~skipped
    for layer in range(3):
        for which, buf, old in (("k", host.k_buffer, before[0]), ("v", host.v_buffer, before[1])):
            view = (lambda b: b[layer]) if layout == "layer_first" else (lambda b: b[:, layer])
            got, was = view(buf.view(torch.uint8))[h], view(old)[h]
            assert_same_bytes(got[skipped], was[skipped], f"skipped host rows {which}{layer}")
            assert_same_bytes(got[kept], rows_of(pool, layer, which, d.cpu()[kept].to("cuda")), f"{which}{layer}")
    target = random_cuda_pool(size=16384, layers=3, seed=4)
    untouched = [b.view(torch.uint8).cpu() for b in target.k_buffer + target.v_buffer]
    host.load_to_device_all_layer(target, h, d, backend)
    torch.cuda.synchronize()
    written = torch.zeros(target.size + target.page_size, dtype=torch.bool)
    written[d.cpu()[kept]] = True
    for i, b in enumerate(target.k_buffer + target.v_buffer):
        assert torch.equal(b.view(torch.uint8).cpu()[~written], untouched[i][~written]), f"device buffer {i}"


@gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_per_layer_load_reaches_its_launch_in_five_frames(monkeypatch, backend):
    """From ``load_to_device_per_layer`` to ``launch_copy_rows`` (which calls the compiled kernel),
    counting both."""
    depths = []
    real = C.launch_copy_rows

    def launch(*a, **k):  # stands for launch_copy_rows' own frame
        depths.append(frames_up_to("load_to_device_per_layer"))
        return real(*a, **k)

    pool = random_cuda_pool(size=16384)
    host = MHATokenToKVPoolHost(pool, 1.0, 0, 16, "layer_first")
    h = host.alloc(1024)
    d = torch.arange(16, 1040, device="cuda")
    host.backup_from_device_all_layer(pool, h, d, backend)
    monkeypatch.setattr(C, "launch_copy_rows", launch)
    host.load_to_device_per_layer(pool, h, d, 2, backend)
    torch.cuda.synchronize()
    assert depths and 0 not in depths and max(depths) <= 5, depths


# --- kvpool.streams on a GPU: OnStream makes a stream current and restores the caller's stream (also
# when the block raises, and when nested), and StreamMark orders one stream after another's work so
# far without a host wait, each wait following the record just before it.

# About 50 ms of GPU sleep on an H200: long enough that an unordered stream would overtake it.
SLEEP_CYCLES = 100_000_000


@gpu
def test_on_stream_makes_the_stream_current_and_restores_the_callers():
    dev = torch.cuda.current_device()
    caller = torch.cuda.Stream()
    side, other = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(caller):
        with OnStream(side):
            assert torch.cuda.current_stream() == side
            with OnStream(other):
                assert torch.cuda.current_stream() == other
            assert torch.cuda.current_stream() == side
        assert torch.cuda.current_stream() == caller
        with pytest.raises(RuntimeError, match="inside"):
            with OnStream(side):
                raise RuntimeError("raised inside")
        assert torch.cuda.current_stream() == caller
        assert torch.cuda.current_device() == dev


@gpu
def test_work_queued_inside_runs_on_the_stream():
    side = torch.cuda.Stream()
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    with OnStream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        x.fill_(1.0)
    # The caller's stream did not get the sleep: it is idle while the side stream is still busy.
    assert torch.cuda.current_stream().query()
    assert not side.query()
    side.synchronize()
    assert bool((x == 1.0).all())


@gpu
def test_stream_mark_orders_the_waiter_after_the_work_so_far():
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    mark = StreamMark()
    x = torch.zeros(1 << 20, device="cuda")
    y = torch.empty_like(x)
    torch.cuda.synchronize()
    with torch.cuda.stream(first):
        torch.cuda._sleep(SLEEP_CYCLES)
        x.fill_(1.0)
    mark.order(second, first)  # no host wait: `first` is still sleeping
    assert not first.query()
    with torch.cuda.stream(second):
        y.copy_(x)
    # Recording the same event again for later work on `first` does not move the earlier wait.
    with torch.cuda.stream(first):
        torch.cuda._sleep(SLEEP_CYCLES)
        x.fill_(2.0)
    mark.order(torch.cuda.current_stream(), first)
    torch.cuda.current_stream().synchronize()
    second.synchronize()
    assert bool((y == 1.0).all()), "the copy ran before the work it was ordered after, or after later work"
    assert bool((x == 2.0).all())
