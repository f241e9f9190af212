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
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from kvpool import KVReceiver, KVSender, MHATokenToKVPool
from kvpool.transfer.handshake import (
    HEADER_BYTES,
    MESSAGE_BYTES,
    RECEIVER,
    SENDER,
    Agreement,
    Header,
    Refusal,
    agree,
    make_header,
)
from kvpool.transfer import wire
from kvpool.transfer.wire import RAMP, TokenLayout, chunk_plan
from kvassert import needs_interpreter
from transfer_ranks import Case, Side, check_outcomes, free_port, run_cases, spawn, with_side

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
