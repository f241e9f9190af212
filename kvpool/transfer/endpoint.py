"""What a sender and a receiver of a request's rows between two ranks' pools share: the checks, the
handshake, the staging and its tables, the direct path, the streams. ``KVSender``/``KVReceiver``
(:mod:`kvpool.transfer.pipelines`) add their halves of the staged pipeline. What users may rely on
is in docs/contract.md, "KV transfer between ranks".

How a transfer runs (both ranks, in this order):

1. **Own checks.** Each rank checks its own arguments. A problem that leaves the peer unknown (no
   process group, a peer rank that is not in the group or is this rank, a backend that cannot carry
   the pool's tensors) raises at once, on this rank only. Every other problem (``loc`` or
   ``state_slots`` of the wrong type or shape, a slot outside its pool) is recorded in this rank's
   header instead of raised.
2. **Handshake.** The ranks swap fixed-size headers (:mod:`kvpool.transfer.handshake`): the KV pool's
   geometry and row format (:mod:`kvpool.transfer.parts`), token count, the heads each holds,
   staging size, the linear-attention state's geometry and slot count
   (:mod:`kvpool.transfer.state_wire`), what the endpoint offers for a direct transfer, and any
   problem from step 1. They travel through torch.distributed's key-value store
   (:mod:`kvpool.transfer.exchange`): host round trips only, no device work, no wait for earlier
   transfers to drain. Both ranks apply the same symmetric :func:`~kvpool.transfer.handshake.agree`
   to the two headers, so either both raise the same exception with the same message (a
   ``ValueError`` naming the mismatched field, or the ``IndexError``/``TypeError``/``ValueError``
   one rank found in its own arguments) before any byte moves, or both move the same rows the same
   way. Each rank publishes its header before reading the peer's, so two senders (or two receivers)
   facing each other cannot deadlock. A rank whose peer does not start its side within the store's
   timeout (``init_process_group``'s ``timeout``) withdraws its header and raises; the peer's call
   for that transfer, whenever it comes, raises too, and the next transfers pair as before.
3. **Path.** :func:`~kvpool.transfer.handshake.link_route` picks, from the same headers, the direct
   path (:mod:`kvpool.transfer.ipc`: both CUDA endpoints on one host, set up once per pair of
   endpoints) or the staged one.
4. **Staged pipeline.** The sender gathers the rows of a chunk from every layer (KV rows with the
   scales stored beside them, then state bands) into a staging half with one launch of the
   row-copy kernel, sends it, and gathers the next chunk into the other half while the first is in
   flight; the receiver receives into one half while it scatters the other into its pools. Chunk sizes follow
   :func:`~kvpool.transfer.wire.chunk_plan` and :func:`~kvpool.transfer.state_wire.state_plan`.

Streams (CUDA). The data moves on a side stream: the sender's gathers wait for the work queued on the
caller's current stream when ``send`` is called, so they read what was written before; the receiver's
scatters likewise wait before overwriting its slots. The host waits for the peer's header only.
Nothing synchronises the caller's stream or the host with the device. ``KVTransfer.wait()`` makes the
caller's current stream wait for the transfer (a stream wait, not a host wait); ``is_completed()``
queries an event.

Memory. Each endpoint allocates, once, a staging buffer of two halves of ``chunk_bytes``, an index
buffer of one int64 per pool row and state slot, and small tables (those of a head range other than
the pool's own on that range's first transfer); a transfer allocates no device memory. ``loc`` and
``state_slots`` are host indices (CPU tensors or NumPy arrays, as a scheduler holds them): they are
checked on the host, so a bad slot is reported without reading device memory, and uploaded from a
pinned copy that torch's caching host allocator keeps until the upload has run.

CPU pools (gloo). The same pipeline runs on the host: ``send``/``recv`` return when the data has moved
and the handle is already complete.

One endpoint runs one transfer at a time; transfers between the same two ranks over the same group
are matched in the order they were started, so both ranks must start them in the same order. Every
handshake goes through the default store, which lives in one process (rank 0's, for the usual TCP
store). Not thread-safe.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Optional, Union

import torch
import torch.distributed as dist

from kvpool.checks import non_negative_int, positive_int
from kvpool.kernels.copy_rows import RowTable, copy_rows, launch_copy_rows
from kvpool.kernels.copy_rows.launcher import FEW_PROGRAMS
from kvpool.kernels.launch import compiled_on, sm_count
from kvpool.pools.hybrid_kv_pool import HybridLinearKVPool
from kvpool.pools.mha_fp4_pool import MHATokenToKVPoolFP4
from kvpool.pools.mha_fp8_token_pool import MHATokenToKVPoolFP8PerTokenHead
from kvpool.pools.mha_pool import MHATokenToKVPool
from kvpool.pools.mla_fp4_pool import MLATokenToKVPoolFP4
from kvpool.pools.mla_pool import MLATokenToKVPool
from kvpool.streams import OnStream, StreamMark
from kvpool.transfer.arguments import Loc, check_backend, check_peer, check_slots
from kvpool.transfer.arguments import default_store as _default_store
from kvpool.transfer.exchange import exchange, release
from kvpool.transfer.handle import KVTransfer
from kvpool.transfer.handshake import (
    DIRECT,
    SENDER,
    SETUP,
    Agreement,
    Header,
    Refusal,
    agree,
    link_route,
    make_header,
)
from kvpool.transfer.ipc import (
    DirectLink,
    PeerDone,
    RecvPair,
    SendPair,
    offer_code,
    receiver_setup,
    remote_kv_table,
    remote_state_table,
    sender_setup,
)
from kvpool.transfer.parts import KVParts, check_pool, kv_parts
from kvpool.transfer.staging import Chunk, Staging
from kvpool.transfer.state_wire import StateShard, StateSide, band_spans
from kvpool.transfer.wire import TokenLayout, chunk_plan

#: The pools a transfer moves rows of, each row with every part it keeps (:mod:`kvpool.transfer.parts`).
#: An MLA pool's rows travel as their latent (K) and rotary (V) parts, one head; a
#: ``HybridLinearKVPool`` moves its inner pool's rows and its ``mamba_pool``'s states.
POOLS = (MHATokenToKVPool, MLATokenToKVPool, MHATokenToKVPoolFP4, MLATokenToKVPoolFP4,
         MHATokenToKVPoolFP8PerTokenHead, HybridLinearKVPool)  # fmt: skip
#: Staging per half on CUDA (or the whole pool's rows, if smaller): each NCCL message carries a fixed
#: cost, so large messages keep the link busy; the price is two halves of device memory per endpoint.
TRANSFER_CHUNK_BYTES_CUDA = 512 << 20
#: Staging per half on the CPU: gloo messages this large are past its per-message overhead.
TRANSFER_CHUNK_BYTES_CPU = 4 << 20


def default_max_programs(sms: int) -> int:
    """The gather/scatter grid beside the transport on a GPU with ``sms`` SMs: copy_rows' few-programs
    grid, since the link bounds a transfer and a full-grid copy beside NCCL's kernel slows it (the
    pipeline's fill and drain copies, which run alone, take the whole GPU)."""
    return min(sms, FEW_PROGRAMS)


AnyPool = Union[
    MHATokenToKVPool, MLATokenToKVPool, MHATokenToKVPoolFP4, MLATokenToKVPoolFP4, MHATokenToKVPoolFP8PerTokenHead,
    HybridLinearKVPool,
]


@dataclass(frozen=True)
class Route:
    """One staged transfer's data movement, as the sender's and receiver's pipelines take it."""

    plan: list[tuple[int, int]]  # (first token, tokens) of each KV chunk
    index: torch.Tensor  # [tokens] this side's slots, on the pool's device
    layout: TokenLayout
    pool_table: RowTable
    stages: tuple[RowTable, RowTable]  # the staging halves
    peer: int
    group: Optional[dist.ProcessGroup]
    compute: Optional[torch.cuda.Stream]  # the caller's stream on CUDA, None on CPU
    state: tuple[Chunk, ...] = ()  # the state chunks, after the KV's

    def chunks(self) -> list[Chunk]:
        """Every chunk this transfer moves, in order: a KV chunk per entry of ``plan``, then the
        state chunks."""
        kv = [Chunk(count, count * self.layout.token_bytes, self.pool_table, self.index[start : start + count],
                    self.stages) for start, count in self.plan]  # fmt: skip
        return kv + list(self.state)


class Endpoint:
    """What a sender and a receiver share: the pools, staging, streams, the handshake and the direct
    path. Subclasses set ``_role`` and define ``_pipeline``."""

    _role: int = 0

    def __init__(
        self,
        pool: AnyPool,
        group: Optional[dist.ProcessGroup] = None,
        *,
        head_start: int = 0,
        total_heads: Optional[int] = None,
        chunk_bytes: Optional[int] = None,
        max_programs: Optional[int] = None,
        state_shard: Optional[StateShard] = None,
        ipc: bool = True,
    ) -> None:
        check_pool(pool)
        self.pool, self.group = pool, group
        hybrid = isinstance(pool, HybridLinearKVPool)
        kv = pool.full_kv_pool if hybrid else pool
        self.kv, self.mamba = kv, pool.mamba_pool if hybrid else None  # type: ignore[union-attr]
        #: The KV pool's row parts as the wire carries them (the global scales are read per transfer).
        self.parts = parts = kv_parts(kv)
        self.layer_ids = tuple(pool.full_attention_layer_ids) if hybrid else None  # type: ignore[union-attr]
        if state_shard is not None and self.mamba is None:
            raise ValueError("state_shard needs a pool with linear-attention state (a HybridLinearKVPool with a mamba_pool)")
        self.state = None if self.mamba is None else StateSide.of(self.mamba, state_shard)
        self.head_start = non_negative_int(head_start, "head_start")
        self.total_heads = parts.head_num if total_heads is None else positive_int(total_heads, "total_heads")
        if head_start + parts.head_num > self.total_heads:
            raise ValueError(
                f"the pool's heads [head_start, head_start + head_num) = [{head_start}, {head_start + parts.head_num}) "
                f"must lie within total_heads={self.total_heads}"
                + ("; pass total_heads (the model's KV heads)" if total_heads is None else "")
            )
        self.device = kv.device
        self._cuda = self.device.type == "cuda"
        self._kernel = compiled_on(self.device)  # else copy_rows' own choice
        self._rows = parts.rows
        self._state_rows = 0 if self.mamba is None else self.mamba.size + 1
        self.chunk_bytes = self._chunk_bytes(chunk_bytes)
        self.max_programs = None if max_programs is None else positive_int(max_programs, "max_programs")
        # The pipeline's fill and drain copies (and the direct path's one copy) run alone and take
        # the whole GPU, unless the caller capped the grid (to leave SMs to its model on other streams).
        self._alone_programs = self.max_programs
        self.link = DirectLink(offer_code(self.device, ipc, self._kernel))
        self._peer_headers: dict[int, Header] = {}  # the last header each peer sent (the handshake's guess)
        if self._cuda:
            self._side = torch.cuda.Stream(device=self.device)
            self._caller_mark = StreamMark()  # orders the side stream after the caller's
            if max_programs is None:
                self.max_programs = default_max_programs(sm_count(self.device))
            # The side stream starts after what is queued on the caller's (the pool may still be
            # being filled there).
            self._side.wait_stream(torch.cuda.current_stream(self.device))
        # The staging buffers and the index are the side stream's allocations, which only the side
        # stream's later work reuses: an endpoint dropped with a transfer in flight is safe (the side
        # stream's last work in each transfer waits for the transport) and needs no record_stream,
        # whose events cannot be made once CUDA shuts down at a process's exit.
        with self._on_side():
            self.staging = Staging(parts, self.mamba, self.state, self.chunk_bytes, self._cuda)
            self._stage, self._arange = self.staging.buffer, self.staging.arange
            if self._cuda:
                self._index = torch.empty(self._rows + self._state_rows, dtype=torch.int64, device=self.device)
            # The tables of the pool's own heads are built now; other head ranges on first use.
            self._tables_for(0, parts.head_num)

    def _chunk_bytes(self, chunk_bytes: Optional[int]) -> int:
        parts = self.parts
        token = parts.layout(parts.head_num)
        row = 0 if self.mamba is None else max(self.mamba.row_table.row_bytes)  # the largest state buffer row
        if chunk_bytes is None:
            # No larger than the whole pools: a transfer moves at most one token per pool row and
            # one state per slot.
            default = TRANSFER_CHUNK_BYTES_CUDA if self._cuda else TRANSFER_CHUNK_BYTES_CPU
            whole = max(self._rows * token.token_bytes, self._state_rows * sum(self.mamba.row_table.row_bytes)
                        if self.mamba is not None else 0)  # fmt: skip
            chunk_bytes = max(min(default, whole), token.token_bytes, row)
        positive_int(chunk_bytes, "chunk_bytes")
        if chunk_bytes < token.token_bytes:
            raise ValueError(
                f"chunk_bytes must hold at least one token of this pool ({token.token_bytes} bytes: "
                f"{parts.layer_num} layers x {len(parts.head_bytes)} row parts x {parts.head_num} heads), got {chunk_bytes}"
            )
        if chunk_bytes < row:
            raise ValueError(
                f"chunk_bytes must hold at least one state buffer's slot row of this pool ({row} bytes: the "
                f"largest convolution window or SSM state of a layer), got {chunk_bytes}"
            )
        return chunk_bytes

    def header_parts(self) -> KVParts:
        """:attr:`parts` with the pool's global scales as they are now (an NVFP4 pool's may change
        between transfers, through ``set_global_scales``)."""
        scales = tuple(getattr(self.kv, "global_scale_values", ()))
        if scales != self.parts.global_scales:
            self.parts = replace(self.parts, global_scales=scales)
        return self.parts

    # --- one transfer --------------------------------------------------------------------------------

    def _start(self, loc: Loc, peer: int, state_slots: Optional[Loc] = None) -> KVTransfer:
        group = self.group
        rank = check_peer(peer, group, "dst" if self._role == SENDER else "src")
        check_backend(group, self.device)
        sender, receiver = (rank, peer) if self._role == SENDER else (peer, rank)
        where = f"kvpool transfer rank {sender} -> rank {receiver}"
        role = "sender" if self._role == SENDER else "receiver"
        loc_host, problem = check_slots(loc, self._rows, where, role)
        states_host, state_problem = self._check_states(state_slots, where, role)
        problem = problem or state_problem
        tokens = 0 if loc_host is None else loc_host.shape[0]
        states = 0 if states_host is None else states_host.shape[0]
        compute = torch.cuda.current_stream(self.device) if self._cuda else None
        expected = self.link.expected_pair(peer) if self._role == SENDER and problem is None else None
        if expected is not None:  # its slots and ready event, before the header leaves (ipc.py)
            self._prepare(expected, compute, loc_host, states_host)  # type: ignore[arg-type]
        mine = make_header(
            self._role, rank, self.header_parts(), self.head_start, self.total_heads, tokens, self.chunk_bytes,
            layer_ids=self.layer_ids, state=self.state, states=states, link=self.link.fields(peer),
        )  # fmt: skip
        if problem is not None:
            mine = mine.with_error(problem)
        encoded = mine.to_bytes()
        store = _default_store()
        theirs, spent_key = exchange(store, encoded, mine, rank, peer, group, self._peer_headers.get(peer))
        self._peer_headers[peer] = theirs
        self.link.expected[peer] = theirs.ep_id
        try:
            # Both ranks judge the headers as they travelled (a long message is cut the same way on both).
            ours = Header.from_bytes(encoded)
            verdict = agree(ours, theirs)
            if isinstance(verdict, Refusal):
                raise verdict.exception()
            if loc_host is None:  # unreachable: a rank with a loc problem refuses through the verdict
                raise RuntimeError(f"{where}: the handshake agreed although this rank's loc was rejected")
            path, reason = link_route(ours, theirs)
            pair = self.link.pairs.get(theirs.ep_id)
            if path == SETUP:
                pair = self._setup(store, spent_key.rsplit("/", 1)[0] + "/", theirs, peer, compute, loc_host, states_host)
                path, reason = (DIRECT, None) if pair.reason is None else ("staged", pair.reason)
            elif reason is None and path != DIRECT and pair is not None:
                reason = pair.reason  # the pair refused at setup
            if path == DIRECT:
                return self._move_direct(verdict, pair, theirs, loc_host, states_host, peer, compute)  # type: ignore[arg-type]
            return self._move(verdict, loc_host, states_host, peer, group, compute, reason)
        finally:
            release(store, spent_key)  # once the data movement is queued: the round trip overlaps the device's work

    def _check_states(
        self, state_slots: object, where: str, role: str
    ) -> tuple[Optional[torch.Tensor], Optional[Exception]]:
        if state_slots is None:
            return torch.empty(0, dtype=torch.int64), None
        if self.mamba is None:
            return None, ValueError(
                f"{where}: the {role}'s state_slots need a pool with linear-attention state (a HybridLinearKVPool "
                f"with a mamba_pool), got state_slots for a {type(self.pool).__name__}; nothing moved"
            )
        return check_slots(state_slots, self._state_rows, where, role, name="state_slots", pool="state pool")

    def _on_side(self) -> contextlib.AbstractContextManager:
        """Current device and stream for the data movement (nothing on CPU)."""
        if not self._cuda:
            return contextlib.nullcontext()
        return OnStream(self._side)

    def _tables_for(self, lo: int, hi: int) -> tuple[TokenLayout, RowTable, tuple[RowTable, RowTable]]:
        """The pool's table of local heads ``[lo, hi)`` and the staging halves (:meth:`Staging.kv_tables`)."""
        return self.staging.kv_tables(lo, hi)

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
        return self.staging.half(half, nbytes)

    def _upload(self, loc: torch.Tensor, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``loc`` and ``states`` in the index buffer (current stream: the side stream), from a
        contiguous pinned copy: the caller may change them once this returns, and a strided source
        would go through pageable memory (a possible host wait). The pinned block stays reserved
        until this copy has run (the caching host allocator records the stream)."""
        t, n = loc.shape[0], loc.shape[0] + states.shape[0]
        pinned = torch.empty(n, dtype=torch.int64, pin_memory=True)
        pinned[:t].copy_(loc)
        pinned[t:].copy_(states)
        self._index[:n].copy_(pinned, non_blocking=True)
        return self._index[:t], self._index[t:n]

    def _move(
        self, agreed: Agreement, loc: torch.Tensor, states: torch.Tensor, peer: int,
        group: Optional[dist.ProcessGroup], compute: Optional[torch.cuda.Stream], reason: Optional[str],
    ) -> KVTransfer:  # fmt: skip
        """The staged path."""
        role = "sender" if self._role == SENDER else "receiver"
        heads = (agreed.head_lo, agreed.head_hi)
        if agreed.tokens == 0 and agreed.states == 0:
            return KVTransfer(role, peer, 0, heads, 0, 0, self.device, path_reason=reason)
        with self._on_side():
            lo, hi = agreed.head_lo - self.head_start, agreed.head_hi - self.head_start  # local head numbers
            layout, pool_table, stages = self._tables_for(lo, hi)
            plan = chunk_plan(agreed.tokens, agreed.chunk_bytes // layout.token_bytes) if agreed.tokens else []
            index, state_index = (loc, states) if not self._cuda else self._upload(loc, states)
            state: list[Chunk] = []
            if agreed.states:
                spans = self.staging.state_spans(agreed.state)  # type: ignore[arg-type]
                state = self.staging.state_chunks(spans, agreed.states, state_index, agreed.chunk_bytes)
            route = Route(plan, index, layout, pool_table, stages, peer, group, compute, tuple(state))
            self._pipeline(route)
            done = None
            if self._cuda:
                done = torch.cuda.Event()
                done.record(self._side)
        state_nbytes = sum(c.nbytes for c in state)
        return KVTransfer(
            role, peer, agreed.tokens, heads, agreed.tokens * layout.token_bytes + state_nbytes, len(plan) + len(state),
            self.device, done, states=agreed.states, state_nbytes=state_nbytes, path_reason=reason,
        )  # fmt: skip

    def _pipeline(self, route: Route) -> None:
        """Move the rows of ``route``'s chunks."""
        raise NotImplementedError

    # --- the direct path (kvpool.transfer.ipc) ---------------------------------------------------------

    def _prepare(self, pair: SendPair, compute: torch.cuda.Stream, loc: torch.Tensor, states: torch.Tensor) -> None:
        with self._on_side():
            self._caller_mark.order(self._side, compute)  # the receiver reads what was written before send
            pair.prepare(self._side, torch.cat((loc, states)))

    def _setup(
        self, store: dist.Store, prefix: str, theirs: Header, peer: int, compute: torch.cuda.Stream,
        loc: torch.Tensor, states: torch.Tensor,
    ) -> SendPair | RecvPair:  # fmt: skip
        """Set up the direct path with the peer's endpoint (this transfer's first)."""
        pair: SendPair | RecvPair
        with torch.cuda.device(self.device):  # the events and their handles are made on this device
            if self._role == SENDER:
                pair = SendPair(theirs.ep_id, self._side, self._rows + self._state_rows)
                self._prepare(pair, compute, loc, states)
                exported: dict[str, object] = {"kv": self.parts.views(0, self.parts.head_num)}
                if self.mamba is not None:
                    exported.update(conv=list(self.mamba.conv), temporal=self.mamba.temporal)
                sender_setup(store, prefix, pair, exported, self.device)
            else:
                pair = RecvPair(theirs.ep_id)
                receiver_setup(store, prefix, pair, self.device)
        self.link.add(peer, pair)
        return pair

    def _move_direct(
        self, agreed: Agreement, pair: SendPair | RecvPair, theirs: Header, loc: torch.Tensor,
        states: torch.Tensor, peer: int, compute: torch.cuda.Stream,
    ) -> KVTransfer:  # fmt: skip
        """The direct path: the receiver copies from the sender's buffers in one launch per kind."""
        role = "sender" if self._role == SENDER else "receiver"
        heads, tokens, n_states = (agreed.head_lo, agreed.head_hi), agreed.tokens, agreed.states
        layout = self.parts.layout(heads[1] - heads[0])
        spans = self.staging.state_spans(agreed.state) if n_states else ()  # type: ignore[arg-type]
        state_nbytes = n_states * sum(n for _, _, n in spans) * (self.mamba.num_mamba_layers if n_states else 0)  # type: ignore[union-attr]
        nbytes, chunks = tokens * layout.token_bytes + state_nbytes, (tokens > 0) + (n_states > 0)
        info = dict(states=n_states, state_nbytes=state_nbytes, path=DIRECT)
        if chunks == 0:
            return KVTransfer(role, peer, 0, heads, 0, 0, self.device, **info)  # type: ignore[arg-type]
        k = pair.count
        pair.count += 1
        if isinstance(pair, SendPair):
            done = PeerDone(pair.counter, k + 1, pair.done[k % 2])  # type: ignore[arg-type]
            return KVTransfer(role, peer, tokens, heads, nbytes, chunks, self.device, peer_done=done, **info)  # type: ignore[arg-type]
        with self._on_side():
            self._caller_mark.order(self._side, compute)  # the copies overwrite slots the caller's work may read
            index, state_index = self._upload(loc, states)
            self._side.wait_event(pair.ready[k % 2])  # the sender's rows and slots are written
            src_index = pair.remote["index"][k % 2]  # type: ignore[index]
            if tokens:
                src = remote_kv_table(pair, heads[0] - theirs.head_start, heads[1] - theirs.head_start)
                dst = self._tables_for(heads[0] - self.head_start, heads[1] - self.head_start)[1]
                launch_copy_rows(dst, index, src, src_index[:tokens], max_programs=self._alone_programs)
            if n_states:
                src = remote_state_table(pair, band_spans(StateSide.from_header(theirs), agreed.state))  # type: ignore[arg-type]
                dst = self.staging.state_table(spans)  # type: ignore[arg-type]
                launch_copy_rows(dst, state_index, src, src_index[tokens : tokens + n_states],
                                 max_programs=self._alone_programs)  # fmt: skip
            pair.done[k % 2].record(self._side)
        pair.counter.post()  # type: ignore[union-attr]
        return KVTransfer(role, peer, tokens, heads, nbytes, chunks, self.device, pair.done[k % 2], **info)  # type: ignore[arg-type]


def kept_endpoint(cls: type, pool: AnyPool, group: Optional[dist.ProcessGroup], **options: object) -> Endpoint:
    """The endpoint kept for ``pool``, ``group`` and ``options``. Kept on the pool object itself, so
    it lives and dies with the pool (a table keyed by pool would keep every pool alive, since each
    endpoint refers to its pool)."""
    check_pool(pool)
    kept: dict = pool.__dict__.setdefault("_transfer_endpoints", {})
    key = (cls, group, tuple(sorted(options.items())))
    ep = kept.get(key)
    if ep is None:
        ep = kept[key] = cls(pool, group, **options)
    return ep
