"""What a sender and a receiver of a request's KV rows between two ranks' pools share: the checks,
the handshake, the pool's and the staging's row tables, the streams, and the transfer handle.
``KVSender``/``KVReceiver`` (:mod:`kvpool.transfer.pipelines`) add their halves of the pipeline.
What users may rely on is in docs/contract.md, "KV transfer between ranks".

How a transfer runs (both ranks, in this order):

1. **Own checks.** Each rank checks its own arguments. A problem that leaves the peer unknown (no
   process group, a peer rank that is not in the group or is this rank, a backend that cannot carry
   the pool's tensors) raises at once, on this rank only. Every other problem (``loc`` of the wrong
   type or shape, a slot outside the pool) is recorded in this rank's header instead of raised.
2. **Handshake.** The ranks swap 1 KiB headers (:mod:`kvpool.transfer.handshake`): pool geometry,
   token count, the heads each holds, staging size, and any problem from step 1. They travel through
   torch.distributed's key-value store (the one ``init_process_group`` set up;
   :mod:`kvpool.transfer.exchange`), so the handshake costs
   host round trips only: no device work, no stream, no wait for earlier transfers to drain. Both
   ranks apply the same symmetric :func:`~kvpool.transfer.handshake.agree` to the two headers, so
   either both raise the same exception with the same message (a ``ValueError`` naming the mismatched
   field, or the ``IndexError``/``TypeError``/``ValueError`` one rank found in its own arguments)
   before any KV byte moves, or both move the same rows in the same chunks. Each rank publishes its
   header before reading the peer's, so two senders (or two receivers) facing each other cannot
   deadlock: they learn of it from the headers. A rank whose peer does not start its side within the
   store's timeout (``init_process_group``'s ``timeout``) withdraws its header and raises; the peer's
   call for that transfer, whenever it comes, raises too, and the next transfers pair as before.
3. **Pipeline.** The sender gathers the rows of a chunk from every layer into a staging half with one
   launch of the row-copy kernel (:mod:`kvpool.kernels.copy_rows`, a table of layer-buffer pointers), sends it, and
   gathers the next chunk into the other half while the first is in flight. The receiver receives into
   one half while it scatters the other into its pool. Chunk sizes follow
   :func:`~kvpool.transfer.wire.chunk_plan`.

Streams (CUDA). The data moves on a side stream: the sender's gathers wait for the work queued on the
caller's current stream when ``send`` is called, so they read what was written before; the receiver's
scatters likewise wait before overwriting its slots. The host waits for the peer's header only.
Nothing synchronises the caller's stream or the host with the device. ``KVTransfer.wait()`` makes the
caller's current stream wait for the transfer (a stream wait, not a host wait); ``is_completed()``
queries an event.

Memory. Each endpoint allocates, once, a staging buffer of two halves of ``chunk_bytes``, an index
buffer of one int64 per pool row, and small tables (those of a head range other than the pool's own on
that range's first transfer); a transfer allocates no device memory. ``loc`` is host indices (a CPU
tensor or a NumPy array, as a scheduler holds them): they are checked on the host, so a bad slot is
reported without reading device memory, and uploaded from a pinned copy that torch's caching host
allocator keeps until the upload has run. (One pinned buffer reused by every transfer would make the
host wait for the previous upload, which may sit behind the compute stream; the caching allocator
only allocates when none of its blocks is free, e.g. on the first transfers.)

CPU pools (gloo). The same pipeline runs on the host: ``send``/``recv`` return when the data has moved
and the handle is already complete.

One endpoint runs one transfer at a time; transfers between the same two ranks over the same group
are matched in the order they were started, so both ranks must start them in the same order (a rank
whose call raises before the handshake, e.g. on an invalid peer, has started nothing: the peer's
pending call pairs with its next one or, if the peer gave up waiting first, that next one raises). Every handshake goes through the default store, which lives
in one process (rank 0's, for the usual TCP store). Not thread-safe.
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch
import torch.distributed as dist

from kvpool.checks import check_index, non_negative_int, out_of_range, positive_int
from kvpool.kernels.copy_rows import FEW_PROGRAMS, RowTable, copy_rows, launch_copy_rows
from kvpool.kernels.launch import INTERPRETER, TRITON_AVAILABLE
from kvpool.pools.mha_pool import MHATokenToKVPool
from kvpool.pools.mla_pool import MLATokenToKVPool
from kvpool.streams import OnStream, StreamMark
from kvpool.transfer.handshake import (
    RECEIVER,
    SENDER,
    Agreement,
    Header,
    Refusal,
    agree,
    make_header,
)
from kvpool.transfer.exchange import exchange, release
from kvpool.transfer.wire import TokenLayout, chunk_plan

#: The pools a transfer moves rows of. An MLA pool's rows travel as their latent (K) and rotary (V)
#: parts, one head.
POOLS = (MHATokenToKVPool, MLATokenToKVPool)

#: Staging per half on CUDA (or the whole pool's rows, if smaller), so the most a chunk can be: each
#: NCCL message carries a fixed cost, so large messages keep the link busy (BENCHMARKS.md has the
#: sweep); the price is two halves of device memory per endpoint (pass a smaller ``chunk_bytes``).
DEFAULT_CHUNK_BYTES_CUDA = 512 << 20
#: gloo over localhost or TCP: messages this large are past its per-message overhead.
DEFAULT_CHUNK_BYTES_CPU = 4 << 20


def default_max_programs(sms: int) -> int:
    """The gather/scatter grid beside the transport on a GPU with ``sms`` SMs: copy_rows' few-programs
    grid, since the link bounds a transfer and a full-grid copy beside NCCL's kernel slows it (the
    pipeline's fill and drain copies, which run alone, take the whole GPU)."""
    return min(sms, FEW_PROGRAMS)


Loc = Union[torch.Tensor, np.ndarray]


@dataclass(frozen=True)
class Route:
    """One transfer's data movement, as the sender's and receiver's pipelines take it."""

    plan: list[tuple[int, int]]  # (first token, tokens) of each chunk
    index: torch.Tensor  # [tokens] this side's slots, on the pool's device
    layout: TokenLayout
    pool_table: RowTable
    stages: tuple[RowTable, RowTable]  # the staging halves
    peer: int
    group: Optional[dist.ProcessGroup]
    compute: Optional[torch.cuda.Stream]  # the caller's stream on CUDA, None on CPU


class KVPoll(enum.IntEnum):
    """State of a transfer, numbered as SGLang's ``KVPoll`` so scheduler code comparing against those
    values carries over. A transfer that starts has passed its handshake, so only these two occur."""

    Transferring = 3
    Success = 4


class KVTransfer:
    """Handle of one started transfer (returned by ``send``/``recv``, ``send_kv``/``recv_kv``).

    Attributes
    ----------
    role : ``"sender"`` or ``"receiver"``.
    peer : global rank of the other side.
    tokens : slots moved.
    heads : ``(lo, hi)``, the global KV heads moved.
    nbytes : KV bytes moved (all layers, K and V, the moved heads only).
    chunks : messages the rows travelled in.
    """

    def __init__(
        self, role: str, peer: int, tokens: int, heads: tuple[int, int], nbytes: int, chunks: int,
        device: torch.device, done: Optional[torch.cuda.Event] = None,
    ) -> None:  # fmt: skip
        self.role, self.peer, self.tokens, self.heads = role, peer, tokens, heads
        self.nbytes, self.chunks = nbytes, chunks
        self._device, self._done = device, done

    def is_completed(self) -> bool:
        """True once every row has moved (sender: read and sent; receiver: written into the pool).
        Never blocks."""
        return self._done is None or self._done.query()

    def poll(self) -> KVPoll:
        return KVPoll.Success if self.is_completed() else KVPoll.Transferring

    def wait(self) -> None:
        """Make the caller's current stream wait for the transfer (no host wait on CUDA). Afterwards,
        work queued on that stream may reuse the sender's slots or read the receiver's."""
        if self._done is not None:
            # (The stream is looked up by device; the wait itself switches devices if it must.)
            torch.cuda.current_stream(self._device).wait_event(self._done)

    def __repr__(self) -> str:
        state = "done" if self.is_completed() else "in flight"
        return (
            f"KVTransfer({self.role}, peer={self.peer}, tokens={self.tokens}, heads={self.heads}, "
            f"nbytes={self.nbytes}, chunks={self.chunks}, {state})"
        )


class Endpoint:
    """What a sender and a receiver share: the pool's tables, staging, streams and the handshake.
    Subclasses set ``_role`` and define ``_pipeline``."""

    _role: int = 0

    def __init__(
        self,
        pool: MHATokenToKVPool,
        group: Optional[dist.ProcessGroup] = None,
        *,
        head_start: int = 0,
        total_heads: Optional[int] = None,
        chunk_bytes: Optional[int] = None,
        max_programs: Optional[int] = None,
    ) -> None:
        if not isinstance(pool, POOLS):
            raise TypeError(f"pool must be an MHATokenToKVPool or MLATokenToKVPool, got {type(pool).__name__}")
        self.pool = pool
        self.group = group
        self.head_start = non_negative_int(head_start, "head_start")
        self.total_heads = pool.head_num if total_heads is None else positive_int(total_heads, "total_heads")
        if head_start + pool.head_num > self.total_heads:
            raise ValueError(
                f"the pool's heads [head_start, head_start + head_num) = [{head_start}, {head_start + pool.head_num}) "
                f"must lie within total_heads={self.total_heads}"
                + ("; pass total_heads (the model's KV heads)" if total_heads is None else "")
            )
        self.device = pool.device
        self._cuda = self.device.type == "cuda"
        self._kernel = self._cuda and TRITON_AVAILABLE and not INTERPRETER  # else copy_rows' own choice
        self._element_size = pool.k_buffer[0].element_size()
        self._rows = pool.size + pool.page_size
        full = TokenLayout.of(pool.layer_num, pool.head_num, pool.head_dim, pool.v_head_dim, self._element_size)
        one_head = TokenLayout.of(pool.layer_num, 1, pool.head_dim, pool.v_head_dim, self._element_size)
        if chunk_bytes is None:
            # No larger than the whole pool: a transfer moves at most one token per pool row.
            default = DEFAULT_CHUNK_BYTES_CUDA if self._cuda else DEFAULT_CHUNK_BYTES_CPU
            chunk_bytes = max(min(default, self._rows * full.token_bytes), full.token_bytes)
        self.chunk_bytes = positive_int(chunk_bytes, "chunk_bytes")
        if self.chunk_bytes < full.token_bytes:
            raise ValueError(
                f"chunk_bytes must hold at least one token of this pool ({full.token_bytes} bytes: "
                f"{pool.layer_num} layers x K,V x {pool.head_num} heads), got {chunk_bytes}"
            )
        self.max_programs = None if max_programs is None else positive_int(max_programs, "max_programs")
        # The pipeline's fill and drain copies run alone and take the whole GPU, unless the caller
        # capped the grid (to leave SMs to its model on other streams).
        self._alone_programs = self.max_programs

        dev = self.device
        self._stage = torch.empty(2 * self.chunk_bytes, dtype=torch.uint8, device=dev)
        self._arange = torch.arange(min(self._rows, self.chunk_bytes // one_head.token_bytes), device=dev)
        self._tables: dict[tuple[int, int], tuple[TokenLayout, RowTable, tuple[RowTable, RowTable]]] = {}
        self._peer_headers: dict[int, Header] = {}  # the last header each peer sent (the handshake's guess)
        if self._cuda:
            self._index = torch.empty(self._rows, dtype=torch.int64, device=dev)
            self._side = torch.cuda.Stream(device=dev)
            self._caller_mark = StreamMark()  # orders the side stream after the caller's
            if max_programs is None:
                sms = torch.cuda.get_device_properties(dev).multi_processor_count
                self.max_programs = default_max_programs(sms)
            # These buffers were allocated on the caller's stream: the side stream starts after what
            # is queued there (the memory may have just been freed by work still pending), and
            # freeing them waits for the side stream, whose last work in each transfer waits for
            # the transport too (so an endpoint dropped with a transfer in flight is safe).
            caller = torch.cuda.current_stream(dev)
            self._side.wait_stream(caller)
            for t in (self._stage, self._arange, self._index):
                t.record_stream(self._side)
        # The tables of the pool's own heads are built now; other head ranges on first use.
        with self._on_side():
            self._tables_for(0, pool.head_num)

    # --- one transfer --------------------------------------------------------------------------------

    def _start(self, loc: Loc, peer: int) -> KVTransfer:
        group = self.group
        rank = self._check_peer(peer, group)
        self._check_backend(group)
        sender, receiver = (rank, peer) if self._role == SENDER else (peer, rank)
        where = f"kvpool transfer rank {sender} -> rank {receiver}"
        loc_host, problem = self._check_loc(loc, where)
        tokens = 0 if loc_host is None else loc_host.shape[0]
        mine = make_header(self._role, rank, self.pool, self.head_start, self.total_heads, tokens, self.chunk_bytes)
        if problem is not None:
            mine = mine.with_error(problem)
        encoded = mine.to_bytes()
        store = _default_store()
        theirs, spent_key = exchange(store, encoded, mine, rank, peer, group, self._peer_headers.get(peer))
        self._peer_headers[peer] = theirs
        try:
            # Both ranks judge the headers as they travelled (a long message is cut the same way on both).
            verdict = agree(Header.from_bytes(encoded), theirs)
            if isinstance(verdict, Refusal):
                raise verdict.exception()
            if loc_host is None:  # unreachable: a rank with a loc problem refuses through the verdict
                raise RuntimeError(f"{where}: the handshake agreed although this rank's loc was rejected")
            return self._move(verdict, loc_host, peer, group)
        finally:
            release(store, spent_key)  # once the data movement is queued: the round trip overlaps the device's work

    def _check_peer(self, peer: object, group: Optional[dist.ProcessGroup]) -> int:
        """This rank's global rank, after checking ``peer``; raises here (the peer cannot be told)."""
        name = "dst" if self._role == SENDER else "src"
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call init_process_group first (kvpool starts no processes)"
            )
        if isinstance(peer, bool) or not isinstance(peer, int):
            raise TypeError(f"{name} must be an int (a global rank), got {type(peer).__name__}")
        rank = dist.get_rank()
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        if rank not in ranks:
            raise ValueError(f"this rank ({rank}) is not in the process group (ranks {ranks})")
        if peer not in ranks or peer == rank:
            raise ValueError(
                f"{name} must be another rank of the process group {ranks}, got {peer} (this rank is {rank})"
            )
        return rank

    def _check_backend(self, group: Optional[dist.ProcessGroup]) -> None:
        backend = str(dist.get_backend(group))
        if ":" in backend:  # "cpu:gloo,cuda:nccl": one backend per device type
            per_device = dict(part.split(":", 1) for part in backend.split(","))
            chosen = per_device.get(self.device.type)
        else:
            chosen = backend
        ok = chosen is not None and not (
            (chosen == "nccl" and self.device.type != "cuda") or (chosen == "gloo" and self.device.type != "cpu")
        )
        if not ok:
            raise ValueError(
                f"the process group's backend ({backend}) cannot carry tensors of the pool's device "
                f"{self.device}: use NCCL for CUDA pools and gloo for CPU pools"
            )

    def _check_loc(self, loc: object, where: str) -> tuple[Optional[torch.Tensor], Optional[Exception]]:
        """``loc`` as a CPU int64 tensor, or the problem to report to both ranks (with the error the
        one check helper raises, prefixed by the transfer and the role)."""
        role = "sender" if self._role == SENDER else "receiver"
        tail = "; nothing moved"
        if isinstance(loc, np.ndarray):
            if loc.dtype not in (np.int32, np.int64):
                return None, ValueError(f"{where}: the {role}'s loc must be int32 or int64, got numpy {loc.dtype}{tail}")
            loc = torch.from_numpy(loc)
        if not isinstance(loc, torch.Tensor):
            return None, TypeError(
                f"{where}: the {role}'s loc must be a CPU torch.Tensor or a numpy array, got {type(loc).__name__}{tail}"
            )
        try:
            check_index(loc, "loc", dims="[T]")
        except ValueError as e:
            return None, ValueError(f"{where}: the {role}'s {e}{tail}")
        if loc.device.type != "cpu":
            return None, ValueError(
                f"{where}: the {role}'s loc must be host indices (a CPU tensor), got a tensor on {loc.device}: "
                f"reading device indices to check them would synchronise the device; pass loc.cpu(){tail}"
            )
        n = loc.shape[0]
        if n > self._rows:
            return None, ValueError(f"{where}: the {role}'s loc has {n} slots, more than its pool's {self._rows} rows{tail}")
        loc64 = loc.to(torch.int64)
        bad = out_of_range(loc64, self._rows, negative_ok=False)
        if bad is not None:
            return None, IndexError(
                f"{where}: the {role}'s loc[{bad[0]}] = {bad[1]} is outside its pool's slots [0, {self._rows}){tail}"
            )
        return loc64, None

    def _on_side(self) -> contextlib.AbstractContextManager:
        """Current device and stream for the data movement (nothing on CPU)."""
        if not self._cuda:
            return contextlib.nullcontext()
        return OnStream(self._side)

    def _tables_for(self, lo: int, hi: int) -> tuple[TokenLayout, RowTable, tuple[RowTable, RowTable]]:
        """Row tables of the pool (local heads ``[lo, hi)`` of every layer's K and V: the pool's own
        ``row_table`` for all its heads) and of the two staging halves, in the wire order; built once
        per head range, on the side stream (the address tables are copied there without a
        synchronisation, ready for the work that follows)."""
        key = (lo, hi)
        cached = self._tables.get(key)
        if cached is not None:
            return cached
        pool = self.pool
        layout = TokenLayout.of(pool.layer_num, hi - lo, pool.head_dim, pool.v_head_dim, self._element_size)
        if (lo, hi) == (0, pool.head_num):
            pool_table = pool.row_table
        else:
            parts = [b[:, lo:hi] for pair in zip(pool.k_buffer, pool.v_buffer) for b in pair]
            pool_table = RowTable.of(parts, non_blocking=self._cuda)
        capacity = self.chunk_bytes // layout.token_bytes
        halves = []
        for half in range(2):
            base = self._stage[half * self.chunk_bytes :][: capacity * layout.token_bytes]
            rows = base.view(capacity, layout.token_bytes)
            bands = [rows[:, o : o + n] for o, n in zip(layout.offsets, layout.row_bytes)]
            halves.append(RowTable.of(bands, non_blocking=self._cuda))
        entry = (layout, pool_table, (halves[0], halves[1]))
        self._tables[key] = entry
        return entry

    def _copy(
        self, dst: RowTable, dst_index: torch.Tensor, src: RowTable, src_index: torch.Tensor, alone: bool = False
    ) -> None:
        """One gather or scatter of a chunk. The tables and indices are the endpoint's own, built and
        checked once (slots on the host before the handshake), so on CUDA the kernel is launched
        without ``copy_rows``' per-call checks: the host cost per chunk is what can leave the link
        idle between chunks. ``alone``: no transport kernel runs beside this copy (the sender's
        first gather, the receiver's last scatter: the pipeline's fill and drain), so it takes the
        whole GPU unless the caller set ``max_programs``."""
        programs = self._alone_programs if alone else self.max_programs
        if self._kernel:
            launch_copy_rows(dst, dst_index, src, src_index, max_programs=programs)
        else:  # CPU pools, or no usable Triton (copy_rows then takes its PyTorch reference)
            copy_rows(dst, dst_index, src, src_index, max_programs=programs)

    def _staged(self, half: int, nbytes: int) -> torch.Tensor:
        return self._stage[half * self.chunk_bytes :][:nbytes]

    def _move(self, agreed: Agreement, loc: torch.Tensor, peer: int, group: Optional[dist.ProcessGroup]) -> KVTransfer:
        role = "sender" if self._role == SENDER else "receiver"
        heads = (agreed.head_lo, agreed.head_hi)
        if agreed.tokens == 0:
            return KVTransfer(role, peer, 0, heads, 0, 0, self.device)
        compute = torch.cuda.current_stream(self.device) if self._cuda else None
        with self._on_side():
            lo, hi = agreed.head_lo - self.head_start, agreed.head_hi - self.head_start  # local head numbers
            layout, pool_table, stages = self._tables_for(lo, hi)
            plan = chunk_plan(agreed.tokens, agreed.chunk_bytes // layout.token_bytes)
            nbytes = agreed.tokens * layout.token_bytes
            if not self._cuda:
                self._pipeline(Route(plan, loc, layout, pool_table, stages, peer, group, None))
                return KVTransfer(role, peer, agreed.tokens, heads, nbytes, len(plan), self.device)
            # A contiguous pinned copy: the caller may change loc once this returns, and a strided
            # source would make the upload below go through pageable memory (a possible host wait).
            pinned = torch.empty(loc.shape[0], dtype=torch.int64, pin_memory=True).copy_(loc)
            index = self._index[: loc.shape[0]]
            # The pinned block stays reserved until this copy has run (the caching host allocator
            # records the stream), so the host may drop it now.
            index.copy_(pinned, non_blocking=True)
            self._pipeline(Route(plan, index, layout, pool_table, stages, peer, group, compute))
            done = torch.cuda.Event()
            done.record(self._side)
        return KVTransfer(role, peer, agreed.tokens, heads, nbytes, len(plan), self.device, done)

    def _pipeline(self, route: Route) -> None:
        """Move the rows of ``route``'s chunks."""
        raise NotImplementedError


def _default_store() -> dist.Store:
    """The key-value store torch.distributed was initialised with (every rank can reach it)."""
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None:  # pragma: no cover - present in every torch kvpool supports
        raise RuntimeError("kvpool transfers need torch.distributed's default store, which this torch does not expose")
    return getter()


def kept_endpoint(cls: type, pool: MHATokenToKVPool, group: Optional[dist.ProcessGroup], **options: object) -> Endpoint:
    """The endpoint kept for ``pool``, ``group`` and ``options``. Kept on the pool object itself, so
    it lives and dies with the pool (a table keyed by pool would keep every pool alive, since each
    endpoint refers to its pool)."""
    if not isinstance(pool, POOLS):
        raise TypeError(f"pool must be an MHATokenToKVPool or MLATokenToKVPool, got {type(pool).__name__}")
    kept: dict = pool.__dict__.setdefault("_transfer_endpoints", {})
    key = (cls, group, tuple(sorted(options.items())))
    ep = kept.get(key)
    if ep is None:
        ep = kept[key] = cls(pool, group, **options)
    return ep
