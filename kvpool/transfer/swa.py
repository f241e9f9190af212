"""``SWAKVSender`` and ``SWAKVReceiver``: a request's rows of both parts of an ``SWAKVPool`` moved
between ranks (docs/contract.md, "KV transfer between ranks", "Sliding-window models").

Each is two ordinary endpoints, one per part (``KVSender``/``KVReceiver`` over ``full_kv_pool`` and
over ``swa_kv_pool``), so each part moves as any MHA pool does: staged or direct, re-sharded by
heads, with its own handshake. The full part moves the rows of ``loc``; the SWA part the rows of the
SWA slots each rank's own mapping gives its ``loc`` (or the SWA slots the caller names). Before
either part moves, the ranks swap one more header, the SWA part's, so that a transfer either part
would refuse is refused by both ranks with nothing moved.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from kvpool.pools.swa_pool import SWAKVPool, translate_slots
from kvpool.transfer.arguments import Loc, check_backend, check_peer, check_slots, default_store
from kvpool.transfer.exchange import exchange, release
from kvpool.transfer.handle import KVPoll, KVTransfer
from kvpool.transfer.handshake import RECEIVER, SENDER, Header, Refusal, agree, make_header
from kvpool.transfer.pipelines import KVReceiver, KVSender


class SWAKVTransfer:
    """Handle of one SWA transfer: ``full`` and ``swa``, the parts' ``KVTransfer``.

    Attributes
    ----------
    role, peer, tokens, path, path_reason : the full part's (``tokens``: full slots moved).
    swa_tokens : SWA slots moved.
    nbytes : bytes of both parts.
    """

    def __init__(self, full: KVTransfer, swa: KVTransfer) -> None:
        self.full, self.swa = full, swa
        self.role, self.peer, self.tokens, self.swa_tokens = full.role, full.peer, full.tokens, swa.tokens
        self.nbytes, self.path, self.path_reason = full.nbytes + swa.nbytes, full.path, full.path_reason

    def is_completed(self) -> bool:
        """True once both parts have moved (never blocks)."""
        return self.full.is_completed() and self.swa.is_completed()

    def poll(self) -> KVPoll:
        """``KVPoll.Success`` once both parts completed, else ``KVPoll.Transferring``."""
        return KVPoll.Success if self.is_completed() else KVPoll.Transferring

    def wait(self) -> None:
        """The caller's current stream waits for both parts (``KVTransfer.wait`` of each)."""
        self.full.wait()
        self.swa.wait()

    def __repr__(self) -> str:
        return f"SWAKVTransfer(full={self.full!r}, swa={self.swa!r})"


class _SWAEndpoint:
    """What an SWA sender and receiver share: the two part endpoints and the SWA part's pre-handshake."""

    _role = 0
    _part: type = KVSender

    def __init__(
        self,
        pool: SWAKVPool,
        group: Optional[dist.ProcessGroup] = None,
        *,
        head_start: int = 0,
        total_heads: Optional[int] = None,
        swa_head_start: Optional[int] = None,
        swa_total_heads: Optional[int] = None,
        chunk_bytes: Optional[int] = None,
        max_programs: Optional[int] = None,
        ipc: bool = True,
    ) -> None:
        if not isinstance(pool, SWAKVPool):
            raise TypeError(f"pool must be an SWAKVPool, got {type(pool).__name__}")
        self.pool, self.group = pool, group
        full, swa = pool.full_kv_pool, pool.swa_kv_pool
        same = swa.head_num == full.head_num  # the SWA part shards as the full part unless told otherwise
        self.swa_head_start = swa_head_start if swa_head_start is not None else (head_start if same else 0)
        swa_total = swa_total_heads if swa_total_heads is not None else (total_heads if same else None)
        options = dict(chunk_bytes=chunk_bytes, max_programs=max_programs, ipc=ipc)
        self.full = self._part(full, group, head_start=head_start, total_heads=total_heads, **options)
        self.swa = self._part(swa, group, head_start=self.swa_head_start, total_heads=swa_total, **options)
        # The headers carry the model's global layer ids, so pools that split the layers differently refuse.
        self.full.layer_ids = tuple(pool.full_attention_layer_ids)
        self.swa.layer_ids = tuple(pool.swa_attention_layer_ids)

    def _swa_slots(self, loc_host: torch.Tensor, where: str, role: str):
        """The SWA slots of full slots ``loc_host`` through this rank's mapping (host indices), or the
        problem to report (no mapping, or a mapping entry outside the SWA pool). On CUDA the
        translation is read back from the device (one synchronisation)."""
        mapping = self.pool.full_to_swa_index_mapping
        if mapping is None:
            return None, ValueError(
                f"{where}: the {role}'s pool has no full-to-SWA mapping (call register_mapping first); nothing moved"
            )
        swa = translate_slots(mapping, loc_host.to(mapping.device)).cpu()
        rows = self.pool.swa_kv_pool.rows
        bad = ((swa < 0) | (swa >= rows)).nonzero()
        if bad.numel():  # a mapping entry no SWA slot has: refused before either part moves
            i = int(bad[0])
            return None, IndexError(
                f"{where}: the {role}'s loc[{i}] = {int(loc_host[i])} maps to SWA slot {int(swa[i])}, outside its "
                f"SWA pool's slots [0, {rows}) (its full-to-SWA mapping holds an entry out of range); nothing moved"
            )
        return swa, None

    def _start(self, loc: Loc, peer: int, swa_loc: Optional[Loc]) -> SWAKVTransfer:
        rank = check_peer(peer, self.group, "dst" if self._role == SENDER else "src")
        check_backend(self.group, self.pool.device)
        sender, receiver = (rank, peer) if self._role == SENDER else (peer, rank)
        where = f"kvpool transfer rank {sender} -> rank {receiver}"
        role = "sender" if self._role == SENDER else "receiver"
        swa = self.pool.swa_kv_pool
        loc_host, problem = check_slots(loc, self.pool.full_kv_pool.rows, where, role)
        swa_host = None
        if problem is None and swa_loc is None:
            swa_host, problem = self._swa_slots(loc_host, where, role)  # type: ignore[arg-type]
        elif problem is None:
            swa_host, problem = check_slots(swa_loc, swa.rows, where, role, name="swa_loc", pool="SWA pool")
        tokens = 0 if swa_host is None else swa_host.shape[0]
        ep = self.swa
        mine = make_header(self._role, rank, ep.header_parts(), ep.head_start, ep.total_heads, tokens, ep.chunk_bytes,
                           layer_ids=ep.layer_ids)  # fmt: skip
        if problem is not None:
            mine = mine.with_error(problem)
        encoded = mine.to_bytes()
        store = default_store()
        theirs, key = exchange(store, encoded, mine, rank, peer, self.group, None)
        release(store, key)
        verdict = agree(Header.from_bytes(encoded), theirs)
        if isinstance(verdict, Refusal):
            if mine.error_kind or theirs.error_kind:  # a rank's own argument, reported as it found it
                raise verdict.exception()
            where_, _, what = verdict.message.partition(": ")  # "kvpool transfer rank a -> rank b: ..."
            raise verdict.error(f"{where_}, sliding-window part: {what}")
        if self._role == SENDER:
            full_done = self.full.send(loc_host, peer)  # type: ignore[attr-defined]
            return SWAKVTransfer(full_done, self.swa.send(swa_host, peer))  # type: ignore[attr-defined]
        full_done = self.full.recv(loc_host, peer)  # type: ignore[attr-defined]
        return SWAKVTransfer(full_done, self.swa.recv(swa_host, peer))  # type: ignore[attr-defined]


class SWAKVSender(_SWAEndpoint):
    """Sends requests' rows of both parts of an ``SWAKVPool`` to ``SWAKVReceiver`` s on other ranks.

    Parameters
    ----------
    pool : SWAKVPool (a mapping registered; CUDA with an NCCL group, CPU with gloo).
    group, chunk_bytes, max_programs, ipc : as for ``KVSender``, for each part's endpoint.
    head_start, total_heads : the full part's heads, as for ``KVSender``.
    swa_head_start, swa_total_heads : the SWA part's; default the full part's values when both
        parts have as many heads, else the SWA part's own heads, whole.

    Examples
    --------
    >>> handle = SWAKVSender(pool).send(loc_cpu, dst=1)      # doctest: +SKIP
    >>> handle.wait()                                        # doctest: +SKIP
    """

    _role, _part = SENDER, KVSender

    def send(self, loc: Loc, dst: int, swa_loc: Optional[Loc] = None) -> SWAKVTransfer:
        """Send, for every full-attention layer, the rows ``loc`` (host indices, as ``KVSender.send``)
        and, for every sliding-window layer, the rows of the SWA slots this pool's mapping gives
        ``loc`` (``swa_loc``: those SWA slots named directly, host indices, e.g. only the last
        window's) to rank ``dst``, which calls ``recv`` with its own slots.

        Raises
        ------
        ValueError, IndexError, TypeError
            On both ranks alike, nothing moved: anything ``KVSender.send`` refuses, for either part
            (the SWA part's mismatches say "sliding-window part:"), a pool without a mapping, or
            a bad ``swa_loc``. Errors of the peer or the group raise at once on this rank only.
        """
        return self._start(loc, dst, swa_loc)


class SWAKVReceiver(_SWAEndpoint):
    """Receives requests' rows of both parts into an ``SWAKVPool``; parameters as for
    :class:`SWAKVSender`."""

    _role, _part = RECEIVER, KVReceiver

    def recv(self, loc: Loc, src: int, swa_loc: Optional[Loc] = None) -> SWAKVTransfer:
        """Receive the full rows into ``loc`` and the SWA rows into the SWA slots this pool's mapping
        gives ``loc`` (or into ``swa_loc``, as many as the sender's), from rank ``src``. A slot of
        ``loc`` with no SWA part receives its SWA rows in the SWA padding slot 0. Raises as
        :meth:`SWAKVSender.send`."""
        return self._start(loc, src, swa_loc)
