"""KV transfer between ranks: a request's K/V rows of every layer, with the scales a pool keeps
beside its codes (and a hybrid model's linear-attention states), move from one rank's pools to
another's over torch.distributed, after a handshake that makes both ranks agree or both raise; on
one host the receiver may read the sender's rows directly. What users may rely on is in docs/contract.md, "KV transfer between ranks".

``KVSender``/``KVReceiver`` are bound to a pool and a process group and keep their staging buffers;
``send_kv``/``recv_kv`` are the same with one endpoint kept per pool; ``SWAKVSender``/``SWAKVReceiver``
move both parts of an ``SWAKVPool`` (``swa.py``). See
:mod:`kvpool.transfer.endpoint` for how a transfer runs.
"""

from kvpool.transfer.handle import KVPoll, KVTransfer
from kvpool.transfer.pipelines import KVReceiver, KVSender, recv_kv, send_kv
from kvpool.transfer.state_wire import GATED_DELTA_NET, MAMBA2, StateShard
from kvpool.transfer.swa import SWAKVReceiver, SWAKVSender, SWAKVTransfer

__all__ = ["GATED_DELTA_NET", "KVPoll", "KVReceiver", "KVSender", "KVTransfer", "MAMBA2", "StateShard",
           "SWAKVReceiver", "SWAKVSender", "SWAKVTransfer", "recv_kv", "send_kv"]
