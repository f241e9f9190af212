"""The host tier of state slots: MambaPoolHost parks a MambaPool's slots in host memory and brings
them back byte for byte (both layouts, both backends), alone and with their KV (HybridPoolHost)."""

from __future__ import annotations

import pytest
import torch

from kvassert import STATE_LAYERS as LAYERS
from kvassert import assert_same_bytes, assert_states, state_params
from kvassert import make_state_pool as make_pool
from kvassert import slots_of as T
from kvassert import state_device  # noqa: F401 (a fixture)
from kvassert import state_snapshot as snapshot
from kvpool import HybridLinearKVPool, HybridPoolHost, MambaPoolHost
from kvpool import MambaCacheParams, MambaPool, MambaStateShape

META = torch.device("meta")
SHAPE = MambaStateShape(conv=(7, 3), temporal=(2, 3, 5))
PARAMS = state_params()


@pytest.fixture
def device(state_device):
    return state_device


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
def test_host_round_trip_is_exact(device, layout, io_backend):
    pool = make_pool(device)
    host = MambaPoolHost(pool, 2.0, 0, layout=layout)
    assert host.size == 18 and host.page_size == 1 and host.get_size_per_token() == PARAMS.bytes_per_slot
    h = host.alloc(3)
    assert h.tolist() == [0, 1, 2] and host.available_size() == 15
    before = snapshot(pool)
    event = host.backup_from_device_all_layer(pool, h, T([4, 9, -1], device), io_backend)
    assert (event is None) == (device == "cpu")
    host.wait_for_backups()
    if event is not None:
        event.synchronize()  # the host reads the pinned rows next: a stream wait does not cover it
    lead = (slice(None), slice(0, 2)) if layout == "layer_first" else (slice(0, 2), slice(None))
    got = host.temporal[lead]
    got = got if layout == "layer_first" else got.transpose(0, 1)
    assert_same_bytes(got.contiguous().view(torch.uint8), before[1][:, [4, 9]], "host rows")
    pool.clear_slots(T([4, 9], device))
    host.load_to_device_all_layer(pool, h[:2], T([9, 4], device), io_backend)  # swapped on the way back
    host.wait_for_loads()
    expected = [b.clone() for b in before]
    for e, b in zip(expected, before):
        e[:, [9, 4]] = b[:, [4, 9]]
    assert_states(pool, expected)
    assert host.free(h) == 3 and host.available_size() == 18


def test_host_backup_padding_keeps_the_host_row():
    pool = make_pool()
    host = MambaPoolHost(pool, 1.0, 0)
    h = host.alloc(2)
    host.backup_from_device_all_layer(pool, h, T([1, 2]))
    kept = host.temporal[:, 1].clone()
    host.backup_from_device_all_layer(pool, h, T([3, -1]))
    assert torch.equal(host.temporal[:, 1].view(torch.int32), kept.view(torch.int32))
    before = snapshot(pool)
    host.load_to_device_all_layer(pool, h, T([-1, 5]))
    for b in before:
        b[:, 5] = b[:, 2]
    assert_states(pool, before)


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda h, p, s: h.backup_from_device_all_layer(p, s, T([1, 2]), "copy"), ValueError, "io_backend must be one of kernel, direct"),
        (lambda h, p, s: h.backup_from_device_all_layer(p, s, T([1])), ValueError, "device_indices must have as many entries as host_indices"),
        (lambda h, p, s: h.backup_from_device_all_layer(p, s, T([1, 10])), IndexError, r"device_indices\[1\] = 10 is out of range"),
        (lambda h, p, s: h.backup_from_device_all_layer(p, T([0, 0]), T([1, 2])), ValueError, "must name each page once"),
        (lambda h, p, s: h.backup_from_device_all_layer(p, T([0, 40]), T([1, 2])), IndexError, r"host_indices\[1\] = 40 is out of range"),
        (lambda h, p, s: h.backup_from_device_all_layer(p, s, T([1, 2]).to(META)), ValueError, "device_indices must be on cpu"),
        (lambda h, p, s: h.load_to_device_all_layer(p, s, T([1.0, 2.0], dtype=torch.float32)), ValueError, "device_indices must be int32 or int64"),
        (lambda h, p, s: h.backup_from_device_all_layer(make_pool(params=MambaCacheParams(SHAPE, (1, 2))), s, T([1, 2])),
         ValueError, "device_pool must have the cache_params"),
        (lambda h, p, s: h.backup_from_device_all_layer(object(), s, T([1, 2])), TypeError, "device_pool must be a MambaPool"),
    ],
    ids=["backend", "lengths", "device-range", "host-twice", "host-range", "device", "dtype", "geometry", "type"],
)
def test_host_transfers_reject_bad_input_before_copying(call, exc, match):
    pool = make_pool(size=9)
    host = MambaPoolHost(pool, 2.0, 0)
    h = host.alloc(2)
    host_before = host.temporal.clone()
    before = snapshot(pool)
    with pytest.raises(exc, match=match):
        call(host, pool, h)
    assert torch.equal(host.temporal.view(torch.int32), host_before.view(torch.int32)) and host.free(h) == 2
    assert_states(pool, before, "nothing written")


def test_host_sizes_and_construction_errors():
    pool = make_pool()
    assert MambaPoolHost(pool, 1.0, 1e-6).size == int(1e3 // PARAMS.bytes_per_slot)
    two_convs = MambaPool(size=4, cache_params=MambaCacheParams(MambaStateShape(conv=[(7, 3), (4, 3)], temporal=(2, 3, 5)), LAYERS), device="cpu")
    host = MambaPoolHost(two_convs, 1.0, 0)
    assert [c.shape for c in host.conv] == [(3, 4, 7, 3), (3, 4, 4, 3)]
    with pytest.raises(ValueError, match=r"io_backend must be one of kernel \('direct' needs one convolution per layer\)"):
        host.backup_from_device_all_layer(two_convs, host.alloc(1), T([1]), "direct")
    for args, kwargs, exc, match in [
        ((object(), 1.0, 0), {}, TypeError, "device_pool must be a MambaPool"),
        ((pool, 0, 0), {}, ValueError, "host_to_device_ratio must be a positive number"),
        ((pool, 1.0, 1e-9), {}, ValueError, "at least one slot"),
        ((pool, 1.0, 0), dict(layout="page_first_direct"), ValueError, "layout must be one of layer_first, page_first"),
        ((pool, 1.0, 0), dict(allocator_type="mooncake"), ValueError, "allocator_type must be 'default'"),
        ((pool, 1.0, 0), dict(device="cuda"), ValueError, "device must be cpu"),
    ]:
        with pytest.raises(exc, match=match):
            MambaPoolHost(*args, **kwargs)


def _hybrid_pools(device):
    mamba = make_pool(device)
    kv = HybridLinearKVPool(32, torch.float8_e4m3fn, 4, 2, 16, [0, 3, 4], False, device, mamba, warmup=False)
    g = torch.Generator().manual_seed(5)
    for buf in kv.full_kv_pool.k_buffer + kv.full_kv_pool.v_buffer:
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=g).to(buf.device))
    return kv, mamba


def test_hybrid_host_parks_and_reloads_kv_with_state(device):
    kv, mamba = _hybrid_pools(device)
    host = HybridPoolHost(kv, 2.0, 0, 4, "page_first")
    assert host.kv_host.size == 64 and host.state_host.size == 18
    kv_h, state_h = host.kv_host.alloc(8), host.state_host.alloc(1)
    kv_slots, state_slot = torch.arange(8, 16, device=device), T([3], device)
    k_before = [b[8:16].clone() for b in kv.full_kv_pool.k_buffer]
    state_before = snapshot(mamba)
    host.backup(kv_h, kv_slots, state_h, state_slot)
    host.wait_for_backups()
    for b in kv.full_kv_pool.k_buffer:
        b[8:16] = 0  # the request's slots reused by another request
    mamba.clear_slots(state_slot)
    new_kv, new_state = torch.arange(20, 28, device=device), T([7], device)
    host.load(kv_h, new_kv, state_h, new_state)
    host.wait_for_loads()
    for b, before in zip(kv.full_kv_pool.k_buffer, k_before):
        assert_same_bytes(b[20:28], before, "KV reloaded")
    expected = [s.clone() for s in state_before]
    for e, b in zip(expected, state_before):
        e[:, 3] = 0  # cleared for its new owner
        e[:, 7] = b[:, 3]  # the parked state, reloaded into another slot
    assert_states(mamba, expected)


def test_hybrid_host_checks_both_halves_before_copying():
    kv, mamba = _hybrid_pools("cpu")
    host = HybridPoolHost(kv, 2.0, 0, 4, "layer_first")
    kv_h, state_h = host.kv_host.alloc(4), host.state_host.alloc(1)
    kv_host_before = host.kv_host.k_buffer.clone()
    with pytest.raises(IndexError, match=r"device_indices\[0\] = 99 is out of range"):
        host.backup(kv_h, torch.arange(4, 8), state_h, T([99]))  # the state half is bad: no KV copied either
    assert torch.equal(host.kv_host.k_buffer, kv_host_before)
    with pytest.raises(ValueError, match="device_pool must have a mamba_pool"):

        HybridPoolHost(HybridLinearKVPool(8, torch.bfloat16, 1, 1, 8, [0], False, "cpu", None, warmup=False), 1.0, 0, 1, "layer_first")
