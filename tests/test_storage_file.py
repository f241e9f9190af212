"""The file backend (``HiCacheFile``) keeps pages exactly and never returns a wrong one: host pages
round-trip byte for byte through the directory (and across a restart), a writer killed midway
leaves no page under a real name, a flipped byte, a torn file, another key's file or another
``extra_key`` reads as a miss, the directory stays within its byte bound by evicting the least
recently used pages, and it is readable by its owner only.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from kvassert import HOST_LAYOUTS, directory_state, file_store, host_page_bytes, host_rows, make_device_pool, make_host

from kvpool.storage import HiCacheFile, HiCacheStorageConfig, page_keys
from kvpool.storage import file as file_module
from kvpool.storage.keys import storage_name
from kvpool.storage.record import HEADER, payload_offset

REPO = Path(__file__).resolve().parents[1]


def host_pair(layout="layer_first"):
    pool = make_device_pool()
    return make_host(pool, layout)


def page_files(store) -> list[str]:
    return sorted(n for n in os.listdir(store.file_path) if n.endswith(".kvpage"))


def only_page_file(store) -> Path:
    (name,) = page_files(store)
    return Path(store.file_path) / name


# --- round trips ----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_host_pages_round_trip_byte_for_byte(tmp_path, layout):
    host = host_pair(layout)
    store = file_store(tmp_path / "kv", host, model_name="m")
    src, dst = host.alloc(12), host.alloc(12)
    keys = page_keys(list(range(100, 112)), host.page_size)
    expected = [host_page_bytes(host, int(src[i * 4])) for i in range(3)]
    others = [host_page_bytes(host, s) for s in range(0, host.size, 4) if s not in dst[::4].tolist()]

    assert store.batch_set_v1(keys, src) == [True, True, True]
    assert store.batch_exists(keys) == 3
    assert store.batch_get_v1(keys, dst) == [True, True, True]
    for i in range(3):
        assert torch.equal(host_page_bytes(host, int(dst[i * 4])), expected[i]), f"page {i}"
        for layer in range(host.layer_num):
            for which in "kv":
                rows = host_rows(host, layer, which)
                assert torch.equal(rows[int(dst[i * 4]) : int(dst[i * 4]) + 4], rows[int(src[i * 4]) : int(src[i * 4]) + 4])
    # No host page outside the three read into changed.
    now = [host_page_bytes(host, s) for s in range(0, host.size, 4) if s not in dst[::4].tolist()]
    assert len(now) == len(others) and all(torch.equal(a, b) for a, b in zip(now, others))
    # The generic form returns the same bytes, and a restarted store over the directory finds them.
    assert torch.equal(store.get(keys[1]), expected[1])
    again = file_store(tmp_path / "kv", host, model_name="m")
    target = torch.empty(expected[2].numel(), dtype=torch.uint8)
    assert again.get(keys[2], target) is target and torch.equal(target, expected[2])
    assert again.get_stats().pages == 3


def test_tensor_values_round_trip_in_any_dtype(tmp_path):
    store = file_store(tmp_path / "kv")
    value = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    value.view(torch.int32)[0, 0] = 0x7FC00001  # a NaN payload must survive exactly
    assert store.set("page-a", value) and store.set("page-a", value)  # the second one skips
    got = store.get("page-a")
    assert got.dtype == torch.uint8 and torch.equal(got, value.reshape(-1).view(torch.uint8))
    into = torch.empty(4, 6, dtype=torch.float32)
    assert store.get("page-a", into) is into and torch.equal(into.view(torch.int32), value.view(torch.int32))
    assert store.get("page-a", torch.empty(5, dtype=torch.float32)) is None  # another size: a miss
    assert store.batch_set(["b", "c"], [value[0], value[1:].t()]) is True
    b, c = store.batch_get(["b", "c"])
    assert torch.equal(b, value[0].view(torch.uint8)) and torch.equal(c, value[1:].t().contiguous().reshape(-1).view(torch.uint8))
    stats = store.get_stats()
    assert (stats.writes, stats.hits, stats.misses, stats.corrupt, stats.pages) == (4, 4, 1, 0, 3)


# --- atomicity -------------------------------------------------------------------------------------

_KILLED_WRITER = """
import os, signal, sys, torch
from kvpool.storage import HiCacheFile, HiCacheStorageConfig
store = HiCacheFile(HiCacheStorageConfig(), sys.argv[1])
real_write, calls = os.write, []
def write_then_die(fd, data):
    calls.append(len(data))
    if len(calls) == 2:                      # the payload: half of it, then the process is killed
        real_write(fd, memoryview(data)[: len(data) // 2])
        os.kill(os.getpid(), signal.SIGKILL)
    return real_write(fd, data)
os.write = write_then_die
store.set("victim", torch.full((4096,), 7, dtype=torch.uint8))
"""


def test_a_writer_killed_midway_leaves_no_page(tmp_path):
    path = tmp_path / "kv"
    store = file_store(path)
    assert store.set("bystander", torch.ones(16, dtype=torch.uint8))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(path)], env=env, capture_output=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()[-2000:]
    temps = [n for n in os.listdir(path) if n.startswith(file_module.TEMP_PREFIX)]
    # What the writer got down before it died: the header, the name and half the payload, in a
    # temporary file only.
    assert len(temps) == 1, os.listdir(path)
    assert (path / temps[0]).stat().st_size == payload_offset(len(storage_name(store.namespace, "victim"))) + 2048
    assert len(page_files(store)) == 1
    assert not store.exists("victim") and store.get("victim") is None
    # A store opened later removes the dead writer's file and keeps the page that was whole.
    later = file_store(path)
    assert [n for n in os.listdir(path) if n.startswith(file_module.TEMP_PREFIX)] == []
    assert torch.equal(later.get("bystander"), torch.ones(16, dtype=torch.uint8))
    assert later.set("victim", torch.full((4096,), 7, dtype=torch.uint8))
    assert torch.equal(later.get("victim"), torch.full((4096,), 7, dtype=torch.uint8))


def test_a_failed_rename_or_write_leaves_what_was_there(tmp_path, monkeypatch):
    store = file_store(tmp_path / "kv")
    assert store.set("kept", torch.zeros(8, dtype=torch.uint8))
    before = directory_state(store.file_path)

    def no_space(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(file_module.os, "replace", no_space)
    assert store.set("new", torch.ones(8, dtype=torch.uint8)) is False
    monkeypatch.undo()
    real_write = os.write
    monkeypatch.setattr(file_module.os, "write", lambda fd, data: no_space() if len(data) == 8 else real_write(fd, data))
    assert store.set("new", torch.ones(8, dtype=torch.uint8)) is False
    monkeypatch.undo()
    assert directory_state(store.file_path) == before  # no temporary file, no page
    assert store.get("new") is None and torch.equal(store.get("kept"), torch.zeros(8, dtype=torch.uint8))
    stats = store.get_stats()
    assert (stats.write_failures, stats.pages) == (2, 1)


def test_a_torn_page_is_a_miss_and_is_written_again(tmp_path):
    host = host_pair()
    store = file_store(tmp_path / "kv", host)
    src, dst = host.alloc(4), host.alloc(4)
    (key,) = page_keys([1, 2, 3, 4], 4)
    assert store.batch_set_v1([key], src) == [True]
    f = only_page_file(store)
    whole = f.read_bytes()
    for cut in (0, 10, HEADER.size, len(whole) - 1):  # empty, inside the header, no payload, one byte short
        f.write_bytes(whole[:cut])
        untouched = host_page_bytes(host, int(dst[0]))
        assert store.batch_get_v1([key], dst) == [False], cut
        assert torch.equal(host_page_bytes(host, int(dst[0])), untouched)
        assert not f.exists()  # removed, so the next write stores the page again
        assert store.batch_set_v1([key], src) == [True] and f.read_bytes() == whole
    assert store.get_stats().corrupt == 4


# --- checksums and foreign pages -------------------------------------------------------------------


@pytest.mark.parametrize(
    "where", ["magic", "version", "name length", "payload length", "crc", "name", "padding", "payload first", "payload last"]
)
def test_a_flipped_byte_is_a_miss(tmp_path, where):
    store = file_store(tmp_path / "kv")
    value = torch.arange(64, dtype=torch.uint8)
    assert store.set("k", value)
    f = only_page_file(store)
    raw = bytearray(f.read_bytes())
    name_len = int.from_bytes(raw[12:16], "little")
    at = {
        "magic": 0, "version": 8, "name length": 12, "payload length": 16, "crc": 24, "name": HEADER.size + 5,
        "padding": payload_offset(name_len) - 1, "payload first": payload_offset(name_len), "payload last": len(raw) - 1,
    }[where]  # fmt: skip
    raw[at] ^= 0x01
    f.write_bytes(bytes(raw))
    target = torch.zeros(64, dtype=torch.uint8)
    assert store.get("k", target) is None and store.get("k") is None
    stats = store.get_stats()
    assert stats.corrupt == 1 and stats.hits == 0


def test_another_keys_file_swapped_in_is_a_miss(tmp_path):
    store = file_store(tmp_path / "kv")
    assert store.set("a", torch.full((32,), 1, dtype=torch.uint8))
    assert store.set("b", torch.full((32,), 2, dtype=torch.uint8))
    paths = {k: Path(store.file_path) / (file_module.storage_digest(store.namespace, k) + ".kvpage") for k in "ab"}
    shutil.copyfile(paths["a"], paths["b"])  # a valid page, of another key, under b's name
    assert store.get("b") is None and store.get_stats().corrupt == 1
    assert torch.equal(store.get("a"), torch.full((32,), 1, dtype=torch.uint8))


def test_a_digest_collision_never_returns_the_other_page(tmp_path, monkeypatch):
    monkeypatch.setattr(file_module, "storage_digest", lambda namespace, key: "0" * 64)  # every key, one file
    store = file_store(tmp_path / "kv")
    a, b = torch.full((32,), 1, dtype=torch.uint8), torch.full((32,), 2, dtype=torch.uint8)
    assert store.set("a", a)
    assert store.get("b") is None  # the file holds a's name, not b's
    assert store.set("b", b) and torch.equal(store.get("b"), b)
    assert store.get("a") is None  # and now b's
    assert store.get_stats().corrupt == 2


def test_another_extra_key_or_namespace_never_sees_the_page(tmp_path):
    host = host_pair()
    store = file_store(tmp_path / "kv", host, model_name="m", tp_rank=0, tp_size=2)
    src, dst = host.alloc(4), host.alloc(4)
    tokens = [5, 6, 7, 8]
    (mine,) = page_keys(tokens, 4, extra_key="tenant-a")
    (theirs,) = page_keys(tokens, 4, extra_key="tenant-b")
    assert store.batch_set_v1([mine], src) == [True]
    assert store.batch_exists([theirs]) == 0 and store.batch_get_v1([theirs], dst) == [False]
    for other in (dict(model_name="m", tp_rank=1, tp_size=2), dict(model_name="n", tp_rank=0, tp_size=2)):
        stranger = file_store(tmp_path / "kv", host, **other)
        assert not stranger.exists(mine) and stranger.batch_get_v1([mine], dst) == [False]
    other_layout = make_host(make_device_pool(), "page_first")
    stranger = file_store(tmp_path / "kv", other_layout, model_name="m", tp_rank=0, tp_size=2)
    assert not stranger.exists(mine)
    assert store.batch_get_v1([mine], dst) == [True]


# --- the bound, eviction and permissions ------------------------------------------------------------


def test_the_directory_stays_within_its_bound_least_recently_used_first(tmp_path):
    page = torch.zeros(1000, dtype=torch.uint8)
    probe = file_store(tmp_path / "probe")
    probe.set("x", page)
    one = probe.get_stats().bytes
    store = file_store(tmp_path / "kv", max_bytes=3 * one + one // 2)  # three pages fit, not four
    for k in "abc":
        assert store.set(k, page)
    assert store.get("a") is not None  # a is now the most recently used
    assert store.set("d", page)  # evicts b
    assert [store.exists(k) for k in "abcd"] == [True, False, True, True]
    assert store.set("e", page)  # evicts c
    assert [store.exists(k) for k in "acde"] == [True, False, True, True]
    stats = store.get_stats()
    assert stats.evictions == 2 and stats.pages == 3 and stats.bytes == 3 * one
    assert sum(os.path.getsize(os.path.join(store.file_path, n)) for n in page_files(store)) <= store.max_bytes
    assert store.set("huge", torch.zeros(4 * one, dtype=torch.uint8)) is False  # larger than the bound
    assert store.get_stats().pages == 3
    # Reopened with a smaller bound, the least recently written pages go first.
    smaller = file_store(tmp_path / "kv", max_bytes=one)
    assert smaller.get_stats().pages == 1 and len(page_files(smaller)) == 1
    store.clear()
    assert page_files(store) == [] and store.get_stats().pages == 0


def test_the_directory_is_its_owners_only(tmp_path):
    store = file_store(tmp_path / "new" / "kv")
    assert stat.S_IMODE(os.stat(store.file_path).st_mode) == 0o700
    assert store.set("k", torch.zeros(4, dtype=torch.uint8))
    assert stat.S_IMODE(only_page_file(store).stat().st_mode) & 0o077 == 0
    assert all(len(n) == 64 + len(".kvpage") for n in page_files(store))  # digests, never the key's text

    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o755)
    with pytest.raises(ValueError, match=r"file_path must be readable by its owner only \(mode 0o700\), got .* mode 0o755"):
        HiCacheFile(HiCacheStorageConfig(), str(open_dir))
    link = tmp_path / "link"
    link.symlink_to(store.file_path)
    with pytest.raises(ValueError, match="file_path must be a directory \\(not a symlink or a file\\)"):
        HiCacheFile(HiCacheStorageConfig(), str(link))
    assert os.listdir(open_dir) == []


def test_a_read_that_finds_a_page_gone_keeps_the_page_a_writer_put_back_meanwhile(tmp_path, monkeypatch):
    """A read that opens an evicted page's file and finds nothing, while another thread writes the key
    again before the read counts its miss: the new page stays indexed (the directory's count and
    bound still match its files), and the next read hits it."""
    store = file_store(tmp_path / "kv")
    value = torch.full((512,), 7, dtype=torch.uint8)
    store.set("k", value)
    os.unlink(os.path.join(store.file_path, page_files(store)[0]))  # gone, as another process's eviction leaves it
    real_open = file_module.os.open

    def open_then_rewrite(path, flags, *args):
        if not flags & (os.O_WRONLY | os.O_RDWR) and path.endswith(file_module.PAGE_SUFFIX):
            monkeypatch.setattr(file_module.os, "open", real_open)
            try:
                return real_open(path, flags, *args)  # absent: the read's miss
            finally:
                store.set("k", value)  # the writer puts the page back before the read counts it
        return real_open(path, flags, *args)

    monkeypatch.setattr(file_module.os, "open", open_then_rewrite)
    assert store.get("k") is None
    stats = store.get_stats()
    assert stats.pages == len(page_files(store)) == 1
    assert torch.equal(store.get("k"), value)


def test_threads_sharing_a_store_read_only_whole_pages_of_their_own_key(tmp_path):
    page = 512
    probe = file_store(tmp_path / "probe")
    probe.set("k00", torch.zeros(page, dtype=torch.uint8))
    store = file_store(tmp_path / "kv", max_bytes=6 * probe.get_stats().bytes)  # evicting all the time
    value = {f"k{i:02d}": torch.full((page,), i, dtype=torch.uint8) for i in range(20)}
    bad: list[str] = []

    def work(seed: int) -> None:
        for step in range(150):
            key = f"k{(seed * 7 + step * 3) % 20:02d}"
            if step % 2:
                store.set(key, value[key])
            else:
                got = store.get(key)
                if got is not None and not torch.equal(got, value[key]):
                    bad.append(key)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bad == []
    stats = store.get_stats()
    on_disk = page_files(store)
    assert stats.pages == len(on_disk) <= 6 and stats.bytes <= store.max_bytes and stats.corrupt == 0
    assert not [n for n in os.listdir(store.file_path) if n.startswith(file_module.TEMP_PREFIX)]


@pytest.mark.parametrize("meanwhile", ["get", "clear"])
def test_a_read_or_clear_while_a_page_is_written_keeps_the_bound(tmp_path, monkeypatch, meanwhile):
    page = torch.zeros(1000, dtype=torch.uint8)
    probe = file_store(tmp_path / "probe")
    probe.set("x", page)
    one = probe.get_stats().bytes
    store = file_store(tmp_path / "kv", max_bytes=2 * one)  # two pages fit, not three
    real_replace = os.replace

    other = threading.Thread(target=lambda: store.get("a") if meanwhile == "get" else store.clear(), daemon=True)

    def replace_after_another_thread(src, dst):
        # Another thread reads the key (a miss: the page is not renamed into place yet) or clears the
        # store while this write is between its temporary file and the rename (a clear may wait).
        other.start()
        other.join(0.5)
        real_replace(src, dst)

    monkeypatch.setattr(file_module.os, "replace", replace_after_another_thread)
    assert store.set("a", page)
    monkeypatch.undo()
    other.join(10)
    assert not other.is_alive()
    for k in "bcd":
        assert store.set(k, page)
    on_disk = page_files(store)
    stats = store.get_stats()
    assert len(on_disk) <= 2 and stats.pages == len(on_disk) and stats.bytes == len(on_disk) * one


def test_a_store_opened_meanwhile_keeps_a_live_writers_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "kv"
    writer = file_store(path)
    real_replace = os.replace

    def open_another_store_then_replace(src, dst):
        file_store(path)  # another engine starts on the directory mid-write
        real_replace(src, dst)

    monkeypatch.setattr(file_module.os, "replace", open_another_store_then_replace)
    assert writer.set("k", torch.full((64,), 3, dtype=torch.uint8))
    monkeypatch.undo()
    assert torch.equal(writer.get("k"), torch.full((64,), 3, dtype=torch.uint8))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    stale = path / f"{file_module.TEMP_PREFIX}{int(dead.stdout)}-1-0"
    stale.write_bytes(b"half a page")
    file_store(path)
    assert not stale.exists()  # its writer is gone


def test_a_page_evicted_by_another_process_while_a_store_opens_is_skipped(tmp_path, monkeypatch):
    path = tmp_path / "kv"
    first = file_store(path)
    for k in "ab":
        assert first.set(k, torch.full((16,), 1, dtype=torch.uint8))
    real_scandir = os.scandir

    class ListedThenEvicted:  # the directory as listed, one page removed (by another process) right after
        def __init__(self, p):
            self.entries = list(real_scandir(p))
            os.unlink(self.entries[0].path)

        def __enter__(self):
            return iter(self.entries)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(file_module.os, "scandir", ListedThenEvicted)
    opened = file_store(path)
    monkeypatch.undo()
    assert opened.get_stats().pages == 1 and len(page_files(opened)) == 1
