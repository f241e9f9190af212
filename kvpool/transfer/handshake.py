"""The header both ranks of a transfer exchange before any KV byte moves, and the decision they take.

Each rank describes its side in a fixed-size :class:`Header` (pool geometry and row format, token count, the heads
it holds, staging size, the geometry of its linear-attention state and the state slots it moves, what
its endpoint offers for a direct transfer) together with the problem it found in its own arguments,
if any (a slot out of range, a bad ``loc``). The two headers are swapped, and each rank calls :func:`agree` on the pair.
``agree`` is symmetric (``agree(a, b) == agree(b, a)``), so both ranks reach the same verdict from the
same two headers: either both raise the same exception with the same message, or both move the same
rows in the same chunks. That is what keeps a mismatch from hanging one rank while the other waits.

The header has a fixed size (``HEADER_BYTES``): int64 fields, then up to ``MESSAGE_BYTES`` of UTF-8
carrying a rank's own error message, so the peer can raise that exact message too. :func:`link_route` decides, from the same two
headers, whether the rows travel staged or are read directly (:mod:`kvpool.transfer.ipc`).

docs/contract.md, "KV transfer between ranks", lists the mismatches and their errors.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Optional, Sequence, Union

import torch

from kvpool.kernels.formats import CACHE_DTYPES, FP4_DTYPE
from kvpool.transfer.parts import NVFP4, KVParts, format_name, kv_parts
from kvpool.transfer.state_wire import (
    STATE_FIELDS,
    StateOverlap,
    StateSide,
    ids_crc,
    state_mismatch,
    state_overlap,
)

if TYPE_CHECKING:
    from kvpool.pools.mha_pool import MHATokenToKVPool
    from kvpool.pools.mla_pool import MLATokenToKVPool

#: Bytes of one header on the wire: ``_FIELD_SLOTS`` int64 slots for the integer fields (room for
#: fields a later version adds), then the message, which takes the rest (``MESSAGE_BYTES``).
HEADER_BYTES = 2048
_FIELD_SLOTS = 96
_MESSAGE_OFFSET = _FIELD_SLOTS * 8
MESSAGE_BYTES = HEADER_BYTES - _MESSAGE_OFFSET
MAGIC = 0x6B76706F6F6C5458  # "kvpoolTX"
VERSION = 3

SENDER, RECEIVER = 1, 2
ROLE_NAMES = {SENDER: "sender", RECEIVER: "receiver"}

# Exception classes a rank may report for its own arguments; the peer raises the same class.
ERROR_KINDS: dict[int, type[Exception]] = {1: ValueError, 2: IndexError, 3: TypeError}
_KIND_OF = {cls: kind for kind, cls in ERROR_KINDS.items()}

# What an endpoint offers for a direct (CUDA IPC) transfer: IPC_OFFERED, or why not.
IPC_OFFERED, IPC_CPU, IPC_DISABLED, IPC_NO_KERNEL, IPC_UNSUPPORTED = 1, 2, 3, 4, 5
_NOT_OFFERED = {  # completes "the sender's ..." / "the receiver's ..."
    0: "endpoint does not offer a direct transfer",
    IPC_CPU: "pool is in host memory",
    IPC_DISABLED: "endpoint was built with ipc=False",
    IPC_NO_KERNEL: "process cannot run the row-copy kernel (no Triton, or its interpreter)",
    IPC_UNSUPPORTED: "process has no CUDA IPC",
}
# What a rank holds for the peer endpoint it expects: nothing yet, an open direct path, a refusal.
PEER_NONE, PEER_READY, PEER_REFUSED = 0, 1, 2
STAGED, DIRECT, SETUP = "staged", "ipc", "setup"
#: A header's dtype code for SGLang's FP4 (``torch.float4_e2m1fn_x2``, or ``"fp4_e2m1"`` where torch
#: lacks it: one dtype for the handshake), after every code ``CACHE_DTYPES`` may grow to.
FP4_DTYPE_CODE = 64


def dtype_code(dtype: object) -> int:
    """``dtype``'s code in a header: its 1-based position in ``CACHE_DTYPES``, or ``FP4_DTYPE_CODE``
    for SGLang's FP4 (``ValueError`` for another dtype)."""
    if dtype == "fp4_e2m1" or (FP4_DTYPE is not None and dtype == FP4_DTYPE):
        return FP4_DTYPE_CODE
    return CACHE_DTYPES.index(dtype) + 1  # type: ignore[arg-type]


def dtype_name(code: int) -> str:
    """The dtype a header's code stands for, as text for messages (``"unknown dtype code N"`` when it
    names none)."""
    if code == FP4_DTYPE_CODE:
        return str(FP4_DTYPE) if FP4_DTYPE is not None else "fp4_e2m1"
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
    # How the rows keep their scales (an index in kvpool.transfer.parts.KV_FORMATS), and for NVFP4
    # the per-layer global scales: their crc32 and layer 0's (k, v) as float32 bits (for messages).
    kv_format: int = 0
    gs_crc: int = 0
    gs_k0: int = 0
    gs_v0: int = 0
    layer_last: int = 0  # the last KV layer id (start_layer is the first, layer_num the count)
    layer_crc: int = 0  # checksum of the KV layer ids (a hybrid pool's are not consecutive)
    states: int = 0  # state slots this rank moves
    # The linear-attention state (kvpool.transfer.state_wire.STATE_FIELDS), zero without a state pool.
    state_pool: int = 0
    st_layer_count: int = 0
    st_layer_first: int = 0
    st_layer_last: int = 0
    st_layer_crc: int = 0
    st_conv_count: int = 0
    st_conv0: int = 0
    st_conv1: int = 0
    st_conv2: int = 0
    st_conv3: int = 0
    st_width0: int = 0
    st_width1: int = 0
    st_width2: int = 0
    st_width3: int = 0
    st_conv_dtype: int = 0
    st_ssm_dtype: int = 0
    st_v_heads: int = 0
    st_v_head_dim: int = 0
    st_k_head_dim: int = 0
    st_bands: int = 0
    st_v_start: int = 0
    st_total_v: int = 0
    st_k_start: int = 0
    st_k_heads: int = 0
    st_total_k: int = 0
    # The direct path (kvpool.transfer.ipc): this endpoint's id, what it offers (IPC_*), its host,
    # and the peer endpoint it expects with what it holds for that one (PEER_*).
    ep_id: int = 0
    ipc: int = 0
    host_id: int = 0
    peer_ep: int = 0
    peer_ipc: int = 0
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
        """``(lo, hi)``: the global KV heads this rank's pool holds."""
        return self.head_start, self.head_start + self.head_num


#: The integer fields in declaration order (the message is last), and their wire packing.
_INT_FIELDS = tuple(f.name for f in fields(Header) if f.name != "message")
_INTS = struct.Struct("<" + "q" * (len(_INT_FIELDS) + 1))
assert _INTS.size <= _MESSAGE_OFFSET and fields(Header)[-1].name == "message"
assert set(STATE_FIELDS) <= set(_INT_FIELDS)


@dataclass(frozen=True)
class Agreement:
    """What both ranks move when the headers agree: ``tokens`` rows of the global heads
    ``[head_lo, head_hi)`` in chunks of at most ``chunk_bytes`` bytes (the smaller staging), and
    ``states`` state slots of the heads in ``state`` (None when no state moves)."""

    tokens: int
    head_lo: int
    head_hi: int
    chunk_bytes: int
    states: int = 0
    state: Optional[StateOverlap] = None


@dataclass(frozen=True)
class Refusal:
    """Both ranks raise ``error(message)``."""

    error: type[Exception]
    message: str

    def exception(self) -> Exception:
        """The exception both ranks raise: ``error(message)``."""
        return self.error(self.message)


def agree(a: Header, b: Header) -> Agreement | Refusal:
    """The verdict on a pair of headers, the same whichever rank's header comes first.

    Order of checks (the first failing one is reported): the protocol, the roles, the sender's own
    argument problem, the receiver's, then dtype, kv_format, layers, total_heads, head_dim,
    v_head_dim, an NVFP4 pool's global_scales, the overlap of the held heads, the token count; then, when both have a state pool, the state's
    geometry (:func:`~kvpool.transfer.state_wire.state_mismatch`), and the state slot count.
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
    if s.kv_format != r.kv_format:
        return mismatch("kv_format", format_name(s.kv_format), format_name(r.kv_format),
                        " (how the rows keep their scales: stored beside the codes, and in which layout)")  # fmt: skip
    s_layers, r_layers = (s.start_layer, s.layer_last), (r.start_layer, r.layer_last)
    if s_layers != r_layers:
        return mismatch("layers", list(s_layers), list(r_layers), " (first and last layer id, both included)")
    if (s.layer_num, s.layer_crc) != (r.layer_num, r.layer_crc):
        return mismatch("layers", f"{s.layer_num} ids in {list(s_layers)}", f"{r.layer_num} ids in {list(r_layers)}",
                        " (the KV layer ids differ)")  # fmt: skip
    if s.total_heads != r.total_heads:
        return mismatch("total_heads", s.total_heads, r.total_heads, " (KV heads of the whole model)")
    if s.head_dim != r.head_dim:
        return mismatch("head_dim", s.head_dim, r.head_dim)
    if s.v_head_dim != r.v_head_dim:
        return mismatch("v_head_dim", s.v_head_dim, r.v_head_dim)
    if (s.gs_crc, s.gs_k0, s.gs_v0) != (r.gs_crc, r.gs_k0, r.gs_v0):
        return mismatch("global_scales", _scales_text(s), _scales_text(r),
                        " (each layer's NVFP4 K and V global scales, set_global_scales)")  # fmt: skip
    head_lo, head_hi = max(s.heads[0], r.heads[0]), min(s.heads[1], r.heads[1])
    if head_lo >= head_hi:
        return mismatch("heads", list(s.heads), list(r.heads), " (global head ranges, which must overlap)")
    if s.tokens != r.tokens:
        return mismatch("tokens", s.tokens, r.tokens, " (slots in loc)")
    state = None
    if s.state_pool and r.state_pool:
        found = state_mismatch(s, r)
        if found is not None:
            return mismatch(*found)
        state = state_overlap(s, r)
    if s.states != r.states:
        lacking = [name for name, h in (("sender", s), ("receiver", r)) if not h.state_pool]
        extra = f"; the {lacking[0]}'s pool has no linear-attention state" if lacking else ""
        return mismatch("states", s.states, r.states, f" (slots in state_slots){extra}")
    return Agreement(s.tokens, head_lo, head_hi, min(s.chunk_bytes, r.chunk_bytes), s.states, state)


def link_route(a: Header, b: Header) -> tuple[str, Optional[str]]:
    """How an agreed transfer's rows move, the same whichever header comes first: ``(DIRECT, None)``
    when both endpoints hold an open direct path to each other, ``(SETUP, None)`` when both offer
    one on the same host but have not set it up yet (they do, then move directly or staged),
    ``(STAGED, reason)`` otherwise (``reason`` None when the pair refused at setup: each side keeps
    why)."""
    s, r = (a, b) if a.role == SENDER else (b, a)
    for name, h in (("sender", s), ("receiver", r)):
        if h.ipc != IPC_OFFERED:
            return STAGED, f"the {name}'s {_NOT_OFFERED.get(h.ipc, _NOT_OFFERED[0])}"
    if s.host_id != r.host_id:
        return STAGED, "the ranks run on different hosts"
    if s.peer_ep == r.ep_id and r.peer_ep == s.ep_id and s.peer_ipc == r.peer_ipc != PEER_NONE:
        return (DIRECT, None) if s.peer_ipc == PEER_READY else (STAGED, None)
    return SETUP, None


def make_header(
    role: int,
    rank: int,
    pool: Union[KVParts, "MHATokenToKVPool", "MLATokenToKVPool"],
    head_start: int,
    total_heads: int,
    tokens: int,
    chunk_bytes: int,
    *,
    layer_ids: Optional[Sequence[int]] = None,
    state: Optional[StateSide] = None,
    states: int = 0,
    link: Optional[dict[str, int]] = None,
) -> Header:
    """The header describing ``pool`` (its :class:`~kvpool.transfer.parts.KVParts`, or a pool a
    transfer takes, whose parts are read now) for a transfer of ``tokens`` slots; ``layer_ids`` its layers' global ids (default: consecutive from
    its ``start_layer``), ``state`` the geometry of the state pool beside it moving ``states``
    slots, ``link`` the direct-path fields (``ep_id``, ``ipc``, ``host_id``, ``peer_ep``, ``peer_ipc``)."""
    parts = pool if isinstance(pool, KVParts) else kv_parts(pool)
    ids = tuple(range(parts.start_layer, parts.start_layer + parts.layer_num)) if layer_ids is None else tuple(layer_ids)
    extra = dict(state.fields()) if state is not None else {}
    k0, v0 = parts.global_scales[0] if parts.global_scales else (0.0, 0.0)
    return Header(
        magic=MAGIC,
        version=VERSION,
        role=role,
        rank=rank,
        error_kind=0,
        dtype=dtype_code(parts.dtype),
        start_layer=ids[0],
        layer_num=len(ids),
        head_start=head_start,
        head_num=parts.head_num,
        total_heads=total_heads,
        head_dim=parts.head_dim,
        v_head_dim=parts.v_head_dim,
        tokens=tokens,
        chunk_bytes=chunk_bytes,
        page_size=parts.page_size,
        kv_format=parts.kv_format,
        gs_crc=parts.global_scales_crc(),
        gs_k0=_float32_bits(k0),
        gs_v0=_float32_bits(v0),
        layer_last=ids[-1],
        layer_crc=ids_crc(ids),
        states=states,
        **extra,
        **(link or {}),
    )



def _float32_bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


def _scales_text(h: Header) -> str:
    """A header's NVFP4 global scales for a message: layer 0's and the checksum of all."""
    if format_name(h.kv_format) != NVFP4:
        return "none"
    k, v = (struct.unpack("<f", struct.pack("<I", bits))[0] for bits in (h.gs_k0, h.gs_v0))
    return f"(k={k!r}, v={v!r}) in its first layer, crc32 {h.gs_crc:#010x} over all"
