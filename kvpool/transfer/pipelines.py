"""``KVSender`` and ``KVReceiver``: the two ends of a transfer, each the endpoint's handshake plus its
half of the pipeline, and ``send_kv``/``recv_kv`` with one endpoint kept per pool.

The sender gathers a chunk of rows from every layer into a staging half with one row-copy launch,
sends it, and gathers the next chunk into the other half while the first is in flight; the receiver
receives into one half while it scatters the other into its pool (:mod:`kvpool.transfer.endpoint`
has the whole sequence; docs/contract.md, "KV transfer between ranks", the rules users rely on).
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from kvpool.pools.mha_pool import MHATokenToKVPool
from kvpool.transfer.endpoint import Endpoint, KVTransfer, Loc, Route, kept_endpoint
from kvpool.transfer.handshake import RECEIVER, SENDER


class KVSender(Endpoint):
    """Sends requests' KV rows from ``pool`` to receivers on other ranks of ``group``.

    Parameters
    ----------
    pool : MHATokenToKVPool or MLATokenToKVPool
        The pool the rows are read from (CUDA with an NCCL group, CPU with gloo).
    group : the process group (default: the world group). The caller initialises torch.distributed.
    head_start, total_heads : the pool holds the global KV heads ``[head_start, head_start +
        pool.head_num)`` of a model with ``total_heads`` (default ``pool.head_num``). A transfer moves
        the heads both sides hold, so a sender holding all heads serves receivers that each hold a
        tensor-parallel slice, and a receiver holding all heads takes one slice from each sender.
    chunk_bytes : bytes per staging half (default 512 MiB on CUDA, 4 MiB on CPU, or the whole pool's
        rows if that is less; at least one token).
        The smaller of the two sides' values bounds the chunks of a transfer.
    max_programs : cap on the programs of a gather or scatter launch (default on CUDA:
        ``default_max_programs`` (32 programs), leaving room for the transport's kernel; the
        pipeline's first gather and last scatter, which run alone, then take the whole GPU). A value
        given here caps every gather and scatter.

    Examples
    --------
    Prefill rank 0 sends a finished request to decode rank 1 (both called ``init_process_group``)::

        sender = KVSender(pool)                           # once
        handle = sender.send(loc_cpu, dst=1)              # loc_cpu: the request's slots, host int tensor
        handle.wait()                                     # before the slots are freed and reused
    """

    _role = SENDER

    def send(self, loc: Loc, dst: int) -> KVTransfer:
        """Send, for every layer, the K and V rows ``loc`` of the pool to rank ``dst``, which calls
        ``recv`` with its own slots (as many as ``loc`` has).

        Parameters
        ----------
        loc : CPU tensor or numpy array [T], int32/int64: the request's slots in this pool.
        dst : global rank of the receiver.

        Returns
        -------
        KVTransfer. On CUDA the rows are still moving; call ``wait()`` before the caller's stream
        overwrites or frees the slots. On CPU it is complete.

        Raises
        ------
        ValueError, IndexError, TypeError
            After the handshake, on both ranks alike, if the two pools or token counts disagree or
            either side's ``loc`` is bad; nothing has moved.
        ValueError, TypeError, RuntimeError
            At once, on this rank only, if ``dst`` or the process group cannot be used (nothing is
            started: the peer's pending call pairs with this rank's next transfer with it).
        RuntimeError
            If the peer does not start its side within the store's timeout (this rank withdraws; the
            peer's call for this transfer raises too when it comes).
        """
        return self._start(loc, dst)

    def _pipeline(self, route: Route) -> None:
        plan, index, stages, peer, group = route.plan, route.index, route.stages, route.peer, route.group
        if route.compute is not None:
            self._caller_mark.order(self._side, route.compute)  # gathers read what was written before send
        in_flight: list[Optional[dist.Work]] = [None, None]  # the send reading each staging half
        for k, (start, count) in enumerate(plan):
            half = k & 1
            if in_flight[half] is not None:
                in_flight[half].wait()  # type: ignore[union-attr]
            rows = index[start : start + count]
            self._copy(stages[half], self._arange[:count], route.pool_table, rows, alone=k == 0)
            in_flight[half] = dist.isend(self._staged(half, count * route.layout.token_bytes), peer, group=group)
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

    def recv(self, loc: Loc, src: int) -> KVTransfer:
        """Receive, for every layer, K and V rows from rank ``src`` into rows ``loc`` of the pool.

        Parameters
        ----------
        loc : CPU tensor or numpy array [T], int32/int64: this pool's slots for the request, in the
            order of the sender's ``loc`` (token ``t`` lands in ``loc[t]``). If a slot appears twice,
            which token it ends up holding is unspecified.
        src : global rank of the sender.

        Returns
        -------
        KVTransfer. On CUDA call ``wait()`` before the caller's stream reads the slots.

        Raises
        ------
        As :meth:`KVSender.send`.
        """
        return self._start(loc, src)

    def _pipeline(self, route: Route) -> None:
        plan, index, stages, peer, group = route.plan, route.index, route.stages, route.peer, route.group
        works: dict[int, dist.Work] = {}

        def post(k: int) -> None:
            works[k] = dist.irecv(self._staged(k & 1, plan[k][1] * route.layout.token_bytes), peer, group=group)

        for k in range(min(2, len(plan))):
            post(k)
        if route.compute is not None:
            # Scatters overwrite slots that work queued before recv may still read; the first two
            # chunks are already on their way meanwhile.
            self._caller_mark.order(self._side, route.compute)
        for k, (start, count) in enumerate(plan):
            works.pop(k).wait()
            rows = index[start : start + count]
            self._copy(route.pool_table, rows, stages[k & 1], self._arange[:count], alone=k == len(plan) - 1)
            if k + 2 < len(plan):
                post(k + 2)  # on CUDA the receive is ordered after this scatter (it reads that half)


# --- functions with one endpoint per pool ---------------------------------------------------------------

def send_kv(
    pool: MHATokenToKVPool,
    loc: Loc,
    dst: int,
    group: Optional[dist.ProcessGroup] = None,
    *,
    head_start: int = 0,
    total_heads: Optional[int] = None,
    chunk_bytes: Optional[int] = None,
) -> KVTransfer:
    """Send the K/V rows ``loc`` of every layer of ``pool`` to rank ``dst``: ``KVSender(pool, group,
    ...).send(loc, dst)`` with one sender kept per pool and settings (its staging is allocated once).

    >>> handle = send_kv(pool, loc_cpu, dst=1)   # doctest: +SKIP
    >>> handle.wait()                            # doctest: +SKIP
    """
    ep = kept_endpoint(KVSender, pool, group, head_start=head_start, total_heads=total_heads, chunk_bytes=chunk_bytes)
    return ep.send(loc, dst)  # type: ignore[attr-defined]


def recv_kv(
    pool: MHATokenToKVPool,
    loc: Loc,
    src: int,
    group: Optional[dist.ProcessGroup] = None,
    *,
    head_start: int = 0,
    total_heads: Optional[int] = None,
    chunk_bytes: Optional[int] = None,
) -> KVTransfer:
    """Receive K/V rows from rank ``src`` into rows ``loc`` of every layer of ``pool``: ``KVReceiver(
    pool, group, ...).recv(loc, src)`` with one receiver kept per pool and settings."""
    ep = kept_endpoint(KVReceiver, pool, group, head_start=head_start, total_heads=total_heads, chunk_bytes=chunk_bytes)
    return ep.recv(loc, src)  # type: ignore[attr-defined]
