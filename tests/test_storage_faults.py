"""The failure injector does what a test asks of it: the same seed injects the same faults, a
failure never reaches the backend, a raised fault is a ``StorageFault``, a short read delivers its
first half and scribbles the rest, a short write stores its first half only, faults by call number
hit exactly those calls, and delays go through the given sleep.
"""

from __future__ import annotations

import pytest
import torch
from kvassert import directory_state, file_store, host_page_bytes, make_device_pool, make_host

from kvpool.storage import page_keys
from kvpool.storage.faults import SCRIBBLE, FaultyStorage, StorageFault


def stored_host(tmp_path, **faults):
    host = make_host(make_device_pool())
    inner = file_store(tmp_path / "kv", host)
    return host, inner, FaultyStorage(inner, **faults)


def test_the_same_seed_injects_the_same_faults(tmp_path):
    logs = []
    for run in range(2):
        flaky = FaultyStorage(file_store(tmp_path / f"kv{run}"), seed=11, fail_rate=0.3, short_rate=0.2, raise_rate=0.1)
        for i in range(40):
            try:
                flaky.set(f"k{i}", torch.zeros(4, dtype=torch.uint8))
                flaky.get(f"k{i}")
            except StorageFault:
                pass
        logs.append(flaky.log)
    assert logs[0] == logs[1] and {kind for _, _, kind in logs[0]} == {"fail", "short", "raise"}
    other = FaultyStorage(file_store(tmp_path / "kv2"), seed=12, fail_rate=0.3, short_rate=0.2, raise_rate=0.1)
    for i in range(40):
        try:
            other.set(f"k{i}", torch.zeros(4, dtype=torch.uint8))
            other.get(f"k{i}")
        except StorageFault:
            pass
    assert other.log != logs[0]


def test_a_failure_or_raise_never_reaches_the_backend(tmp_path):
    host, inner, flaky = stored_host(tmp_path, fail_calls={"batch_set_v1": {1}, "batch_get_v1": {2}}, raise_calls={"set": {1}})
    a, b = host.alloc(8), host.alloc(8)
    keys = page_keys(list(range(8)), 4)
    before = directory_state(inner.file_path)
    assert flaky.batch_set_v1(keys, a) == [False, False]
    with pytest.raises(StorageFault, match="injected failure of set \\(call 1\\)"):
        flaky.set("x", torch.zeros(4, dtype=torch.uint8))
    assert directory_state(inner.file_path) == before and inner.get_stats().writes == 0
    assert flaky.batch_set_v1(keys, a) == [True, True]
    assert flaky.batch_get_v1(keys, b) == [True, True]
    stats = inner.get_stats()
    page_b = host_page_bytes(host, int(b[0]))
    assert flaky.batch_get_v1(keys, b) == [False, False]  # the second read fails, untouched
    assert inner.get_stats() == stats and torch.equal(host_page_bytes(host, int(b[0])), page_b)
    assert flaky.log == [("batch_set_v1", 1, "fail"), ("set", 1, "raise"), ("batch_get_v1", 2, "fail")]


def test_a_short_read_delivers_the_first_half_and_scribbles_the_rest(tmp_path):
    host, inner, flaky = stored_host(tmp_path, short_calls={"batch_get_v1": {1}, "get": {1}, "batch_exists": {1}})
    src, dst = host.alloc(12), host.alloc(12)
    keys = page_keys(list(range(12)), 4)
    assert flaky.batch_set_v1(keys, src) == [True] * 3
    assert flaky.batch_exists(keys) == 1 and flaky.batch_exists(keys) == 3
    assert flaky.batch_get_v1(keys, dst) == [True, False, False]
    assert torch.equal(host_page_bytes(host, int(dst[0])), host_page_bytes(host, int(src[0])))
    for i in (1, 2):
        assert bool((host_page_bytes(host, int(dst[4 * i])) == SCRIBBLE).all())
    target = torch.zeros(host_page_bytes(host, 0).numel(), dtype=torch.uint8)
    assert flaky.get(keys[0], target) is None and bool((target[target.numel() // 2 :] == SCRIBBLE).all())
    assert torch.equal(flaky.get(keys[0], target), host_page_bytes(host, int(src[0])))


def test_a_short_write_stores_the_first_half_only(tmp_path):
    host, inner, flaky = stored_host(tmp_path, short_calls={"batch_set_v1": {1}, "batch_set": {1}})
    src = host.alloc(16)
    keys = page_keys(list(range(16)), 4)
    assert flaky.batch_set_v1(keys, src) == [True, True, False, False]
    assert [inner.exists(k) for k in keys] == [True, True, False, False]
    values = [torch.full((4,), i, dtype=torch.uint8) for i in range(4)]
    assert flaky.batch_set(["a", "b", "c", "d"], values) is False
    assert [inner.exists(k) for k in "abcd"] == [True, True, False, False]


def test_delays_go_through_the_given_sleep(tmp_path):
    slept = []
    flaky = FaultyStorage(file_store(tmp_path / "kv"), delay_s=0.25, delay_calls={"exists": {2, 3}}, sleep=slept.append)
    for _ in range(4):
        assert flaky.exists("nothing") is False
    assert slept == [0.25, 0.25] and flaky.calls == {"exists": 4}
    flaky.delay_s, flaky.rates["delay"] = 0.5, 1.0
    flaky.exists("nothing")
    assert slept == [0.25, 0.25, 0.5]
