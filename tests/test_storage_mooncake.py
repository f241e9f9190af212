"""The Mooncake backend (``MooncakeStore``) shares pages between engines and never returns a wrong
one: host pages stored by one engine's client are found and read byte for byte by another client of
the same master (and a prefix one engine's ``HiRadixCache`` wrote through is served to another's from
the store), the two talk over loopback only, a missing key is a miss, a record under another key's name or with a flipped byte
reads as a miss, ``clear`` drops only its own namespace, an absent master is a clear error at once,
and a master stopped midway makes reads miss and writes fail, then serves again once restarted.

Each module run starts one ``mooncake_master`` (HTTP metadata server on, every port on 127.0.0.1 and
free) as a subprocess and kills it by its process id at the end, even when a test fails.
"""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from kvassert import HOST_LAYOUTS, Engine, fill_random_, host_page_bytes, make_device_pool, make_host, make_mla_pool, seq

from kvpool import CacheInitParams, HiRadixCache, MHATokenToKVPool, MLATokenToKVPoolHost, PagedTokenToKVPoolAllocator
from kvpool.cache.storage_tier import StoragePolicy
from kvpool.storage import HiCacheStorageConfig, page_keys
from kvpool.storage.keys import storage_name
from kvpool.storage.mooncake_config import MooncakeConfig, import_store_class
from kvpool.storage.mooncake_master import MooncakeMaster, free_port
from kvpool.storage.record import header

try:
    import_store_class()
except ImportError as e:
    pytest.skip(str(e), allow_module_level=True)

from kvpool.storage.mooncake import MooncakeStore  # noqa: E402

# Each client lends 16 MiB to the store: far more than these pages, little for the machine.
SMALL = dict(global_segment_size=16 << 20, local_buffer_size=16 << 20, connect_timeout_s=3.0, retry_interval_s=0.5)


def client(master: MooncakeMaster, **config) -> MooncakeStore:
    return MooncakeStore(
        HiCacheStorageConfig(**config), master_server_address=master.master_server_address,
        metadata_server=master.metadata_server, **SMALL,
    )  # fmt: skip


@pytest.fixture(scope="module")
def master():
    m = MooncakeMaster().start()
    try:
        yield m
    finally:
        m.stop()


@pytest.fixture(scope="module")
def engines(master):
    """Two clients of one master, as two engines on two machines would hold (same model)."""
    a = client(master, model_name="m")
    try:
        b = client(master, model_name="m")
    except BaseException:
        a.close()
        raise
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def over(store: MooncakeStore, host) -> MooncakeStore:
    """``store`` registered on ``host`` and empty in that namespace."""
    store.register_mem_pool_host(host)
    store.clear()
    return store


def counted(store: MooncakeStore, before, *fields: str) -> tuple:
    """How much each counter of ``store`` grew since ``before`` (a ``get_stats()``)."""
    now = store.get_stats()
    return tuple(getattr(now, f) - getattr(before, f) for f in fields)


def host_pages(host) -> list[torch.Tensor]:
    return [host_page_bytes(host, s).clone() for s in range(0, host.size, host.page_size)]


# --- sharing ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_an_engine_reads_the_pages_another_engine_stored(engines, layout):
    host_a, host_b = make_host(make_device_pool(seed=0), layout, seed=1), make_host(make_device_pool(seed=2), layout, seed=3)
    a, b = over(engines[0], host_a), over(engines[1], host_b)
    src, dst = host_a.alloc(12), host_b.alloc(12)
    keys = page_keys(list(range(500, 512)), host_a.page_size, extra_key="tenant-1")
    expected = [host_page_bytes(host_a, int(s)).clone() for s in src[::4]]
    untouched = {s: p for s, p in zip(range(0, host_b.size, 4), host_pages(host_b)) if s not in dst[::4].tolist()}

    assert b.batch_exists(keys) == 0
    sa, sb = a.get_stats(), b.get_stats()
    assert a.batch_set_v1(keys, src) == [True, True, True]
    assert b.batch_exists(keys) == 3 and all(b.exists(k) for k in keys)
    assert b.batch_get_v1(keys, dst) == [True, True, True]
    for i, start in enumerate(dst[::4].tolist()):
        assert torch.equal(host_page_bytes(host_b, start), expected[i]), f"page {i}"
    assert all(torch.equal(host_page_bytes(host_b, s), p) for s, p in untouched.items()), "another host page changed"
    # The generic form reads the same record: the flat data page of the writer's host pool.
    assert torch.equal(b.get(keys[1]), expected[1])
    assert torch.equal(host_a.get_data_page(int(src[4])).view(torch.uint8), expected[1])
    # Storing again sends nothing new and still reports the pages stored.
    assert a.batch_set_v1(keys, src) == [True, True, True]
    assert counted(a, sa, "writes", "write_failures") == (6, 0) and a.get_stats().pages == 3
    assert counted(b, sb, "hits", "misses", "corrupt") == (4, 0, 0)


def test_mla_host_pages_round_trip_between_engines(engines):
    def mla_host(seed: int) -> MLATokenToKVPoolHost:
        host = MLATokenToKVPoolHost(make_mla_pool(torch.float8_e4m3fn, page_size=4), 2.0, 0, 4, "layer_first")
        fill_random_([host.k_buffer, host.v_buffer], seed)
        return host

    host_a, host_b = mla_host(1), mla_host(2)
    a, b = over(engines[0], host_a), over(engines[1], host_b)
    keys = page_keys(list(range(8)), 4)
    src, dst = host_a.alloc(8), host_b.alloc(8)
    assert a.batch_set_v1(keys, src) == [True, True] and b.batch_get_v1(keys, dst) == [True, True]
    for i in (0, 4):
        assert torch.equal(host_page_bytes(host_b, int(dst[i])), host_page_bytes(host_a, int(src[i])))


def test_another_extra_key_or_geometry_is_another_page(engines):
    host_a = make_host(make_device_pool(), "layer_first")
    a, b = over(engines[0], host_a), over(engines[1], make_host(make_device_pool(), "layer_first"))
    tokens = list(range(8))
    assert a.batch_set_v1(page_keys(tokens, 4, extra_key="tenant-1"), host_a.alloc(8)) == [True, True]
    assert b.batch_exists(page_keys(tokens, 4, extra_key="tenant-2")) == 0
    assert b.batch_exists(page_keys(tokens, 4, extra_key="tenant-1")) == 2
    # A host pool of other heads: another namespace, so the same keys name no page there.
    b.register_mem_pool_host(make_host(make_device_pool(head_num=2), "layer_first"))
    assert b.batch_exists(page_keys(tokens, 4, extra_key="tenant-1")) == 0


@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_the_prefix_caches_of_two_engines_share_a_prefix_through_the_store(engines, layout):
    now = StoragePolicy(prefetch_threshold=0, background=False)
    first = Engine("paged", 4, pages=16, host_policy="write_through", layout=layout, storage=engines[0], storage_policy=now)
    engines[0].clear()
    prompt = seq(13, 500)
    first.finish(first.admit(prompt))
    assert first.cache.storage_tier.stats.pages_written == 3
    second = Engine("paged", 4, pages=16, host_policy="write_through", layout=layout, storage=engines[1], storage_policy=now)
    second.ids = first.ids  # the same KV patterns, so the second engine checks the bytes of the first's pages
    req = second.admit(prompt)  # prefetch from the store, host, device: every loaded slot's bytes checked
    assert second.from_storage == 12 and second.loaded == 12 and req.cache_protected_len == 12
    second.cache.check_integrity(second.running.values())
    second.finish(req)
    second.drain()
    other = second.admit(seq(13, 500), extra="tenant-b")  # another extra_key: nothing from the store
    assert second.from_storage == 12
    second.finish(other)
    second.drain()
    first.drain()


# --- presence and misses ---------------------------------------------------------------------------


def test_batch_exists_counts_the_leading_stored_pages(engines):
    host = make_host(make_device_pool(), "page_first")
    a, b = over(engines[0], host), over(engines[1], host)
    keys = page_keys(list(range(16)), 4)
    slots = host.alloc(16)
    assert a.batch_set_v1([keys[0], keys[1], keys[3]], torch.cat([slots[:8], slots[12:]])) == [True] * 3
    assert b.batch_exists(keys) == 2
    assert [b.exists(k) for k in keys] == [True, True, False, True]
    assert b.batch_exists([]) == 0


def test_a_missing_key_is_a_miss(engines):
    host = make_host(make_device_pool(), "layer_first")
    b = over(engines[1], host)
    before = b.get_stats()
    (missing,) = page_keys([9, 9, 9, 9], 4)
    assert b.batch_get_v1([missing], host.alloc(4)) == [False]
    assert b.get(missing) is None and b.batch_get([missing, "another"]) == [None, None]
    assert not b.exists(missing)
    assert counted(b, before, "misses", "hits", "corrupt") == (4, 0, 0)


def test_a_record_under_another_key_torn_or_flipped_is_a_miss(engines):
    host = make_host(make_device_pool(), "page_first")
    a, b = over(engines[0], host), over(engines[1], host)
    good, swapped, flipped, torn = page_keys(list(range(16)), 4)
    assert a.batch_set_v1([good], host.alloc(4)) == [True]
    raw = a.store.get(a.store_key(good))
    payload = raw[len(raw) - sum(host.page_bytes) :]
    own = bytearray(header(storage_name(a.namespace, flipped), payload) + payload)
    own[-1] ^= 0x01
    # Another key's whole record (a swapped object, a digest collision), a record of its own key with
    # one payload byte flipped, and one cut short by a byte, each put under its key by hand.
    for key, record in ((swapped, raw), (flipped, bytes(own)), (torn, raw[:-1])):
        assert a.store.put(a.store_key(key), record) == 0
    before = b.get_stats()
    assert b.batch_get_v1([swapped, flipped, torn, good], host.alloc(16)) == [False, False, False, True]
    assert b.get(torn) is None and b.get(swapped) is None
    assert counted(b, before, "hits", "misses", "corrupt") == (1, 5, 3)
    # A record that failed its check is removed, so the key's next write stores a good page.
    assert [b.exists(k) for k in (swapped, flipped, torn, good)] == [False, False, False, True]


def _read_the_last_page_into_the_first_ones_host_page(engines, pages: int, first_token: int) -> None:
    """``pages`` pages of 4 tokens written by one engine and read by the other, the last into the
    first one's host page: every page a hit, and that host page ends with the last page's bytes."""
    host = make_host(make_device_pool(size=96), "layer_first")
    a, b = over(engines[0], host), over(engines[1], host)
    src = host.alloc(4 * pages)
    keys = page_keys(list(range(first_token, first_token + 4 * pages)), 4)
    assert a.batch_set_v1(keys, src) == [True] * pages
    last = host_page_bytes(host, int(src[4 * (pages - 1)])).clone()
    dst = host.alloc(4 * (pages - 1))
    before = b.get_stats()
    assert b.batch_get_v1(keys, torch.cat([dst, dst[:4]])) == [True] * pages
    assert counted(b, before, "hits", "corrupt") == (pages, 0)
    assert torch.equal(host_page_bytes(host, int(dst[0])), last)


def test_a_batch_read_in_groups_checks_a_page_before_a_later_page_lands_on_it(engines):
    # Eight pages travel in several calls; the last is read into the first one's host page, which
    # must have been checked (a hit) before the last one's bytes arrive there.
    _read_the_last_page_into_the_first_ones_host_page(engines, 8, 0)


def test_a_small_batch_read_twice_into_one_host_page_checks_the_first_before_the_second_lands(engines):
    # Three small pages (one call's worth of bytes): the third is read into the first one's host
    # page, so the first must be checked before the third's bytes arrive there.
    _read_the_last_page_into_the_first_ones_host_page(engines, 3, 100)


# --- pages as tensors --------------------------------------------------------------------------------


def test_tensor_values_round_trip_in_any_dtype(engines):
    a, b = engines
    a.clear()
    value = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    value.view(torch.int32)[0, 0] = 0x7FC00001  # a NaN payload must survive exactly
    assert a.set("page-a", value) and a.set("page-a", value)
    got = b.get("page-a")
    assert got.dtype == torch.uint8 and torch.equal(got, value.reshape(-1).view(torch.uint8))
    into = torch.empty(4, 6, dtype=torch.float32)
    assert b.get("page-a", into) is into and torch.equal(into.view(torch.int32), value.view(torch.int32))
    before = b.get_stats()
    assert b.get("page-a", torch.empty(5, dtype=torch.float32)) is None  # another size: a miss, not corrupt
    assert counted(b, before, "misses", "corrupt") == (1, 0) and b.exists("page-a")
    assert a.batch_set(["b", "c"], [value[0], value[1:].t()]) is True
    c_into = torch.empty(18, dtype=torch.float32)
    got_b, got_c = b.batch_get(["b", "c"], [None, c_into])
    assert torch.equal(got_b, value[0].view(torch.uint8)) and got_c is c_into
    assert torch.equal(c_into, value[1:].t().reshape(-1))


def test_a_full_store_fails_the_write_and_a_batch_keeps_nothing_after_the_failure(engines):
    a, b = engines
    a.clear()
    # The two clients lend 32 MiB in all: twelve 4 MiB pages cannot all fit.
    values = [torch.full((4 << 20,), i, dtype=torch.uint8) for i in range(12)]
    keys = [f"big-{i}" for i in range(12)]
    before = a.get_stats()
    assert a.batch_set(keys, values) is False
    stored = [b.exists(k) for k in keys]
    first_missing = stored.index(False)
    assert not any(stored[first_missing:]), f"pages after the failed one stay stored: {stored}"
    assert counted(a, before, "write_failures")[0] == 1
    assert "Mooncake code" in a.last_error
    for k, v, there in zip(keys, values, stored):
        if there:
            assert torch.equal(b.get(k), v)
    a.clear()
    assert a.set("after", values[0]) and torch.equal(b.get("after"), values[0])
    a.clear()


class FailingOnePut:
    """A Mooncake client whose batched put reports the given entry as failed (the others as the real
    client says), everything else passed through."""

    def __init__(self, real, failing: int) -> None:
        self.real, self.failing = real, failing

    def __getattr__(self, name):
        return getattr(self.real, name)

    def batch_put_from_multi_buffers(self, keys, ptrs, sizes):
        codes = self.real.batch_put_from_multi_buffers(keys, ptrs, sizes)
        return [-200 if i == self.failing else c for i, c in enumerate(codes)]


def test_a_batch_set_leaves_nothing_stored_after_its_failed_page(engines, monkeypatch):
    a, b = engines
    a.clear()
    keys = ["first", "second", "third"]
    values = [torch.full((64,), i, dtype=torch.uint8) for i in range(3)]
    monkeypatch.setattr(a, "store", FailingOnePut(a.store, failing=1))
    assert a.batch_set(keys, values) is False
    monkeypatch.undo()
    assert [b.exists(k) for k in keys][::2] == [True, False]  # the third, sent beside the failure, removed
    assert torch.equal(b.get("first"), values[0])
    a.clear()


def test_clear_drops_only_its_own_namespace(engines):
    host_a, host_b = make_host(make_device_pool(), "layer_first"), make_host(make_device_pool(head_num=2), "layer_first")
    a, b = over(engines[0], host_a), over(engines[1], host_b)
    keys = page_keys(list(range(8)), 4)
    assert a.batch_set_v1(keys, host_a.alloc(8)) == [True, True]
    assert b.batch_set_v1(keys, host_b.alloc(8)) == [True, True]
    assert a.store_key(keys[0]) != b.store_key(keys[0])
    a.clear()
    assert a.batch_exists(keys) == 0 and a.get_stats().pages == 0
    assert b.batch_exists(keys) == 2


def test_bad_input_is_refused_before_anything_moves(engines):
    host = make_host(make_device_pool(), "layer_first")
    a = over(engines[0], host)
    keys = page_keys(list(range(8)), 4)
    slots = host.alloc(8)
    refused = [
        (lambda: a.batch_set_v1(keys, slots[:6]), "host_indices must have 8 entries"),
        (lambda: a.batch_set_v1(keys, slots.to(torch.float32)), "host_indices must be"),
        (lambda: a.batch_set_v1(keys, slots + 1), "host_indices must be whole host pages"),
        (lambda: a.batch_set_v1([keys[0], ""], slots), r"keys\[1\] must be a non-empty str"),
        (lambda: a.batch_get_v1(keys, torch.flip(slots, [0])), "host_indices must be whole host pages"),
        (lambda: a.set(keys[0], [1, 2]), "value must be a CPU tensor"),
        (lambda: a.set(keys[0], torch.ones(2), target_location=0), "value must be given as a tensor"),
        (lambda: a.get(keys[0], torch.ones(4, 2).t()), "target_location must be a contiguous CPU tensor"),
        (lambda: a.batch_set(keys, [torch.ones(2)]), "values must be None or a list of 2 entries"),
        (lambda: a.batch_exists("abc"), "keys must be a list of str"),
    ]
    before = a.get_stats()
    for call, message in refused:
        with pytest.raises(ValueError, match=message):
            call()
    assert a.batch_exists(keys) == 0 and a.get_stats() == before


def test_several_threads_share_one_client(engines):
    host_a, host_b = make_host(make_device_pool(), "page_first"), make_host(make_device_pool(seed=5), "page_first")
    a, b = over(engines[0], host_a), over(engines[1], host_b)
    jobs = [(page_keys(list(range(t * 100, t * 100 + 8)), 4), host_a.alloc(8), host_b.alloc(8)) for t in range(4)]
    results: list = [None] * len(jobs)

    def run(t: int) -> None:
        keys, src, dst = jobs[t]
        results[t] = (a.batch_set_v1(keys, src), b.batch_get_v1(keys, dst))

    threads = [threading.Thread(target=run, args=(t,)) for t in range(len(jobs))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert results == [([True, True], [True, True])] * len(jobs)
    for _, src, dst in jobs:
        for i in (0, 4):
            assert torch.equal(host_page_bytes(host_b, int(dst[i])), host_page_bytes(host_a, int(src[i])))


def test_sglang_construction_with_extra_config_and_the_host_pool(master):
    host = make_host(make_device_pool(), "layer_first")
    extra = dict(master_server_address=master.master_server_address, metadata_server=master.metadata_server,
                 global_segment_size=16 << 20, local_buffer_size=16 << 20, prefetch_threshold=256)  # fmt: skip
    store = MooncakeStore(HiCacheStorageConfig(model_name="sgl", extra_config=extra), host)
    try:
        assert store.mem_pool_host is host and store.config.global_segment_size == 16 << 20
        keys = page_keys(list(range(4)), 4)
        assert store.batch_set_v1(keys, host.alloc(4)) == [True] and store.batch_exists(keys) == 1
        store.clear()
    finally:
        store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.exists(keys[0])
    store.close()  # a second close does nothing


def test_hiradix_cache_from_sglangs_server_args_names_the_mooncake_store(master):
    pool = MHATokenToKVPool(64, 4, torch.bfloat16, 2, 8, 2, "cpu")
    alloc = PagedTokenToKVPoolAllocator(64, 4, kvcache=pool)
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=4)
    extra = dict(master_server_address=master.master_server_address, metadata_server=master.metadata_server,
                 global_segment_size=16 << 20, local_buffer_size=16 << 20, prefetch_threshold=0)  # fmt: skip
    args = SimpleNamespace(hicache_ratio=1.5, hicache_size=0, hicache_mem_layout="layer_first", hicache_write_policy="write_through",
                           hicache_io_backend="direct", hicache_storage_backend="mooncake", hicache_storage_prefetch_policy="best_effort",
                           hicache_storage_backend_extra_config=extra, model_path="org/model")  # fmt: skip
    cache = HiRadixCache(params, args)
    store = cache.storage_tier.storage
    try:
        assert isinstance(store, MooncakeStore) and store.mem_pool_host is cache.token_to_kv_pool_host
        assert store.storage_config.model_name == "org/model" and store.config.global_segment_size == 16 << 20
        assert cache.storage_tier.policy.prefetch_threshold == 0
    finally:
        store.close()


# --- the master -----------------------------------------------------------------------------------


def tcp_sockets() -> list[tuple[str, int, str, int, str, int]]:
    """Every TCP socket of this machine's network namespace: (local address, local port, remote
    address, remote port, state, inode), addresses in hex as /proc/net/tcp and tcp6 write them."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            f = line.split()
            (la, lp), (ra, rp) = f[1].rsplit(":", 1), f[2].rsplit(":", 1)
            found.append((la, int(lp, 16), ra, int(rp, 16), f[3], int(f[9])))
    return found


def listening(port: int) -> list[str]:
    """The local addresses listening on TCP ``port``."""
    return [la for la, lp, _, _, state, _ in tcp_sockets() if lp == port and state == "0A"]  # 0A: LISTEN


def own_connections() -> list[tuple[str, str]]:
    """(local, remote) addresses of this process's established TCP connections."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return [(la, ra) for la, _, ra, _, state, inode in tcp_sockets() if state == "01" and inode in inodes]


# 127.0.0.1, the same as an IPv4-mapped IPv6 address, and ::1, as /proc/net/tcp and tcp6 write them
LOOPBACK = ("0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000")


def test_the_master_rpc_and_metrics_servers_listen_on_loopback_only(master):
    assert master.pid is not None
    for port in (master.rpc_port, master.metrics_port):
        assert listening(port) == ["0100007F"], f"port {port}"  # 127.0.0.1


def test_two_engines_on_one_machine_talk_over_loopback_only(engines):
    host = make_host(make_device_pool(), "page_first")
    a, b = over(engines[0], host), over(engines[1], host)
    keys = page_keys(list(range(8)), 4)
    assert a.batch_set_v1(keys, host.alloc(8)) == [True, True] and b.batch_get_v1(keys, host.alloc(8)) == [True, True]
    connections = own_connections()
    assert connections, "no connection of the clients seen"
    assert all(la in LOOPBACK and ra in LOOPBACK for la, ra in connections), connections


def test_an_absent_master_is_a_clear_error_at_once():
    port = free_port()
    started = time.monotonic()
    with pytest.raises(ConnectionError, match=f"master at 127.0.0.1:{port} does not accept connections"):
        MooncakeStore(
            master_server_address=f"127.0.0.1:{port}", metadata_server=f"http://127.0.0.1:{free_port()}/metadata", **SMALL
        )  # fmt: skip
    assert time.monotonic() - started < 5


def test_a_master_stopped_midway_gives_misses_and_failures_then_serves_again():
    host = make_host(make_device_pool(), "page_first")
    keys = page_keys(list(range(16)), 4)
    src, dst = host.alloc(16), host.alloc(16)
    first = MooncakeMaster().start()
    second = MooncakeMaster(rpc_port=first.rpc_port, http_port=first.http_port, metrics_port=first.metrics_port)
    store = None
    try:
        store = client(first, model_name="m")
        store.register_mem_pool_host(host)
        assert store.batch_set_v1(keys, src) == [True] * 4
        first.stop()
        before = store.get_stats()
        started = time.monotonic()
        # In the order a cache's prefetch calls them: how much is stored, then the pages.
        assert store.batch_exists(keys) == 0
        assert store.batch_get_v1(keys, dst) == [False] * 4
        assert store.batch_set_v1(keys, src) == [False] * 4
        assert store.get(keys[0]) is None and store.set("x", torch.ones(4)) is False
        assert not store.exists(keys[0]) and store.batch_get([keys[1]]) == [None]
        # Mooncake's own first call after the loss may wait ~4 s; waiting like that on each of these
        # seven calls would take ~30 s.
        assert time.monotonic() - started < 12, "calls waited on the stopped master"
        assert counted(store, before, "misses", "write_failures", "hits", "writes") == (6, 5, 0, 0)
        assert "Mooncake code" in store.last_error
        # A master back on the same ports (empty): after the retry interval the client serves again.
        second.start()
        deadline = time.monotonic() + 30
        while store.batch_set_v1(keys, src) != [True] * 4:
            assert time.monotonic() < deadline, f"no write succeeded after the restart: {store.last_error}"
            time.sleep(0.2)
        assert store.batch_get_v1(keys, dst) == [True] * 4
        for i in range(4):
            assert torch.equal(host_page_bytes(host, int(dst[i * 4])), host_page_bytes(host, int(src[i * 4])))
    finally:
        if store is not None and second.pid is not None:
            store.close()  # with no master, a close waits on it for ~13 s; the process exit frees it
        first.stop()
        second.stop()


# --- configuration ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("master_server_address", "127.0.0.1", "master_server_address must be 'host:port'"),
        ("master_server_address", "", "master_server_address must be a non-empty str"),
        ("metadata_server", "127.0.0.1:8080", "metadata_server must be an http://host:port/... URL"),
        ("global_segment_size", 0, "global_segment_size must be a positive int"),
        ("local_buffer_size", 1.5, "local_buffer_size must be a positive int"),
        ("retry_interval_s", 0, "retry_interval_s must be a number > 0"),
        ("protocol", None, "protocol must be a non-empty str"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(field, value, message):
    good = dict(master_server_address="127.0.0.1:50051", metadata_server="http://127.0.0.1:8080/metadata")
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        MooncakeConfig(**{**good, field: value})
    with pytest.raises(ValueError, match="must give metadata_server"):
        MooncakeStore(HiCacheStorageConfig(extra_config={"master_server_address": "127.0.0.1:50051"}))
    with pytest.raises(ValueError, match="unknown master_server_adress"):
        MooncakeStore(master_server_adress="127.0.0.1:50051", metadata_server="http://127.0.0.1:8080/metadata")
