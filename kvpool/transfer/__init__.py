"""KV transfer between ranks: a request's K/V rows of every layer move from one rank's pool to
another's over torch.distributed, after a handshake that makes both ranks agree or both raise. What
users may rely on is in docs/contract.md, "KV transfer between ranks".

``KVSender``/``KVReceiver`` are bound to a pool and a process group and keep their staging buffers;
``send_kv``/``recv_kv`` are the same with one endpoint kept per pool. See
:mod:`kvpool.transfer.endpoint` for how a transfer runs.
"""

from kvpool.transfer.endpoint import KVPoll, KVTransfer
from kvpool.transfer.pipelines import KVReceiver, KVSender, recv_kv, send_kv

__all__ = ["KVPoll", "KVReceiver", "KVSender", "KVTransfer", "recv_kv", "send_kv"]
