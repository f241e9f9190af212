"""The page record's checksums are the ones the contract lays out (a uint64 sum and a
position-weighted uint64 sum of the payload's words, and a CRC-32 over the header fields, the name and
those sums), whichever way the payload is handed in and however many threads compute them; what they
promise to catch they catch (one word changed, two adjacent words, two words swapped, another name),
and pages of several chunks read a flipped byte in any chunk or two chunks swapped as a miss, through
the file backend's tensor and host-page forms alike.
"""

from __future__ import annotations

import os
import struct
import zlib

import numpy as np
import pytest
import torch
from kvassert import file_store, host_page_bytes, make_device_pool, make_host

from kvpool.storage import page_keys
from kvpool.storage import record
from kvpool.storage.keys import storage_name
from kvpool.storage.record import CHUNK_BYTES, HEADER

DEFAULT_CHUNK_BYTES = CHUNK_BYTES

MIB = 1 << 20


@pytest.fixture(autouse=True)
def one_mib_chunks(monkeypatch):
    """The payloads here are sized for chunks of 1 MiB (a few MiB cross several); the sums must not
    depend on the chunk size, which a test below checks at the default size."""
    monkeypatch.setattr(record, "CHUNK_BYTES", MIB)


def contract_checksum(name: bytes, payload: bytes) -> tuple[int, int, int]:
    """``(header CRC-32, A, B)`` as docs/contract.md's page format states them, from struct and zlib
    alone (one word at a time in Python)."""
    padded = payload + bytes(-len(payload) % 8)
    words = struct.unpack(f"<{len(padded) // 8}Q", padded)
    a = sum(words) % 2**64
    b = sum((i + 1) * w for i, w in enumerate(words)) % 2**64
    crc = zlib.crc32(struct.pack("<IIQ", record.VERSION, len(name), len(payload)))
    crc = zlib.crc32(name, crc)
    return zlib.crc32(struct.pack("<QQ", a, b), crc), a, b


def random_bytes(n: int, seed: int) -> bytes:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)).numpy().tobytes()


def test_the_header_is_the_contracts():
    assert record.VERSION == 3 and HEADER.size == 48 and DEFAULT_CHUNK_BYTES % 8 == 0
    assert [record.payload_offset(n) for n in (0, 16, 17, 80)] == [64, 64, 128, 128]


@pytest.mark.parametrize("n", [0, 1, 9, 2055, 65535, MIB - 1, MIB, MIB + 1, 3 * MIB + 5])
def test_the_checksum_is_the_contracts_however_the_payload_is_fed(n):
    payload = random_bytes(n, n)
    name = b"page-name"
    want = contract_checksum(name, payload)
    assert tuple(record.checksum(name, payload)) == want
    # In pieces that cross chunk boundaries at odd places, as host blocks do: short and long, whole
    # words and not, gathered and summed in place.
    cuts = sorted({0, n, *[min(n, c) for c in (7, 3, 40000, 70000, 70003, MIB - 3, MIB + 11, 2 * MIB)]})
    pieces = [memoryview(payload)[a:b] for a, b in zip(cuts, cuts[1:])]
    assert tuple(record.checksum_of(name, pieces).value()) == want
    job = record.PayloadChecksum(name, n)
    for p in pieces:
        job.feed(p)
    assert tuple(job.value()) == want


def test_the_checksum_at_the_default_chunk_size_is_the_contracts(monkeypatch):
    monkeypatch.setattr(record, "CHUNK_BYTES", DEFAULT_CHUNK_BYTES)
    n = 2 * DEFAULT_CHUNK_BYTES + 13
    payload = random_bytes(n, 4)
    want = contract_checksum(b"n", payload)
    assert tuple(record.checksum(b"n", payload)) == want
    view = memoryview(payload)
    pieces = [view[: DEFAULT_CHUNK_BYTES - 5], view[DEFAULT_CHUNK_BYTES - 5 : DEFAULT_CHUNK_BYTES + MIB], view[DEFAULT_CHUNK_BYTES + MIB :]]
    assert tuple(record.checksum_of(b"n", pieces).value()) == want


@pytest.mark.parametrize("block", [8, 4096, 65536])
def test_blocks_laid_out_at_a_stride_are_summed_as_the_contract_says(block):
    # A host page's K blocks of consecutive layers, then its V blocks: writable, equally long,
    # equally far apart (summed in place as one strided array), then a block of another size.
    k, v = bytearray(random_bytes(12 * block, 5)), bytearray(random_bytes(9 * block + 24, 6))
    mk, mv = memoryview(k), memoryview(v)
    pieces = [mk[i * 3 * block : i * 3 * block + block] for i in range(4)] + [mv[i * 2 * block : i * 2 * block + block] for i in range(5)]
    pieces.append(mv[len(v) - 24 :])
    payload = b"".join(bytes(p) for p in pieces)
    assert tuple(record.checksum_of(b"n", pieces).value()) == contract_checksum(b"n", payload)


def test_host_memory_regions_are_summed_as_the_contract_says():
    # (address, size) regions: K-like blocks at a stride, one alone, then some of odd sizes and places.
    mem = np.frombuffer(bytearray(random_bytes(1 << 16, 8)), dtype=np.uint8)
    base = mem.ctypes.data
    regions = [(base + i * 4096, 1024) for i in range(5)] + [(base + 30000, 8 * 70), (base + 40001, 13), (base + 50000, 256)]
    payload = b"".join(mem[r - base : r - base + n].tobytes() for r, n in regions)
    assert tuple(record.checksum_of_regions(b"n", regions).value()) == contract_checksum(b"n", payload)


def test_the_sums_wrap_at_two_to_the_64():
    payload = b"\xff" * (8 * 600)  # every word 2**64 - 1, past a row of words and into a tail
    assert tuple(record.checksum(b"n", payload)) == contract_checksum(b"n", payload)


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


@pytest.mark.parametrize("bit", [0, 31, 32, 63])
def test_what_the_sums_always_catch(bit):
    payload = bytearray(random_bytes(8 * 4096, 7))
    want = record.checksum(b"n", payload)
    words = list(struct.unpack(f"<{len(payload) // 8}Q", payload))

    def with_words(ws):
        return record.checksum(b"n", struct.pack(f"<{len(ws)}Q", *ws))

    # A burst of 64 bits across two adjacent words (the high half of one, the low half of the next).
    burst = list(words)
    burst[100] ^= 0xFFFFFFFF << 32
    burst[101] ^= 0xFFFFFFFF
    assert with_words(burst) != want
    # One bit flipped up in one word and down in the one next to it, and at odd distances.
    for far in (1, 3, 4095):
        w = list(words)
        w[0] = w[0] | (1 << bit)
        w[far] = w[far] & ~(1 << bit)
        if w[0] != words[0] or w[far] != words[far]:
            assert with_words(w) != want, far
    # Two different words swapped, near and far.
    for i, j in ((5, 6), (0, 4095), (17, 2000)):
        w = list(words)
        w[i], w[j] = w[j], w[i]
        assert with_words(w) != want, (i, j)


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
    start = record.payload_offset(len(storage_name(store.namespace, "k")))
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
    assert page > record.CHUNK_BYTES
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
    raw[record.payload_offset(len(name)) + record.CHUNK_BYTES + 3] ^= 0x80
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
