"""The page record's checksum is the one the contract lays out (a CRC-32 over the header fields, the
name and the CRC-32 of each 1 MiB chunk of the payload), whichever way the payload is handed in and
however many threads compute it, and pages of several chunks keep the guarantee of a single CRC-32:
a flipped byte in any chunk, two chunks swapped, or another key's name reads as a miss, through the
file backend's tensor and host-page forms alike.
"""

from __future__ import annotations

import os
import struct
import zlib

import pytest
import torch
from kvassert import file_store, host_page_bytes, make_device_pool, make_host

from kvpool.storage import page_keys
from kvpool.storage import record
from kvpool.storage.keys import storage_name
from kvpool.storage.record import CHUNK_BYTES, HEADER

MIB = 1 << 20


def contract_checksum(name: bytes, payload: bytes) -> int:
    """The checksum as docs/contract.md's page format states it, from zlib alone."""
    crcs = [zlib.crc32(payload[i : i + MIB]) for i in range(0, len(payload), MIB)]
    crc = zlib.crc32(struct.pack("<IIQ", record.VERSION, len(name), len(payload)))
    crc = zlib.crc32(name, crc)
    return zlib.crc32(struct.pack(f"<{len(crcs)}I", *crcs), crc)


def random_bytes(n: int, seed: int) -> bytes:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)).numpy().tobytes()


def test_the_chunk_is_the_contracts():
    assert CHUNK_BYTES == MIB and record.VERSION == 2 and HEADER.size == 32


@pytest.mark.parametrize("n", [0, 1, 65535, MIB - 1, MIB, MIB + 1, 3 * MIB + 5])
def test_the_checksum_is_the_contracts_however_the_payload_is_fed(n):
    payload = random_bytes(n, n)
    name = b"page-name"
    want = contract_checksum(name, payload)
    assert record.checksum(name, payload) == want
    # In pieces that cross chunk boundaries at odd places, as host blocks do.
    cuts = sorted({0, n, *[min(n, c) for c in (7, 70000, MIB - 3, MIB + 11, 2 * MIB)]})
    pieces = [memoryview(payload)[a:b] for a, b in zip(cuts, cuts[1:])]
    assert record.checksum_of(name, pieces).value() == want
    job = record.PayloadChecksum(name, n)
    for p in pieces:
        job.feed(p)
    assert job.value() == want


def test_feeding_more_or_less_than_the_payload_is_an_error():
    job = record.PayloadChecksum(b"n", 10)
    job.feed(b"12345")
    with pytest.raises(ValueError, match="payload must be 10 bytes, got 5"):
        job.value()
    with pytest.raises(ValueError, match="payload must be 10 bytes, got at least 16"):
        job.feed(b"x" * 11)


def test_a_flip_in_any_chunk_a_swap_of_chunks_or_another_name_changes_it():
    payload = bytearray(random_bytes(3 * MIB + 100, 1))
    want = record.checksum(b"a", payload)
    for at in (0, MIB - 1, MIB, 2 * MIB + 17, len(payload) - 1):
        payload[at] ^= 0x10
        assert record.checksum(b"a", payload) != want, at
        payload[at] ^= 0x10
    swapped = payload[MIB : 2 * MIB] + payload[:MIB] + payload[2 * MIB :]
    assert record.checksum(b"a", swapped) != want
    assert record.checksum(b"b", payload) != want


def test_a_forked_child_checksums_on_its_own_threads():
    payload = random_bytes(3 * MIB, 2)
    want = record.checksum(b"n", payload)  # the parent's threads exist now
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os._exit(0 if record.checksum(b"n", payload) == want else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


# --- pages of several chunks in the file backend ------------------------------------------------------


def big_host():
    """Host pages of 1120 KiB (two chunks; K blocks of 64 KiB and V blocks of 48 KiB cross the chunk
    boundary), FP8."""
    pool = make_device_pool(size=192, page_size=64, head_num=8, head_dim=128, v_head_dim=96, layer_num=10)
    return make_host(pool, page_size=64, ratio=2.0)


def test_multi_chunk_tensor_pages_round_trip_and_a_flip_or_swap_on_disk_is_a_miss(tmp_path):
    store = file_store(tmp_path / "kv", max_bytes=64 * MIB)
    value = torch.frombuffer(bytearray(random_bytes(3 * MIB + 5, 3)), dtype=torch.uint8)
    assert store.set("k", value)
    assert torch.equal(store.get("k"), value)
    (f,) = [tmp_path / "kv" / n for n in os.listdir(tmp_path / "kv")]
    whole = f.read_bytes()
    start = HEADER.size + len(storage_name(store.namespace, "k"))
    for damaged in (
        whole[: start + 2 * MIB + 9] + bytes([whole[start + 2 * MIB + 9] ^ 1]) + whole[start + 2 * MIB + 10 :],
        whole[:start] + whole[start + MIB : start + 2 * MIB] + whole[start : start + MIB] + whole[start + 2 * MIB :],
    ):
        f.write_bytes(damaged)
        assert store.get("k") is None
        assert store.set("k", value) and f.read_bytes() == whole
    assert store.get_stats().corrupt == 2


def test_multi_chunk_host_pages_round_trip_and_a_damaged_one_touches_no_other_page(tmp_path):
    host = big_host()
    page = sum(host.page_bytes)
    assert page > CHUNK_BYTES
    store = file_store(tmp_path / "kv", host, max_bytes=64 * MIB)
    src, dst = host.alloc(128), host.alloc(128)
    keys = page_keys(list(range(128)), 64)
    expected = [host_page_bytes(host, int(s)) for s in src[::64]]
    assert store.batch_set_v1(keys, src) == [True, True]
    assert store.batch_get_v1(keys, dst) == [True, True]
    for i, s in enumerate(dst[::64].tolist()):
        assert torch.equal(host_page_bytes(host, s), expected[i])
    # The second page's file with a byte flipped in its second chunk: a miss, the first page read.
    name = storage_name(store.namespace, keys[1])
    (f,) = [tmp_path / "kv" / n for n in os.listdir(tmp_path / "kv") if (tmp_path / "kv" / n).read_bytes()[HEADER.size :].startswith(name)]
    raw = bytearray(f.read_bytes())
    raw[HEADER.size + len(name) + CHUNK_BYTES + 3] ^= 0x80
    f.write_bytes(bytes(raw))
    others = {s: host_page_bytes(host, s) for s in range(0, host.size, 64) if s != int(dst[64])}
    assert store.batch_get_v1(keys, dst) == [True, False]
    assert all(torch.equal(host_page_bytes(host, s), b) for s, b in others.items())
    assert store.get_stats().corrupt == 1 and not f.exists()


def test_two_keys_read_into_one_host_page_are_both_checked_whole(tmp_path):
    host = big_host()
    store = file_store(tmp_path / "kv", host, max_bytes=64 * MIB)
    src, dst = host.alloc(128), host.alloc(64)
    keys = page_keys(list(range(128)), 64)
    assert store.batch_set_v1(keys, src) == [True, True]
    second = host_page_bytes(host, int(src[64]))
    assert store.batch_get_v1(keys, torch.cat([dst, dst])) == [True, True]
    assert torch.equal(host_page_bytes(host, int(dst[0])), second)
    assert store.get_stats().corrupt == 0 and len(os.listdir(tmp_path / "kv")) == 2
