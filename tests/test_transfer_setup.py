"""What KV transfer between ranks decides before a byte moves (docs/contract.md, "KV transfer between
ranks"), in process: the chunk plan and the token layout; the handshake (headers round-tripping
through a cut message, the agreement on common heads and chunks, the mismatched field named whichever
header comes first); the linear-attention state on the wire (shards, sides, band spans, the state
plan); the path picked from both headers and the direct path's setup (CUDA IPC mocked); and the
endpoints built without a process group (bad settings, a peer that cannot be told, staging size, one
endpoint per pool and settings, the fill and drain copies' grid).
"""

from __future__ import annotations

from datetime import timedelta

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
from kvassert import scaled_pool


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


SCALED_MISMATCHES = [  # (field named in the message, the sender's pool, the receiver's)
    ("kv_format", dict(kind="nvfp4"), dict(kind="fp4")),
    ("global_scales", dict(kind="nvfp4"), dict(kind="nvfp4", k_global_scales=[0.5, 2.0])),
    ("kv_format", dict(kind="fp8_token_head"), None),  # against an MHATokenToKVPool of the same geometry
    ("dtype", dict(kind="fp4"), dict(kind="fp8_token_head")),
]


@pytest.mark.parametrize("field, sender, receiver", SCALED_MISMATCHES,
                         ids=[f"{s['kind']}_{f}" for f, s, _ in SCALED_MISMATCHES])  # fmt: skip
def test_agree_names_a_mismatched_row_format_whichever_header_comes_first(field, sender, receiver):
    s_pool = scaled_pool(sender.pop("kind"), "cpu", **sender)
    r_pool = _pool(head_num=3, head_dim=8, v_head_dim=4, layer_num=2, start_layer=2) if receiver is None else (
        scaled_pool(receiver.pop("kind"), "cpu", **receiver))  # fmt: skip
    s = make_header(SENDER, 0, s_pool, 0, 3, 10, 4096)
    r = make_header(RECEIVER, 1, r_pool, 0, 3, 10, 4096)
    verdict = agree(s, r)
    assert verdict == agree(r, s)
    assert isinstance(verdict, Refusal) and verdict.error is ValueError
    assert f"{field} mismatch: the sender's pool has {field}=" in verdict.message, verdict.message
    assert verdict.message.endswith("nothing moved")


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
    with pytest.raises(TypeError, match=r"pool must be an MHATokenToKVPool, MLATokenToKVPool, .*\(or a "
                       r"HybridLinearKVPool holding one\), got Tensor"):
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
