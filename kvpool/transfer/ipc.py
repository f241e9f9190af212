"""Direct transfers on one node: the receiver reads the sender's rows through CUDA IPC, no staging.

Once per pair of endpoints (the first transfer between them whose headers both offer it, on one
host), the ranks set the path up through the store, in three messages: the sender's *offer* (CUDA
IPC handles of its pool buffers, made with ``torch.multiprocessing.reductions.reduce_tensor``, of an
index buffer of its own, and of two interprocess "ready" events), the receiver's *answer* (it
opened them, or why not: the sender's GPU not visible, numbered differently, peer access off; and
the handles of two "done" events of its own), and the sender's *final* word. Both then hold the same
verdict for the pair, so every later transfer between them takes the same path on both ranks.

A direct transfer ``k`` of the pair (both ranks count them):

* the sender, before its header leaves, queues on its side stream (after the caller's work so far,
  and after the receiver's done event of transfer ``k - 2``, which last read this index half) the
  upload of its slots into index half ``k % 2`` and records ready event ``k % 2``. The header leaves
  after that record, so the receiver's wait below always finds this transfer's record; and the
  receiver waited on transfer ``k - 2``'s record before its header of transfer ``k - 1`` came.
* the receiver, after the handshake, makes its side stream wait for the caller's work and for ready
  event ``k % 2``, launches the row copy from the sender's buffers (addressed through the opened
  handles) into its own slots, once for the KV rows and once for the states, records done event
  ``k % 2`` and counts the transfer in a store counter of the pair.
* the sender's handle waits (on the host) until that counter shows transfer ``k``, then makes the
  caller's stream wait for done event ``k % 2``: the slots may be reused only after the reads.

docs/contract.md, "KV transfer between ranks", says what decides the path and how to see it.
"""

from __future__ import annotations

import functools
import hashlib
import pickle
import secrets
import socket
import sys
import time
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

from kvpool.kernels.row_table import RowTable
from kvpool.streams import OnStream
from kvpool.transfer.handshake import (
    IPC_CPU,
    IPC_DISABLED,
    IPC_NO_KERNEL,
    IPC_OFFERED,
    IPC_UNSUPPORTED,
    PEER_NONE,
    PEER_READY,
    PEER_REFUSED,
)
from kvpool.transfer.state_wire import band_views

#: Sender endpoints a receiver keeps open per peer rank (a sender that rebuilds its endpoint gets a new id).
KEEP_PER_RANK = 4


@functools.lru_cache(maxsize=1)
def host_id() -> int:
    """This machine, as a 62-bit number: the host name and the kernel's boot id (two containers on
    one host with different names count as two hosts: their processes may not share CUDA IPC)."""
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        pass
    digest = hashlib.blake2b(f"{socket.gethostname()}/{boot}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def offer_code(device: torch.device, enabled: bool, kernel: bool) -> int:
    """What an endpoint on ``device`` offers (``IPC_OFFERED``) or why it cannot."""
    if device.type != "cuda":
        return IPC_CPU
    if not enabled:
        return IPC_DISABLED
    if not kernel:
        return IPC_NO_KERNEL
    if not sys.platform.startswith("linux") or getattr(torch.version, "hip", None):
        return IPC_UNSUPPORTED
    return IPC_OFFERED


def device_uuid(index: int) -> str:
    """The UUID of this process's CUDA device ``index`` (the same GPU has the same UUID in every
    process, whatever its index there)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def local_index(uuid: str) -> Optional[int]:
    """This process's index of the GPU with ``uuid``, or None if it does not see it."""
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return i
    return None


def store_timeout_s(store: dist.Store) -> float:
    """The store's timeout in seconds (300 when the store has none): how long a rank waits for its
    peer."""
    timeout = getattr(store, "timeout", None)
    return timeout.total_seconds() if isinstance(timeout, timedelta) else 300.0


class Counter:
    """A count in the store that one rank raises and the other reads (no key is ever deleted)."""

    __slots__ = ("store", "key", "seen", "timeout_s")

    def __init__(self, store: dist.Store, key: str) -> None:
        self.store, self.key, self.seen, self.timeout_s = store, key, 0, store_timeout_s(store)

    def post(self) -> None:
        """Raise the count by one; ``seen`` becomes the new count."""
        self.seen = self.store.add(self.key, 1)

    def read(self) -> int:
        """The count now (one store call), never below ``seen``."""
        self.seen = max(self.seen, self.store.add(self.key, 0))
        return self.seen


class PeerDone:
    """The receiver's done event of one direct transfer, as the sender's handle waits for it."""

    __slots__ = ("counter", "target", "event")

    def __init__(self, counter: Counter, target: int, event: torch.cuda.Event) -> None:
        self.counter, self.target, self.event = counter, target, event

    def known(self) -> bool:
        """Whether the receiver has recorded ``event`` for this transfer (its count reached ``target``);
        a store call until it has, never blocks."""
        return self.counter.seen >= self.target or self.counter.read() >= self.target

    def wait_known(self) -> None:
        """Block the host until :meth:`known`, polling the store; ``RuntimeError`` after the store's
        timeout."""
        deadline, pause = time.monotonic() + self.counter.timeout_s, 20e-6
        while not self.known():
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"kvpool transfer: the receiver did not queue its reads of a direct transfer within the "
                    f"store's timeout ({self.counter.timeout_s:.0f} s); the sender's slots may still be read"
                )
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)


class SendPair:
    """The sender's side of a direct path to one receiver endpoint."""

    def __init__(self, peer_ep: int, side: torch.cuda.Stream, capacity: int) -> None:
        self.peer_ep, self.status, self.reason, self.count = peer_ep, PEER_NONE, None, 0
        self.ready = [torch.cuda.Event(interprocess=True) for _ in range(2)]
        self.done: list[torch.cuda.Event] = []  # the receiver's, opened here
        # Per half: the KV slots, then the state slots; the side stream's allocation, written there only.
        with OnStream(side):
            self.index = torch.empty((2, capacity), dtype=torch.int64, device=side.device)
        self.counter: Optional[Counter] = None

    def prepare(self, side: torch.cuda.Stream, slots: torch.Tensor) -> None:
        """Queue (current stream: ``side``) the upload of ``slots`` (CPU int64: the KV slots, then
        the state slots) into this transfer's index half and the record of its ready event."""
        k = self.count
        if k >= 2:
            side.wait_event(self.done[k % 2])  # transfer k - 2's reads of this half are done
        if slots.numel():
            pinned = torch.empty(slots.shape[0], dtype=torch.int64, pin_memory=True).copy_(slots)
            self.index[k % 2, : slots.shape[0]].copy_(pinned, non_blocking=True)
        self.ready[k % 2].record(side)


class RecvPair:
    """The receiver's side of a direct path from one sender endpoint: the opened buffers and events."""

    def __init__(self, peer_ep: int) -> None:
        self.peer_ep, self.status, self.reason, self.count = peer_ep, PEER_NONE, None, 0
        self.done = [torch.cuda.Event(interprocess=True) for _ in range(2)]
        self.ready: list[torch.cuda.Event] = []  # the sender's, opened here
        self.remote: dict[str, object] = {}  # the sender's tensors: "kv" list, "conv" list, "temporal", "index"
        self.tables: dict[object, object] = {}  # RowTables over the remote buffers, per head range or spans
        self.counter: Optional[Counter] = None


def _refused(reason: str) -> bytes:
    return pickle.dumps({"refused": reason})


def _take(store: dist.Store, key: str) -> dict:
    """The message under ``key`` (waiting for it up to the store's timeout), deleted once read."""
    try:
        raw = store.get(key)
    except dist.DistStoreError:
        raise RuntimeError(
            "kvpool transfer: the peer did not complete the direct-path setup within the store's timeout; "
            "nothing moved"
        ) from None
    store.delete_key(key)
    return pickle.loads(raw)


def _enable_peer_access(local: int, remote: int) -> None:
    """Let kernels on ``local`` read ``remote``'s memory: torch enables peer access from a copy's
    source device to its destination device the first time it copies between them."""
    torch.empty(1, device=f"cuda:{remote}").copy_(torch.empty(1, device=f"cuda:{local}"))


def sender_setup(
    store: dist.Store, prefix: str, pair: SendPair, exported: dict[str, object], device: torch.device
) -> None:
    """The sender's three messages (``pair.prepare`` has run for this transfer; ``device`` is the
    current device): sets ``pair.status`` to ``PEER_READY`` or ``PEER_REFUSED`` (with ``pair.reason``)."""
    try:
        tensors = {name: ([reduce_tensor(t) for t in value] if isinstance(value, list) else reduce_tensor(value))
                   for name, value in {**exported, "index": pair.index}.items()}  # fmt: skip
        offer = pickle.dumps({"uuid": device_uuid(device.index), "index": device.index, "tensors": tensors,
                              "ready": [e.ipc_handle() for e in pair.ready]})  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - any failure to export means the staged path
        offer = _refused(f"the sender could not export its buffers ({type(exc).__name__}: {exc})")
    store.set(prefix + "ipc/offer", offer)
    answer = _take(store, prefix + "ipc/answer")
    reason = answer.get("refused")
    if reason is None:
        try:
            index = local_index(answer["uuid"])
            if index != answer["index"]:
                raise RuntimeError("the two processes number their GPUs differently")
            pair.done = [torch.cuda.Event.from_ipc_handle(torch.device("cuda", index), h) for h in answer["done"]]
            pair.counter = Counter(store, prefix + "ipc/done")
        except Exception as exc:  # noqa: BLE001
            reason = f"the sender could not open the receiver's events ({type(exc).__name__}: {exc})"
    store.set(prefix + "ipc/final", pickle.dumps({"refused": reason}))
    pair.status, pair.reason = (PEER_READY, None) if reason is None else (PEER_REFUSED, reason)


def receiver_setup(store: dist.Store, prefix: str, pair: RecvPair, device: torch.device) -> None:
    """The receiver's side of :func:`sender_setup` (``device`` is the current device, where the done
    events are made)."""
    offer = _take(store, prefix + "ipc/offer")
    reason = offer.get("refused")
    if reason is None:
        try:
            reason = _open(offer, pair, device.index)
        except Exception as exc:  # noqa: BLE001 - any failure to open means the staged path
            reason = f"the receiver could not open the sender's buffers ({type(exc).__name__}: {exc})"
    if reason is None:
        answer = pickle.dumps({"uuid": device_uuid(device.index), "index": device.index,
                               "done": [e.ipc_handle() for e in pair.done]})  # fmt: skip
    else:
        answer = _refused(reason)
    store.set(prefix + "ipc/answer", answer)
    final = _take(store, prefix + "ipc/final")
    reason = reason or final.get("refused")
    if reason is None:
        pair.counter = Counter(store, prefix + "ipc/done")
    pair.status, pair.reason = (PEER_READY, None) if reason is None else (PEER_REFUSED, reason)


def _open(offer: dict, pair: RecvPair, local: int) -> Optional[str]:
    """Open the sender's buffers and events into ``pair``; the reason it cannot, or None."""
    remote = local_index(offer["uuid"])
    if remote is None:
        return f"the sender's GPU ({offer['uuid']}) is not visible to the receiver's process"
    if remote != offer["index"]:
        return f"the two processes number their GPUs differently (the sender's cuda:{offer['index']} is cuda:{remote} here)"
    if remote != local:
        if not torch.cuda.can_device_access_peer(local, remote):
            return f"peer access from cuda:{local} to cuda:{remote} is not available"
        _enable_peer_access(local, remote)
    for name, value in offer["tensors"].items():
        pair.remote[name] = [fn(*args) for fn, args in value] if isinstance(value, list) else value[0](*value[1])
    pair.ready = [torch.cuda.Event.from_ipc_handle(torch.device("cuda", remote), h) for h in offer["ready"]]
    return None

def remote_kv_table(pair: RecvPair, lo: int, hi: int) -> RowTable:
    """The sender's heads ``[lo, hi)`` (its local numbers) of every layer's K and V, through the
    opened handles: built once per head range, with a synchronous copy of the address table (it
    lives on the sender's device, whose streams do not order this endpoint's)."""
    key = ("kv", lo, hi)
    table = pair.tables.get(key)
    if table is None:
        table = pair.tables[key] = RowTable.of([b[:, lo:hi] for b in pair.remote["kv"]])  # type: ignore[union-attr]
    return table  # type: ignore[return-value]


def remote_state_table(pair: RecvPair, spans: list[tuple[int, int, int]]) -> RowTable:
    """The sender's state bands ``spans`` (its own spans) of every linear layer, as above."""
    key = ("state", tuple(spans))
    table = pair.tables.get(key)
    if table is None:
        views = band_views(pair.remote["conv"], pair.remote["temporal"], spans)  # type: ignore[arg-type]
        table = pair.tables[key] = RowTable.of(views)
    return table  # type: ignore[return-value]


class DirectLink:
    """An endpoint's direct paths: what it offers, the peer endpoint each peer rank last showed, and
    the pair it holds with each peer endpoint (the last ``KEEP_PER_RANK`` per peer rank)."""

    def __init__(self, offer: int) -> None:
        self.ep_id = secrets.randbits(62) | 1
        self.offer = offer
        self.pairs: dict[int, SendPair | RecvPair] = {}
        self.expected: dict[int, int] = {}  # peer rank -> the endpoint id in its last header
        self._by_rank: dict[int, list[int]] = {}
        self._retired: list[SendPair | RecvPair] = []

    def fields(self, peer: int) -> dict[str, int]:
        """The header's direct-path fields for a transfer with rank ``peer``."""
        ep = self.expected.get(peer, 0)
        pair = self.pairs.get(ep)
        status = PEER_NONE if pair is None else pair.status
        return dict(ep_id=self.ep_id, ipc=self.offer, host_id=host_id(), peer_ep=ep if status else 0, peer_ipc=status)

    def expected_pair(self, peer: int) -> Optional[SendPair | RecvPair]:
        """The open pair with the endpoint rank ``peer`` showed last, if any."""
        pair = self.pairs.get(self.expected.get(peer, 0))
        return pair if pair is not None and pair.status == PEER_READY else None

    def add(self, peer: int, pair: SendPair | RecvPair) -> None:
        """Keep ``pair`` (replacing an older pair with the same endpoint); pairs dropped stay referenced
        until the reads they may still serve are done."""
        self._retired = [p for p in self._retired if not all(e.query() for e in p.done)]
        old = self.pairs.pop(pair.peer_ep, None)
        order = [ep for ep in self._by_rank.setdefault(peer, []) if ep != pair.peer_ep] + [pair.peer_ep]
        while len(order) > KEEP_PER_RANK:
            dropped = self.pairs.pop(order.pop(0), None)
            if dropped is not None:
                self._retired.append(dropped)
        if old is not None and old is not pair:
            self._retired.append(old)
        self._by_rank[peer] = order
        self.pairs[pair.peer_ep] = pair
