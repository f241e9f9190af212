"""``KVSender`` and ``KVReceiver``: the two ends of a transfer, each the endpoint's handshake and
direct path plus its half of the staged pipeline, and ``send_kv``/``recv_kv`` with one endpoint kept
per pool.

The sender gathers a chunk of rows from every layer into a staging half with one row-copy launch,
sends it, and gathers the next chunk into the other half while the first is in flight; the receiver
receives into one half while it scatters the other into its pools (:mod:`kvpool.transfer.endpoint`
has the whole sequence; docs/contract.md, "KV transfer between ranks", the rules users rely on).
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from kvpool.transfer.arguments import Loc
from kvpool.transfer.endpoint import AnyPool, Endpoint, Route, kept_endpoint
from kvpool.transfer.handle import KVTransfer
from kvpool.transfer.handshake import RECEIVER, SENDER
from kvpool.transfer.state_wire import StateShard


class KVSender(Endpoint):
    """Sends requests' KV rows (and, for hybrid models, their linear-attention states) from ``pool``
    to receivers on other ranks of ``group``.

    Parameters
    ----------
    pool : MHATokenToKVPool, MLATokenToKVPool, MHATokenToKVPoolFP4, MLATokenToKVPoolFP4,
        MHATokenToKVPoolFP8PerTokenHead or HybridLinearKVPool
        The pool the rows are read from (CUDA with an NCCL group, CPU with gloo), every part of each
        row (a pool that keeps scales beside its codes moves them too: ``kvpool.transfer.parts``). A
        ``HybridLinearKVPool`` moves its full-attention layers' rows and, given ``state_slots``, the
        states of its ``mamba_pool``.
    group : the process group (default: the world group). The caller initialises torch.distributed.
    head_start, total_heads : the pool holds the global KV heads ``[head_start, head_start +
        pool.head_num)`` of a model with ``total_heads`` (default ``pool.head_num``). A transfer moves
        the heads both sides hold, so a sender holding all heads serves receivers that each hold a
        tensor-parallel slice, and a receiver holding all heads takes one slice from each sender.
    chunk_bytes : bytes per staging half (default ``endpoint.TRANSFER_CHUNK_BYTES_CUDA`` on CUDA,
        ``TRANSFER_CHUNK_BYTES_CPU`` on CPU, or the whole pool's rows if that is less; at least one
        token).
        The smaller of the two sides' values bounds the chunks of a transfer.
    max_programs : cap on the programs of a gather or scatter launch (default on CUDA:
        ``default_max_programs``, the row copy's ``FEW_PROGRAMS`` grid, leaving room for the
        transport's kernel; the pipeline's first gather and last scatter, which run alone, then take the whole GPU). A value
        given here caps every gather and scatter, and the direct path's copy.
    state_shard : StateShard, the linear-attention heads the ``mamba_pool`` holds (tensor-parallel
        re-sharding of the state); None: the whole state, moved only between pools of one geometry.
    ipc : let transfers with a receiver on the same host read the rows directly (CUDA IPC) when both
        endpoints allow it and the machine does; False: always staged.

    Examples
    --------
    Prefill rank 0 sends a finished request to decode rank 1 (both called ``init_process_group``)::

        sender = KVSender(pool)                           # once
        handle = sender.send(loc_cpu, dst=1)              # loc_cpu: the request's slots, host int tensor
        handle.wait()                                     # before the slots are freed and reused
    """

    _role = SENDER

    def send(self, loc: Loc, dst: int, state_slots: Optional[Loc] = None) -> KVTransfer:
        """Send, for every layer, the K and V rows ``loc`` of the pool (with the scales stored beside
        them, for a pool that keeps them) to rank ``dst``, which calls
        ``recv`` with its own slots (as many as ``loc`` has), and the states of ``state_slots``.

        Parameters
        ----------
        loc : CPU tensor or numpy array [T], int32/int64: the request's slots in this pool.
        dst : global rank of the receiver.
        state_slots : CPU tensor or numpy array [R], int32/int64: the requests' slots in the
            ``mamba_pool`` (a ``HybridLinearKVPool``'s), in ``0..size``; None: no state moves.

        Returns
        -------
        KVTransfer. On CUDA the rows are still moving; call ``wait()`` before the caller's stream
        overwrites or frees the slots. On CPU it is complete.

        Raises
        ------
        ValueError, IndexError, TypeError
            After the handshake, on both ranks alike, if the two pools (dtype, row format, an NVFP4
            pool's global scales, layers, heads, head dims), token counts or state slot counts
            disagree or either side's ``loc`` or ``state_slots`` is bad; nothing has moved.
        ValueError, TypeError, RuntimeError
            At once, on this rank only, if ``dst`` or the process group cannot be used (nothing is
            started: the peer's pending call pairs with this rank's next transfer with it).
        RuntimeError
            If the peer does not start its side within the store's timeout (this rank withdraws; the
            peer's call for this transfer raises too when it comes).
        """
        return self._start(loc, dst, state_slots)

    def _pipeline(self, route: Route) -> None:
        peer, group = route.peer, route.group
        if route.compute is not None:
            self._caller_mark.order(self._side, route.compute)  # gathers read what was written before send
        in_flight: list[Optional[dist.Work]] = [None, None]  # the send reading each staging half
        for k, chunk in enumerate(route.chunks()):
            half = k & 1
            if in_flight[half] is not None:
                in_flight[half].wait()  # type: ignore[union-attr]
            self._copy(chunk.stages[half], self._arange[: chunk.count], chunk.pool, chunk.rows, alone=k == 0)
            in_flight[half] = dist.isend(self._staged(half, chunk.nbytes), peer, group=group)
        for work in in_flight:
            if work is not None:
                work.wait()


class KVReceiver(Endpoint):
    """Receives requests' KV rows into ``pool`` from senders on other ranks of ``group``.

    Parameters are as for :class:`KVSender`.

    Examples
    --------
    Decode rank 1 takes the request rank 0 sends::

        receiver = KVReceiver(pool)                       # once
        handle = receiver.recv(loc_cpu, src=0)            # loc_cpu: slots allocated for the request
        handle.wait()                                     # before attention reads them
    """

    _role = RECEIVER

    def recv(self, loc: Loc, src: int, state_slots: Optional[Loc] = None) -> KVTransfer:
        """Receive, for every layer, K and V rows from rank ``src`` into rows ``loc`` of the pool,
        and states into ``state_slots``.

        Parameters
        ----------
        loc : CPU tensor or numpy array [T], int32/int64: this pool's slots for the request, in the
            order of the sender's ``loc`` (token ``t`` lands in ``loc[t]``). If a slot appears twice,
            which token it ends up holding is unspecified.
        src : global rank of the sender.
        state_slots : CPU tensor or numpy array [R]: this ``mamba_pool``'s slots, in the order of
            the sender's ``state_slots``; None: no state moves.

        Returns
        -------
        KVTransfer. On CUDA call ``wait()`` before the caller's stream reads the slots.

        Raises
        ------
        As :meth:`KVSender.send`.
        """
        return self._start(loc, src, state_slots)

    def _pipeline(self, route: Route) -> None:
        peer, group = route.peer, route.group
        chunks = route.chunks()
        works: dict[int, dist.Work] = {}

        def post(k: int) -> None:
            works[k] = dist.irecv(self._staged(k & 1, chunks[k].nbytes), peer, group=group)

        for k in range(min(2, len(chunks))):
            post(k)
        if route.compute is not None:
            # Scatters overwrite slots that work queued before recv may still read; the first two
            # chunks are already on their way meanwhile.
            self._caller_mark.order(self._side, route.compute)
        for k, chunk in enumerate(chunks):
            works.pop(k).wait()
            self._copy(chunk.pool, chunk.rows, chunk.stages[k & 1], self._arange[: chunk.count], alone=k == len(chunks) - 1)
            if k + 2 < len(chunks):
                post(k + 2)  # on CUDA the receive is ordered after this scatter (it reads that half)


# --- functions with one endpoint per pool ---------------------------------------------------------------

def send_kv(
    pool: AnyPool,
    loc: Loc,
    dst: int,
    group: Optional[dist.ProcessGroup] = None,
    *,
    state_slots: Optional[Loc] = None,
    head_start: int = 0,
    total_heads: Optional[int] = None,
    chunk_bytes: Optional[int] = None,
    state_shard: Optional[StateShard] = None,
    ipc: bool = True,
) -> KVTransfer:
    """Send the K/V rows ``loc`` of every layer of ``pool`` (and the states ``state_slots``) to rank
    ``dst``: ``KVSender(pool, group, ...).send(loc, dst, state_slots)`` with one sender kept per pool
    and settings (its staging is allocated once).

    >>> handle = send_kv(pool, loc_cpu, dst=1)   # doctest: +SKIP
    >>> handle.wait()                            # doctest: +SKIP
    """
    ep = kept_endpoint(KVSender, pool, group, head_start=head_start, total_heads=total_heads,
                       chunk_bytes=chunk_bytes, state_shard=state_shard, ipc=ipc)  # fmt: skip
    return ep.send(loc, dst, state_slots)  # type: ignore[attr-defined]


def recv_kv(
    pool: AnyPool,
    loc: Loc,
    src: int,
    group: Optional[dist.ProcessGroup] = None,
    *,
    state_slots: Optional[Loc] = None,
    head_start: int = 0,
    total_heads: Optional[int] = None,
    chunk_bytes: Optional[int] = None,
    state_shard: Optional[StateShard] = None,
    ipc: bool = True,
) -> KVTransfer:
    """Receive K/V rows from rank ``src`` into rows ``loc`` of every layer of ``pool`` (and states
    into ``state_slots``): ``KVReceiver(pool, group, ...).recv(loc, src, state_slots)`` with one
    receiver kept per pool and settings."""
    ep = kept_endpoint(KVReceiver, pool, group, head_start=head_start, total_heads=total_heads,
                       chunk_bytes=chunk_bytes, state_shard=state_shard, ipc=ipc)  # fmt: skip
    return ep.recv(loc, src, state_slots)  # type: ignore[attr-defined]
