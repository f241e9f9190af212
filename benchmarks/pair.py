"""Two ranks on one host for the transfer benchmarks and probes: a free port, and the process group.

Rank ``r`` takes ``cuda:r`` with NCCL (NVLink multicast off unless the environment says otherwise),
or, with ``smoke``, a CPU pool's gloo group, which only checks a script (its numbers mean nothing).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_pair(rank: int, port: int, smoke: bool, timeout_s: int = 120) -> torch.device:
    """Join the two-rank group on localhost ``port``; returns this rank's device."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if smoke:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=60))  # fmt: skip
        return torch.device("cpu")
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=timeout_s), device_id=dev)  # fmt: skip
    return dev
