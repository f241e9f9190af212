"""A transfer call's own checks: the peer and the process group (raised at once: the peer cannot be
told), and the slots (reported to both ranks through the handshake). docs/contract.md, "KV transfer
between ranks", lists them."""

from __future__ import annotations

from typing import Optional, Union

import numpy as np
import torch
import torch.distributed as dist

from kvpool.checks import check_index, out_of_range

Loc = Union[torch.Tensor, np.ndarray]


def check_peer(peer: object, group: Optional[dist.ProcessGroup], name: str) -> int:
    """This rank's global rank, after checking ``peer`` (argument ``name``); raises here."""
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
        raise ValueError(f"{name} must be another rank of the process group {ranks}, got {peer} (this rank is {rank})")
    return rank


def check_backend(group: Optional[dist.ProcessGroup], device: torch.device) -> None:
    """The group's backend can carry tensors of ``device`` (NCCL for CUDA, gloo for CPU)."""
    backend = str(dist.get_backend(group))
    if ":" in backend:  # "cpu:gloo,cuda:nccl": one backend per device type
        per_device = dict(part.split(":", 1) for part in backend.split(","))
        chosen = per_device.get(device.type)
    else:
        chosen = backend
    ok = chosen is not None and not (
        (chosen == "nccl" and device.type != "cuda") or (chosen == "gloo" and device.type != "cpu")
    )
    if not ok:
        raise ValueError(
            f"the process group's backend ({backend}) cannot carry tensors of the pool's device "
            f"{device}: use NCCL for CUDA pools and gloo for CPU pools"
        )


def check_slots(
    loc: object, rows: int, where: str, role: str, name: str = "loc", pool: str = "pool"
) -> tuple[Optional[torch.Tensor], Optional[Exception]]:
    """``loc`` (argument ``name``, slots of a ``pool`` of ``rows`` rows) as a CPU int64 tensor, or the
    problem to report to both ranks (with the error the one check helper raises, prefixed by the
    transfer and the role)."""
    tail = "; nothing moved"
    if isinstance(loc, np.ndarray):
        if loc.dtype not in (np.int32, np.int64):
            return None, ValueError(f"{where}: the {role}'s {name} must be int32 or int64, got numpy {loc.dtype}{tail}")
        loc = torch.from_numpy(loc)
    if not isinstance(loc, torch.Tensor):
        return None, TypeError(
            f"{where}: the {role}'s {name} must be a CPU torch.Tensor or a numpy array, got {type(loc).__name__}{tail}"
        )
    try:
        check_index(loc, name, dims="[T]" if name == "loc" else "[R]")
    except ValueError as e:
        return None, ValueError(f"{where}: the {role}'s {e}{tail}")
    if loc.device.type != "cpu":
        return None, ValueError(
            f"{where}: the {role}'s {name} must be host indices (a CPU tensor), got a tensor on {loc.device}: "
            f"reading device indices to check them would synchronise the device; pass {name}.cpu(){tail}"
        )
    n = loc.shape[0]
    if n > rows:
        return None, ValueError(f"{where}: the {role}'s {name} has {n} slots, more than its {pool}'s {rows} rows{tail}")
    loc64 = loc.to(torch.int64)
    bad = out_of_range(loc64, rows, negative_ok=False)
    if bad is not None:
        return None, IndexError(
            f"{where}: the {role}'s {name}[{bad[0]}] = {bad[1]} is outside its {pool}'s slots [0, {rows}){tail}"
        )
    return loc64, None


def default_store() -> dist.Store:
    """The key-value store torch.distributed was initialised with (every rank can reach it)."""
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None:  # pragma: no cover - present in every torch kvpool supports
        raise RuntimeError("kvpool transfers need torch.distributed's default store, which this torch does not expose")
    return getter()
