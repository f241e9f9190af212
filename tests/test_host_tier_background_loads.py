"""Loads queued by the host pool's worker thread (``background=True``) and the layer-transfer hook:
a background load returns before its copies and the device pool's getters wait for each layer, a
failure reaches the getters and the next call once, every other call waits for the queueing, and a
worker that cannot start leaves no getter waiting.
"""

from __future__ import annotations

import pytest
import torch
from kvassert import HOST_BACKENDS, HOST_LAYOUTS, dev_rows, make_device_pool, make_host

from kvpool.kernels.copy_rows import launcher as C
from kvpool.host import direct_backend


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


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
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


@pytest.mark.parametrize("backend", HOST_BACKENDS)
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
