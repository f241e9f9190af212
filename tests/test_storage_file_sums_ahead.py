"""The file backend's batch writes sum their pages either ahead, on the checksum threads (page i + 1
while page i is written), or on the writer just before each write (``sum_ahead``), with the same
files and guarantees either way: a checksum that raises (on a checksum thread or on the writer) is
a failed write of that page alone (no temporary file, the key as before, the bound kept), and
``close`` while a batch is being written lets the page in flight be renamed, writes no further page,
returns only once no checksum thread reads the caller's memory, and refuses later calls.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from kvassert import directory_state, host_page_bytes, make_device_pool, make_host

from kvpool.storage import HiCacheFile, HiCacheStorageConfig, page_keys
from kvpool.storage import file as file_module
from kvpool.storage import record

AHEAD = [True, False]


def store_in(path, host=None, sum_ahead=True, max_bytes=1 << 20):
    store = HiCacheFile(HiCacheStorageConfig(model_name="m"), str(path), max_bytes=max_bytes, sum_ahead=sum_ahead)
    if host is not None:
        store.register_mem_pool_host(host)
    return store


def temp_files(store) -> list[str]:
    return [n for n in os.listdir(store.file_path) if n.startswith(file_module.TEMP_PREFIX)]


def host_and_pages(pages=6):
    host = make_host(make_device_pool())
    src = host.alloc(pages * host.page_size)
    keys = page_keys(list(range(500, 500 + pages * host.page_size)), host.page_size)
    return host, src, keys


def first_block(store, keys, src, i) -> int:
    """The address of page ``i``'s first host block (how a checksum's pieces name their page)."""
    return store.host_page_regions(keys, src)[i][0][0]


@pytest.mark.parametrize("sum_ahead", AHEAD)
def test_both_ways_of_summing_write_the_same_files_and_read_back_the_pages(tmp_path, sum_ahead):
    host, src, keys = host_and_pages()
    store = store_in(tmp_path / "kv", host, sum_ahead)
    other = store_in(tmp_path / "other", host, not sum_ahead)
    assert store.batch_set_v1(keys, src) == [True] * 6 and other.batch_set_v1(keys, src) == [True] * 6
    assert directory_state(store.file_path) == directory_state(other.file_path)
    dst = host.alloc(len(src))
    assert store.batch_get_v1(keys, dst) == [True] * 6
    for i in range(6):
        assert torch.equal(host_page_bytes(host, int(dst[i * 4])), host_page_bytes(host, int(src[i * 4])))
    values = [torch.full((3000,), i, dtype=torch.uint8) for i in range(5)]
    tensor_keys = [f"t{i}" for i in range(5)]
    assert store.batch_set(tensor_keys, values) and other.batch_set(tensor_keys, values)
    assert directory_state(store.file_path) == directory_state(other.file_path)
    assert all(torch.equal(store.get(k), v) for k, v in zip(tensor_keys, values))
    assert not temp_files(store)


@pytest.mark.parametrize("sum_ahead", AHEAD)
def test_a_checksum_that_raises_fails_that_page_alone_and_leaves_its_key_as_before(tmp_path, monkeypatch, sum_ahead):
    if sum_ahead and record.checksum_threads() == 1:
        pytest.skip("one core: there are no checksum threads to sum ahead on")
    host, src, keys = host_and_pages()
    store = store_in(tmp_path / "kv", host, sum_ahead)
    bad = first_block(store, keys, src, 2)
    real_sums, real_replace = record.region_sums, os.replace
    raised_on, raised, renamed = [], threading.Event(), []

    def region_sums(regions):
        if regions[0][0] == bad:
            raised_on.append(threading.current_thread().name)
            raised.set()
            raise MemoryError("checksum scratch")
        return real_sums(regions)

    def replace(a, b):
        if sum_ahead and len(renamed) == 1:  # page 1's rename waits for page 2's sums, started ahead
            assert raised.wait(10)
        real_replace(a, b)
        renamed.append(b)

    monkeypatch.setattr(record, "region_sums", region_sums)
    monkeypatch.setattr(file_module.os, "replace", replace)
    assert store.batch_set_v1(keys, src) == [True, True, False, True, True, True]
    monkeypatch.undo()
    # Ahead: raised on a checksum thread while the writer was renaming page 1; else on the writer.
    assert len(raised_on) == 1
    assert raised_on[0].startswith("kvpool-checksum") if sum_ahead else raised_on[0] == threading.current_thread().name
    stats = store.get_stats()
    assert (stats.writes, stats.write_failures, stats.pages) == (5, 1, 5)
    assert stats.bytes == sum(os.path.getsize(os.path.join(store.file_path, n)) for n in os.listdir(store.file_path))
    assert not temp_files(store) and not store.exists(keys[2])
    assert store.batch_set_v1(keys[2:3], src[8:12]) == [True]  # written once the checksum works again
    assert store.batch_get_v1(keys, host.alloc(len(src))) == [True] * 6


@pytest.mark.parametrize("sum_ahead", AHEAD)
def test_a_tensor_batch_stops_at_a_checksum_that_raises(tmp_path, monkeypatch, sum_ahead):
    store = store_in(tmp_path / "kv", sum_ahead=sum_ahead)
    before = directory_state(store.file_path)
    real = record.chunk_sums

    def chunk_sums(pieces):
        if bytes(pieces[0][:1]) == b"\x07":
            raise ValueError("checksum")
        return real(pieces)

    monkeypatch.setattr(record, "chunk_sums", chunk_sums)
    values = [torch.full((5000,), v, dtype=torch.uint8) for v in (1, 7, 3)]
    assert store.batch_set(["a", "b", "c"], values) is False
    monkeypatch.undo()
    assert [store.exists(k) for k in "abc"] == [True, False, False]
    assert set(directory_state(store.file_path)) - set(before) == {n for n in os.listdir(store.file_path) if n.endswith(".kvpage")}
    assert store.get_stats().write_failures == 1 and not temp_files(store)


@pytest.mark.parametrize("sum_ahead", AHEAD)
def test_close_while_a_batch_is_written_renames_the_page_in_flight_and_writes_no_further_page(tmp_path, monkeypatch, sum_ahead):
    host, src, keys = host_and_pages()
    store = store_in(tmp_path / "kv", host, sum_ahead)
    slow = first_block(store, keys, src, 2)
    real_sums, real_replace = record.region_sums, os.replace
    running, lock = [0], threading.Lock()
    inside, go = threading.Event(), threading.Event()
    renamed = []

    def region_sums(regions):
        with lock:
            running[0] += 1
        try:
            if regions[0][0] == slow:
                time.sleep(0.3)  # page 2's sums are still running when the batch stops
            return real_sums(regions)
        finally:
            with lock:
                running[0] -= 1

    def replace(a, b):
        if len(renamed) == 1:  # page 1 is between its temporary file and its rename
            inside.set()
            go.wait(10)
        real_replace(a, b)
        renamed.append(b)

    monkeypatch.setattr(record, "region_sums", region_sums)
    monkeypatch.setattr(file_module.os, "replace", replace)
    result = []
    writer = threading.Thread(target=lambda: result.append(store.batch_set_v1(keys, src)), daemon=True)
    writer.start()
    assert inside.wait(10)
    closer = threading.Thread(target=store.close, daemon=True)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()  # it waits for the batch in flight
    go.set()
    closer.join(10)
    assert not closer.is_alive()
    with lock:
        assert running[0] == 0  # no checksum reads the host pages once close has returned
    writer.join(10)
    monkeypatch.undo()
    assert result == [[True, True, False, False, False, False]] and len(renamed) == 2
    assert not temp_files(store) and store.get_stats().pages == 2
    for call in (lambda: store.batch_set_v1(keys, src), lambda: store.batch_get_v1(keys, src), lambda: store.get(keys[0]),
                 lambda: store.set("x", torch.zeros(4, dtype=torch.uint8)), lambda: store.exists(keys[0]), store.clear):  # fmt: skip
        with pytest.raises(RuntimeError, match="HiCacheFile is closed"):
            call()
    assert store.get_stats().pages == 2
    store.close()  # again: nothing to do
    again = store_in(tmp_path / "kv", host, sum_ahead)
    assert again.batch_get_v1(keys[:2], host.alloc(8)) == [True, True]


def test_sum_ahead_must_be_a_bool_or_none(tmp_path):
    with pytest.raises(ValueError, match="sum_ahead must be None or a bool, got 1"):
        HiCacheFile(None, str(tmp_path / "kv"), sum_ahead=1)
    assert not (tmp_path / "kv").exists()
    store = HiCacheFile(None, str(tmp_path / "kv"))
    assert store.sum_ahead is (file_module.usable_cores() >= file_module.SUM_AHEAD_CORES)
