"""KV transfer between two ranks of pools whose rows keep scales beside their codes (both FP4
formats, the FP4 latent pool, per-token-head FP8, a hybrid pool holding one): rows written by the
sender's own write arrive in the receiver's slots with every part (codes, block scales, per-token-head
scales) byte for byte, head slices of every part when the ranks hold different heads; nothing else
in either pool changes; a mismatched format or NVFP4 global scale is refused on both ranks, naming
the field, with nothing moved. CPU pools over gloo (also through the row-copy kernel, interpreted);
two GPUs over NCCL, staged and direct (docs/contract.md, "KV transfer between ranks").
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

from kvassert import INTERPRETER, NVFP4_GLOBAL_SCALES
from transfer_ranks import check_outcome, free_port, join_two_ranks, spawn

SCALED = ("fp4", "nvfp4", "mla_fp4", "fp8_token_head", "hybrid_token_head", "hybrid_nvfp4")


@dataclass(frozen=True)
class Side:
    """One rank's pool: its kind (``SCALED``, or ``"fp8"``/``"bf16"`` for a K/V pool), the global
    heads it holds ``[head_start, head_start + heads)`` of ``total_heads``, and its settings."""

    kind: str
    heads: int = 3
    head_start: int = 0
    total_heads: Optional[int] = None
    page_size: int = 2
    chunk_bytes: Optional[int] = None
    global_scales: dict = field(default_factory=lambda: dict(NVFP4_GLOBAL_SCALES))


@dataclass(frozen=True)
class ScaledCase:
    """One transfer from rank 0 to rank 1. ``expect``: (exception type, text both ranks' messages
    contain), or None: the rows move."""

    name: str
    sender: Side
    receiver: Side
    send_loc: tuple[int, ...] = (3, 7, 21, 8, 1)
    recv_loc: tuple[int, ...] = (5, 1, 20, 12, 9)
    expect: Optional[tuple[str, str]] = None


HAS = "mismatch: the sender's pool has "
CASES = [
    ScaledCase("fp4_mx_one_token_chunks_page2_to_page4", Side("fp4", chunk_bytes=162), Side("fp4", page_size=4)),
    ScaledCase("nvfp4", Side("nvfp4"), Side("nvfp4", page_size=4)),
    ScaledCase("mla_fp4", Side("mla_fp4", heads=1), Side("mla_fp4", heads=1)),
    ScaledCase("fp8_per_token_head", Side("fp8_token_head"), Side("fp8_token_head", chunk_bytes=2 * 120)),
    ScaledCase("hybrid_per_token_head", Side("hybrid_token_head"), Side("hybrid_token_head")),
    ScaledCase("hybrid_nvfp4_to_nvfp4", Side("hybrid_nvfp4"), Side("nvfp4", page_size=4)),
    ScaledCase("fp4_mx_heads_1_to_3_of_3", Side("fp4"), Side("fp4", heads=2, head_start=1, total_heads=3)),
    ScaledCase("nvfp4_heads_0_to_2_into_all", Side("nvfp4", heads=2, total_heads=3), Side("nvfp4")),
    ScaledCase("per_token_head_heads_2_to_3_of_3", Side("fp8_token_head"),
               Side("fp8_token_head", heads=1, head_start=2, total_heads=3)),  # fmt: skip
    ScaledCase("nvfp4_to_fp4_mx", Side("nvfp4"), Side("fp4"), expect=(
        "ValueError", "kv_format " + HAS + "kv_format=nvfp4, the receiver's has kv_format=fp4_mx_block16")),
    ScaledCase("nvfp4_global_scales", Side("nvfp4"), Side("nvfp4", global_scales=dict(k_global_scales=[0.5, 2.0])),
               expect=("ValueError", "global_scales mismatch")),  # fmt: skip
    ScaledCase("per_token_head_to_static_fp8", Side("fp8_token_head"), Side("fp8"), expect=(
        "ValueError", "kv_format " + HAS + "kv_format=fp8_per_token_head, the receiver's has kv_format=plain")),
    ScaledCase("fp4_to_bf16", Side("fp4"), Side("bf16"), expect=("ValueError", "dtype mismatch")),
    ScaledCase("in_step_afterwards", Side("nvfp4"), Side("nvfp4")),
]
LAYERS = (2, 3)  # global layer ids of every pool (a hybrid pool's full-attention layers)


def make_pool(side: Side, device: str):
    from kvpool import HybridLinearKVPool, MHATokenToKVPool, MHATokenToKVPoolFP4, MLATokenToKVPoolFP4
    from kvpool import MHATokenToKVPoolFP8PerTokenHead

    h, common = side.heads, dict(start_layer=LAYERS[0])
    if side.kind in ("fp4", "nvfp4"):
        scales = side.global_scales if side.kind == "nvfp4" else {}
        return MHATokenToKVPoolFP4(20, side.page_size, side.kind if side.kind == "nvfp4" else "fp4_e2m1", h, 32, 2,
                                   device, v_head_dim=16, **scales, **common)  # fmt: skip
    if side.kind == "mla_fp4":
        return MLATokenToKVPoolFP4(20, side.page_size, "fp4_e2m1", 32, 16, 2, device, **common)
    if side.kind == "fp8_token_head":
        return MHATokenToKVPoolFP8PerTokenHead(20, side.page_size, torch.float8_e4m3fn, h, 8, 2, device,
                                               v_head_dim=4, warmup=False, **common)  # fmt: skip
    if side.kind == "hybrid_nvfp4":
        return HybridLinearKVPool(20, "nvfp4", side.page_size, h, 32, list(LAYERS), False, device, None,
                                  v_head_dim=16, warmup=False, **side.global_scales)  # fmt: skip
    if side.kind == "hybrid_token_head":
        return HybridLinearKVPool(20, torch.float8_e4m3fn, side.page_size, h, 8, list(LAYERS), False, device, None,
                                  v_head_dim=4, warmup=False, kv_scale_mode="per_token_head")  # fmt: skip
    dtype = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16}[side.kind]
    return MHATokenToKVPool(20, side.page_size, dtype, h, 8, 2, device, v_head_dim=4, warmup=False, **common)


def kv_pool(pool):
    return getattr(pool, "full_kv_pool", pool)


def part_bytes(pool) -> dict[str, list[torch.Tensor]]:
    """Every buffer of every layer as uint8 ``[rows, row bytes]`` on the CPU, by attribute name."""
    kv = kv_pool(pool)
    names = getattr(kv, "part_names", ("k_buffer", "v_buffer"))
    return {n: [b.view(torch.uint8).reshape(b.shape[0], -1).cpu().clone() for b in getattr(kv, n)] for n in names}


def build(side: Side, salt: int, loc: tuple[int, ...], device: str):
    """A pool of ``side`` with random bytes in every part (drawn on the CPU, so any rank can rebuild
    any other's), then rows ``loc`` of every layer written by the pool's own write from inputs drawn
    from ``salt``."""
    pool = make_pool(side, device)
    g = torch.Generator().manual_seed(salt)
    kv = kv_pool(pool)
    for bufs in (getattr(kv, n) for n in getattr(kv, "part_names", ("k_buffer", "v_buffer"))):
        for b in bufs:
            raw = b.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
    if side.kind in ("fp8", "bf16"):
        return pool
    slots = torch.tensor(loc, device=device)
    for layer in LAYERS:
        if side.kind == "mla_fp4":
            rows = torch.randn(len(loc), 1, 48, generator=g).to(torch.bfloat16).to(device)
            pool.set_kv_buffer(None, slots, rows, None, layer_id_override=layer)
            continue
        d, dv = (32, 16) if side.kind in ("fp4", "nvfp4", "hybrid_nvfp4") else (8, 4)
        k = (3 * torch.randn(len(loc), side.heads, d, generator=g)).to(torch.bfloat16).to(device)
        v = (3 * torch.randn(len(loc), side.heads, dv, generator=g)).to(torch.bfloat16).to(device)
        pool.set_kv_buffer(None, slots, k, v, layer_id_override=layer)
    return pool


def expected_receiver(case: ScaledCase, sender: dict, receiver: dict) -> dict:
    """The receiver's bytes after the transfer, by the contract: every part of a layer keeps its
    heads one after the other in each row (an FP4 pool's flat exponent buffer included), so global
    head ``g`` of a part's row is the ``g - head_start``-th of its equal slices."""
    s, r = case.sender, case.receiver
    lo, hi = max(s.head_start, r.head_start), min(s.head_start + s.heads, r.head_start + r.heads)
    out = {name: [b.clone() for b in bufs] for name, bufs in receiver.items()}
    for name, bufs in out.items():
        for o, src in zip(bufs, sender[name]):
            hs, hr = src.shape[1] // s.heads, o.shape[1] // r.heads
            assert hs == hr, (name, hs, hr)
            cols_s = slice((lo - s.head_start) * hs, (hi - s.head_start) * hs)
            cols_r = slice((lo - r.head_start) * hr, (hi - r.head_start) * hr)
            for dst, frm in zip(case.recv_loc, case.send_loc):
                o[dst, cols_r] = src[frm, cols_s]
    return out


def run_rank(rank: int, port: int, out: str, backend: str, path: str) -> None:
    torch.set_num_threads(1)
    from kvpool import KVReceiver, KVSender

    if path == "kernel":
        from kvpool.kernels.copy_rows import launcher

        launcher.kernel_on_cpu = True  # the Triton row copy, interpreted, on the CPU pools
    device = join_two_ranks(rank, port, backend, timeout_s=60)
    outcomes = {}
    for idx, case in enumerate(CASES):
        try:
            side, loc = (case.sender, case.send_loc) if rank == 0 else (case.receiver, case.recv_loc)
            pool = build(side, 100 * idx + rank, loc, device)
            before = part_bytes(pool)
            opts = dict(head_start=side.head_start, total_heads=side.total_heads, chunk_bytes=side.chunk_bytes,
                        ipc=path == "ipc")  # fmt: skip
            error, handle = None, None
            try:
                if rank == 0:
                    handle = KVSender(pool, **opts).send(torch.tensor(loc), 1)
                else:
                    handle = KVReceiver(pool, **opts).recv(torch.tensor(loc), 0)
                handle.wait()
                if device != "cpu":
                    torch.cuda.synchronize()
            except (ValueError, IndexError, TypeError) as e:
                error = e
            after = part_bytes(pool)
            if rank == 0 or error is not None:
                expected = before  # a sender is only read; a refusal moves nothing
            else:
                sender = part_bytes(build(case.sender, 100 * idx, case.send_loc, device))
                expected = expected_receiver(case, sender, before)
            assert after.keys() == expected.keys(), (list(after), list(expected))
            for name in after:
                for layer, (a, e) in enumerate(zip(after[name], expected[name])):
                    bad = (a != e).any(dim=1).nonzero().flatten().tolist()
                    assert not bad, f"rank {rank} {case.name}: {name} of layer {LAYERS[layer]} differs in rows {bad}"
            if error is None:
                outcomes[case.name] = {"outcome": "ok", "path": handle.path, "nbytes": handle.nbytes}
            else:
                outcomes[case.name] = {"outcome": "raised", "type": type(error).__name__, "message": str(error)}
        except Exception as e:  # noqa: BLE001 - reported to the test
            outcomes[case.name] = {"outcome": "failure", "detail": "".join(traceback.format_exception(e))[-3000:]}
    Path(out, f"rank{rank}.json").write_text(json.dumps(outcomes))
    dist.destroy_process_group()


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
interpreted = pytest.mark.skipif(not INTERPRETER, reason="the row-copy kernel on CPU tensors needs TRITON_INTERPRET=1")
PATHS = [
    pytest.param("gloo", "torch", id="cpu"),
    pytest.param("gloo", "kernel", marks=interpreted, id="cpu_copy_kernel"),
    pytest.param("nccl", "staged", marks=[pytest.mark.gpu, two_gpus], id="two_gpus_staged"),
    pytest.param("nccl", "ipc", marks=[pytest.mark.gpu, two_gpus], id="two_gpus_ipc"),
]


@pytest.mark.parametrize("backend, path", PATHS)
def test_scaled_pools_move_every_part_between_two_ranks(tmp_path, backend, path):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    spawn(run_rank, 2, (free_port(), str(tmp_path), backend, path), timeout=300)
    ranks = [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(2)]
    for case in CASES:
        got = check_outcome(ranks, case)
        if case.expect is None:
            want = "ipc" if path == "ipc" else "staged"
            assert [g["path"] for g in got] == [want, want], (case.name, got)
    # 5 tokens x 2 layers x (16 + 8 code bytes and 2 + 1 exponent bytes a head) x 3 heads
    assert ranks[1]["fp4_mx_one_token_chunks_page2_to_page4"]["nbytes"] == 5 * 2 * 27 * 3
    # 5 tokens x 2 layers x (8 + 4 code bytes and two float32 scales a head) x 1 head
    assert ranks[1]["per_token_head_heads_2_to_3_of_3"]["nbytes"] == 5 * 2 * 20
