"""Multi-process harness for the transfer tests: spawn ranks, run a list of cases in each, report back.

A *case* names each rank's pool (a :class:`Side`), the transfers to run in order (``(src, dst)``
pairs) and what must happen: every transfer completes and the pools hold exactly the expected bytes,
or every rank of the transfer raises the same exception. Pools are filled with a byte pattern that is
a function of (salt, slot, global head, byte, layer, K/V), so every rank can simulate, from the case
alone, what every pool holds after the transfers (:func:`simulate`), and checks its whole pool (moved
rows and everything else) byte for byte against that. A side with a :class:`StateGeom` holds a
``HybridLinearKVPool`` whose ``MambaPool`` is filled the same way, each state byte a function of its
*identity* (convolution band, global head, channel and byte; or global value head and byte of the
SSM state), so a re-sharded transfer is checked by where each identity lands, not by offsets. Each rank writes its outcomes to
``out/rank{r}.json``; :func:`run_cases` collects them, and the test compares the ranks' outcomes.

Used by tests/test_transfer_between_ranks.py (CPU, gloo) and tests/test_gpu_transfer.py (CUDA, NCCL:
one GPU per rank, or every rank on one GPU, where only the direct path may move rows).
"""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DTYPES = {
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}


@dataclass(frozen=True)
class StateGeom:
    """One rank's linear-attention state: a MambaPool of ``slots`` over ``linear`` layers, heads held
    ``[k_start, k_start + k_heads)`` of ``total_k`` (default: the local count) and likewise for value
    heads; ``bands`` the convolution's band letters (None: no StateShard, whole rows)."""

    k_heads: int = 2
    v_heads: int = 4
    k_dim: int = 8
    v_dim: int = 4
    conv_kernel: int = 4
    bands: Optional[str] = "kkv"
    k_start: int = 0
    v_start: int = 0
    total_k: Optional[int] = None
    total_v: Optional[int] = None
    slots: int = 12
    linear: tuple[int, ...] = (0, 1, 2, 4, 5)
    conv_dtype: str = "bf16"
    ssm_dtype: str = "fp32"

    @property
    def conv_dim(self) -> int:
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim

    def shard(self):
        from kvpool import StateShard

        if self.bands is None:
            return None
        return StateShard(self.v_start, self.total_v or self.v_heads, self.k_start, self.total_k or self.k_heads,
                          (self.bands,))  # fmt: skip


@dataclass(frozen=True)
class Side:
    """One rank's pool and endpoint settings."""

    dtype: str = "fp8_e4m3"
    layers: int = 3
    start_layer: int = 0
    heads: int = 4
    head_start: int = 0
    total_heads: Optional[int] = None
    head_dim: int = 32
    v_head_dim: Optional[int] = None
    size: int = 200
    page_size: int = 1
    chunk_bytes: Optional[int] = None
    mla: bool = False  # an MLATokenToKVPool: heads 1, head_dim = kv_lora_rank, v_head_dim = qk_rope_head_dim
    state: Optional[StateGeom] = None  # a HybridLinearKVPool (full-attention layers 3, 7, ...) with this state
    hybrid: bool = False  # a HybridLinearKVPool even without a state (its mamba_pool None)
    ipc: bool = True  # the endpoint's ipc option

    @property
    def rows(self) -> int:
        return self.size + self.page_size


@dataclass(frozen=True)
class Case:
    """``sides``: rank -> Side; ``transfers``: (src, dst) in order; ``tokens``: slots per transfer
    (``recv_tokens`` overrides the receiver's count); ``tamper``: rank -> how that rank spoils its
    call ("oob", "neg", "float", "2d", "list", "cuda", "as_sender", "as_receiver"; "state_oob",
    "state_neg", "state_float" spoil its state_slots, "state_given" passes slots to a pool without state);
    ``expect``: None (success) or (exception name, substring both ranks' messages contain)."""

    name: str
    sides: dict[int, Side]
    transfers: list[tuple[int, int]]
    tokens: int = 37
    recv_tokens: Optional[int] = None
    states: int = 0  # state slots per transfer (sides with a StateGeom)
    recv_states: Optional[int] = None
    tamper: dict[int, str] = field(default_factory=dict)
    expect: Optional[tuple[str, str]] = None
    loc_dtype: str = "int64"  # "int32", "numpy"
    duplicates: bool = False  # the sender's loc repeats slots
    same_slots: bool = False  # a rank uses the same slots in every transfer of the case
    group: Optional[tuple[int, ...]] = None  # run in dist.new_group(group) instead of the world group


# --- pattern --------------------------------------------------------------------------------------------


def pattern(
    slots: torch.Tensor, head_lo: int, head_hi: int, head_bytes: int, layer: int, kv: int, salt: int
) -> torch.Tensor:
    """uint8 [len(slots), (head_hi - head_lo) * head_bytes]: the bytes a pool with ``salt`` holds at
    those slots for global heads [head_lo, head_hi) of ``layer`` (kv 0: K, 1: V)."""
    s = slots.to(torch.int64)[:, None]
    c = torch.arange(head_lo * head_bytes, head_hi * head_bytes, dtype=torch.int64, device=slots.device)[None, :]
    x = (s * 1_000_003 + c * 7_919 + layer * 104_729 + kv * 1_299_709 + salt * 15_485_863) & 0x7FFFFFFF
    x = x ^ (x >> 13)
    x = (x * 0x5BD1E995) & 0x7FFFFFFF
    x = x ^ (x >> 15)
    return (x & 0xFF).to(torch.uint8)


def full_layers(side: Side) -> list[int]:
    """A hybrid side's full-attention layer ids (Qwen3.5's pattern, from ``start_layer``)."""
    return [side.start_layer + 4 * i + 3 for i in range(side.layers)]


def make_pool(side: Side, device: str):
    from kvpool import HybridLinearKVPool, MambaCacheParams, MambaPool, MambaStateDType, MambaStateShape, MHATokenToKVPool, MLATokenToKVPool

    if side.state is not None or side.hybrid:
        g, mamba = side.state, None
        if g is not None:
            shape = MambaStateShape(conv=(g.conv_dim, g.conv_kernel - 1), temporal=(g.v_heads, g.v_dim, g.k_dim))
            params = MambaCacheParams(shape, g.linear, MambaStateDType(DTYPES[g.conv_dtype], DTYPES[g.ssm_dtype]))
            mamba = MambaPool(size=g.slots, cache_params=params, device=device)
        return HybridLinearKVPool(side.size, DTYPES[side.dtype], side.page_size, side.heads, side.head_dim,
                                  full_layers(side), False, device, mamba, v_head_dim=side.v_head_dim,
                                  warmup=False)  # fmt: skip
    if side.mla:
        assert side.heads == 1 and side.v_head_dim is not None, "an MLA side has one head and a rotary part"
        return MLATokenToKVPool(
            side.size, side.page_size, DTYPES[side.dtype], side.head_dim, side.v_head_dim, side.layers, device,
            start_layer=side.start_layer, warmup=False,
        )  # fmt: skip
    return MHATokenToKVPool(
        side.size, side.page_size, DTYPES[side.dtype], side.heads, side.head_dim, side.layers, device,
        v_head_dim=side.v_head_dim, start_layer=side.start_layer, warmup=False,
    )  # fmt: skip


def _byte_rows(buf: torch.Tensor) -> torch.Tensor:
    return buf.view(buf.shape[0], -1).view(torch.uint8)


def buffers(pool) -> list[torch.Tensor]:
    """The pool's buffers as uint8 [rows, row_bytes], in the order K0, V0, K1, V1, ... (a hybrid
    pool's full-attention layers), then each linear layer's convolution window and SSM state."""
    kv = getattr(pool, "full_kv_pool", pool)
    out = [_byte_rows(b) for pair in zip(kv.k_buffer, kv.v_buffer) for b in pair]
    mamba = getattr(pool, "mamba_pool", None)
    if mamba is not None:
        out += [_byte_rows(t[i]) for i in range(mamba.num_mamba_layers) for t in (mamba.conv[0], mamba.temporal)]
    return out


def fill(pool, side: Side, salt: int) -> None:
    for buf, data in zip(buffers(pool), initial_bytes(side, salt, pool.device)):
        buf.copy_(data)


def state_identities(g: StateGeom) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 [row bytes] per buffer kind (convolution window, SSM state): the identity of each byte of
    a slot's row, the same on every rank that holds it (whole rows without bands: the byte's offset)."""
    ce, se = torch.empty(0, dtype=DTYPES[g.conv_dtype]).element_size(), torch.empty(0, dtype=DTYPES[g.ssm_dtype]).element_size()
    per_channel = (g.conv_kernel - 1) * ce
    conv = torch.arange(g.conv_dim * per_channel)
    if g.bands is not None:
        channel, within = conv // per_channel, conv % per_channel
        ident = torch.empty_like(conv)
        at = 0
        for j, letter in enumerate(g.bands):
            heads, dim, start = (g.k_heads, g.k_dim, g.k_start) if letter == "k" else (g.v_heads, g.v_dim, g.v_start)
            mask = (channel >= at) & (channel < at + heads * dim)
            off = channel - at
            ident[mask] = (((j * 4096 + start + off // dim) * 4096 + off % dim) * 4096 + within)[mask]
            at += heads * dim
        conv = ident
    per_head = g.v_dim * g.k_dim * se
    ssm = torch.arange(g.v_heads * per_head)
    if g.bands is not None:
        ssm = (g.v_start + ssm // per_head) * (1 << 20) + ssm % per_head
    return conv, ssm


def initial_bytes(side: Side, salt: int, device) -> list[torch.Tensor]:
    """A pool's buffers as filled by :func:`fill`: uint8 [rows, heads * head_bytes] per (layer, K/V)."""
    rows = torch.arange(side.rows, device=device)
    esize = torch.empty(0, dtype=DTYPES[side.dtype]).element_size()
    out = []
    hybrid = side.state is not None or side.hybrid
    layer_ids = full_layers(side) if hybrid else range(side.start_layer, side.start_layer + side.layers)
    for layer in layer_ids:
        for kv, dim in enumerate((side.head_dim, side.v_head_dim or side.head_dim)):
            heads = side.head_start, side.head_start + side.heads
            out.append(pattern(rows, *heads, dim * esize, layer, kv, salt))
    if side.state is not None:
        g = side.state
        slots = torch.arange(g.slots + 1, device=device)
        for layer in g.linear:
            for kind, ident in enumerate(state_identities(g)):
                out.append(identity_pattern(slots, ident.to(device), layer, 2 + kind, salt))
    return out


def identity_pattern(slots: torch.Tensor, ident: torch.Tensor, layer: int, kind: int, salt: int) -> torch.Tensor:
    """uint8 [len(slots), len(ident)]: the state bytes of identities ``ident`` (see state_identities)."""
    s = slots.to(torch.int64)[:, None]
    x = (s * 1_000_003 + ident[None, :] * 7_919 + layer * 104_729 + kind * 1_299_709 + salt * 15_485_863) & 0x7FFFFFFF
    x = x ^ (x >> 13)
    x = (x * 0x5BD1E995) & 0x7FFFFFFF
    x = x ^ (x >> 15)
    return (x & 0xFF).to(torch.uint8)


def simulate(case: Case, idx: int, device) -> dict[int, list[torch.Tensor]]:
    """Every pool of the case after its transfers, moved with plain indexing (all rows of a transfer
    read before any is written)."""
    state = {r: initial_bytes(side, case_salt(idx, r), device) for r, side in case.sides.items()}
    if case.expect is not None:
        return state
    for t, (src, dst) in enumerate(case.transfers):
        s, d = case.sides[src], case.sides[dst]
        lo, hi = max(s.head_start, d.head_start), min(s.head_start + s.heads, d.head_start + d.heads)
        s_loc = case_loc(case, idx, t, "sender", s).to(device)
        d_loc = case_loc(case, idx, t, "receiver", d).to(device)
        n_kv = 2 * s.layers
        for j, (sb, db) in enumerate(zip(state[src][:n_kv], state[dst][:n_kv])):
            hb = sb.shape[1] // s.heads
            rows = sb[s_loc, (lo - s.head_start) * hb : (hi - s.head_start) * hb]
            db[d_loc, (lo - d.head_start) * hb : (hi - d.head_start) * hb] = rows
        if case.states:
            s_slots = case_state_slots(case, idx, t, "sender", s).to(device)
            d_slots = case_state_slots(case, idx, t, "receiver", d).to(device)
            for kind, (si, di) in enumerate(zip(state_identities(s.state), state_identities(d.state))):
                s_cols, d_cols = shared_columns(si, di)
                for layer in range(len(s.state.linear)):
                    sb, db = state[src][n_kv + 2 * layer + kind], state[dst][n_kv + 2 * layer + kind]
                    rows = sb[s_slots][:, s_cols.to(device)]
                    db[d_slots[:, None], d_cols.to(device)[None, :]] = rows
    return state


def shared_columns(src_ident: torch.Tensor, dst_ident: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Columns of the sender's and the receiver's rows holding the identities both hold."""
    order = torch.argsort(src_ident)
    pos = torch.searchsorted(src_ident[order], dst_ident).clamp(max=len(order) - 1)
    found = src_ident[order][pos] == dst_ident
    return order[pos][found], torch.nonzero(found).flatten()


def case_salt(idx: int, rank: int) -> int:
    return 100 * idx + rank + 1


def compare_pool(pool, expected: list[torch.Tensor], what: str) -> None:
    got = buffers(pool)
    assert len(got) == len(expected), (len(got), len(expected))
    kv = getattr(pool, "full_kv_pool", pool)
    for j, (actual, e) in enumerate(zip(got, expected)):
        differ = actual != e
        if bool(differ.any()):
            bad = differ.nonzero()
            row, col = int(bad[0, 0]), int(bad[0, 1])
            name = (f"layer {kv.start_layer + j // 2} {'KV'[j % 2]}" if j < 2 * kv.layer_num
                    else f"linear layer {(j - 2 * kv.layer_num) // 2} {('conv', 'ssm')[j % 2]}")  # fmt: skip
            raise AssertionError(
                f"{what}: {name}: {int(differ.sum())} bytes differ in "
                f"{int(differ.any(dim=1).sum())} rows; first at row {row} byte {col}: "
                f"{int(actual[row, col])} vs expected {int(e[row, col])}"
            )


# --- per-case slots --------------------------------------------------------------------------------------


def case_loc(case: Case, idx: int, t: int, role: str, side: Side) -> torch.Tensor:
    """Deterministic slots of transfer ``t`` of case ``idx`` for ``role``: whole pages in random order
    (the first ``tokens`` slots of them), always including the last row when there is room."""
    n = case.tokens if role == "sender" or case.recv_tokens is None else case.recv_tokens
    g = torch.Generator().manual_seed(1_000 * idx + 10 * (0 if case.same_slots else t) + (role != "sender"))
    pages = torch.randperm(side.rows // side.page_size, generator=g)
    slots = (pages[:, None] * side.page_size + torch.arange(side.page_size)).flatten()[:n]
    if n >= 2 and side.rows - 1 not in slots.tolist():
        slots[1] = side.rows - 1
    if case.duplicates and role == "sender" and n >= 4:
        slots[n // 2 :] = slots[: n - n // 2].clone()
    return slots


def case_state_slots(case: Case, idx: int, t: int, role: str, side: Side) -> torch.Tensor:
    """Distinct state slots of transfer ``t`` (``0..slots``, the last one included when there is room)."""
    n = case.states if role == "sender" or case.recv_states is None else case.recv_states
    if side.state is None:
        return torch.arange(n)
    g = torch.Generator().manual_seed(7_000 + 1_000 * idx + 10 * (0 if case.same_slots else t) + (role != "sender"))
    slots = torch.randperm(side.state.slots + 1, generator=g)[:n]
    if n >= 2 and side.state.slots not in slots.tolist():
        slots[1] = side.state.slots
    return slots


def _spoil_states(slots: torch.Tensor, how: Optional[str], side: Side):
    if how == "state_oob":
        slots = slots.clone()
        slots[-1] = side.state.slots + 1
    elif how == "state_neg":
        slots = slots.clone()
        slots[0] = -1
    elif how == "state_float":
        return slots.float()
    return slots


def _spoil(loc: torch.Tensor, how: Optional[str], side: Side, case: Case):
    if how == "oob":
        loc = loc.clone()
        loc[len(loc) // 2] = side.rows
        return loc
    if how == "neg":
        loc = loc.clone()
        loc[0] = -1
        return loc
    if how == "float":
        return loc.float()
    if how == "2d":
        return loc.view(1, -1)
    if how == "list":
        return loc.tolist()
    if how == "cuda":
        return loc.to("cuda") if torch.cuda.is_available() else loc.to("meta")
    if case.loc_dtype == "int32":
        return loc.to(torch.int32)
    if case.loc_dtype == "numpy":
        return loc.numpy()
    return loc


# --- the rank's loop ------------------------------------------------------------------------------------


def run_rank_cases(
    rank: int, world: int, port: int, out: str, backend: str, cases: list[Case], kernel: bool = False
) -> None:
    """Body of one spawned rank: init the group, run every case, write the outcomes. ``kernel``: copy
    rows of CPU pools with the Triton kernel through its interpreter instead of the torch path.
    ``backend``: "gloo" (CPU pools), "nccl" (rank r on cuda:r) or "nccl-one-gpu" (every rank on
    cuda:0: NCCL refuses two ranks on one GPU, so the group is never used for data, and the ranks
    keep in step over a gloo group)."""
    torch.set_num_threads(1)
    if kernel:
        from kvpool.kernels.copy_rows import launcher as copy_rows

        if not copy_rows.INTERPRETER:
            raise RuntimeError("kernel=True needs TRITON_INTERPRET=1")
        copy_rows.kernel_on_cpu = True
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    device = "cpu"
    kwargs = {}
    one_gpu = backend == "nccl-one-gpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
        kwargs["device_id"] = torch.device(device)
    elif one_gpu:
        torch.cuda.set_device(0)
        device, backend = "cuda:0", "nccl"  # no device_id: the communicator is never made
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=30), **kwargs,
    )  # fmt: skip
    sync = dist.new_group(backend="gloo") if one_gpu else None
    outcomes = {}
    try:
        for idx, case in enumerate(cases):
            outcomes[case.name] = _run_case(rank, idx, case, device)
            dist.barrier(group=sync)  # cases start together, so a failed case cannot shift the next one
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(outcomes, indent=1))
        dist.destroy_process_group()


def _run_case(rank: int, idx: int, case: Case, device: str) -> dict:
    from kvpool import KVReceiver, KVSender

    group = dist.new_group(list(case.group)) if case.group else None  # collective: every rank calls it
    if device.startswith("cuda"):
        torch.cuda.synchronize()  # the last case's copies are done before its pools go
    side = case.sides.get(rank)
    if side is None or not any(rank in t for t in case.transfers):
        return {"outcome": "idle"}
    salt = case_salt(idx, rank)
    pool = make_pool(side, device)
    fill(pool, side, salt)
    opts = dict(group=group, head_start=side.head_start, total_heads=side.total_heads, chunk_bytes=side.chunk_bytes,
                state_shard=side.state.shard() if side.state is not None else None, ipc=side.ipc)  # fmt: skip
    sender = receiver = None
    handles = []
    try:
        for t, (src, dst) in enumerate(case.transfers):
            if rank not in (src, dst):
                continue
            role = "sender" if rank == src else "receiver"
            how = case.tamper.get(rank)
            if how == "as_sender":
                role = "sender"
            elif how == "as_receiver":
                role = "receiver"
            peer = dst if rank == src else src
            loc = _spoil(case_loc(case, idx, t, role, side), how, side, case)
            states = None
            if (case.states and side.state is not None) or how == "state_given":
                states = _spoil_states(case_state_slots(case, idx, t, role, side), how, side)
            if role == "sender":
                sender = sender or KVSender(pool, **opts)
                handles.append(sender.send(loc, peer, states))
            else:
                receiver = receiver or KVReceiver(pool, **opts)
                handles.append(receiver.recv(loc, peer, states))
            handles[-1].wait()  # the caller's stream waits before it uses (or sends on) the rows
        error = None
    except Exception as e:  # noqa: BLE001 - the outcome is compared across ranks by the test
        error = e
    try:
        if error is not None and not isinstance(error, (ValueError, IndexError, TypeError)):
            raise error
        expected = simulate(case, idx, pool.device)[rank]
        compare_pool(pool, expected, f"rank {rank} pool after case {case.name}")
    except Exception as e:  # noqa: BLE001
        return {"outcome": "failure", "detail": "".join(traceback.format_exception(e))[-3000:]}
    if error is not None:
        return {"outcome": "raised", "type": type(error).__name__, "message": str(error)}
    return {
        "outcome": "ok",
        "transfers": [
            dict(role=h.role, peer=h.peer, tokens=h.tokens, heads=list(h.heads), nbytes=h.nbytes, chunks=h.chunks,
                 states=h.states, state_nbytes=h.state_nbytes, path=h.path, path_reason=h.path_reason)
            for h in handles
        ],
    }


def check_outcomes(cases: list[Case], outcomes: list[dict], world: int) -> None:
    """Every case did what it expects on every rank of its transfers (the same exception and message
    on each, when it expects one), and ranks outside them stayed idle."""
    problems = []
    for case in cases:
        ranks = sorted({r for t in case.transfers for r in t})
        got = {r: outcomes[r][case.name] for r in ranks}
        for r, o in got.items():
            if o["outcome"] == "failure":
                problems.append(f"{case.name}: rank {r} failed:\n{o['detail']}")
        if case.expect is None:
            for r, o in got.items():
                if o["outcome"] != "ok":
                    problems.append(f"{case.name}: rank {r}: expected success, got {o}")
        else:
            kind, text = case.expect
            first = got[ranks[0]]
            for r, o in got.items():
                if o["outcome"] != "raised" or o["type"] != kind or text not in o["message"]:
                    problems.append(f"{case.name}: rank {r}: expected {kind} containing {text!r}, got {o}")
                elif o != first:
                    problems.append(f"{case.name}: ranks differ: {first} vs rank {r}: {o}")
        for r in set(range(world)) - set(ranks):
            if outcomes[r][case.name]["outcome"] != "idle":
                problems.append(f"{case.name}: rank {r} should be idle, got {outcomes[r][case.name]}")
    assert not problems, "\n".join(problems)


# --- spawning -------------------------------------------------------------------------------------------


def join_two_ranks(rank: int, port: int, backend: str, timeout_s: float = 30) -> str:
    """Join rank ``rank`` of a two-rank group over ``backend`` (gloo on CPU pools, or NCCL with rank
    ``r`` on GPU ``r``) on 127.0.0.1:``port``; returns the device the rank's pools live on."""
    device, kwargs = "cpu", {}
    if backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
        kwargs["device_id"] = torch.device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=timeout_s), **kwargs)  # fmt: skip
    return device


def check_outcome(ranks: list[dict], case: Any) -> list[dict]:
    """Both ranks' record of ``case`` (by ``case.name``): neither failed; both moved the rows, or,
    where ``case.expect`` is (exception type name, text), both raised that type with the same
    message holding that text. Returns the two records."""
    got = [r[case.name] for r in ranks]
    for g in got:
        assert g["outcome"] != "failure", f"{case.name}: {g['detail']}"
    if case.expect is None:
        assert [g["outcome"] for g in got] == ["ok", "ok"], (case.name, got)
    else:
        assert [g["outcome"] for g in got] == ["raised", "raised"], (case.name, got)
        assert got[0]["message"] == got[1]["message"], (case.name, got)
        assert [g["type"] for g in got] == [case.expect[0]] * 2 and case.expect[1] in got[0]["message"], (case.name, got)
    return got


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn: Callable, world: int, args: tuple, timeout: float) -> None:
    """Run ``fn(rank, *args)`` in ``world`` spawned processes; kill them all after ``timeout`` s."""
    ctx = mp.start_processes(fn, args=args, nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks still running after {timeout:.0f} s (a hang?)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


def run_cases(
    cases: list[Case], world: int, out: Path, backend: str = "gloo", timeout: float = 120, kernel: bool = False
) -> list[dict]:
    """Run ``cases`` in ``world`` ranks; per rank, case name -> outcome."""
    spawn(run_rank_cases, world, (world, free_port(), str(out), backend, cases, kernel), timeout)
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


def with_side(side: Side, **changes) -> Side:
    return replace(side, **changes)


def with_ipc(cases: list[Case], ipc: bool) -> list[Case]:
    """``cases`` with every side's endpoint built with ``ipc``."""
    return [replace(c, sides={r: replace(s, ipc=ipc) for r, s in c.sides.items()}) for c in cases]


def paths_taken(cases: list[Case], outcomes: list[dict]) -> set[tuple[str, Optional[str]]]:
    """The ``(path, path_reason)`` of every transfer that moved rows, on every rank."""
    return {(t["path"], t["path_reason"]) for o in outcomes for c in cases if o[c.name].get("outcome") == "ok"
            for t in o[c.name]["transfers"] if t["tokens"] or t["states"]}  # fmt: skip

