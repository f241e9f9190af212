"""The byte layout of a stored page: a fixed header, the name the page belongs to, the payload, and
checksums over all three (docs/contract.md, "Storage tier", "Page format").

::

    offset  size  field
    0       8     magic b"KVPOOLPG"
    8       4     format version (3), uint32
    12      4     name length N, uint32
    16      8     payload length P, uint64
    24      4     header checksum, uint32 (below)
    28      4     reserved, 0
    32      8     payload sum A, uint64 (below)
    40      8     payload weighted sum B, uint64
    48      N     name: kvpool.storage.keys.storage_name(namespace, key)
    48+N          zero bytes up to O, the next multiple of 64
    O       P     payload: the page's bytes (a host pool's flat data page)

All integers little-endian. The payload is read as little-endian uint64 words ``w[0], w[1], ...``
(the last one zero-padded when P is not a multiple of 8); ``A`` is the sum of the words and ``B``
the sum of ``(i + 1) * w[i]``, both modulo 2**64. The header checksum is the CRC-32 of bytes 8..24,
then the name, then bytes 32..48 (``A`` and ``B``), so the name is inside the checksum of the
payload's sums.

``A`` and ``B`` are vectorised sums (numpy, which releases the GIL), an order of magnitude faster
than a CRC-32 of the payload, so checking a page costs a fraction of moving it. They are computed
in chunks of :data:`CHUNK_BYTES`, those of a payload of several chunks on several threads at once,
beside the moves of other bytes; a chunk's sums shift by its word offset (``B += offset * A``), so the result does not depend
on the chunking. What they always catch: any change confined to one word (``A`` changes), any
change of two adjacent words (so every burst of up to 64 bits), and a change of two words ``d``
words apart unless both changes are multiples of ``2**(64 - v)``, with ``2**v`` the largest power
of two dividing ``d`` (changes confined to the top ``v`` bits of both words, in opposite
directions); two different words swapped ``d`` words apart unless they agree in their low
``64 - v`` bits. Other damage is caught unless it leaves both sums as they were (two 1 MiB pieces
swapped: a chance of about 2**-47).

A reader knows the name it expects and the payload size it can take, so a page reads as data only if
the magic, version, name and both lengths match and the header checksum and the sums of what it read
agree: a page that is torn (short), corrupted, another key's (a file swapped on disk, a digest
collision) or another size reads as a miss.
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, Optional

import numpy as np

MAGIC = b"KVPOOLPG"
VERSION = 3
HEADER = struct.Struct("<8sIIQIIQQ")
#: The header fields the header checksum covers ahead of the name (version, name length, payload length).
_COVERED = struct.Struct("<IIQ")
_SUMS = struct.Struct("<QQ")
#: The payload begins at a multiple of this many bytes (a cache line).
ALIGN = 64
_MASK = (1 << 64) - 1
#: The payload is checksummed in chunks of this many bytes (a multiple of 8; the sums do not
#: depend on it), one chunk per task of the checksum threads.
CHUNK_BYTES = 4 << 20
#: A chunk of buffers on average shorter than this is checksummed on the calling thread: they are
#: gathered into one buffer under the GIL, which threads taking turns would slow (host memory given
#: as regions is summed in place, in runs, and goes to the checksum threads whatever its blocks).
#: A payload of one chunk is summed on the calling thread, in ``value()``.
INLINE_BYTES = 64 << 10
#: Pieces at least this long (and whole words) are summed where they lie; shorter ones are gathered
#: into a per-thread buffer first (a numpy call costs about a microsecond whatever its length).
DIRECT_BYTES = 32 << 10
#: The words are summed as rows of this many words: ``B`` from the rows' sums and the columns' sums.
_ROW = 256
_ROW_WEIGHTS = np.arange(1, _ROW + 1, dtype=np.uint64)
_ROW_STARTS = np.arange(CHUNK_BYTES // 8 // _ROW + 1, dtype=np.uint64) * np.uint64(_ROW)
_WORD_INDEX = np.arange(CHUNK_BYTES // 8, dtype=np.uint64)
#: Up to this many words, ``B`` is one dot product with the word indices: fewer numpy calls, which
#: cost more than the arithmetic on a short payload (on a long one, the rows' two passes are faster).
_DOT_WORDS = 8192
_scratch = threading.local()


class Digest(NamedTuple):
    """What a page's checksums are: the header checksum and the payload's two sums."""

    crc: int
    a: int
    b: int


def _word_sums(words: np.ndarray) -> tuple[int, int]:
    """``(sum of w[i], sum of (i + 1) * w[i])`` of uint64 words, modulo 2**64."""
    n = words.shape[0]
    if n <= _DOT_WORDS:  # two numpy calls (numpy's integer dot wraps modulo 2**64, as the sums do)
        a = int(words.sum(dtype=np.uint64))
        return a & _MASK, (int(np.dot(_WORD_INDEX[:n], words)) + a) & _MASK
    rows = n // _ROW
    a = b = 0
    if rows:
        m = words[: rows * _ROW].reshape(rows, _ROW)
        r, c = m.sum(1, dtype=np.uint64), m.sum(0, dtype=np.uint64)
        a = int(r.sum(dtype=np.uint64))
        b = int(np.dot(_ROW_STARTS[:rows], r)) + int(np.dot(_ROW_WEIGHTS, c))
    if n > rows * _ROW:
        t = words[rows * _ROW :]
        ta = int(t.sum(dtype=np.uint64))
        b += int(np.dot(_ROW_WEIGHTS[: t.shape[0]], t)) + rows * _ROW * ta
        a += ta
    return a & _MASK, b & _MASK


def _address(piece: memoryview) -> Optional[int]:
    """Where a writable buffer's bytes are, or None (a read-only one)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(piece))
    except (TypeError, ValueError):
        return None


def _run(pieces: list[memoryview], i: int) -> tuple[int, int, int]:
    """``(count, first address, stride)`` of the pieces from ``pieces[i]`` on that are equally long
    (whole words), word-aligned and equally far apart in memory (a host page's K or V blocks of
    consecutive layers); a count below 2 when there is no such run."""
    n = pieces[i].nbytes
    if n % 8 or i + 1 >= len(pieces) or pieces[i + 1].nbytes != n:
        return 1, 0, 0
    first, second = _address(pieces[i]), _address(pieces[i + 1])
    if first is None or second is None or first % 8 or (second - first) % 8 or second - first < n:
        return 1, 0, 0
    stride, count = second - first, 2
    while i + count < len(pieces) and pieces[i + count].nbytes == n and _address(pieces[i + count]) == first + count * stride:
        count += 1
    return count, first, stride


def _run_sums(first: int, stride: int, words: int, count: int) -> tuple[int, int]:
    """``_word_sums`` of ``count`` pieces of ``words`` words, ``stride`` bytes apart from ``first``,
    read in place as one strided array (two passes over them whatever their number)."""
    span = (ctypes.c_uint64 * ((count - 1) * (stride // 8) + words)).from_address(first)
    m = np.ndarray((count, words), dtype="<u8", buffer=span, strides=(stride, 8))  # cheaper to make than as_strided's
    r, c = m.sum(1, dtype=np.uint64), m.sum(0, dtype=np.uint64)
    a = int(r.sum(dtype=np.uint64))
    b = a + words * int(np.dot(_WORD_INDEX[:count], r)) + int(np.dot(_WORD_INDEX[:words], c))
    return a & _MASK, b & _MASK


def chunk_sums(pieces: list[memoryview]) -> tuple[int, int]:
    """The sums ``(A, B)`` of consecutive buffers (together at most :data:`CHUNK_BYTES`) as if they
    began a payload: runs of equally long, equally spaced pieces summed in place together, other long
    whole-word pieces summed in place one by one, the rest gathered first."""
    a = b = 0
    off = fill = start = 0  # bytes so far; bytes gathered, from byte ``start``
    buf = None

    def add(sums: tuple[int, int], at: int) -> None:
        nonlocal a, b
        a, b = a + sums[0], b + sums[1] + at * sums[0]

    def flush() -> None:
        nonlocal fill
        words = -(-fill // 8)
        buf[fill : words * 8] = bytes(words * 8 - fill)
        add(_word_sums(np.frombuffer(buf, dtype="<u8", count=words)), start // 8)
        fill = 0

    i = 0
    while i < len(pieces):
        p = pieces[i]
        n = p.nbytes
        count, first, stride = _run(pieces, i) if off % 8 == 0 else (1, 0, 0)
        if count > 1:
            if fill:
                flush()
            add(_run_sums(first, stride, n // 8, count), off // 8)
            off, i = off + count * n, i + count
            continue
        if n % 8 == 0 and off % 8 == 0 and (n >= DIRECT_BYTES or len(pieces) == 1):  # nothing to gather it with
            if fill:
                flush()
            add(_word_sums(np.frombuffer(p, dtype="<u8")), off // 8)
        elif n:
            if buf is None:
                buf = getattr(_scratch, "buf", None)
                if buf is None or len(buf) < CHUNK_BYTES + 8:
                    buf = _scratch.buf = bytearray(CHUNK_BYTES + 8)
            if not fill:
                start = off
            buf[fill : fill + n] = p
            fill += n
        off, i = off + n, i + 1
    if fill:
        flush()
    return a & _MASK, b & _MASK


def region_sums(regions: list[tuple[int, int]]) -> tuple[int, int]:
    """:func:`chunk_sums` of host memory given as ``(address, size)`` regions: runs of equally long,
    equally spaced word-aligned regions summed in place together, single ones in place alone."""
    a = b = off = i = 0
    total = len(regions)
    while i < total:
        ptr, n = regions[i]
        if n % 8 or ptr % 8 or not n:  # the rest as buffers (``off`` is whole words here)
            sa, sb = chunk_sums([_view(p, m) for p, m in regions[i:] if m])
            return (a + sa) & _MASK, (b + sb + (off // 8) * sa) & _MASK
        count, stride = 1, 0
        if i + 1 < total and regions[i + 1][1] == n:
            stride = regions[i + 1][0] - ptr
            if stride >= n and stride % 8 == 0:
                count, nxt = 2, ptr + 2 * stride
                while i + count < total:
                    q, m = regions[i + count]
                    if q != nxt or m != n:
                        break
                    count, nxt = count + 1, nxt + stride
        if count > 1:
            sa, sb = _run_sums(ptr, stride, n // 8, count)
        else:
            sa, sb = _word_sums(np.frombuffer((ctypes.c_uint64 * (n // 8)).from_address(ptr), dtype="<u8"))
        a, b = a + sa, b + sb + (off // 8) * sa
        off, i = off + count * n, i + count
    return a & _MASK, b & _MASK


def _view(ptr: int, n: int) -> memoryview:
    return memoryview((ctypes.c_ubyte * n).from_address(ptr)).cast("B")


def _sums(pieces: list[Any]) -> tuple[int, int]:
    """The sums of a chunk's pieces: buffers, ``(address, size)`` regions, or both."""
    if all(type(p) is tuple for p in pieces):
        return region_sums(pieces)
    return chunk_sums([_view(*p) if isinstance(p, tuple) else p for p in pieces])


def digest_of(name: bytes, payload_len: int, a: int, b: int) -> Digest:
    """The digest of a page of ``name`` whose ``payload_len`` bytes have the sums ``a``, ``b``."""
    crc = zlib.crc32(_COVERED.pack(VERSION, len(name), payload_len))
    crc = zlib.crc32(name, crc)
    return Digest(zlib.crc32(_SUMS.pack(a, b), crc), a, b)


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
    """One chunk's sums, computed by whichever thread claims it first: a checksum thread, or the
    caller of ``result()``, which computes a chunk no thread has started rather than wait for one
    (on a busy machine a thread may be scheduled late)."""

    __slots__ = ("pieces", "regions", "sums", "error", "_claim", "_done")

    def __init__(self, pieces: list[Any], regions: bool) -> None:
        self.pieces: Optional[list[Any]] = pieces  # buffers, or (address, size) regions
        self.regions = regions  # regions only
        self.sums: tuple[int, int] = (0, 0)
        self.error: Optional[BaseException] = None
        self._claim, self._done = threading.Lock(), threading.Event()

    def run(self) -> None:
        if not self._claim.acquire(blocking=False):
            return
        try:
            self.sums = region_sums(self.pieces or []) if self.regions else _sums(self.pieces or [])
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

    def result(self) -> tuple[int, int]:
        self.run()
        self._done.wait()
        if self.error is not None:
            raise self.error
        return self.sums


class PayloadChecksum:
    """The checksum of one page, its payload handed in piece by piece (``feed``) in order; when the
    payload is more than one chunk and ``threads`` is True, each chunk is handed to the shared
    checksum threads as soon as it is complete, so the caller can write or read the next bytes
    meanwhile. ``value()`` computes the chunks no thread has started, waits for the others, and
    returns the page's :class:`Digest`. With ``ahead`` every chunk goes to the checksum threads,
    a payload of one chunk too: the caller has other work to do meanwhile (the write of the page
    before), so a thread's wake-up costs it nothing.

    The pieces must stay unchanged until ``value()`` returns, or until ``wait()`` for a caller that
    gives up on them.

    Raises
    ------
    ValueError
        More bytes fed than ``payload_len``, or ``value()`` before all of them.
    """

    def __init__(self, name: bytes, payload_len: int, threads: bool = True, ahead: bool = False) -> None:
        self.name, self.payload_len, self.threads, self.ahead = name, payload_len, threads, ahead
        self._fed = 0
        self._chunks: list[_Chunk] = []
        self._pending: list[Any] = []  # buffers, or (address, size) regions
        self._pending_bytes = 0
        self._pending_buffers = False  # whether a buffer (not a region) is pending

    def feed(self, data: Any) -> None:
        """The next bytes of the payload (any buffer: bytes, memoryview, a ctypes array, ...)."""
        view = data if isinstance(data, memoryview) and data.format == "B" and data.ndim == 1 else memoryview(data).cast("B")
        n = view.nbytes
        if self._fed + n > self.payload_len:
            raise ValueError(f"payload must be {self.payload_len} bytes, got at least {self._fed + n}")
        self._fed += n
        if self._pending_bytes + n < CHUNK_BYTES:  # the usual case: a piece inside the chunk
            self._pending_buffers = True
            self._pending.append(view)
            self._pending_bytes += n
            return
        while view.nbytes:
            take = min(CHUNK_BYTES - self._pending_bytes, view.nbytes)
            self._pending_buffers = True
            self._pending.append(view[:take])
            self._pending_bytes += take
            view = view[take:]
            if self._pending_bytes == CHUNK_BYTES:
                self._close_chunk()

    def feed_regions(self, regions: list[tuple[int, int]]) -> None:
        """The next bytes of the payload as host memory, ``(address, size)`` regions in order (the
        memory must stay allocated and unchanged until ``value()`` returns)."""
        n = sum(size for _, size in regions)
        if self._fed + n > self.payload_len:
            raise ValueError(f"payload must be {self.payload_len} bytes, got at least {self._fed + n}")
        self._fed += n
        if self._pending_bytes + n < CHUNK_BYTES and all(size for _, size in regions):  # all inside the chunk
            self._pending.extend(regions)
            self._pending_bytes += n
            return
        for ptr, size in regions:
            if not size:
                continue
            if self._pending_bytes + size < CHUNK_BYTES:  # the usual case: a region inside the chunk
                self._pending.append((ptr, size))
                self._pending_bytes += size
                continue
            while size:
                take = min(CHUNK_BYTES - self._pending_bytes, size)
                self._pending.append((ptr, take))
                self._pending_bytes += take
                ptr, size = ptr + take, size - take
                if self._pending_bytes == CHUNK_BYTES:
                    self._close_chunk()

    def _close_chunk(self) -> None:
        chunk = _Chunk(self._pending, not self._pending_buffers)
        gathered = not isinstance(self._pending[0], tuple) and self._pending_bytes < INLINE_BYTES * len(self._pending)
        # A payload of one chunk is summed by the caller (unless summed ahead): a thread's wake-up and
        # the GIL cost more than the sums.
        alone = self.payload_len <= CHUNK_BYTES and not self.ahead
        pool = None if gathered or not self.threads or alone else _executor()
        self._pending, self._pending_bytes, self._pending_buffers = [], 0, False
        self._chunks.append(chunk)
        if pool is not None:  # else ``value()`` computes it
            pool.submit(chunk.run)

    def seal(self) -> None:
        """Every byte is fed: the last, partial chunk is closed too (handed to the threads when they
        sum ahead), rather than in ``value()``."""
        if self._fed != self.payload_len:
            raise ValueError(f"payload must be {self.payload_len} bytes, got {self._fed}")
        if self._pending_bytes:
            self._close_chunk()

    def wait(self) -> None:
        """Wait until no thread reads the pieces fed so far (a caller giving up before the payload
        is whole calls it before it reuses them)."""
        for c in self._chunks:
            c.cancel()

    def value(self) -> Digest:
        """The page's digest (waits for the chunks still being checksummed)."""
        if self._fed != self.payload_len:
            raise ValueError(f"payload must be {self.payload_len} bytes, got {self._fed}")
        if self._pending_bytes:
            self._close_chunk()
        a = b = 0
        for i, c in enumerate(self._chunks):
            ca, cb = c.result()
            a, b = a + ca, b + cb + i * (CHUNK_BYTES // 8) * ca
        return digest_of(self.name, self.payload_len, a & _MASK, b & _MASK)


def checksum_of(name: bytes, parts: list[Any], threads: bool = True, ahead: bool = False) -> PayloadChecksum:
    """A :class:`PayloadChecksum` of the payload given as consecutive buffers, all fed (their
    chunks being checksummed; ``value()`` waits for them)."""
    views = [memoryview(p).cast("B") for p in parts]
    job = PayloadChecksum(name, sum(v.nbytes for v in views), threads, ahead)
    for v in views:
        job.feed(v)
    if ahead:
        job.seal()
    return job


def checksum_of_regions(
    name: bytes, regions: list[tuple[int, int]], threads: bool = True, ahead: bool = False
) -> PayloadChecksum:
    """A :class:`PayloadChecksum` of a payload in host memory, ``(address, size)`` regions in order,
    all fed (``value()`` waits for their chunks)."""
    job = PayloadChecksum(name, sum(n for _, n in regions), threads, ahead)
    job.feed_regions(regions)
    if ahead:
        job.seal()
    return job


def checksum(name: bytes, payload: Any) -> Digest:
    """The digest of a page of ``name`` and ``payload`` (one buffer)."""
    return checksum_of(name, [payload]).value()


def payload_offset(name_len: int) -> int:
    """Where the payload of a page whose name is ``name_len`` bytes long begins: after the header
    and the name, zero bytes up to a multiple of :data:`ALIGN` (a copy between a file's page cache
    and a buffer whose offsets differ by less than a cache line is markedly slower)."""
    return -(-(HEADER.size + name_len) // ALIGN) * ALIGN


def pack_header(name: bytes, payload_len: int, digest: Digest) -> bytes:
    """The header, name and padding of a page of ``name`` with a payload of ``payload_len`` bytes and ``digest``."""
    head = HEADER.pack(MAGIC, VERSION, len(name), payload_len, digest.crc, 0, digest.a, digest.b) + name
    return head + bytes(payload_offset(len(name)) - len(head))


def header(name: bytes, payload: Any) -> bytes:
    """The header and name that go in front of ``payload``."""
    return pack_header(name, memoryview(payload).nbytes, checksum(name, payload))


def parse_header(raw: bytes, name: bytes) -> Optional[tuple[int, Digest]]:
    """``(payload length, digest)`` from the first ``payload_offset(len(name))`` bytes of a stored
    page, or None when they are short, of another format, name another page than ``name``, have a
    padding byte that is not zero, or fail the header checksum (before any payload byte is read)."""
    end = HEADER.size + len(name)
    if len(raw) != payload_offset(len(name)):
        return None
    magic, version, name_len, payload_len, crc, _, a, b = HEADER.unpack_from(raw)
    if magic != MAGIC or version != VERSION or name_len != len(name) or raw[HEADER.size : end] != name or any(raw[end:]):
        return None
    digest = digest_of(name, payload_len, a, b)
    return (payload_len, digest) if digest.crc == crc else None
