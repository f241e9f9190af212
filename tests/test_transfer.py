"""KV transfer between ranks (docs/contract.md, "KV transfer between ranks") on CPU pools over gloo,
plus the pure parts in-process.

The spawned tests run many cases per process group (startup dominates): every byte of every moved
row, nothing else in either pool changed, the same error on both ranks for every mismatch and bad
argument, and the pair still in step afterwards. Re-sharding between tensor-parallel sizes runs on
three ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from kvpool import KVReceiver, KVSender, MHATokenToKVPool
from kvpool import StateShard
from kvpool.transfer.handshake import (
    DIRECT,
    HEADER_BYTES,
    IPC_CPU,
    IPC_DISABLED,
    IPC_OFFERED,
    MESSAGE_BYTES,
    PEER_NONE,
    PEER_READY,
    PEER_REFUSED,
    RECEIVER,
    SENDER,
    SETUP,
    STAGED,
    Agreement,
    Header,
    Refusal,
    agree,
    link_route,
    make_header,
)
from kvpool.transfer.state_wire import MAMBA2, StateOverlap, StateSide, band_spans, state_plan
from kvpool.transfer import wire
from kvpool.transfer.wire import RAMP, TokenLayout, chunk_plan
from kvassert import needs_interpreter
from transfer_ranks import Case, Side, StateGeom, check_outcomes, free_port, run_cases, spawn, with_side

ROOT = Path(__file__).resolve().parents[1]

# --- the chunk plan ---------------------------------------------------------------------------------------


@given(st.integers(0, 5000), st.integers(1, 700))
def test_chunk_plan_covers_tokens_in_bounded_growing_chunks(tokens, capacity):
    plan = chunk_plan(tokens, capacity)
    starts = [s for s, _ in plan]
    counts = [c for _, c in plan]
    assert sum(counts) == tokens
    assert starts == [sum(counts[:i]) for i in range(len(counts))]
    assert all(1 <= c <= capacity for c in counts)
    # each chunk's gather must fit under the previous chunk's send: bounded growth
    assert all(b <= RAMP * a for a, b in zip(counts, counts[1:]))
    assert plan == chunk_plan(tokens, capacity)


def test_chunk_plan_shape_for_an_8k_request(monkeypatch):
    # The default ramp: three steps of 2x at each end (wire.RAMP, wire.RAMP_STEPS), full chunks in
    # the middle; a Llama-3-8B FP8 request (64 KiB a token) with the default 512 MiB staging half.
    assert [c for _, c in chunk_plan(8192, 8192)] == [1024, 2048, 2048, 2048, 1024]  # 64/128/128/128/64 MiB
    assert [c for _, c in chunk_plan(32768, 8192)] == [1024, 2048, 4096, 6144, 6144, 6144, 4096, 2048, 1024]
    # One ramp step of 4x; no ramp: full chunks, the remainder shared by the two in the middle.
    monkeypatch.setattr(wire, "RAMP", 4)
    monkeypatch.setattr(wire, "RAMP_STEPS", 1)
    counts = [c for _, c in chunk_plan(8192, 1024)]
    assert counts == [256, 1024, 1024, 1024, 768, 768, 1024, 1024, 1024, 256]
    monkeypatch.setattr(wire, "RAMP_STEPS", 0)
    assert [c for _, c in chunk_plan(8000, 1024)] == [1024] * 3 + [928, 928] + [1024] * 3


def test_chunk_plan_rejects_bad_arguments():
    with pytest.raises(ValueError, match="capacity"):
        chunk_plan(10, 0)


def test_token_layout():
    lay = TokenLayout.of(layer_num=2, heads=3, head_dim=4, v_head_dim=2, element_size=2)
    assert lay.row_bytes == (24, 12, 24, 12)
    assert lay.offsets == (0, 24, 36, 60)
    assert lay.token_bytes == 72


# --- the handshake ---------------------------------------------------------------------------------------


def _pool(**kw):
    args = dict(size=64, page_size=1, dtype=torch.float8_e4m3fn, head_num=4, head_dim=32, layer_num=3, device="cpu")
    args.update(kw)
    return MHATokenToKVPool(**args)


def _header(role, rank, pool=None, head_start=0, total_heads=4, tokens=10, chunk_bytes=4096):
    return make_header(role, rank, pool or _pool(), head_start, total_heads, tokens, chunk_bytes)


def test_header_round_trips_with_a_cut_message():
    h = _header(SENDER, 3).with_error(IndexError("slot é " + "x" * 2000))
    data = h.encode()
    assert data.dtype == torch.uint8 and data.shape == (HEADER_BYTES,)
    back = Header.decode(data)
    assert back.error_kind == h.error_kind and back.tokens == 10 and back.rank == 3
    assert back.message == h.message.encode()[:MESSAGE_BYTES].decode()


def test_agree_moves_the_common_heads_in_the_smaller_chunks():
    s = _header(SENDER, 0, chunk_bytes=8192)
    r = _header(RECEIVER, 1, pool=_pool(head_num=2), head_start=2, chunk_bytes=4096)
    assert agree(s, r) == agree(r, s) == Agreement(tokens=10, head_lo=2, head_hi=4, chunk_bytes=4096)


MISMATCHES = [  # (field named in the message, how the receiver differs)
    ("dtype", dict(pool=_pool(dtype=torch.bfloat16))),
    ("layers", dict(pool=_pool(layer_num=2))),
    ("layers", dict(pool=_pool(start_layer=1))),
    ("total_heads", dict(total_heads=8)),
    ("head_dim", dict(pool=_pool(head_dim=64))),
    ("v_head_dim", dict(pool=_pool(v_head_dim=16))),
    ("heads", dict(pool=_pool(head_num=2), head_start=2)),  # against a sender holding heads [0, 2)
    ("tokens", dict(tokens=11)),
]


@pytest.mark.parametrize("field, receiver", MISMATCHES, ids=[f for f, _ in MISMATCHES])
def test_agree_names_the_mismatched_field_whichever_header_comes_first(field, receiver):
    sender_pool = _pool(head_num=2) if field == "heads" else _pool()
    s = _header(SENDER, 0, pool=sender_pool)
    r = _header(RECEIVER, 1, **receiver)
    verdict = agree(s, r)
    assert verdict == agree(r, s)
    assert isinstance(verdict, Refusal) and verdict.error is ValueError
    assert f"{field} mismatch" in verdict.message and "rank 0 -> rank 1" in verdict.message


def test_agree_reports_roles_and_own_problems_before_geometry():
    both_send = agree(_header(SENDER, 0), _header(SENDER, 1, pool=_pool(dtype=torch.bfloat16)))
    assert isinstance(both_send, Refusal) and "role mismatch" in both_send.message
    bad_sender = _header(SENDER, 2).with_error(IndexError("sender slot"))
    bad_receiver = _header(RECEIVER, 1, pool=_pool(dtype=torch.bfloat16)).with_error(TypeError("receiver loc"))
    assert agree(bad_sender, bad_receiver) == agree(bad_receiver, bad_sender) == Refusal(IndexError, "sender slot")
    assert agree(_header(SENDER, 2), bad_receiver) == Refusal(TypeError, "receiver loc")


def test_agree_rejects_a_foreign_header():
    junk = Header.decode(torch.zeros(HEADER_BYTES, dtype=torch.uint8))
    verdict = agree(_header(SENDER, 0), junk)
    assert isinstance(verdict, Refusal) and "protocol mismatch" in verdict.message


# --- the state on the wire, and the path ---------------------------------------------------------------------


def test_state_shard_of_a_tensor_parallel_rank():
    assert StateShard.tp(3, 8, num_v_heads=64, num_k_heads=16) == StateShard(24, 64, 6, 16, ("kkv",))
    # Fewer key heads than ranks: each rank holds the one its value heads use.
    assert StateShard.tp(5, 8, num_v_heads=16, num_k_heads=4, conv_bands=MAMBA2) == StateShard(10, 16, 2, 4, ("vkk",))
    for kwargs, text in [(dict(tp_rank=8), "tp_rank must be below tp_size"), (dict(num_v_heads=60), "split evenly"),
                         (dict(num_k_heads=3, num_v_heads=48), "replicated")]:  # fmt: skip
        args = dict(tp_rank=0, tp_size=8, num_v_heads=64, num_k_heads=16) | kwargs
        with pytest.raises(ValueError, match=text):
            StateShard.tp(args.pop("tp_rank"), args.pop("tp_size"), **args)
    with pytest.raises(ValueError, match="conv_bands must name at least one band of key heads"):
        StateShard(0, 4, 0, 2, ("vv",))
    with pytest.raises(ValueError, match=r"conv_bands\[0\] must be a non-empty string of 'k' and 'v'"):
        StateShard(0, 4, 0, 2, ("kxv",))


def _mamba(conv=(48, 3), temporal=(4, 4, 8), layers=(0, 1), **kw):
    from kvpool import MambaCacheParams, MambaPool, MambaStateShape

    return MambaPool(size=4, cache_params=MambaCacheParams(MambaStateShape(conv, temporal), layers), device="cpu", **kw)


def test_state_side_takes_the_key_heads_from_the_convolution():
    side = StateSide.of(_mamba(), StateShard(4, 8, 2, 4))  # 48 = 2 x k_heads x 8 + 4 x 4
    assert (side.k_heads, side.v_heads, side.bands) == (2, 4, ("kkv",))
    back = StateSide.from_header(make_header(SENDER, 0, _pool(), 0, 4, 0, 4096, state=side))
    assert back.conv == side.conv and back.k_heads == 2 and back.bands == side.bands
    whole = StateSide.of(_mamba(), None)
    assert whole.bands is None and whole.total_v_heads == 4
    with pytest.raises(ValueError, match="convolution 0 has 50 channels, which bands 'kkv'"):
        StateSide.of(_mamba(conv=(50, 3)), StateShard(0, 4, 0, 2))
    with pytest.raises(ValueError, match=r"value heads \[6, 10\) must lie within total_v_heads=8"):
        StateSide.of(_mamba(), StateShard(6, 8, 0, 2))
    with pytest.raises(ValueError, match="each of the pool's 1 convolutions"):
        StateSide.of(_mamba(), StateShard(0, 4, 0, 2, ("kkv", "v")))


def test_band_spans_are_the_heads_both_hold():
    full = StateSide.of(_mamba(conv=(96, 3), temporal=(8, 4, 8)), StateShard(0, 8, 0, 4))  # 4 key, 8 value heads
    upper = StateSide.of(_mamba(), StateShard(4, 8, 2, 4))
    agreed = StateOverlap(4, 8, 2, 4)
    # Per layer: q, k, v bands of the convolution (2 key heads x 8 x 3 columns x 2 bytes = 96; 4 value
    # heads x 4 x 3 x 2 = 96), then the SSM state's 4 upper value heads (4 x 4 x 8 x 4 bytes).
    assert band_spans(full, agreed) == [(0, 96, 96), (0, 288, 96), (0, 480, 96), (-1, 512, 512)]
    assert band_spans(upper, agreed) == [(0, 0, 96), (0, 96, 96), (0, 192, 96), (-1, 0, 512)]
    assert [n for *_, n in band_spans(full, agreed)] == [n for *_, n in band_spans(upper, agreed)]


@given(st.lists(st.integers(1, 64), min_size=1, max_size=12), st.integers(0, 9), st.integers(64, 300))
def test_state_plan_covers_every_buffer_and_slot_once_within_capacity(row_bytes, states, capacity):
    plan = state_plan(row_bytes, states, capacity)
    covered = sorted((b, s) for b0, b1, first, count in plan for b in range(b0, b1) for s in range(first, first + count))
    assert covered == [(b, s) for b in range(len(row_bytes)) for s in range(states)]
    assert all(count * sum(row_bytes[b0:b1]) <= capacity for b0, b1, _, count in plan)


def test_agree_checks_the_state_only_when_both_have_one():
    hyb = StateSide.of(_mamba(), None)
    s = make_header(SENDER, 0, _pool(), 0, 4, 10, 4096, state=hyb, states=2)
    r = make_header(RECEIVER, 1, _pool(), 0, 4, 10, 4096, state=hyb, states=2)
    assert agree(s, r) == agree(r, s) == Agreement(10, 0, 4, 4096, 2, StateOverlap(0, 4, 0, 0))
    other = make_header(RECEIVER, 1, _pool(), 0, 4, 10, 4096, state=StateSide.of(_mamba(layers=(0, 2)), None), states=2)
    verdict = agree(s, other)
    assert verdict == agree(other, s) and "linear_layers mismatch" in verdict.message
    plain = make_header(RECEIVER, 1, _pool(), 0, 4, 10, 4096)
    assert isinstance(agree(s, plain), Refusal)  # 2 states against none
    kv_only = make_header(SENDER, 0, _pool(), 0, 4, 10, 4096, state=hyb)
    assert agree(kv_only, plain) == Agreement(10, 0, 4, 4096)


def test_link_route_picks_the_path_from_both_headers():
    def header(role, rank, ipc=IPC_OFFERED, host=7, ep=0, peer_ep=0, peer_ipc=PEER_NONE):
        link = dict(ep_id=ep, ipc=ipc, host_id=host, peer_ep=peer_ep, peer_ipc=peer_ipc)
        return make_header(role, rank, _pool(), 0, 4, 10, 4096, link=link)

    s, r = header(SENDER, 0, ep=11), header(RECEIVER, 1, ep=22)
    assert link_route(s, r) == link_route(r, s) == (SETUP, None)
    ready = header(SENDER, 0, ep=11, peer_ep=22, peer_ipc=PEER_READY), header(RECEIVER, 1, ep=22, peer_ep=11, peer_ipc=PEER_READY)
    assert link_route(*ready) == link_route(*ready[::-1]) == (DIRECT, None)
    # A receiver endpoint the sender has not met (a new one on that rank): set up again.
    assert link_route(ready[0], header(RECEIVER, 1, ep=33, peer_ep=11, peer_ipc=PEER_READY)) == (SETUP, None)
    refused = header(SENDER, 0, ep=11, peer_ep=22, peer_ipc=PEER_REFUSED), header(RECEIVER, 1, ep=22, peer_ep=11, peer_ipc=PEER_REFUSED)
    assert link_route(*refused) == (STAGED, None)
    assert link_route(s, header(RECEIVER, 1, host=8)) == (STAGED, "the ranks run on different hosts")
    assert link_route(s, header(RECEIVER, 1, ipc=IPC_DISABLED)) == (STAGED, "the receiver's endpoint was built with ipc=False")
    assert link_route(header(SENDER, 0, ipc=IPC_CPU), r)[1] == "the sender's pool is in host memory"


def test_endpoint_checks_its_state_settings():
    from kvpool import HybridLinearKVPool

    mamba = _mamba(layers=(0, 2))
    hybrid = HybridLinearKVPool(64, torch.float8_e4m3fn, 1, 4, 32, [1, 3], False, "cpu", mamba, warmup=False)
    ep = KVSender(hybrid, state_shard=StateShard(0, 8, 0, 2))
    assert ep.kv is hybrid.full_kv_pool and ep.mamba is mamba and ep.state.k_heads == 2
    assert ep.chunk_bytes == max(65 * 512, 5 * 2 * (288 + 512))  # the whole KV pool's rows or every state slot
    with pytest.raises(ValueError, match="state_shard needs a pool with linear-attention state"):
        KVSender(_pool(), state_shard=StateShard(0, 8, 0, 2))
    small = HybridLinearKVPool(64, torch.float8_e4m3fn, 1, 1, 8, [1, 3], False, "cpu", mamba, warmup=False)  # 32-byte tokens
    with pytest.raises(ValueError, match=r"one state buffer's slot row of this pool \(512 bytes"):
        KVSender(small, chunk_bytes=511)


class _Event:
    """Stands in for a CUDA interprocess event in the direct path's setup (no GPU here)."""

    def __init__(self, handle: bytes = b"", done: bool = True) -> None:
        self.handle, self.done = handle, done

    def ipc_handle(self) -> bytes:
        return self.handle

    def query(self) -> bool:
        return self.done

    @classmethod
    def from_ipc_handle(cls, device, handle):
        return cls(b"opened:" + handle)


def _setup_pair(monkeypatch, *, visible=("GPU-0",), export_fails=False, events_fail=False):
    """Run the sender's and the receiver's setup in two threads over one store; returns both pairs."""
    import threading

    from kvpool.transfer import ipc

    monkeypatch.setattr(ipc, "device_uuid", lambda index: f"GPU-{index}")
    monkeypatch.setattr(ipc, "local_index", lambda uuid: int(uuid[4:]) if uuid in visible else None)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    if export_fails:
        monkeypatch.setattr(ipc, "reduce_tensor", lambda t: (_ for _ in ()).throw(RuntimeError("no IPC here")))
    if events_fail:
        monkeypatch.setattr(_Event, "from_ipc_handle", classmethod(lambda cls, d, h: (_ for _ in ()).throw(
            RuntimeError("bad handle")) if h.startswith(b"done") else cls(h)))  # fmt: skip
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=10))
    send, recv = object.__new__(ipc.SendPair), object.__new__(ipc.RecvPair)
    for pair in (send, recv):
        pair.peer_ep, pair.status, pair.reason, pair.count, pair.counter = 5, 0, None, 0, None
    send.ready, send.done, send.index = [_Event(b"ready0"), _Event(b"ready1")], [], torch.arange(6).view(2, 3)
    recv.done, recv.ready, recv.remote, recv.tables = [_Event(b"done0"), _Event(b"done1")], [], {}, {}
    kv = [torch.full((4, 2), i, dtype=torch.uint8) for i in range(2)]
    device = torch.device("cuda", 0)
    errors: list = []

    def run(fn, *args):
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(ipc.sender_setup, store, "t/", send, {"kv": kv}, device)),
               threading.Thread(target=run, args=(ipc.receiver_setup, store, "t/", recv, device))]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert not any(store.check([f"t/ipc/{k}"]) for k in ("offer", "answer", "final")), "a setup message was left behind"
    return send, recv


def test_direct_path_setup_opens_the_senders_buffers_and_events(monkeypatch):
    send, recv = _setup_pair(monkeypatch)
    assert send.status == recv.status == PEER_READY and send.reason is recv.reason is None
    assert [bytes(e.handle) for e in recv.ready] == [b"opened:ready0", b"opened:ready1"]
    assert [bytes(e.handle) for e in send.done] == [b"opened:done0", b"opened:done1"]
    assert [int(t[0, 0]) for t in recv.remote["kv"]] == [0, 1] and torch.equal(recv.remote["index"], send.index)
    send.counter.read(), recv.counter.post()
    assert send.counter.read() == 1  # the done count the sender's handles wait on


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        (dict(visible=()), "the sender's GPU (GPU-0) is not visible to the receiver's process"),
        (dict(export_fails=True), "the sender could not export its buffers (RuntimeError: no IPC here)"),
        (dict(events_fail=True), "the sender could not open the receiver's events (RuntimeError: bad handle)"),
    ],
    ids=["gpu-not-visible", "export-fails", "events-fail"],
)
def test_direct_path_setup_refuses_on_both_sides_alike(monkeypatch, kwargs, reason):
    send, recv = _setup_pair(monkeypatch, **kwargs)
    assert send.status == recv.status == PEER_REFUSED, (send.reason, recv.reason)
    assert send.reason == recv.reason == reason


def test_direct_link_keeps_a_few_pairs_per_peer_rank(monkeypatch):
    from kvpool.transfer import ipc

    link = ipc.DirectLink(IPC_OFFERED)
    assert link.fields(3) == dict(ep_id=link.ep_id, ipc=IPC_OFFERED, host_id=ipc.host_id(), peer_ep=0, peer_ipc=PEER_NONE)
    pairs = []
    for ep in range(1, ipc.KEEP_PER_RANK + 3):
        pair = object.__new__(ipc.RecvPair)
        pair.peer_ep, pair.status, pair.reason, pair.done = ep, PEER_READY, None, [_Event(done=False)]
        link.add(3, pair)
        pairs.append(pair)
    assert sorted(link.pairs) == list(range(3, ipc.KEEP_PER_RANK + 3))  # the oldest two dropped ...
    assert link._retired == pairs[:2]  # ... but kept while their reads may still run
    link.expected[3] = ipc.KEEP_PER_RANK + 2
    assert link.expected_pair(3) is pairs[-1] and link.fields(3)["peer_ipc"] == PEER_READY
    for p in pairs[:2]:
        p.done[0].done = True
    fresh = object.__new__(ipc.RecvPair)
    fresh.peer_ep, fresh.status, fresh.reason, fresh.done = 99, PEER_READY, None, []
    link.add(4, fresh)
    assert link._retired == [] and link.pairs[99] is fresh


# --- endpoint construction (no process group needed) ---------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        (dict(head_start=-1), ValueError, "head_start must be a non-negative int"),
        (dict(head_start=2), ValueError, "pass total_heads"),
        (dict(head_start=2, total_heads=5), ValueError, "within total_heads=5"),
        (dict(total_heads=0), ValueError, "total_heads must be a positive int"),
        (dict(chunk_bytes=100), ValueError, "chunk_bytes must hold at least one token of this pool (768 bytes"),
        (dict(max_programs=0), ValueError, "max_programs must be a positive int"),
    ],
)
def test_endpoint_rejects_bad_settings(kwargs, error, text):
    with pytest.raises(error, match=text.replace("(", r"\(").replace("[", r"\[")):
        KVSender(_pool(), **kwargs)


def test_endpoint_rejects_a_non_pool():
    with pytest.raises(TypeError, match="pool must be an MHATokenToKVPool or MLATokenToKVPool, got Tensor"):
        KVReceiver(torch.zeros(3))


def test_send_without_process_group_raises_at_once():
    with pytest.raises(RuntimeError, match="init_process_group"):
        KVSender(_pool()).send(torch.arange(3), 1)


@pytest.fixture
def world_of_one():
    """A one-rank gloo group in this process: enough for the checks made before any handshake."""
    import torch.distributed as dist

    from transfer_ranks import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "peer, error, text",
    [
        (0, ValueError, "dst must be another rank of the process group [0], got 0 (this rank is 0)"),
        (3, ValueError, "dst must be another rank of the process group [0], got 3"),
        (True, TypeError, "dst must be an int (a global rank), got bool"),
        ("1", TypeError, "dst must be an int (a global rank), got str"),
    ],
)
def test_a_peer_that_cannot_be_told_raises_at_once(world_of_one, peer, error, text):
    with pytest.raises(error) as info:
        KVSender(_pool()).send(torch.arange(3), peer)
    assert text in str(info.value)


def test_default_staging_is_no_larger_than_the_pool():
    pool = _pool()  # 65 rows of 3 layers x K,V x 4 heads x 32: 768 bytes a token
    assert KVSender(pool).chunk_bytes == 65 * 768  # less than the CPU default of 4 MiB
    assert KVSender(pool, chunk_bytes=4096).chunk_bytes == 4096  # a given size stays


def test_send_kv_keeps_one_endpoint_per_pool_and_settings():
    from kvpool.transfer.endpoint import kept_endpoint as _endpoint

    pool = _pool()
    a = _endpoint(KVSender, pool, None, head_start=0, total_heads=None, chunk_bytes=None)
    assert _endpoint(KVSender, pool, None, head_start=0, total_heads=None, chunk_bytes=None) is a
    assert _endpoint(KVSender, pool, None, head_start=0, total_heads=None, chunk_bytes=4096) is not a
    assert _endpoint(KVReceiver, pool, None, head_start=0, total_heads=None, chunk_bytes=None) is not a
    assert _endpoint(KVSender, _pool(), None, head_start=0, total_heads=None, chunk_bytes=None) is not a


class _Done:
    def wait(self) -> None:
        pass


@pytest.mark.parametrize("max_programs", [None, 5])
@pytest.mark.parametrize("cls", [KVSender, KVReceiver])
def test_fill_and_drain_copies_take_the_whole_grid_unless_capped(monkeypatch, cls, max_programs):
    """The sender's first gather and the receiver's last scatter run with no transport kernel
    beside them: they take copy_rows' whole grid, unless the caller capped every copy; the copies
    that run beside the transport keep the endpoint's cap."""
    from kvpool.transfer import endpoint as ep_module

    grids: list = []
    real_copy_rows = ep_module.copy_rows
    monkeypatch.setattr(ep_module, "copy_rows", lambda *a, max_programs: (grids.append(max_programs), real_copy_rows(*a))[1])
    monkeypatch.setattr(ep_module.dist, "isend", lambda *a, **k: _Done())
    monkeypatch.setattr(ep_module.dist, "irecv", lambda *a, **k: _Done())
    pool = _pool()
    ep = cls(pool, chunk_bytes=4 * 768, max_programs=max_programs)  # 4 tokens a chunk
    ep.max_programs = 7 if max_programs is None else max_programs  # what a CUDA endpoint defaults to
    layout, table, stages = ep._tables_for(0, pool.head_num)
    plan = chunk_plan(10, 4)
    ep._pipeline(ep_module.Route(plan, torch.arange(1, 11), layout, table, stages, 1, None, None))
    edge = 0 if cls is KVSender else len(plan) - 1
    assert len(grids) == len(plan) >= 3
    assert grids[edge] == max_programs  # None: copy_rows' whole grid
    assert all(g == ep.max_programs for i, g in enumerate(grids) if i != edge)


# --- two ranks over gloo -------------------------------------------------------------------------------------

BASE = Side()  # fp8 e4m3, 3 layers x 4 heads x 32, 200 slots, page 1: 768 bytes a token
SMALL_CHUNKS = with_side(BASE, chunk_bytes=8 * 768)  # 8 tokens a chunk: many chunks
P16 = with_side(BASE, size=256, page_size=16)


def _pair(sender: Side, receiver: Side, **kw) -> dict:
    return dict(sides={0: sender, 1: receiver}, transfers=[(0, 1)], **kw)


def _ok(name: str, sender: Side, receiver: Side, **kw) -> Case:
    return Case(name, **_pair(sender, receiver), **kw)


def _fails(name: str, error: str, text: str, sender: Side = BASE, receiver: Side = BASE, **kw) -> Case:
    return Case(name, **_pair(sender, receiver), expect=(error, text), **kw)


def _as(dtype: str, side: Side = BASE, **changes) -> Side:
    return with_side(side, dtype=dtype, **changes)


ODD = Side(dtype="bf16", layers=2, start_layer=5, heads=3, head_dim=96, v_head_dim=64, size=50, page_size=4)
ODD_P16 = with_side(ODD, page_size=16, size=64)
SENDER_HAS = "mismatch: the sender's pool has "
# MLA pools (DeepSeek-V3's 512 + 64 rows; an odd 40 + 24 one): one head, the latent part as K, the
# rotary part as V.
MLA = Side(mla=True, layers=2, heads=1, head_dim=512, v_head_dim=64, size=100)
MLA_SMALL_CHUNKS = with_side(MLA, chunk_bytes=8 * 2 * 576)
MLA_P16 = with_side(MLA, size=112, page_size=16)
MLA_ODD = Side(mla=True, dtype="bf16", layers=2, start_layer=5, heads=1, head_dim=40, v_head_dim=24, size=50)
TWO_RANK_CASES = [
    _ok("fp8_many_chunks_page1_to_page16", SMALL_CHUNKS, P16),
    _ok("bf16_odd_geometry_layers_5_6", ODD, ODD_P16, tokens=7),
    _ok("fp32_one_token", _as("fp32"), _as("fp32"), tokens=1),
    _ok("e5m2_no_tokens", _as("fp8_e5m2"), _as("fp8_e5m2"), tokens=0),
    _ok("fp16_int32_loc_sender_repeats_slots", _as("fp16"), _as("fp16", chunk_bytes=5 * 1536),
        loc_dtype="int32", duplicates=True),  # fmt: skip
    _ok("numpy_loc", BASE, BASE, loc_dtype="numpy"),
    _ok("whole_pool_every_slot", with_side(BASE, size=63), with_side(SMALL_CHUNKS, size=63), tokens=64),
    Case("rank1_sends_to_rank0", sides={0: P16, 1: SMALL_CHUNKS}, transfers=[(1, 0)]),
    Case("three_in_a_row_both_ways", sides={0: SMALL_CHUNKS, 1: BASE}, transfers=[(0, 1), (1, 0), (0, 1)]),
    _fails("dtype", "ValueError", "dtype " + SENDER_HAS + "dtype=torch.float8_e4m3fn, the receiver's has "
           "dtype=torch.bfloat16", receiver=_as("bf16")),  # fmt: skip
    _fails("layer_count", "ValueError", "layers " + SENDER_HAS + "layers=[0, 2], the receiver's has layers=[0, 1]",
           receiver=with_side(BASE, layers=2)),  # fmt: skip
    _fails("start_layer", "ValueError", "layers mismatch", receiver=with_side(BASE, start_layer=1)),
    _fails("head_dim", "ValueError", "head_dim " + SENDER_HAS + "head_dim=32, the receiver's has head_dim=64",
           receiver=with_side(BASE, head_dim=64)),  # fmt: skip
    _fails("v_head_dim", "ValueError", "v_head_dim mismatch", receiver=with_side(BASE, v_head_dim=16)),
    _fails("head_count", "ValueError", "total_heads " + SENDER_HAS + "total_heads=4, the receiver's has "
           "total_heads=2", receiver=with_side(BASE, heads=2)),  # fmt: skip
    _fails("token_count", "ValueError", "tokens " + SENDER_HAS + "tokens=37, the receiver's has tokens=36",
           recv_tokens=36),  # fmt: skip
    _fails("both_send", "ValueError", "role mismatch: rank 0 is a sender and rank 1 is a sender",
           tamper={1: "as_sender"}),  # fmt: skip
    _fails("both_receive", "ValueError", "role mismatch", tamper={0: "as_receiver"}),
    _fails("sender_slot_past_the_end", "IndexError", "the sender's loc[18] = 201 is outside its pool's slots [0, 201)",
           tamper={0: "oob"}),  # fmt: skip
    _fails("receiver_negative_slot", "IndexError", "the receiver's loc[0] = -1 is outside its pool's slots [0, 272)",
           receiver=P16, tamper={1: "neg"}),  # fmt: skip
    _fails("receiver_float_loc", "ValueError", "the receiver's loc must be int32 or int64, got torch.float32",
           tamper={1: "float"}),  # fmt: skip
    _fails("sender_2d_loc", "ValueError", "the sender's loc must be 1-D [T], got shape (1, 37)", tamper={0: "2d"}),
    _fails("sender_list_loc", "TypeError", "got list", tamper={0: "list"}),
    _fails("receiver_device_loc", "ValueError", "host indices", tamper={1: "cuda"}),
    _ok("mla_fp8_deepseek_rows_many_chunks_page1_to_page16", MLA_SMALL_CHUNKS, MLA_P16),
    _ok("mla_bf16_odd_rows_layers_5_6", MLA_ODD, with_side(MLA_ODD, page_size=4, size=60), tokens=9),
    _fails("mla_kv_lora_rank", "ValueError", "head_dim " + SENDER_HAS + "head_dim=512, the receiver's has head_dim=256",
           sender=MLA, receiver=with_side(MLA, head_dim=256)),  # fmt: skip
    _fails("bad_slot_reported_before_geometry", "IndexError", "the sender's loc[18]", receiver=_as("bf16"),
           tamper={0: "oob"}),  # fmt: skip
    _ok("still_in_step_after_the_errors", SMALL_CHUNKS, P16),
]


def test_two_ranks_move_exact_bytes_and_fail_alike(tmp_path):
    outcomes = run_cases(TWO_RANK_CASES, world=2, out=tmp_path)
    check_outcomes(TWO_RANK_CASES, outcomes, world=2)
    multi = outcomes[1]["fp8_many_chunks_page1_to_page16"]["transfers"][0]
    assert multi["tokens"] == 37 and multi["nbytes"] == 37 * 768, multi
    assert multi["chunks"] == len(chunk_plan(37, 8)) >= 3, multi  # both staging halves reused
    assert outcomes[0]["e5m2_no_tokens"]["transfers"][0]["chunks"] == 0


KERNEL_CASES = [  # the Triton kernel (interpreted) on the staging bands and head-sliced pool tables
    _ok("kernel_fp8_many_chunks", SMALL_CHUNKS, P16, tokens=21),
    _ok("kernel_bf16_odd_geometry", ODD, ODD_P16, tokens=5),
    _ok("kernel_mla_fp8_rows", MLA_SMALL_CHUNKS, MLA_P16, tokens=11),
    _ok("kernel_heads_2_to_4_of_4", BASE, Side(heads=2, head_start=2, total_heads=4, chunk_bytes=4 * 384), tokens=9),
]


@needs_interpreter
def test_two_ranks_through_the_copy_kernel(tmp_path):
    outcomes = run_cases(KERNEL_CASES, world=2, out=tmp_path, kernel=True)
    check_outcomes(KERNEL_CASES, outcomes, world=2)


# --- three ranks: tensor-parallel re-sharding --------------------------------------------------------------

FULL = Side(heads=4, total_heads=4, chunk_bytes=6 * 768)
LOW = Side(heads=2, head_start=0, total_heads=4, page_size=16, size=256)
HIGH = Side(heads=2, head_start=2, total_heads=4, chunk_bytes=3 * 384)
TP2 = {1: LOW, 2: HIGH}
RESHARD_CASES = [
    Case("tp1_to_tp2", sides={0: FULL, **TP2}, transfers=[(0, 1), (0, 2)]),
    Case("tp2_to_tp1_same_slots", sides={0: with_side(FULL, page_size=16, size=256), **TP2},
         transfers=[(1, 0), (2, 0)], same_slots=True),  # fmt: skip
    Case("partial_overlap_heads_1_to_3", transfers=[(0, 2)],
         sides={0: Side(heads=3, head_start=1, total_heads=4), 2: Side(heads=2, head_start=0, total_heads=4)}),  # fmt: skip
    Case("subgroup_0_2", sides={0: LOW, 2: with_side(FULL, chunk_bytes=None)}, transfers=[(0, 2)], group=(0, 2)),
    Case("disjoint_heads", sides=TP2, transfers=[(1, 2)],
         expect=("ValueError", "heads " + SENDER_HAS + "heads=[0, 2], the receiver's has heads=[2, 4]")),  # fmt: skip
    Case("model_head_count", sides={0: FULL, 2: with_side(HIGH, total_heads=8)}, transfers=[(0, 2)],
         expect=("ValueError", "total_heads mismatch")),  # fmt: skip
    Case("tp1_to_tp2_again", sides={0: FULL, **TP2}, transfers=[(0, 2), (0, 1)]),
]


def test_three_ranks_reshard_heads_between_tp_sizes(tmp_path):
    outcomes = run_cases(RESHARD_CASES, world=3, out=tmp_path)
    check_outcomes(RESHARD_CASES, outcomes, world=3)
    sent = outcomes[0]["tp1_to_tp2"]["transfers"]
    assert [t["heads"] for t in sent] == [[0, 2], [2, 4]]
    assert outcomes[2]["partial_overlap_heads_1_to_3"]["transfers"][0]["heads"] == [1, 2]


# --- hybrid models: the linear-attention state -----------------------------------------------------------

G = StateGeom()  # GDN bands "kkv": 2 key heads x 8, 4 value heads x 4, conv (48, 3) bf16, SSM (4, 4, 8) fp32
HYB = Side(state=G, size=120)  # 3 full-attention layers (3, 7, 11) beside the 5 linear ones
WHOLE = with_side(HYB, state=replace(G, bands=None))
# 1 KiB chunks: one token (768 bytes) or one layer's conv window and SSM state (288 + 512) each.
HYB_SMALL = with_side(HYB, chunk_bytes=1024)
WHOLE_SMALL = with_side(WHOLE, chunk_bytes=1024)
MAMBA2_SIDE = with_side(HYB, state=replace(G, bands="vkk", conv_dtype="fp16", ssm_dtype="bf16"))
ODD_STATE = with_side(HYB, state=replace(G, k_heads=1, v_heads=3, k_dim=5, v_dim=3, conv_kernel=2, slots=7,
                                         linear=(0, 2, 5, 9)))  # fmt: skip


def _state_pair(name: str, sender: Side, receiver: Side, **kw) -> Case:
    kw.setdefault("states", 3)
    return Case(name, **_pair(sender, receiver), **kw)


HYBRID_CASES = [
    _state_pair("whole_state_many_chunks", WHOLE_SMALL, with_side(WHOLE, page_size=4), tokens=21),
    _state_pair("gdn_bands_many_chunks", HYB_SMALL, with_side(HYB, page_size=16, size=128), tokens=13),
    _state_pair("mamba2_bands_fp16_conv_bf16_ssm", MAMBA2_SIDE, MAMBA2_SIDE, states=1),
    _state_pair("odd_state_geometry", ODD_STATE, ODD_STATE, states=8, tokens=5),
    _state_pair("states_only_no_tokens", HYB, HYB, tokens=0, states=2),
    _state_pair("kv_only_between_hybrid_pools", HYB, HYB, states=0),
    Case("hybrid_both_ways", sides={0: HYB_SMALL, 1: HYB}, transfers=[(0, 1), (1, 0)], states=2),
    _fails("conv_dtype", "ValueError", "conv_dtype " + SENDER_HAS + "conv_dtype=torch.bfloat16, the receiver's "
           "has conv_dtype=torch.float16", HYB, with_side(HYB, state=replace(G, conv_dtype="fp16")), states=1),  # fmt: skip
    _fails("ssm_dtype", "ValueError", "ssm_dtype mismatch", HYB, with_side(HYB, state=replace(G, ssm_dtype="bf16")),
           states=1),  # fmt: skip
    _fails("linear_layers", "ValueError", "linear_layers " + SENDER_HAS + "linear_layers=5 ids in [0, 5], the "
           "receiver's has linear_layers=4 ids in [0, 5]", HYB, with_side(HYB, state=replace(G, linear=(0, 1, 4, 5))),
           states=1),  # fmt: skip
    _fails("conv_bands", "ValueError", "conv_bands " + SENDER_HAS + "conv_bands=('kkv',), the receiver's has "
           "conv_bands=None", HYB, WHOLE, states=1),  # fmt: skip
    _fails("ssm_head_dim", "ValueError", "ssm_k_head_dim mismatch", HYB, with_side(HYB, state=replace(G, k_dim=4)),
           states=1),  # fmt: skip
    _fails("whole_conv_shape", "ValueError", "conv " + SENDER_HAS + "conv=[(48, 3)], the receiver's has "
           "conv=[(48, 2)]", WHOLE, with_side(WHOLE, state=replace(WHOLE.state, conv_kernel=3)), states=1),  # fmt: skip
    _fails("state_count", "ValueError", "states " + SENDER_HAS + "states=3, the receiver's has states=2",
           HYB, HYB, states=3, recv_states=2),  # fmt: skip
    _fails("states_to_a_pool_without_state", "ValueError", "states mismatch: the sender's pool has states=2, the "
           "receiver's has states=0 (slots in state_slots); the receiver's pool has no linear-attention state",
           HYB, Side(hybrid=True), states=2, tokens=4),  # fmt: skip
    _fails("state_slots_for_a_plain_pool", "ValueError", "the receiver's state_slots need a pool with "
           "linear-attention state", BASE, BASE, tamper={1: "state_given"}),  # fmt: skip
    _fails("sender_state_slot_past_the_end", "IndexError", "the sender's state_slots[2] = 13 is outside its state "
           "pool's slots [0, 13)", HYB, HYB, states=3, tamper={0: "state_oob"}),  # fmt: skip
    _fails("receiver_negative_state_slot", "IndexError", "the receiver's state_slots[0] = -1", HYB, HYB, states=3,
           tamper={1: "state_neg"}),  # fmt: skip
    _fails("receiver_float_state_slots", "ValueError", "the receiver's state_slots must be int32 or int64, got "
           "torch.float32", HYB, HYB, states=3, tamper={1: "state_float"}),  # fmt: skip
    _fails("hybrid_layer_ids_against_consecutive_ones", "ValueError", "layers " + SENDER_HAS + "layers=3 ids in "
           "[3, 11], the receiver's has layers=9 ids in [3, 11] (the KV layer ids differ)", HYB,
           Side(layers=9, start_layer=3), tokens=4),  # fmt: skip
    _state_pair("hybrid_still_in_step", HYB_SMALL, HYB, states=2),
]


def test_two_ranks_move_states_with_the_kv_and_fail_alike(tmp_path):
    outcomes = run_cases(HYBRID_CASES, world=2, out=tmp_path)
    check_outcomes(HYBRID_CASES, outcomes, world=2)
    many = outcomes[1]["whole_state_many_chunks"]["transfers"][0]
    assert many["states"] == 3 and many["state_nbytes"] == 3 * 5 * (288 + 512), many
    assert many["nbytes"] == 21 * 768 + many["state_nbytes"], many
    assert many["chunks"] == 21 + 5 * 3, many  # 1 token a chunk; one layer's (conv, SSM) of one slot a chunk
    only = outcomes[0]["states_only_no_tokens"]["transfers"][0]
    assert only["tokens"] == 0 and only["states"] == 2 and only["chunks"] >= 1, only
    assert outcomes[1]["kv_only_between_hybrid_pools"]["transfers"][0]["state_nbytes"] == 0
    assert all(t["path"] == "staged" and "host memory" in t["path_reason"] for o in outcomes
               for c in o.values() if c.get("outcome") == "ok" for t in c["transfers"])  # fmt: skip


HYBRID_KERNEL_CASES = [  # state bands and staging through the Triton kernel (interpreted)
    _state_pair("kernel_gdn_bands_many_chunks", HYB_SMALL, with_side(HYB, page_size=4), tokens=5, states=2),
    _state_pair("kernel_whole_state", WHOLE, WHOLE, tokens=3, states=2),
]


@needs_interpreter
def test_two_ranks_move_states_through_the_copy_kernel(tmp_path):
    outcomes = run_cases(HYBRID_KERNEL_CASES, world=2, out=tmp_path, kernel=True)
    check_outcomes(HYBRID_KERNEL_CASES, outcomes, world=2)


# Tensor-parallel re-sharding of the state: 4 key heads x 8 and 8 value heads x 4 in all, GDN bands.
SG_FULL = replace(G, k_heads=4, v_heads=8)
SG_LOW = replace(G, k_heads=2, v_heads=4, total_k=4, total_v=8)
SG_HIGH = replace(SG_LOW, k_start=2, v_start=4, slots=9)
S_FULL, S_LOW, S_HIGH = Side(state=SG_FULL, size=120), Side(state=SG_LOW, size=120), Side(state=SG_HIGH, size=120)
# Two key heads over four ranks: each rank holds the key head its two value heads use.
SG_REPL = replace(G, k_heads=2, v_heads=8, total_k=2, total_v=8)
SG_R1 = replace(G, k_heads=1, v_heads=2, v_start=2, k_start=0, total_k=2, total_v=8)
SG_R2 = replace(SG_R1, v_start=4, k_start=1)
M2 = replace(SG_FULL, bands="vkk")
STATE_RESHARD_CASES = [
    Case("state_tp1_to_tp2_with_kv_heads", sides={0: with_side(S_FULL, heads=4),
         1: with_side(S_LOW, heads=2, total_heads=4), 2: with_side(S_HIGH, heads=2, head_start=2, total_heads=4)},
         transfers=[(0, 1), (0, 2)], states=3, tokens=11),  # fmt: skip
    Case("state_tp2_to_tp1_same_slots", sides={0: S_FULL, 1: S_LOW, 2: S_HIGH}, transfers=[(1, 0), (2, 0)],
         states=2, same_slots=True),  # fmt: skip
    Case("state_mamba2_tp1_to_tp2", sides={0: Side(state=M2), 1: Side(state=replace(SG_LOW, bands="vkk")),
         2: Side(state=replace(SG_HIGH, bands="vkk"))}, transfers=[(0, 1), (0, 2)], states=2),  # fmt: skip
    Case("state_replicated_key_heads", sides={0: Side(state=SG_REPL), 1: Side(state=SG_R1), 2: Side(state=SG_R2)},
         transfers=[(0, 1), (0, 2), (1, 0)], states=2, tokens=3),  # fmt: skip
    Case("state_disjoint_value_heads", sides={1: S_LOW, 2: S_HIGH}, transfers=[(1, 2)], states=1,
         expect=("ValueError", "v_heads " + SENDER_HAS + "v_heads=[0, 4], the receiver's has v_heads=[4, 8]")),  # fmt: skip
    Case("state_model_value_heads", sides={0: S_FULL, 2: with_side(S_HIGH, state=replace(SG_HIGH, total_v=16))},
         transfers=[(0, 2)], states=1, expect=("ValueError", "total_v_heads mismatch")),  # fmt: skip
    Case("state_tp1_to_tp2_again", sides={0: S_FULL, 1: S_LOW, 2: S_HIGH}, transfers=[(0, 2), (0, 1)], states=1),
]


def test_three_ranks_reshard_the_state_between_tp_sizes(tmp_path):
    outcomes = run_cases(STATE_RESHARD_CASES, world=3, out=tmp_path)
    check_outcomes(STATE_RESHARD_CASES, outcomes, world=3)
    sent = outcomes[0]["state_tp1_to_tp2_with_kv_heads"]["transfers"]
    # Half the key and value heads of each layer: (2 x 8 q + 2 x 8 k + 4 x 4 v channels) x 3 columns x
    # 2 bytes of convolution window and 4 x 4 x 8 x 4 bytes of SSM state, 5 layers, 3 slots.
    assert [t["state_nbytes"] for t in sent] == [3 * 5 * (288 + 512)] * 2, sent


# --- the example ---------------------------------------------------------------------------------------------


def _disagg_sim(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, str(ROOT / "examples" / "disagg_sim.py"), "--device", "cpu", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)


def test_disagg_sim_example_checks_every_byte():
    run = _disagg_sim("--requests", "10")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "PASS" in run.stdout and "GB/s" in run.stdout, run.stdout
    bad = _disagg_sim("--requests", "3", "--corrupt")
    assert bad.returncode == 1 and "FAILED: 1 tokens differ on arrival" in bad.stdout, bad.stdout + bad.stderr


def test_disagg_sim_example_moves_hybrid_states_and_checks_them():
    run = _disagg_sim("--model", "qwen3.5", "--requests", "6", "--decode-page-size", "4")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "PASS" in run.stdout and "6 states x 6 linear layers byte-equal on arrival" in run.stdout, run.stdout
    bad = _disagg_sim("--model", "qwen3.5", "--requests", "2", "--corrupt")
    assert bad.returncode == 1 and "0 tokens differ on arrival" in bad.stdout, bad.stdout + bad.stderr
    assert "1 states differ on arrival" in bad.stdout and "linear layer" in bad.stdout, bad.stdout


# --- the handshake's timeout paths (the store) ----------------------------------------------------------


def _leftover_keys(store, transfers: int) -> list[str]:
    """The handshake keys of ranks 0 and 1's first ``transfers`` transfers still in the store."""
    name = dist.group.WORLD.group_name
    keys = [f"kvpool/transfer/0-1/{name}/{seq}/{r}" for seq in range(transfers) for r in range(2)]
    return [k for k in keys if store.check([k])]


def _late_peer_rank(rank: int, port: int, out: str) -> None:
    """Rank 0 sends three times; rank 1 misses the first transfer (it starts its side only after rank
    0's store wait has timed out, and once raises before any handshake), then both carry on."""
    from kvpool import KVReceiver, KVSender, MHATokenToKVPool

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=2))  # fmt: skip
    store = dist.distributed_c10d._get_default_store()
    report: dict = {"errors": [], "moved": []}
    try:
        pool = MHATokenToKVPool(64, 1, torch.float8_e4m3fn, 2, 16, 2, "cpu", warmup=False)
        for b in pool.k_buffer + pool.v_buffer:
            b.fill_(10 + rank)
        loc = torch.arange(1, 9)
        ep = KVSender(pool) if rank == 0 else KVReceiver(pool)

        def attempt():
            try:
                (ep.send(loc, 1) if rank == 0 else ep.recv(loc, 0)).wait()
                report["moved"].append(True)
            except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
                report["errors"].append(f"{type(exc).__name__}: {exc}")

        if rank == 1:
            time.sleep(3.5)  # rank 0's first send times out (2 s) and withdraws meanwhile
            try:
                ep.recv(loc, 1)  # its own rank: raises before any handshake
            except ValueError as exc:
                report["early"] = str(exc)
        attempt()  # rank 0: times out; rank 1 (late): finds the withdrawn header
        dist.barrier()
        attempt()  # both in step again: moves
        dist.barrier()
        report["seen"] = pool.k_buffer[0][1:9].view(torch.uint8).float().mean().item()
        report["leftover"] = _leftover_keys(store, 3)
    finally:
        Path(out, f"late{rank}.json").write_text(json.dumps(report))
        dist.destroy_process_group()


def _run_pair(rank_fn, name: str, tmp_path) -> tuple[dict, dict]:
    """Run ``rank_fn(rank, port, out)`` on two ranks and return the reports they wrote to
    ``out/<name><rank>.json`` (rank 0's first)."""
    spawn(rank_fn, 2, (free_port(), str(tmp_path)), timeout=60)
    return tuple(json.loads(Path(tmp_path, f"{name}{r}.json").read_text()) for r in range(2))  # type: ignore[return-value]


def test_a_late_peer_raises_once_and_the_pair_stays_in_step(tmp_path):
    sender, receiver = _run_pair(_late_peer_rank, "late", tmp_path)
    assert len(sender["errors"]) == 1 and "did not start its side" in sender["errors"][0], sender
    assert len(receiver["errors"]) == 1 and "gave up waiting" in receiver["errors"][0], receiver
    assert "another rank" in receiver["early"], receiver
    assert sender["moved"] == receiver["moved"] == [True], (sender, receiver)
    assert receiver["seen"] == 10.0, "the second transfer carried the sender's rows"
    assert sender["leftover"] == receiver["leftover"] == [], "a handshake key was left in the store"


class _CountingStore:
    """The default store, recording the name of every operation the handshake makes."""

    def __init__(self, store) -> None:
        self.store, self.ops = store, []

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def call(*args, **kwargs):
            self.ops.append(name)
            return method(*args, **kwargs)

        return call


def _predicted_rank(rank: int, port: int, out: str) -> None:
    """Four transfers; rank 1 always arrives second. The second and third can be predicted from the
    first (the third with another token count on both sides), the fourth cannot (token counts differ)."""
    from kvpool import KVReceiver, KVSender, MHATokenToKVPool
    from kvpool.transfer import endpoint

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=20))  # fmt: skip
    counting = _CountingStore(dist.distributed_c10d._get_default_store())
    endpoint._default_store = lambda: counting
    report: dict = {"ops": [], "errors": [], "rows": []}
    try:
        pool = MHATokenToKVPool(64, 1, torch.float8_e4m3fn, 2, 16, 2, "cpu", warmup=False)
        ep = KVSender(pool) if rank == 0 else KVReceiver(pool)
        for i, (n_send, n_recv) in enumerate(((8, 8), (8, 8), (4, 4), (4, 5))):
            n = n_send if rank == 0 else n_recv
            loc = torch.arange(1 + 8 * i, 1 + 8 * i + n)
            if rank == 0:
                for b in pool.k_buffer + pool.v_buffer:
                    b.view(torch.uint8)[loc] = 20 + i
            dist.barrier()
            if rank == 1:
                time.sleep(1.0)  # the sender is waiting in the store by then
            counting.ops.clear()
            try:
                (ep.send(loc, 1) if rank == 0 else ep.recv(loc, 0)).wait()
            except ValueError as exc:
                report["errors"].append((i, str(exc)))
            report["ops"].append(list(counting.ops))
            report["rows"].append(pool.v_buffer[1].view(torch.uint8)[loc].unique().tolist())
        dist.barrier()
        report["leftover"] = _leftover_keys(counting.store, 4)
    finally:
        Path(out, f"predicted{rank}.json").write_text(json.dumps(report))
        dist.destroy_process_group()


def test_a_predictable_header_is_read_and_claimed_in_one_round_trip(tmp_path):
    sender, receiver = _run_pair(_predicted_rank, "predicted", tmp_path)
    first, second, third, fourth = receiver["ops"]
    assert first == ["set", "get", "compare_set", "delete_key"], first  # nothing to predict from yet
    assert second == third == ["set", "compare_set", "delete_key"], (second, third)
    assert fourth[:2] == ["set", "compare_set"] and "get" not in fourth, fourth  # a miss: the header was there
    # The sender arrived first: its guess found no key, so it waited for the receiver's header.
    assert sender["ops"][1] == ["set", "compare_set", "get", "compare_set", "delete_key"], sender["ops"]
    assert receiver["rows"][:3] == [[20], [21], [22]], receiver["rows"]
    assert [i for i, _ in sender["errors"]] == [i for i, _ in receiver["errors"]] == [3]
    assert sender["errors"][0][1] == receiver["errors"][0][1] and "tokens mismatch" in sender["errors"][0][1]
    assert sender["leftover"] == receiver["leftover"] == [], "a handshake key was left in the store"


# --- a peer that fails mid-transfer -----------------------------------------------------------------------

_PEER_TIMEOUT = 3.0  # the process group's timeout (seconds)


def _failing_peer_rank(rank: int, port: int, out: str, mode: str) -> None:
    """Rank 0 sends 64 tokens in 8-token chunks to rank 1; after its second chunk has left, the
    sender dies (``sender-dies``) or stops for twice the timeout (``sender-stalls``), or, after its
    first scatter, the receiver dies (``receiver-dies``). The survivor reports what it raised, how
    long it took and its pool."""
    from kvpool import KVReceiver, KVSender, MHATokenToKVPool
    from kvpool.transfer.endpoint import Endpoint

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=_PEER_TIMEOUT))  # fmt: skip
    pool = MHATokenToKVPool(256, 1, torch.float8_e4m3fn, 2, 16, 2, "cpu", warmup=False)
    g = torch.Generator().manual_seed(rank)
    for b in pool.k_buffer + pool.v_buffer:
        b.copy_(torch.randint(0, 256, b.shape, generator=g, dtype=torch.uint8))
    before = [b.clone() for b in pool.k_buffer + pool.v_buffer]
    loc = torch.arange(100, 164)
    dies = mode == "receiver-dies" if rank == 1 else mode.startswith("sender")
    if dies and rank == 0:
        real_isend, sent = dist.isend, []

        def isend(tensor, dst, group=None, tag=0):
            work = real_isend(tensor, dst, group=group, tag=tag)
            sent.append(work)
            if len(sent) == 2:  # the first two chunks are on their way; the rest never come
                work.wait()
                if mode == "sender-stalls":
                    time.sleep(2 * _PEER_TIMEOUT)
                os._exit(0)
            return work

        dist.isend = isend
    if dies and rank == 1:
        real_copy = Endpoint._copy

        def copy(self, *args, **kwargs):
            real_copy(self, *args, **kwargs)
            os._exit(0)  # after the first chunk's scatter

        Endpoint._copy = copy
    ep = KVSender(pool, chunk_bytes=8 * 128) if rank == 0 else KVReceiver(pool, chunk_bytes=8 * 128)
    start = time.monotonic()
    report: dict = {"error": None}
    try:
        (ep.send(loc, 1) if rank == 0 else ep.recv(loc, 0)).wait()
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
        report["error"] = f"{type(exc).__name__}: {exc}"
    report["seconds"] = time.monotonic() - start
    target = torch.zeros(pool.size + pool.page_size, dtype=torch.bool)
    target[loc] = True
    after = pool.k_buffer + pool.v_buffer
    report["others_unchanged"] = all(torch.equal(a[~target], b[~target]) for a, b in zip(after, before))
    report["targets_unchanged"] = all(torch.equal(a[target], b[target]) for a, b in zip(after, before))
    Path(out, f"{mode}{rank}.json").write_text(json.dumps(report))
    os._exit(0)  # the peer is gone: no collective teardown


@pytest.mark.parametrize("mode", ["sender-dies", "sender-stalls", "receiver-dies"])
def test_a_peer_failing_mid_transfer_leaves_only_the_receivers_target_slots_unspecified(tmp_path, mode):
    """docs/contract.md: after a failed transfer the receiver's target slots hold unspecified bytes
    (some rows may have arrived) and nothing else in either pool changes; a receiver whose sender
    fails raises within the process group's timeout."""
    assert len(chunk_plan(64, 8)) >= 4, "the transfer must still be moving when the peer fails"
    spawn(_failing_peer_rank, 2, (free_port(), str(tmp_path), mode), timeout=60)
    survivor = 1 if mode.startswith("sender") else 0
    report = json.loads(Path(tmp_path, f"{mode}{survivor}.json").read_text())
    assert report["others_unchanged"], report
    if survivor == 1:
        assert report["error"] is not None and report["seconds"] < _PEER_TIMEOUT + 5, report
        assert not report["targets_unchanged"], "the first chunks arrived before the sender failed"
    else:  # the sender only reads its pool; its sends may all have left before the receiver died
        assert report["targets_unchanged"], report
