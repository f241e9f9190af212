"""KV transfer between ranks on GPUs (docs/contract.md, "KV transfer between ranks").

Two GPUs (skipped without): one process per GPU (rank r on cuda:r), over NCCL, each test once on
the staged path (endpoints built with ``ipc=False``) and once on the direct one (the receiver reads
the sender's rows through CUDA IPC). The case battery of the CPU suite runs here too (bytes exact,
nothing else changed, the same error on both ranks), hybrid models' states included, plus what only
a GPU shows: ``send``/``recv`` return while the caller's stream is still busy (no synchronisation of
the compute stream), the transfer still sees the writes queued on that stream before it and is seen
by the work queued after ``wait()``, the sender's slots may be overwritten once ``wait()`` returns
even while the receiver is held up, and repeated transfers allocate no device memory.
``NCCL_NVLS_ENABLE=0`` is set (no NVLink multicast).

One GPU: two processes on the same GPU move rows through the direct path (CUDA IPC works between
processes on one device): the same battery checked byte for byte, and the stream and reuse tests
(``-k one_gpu`` selects these).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from transfer_ranks import (
    Case,
    Side,
    StateGeom,
    check_outcomes,
    free_port,
    paths_taken,
    run_cases,
    spawn,
    with_ipc,
    with_side,
)

pytestmark = [pytest.mark.gpu]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
one_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
PATHS = ["staged", "ipc"]
STAGED_REASON = "the sender's endpoint was built with ipc=False"

ROOT = Path(__file__).resolve().parents[1]

BASE = Side(size=600)  # fp8 e4m3, 3 layers x 4 heads x 32: 768 bytes a token
SMALL_CHUNKS = with_side(BASE, chunk_bytes=8 * 768)
P16 = with_side(BASE, size=640, page_size=16)
ODD = Side(dtype="bf16", layers=2, start_layer=5, heads=3, head_dim=96, v_head_dim=64, size=50, page_size=4)
# Llama-3-8B geometry (32 layers, 8 KV heads x 128, FP8: 64 KiB a token), 8 MiB chunks.
LLAMA = Side(layers=32, heads=8, head_dim=128, size=5000, chunk_bytes=8 << 20)
LLAMA_P16 = with_side(LLAMA, size=5120, page_size=16, chunk_bytes=None)
HIGH = Side(heads=2, head_start=2, total_heads=4, size=600, chunk_bytes=3 * 384)
LOW = Side(heads=2, head_start=0, total_heads=4, size=640, page_size=16)


def _pair(sender, receiver, **kw):
    return dict(sides={0: sender, 1: receiver}, transfers=[(0, 1)], **kw)


GPU_CASES = [
    Case("fp8_many_chunks_page1_to_page16", **_pair(SMALL_CHUNKS, P16), tokens=301),
    Case("bf16_odd_geometry", **_pair(ODD, with_side(ODD, page_size=16, size=64)), tokens=7),
    Case("fp32_one_token", **_pair(with_side(BASE, dtype="fp32"), with_side(BASE, dtype="fp32")), tokens=1),
    Case("no_tokens", **_pair(BASE, BASE), tokens=0),
    Case("fp16_int32_loc_repeats", **_pair(with_side(BASE, dtype="fp16"), with_side(BASE, dtype="fp16")),
         loc_dtype="int32", duplicates=True),  # fmt: skip
    Case("llama_4k_tokens_page1_to_page16", **_pair(LLAMA, LLAMA_P16), tokens=4096),
    Case("rank1_to_rank0", sides={0: P16, 1: SMALL_CHUNKS}, transfers=[(1, 0)], tokens=200),
    Case("both_ways_in_a_row", sides={0: SMALL_CHUNKS, 1: BASE}, transfers=[(0, 1), (1, 0), (0, 1)], tokens=100),
    Case("all_heads_to_upper_half", **_pair(BASE, HIGH), tokens=50),
    Case("mla_deepseek_rows_2k_tokens_page1_to_page16",  # MLA pools: latent (K) and rotary (V) parts, one head
         **_pair(Side(mla=True, layers=4, heads=1, head_dim=512, v_head_dim=64, size=3000, chunk_bytes=1 << 20),
                 Side(mla=True, layers=4, heads=1, head_dim=512, v_head_dim=64, size=3008, page_size=16)),
         tokens=2048),  # fmt: skip
    Case("lower_half_to_all_heads", **_pair(LOW, BASE), tokens=50),
    Case("dtype", **_pair(BASE, with_side(BASE, dtype="bf16")), expect=("ValueError", "dtype mismatch")),
    Case("token_count", **_pair(BASE, BASE), recv_tokens=36, expect=("ValueError", "tokens mismatch")),
    Case("both_send", **_pair(BASE, BASE), tamper={1: "as_sender"}, expect=("ValueError", "role mismatch")),
    Case("sender_slot_past_the_end", **_pair(BASE, BASE), tamper={0: "oob"},
         expect=("IndexError", "the sender's loc[18] = 601")),  # fmt: skip
    Case("receiver_negative_slot", **_pair(BASE, BASE), tamper={1: "neg"},
         expect=("IndexError", "the receiver's loc[0] = -1")),  # fmt: skip
    Case("receiver_cuda_loc", **_pair(BASE, BASE), tamper={1: "cuda"}, expect=("ValueError", "host indices")),
    Case("disjoint_heads", **_pair(LOW, HIGH), expect=("ValueError", "heads mismatch")),
    Case("still_in_step", **_pair(SMALL_CHUNKS, P16), tokens=301),
]


# Hybrid models: Qwen3.5-397B's per-rank geometry at TP8 (15 full-attention layers of one FP8 KV
# head x 256; 45 Gated DeltaNet layers whose slot holds a (1536, 3) bf16 window and an (8, 128, 128)
# float32 state: 23 MiB) and a small one re-sharded between TP1 and TP2.
QWEN_TP8 = Side(layers=15, heads=1, head_dim=256, size=9000, state=StateGeom(
    k_heads=2, v_heads=8, k_dim=128, v_dim=128, total_k=16, total_v=64, slots=4,
    linear=tuple(i for i in range(60) if (i + 1) % 4)))  # fmt: skip
SG = StateGeom(k_heads=4, v_heads=8, k_dim=16, v_dim=8, slots=6)
S_FULL = Side(state=SG, size=600)
S_HIGH = Side(state=replace(SG, k_heads=2, v_heads=4, k_start=2, v_start=4, total_k=4, total_v=8), size=600)
HYBRID_GPU_CASES = [
    Case("qwen35_tp8_4k_tokens_and_states", **_pair(QWEN_TP8, with_side(QWEN_TP8, size=9008, page_size=16)),
         tokens=4096, states=3),  # fmt: skip
    Case("qwen35_states_only", **_pair(QWEN_TP8, QWEN_TP8), tokens=0, states=2),
    Case("state_tp1_to_upper_tp2_half", **_pair(S_FULL, S_HIGH), tokens=300, states=4),
    Case("state_upper_tp2_half_to_tp1", **_pair(S_HIGH, S_FULL), tokens=300, states=4),
    Case("ssm_dtype", **_pair(S_FULL, with_side(S_FULL, state=replace(SG, ssm_dtype="bf16"))), states=1,
         expect=("ValueError", "ssm_dtype mismatch")),  # fmt: skip
    Case("state_slot_past_the_end", **_pair(S_FULL, S_FULL), states=2, tamper={1: "state_oob"},
         expect=("IndexError", "the receiver's state_slots[1] = 7")),  # fmt: skip
    Case("hybrid_still_in_step", **_pair(S_FULL, S_FULL), tokens=50, states=2),
]


def _check_paths(cases, outcomes, path):
    taken = paths_taken(cases, outcomes)
    assert taken == ({("staged", STAGED_REASON)} if path == "staged" else {("ipc", None)}), taken


@two_gpus
@pytest.mark.parametrize("path", PATHS)
def test_gpu_two_ranks_move_exact_bytes_and_fail_alike(tmp_path, path):
    cases = with_ipc(GPU_CASES, path == "ipc")
    outcomes = run_cases(cases, world=2, out=tmp_path, backend="nccl", timeout=300)
    check_outcomes(cases, outcomes, world=2)
    _check_paths(cases, outcomes, path)
    llama = outcomes[1]["llama_4k_tokens_page1_to_page16"]["transfers"][0]
    assert llama["nbytes"] == 4096 * 65536 and llama["chunks"] > (20 if path == "staged" else 0), llama


@two_gpus
@pytest.mark.parametrize("path", PATHS)
def test_gpu_two_ranks_move_hybrid_states(tmp_path, path):
    cases = with_ipc(HYBRID_GPU_CASES, path == "ipc")
    outcomes = run_cases(cases, world=2, out=tmp_path, backend="nccl", timeout=300)
    check_outcomes(cases, outcomes, world=2)
    _check_paths(cases, outcomes, path)
    qwen = outcomes[1]["qwen35_tp8_4k_tokens_and_states"]["transfers"][0]
    assert qwen["state_nbytes"] == 3 * 45 * (1536 * 3 * 2 + 8 * 128 * 128 * 4), qwen
    assert qwen["nbytes"] == 4096 * 15 * 2 * 256 + qwen["state_nbytes"], qwen


ONE_GPU_CASES = GPU_CASES + HYBRID_GPU_CASES


@one_gpu
def test_ipc_between_two_processes_on_one_gpu(tmp_path):
    """Sender and receiver are two processes on cuda:0: every transfer that moves rows reads the
    sender's buffers through CUDA IPC (the staged path could not run: NCCL takes no two ranks on one
    GPU), every byte checked as on two GPUs."""
    outcomes = run_cases(ONE_GPU_CASES, world=2, out=tmp_path, backend="nccl-one-gpu", timeout=300)
    check_outcomes(ONE_GPU_CASES, outcomes, world=2)
    _check_paths(ONE_GPU_CASES, outcomes, "ipc")


# --- streams and memory ------------------------------------------------------------------------------------

def _gate_kernel():
    """A kernel that spins until a pinned host flag becomes non-zero: it holds a stream busy for
    exactly as long as the test wants (a timed sleep did not reliably outlast the checks)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _wait_for_flag(flag_ptr, max_polls):
        polls = 0
        while (tl.load(flag_ptr, volatile=True) == 0) & (polls < max_polls):
            polls += 1

    return _wait_for_flag


# Each poll reads host memory over PCIe (about a microsecond): the gate gives up after a few seconds
# rather than hang the test if the flag were never seen.
MAX_POLLS = 4_000_000


HOLD_S = 0.2  # how long the host keeps the compute stream held after the call returned
# (GPUs, path) of the stream tests: both paths on two GPUs; the direct one with both processes on one.
SETTINGS = [pytest.param(2, "staged", marks=two_gpus, id="two_gpus_staged"),
            pytest.param(2, "ipc", marks=two_gpus, id="two_gpus_ipc"),
            pytest.param(1, "ipc", marks=one_gpu, id="one_gpu_ipc")]  # fmt: skip


def _join(rank: int, port: int, gpus: int):
    """This rank's device and a barrier: rank r on cuda:r, or both on cuda:0 (NCCL takes no two
    ranks on one GPU: its communicator is never made there, and the barrier goes over gloo)."""
    dev = torch.device("cuda", rank if gpus == 2 else 0)
    torch.cuda.set_device(dev)
    extra = dict(device_id=dev) if gpus == 2 else {}
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60), **extra)  # fmt: skip
    group = None if gpus == 2 else dist.new_group(backend="gloo")
    return dev, lambda: dist.barrier(group=group)


def _stream_rank(rank: int, port: int, out: str, gpus: int, path: str) -> None:
    from kvpool import KVReceiver, KVSender, MHATokenToKVPool

    dev, barrier = _join(rank, port, gpus)
    report: dict = {}
    flag = torch.ones(1, dtype=torch.int32, pin_memory=True)
    try:
        pool = MHATokenToKVPool(4096, 1, torch.float8_e4m3fn, 8, 128, 4, dev, warmup=False)
        n = 1000
        g = torch.Generator().manual_seed(7 + rank)
        loc = torch.randperm(4097, generator=g)[:n]
        opts = dict(chunk_bytes=1 << 20, ipc=path == "ipc")
        ep = KVSender(pool, **opts) if rank == 0 else KVReceiver(pool, **opts)
        move = ep.send if rank == 0 else ep.recv
        for _ in range(2):  # the pair's communicator or direct path, pinned host blocks, compiled kernels
            h = move(loc, 1 - rank)
            h.wait()
            report["path"] = h.path
        gate = _gate_kernel()
        gate[(1,)](flag, MAX_POLLS)  # compiled and loaded before the measured part (the flag is set: no wait)
        torch.cuda.synchronize()
        barrier()
        torch.cuda.synchronize()

        value = 17 + rank  # the sender's bytes; the receiver must end up with 17 everywhere
        loc_dev = loc.to(dev)  # device indices for the writes below: no host copy behind the busy stream
        torch.cuda.synchronize()
        flag[0] = 0
        gate[(1,)](flag, MAX_POLLS)  # the compute stream is busy until the host sets the flag ...
        if rank == 0:
            # ... and then writes what the transfer must carry. (fill_, not index_fill_: index_fill_
            # makes the host wait for the stream, which released the gate before the checks ran.)
            for b in pool.k_buffer + pool.v_buffer:
                b.fill_(value)
        busy = torch.cuda.Event()
        busy.record()  # completes when the gate (and the sender's fill) has run
        caller = torch.cuda.current_stream()
        start = time.perf_counter()
        h = move(loc, 1 - rank)
        report["call_s"] = time.perf_counter() - start
        report["completed_right_after"] = h.is_completed()
        # Diagnostics: was the compute stream still busy when the handle was asked, and on which
        # streams did the work go (the caller's stream must be unchanged by the call)?
        report["compute_busy_right_after"] = not busy.query()
        report["side_idle_right_after"] = ep._side.query()
        report["caller_stream_unchanged"] = torch.cuda.current_stream() == caller
        report["caller_is_side"] = caller == ep._side
        report["handle"] = {"tokens": h.tokens, "chunks": h.chunks, "has_event": h._done is not None}
        time.sleep(HOLD_S)  # nothing can have moved: the sender's gathers and the receiver's scatters wait
        report["completed_while_held"] = h.is_completed()
        report["compute_busy_while_held"] = not busy.query()
        flag[0] = 1  # ... until now
        h.wait()
        if rank == 1:  # work queued after wait() sees the rows
            seen = torch.stack([b.index_select(0, loc_dev).float().mean() for b in pool.k_buffer + pool.v_buffer])
        torch.cuda.synchronize()
        report["completed_after_sync"] = h.is_completed()
        if rank == 1:
            report["seen"] = seen.tolist()
        stats0 = torch.cuda.memory_stats(dev)
        for _ in range(3):
            move(loc, 1 - rank).wait()
        torch.cuda.synchronize()
        stats1 = torch.cuda.memory_stats(dev)
        report["allocations"] = stats1["allocation.all.allocated"] - stats0["allocation.all.allocated"]
    finally:
        flag[0] = 1  # never leave a stream spinning
        Path(out, f"stream{rank}.json").write_text(json.dumps(report))
        dist.destroy_process_group()


@pytest.mark.parametrize("gpus, path", SETTINGS)
def test_gpu_transfer_never_waits_for_the_compute_stream(tmp_path, gpus, path):
    spawn(_stream_rank, 2, (free_port(), str(tmp_path), gpus, path), timeout=240)
    reports = [json.loads(Path(tmp_path, f"stream{r}.json").read_text()) for r in range(2)]
    print("stream reports:", reports)
    assert [rep["path"] for rep in reports] == [path, path], reports
    seen = reports[1]["seen"]
    assert seen == [17.0] * len(seen), f"the receiver's rows hold {seen} (mean byte per buffer), expected 17"
    for rank, rep in enumerate(reports):
        assert rep["call_s"] < HOLD_S, f"rank {rank}: the call waited for the busy stream: {rep}"
        assert rep["compute_busy_right_after"] and rep["compute_busy_while_held"], f"rank {rank}: gate not held: {rep}"
        assert rep["caller_stream_unchanged"] and not rep["caller_is_side"], rep
        assert rep["completed_right_after"] is False, f"rank {rank}: done before its stream could run: {rep}"
        assert rep["completed_while_held"] is False, f"rank {rank}: done while its stream was held: {rep}"
        assert rep["completed_after_sync"] is True, rep
        assert rep["allocations"] == 0, f"rank {rank}: transfers allocated device memory: {rep}"
    got = reports[1]
    seen = got["seen"]
    assert seen == [17.0] * len(seen), f"the receiver's rows hold {seen} (mean byte per buffer), expected 17"


def _reuse_rank(rank: int, port: int, out: str, gpus: int, path: str) -> None:
    """Rank 1's compute stream is held (a gate kernel) while it receives, so its copies wait; rank 0
    sends, waits on the handle and overwrites the sent rows at once. Rank 1 must end up with the
    rows as they were sent."""
    from kvpool import KVReceiver, KVSender, MHATokenToKVPool

    dev, barrier = _join(rank, port, gpus)
    report: dict = {}
    flag = torch.ones(1, dtype=torch.int32, pin_memory=True)
    try:
        pool = MHATokenToKVPool(4096, 1, torch.float8_e4m3fn, 8, 128, 4, dev, warmup=False)
        loc = torch.randperm(4097, generator=torch.Generator().manual_seed(3 + rank))[:1500]
        loc_dev = loc.to(dev)
        opts = dict(chunk_bytes=1 << 20, ipc=path == "ipc")
        ep = KVSender(pool, **opts) if rank == 0 else KVReceiver(pool, **opts)
        move = ep.send if rank == 0 else ep.recv
        move(loc, 1 - rank).wait()  # warm: communicator or direct path
        gate = _gate_kernel()
        gate[(1,)](flag, MAX_POLLS)
        for b in pool.k_buffer + pool.v_buffer:
            b.fill_(17 if rank == 0 else 0)
        torch.cuda.synchronize()
        barrier()
        torch.cuda.synchronize()
        if rank == 1:
            flag[0] = 0
            gate[(1,)](flag, MAX_POLLS)  # the receiver's copies wait behind this
        h = move(loc, 1 - rank)
        report["path"] = h.path
        if rank == 0:
            h.wait()
            for b in pool.k_buffer + pool.v_buffer:
                b.index_fill_(0, loc_dev, 99)  # the slots are the sender's again
        else:
            time.sleep(HOLD_S)
            flag[0] = 1
            h.wait()
            seen = torch.stack([b.index_select(0, loc_dev).view(torch.uint8).flatten().unique() for b in
                                pool.k_buffer + pool.v_buffer]).flatten().unique()  # fmt: skip
            report["seen"] = seen.tolist()
        torch.cuda.synchronize()
    finally:
        flag[0] = 1
        Path(out, f"reuse{rank}.json").write_text(json.dumps(report))
        dist.destroy_process_group()


@pytest.mark.parametrize("gpus, path", SETTINGS)
def test_gpu_sender_slots_may_be_reused_after_wait(tmp_path, gpus, path):
    spawn(_reuse_rank, 2, (free_port(), str(tmp_path), gpus, path), timeout=240)
    reports = [json.loads(Path(tmp_path, f"reuse{r}.json").read_text()) for r in range(2)]
    assert [rep["path"] for rep in reports] == [path, path], reports
    assert reports[1]["seen"] == [17], f"the receiver's rows hold bytes {reports[1]['seen']}, expected only 17"


@two_gpus
@pytest.mark.parametrize("args", [[], ["--no-ipc"], ["--model", "qwen3.5"], ["--model", "qwen3.5", "--no-ipc"]],
                         ids=["mha-ipc", "mha-staged", "qwen35-ipc", "qwen35-staged"])  # fmt: skip
def test_gpu_disagg_sim_example(args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, str(ROOT / "examples" / "disagg_sim.py"), "--device", "cuda", "--requests", "24", *args]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "PASS" in run.stdout and "nccl" in run.stdout, run.stdout
    assert ("path staged" if "--no-ipc" in args else "path ipc") in run.stdout, run.stdout
