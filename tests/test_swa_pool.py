"""``SWAKVPool``: each global layer routed to its part; a sliding-window layer's write, verify write,
moves and CPU copies land at the slots the full-to-SWA mapping gives, byte for byte what a plain
``MHATokenToKVPool`` writes at those slots; bad input raising before anything is written.
"""

from __future__ import annotations

import pytest
import torch

from kvassert import (
    DEVICE,
    FULL_LAYERS,
    SWA_LAYERS,
    Layer,
    assert_same_bytes,
    fused_runs,
    fill_random_,
    id_of,
    make_swa_pool,
    no_sync,
    pool_bytes,
    swa_mapping,
    translated,
)
from kvpool import MHATokenToKVPool, SWAKVPool

FULL_ROWS = 25  # make_swa_pool: size 24, page 1
# Full slot -> SWA slot: a scattered mapping; full slots 3 and 20 are held with no SWA part (0).
PAIRS = {1: 7, 2: 11, 5: 1, 9: 4, 17: 12, 24: 2}


def registered(dtype=torch.float8_e4m3fn, **kw) -> SWAKVPool:
    pool = make_swa_pool(dtype, **kw)
    pool.register_mapping(swa_mapping(FULL_ROWS, PAIRS))
    return pool


def plain_twin(pool: SWAKVPool, part: str) -> MHATokenToKVPool:
    """A plain pool of one part's geometry holding the same bytes."""
    src = getattr(pool, f"{part}_kv_pool")
    twin = MHATokenToKVPool(src.size, src.page_size, src.dtype, src.head_num, src.head_dim, src.layer_num, DEVICE,
                            v_head_dim=src.v_head_dim, fused="never")  # fmt: skip
    for mine, theirs in zip(twin.k_buffer + twin.v_buffer, src.k_buffer + src.v_buffer):
        mine.copy_(theirs)
    return twin


def assert_part_equals(pool: SWAKVPool, part: str, twin: MHATokenToKVPool, what: str) -> None:
    src = getattr(pool, f"{part}_kv_pool")
    for i in range(src.layer_num):
        for kv in (0, 1):
            assert_same_bytes(src.get_kv_buffer(i)[kv].view(torch.uint8), twin.get_kv_buffer(i)[kv].view(torch.uint8),
                              f"{what}: {part} layer {i} {'KV'[kv]}")  # fmt: skip


def loc_of(xs):
    return torch.tensor(xs, dtype=torch.int64, device=DEVICE)


# --- routing -------------------------------------------------------------------------------------------


def test_each_global_layer_reads_its_parts_buffers():
    pool = make_swa_pool(swa_head_num=1, swa_head_dim=32, swa_v_head_dim=4)
    assert pool.layers_mapping == {1: (0, False), 4: (1, False), 0: (0, True), 2: (1, True), 3: (2, True)}
    for g, (i, is_swa) in pool.layers_mapping.items():
        part = pool.swa_kv_pool if is_swa else pool.full_kv_pool
        k, v = pool.get_kv_buffer(g)
        assert k.data_ptr() == part.k_buffer[i].data_ptr() and v.data_ptr() == part.v_buffer[i].data_ptr()
        assert pool.get_key_buffer(g).data_ptr() == k.data_ptr() and pool.get_value_buffer(g).data_ptr() == v.data_ptr()
        assert k.dtype == torch.float8_e4m3fn
        assert tuple(k.shape) == ((13, 1, 32) if is_swa else (25, 3, 16))
        assert tuple(v.shape) == ((13, 1, 4) if is_swa else (25, 3, 8))
    assert (pool.size, pool.size_swa, pool.layer_num) == (24, 12, 5)
    fk, fv = pool.full_kv_pool.get_kv_size_bytes()
    sk, sv = pool.swa_kv_pool.get_kv_size_bytes()
    assert pool.get_kv_size_bytes() == (fk + sk, fv + sv)
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    assert ptrs == [b.data_ptr() for b in pool.full_kv_pool.k_buffer + pool.full_kv_pool.v_buffer]
    assert lens == [25 * 48, 25 * 48, 25 * 24, 25 * 24] and items == [48, 48, 24, 24]
    assert pool.get_state_buf_infos()[1] == [13 * 32] * 3 + [13 * 4] * 3


def test_sglangs_call_forms_build_the_pool_and_its_allocator():
    from kvpool import SWATokenToKVPoolAllocator

    pool = SWAKVPool(
        size=32, size_swa=8, page_size=4, dtype=torch.bfloat16, head_num=2, head_dim=16,
        swa_attention_layer_ids=[0, 1, 3], full_attention_layer_ids=[2], enable_kvcache_transpose=False,
        device=DEVICE, swa_head_num=1, swa_head_dim=8, swa_v_head_dim=4, v_head_dim=12,
    )  # fmt: skip
    assert tuple(pool.get_value_buffer(2).shape) == (36, 2, 12) and tuple(pool.get_value_buffer(3).shape) == (12, 1, 4)
    a = SWATokenToKVPoolAllocator(32, 8, page_size=4, dtype=torch.bfloat16, device=DEVICE, kvcache=pool, need_sort=False)
    assert pool.full_to_swa_index_mapping is a.full_to_swa_index_mapping
    assert a.full_to_swa_index_mapping.shape == (37,)


@pytest.mark.parametrize("layer_id", [5, 99, -1])
def test_a_layer_of_neither_kind_is_refused_by_every_call(layer_id):
    pool = registered()
    before = pool_bytes(pool)
    x = torch.ones(1, 3, 16, device=DEVICE)
    y = torch.ones(1, 3, 8, device=DEVICE)
    calls = [
        lambda: pool.get_key_buffer(layer_id), lambda: pool.get_kv_buffer(layer_id),
        lambda: pool.set_kv_buffer(Layer(layer_id), loc_of([1]), x, y),
        lambda: pool.set_kv_buffer(None, loc_of([1]), x, y, layer_id_override=layer_id),
        lambda: pool.set_kv_buffer_prefix_valid(Layer(layer_id), loc_of([[1]]), loc_of([1]), x, y),
    ]  # fmt: skip
    for call in calls:
        with pytest.raises(ValueError, match=rf"layer_id {layer_id} is not a layer of this pool: its sliding-window "
                                             r"layers are \[0, 2, 3\], its full-attention layers \[1, 4\]"):  # fmt: skip
            call()
    with pytest.raises(TypeError, match="layer_id must be an int"):
        pool.get_key_buffer("1")
    for a, b in zip(pool_bytes(pool), before):
        assert torch.equal(a, b)


# --- the write -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=id_of)
def test_a_sliding_window_layer_writes_the_bytes_of_a_plain_pool_at_the_translated_slots(dtype):
    pool = registered(dtype)
    swa_twin, full_twin = plain_twin(pool, "swa"), plain_twin(pool, "full")
    # Mapped slots, an unmapped held slot (3), padding (-1), past the full pool (25, 40).
    loc = [1, 9, 3, -1, 25, 17, 24, 40, 5]
    g = torch.Generator().manual_seed(3)
    k = (torch.randn(len(loc), 3, 16, generator=g) * 300).to(DEVICE)
    v = (torch.randn(len(loc), 3, 8, generator=g) * 300).to(DEVICE)
    k_scale = 0.75
    for layer in SWA_LAYERS:
        pool.set_kv_buffer(Layer(layer), loc_of(loc), k, v, k_scale, 1.5)
        swa_twin.set_kv_buffer(None, loc_of(translated(loc, PAIRS, FULL_ROWS)), k, v, k_scale, 1.5,
                               layer_id_override=SWA_LAYERS.index(layer))  # fmt: skip
    assert_part_equals(pool, "swa", swa_twin, "SWA write")
    assert_part_equals(pool, "full", full_twin, "full part untouched by SWA writes")
    for layer in FULL_LAYERS:
        pool.set_kv_buffer(None, loc_of(loc), k, v, k_scale, 1.5, layer_id_override=layer)
        full_twin.set_kv_buffer(None, loc_of(loc), k, v, k_scale, 1.5, layer_id_override=FULL_LAYERS.index(layer))
    assert_part_equals(pool, "full", full_twin, "full write")
    assert_part_equals(pool, "swa", swa_twin, "SWA part untouched by full writes")


@fused_runs
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=id_of)
def test_the_fused_write_at_the_translated_slots_equals_the_reference_path(dtype):
    """The fused kernel (Triton's interpreter on the CPU) writing a SWA layer, against a plain pool's
    reference path at the translated slots, bit for bit."""
    pool = registered(dtype, fused="always")
    twin = plain_twin(pool, "swa")
    loc = [2, 24, 3, -1, 30, 9]
    g = torch.Generator().manual_seed(8)
    k = (torch.randn(6, 3, 16, generator=g) * 300).to(torch.bfloat16).to(DEVICE)
    v = (torch.randn(6, 3, 8, generator=g) * 300).to(torch.bfloat16).to(DEVICE)
    pool.set_kv_buffer(Layer(2), loc_of(loc), k, v, 0.37, 0.37)
    twin.set_kv_buffer(None, loc_of(translated(loc, PAIRS, FULL_ROWS)), k, v, 0.37, 0.37, layer_id_override=1)
    assert pool.swa_kv_pool.stats.fused_calls == 1 and twin.stats.reference_calls == 1
    assert_part_equals(pool, "swa", twin, "fused SWA write")


@fused_runs
def test_the_fused_write_and_verify_write_read_the_mapping_in_their_own_launch(monkeypatch):
    """A sliding-window layer's fused write and verify write translate their full slots inside the
    kernel: with the host-side translation made to fail, both still land every row at its
    translated slot (unmapped, padding and out-of-pool entries included), bit for bit."""
    import kvpool.kernels.store_kv.writer as writer_module
    import kvpool.pools.swa_pool as swa_module

    def no_translation(*args):
        raise AssertionError("a fused sliding-window write translated its slots outside the kernel")

    pool = registered(torch.float8_e4m3fn, fused="always")
    twin = plain_twin(pool, "swa")
    monkeypatch.setattr(writer_module, "translate_slots", no_translation)
    monkeypatch.setattr(swa_module, "translate_slots", no_translation)
    g = torch.Generator().manual_seed(11)
    loc = [5, 3, -1, 25, 17, 1]
    k = (torch.randn(6, 3, 16, generator=g) * 300).to(torch.bfloat16).to(DEVICE)
    v = (torch.randn(6, 3, 8, generator=g) * 300).to(torch.bfloat16).to(DEVICE)
    pool.set_kv_buffer(Layer(0), loc_of(loc).to(torch.int32), k, v, 0.37, 0.37)
    loc_2d, commit = [[1, 2, 9], [24, 3, 40]], loc_of([2, 3])
    pool.set_kv_buffer_prefix_valid(Layer(3), loc_of(loc_2d), commit, k, v, 0.5, 0.5)
    monkeypatch.undo()
    twin.set_kv_buffer(None, loc_of(translated(loc, PAIRS, FULL_ROWS)), k, v, 0.37, 0.37, layer_id_override=0)
    swa_2d = [translated(row, PAIRS, FULL_ROWS) for row in loc_2d]
    twin.set_kv_buffer_prefix_valid(None, loc_of(swa_2d), commit, k, v, 0.5, 0.5, layer_id_override=2)
    assert pool.swa_kv_pool.stats.fused_calls == 2
    assert_part_equals(pool, "swa", twin, "fused writes through the mapping")


def test_a_slot_map_of_the_wrong_kind_is_refused_before_anything_is_written():
    pool = MHATokenToKVPool(8, 1, torch.bfloat16, 2, 8, 1, DEVICE)
    before = pool_bytes(pool)
    k = torch.ones(2, 2, 8, device=DEVICE)
    for bad, error, message in (
        ([0, 1], TypeError, "slot_map must be a torch.Tensor"),
        (torch.tensor([0, 1], dtype=torch.int32, device=DEVICE), ValueError, "slot_map must be int64, got torch.int32"),
        (torch.zeros(2, 2, dtype=torch.int64, device=DEVICE), ValueError, "slot_map must be 1-D"),
    ):
        with pytest.raises(error, match=message):
            pool.set_kv_buffer(None, loc_of([1, 2]), k, k, layer_id_override=0, slot_map=bad)
    assert all(torch.equal(a, b) for a, b in zip(pool_bytes(pool), before))


@pytest.mark.parametrize("fused", ["never", pytest.param("always", marks=fused_runs)])
def test_a_slot_map_not_ending_in_minus_one_writes_nothing_for_entries_outside_it(fused):
    """``slot_map`` is any int64 map: a negative entry of ``loc`` and one past the map write nothing
    on either path, though the map's last entry is a real slot."""
    pool = MHATokenToKVPool(8, 1, torch.bfloat16, 2, 8, 1, DEVICE, fused=fused)
    before = pool_bytes(pool)
    k = torch.full((3, 2, 8), 2.0, device=DEVICE)
    pool.set_kv_buffer(None, loc_of([-1, 5, 2]), k, k, layer_id_override=0, slot_map=loc_of([3, 6]))
    after = pool_bytes(pool)
    for i, (a, b) in enumerate(zip(after, before)):
        assert torch.equal(a, b), f"buffer {i}: a slot outside the map was written"


@pytest.mark.parametrize("strided_map", [False, True], ids=["contiguous_map", "strided_map"])
def test_a_bad_loc_with_a_slot_map_is_refused_by_name_under_validate(strided_map):
    """With ``validate`` (and with a map the kernel cannot read itself) the slots are translated
    before the write; a malformed ``loc`` is still refused with an error naming it, nothing written."""
    pool = MHATokenToKVPool(8, 1, torch.bfloat16, 2, 8, 1, DEVICE, validate=True)
    before = pool_bytes(pool)
    k = torch.ones(2, 2, 8, device=DEVICE)
    slot_map = loc_of([3, 0, 4, 0, 5, 0, -1])[::2] if strided_map else loc_of([3, 4, 5, -1])
    for bad, error, message in (
        ([1, 2], TypeError, "loc must be a torch.Tensor, got list"),
        (torch.tensor([1.0, 2.0], device=DEVICE), ValueError, "loc must be int32 or int64, got torch.float32"),
    ):
        with pytest.raises(error, match=message):
            pool.set_kv_buffer(None, bad, k, k, layer_id_override=0, slot_map=slot_map)
    assert all(torch.equal(a, b) for a, b in zip(pool_bytes(pool), before))


def test_a_bad_loc_with_a_slot_map_is_refused_by_name_as_torch_compile_traces_it(monkeypatch):
    """The write as torch.compile traces it translates the slots before its checks; a malformed
    ``loc`` is still refused with an error naming it, nothing written."""
    import kvpool.pools.mha_pool as mha_module

    pool = MHATokenToKVPool(8, 1, torch.bfloat16, 2, 8, 1, DEVICE)
    before = pool_bytes(pool)
    k = torch.ones(2, 2, 8, device=DEVICE)
    monkeypatch.setattr(mha_module, "_is_compiling", lambda: True)
    for bad, error, message in (
        ([1, 2], TypeError, "loc must be a torch.Tensor, got list"),
        (torch.tensor([1.0, 2.0], device=DEVICE), ValueError, "loc must be int32 or int64, got torch.float32"),
    ):
        with pytest.raises(error, match=message):
            pool.set_kv_buffer(None, bad, k, k, layer_id_override=0, slot_map=loc_of([3, 4, 5, -1]))
    assert all(torch.equal(a, b) for a, b in zip(pool_bytes(pool), before))
    pool.set_kv_buffer(None, loc_of([1, 7]), k, k, layer_id_override=0, slot_map=loc_of([3, 4, 5, -1]))
    assert torch.equal(pool.k_buffer[0][4], k[0].to(torch.bfloat16)) and pool_bytes(pool)[0][[0, 1, 2, 3, 5, 6, 7, 8]].eq(0).all()


def test_an_unmapped_full_slot_writes_only_the_swa_padding_slot():
    pool = registered(torch.bfloat16)
    before = pool_bytes(pool)
    x = torch.full((1, 3, 16), 2.0, device=DEVICE)
    y = torch.full((1, 3, 8), 3.0, device=DEVICE)
    pool.set_kv_buffer(Layer(2), loc_of([3]), x, y)  # full slot 3 has no SWA part
    k, v = pool.get_kv_buffer(2)
    assert torch.equal(k[0], x[0].to(torch.bfloat16)) and torch.equal(v[0], y[0].to(torch.bfloat16))
    after = pool_bytes(pool)
    for i, (a, b) in enumerate(zip(after, before)):
        rows = slice(None) if i not in (4 + 1, 4 + 3 + 1) else slice(1, None)  # SWA layer 1's K and V: row 0 written
        assert torch.equal(a[rows], b[rows]), f"buffer {i}"


def test_calibration_observes_each_layer_in_its_part_and_keys_the_scales_by_global_id():
    """Maxima and calibrated scales of every layer are those of a plain pool of its part written
    with the same rows at the same (translated) slots, keyed by the model's global layer ids."""
    pool = registered(torch.float8_e4m3fn)
    assert pool.kv_amax is None
    pool.observe_amax()
    twins = {part: plain_twin(pool, part) for part in ("swa", "full")}
    for twin in twins.values():
        twin.observe_amax()
    loc = [1, 9, 3, -1, 17, 5]
    g = torch.Generator().manual_seed(5)
    for layer in sorted(SWA_LAYERS + FULL_LAYERS):
        k = (torch.randn(len(loc), 3, 16, generator=g) * (layer + 1)).to(DEVICE)
        v = (torch.randn(len(loc), 3, 8, generator=g) * (layer + 2)).to(DEVICE)
        pool.set_kv_buffer(Layer(layer), loc_of(loc), k, v, 1.0, 1.0)
        part, ids = ("swa", SWA_LAYERS) if layer in SWA_LAYERS else ("full", FULL_LAYERS)
        at = translated(loc, PAIRS, FULL_ROWS) if part == "swa" else loc
        twins[part].set_kv_buffer(None, loc_of(at), k, v, 1.0, 1.0, layer_id_override=ids.index(layer))
    scales = pool.calibrated_scales(margin=1.25, per_head=True)
    assert sorted(scales) == sorted(SWA_LAYERS + FULL_LAYERS)
    for part, ids in (("swa", SWA_LAYERS), ("full", FULL_LAYERS)):
        want = twins[part].calibrated_scales(margin=1.25, per_head=True)
        for i, layer in enumerate(ids):
            for got, expected in zip(scales[layer], want[i]):
                assert_same_bytes(got.view(torch.uint8), expected.view(torch.uint8), f"layer {layer} scale")
            assert_same_bytes(pool.kv_amax[layer].view(torch.uint8), twins[part].kv_amax[i].view(torch.uint8),
                              f"layer {layer} maxima")  # fmt: skip
    pool.reset_amax()
    assert all(float(a.abs().sum()) == 0 for a in pool.kv_amax.values())
    with pytest.raises(ValueError, match="enabled"):
        pool.observe_amax("yes")


def test_translate_loc_from_full_to_swa_matches_the_mapping_and_sglangs_int32():
    pool = registered()
    loc = [1, 3, -1, 25, 1000, 24, -7]
    got = pool.translate_loc_from_full_to_swa(loc_of(loc))
    assert got.dtype == torch.int32 and got.tolist() == translated(loc, PAIRS, FULL_ROWS)
    got32 = pool.translate_loc_from_full_to_swa(loc_of([[2, 9], [0, 17]]).to(torch.int32))
    assert got32.tolist() == [[11, 4], [0, 12]]


def test_set_swa_loc_overrides_the_translation():
    pool = registered(torch.float32)
    x = torch.full((2, 3, 16), 5.0, device=DEVICE)
    y = torch.full((2, 3, 8), 6.0, device=DEVICE)
    pool.set_swa_loc(loc_of([8, 10]))
    pool.set_kv_buffer(Layer(0), loc_of([1, 2]), x, y)
    assert torch.equal(pool.get_key_buffer(0)[[8, 10]], x)
    pool.set_swa_loc(None)
    pool.set_kv_buffer(Layer(0), loc_of([1, 2]), x + 1, y)
    assert torch.equal(pool.get_key_buffer(0)[[7, 11]], x + 1)


def test_the_verify_write_of_a_sliding_window_layer_lands_at_the_translated_slots():
    pool = registered()
    twin = plain_twin(pool, "swa")
    loc_2d = [[1, 2, 9], [17, 3, 24]]
    commit = loc_of([2, 3])
    k = torch.randn(6, 3, 16, device=DEVICE)
    v = torch.randn(6, 3, 8, device=DEVICE)
    pool.set_kv_buffer_prefix_valid(Layer(3), loc_of(loc_2d), commit, k, v, 0.5, 0.5)
    swa_2d = [translated(row, PAIRS, FULL_ROWS) for row in loc_2d]
    twin.set_kv_buffer_prefix_valid(None, loc_of(swa_2d), commit, k, v, 0.5, 0.5, layer_id_override=2)
    assert_part_equals(pool, "swa", twin, "verify write")


# --- moves and CPU copies ------------------------------------------------------------------------------


def test_moves_copy_both_parts_at_their_slots():
    pool = registered()
    full_twin, swa_twin = plain_twin(pool, "full"), plain_twin(pool, "swa")
    tgt, src = [2, 9, 3, -1], [1, 2, 24, 5]  # a chain (2 <- 1, 9 <- 2), an unmapped target, padding
    pool.move_kv_cache(loc_of(tgt), loc_of(src))
    full_twin.move_kv_cache(loc_of(tgt), loc_of(src))
    swa_twin.move_kv_cache(loc_of(translated(tgt, PAIRS, FULL_ROWS)), loc_of(translated(src, PAIRS, FULL_ROWS)))
    assert_part_equals(pool, "full", full_twin, "move")
    assert_part_equals(pool, "swa", swa_twin, "move")


def test_cpu_copies_take_both_parts_and_put_them_back_at_new_slots():
    pool = registered()
    copy = pool.get_cpu_copy(loc_of([1, 9, 17]))
    assert set(copy) == {"full", "swa"}
    swa_rows = [pool.swa_kv_pool.k_buffer[i][[7, 4, 12]].clone() for i in range(3)]
    full_rows = [pool.full_kv_pool.v_buffer[i][[1, 9, 17]].clone() for i in range(2)]
    fill_random_(pool.full_kv_pool.v_buffer + pool.swa_kv_pool.k_buffer, seed=11)
    pool.load_cpu_copy(copy, loc_of([2, 5, 24]))  # SWA slots 11, 1, 2
    for i in range(3):
        assert_same_bytes(pool.swa_kv_pool.k_buffer[i][[11, 1, 2]], swa_rows[i], f"SWA layer {i}")
    for i in range(2):
        assert_same_bytes(pool.full_kv_pool.v_buffer[i][[2, 5, 24]], full_rows[i], f"full layer {i}")


# --- bad input ---------------------------------------------------------------------------------------------


def bad_calls(pool):
    x, y = torch.ones(2, 3, 16, device=DEVICE), torch.ones(2, 3, 8, device=DEVICE)
    good = loc_of([1, 2])
    meta = torch.tensor([1, 2], device="meta")
    copy = pool.get_cpu_copy(good)
    short = {"full": copy["full"], "swa": pool.swa_kv_pool.get_cpu_copy(loc_of([7]))}
    return [
        (lambda: pool.set_kv_buffer(Layer(0), good.float(), x, y), ValueError, "loc must be int32 or int64, got torch.float32"),
        (lambda: pool.set_kv_buffer(Layer(0), loc_of([1, 2, 5]), x, y), ValueError, "loc must have 2 entries"),
        (lambda: pool.set_kv_buffer(Layer(0), meta, x, y), ValueError, "loc must be on"),
        (lambda: pool.set_kv_buffer(Layer(0), [1, 2], x, y), TypeError, "loc must be a torch.Tensor"),
        (lambda: pool.set_kv_buffer(Layer(2), good, x[:, :2], y), ValueError, "cache_k"),
        (lambda: pool.set_kv_buffer_prefix_valid(Layer(0), good, good, x, y), ValueError, "loc_2d must be 2-D"),
        (lambda: pool.move_kv_cache(good, loc_of([1])), ValueError, "src_loc must have 2 entries"),
        (lambda: pool.move_kv_cache(good.float(), good), ValueError, "tgt_loc must be int32 or int64"),
        (lambda: pool.load_cpu_copy(short, good), ValueError, "kv_cache_cpu"),
        (lambda: pool.load_cpu_copy(copy["full"], good), TypeError, "kv_cache_cpu must be a dict"),
        (lambda: pool.register_mapping(torch.zeros(FULL_ROWS, dtype=torch.int64, device=DEVICE)), ValueError,
         "full_to_swa_index_mapping must have 26 entries"),
        (lambda: pool.register_mapping(torch.zeros(FULL_ROWS + 1, dtype=torch.int32, device=DEVICE)), ValueError,
         "full_to_swa_index_mapping must be int64, got torch.int32"),
        (lambda: pool.register_mapping(torch.zeros(FULL_ROWS + 1, dtype=torch.int64, device="meta")), ValueError,
         "full_to_swa_index_mapping must be on"),
        (lambda: pool.register_mapping(torch.zeros(2, FULL_ROWS + 1, dtype=torch.int64, device=DEVICE)), ValueError,
         "full_to_swa_index_mapping must be 1-D"),
    ]  # fmt: skip


def test_bad_input_raises_naming_it_and_changes_nothing():
    pool = registered()
    mapping = pool.full_to_swa_index_mapping
    before = pool_bytes(pool)
    for call, error, message in bad_calls(pool):
        with pytest.raises(error, match=message):
            call()
        assert pool.full_to_swa_index_mapping is mapping
        for i, (a, b) in enumerate(zip(pool_bytes(pool), before)):
            assert torch.equal(a, b), f"{message}: buffer {i} changed"


def test_sliding_window_layers_need_a_mapping_and_full_layers_do_not():
    pool = make_swa_pool(torch.bfloat16)
    x, y = torch.ones(1, 3, 16, device=DEVICE), torch.ones(1, 3, 8, device=DEVICE)
    before = pool_bytes(pool)
    for call in (lambda: pool.set_kv_buffer(Layer(0), loc_of([1]), x, y), lambda: pool.move_kv_cache(loc_of([1]), loc_of([2])),
                 lambda: pool.get_cpu_copy(loc_of([1])), lambda: pool.translate_loc_from_full_to_swa(loc_of([1]))):  # fmt: skip
        with pytest.raises(ValueError, match="needs the full-to-SWA mapping: call register_mapping first"):
            call()
    assert all(torch.equal(a, b) for a, b in zip(pool_bytes(pool), before))
    pool.set_kv_buffer(Layer(4), loc_of([1]), x, y)
    assert torch.equal(pool.get_key_buffer(4)[1], x[0].to(torch.bfloat16))


def test_validate_refuses_a_slot_past_the_full_pool_and_a_bad_mapping():
    pool = make_swa_pool(validate=True)
    with pytest.raises(ValueError, match=r"full_to_swa_index_mapping\[-1\] must be -1, got 0"):
        pool.register_mapping(torch.zeros(FULL_ROWS + 1, dtype=torch.int64, device=DEVICE))
    with pytest.raises(IndexError, match="full_to_swa_index_mapping"):
        pool.register_mapping(swa_mapping(FULL_ROWS, {1: 13}))  # the SWA pool has rows 0..12
    assert pool.full_to_swa_index_mapping is None
    pool.register_mapping(swa_mapping(FULL_ROWS, PAIRS))
    before = pool_bytes(pool)
    x, y = torch.ones(2, 3, 16, device=DEVICE), torch.ones(2, 3, 8, device=DEVICE)
    with pytest.raises(IndexError, match=r"loc\[1\] = 25"):
        pool.set_kv_buffer(Layer(0), loc_of([1, 25]), x, y)
    with pytest.raises(IndexError, match=r"src_loc\[0\] = 30"):
        pool.move_kv_cache(loc_of([1]), loc_of([30]))
    assert all(torch.equal(a, b) for a, b in zip(pool_bytes(pool), before))


@pytest.mark.parametrize("kwargs, message", [
    (dict(swa_attention_layer_ids=[0, 1]), r"must be disjoint, got \[1\] in both"),
    (dict(full_attention_layer_ids=[]), "full_attention_layer_ids must name at least one layer"),
    (dict(swa_attention_layer_ids=[0, 0]), "swa_attention_layer_ids must be distinct"),
    (dict(enable_kvcache_transpose=True), "enable_kvcache_transpose must be False"),
    (dict(token_to_kv_pool_class=object), "token_to_kv_pool_class must be MHATokenToKVPool"),
])  # fmt: skip
def test_bad_construction_raises(kwargs, message):
    args = dict(size=8, size_swa=4, page_size=1, dtype=torch.bfloat16, head_num=1, head_dim=8,
                swa_attention_layer_ids=[0], full_attention_layer_ids=[1], enable_kvcache_transpose=False,
                device=DEVICE)  # fmt: skip
    with pytest.raises(ValueError, match=message):
        SWAKVPool(**{**args, **kwargs})


# --- on a GPU: the fused write at the translated slots --------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=id_of)
def test_on_a_gpu_the_fused_sliding_window_write_equals_the_reference_at_the_translated_slots(dtype):
    pool = make_swa_pool(dtype, size=4096, size_swa=1024, device="cuda", fused="always")
    pairs = {f: s for f, s in zip(range(1, 4097, 3), torch.randperm(1024).add(1).tolist())}
    pool.register_mapping(swa_mapping(4097, pairs, "cuda"))
    twin = plain_twin(pool, "swa")
    # Every mapped slot once, in random order, one unmapped slot, padding and a slot past the full pool:
    # no two tokens land on one SWA row (which of two duplicates wins is unspecified).
    mapped = torch.tensor(sorted(pairs))[torch.randperm(len(pairs))].tolist()
    loc = torch.tensor(mapped[:500] + [2, -1, 5000] + mapped[500:], device="cuda")
    t = loc.numel()
    k = torch.randn(t, 3, 16, device="cuda", dtype=torch.bfloat16) * 100
    v = torch.randn(t, 3, 8, device="cuda", dtype=torch.bfloat16) * 100
    scale = torch.tensor([0.3], device="cuda")
    pool.set_kv_buffer(Layer(3), loc, k, v, scale, scale)  # compiles what the warmup did not
    torch.cuda.synchronize()
    with no_sync():  # the translation and the write never wait for the device
        pool.set_kv_buffer(Layer(3), loc, k, v, scale, scale)
    swa_loc = torch.tensor(translated(loc.tolist(), pairs, 4097), device="cuda")
    twin.set_kv_buffer(None, swa_loc, k, v, scale, scale, layer_id_override=2)
    assert pool.swa_kv_pool.stats.fused_calls >= 1
    assert_part_equals(pool, "swa", twin, "fused SWA write")


@pytest.mark.gpu
def test_on_a_gpu_a_sliding_window_write_is_one_kernel_and_compiles_nothing():
    """After construction (whose warmup compiles the mapped variants), a sliding-window layer's
    write runs exactly one CUDA kernel, the write itself, and launches nothing through the JIT."""
    from torch.profiler import ProfilerActivity, profile

    pool = make_swa_pool(torch.float8_e4m3fn, size=4096, size_swa=1024, device="cuda")
    pool.register_mapping(swa_mapping(4097, {f: f % 1000 + 1 for f in range(1, 4097, 2)}, "cuda"))
    loc = torch.arange(1, 257, device="cuda")
    k = torch.randn(256, 3, 16, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(256, 3, 8, device="cuda", dtype=torch.bfloat16)
    jit_before = pool.swa_kv_pool.writer.jit_launches
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        pool.set_kv_buffer(Layer(2), loc, k, v, 0.5, 0.5)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    assert len(kernels) == 1 and "store_kv" in kernels[0], kernels
    assert pool.swa_kv_pool.writer.jit_launches == jit_before
