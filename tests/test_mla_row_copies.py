"""The row copies of an MLA pool: moves, CPU copies and the host tier (``MLATokenToKVPoolHost``), byte
for byte, through the row-copy kernel (interpreter) or its reference; the pool's rows are seen as a
latent (K) part and a rotary (V) part.
"""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

import kvpool
from kvassert import (
    R,
    ROPE,
    assert_same_bytes,
    fill_random_,
)
from kvpool import MLATokenToKVPool, MLATokenToKVPoolHost, TokenToKVPoolAllocator
from kvpool import host as host_tier
from kvpool.kernels.copy_rows import launcher as copy_rows

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy inside Triton's interpreter


# ----------------------------------------------------------------------------------------------
# Moves, CPU copies and the host tier: bytes, through the row-copy kernel (interpreter) or its
# reference; the pool's rows are seen as a latent (K) part and a rotary (V) part.


def random_pool(dtype=torch.float8_e4m3fn, seed=0, **kw) -> MLATokenToKVPool:
    """A CPU pool whose every byte is random (NaN patterns included): every row is distinguishable."""
    with mock.patch.dict(os.environ):
        os.environ.pop("KVPOOL_FUSED", None)
        os.environ.pop("KVPOOL_VALIDATE", None)
        pool = MLATokenToKVPool(kw.pop("size", 30), kw.pop("page_size", 2), dtype, R, ROPE, 3, "cpu",
                                warmup=False, **kw)  # fmt: skip
    fill_random_(pool.kv_buffer, seed)
    return pool


def latent_bytes(pool: MLATokenToKVPool) -> list[torch.Tensor]:
    return [b.view(torch.uint8).reshape(b.shape[0], -1).clone() for b in pool.kv_buffer]


def test_the_row_copy_view_of_the_pool():
    pool = random_pool()
    assert (pool.head_num, pool.head_dim, pool.v_head_dim) == (1, R, ROPE)
    for layer, (k, v, whole) in enumerate(zip(pool.k_buffer, pool.v_buffer, pool.kv_buffer)):
        assert k.data_ptr() == whole.data_ptr() and v.data_ptr() == whole[:, :, R:].data_ptr()
        assert torch.equal(torch.cat((k, v), dim=2), whole), f"layer {layer}: the parts are the row"


MLA_MOVES = {
    "cycle": ([1, 2, 3], [2, 3, 1]),
    "chain": ([4, 5, 6, 7], [5, 6, 7, 8]),
    "swap-and-same": ([1, 2, 9], [2, 1, 9]),
    "skips": ([-1, 40, 5, 6], [3, 4, 99, -2]),
}


@pytest.mark.parametrize("name", list(MLA_MOVES))
def test_move_kv_cache_moves_whole_rows_as_if_read_first(copy_path, name):
    pool = random_pool(seed=len(name))
    tgt, src = MLA_MOVES[name]
    before = latent_bytes(pool)
    pool.move_kv_cache(torch.tensor(tgt), torch.tensor(src, dtype=torch.int32))
    after = latent_bytes(pool)
    rows = pool.rows
    moved = {t: s for t, s in zip(tgt, src) if 0 <= t < rows and 0 <= s < rows}
    for layer in range(3):
        for r in range(rows):
            want = before[layer][moved.get(r, r)]
            assert torch.equal(after[layer][r], want), f"{name}: layer {layer} row {r}"


def test_move_kv_cache_through_staging(copy_path, monkeypatch):
    monkeypatch.setattr(copy_rows, "ONE_PASS_MAX_PAIRS", 4)
    pool = random_pool(seed=9)
    before = latent_bytes(pool)
    tgt, src = list(range(8)), [1, 2, 3, 4, 5, 6, 7, 0]  # an 8-cycle: more pairs than one pass takes
    pool.move_kv_cache(torch.tensor(tgt), torch.tensor(src))
    for layer, b in enumerate(latent_bytes(pool)):
        assert torch.equal(b[:8], before[layer][src]) and torch.equal(b[8:], before[layer][8:])


def test_move_kv_cache_rejects_bad_input_before_writing():
    pool = random_pool(validate=True)
    before = latent_bytes(pool)
    with pytest.raises(IndexError, match=r"src_loc\[1\] = 32 is out of range: rows are 0..31"):
        pool.move_kv_cache(torch.tensor([1, 2]), torch.tensor([3, 32]))
    with pytest.raises(ValueError, match=r"src_loc must have as many entries as tgt_loc \(2\), got 1"):
        pool.move_kv_cache(torch.tensor([1, 2]), torch.tensor([3]))
    with pytest.raises(ValueError, match="tgt_loc must be int32 or int64, got torch.float32"):
        pool.move_kv_cache(torch.tensor([1.0]), torch.tensor([3]))
    for a, b in zip(before, latent_bytes(pool)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=str)
def test_cpu_copy_round_trip_is_exact(copy_path, dtype):
    pool = random_pool(dtype, seed=4)
    slots = torch.tensor([7, 3, 8, 31, 0])
    copy = pool.get_cpu_copy(slots)
    assert len(copy) == 5 and copy.dtype == dtype and copy.start_layer == 0
    assert copy.k.shape == (3, 5, 1, R) and copy.v.shape == (3, 5, 1, ROPE)
    for layer in range(3):
        assert_same_bytes(torch.cat((copy.k[layer], copy.v[layer]), dim=2), pool.kv_buffer[layer][slots], f"layer {layer}")
    originals = [b[slots].clone() for b in pool.kv_buffer]
    before = latent_bytes(pool)
    targets = torch.tensor([20, 21, 22, 23, 24], dtype=torch.int32)
    pool.load_cpu_copy(copy, targets)
    untouched = torch.ones(pool.rows, dtype=torch.bool)
    untouched[targets.long()] = False
    for layer, b in enumerate(latent_bytes(pool)):
        assert torch.equal(b[targets.long()], originals[layer].view(torch.uint8).reshape(5, -1))
        assert torch.equal(b[untouched], before[layer][untouched])
    with pytest.raises(ValueError, match=r"kv_cache_cpu.k must have shape \(3, 4, 1, 40\)"):
        pool.load_cpu_copy(copy, targets[:4])
    with pytest.raises(IndexError, match=r"indices\[1\] = 32 is out of range: slots are 0..31"):
        pool.get_cpu_copy(torch.tensor([1, 32]))


def test_allocator_cpu_copies_go_through_the_mla_pool():
    pool = random_pool(seed=5, page_size=1)  # a token allocator hands out slots of a pool of one-slot pages
    allocator = TokenToKVPoolAllocator(pool.size, pool.dtype, "cpu", kvcache=pool)
    slots = allocator.alloc(4)
    copy = allocator.get_cpu_copy(slots)
    originals = [b[slots].clone() for b in pool.kv_buffer]
    for b in pool.kv_buffer:
        b[slots] = 0
    allocator.load_cpu_copy(copy, slots)
    for b, o in zip(pool.kv_buffer, originals):
        assert torch.equal(b[slots], o)


@pytest.mark.parametrize("backend", host_tier.IO_BACKENDS)
@pytest.mark.parametrize("layout", host_tier.LAYOUTS)
def test_host_tier_parks_and_reloads_latent_rows(copy_path, layout, backend):
    if copy_path == "kernel" and backend == "direct":
        pytest.skip("the direct backend's device side is the same row copy; the interpreter runs the kernel backend")
    pool = random_pool(seed=6, page_size=4, size=40)
    host = MLATokenToKVPoolHost(pool, 2.0, 0, 4, layout, staging_bytes=3000)  # a few rows per staging chunk
    assert host.size == 80 and host.size_per_token == 3 * (R + ROPE)
    assert (host.kv_lora_rank, host.qk_rope_head_dim) == (R, ROPE)
    h = host.alloc(8)
    h = torch.cat((h[4:], h[:4]))  # pages out of order
    d = torch.tensor([5, 6, 7, 8, 30, 2, 3, 43])
    before = latent_bytes(pool)
    host.backup_from_device_all_layer(pool, h, d, backend)
    other = random_pool(seed=7, page_size=4, size=40)
    untouched = latent_bytes(other)
    t = torch.tensor([1, 2, 3, 4, 9, 10, 11, 12])
    host.load_to_device_per_layer(other, h, t, 1, backend)
    got = latent_bytes(other)
    assert torch.equal(got[1][t], before[1][d]) and torch.equal(got[0], untouched[0]) and torch.equal(got[2], untouched[2])
    host.load_to_device_all_layer(other, h, t, backend)
    for layer, b in enumerate(latent_bytes(other)):
        assert torch.equal(b[t], before[layer][d]), f"layer {layer}"
        mask = torch.ones(other.rows, dtype=torch.bool)
        mask[t] = False
        assert torch.equal(b[mask], untouched[layer][mask])
    # a page for a storage tier: the latent parts of every layer, then the rotary parts
    page = host.get_data_page(int(h[0]))
    assert page.numel() == 4 * 3 * (R + ROPE)
    host.set_from_flat_data_page(int(h[4]), page)
    assert torch.equal(host.get_data_page(int(h[4])), page)


def test_host_tier_takes_only_an_mla_pool():
    mha = kvpool.MHATokenToKVPool(8, 1, torch.float8_e4m3fn, 1, R, 1, "cpu", v_head_dim=ROPE, warmup=False)
    with pytest.raises(TypeError, match="device_pool must be an MLATokenToKVPool or MLATokenToKVPoolFP4, got MHATokenToKVPool"):
        MLATokenToKVPoolHost(mha, 2.0, 0, 1, "layer_first")
