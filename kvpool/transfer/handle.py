"""The handle of one started transfer (``KVTransfer``) and its state (``KVPoll``). docs/contract.md,
"KV transfer between ranks", has the rules users rely on."""

from __future__ import annotations

import enum
from typing import Optional, Protocol

import torch


class KVPoll(enum.IntEnum):
    """State of a transfer, numbered as SGLang's ``KVPoll`` so scheduler code comparing against those
    values carries over. A transfer that starts has passed its handshake, so only these two occur."""

    Transferring = 3
    Success = 4


class PeerDone(Protocol):
    """The peer's end of a direct transfer, as its sender's handle sees it: an event the peer
    records once its reads are queued, and whether that record has happened yet."""

    event: torch.cuda.Event

    def known(self) -> bool:
        """Whether the peer has recorded ``event`` for this transfer (never blocks)."""

    def wait_known(self) -> None:
        """Block the host until it has (``RuntimeError`` if the peer does not within the store's timeout)."""


class KVTransfer:
    """Handle of one started transfer (returned by ``send``/``recv``, ``send_kv``/``recv_kv``).

    Attributes
    ----------
    role : ``"sender"`` or ``"receiver"``.
    peer : global rank of the other side.
    tokens : slots moved.
    heads : ``(lo, hi)``, the global KV heads moved.
    nbytes : bytes moved: the KV rows (all layers, K and V, the moved heads only) and the states.
    chunks : pieces the rows moved in: messages on the staged path, copy launches on the direct one.
    states : state slots moved (hybrid models' linear-attention state).
    state_nbytes : the states' part of ``nbytes``.
    path : ``"staged"`` (staging buffer and NCCL or gloo) or ``"ipc"`` (the receiver read the
        sender's rows directly).
    path_reason : why the transfer went staged (None on the direct path).
    """

    def __init__(
        self, role: str, peer: int, tokens: int, heads: tuple[int, int], nbytes: int, chunks: int,
        device: torch.device, done: Optional[torch.cuda.Event] = None, *, states: int = 0,
        state_nbytes: int = 0, path: str = "staged", path_reason: Optional[str] = None,
        peer_done: Optional[PeerDone] = None,
    ) -> None:  # fmt: skip
        self.role, self.peer, self.tokens, self.heads = role, peer, tokens, heads
        self.nbytes, self.chunks, self.states, self.state_nbytes = nbytes, chunks, states, state_nbytes
        self.path, self.path_reason = path, path_reason
        self._device, self._done, self._peer_done = device, done, peer_done

    def is_completed(self) -> bool:
        """True once every row has moved (sender: read and sent, or read by the receiver; receiver:
        written into the pool). Never blocks."""
        if self._peer_done is not None:
            return self._peer_done.known() and self._peer_done.event.query()
        return self._done is None or self._done.query()

    def poll(self) -> KVPoll:
        """SGLang's poll: ``KVPoll.Success`` once :meth:`is_completed`, else
        ``KVPoll.Transferring``; never blocks."""
        return KVPoll.Success if self.is_completed() else KVPoll.Transferring

    def wait(self) -> None:
        """Make the caller's current stream wait for the transfer (no host wait on CUDA; on the direct
        path the sender's host first waits until the receiver has queued its reads). Afterwards,
        work queued on that stream may reuse the sender's slots or read the receiver's."""
        if self._peer_done is not None:
            self._peer_done.wait_known()
            torch.cuda.current_stream(self._device).wait_event(self._peer_done.event)
        elif self._done is not None:
            # (The stream is looked up by device; the wait itself switches devices if it must.)
            torch.cuda.current_stream(self._device).wait_event(self._done)

    def __repr__(self) -> str:
        state = "done" if self.is_completed() else "in flight"
        states = f", states={self.states}" if self.states else ""
        return (
            f"KVTransfer({self.role}, peer={self.peer}, tokens={self.tokens}, heads={self.heads}{states}, "
            f"nbytes={self.nbytes}, chunks={self.chunks}, {self.path}, {state})"
        )
