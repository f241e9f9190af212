"""KV transfer of an SWAKVPool between two ranks (CPU pools over gloo; two GPUs over NCCL, where the
direct path may run), static or per-token-head FP8 (whose scales move with the codes): the full rows of ``loc`` land
in the receiver's ``loc``, the SWA rows of the sender's translated slots in the receiver's translated
slots (or in the SWA slots both name), byte for byte, nothing else changed; a transfer either part
refuses raises the same error on both ranks with nothing moved, and the pair stays in step.
"""

from __future__ import annotations

import json
import os
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest
import torch
import torch.distributed as dist

from kvassert import FULL_LAYERS, SWA_LAYERS, swa_mapping
from transfer_ranks import check_outcome, free_port, join_two_ranks, spawn

SENDER_MAP = {1: 7, 2: 11, 5: 1, 9: 4}  # full slot 3 has no SWA part
RECEIVER_MAP = {10: 3, 11: 5, 12: 6, 13: 8}  # full slot 14 has none
DTYPES = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp4": "fp4_e2m1"}


@dataclass(frozen=True)
class SWACase:
    """One transfer from rank 0 to rank 1 and what must come of it. ``expect``: (exception type,
    text of its message on both ranks), or None: the rows move. ``receiver``: changes to the
    receiver's pool arguments; ``mapped``: whether each rank registers its mapping."""

    name: str
    send_loc: list[int]
    recv_loc: list[int]
    send_swa: Optional[list[int]] = None
    recv_swa: Optional[list[int]] = None
    dtype: str = "fp8"
    kv_scale_mode: str = "static"  # both ranks' pools ("per_token_head": scales beside the codes)
    v_head_dim: int = 8  # both ranks' (an FP4 part's a multiple of 16)
    maps: tuple[dict, dict] = (SENDER_MAP, RECEIVER_MAP)  # full slot -> SWA slot, each rank's
    receiver: dict = field(default_factory=dict)
    mapped: tuple[bool, bool] = (True, True)
    expect: Optional[tuple[str, str]] = None


CASES = [
    SWACase("both_parts_fp8", [1, 2, 5, 9], [10, 11, 12, 13]),
    SWACase("tokens_without_an_swa_part", [3, 1], [14, 10]),
    SWACase("named_swa_slots_bf16", [1, 2, 5, 9], [10, 11, 12, 13], send_swa=[1, 4], recv_swa=[6, 8], dtype="bf16"),
    SWACase("swa_head_dim", [1], [10], receiver=dict(swa_head_dim=8),
            expect=("ValueError", "sliding-window part: head_dim mismatch")),
    SWACase("layer_split", [1], [10], receiver=dict(swa=[0, 1, 3], full=[2, 4]),
            expect=("ValueError", "sliding-window part: layers mismatch")),
    SWACase("receiver_slot_past_the_end", [1, 2], [10, 99],
            expect=("IndexError", "the receiver's loc[1] = 99 is outside its pool's slots [0, 25)")),
    SWACase("sender_without_mapping", [1], [10], mapped=(False, True),
            expect=("ValueError", "the sender's pool has no full-to-SWA mapping")),
    SWACase("swa_slot_counts", [1, 2], [10, 11], send_swa=[7], recv_swa=[3, 5],
            expect=("ValueError", "sliding-window part: tokens mismatch")),
    SWACase("both_parts_per_token_head_fp8", [1, 2, 5, 9], [10, 11, 12, 13], kv_scale_mode="per_token_head"),
    SWACase("per_token_head_to_static", [1], [10], kv_scale_mode="per_token_head",
            receiver=dict(kv_scale_mode="static"), expect=("ValueError", "sliding-window part: kv_format mismatch")),
    SWACase("both_parts_fp4", [1, 2, 5, 9], [10, 11, 12, 13], dtype="fp4", v_head_dim=16),
    SWACase("fp4_to_nvfp4", [1], [10], dtype="fp4", v_head_dim=16, receiver=dict(fp4_format="nvfp4"),
            expect=("ValueError", "sliding-window part: kv_format mismatch")),
    SWACase("receiver_mapping_entry_past_the_swa_pool", [1, 2], [10, 11], maps=(SENDER_MAP, {10: 3, 11: 999}),
            expect=("IndexError", "the receiver's loc[1] = 11 maps to SWA slot 999, outside its SWA pool's slots [0, 13)")),
    SWACase("in_step_afterwards", [9, 5], [12, 13]),
]


def make_pool(case: SWACase, rank: int, salt: int, device: str):
    """Rank ``rank``'s pool in ``case``, its bytes drawn on the CPU from ``salt`` (so any rank can
    rebuild any other's, whatever its device)."""
    from kvpool import SWAKVPool

    kw = {"kv_scale_mode": case.kv_scale_mode, **(case.receiver if rank == 1 else {})}
    swa, full = kw.pop("swa", SWA_LAYERS), kw.pop("full", FULL_LAYERS)
    pool = SWAKVPool(24, 12, 1, DTYPES[case.dtype], 3, 16, swa, full, False, device, v_head_dim=case.v_head_dim,
                     warmup=False, **kw)  # fmt: skip
    g = torch.Generator().manual_seed(salt)
    for b in (b for p in (pool.full_kv_pool, pool.swa_kv_pool) for b in buffers(p)):
        b.view(torch.uint8).copy_(torch.randint(0, 256, b.view(torch.uint8).shape, dtype=torch.uint8, generator=g))
    if case.mapped[rank]:
        pool.register_mapping(swa_mapping(pool.full_kv_pool.rows, case.maps[rank], device))
    return pool


def buffers(part) -> list[torch.Tensor]:
    """Every buffer of every layer of one part: K and V, and the scales of a per-token-head part."""
    return [b for name in getattr(part, "part_names", ("k_buffer", "v_buffer")) for b in getattr(part, name)]


def part_bytes(pool) -> dict[str, list[torch.Tensor]]:
    return {part: [b.view(torch.uint8).cpu().clone() for b in buffers(p)]
            for part, p in (("full", pool.full_kv_pool), ("swa", pool.swa_kv_pool))}  # fmt: skip


def expected_receiver(case: SWACase, sender: dict, receiver: dict) -> tuple[dict, set[int]]:
    """The receiver's bytes after the transfer, by the contract (computed from the test's own maps),
    and the SWA rows whose bytes it leaves unspecified (the padding slot, when a token has no SWA part)."""
    out = {part: [b.clone() for b in bufs] for part, bufs in receiver.items()}
    for dst, src in zip(case.recv_loc, case.send_loc):
        for o, s in zip(out["full"], sender["full"]):
            o[dst] = s[src]
    if case.send_swa is not None:
        swa_pairs = list(zip(case.recv_swa, case.send_swa))
    else:
        swa_pairs = [(RECEIVER_MAP.get(d, 0), SENDER_MAP.get(s, 0)) for d, s in zip(case.recv_loc, case.send_loc)]
    loose = {d for d, s in swa_pairs if d == 0 or s == 0}
    for dst, src in swa_pairs:
        if dst not in loose:
            for o, s in zip(out["swa"], sender["swa"]):
                o[dst] = s[src]
    return out, loose


def run_rank(rank: int, port: int, out: str, backend: str) -> None:
    torch.set_num_threads(1)
    from kvpool import SWAKVReceiver, SWAKVSender

    device = join_two_ranks(rank, port, backend, timeout_s=30)
    outcomes = {}
    for idx, case in enumerate(CASES):
        try:
            pool = make_pool(case, rank, 100 * idx + rank, device)
            before = part_bytes(pool)
            error = None
            try:
                loc, swa_loc = (case.send_loc, case.send_swa) if rank == 0 else (case.recv_loc, case.recv_swa)
                swa_loc = None if swa_loc is None else torch.tensor(swa_loc)
                if rank == 0:
                    handle = SWAKVSender(pool).send(torch.tensor(loc), 1, swa_loc)
                else:
                    handle = SWAKVReceiver(pool).recv(torch.tensor(loc), 0, swa_loc)
                handle.wait()
                if device != "cpu":
                    torch.cuda.synchronize()
                assert handle.is_completed() and handle.tokens == len(case.send_loc)
            except (ValueError, IndexError, TypeError) as e:
                error = e
            after = part_bytes(pool)
            if rank == 0 or error is not None:
                expected, loose = before, set()  # a sender is only read; a refusal moves nothing
            else:
                sender = part_bytes(make_pool(case, 0, 100 * idx, device))
                expected, loose = expected_receiver(case, sender, before)
            for part in ("full", "swa"):
                for i, (a, e) in enumerate(zip(after[part], expected[part])):
                    rows = [r for r in range(a.shape[0]) if not (part == "swa" and r in loose)]
                    assert torch.equal(a[rows], e[rows]), f"rank {rank} {case.name}: {part} buffer {i} differs"
            outcomes[case.name] = {"outcome": "ok"} if error is None else {
                "outcome": "raised", "type": type(error).__name__, "message": str(error)}
        except Exception as e:  # noqa: BLE001 - reported to the test
            outcomes[case.name] = {"outcome": "failure", "detail": "".join(traceback.format_exception(e))[-3000:]}
    Path(out, f"rank{rank}.json").write_text(json.dumps(outcomes))
    dist.destroy_process_group()


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=[pytest.mark.gpu, two_gpus])])
def test_swa_pools_move_both_parts_between_two_ranks(tmp_path, backend):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    spawn(run_rank, 2, (free_port(), str(tmp_path), backend), timeout=180)
    ranks = [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(2)]
    for case in CASES:
        check_outcome(ranks, case)
