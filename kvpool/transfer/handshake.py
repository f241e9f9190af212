"""The header both ranks of a transfer exchange before any KV byte moves, and the decision they take.

Each rank describes its side in a fixed-size :class:`Header` (pool geometry, token count, the heads
it holds, staging size) together with the problem it found in its own arguments, if any (a slot out
of range, a bad ``loc``). The two headers are swapped, and each rank calls :func:`agree` on the pair.
``agree`` is symmetric (``agree(a, b) == agree(b, a)``), so both ranks reach the same verdict from the
same two headers: either both raise the same exception with the same message, or both move the same
rows in the same chunks. That is what keeps a mismatch from hanging one rank while the other waits.

The header is 1 KiB: 32 int64 fields, then up to 768 bytes of UTF-8 carrying a rank's own error
message, so the peer can raise that exact message too.

docs/contract.md, "KV transfer between ranks", lists the mismatches and their errors.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Union

import torch

from kvpool.kernels.formats import CACHE_DTYPES

if TYPE_CHECKING:
    from kvpool.pools.mha_pool import MHATokenToKVPool

HEADER_BYTES = 1024
_FIELD_SLOTS = 32
_MESSAGE_OFFSET = _FIELD_SLOTS * 8
MESSAGE_BYTES = HEADER_BYTES - _MESSAGE_OFFSET
MAGIC = 0x6B76706F6F6C5458  # "kvpoolTX"
VERSION = 1

SENDER, RECEIVER = 1, 2
ROLE_NAMES = {SENDER: "sender", RECEIVER: "receiver"}

# Exception classes a rank may report for its own arguments; the peer raises the same class.
ERROR_KINDS: dict[int, type[Exception]] = {1: ValueError, 2: IndexError, 3: TypeError}
_KIND_OF = {cls: kind for kind, cls in ERROR_KINDS.items()}


def dtype_code(dtype: torch.dtype) -> int:
    return CACHE_DTYPES.index(dtype) + 1


def dtype_name(code: int) -> str:
    if 1 <= code <= len(CACHE_DTYPES):
        return str(CACHE_DTYPES[code - 1])
    return f"unknown dtype code {code}"


@dataclass(frozen=True)
class Header:
    """One rank's side of a transfer. Head numbers are global: the pool holds heads
    ``[head_start, head_start + head_num)`` of a model with ``total_heads`` KV heads."""

    magic: int
    version: int
    role: int
    rank: int
    error_kind: int  # 0: no problem; else a key of ERROR_KINDS
    dtype: int
    start_layer: int
    layer_num: int
    head_start: int
    head_num: int
    total_heads: int
    head_dim: int
    v_head_dim: int
    tokens: int
    chunk_bytes: int
    page_size: int
    message: str = ""

    def with_error(self, error: Exception) -> "Header":
        """This header carrying ``error`` (its class must be one of ERROR_KINDS) for the peer."""
        return replace(self, error_kind=_KIND_OF[type(error)], message=str(error))

    def to_bytes(self) -> bytes:
        """The header as ``HEADER_BYTES`` bytes: the integer fields and the message's length as
        little-endian int64, zeros, then the message's UTF-8 from ``_MESSAGE_OFFSET`` (a message
        longer than ``MESSAGE_BYTES`` is cut). Plain ``struct`` packing: a transfer packs and unpacks
        headers on its host path, before any byte moves."""
        text = self.message.encode("utf-8")[:MESSAGE_BYTES]
        ints = _INTS.pack(*(getattr(self, name) for name in _INT_FIELDS), len(text))
        return ints + bytes(_MESSAGE_OFFSET - _INTS.size) + text + bytes(MESSAGE_BYTES - len(text))

    @classmethod
    def from_bytes(cls, raw: bytes) -> "Header":
        """Inverse of :meth:`to_bytes`; ``raw`` holds ``HEADER_BYTES`` bytes (whatever they are: a
        foreign header decodes into fields that :func:`agree` then rejects)."""
        *ints, length = _INTS.unpack_from(raw)
        length = min(max(length, 0), MESSAGE_BYTES)
        text = raw[_MESSAGE_OFFSET : _MESSAGE_OFFSET + length].decode("utf-8", errors="replace")
        return cls(*ints, message=text)

    def encode(self) -> torch.Tensor:
        """:meth:`to_bytes` as a CPU uint8 tensor of ``HEADER_BYTES``."""
        return torch.frombuffer(bytearray(self.to_bytes()), dtype=torch.uint8)

    @classmethod
    def decode(cls, data: Union[torch.Tensor, bytes]) -> "Header":
        """Inverse of :meth:`encode` (or of :meth:`to_bytes`): a CPU uint8 tensor or bytes."""
        return cls.from_bytes(data if isinstance(data, (bytes, bytearray)) else data.numpy().tobytes())

    @property
    def heads(self) -> tuple[int, int]:
        return self.head_start, self.head_start + self.head_num


#: The integer fields in declaration order (the message is last), and their wire packing.
_INT_FIELDS = tuple(f.name for f in fields(Header) if f.name != "message")
_INTS = struct.Struct("<" + "q" * (len(_INT_FIELDS) + 1))
assert _INTS.size <= _MESSAGE_OFFSET and fields(Header)[-1].name == "message"


@dataclass(frozen=True)
class Agreement:
    """What both ranks move when the headers agree: ``tokens`` rows of the global heads
    ``[head_lo, head_hi)`` in chunks of at most ``chunk_bytes`` bytes (the smaller staging)."""

    tokens: int
    head_lo: int
    head_hi: int
    chunk_bytes: int


@dataclass(frozen=True)
class Refusal:
    """Both ranks raise ``error(message)``."""

    error: type[Exception]
    message: str

    def exception(self) -> Exception:
        return self.error(self.message)


def agree(a: Header, b: Header) -> Agreement | Refusal:
    """The verdict on a pair of headers, the same whichever rank's header comes first.

    Order of checks (the first failing one is reported): the protocol, the roles, the sender's own
    argument problem, the receiver's, then dtype, layers, total_heads, head_dim, v_head_dim, the
    overlap of the held heads, and the token count.
    """
    lo, hi = (a, b) if a.rank <= b.rank else (b, a)
    for h in (lo, hi):
        if h.magic != MAGIC or h.version != VERSION:
            return Refusal(
                ValueError,
                f"kvpool transfer between rank {lo.rank} and rank {hi.rank}: protocol mismatch: rank {h.rank} "
                f"sent magic {h.magic:#x} version {h.version}, expected {MAGIC:#x} version {VERSION} "
                f"(did the peer post another operation, or run another kvpool version?); nothing moved",
            )
    if lo.role == hi.role or {lo.role, hi.role} != {SENDER, RECEIVER}:
        role = ROLE_NAMES.get(lo.role, str(lo.role)), ROLE_NAMES.get(hi.role, str(hi.role))
        return Refusal(
            ValueError,
            f"kvpool transfer between rank {lo.rank} and rank {hi.rank}: role mismatch: rank {lo.rank} is a "
            f"{role[0]} and rank {hi.rank} is a {role[1]}; one must send and the other receive; nothing moved",
        )
    s, r = (lo, hi) if lo.role == SENDER else (hi, lo)
    where = f"kvpool transfer rank {s.rank} -> rank {r.rank}"
    for h in (s, r):
        if h.error_kind:
            error = ERROR_KINDS.get(h.error_kind, ValueError)
            return Refusal(error, h.message)

    def mismatch(name: str, sv: object, rv: object, extra: str = "") -> Refusal:
        return Refusal(
            ValueError,
            f"{where}: {name} mismatch: the sender's pool has {name}={sv}, the receiver's has "
            f"{name}={rv}{extra}; nothing moved",
        )

    if s.dtype != r.dtype:
        return mismatch("dtype", dtype_name(s.dtype), dtype_name(r.dtype))
    s_layers = (s.start_layer, s.start_layer + s.layer_num - 1)
    r_layers = (r.start_layer, r.start_layer + r.layer_num - 1)
    if s_layers != r_layers:
        return mismatch("layers", list(s_layers), list(r_layers), " (first and last layer id, both included)")
    if s.total_heads != r.total_heads:
        return mismatch("total_heads", s.total_heads, r.total_heads, " (KV heads of the whole model)")
    if s.head_dim != r.head_dim:
        return mismatch("head_dim", s.head_dim, r.head_dim)
    if s.v_head_dim != r.v_head_dim:
        return mismatch("v_head_dim", s.v_head_dim, r.v_head_dim)
    head_lo, head_hi = max(s.heads[0], r.heads[0]), min(s.heads[1], r.heads[1])
    if head_lo >= head_hi:
        return mismatch("heads", list(s.heads), list(r.heads), " (global head ranges, which must overlap)")
    if s.tokens != r.tokens:
        return mismatch("tokens", s.tokens, r.tokens, " (slots in loc)")
    return Agreement(s.tokens, head_lo, head_hi, min(s.chunk_bytes, r.chunk_bytes))


def make_header(
    role: int, rank: int, pool: "MHATokenToKVPool", head_start: int, total_heads: int, tokens: int, chunk_bytes: int
) -> Header:
    """The header describing ``pool`` (an ``MHATokenToKVPool``) for a transfer of ``tokens`` slots."""
    return Header(
        magic=MAGIC,
        version=VERSION,
        role=role,
        rank=rank,
        error_kind=0,
        dtype=dtype_code(pool.dtype),
        start_layer=pool.start_layer,
        layer_num=pool.layer_num,
        head_start=head_start,
        head_num=pool.head_num,
        total_heads=total_heads,
        head_dim=pool.head_dim,
        v_head_dim=pool.v_head_dim,
        tokens=tokens,
        chunk_bytes=chunk_bytes,
        page_size=pool.page_size,
    )

