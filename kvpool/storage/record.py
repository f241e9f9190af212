"""The byte layout of a stored page: a fixed header, the name the page belongs to, the payload, and a
checksum over all three (docs/contract.md, "Storage tier", "Page format").

::

    offset  size  field
    0       8     magic b"KVPOOLPG"
    8       4     format version (2), uint32
    12      4     name length N, uint32
    16      8     payload length P, uint64
    24      4     checksum, uint32 (below)
    28      4     reserved, 0
    32      N     name: kvpool.storage.keys.storage_name(namespace, key)
    32+N    P     payload: the page's bytes (a host pool's flat data page)

All integers little-endian. The checksum is the CRC-32 of bytes 8..24, then the name, then the
CRC-32s (uint32 each) of the payload's consecutive chunks of :data:`CHUNK_BYTES` (the last one may be
shorter; an empty payload has none). The chunks' CRC-32s are independent, so they are computed on
several threads at once (``zlib.crc32`` releases the GIL), and while the payload is being written
or read. A change confined to one chunk changes that chunk's CRC-32 as it would a CRC-32 of the
whole payload (every burst of up to 32 bits, every odd number of flipped bits), and a changed chunk
CRC-32 is a burst of 32 bits in what the outer CRC-32 covers, so it always changes the checksum;
two different chunks swapped swap their CRC-32s, which changes it too in a page under 2 GiB (the
CRC-32 polynomial is irreducible, of order at least 65537: it divides no two-word change closer
than that many bits).

A reader knows the name it expects and the payload size it can take, so a page reads as data only if
the magic, version, name and both lengths match and the checksum of what it read agrees: a page that
is torn (short), corrupted, another key's (a file swapped on disk, a digest collision) or another size
reads as a miss.
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

MAGIC = b"KVPOOLPG"
VERSION = 2
HEADER = struct.Struct("<8sIIQII")
#: The header fields the checksum covers (version, name length, payload length).
_COVERED = struct.Struct("<IIQ")
#: The payload is checksummed in chunks of this many bytes (part of the format: changing it changes
#: every checksum, so it goes with a new version).
CHUNK_BYTES = 1 << 20
#: A chunk whose pieces are on average shorter than this is checksummed on the calling thread:
#: ``zlib.crc32`` hands the GIL over around every piece, which costs more than the piece's CRC when
#: several threads take turns (a host page of a small page size is many small blocks).
INLINE_BYTES = 64 << 10

_pool_lock = threading.Lock()
_pool: Optional[ThreadPoolExecutor] = None
_pool_pid = 0


_THREADS = max(1, min(4, os.cpu_count() or 1))


def checksum_threads() -> int:
    """Threads that checksum payload chunks: one per core, at most 4."""
    return _THREADS


def _executor() -> Optional[ThreadPoolExecutor]:
    """The shared checksum threads (made on first use, and again in a forked child, whose copy of
    the parent's threads does not run), or None with one core."""
    global _pool, _pool_pid
    if checksum_threads() == 1:
        return None
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(max_workers=checksum_threads(), thread_name_prefix="kvpool-checksum")
            _pool_pid = os.getpid()
        return _pool


class _Chunk:
    """One chunk's CRC-32, computed by whichever thread claims it first: a checksum thread, or the
    caller of ``result()``, which computes a chunk no thread has started rather than wait for one
    (on a busy machine a thread may be scheduled late)."""

    __slots__ = ("pieces", "crc", "error", "_claim", "_done")

    def __init__(self, pieces: list[memoryview]) -> None:
        self.pieces: Optional[list[memoryview]] = pieces
        self.crc, self.error = 0, None
        self._claim, self._done = threading.Lock(), threading.Event()

    def run(self) -> None:
        if not self._claim.acquire(blocking=False):
            return
        try:
            crc = 0
            for p in self.pieces or ():
                crc = zlib.crc32(p, crc)
            self.crc = crc
        except BaseException as e:  # handed to result(); a checksum thread must not die silently
            self.error = e
        finally:
            self.pieces = None
            self._done.set()

    def cancel(self) -> None:
        """Claim it without computing it, or wait until the thread computing it is done."""
        if self._claim.acquire(blocking=False):
            self.pieces = None
            self._done.set()
        self._done.wait()

    def result(self) -> int:
        self.run()
        self._done.wait()
        if self.error is not None:
            raise self.error
        return self.crc


class PayloadChecksum:
    """The checksum of one page, its payload handed in piece by piece (``feed``) in order; each full
    chunk is handed to the shared checksum threads as soon as it is complete, so the caller can write
    or read the next bytes meanwhile. ``value()`` computes the chunks no thread has started, waits for
    the others, and returns the checksum.

    The pieces must stay unchanged until ``value()`` returns.

    Raises
    ------
    ValueError
        More bytes fed than ``payload_len``, or ``value()`` before all of them.
    """

    def __init__(self, name: bytes, payload_len: int) -> None:
        self.name, self.payload_len = name, payload_len
        self._fed = 0
        self._chunks: list[_Chunk] = []
        self._pending: list[memoryview] = []
        self._pending_bytes = 0

    def feed(self, data: Any) -> None:
        """The next bytes of the payload (any buffer: bytes, memoryview, a ctypes array, ...)."""
        view = data if isinstance(data, memoryview) and data.format == "B" and data.ndim == 1 else memoryview(data).cast("B")
        n = view.nbytes
        if self._fed + n > self.payload_len:
            raise ValueError(f"payload must be {self.payload_len} bytes, got at least {self._fed + n}")
        self._fed += n
        if self._pending_bytes + n < CHUNK_BYTES:  # the usual case: a piece inside the chunk
            self._pending.append(view)
            self._pending_bytes += n
            return
        while view.nbytes:
            take = min(CHUNK_BYTES - self._pending_bytes, view.nbytes)
            self._pending.append(view[:take])
            self._pending_bytes += take
            view = view[take:]
            if self._pending_bytes == CHUNK_BYTES:
                self._close_chunk()

    def _close_chunk(self) -> None:
        chunk = _Chunk(self._pending)
        pool = None if self._pending_bytes < INLINE_BYTES * len(self._pending) else _executor()
        self._pending, self._pending_bytes = [], 0
        self._chunks.append(chunk)
        if pool is not None:  # else ``value()`` computes it
            pool.submit(chunk.run)

    def wait(self) -> None:
        """Wait until no thread reads the pieces fed so far (a caller giving up before the payload
        is whole calls it before it reuses them)."""
        for c in self._chunks:
            c.cancel()

    def value(self) -> int:
        """The checksum (waits for the chunks still being checksummed)."""
        if self._fed != self.payload_len:
            raise ValueError(f"payload must be {self.payload_len} bytes, got {self._fed}")
        if self._pending_bytes:
            self._close_chunk()
        crcs = [c.result() for c in self._chunks]
        crc = zlib.crc32(_COVERED.pack(VERSION, len(self.name), self.payload_len))
        crc = zlib.crc32(self.name, crc)
        return zlib.crc32(struct.pack(f"<{len(crcs)}I", *crcs), crc)


def checksum_of(name: bytes, parts: list[Any]) -> PayloadChecksum:
    """A :class:`PayloadChecksum` of the payload given as consecutive buffers, all fed (their
    chunks being checksummed; ``value()`` waits for them)."""
    views = [memoryview(p).cast("B") for p in parts]
    job = PayloadChecksum(name, sum(v.nbytes for v in views))
    for v in views:
        job.feed(v)
    return job


def checksum(name: bytes, payload: Any) -> int:
    """The checksum of a page of ``name`` and ``payload`` (one buffer)."""
    return checksum_of(name, [payload]).value()


def pack_header(name: bytes, payload_len: int, crc: int) -> bytes:
    """The header and name of a page of ``name`` with a payload of ``payload_len`` bytes and checksum ``crc``."""
    return HEADER.pack(MAGIC, VERSION, len(name), payload_len, crc, 0) + name


def header(name: bytes, payload: Any) -> bytes:
    """The header and name that go in front of ``payload``."""
    return pack_header(name, memoryview(payload).nbytes, checksum(name, payload))


def parse_header(raw: bytes, name: bytes) -> Optional[tuple[int, int]]:
    """``(payload length, checksum)`` from the first ``HEADER.size + len(name)`` bytes of a stored page,
    or None when they are short, of another format, or name another page than ``name``."""
    if len(raw) != HEADER.size + len(name):
        return None
    magic, version, name_len, payload_len, crc, _ = HEADER.unpack_from(raw)
    if magic != MAGIC or version != VERSION or name_len != len(name) or raw[HEADER.size :] != name:
        return None
    return payload_len, crc
