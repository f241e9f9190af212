"""The byte layout of a stored page: a fixed header, the name the page belongs to, the payload, and a
CRC-32 over all three (docs/contract.md, "Storage tier", "Page format").

::

    offset  size  field
    0       8     magic b"KVPOOLPG"
    8       4     format version (1), uint32
    12      4     name length N, uint32
    16      8     payload length P, uint64
    24      4     CRC-32 of bytes 8..24, then the name, then the payload, uint32
    28      4     reserved, 0
    32      N     name: kvpool.storage.keys.storage_name(namespace, key)
    32+N    P     payload: the page's bytes (a host pool's flat data page)

All integers little-endian. A reader knows the name it expects and the payload size it can take,
so a page reads as data only if the magic, version, name and both lengths match and the CRC-32 of
what it read agrees: a page that is torn (short), corrupted, another key's (a file swapped on disk,
a digest collision) or another size reads as a miss.
"""

from __future__ import annotations

import struct
import zlib
from typing import Optional

MAGIC = b"KVPOOLPG"
VERSION = 1
HEADER = struct.Struct("<8sIIQII")
#: The header fields the checksum covers (version, name length, payload length).
_COVERED = struct.Struct("<IIQ")


def checksum(name: bytes, payload: memoryview | bytes, payload_len: Optional[int] = None) -> int:
    """CRC-32 over the covered header fields, the name and the payload."""
    n = len(payload) if payload_len is None else payload_len
    crc = zlib.crc32(_COVERED.pack(VERSION, len(name), n))
    crc = zlib.crc32(name, crc)
    return zlib.crc32(payload, crc)


def header(name: bytes, payload: memoryview | bytes) -> bytes:
    """The header and name that go in front of ``payload``."""
    return HEADER.pack(MAGIC, VERSION, len(name), len(payload), checksum(name, payload), 0) + name


def parse_header(raw: bytes, name: bytes) -> Optional[tuple[int, int]]:
    """``(payload length, CRC-32)`` from the first ``HEADER.size + len(name)`` bytes of a stored page,
    or None when they are short, of another format, or name another page than ``name``."""
    if len(raw) != HEADER.size + len(name):
        return None
    magic, version, name_len, payload_len, crc, _ = HEADER.unpack_from(raw)
    if magic != MAGIC or version != VERSION or name_len != len(name) or raw[HEADER.size :] != name:
        return None
    return payload_len, crc
