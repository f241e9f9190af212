"""The host tier of a sliding-window pool: SWAKVPoolHost parks an SWAKVPool's full rows and, for the
slots the mapping gives an SWA part, their sliding-window rows, and loads them back byte for byte
(the SWA rows at the SWA slots the mapping gives the new full slots); pages of both parts; per-layer
loads with the counter; the budget split; bad input raising before anything is copied.
"""

from __future__ import annotations

import pytest
import torch

from kvassert import FULL_LAYERS, SWA_LAYERS, assert_same_bytes, make_swa_pool, swa_mapping
from kvassert import slots_of as T
from kvassert import state_device  # noqa: F401 (a fixture)
from kvpool import SWAKVPool, SWAKVPoolHost
from kvpool.kernels.copy_rows import launcher as copy_rows_launcher
from kvpool.pools.swa_pool import SWALayerTransferCounters

META = torch.device("meta")
FULL_ROWS = 25  # make_swa_pool: size 24, page 1
# Full slot -> SWA slot before the backup: full slots 3 and 20 are held with no SWA part.
OLD = {1: 7, 2: 11, 5: 1, 9: 4, 17: 12}
# After the request's slots were reused: the new full slots and their new SWA slots.
NEW = {10: 3, 11: 5, 12: 6, 13: 8, 14: 9, 15: 10}


@pytest.fixture
def device(state_device):
    return state_device


def registered(device, pairs, dtype=torch.float8_e4m3fn, **kw) -> SWAKVPool:
    pool = make_swa_pool(dtype, device=device, warmup=False, **kw)
    pool.register_mapping(swa_mapping(pool.full_kv_pool.rows, pairs, device))
    return pool


def part_bytes(pool: SWAKVPool, part: str) -> list[torch.Tensor]:
    """Every K buffer then every V buffer of one part, as uint8 CPU copies."""
    p = getattr(pool, f"{part}_kv_pool")
    return [b.view(torch.uint8).cpu().clone() for b in p.k_buffer + p.v_buffer]


def settle(host: SWAKVPoolHost, device: str) -> None:
    """Every transfer queued has landed (the host reads the buffers next)."""
    host.wait_for_backups()
    host.wait_for_loads()
    if device == "cuda":
        torch.cuda.synchronize()


def assert_part(pool: SWAKVPool, part: str, expected: list[torch.Tensor], what: str) -> None:
    for i, (got, want) in enumerate(zip(part_bytes(pool, part), expected)):
        assert_same_bytes(got, want, f"{what}: {part} buffer {i}")


def moved(before: list[torch.Tensor], pairs: list[tuple[int, int]]) -> list[torch.Tensor]:
    """``before`` with row ``dst`` of every buffer replaced by row ``src`` of the same buffer, per pair."""
    out = [b.clone() for b in before]
    for o, b in zip(out, before):
        for dst, src in pairs:
            o[dst] = b[src]
    return out


def host_state(host: SWAKVPoolHost) -> tuple:
    """Both parts' host buffers as bytes and the pool's page bookkeeping."""
    bufs = tuple(b.view(torch.uint8).clone() for h in (host.full_host, host.swa_host) for b in (h.k_buffer, h.v_buffer))
    return bufs, host.available_size(), host.swa_available_size(), host.has_swa_rows(torch.arange(host.size)).tolist()


def assert_host_state(host: SWAKVPoolHost, before: tuple, what: str) -> None:
    now = host_state(host)
    for i, (a, b) in enumerate(zip(now[0], before[0])):
        assert_same_bytes(a, b, f"{what}: host buffer {i}")
    assert now[1:] == before[1:], f"{what}: host pages changed"


# --- round trips ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=["fp8", "bf16"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
def test_round_trip_lands_both_parts_at_the_new_slots(device, dtype, layout, io_backend):
    if device != "cpu" and dtype == torch.bfloat16 and io_backend == "direct":
        pytest.skip("the kernel path runs both dtypes once per layout")
    pool = registered(device, OLD, dtype)
    host = SWAKVPoolHost(pool, 2.0, 0, 1, layout)
    h = host.alloc(6)
    old = [1, 3, 5, 9, 20, 17]  # 3 and 20 have no SWA part
    full0, swa0 = part_bytes(pool, "full"), part_bytes(pool, "swa")
    event = host.backup_from_device_all_layer(pool, h, T(old, device), io_backend)
    assert (event is None) == (device == "cpu")
    settle(host, device)
    assert host.has_swa_rows(h).tolist() == [True, False, True, True, False, True]
    assert host.swa_available_size() == host.swa_host.size - 4
    assert_part(pool, "full", full0, "a backup only reads")
    assert_part(pool, "swa", swa0, "a backup only reads")

    # The request's slots are reused; it comes back to new full slots with new SWA slots.
    pool.register_mapping(swa_mapping(FULL_ROWS, NEW, device))
    new = [10, 11, 12, 13, 14, 15]
    host.load_to_device_all_layer(pool, h, T(new, device), io_backend)
    settle(host, device)
    assert_part(pool, "full", moved(full0, list(zip(new, old))), "full rows at the new full slots")
    swa_pairs = [(NEW[n], OLD[o]) for n, o in zip(new, old) if o in OLD]  # slots 11 and 14 get none
    assert_part(pool, "swa", moved(swa0, swa_pairs), "SWA rows at the new slots' SWA slots, no others")
    assert host.free(h) == 6 and host.swa_available_size() == host.swa_host.size


def test_a_page_with_one_mapped_slot_keeps_one_swa_row():
    # Page size 2: full page 2 (slots 4, 5) has an SWA part for slot 4 only; page 3 has none.
    pool = registered("cpu", {4: 6, 8: 2, 9: 3}, size=24, size_swa=12, page_size=2)
    host = SWAKVPoolHost(pool, 2.0, 0, 2, "page_first")
    h = host.alloc(6)
    old = [4, 5, 6, 7, 8, 9]
    full0, swa0 = part_bytes(pool, "full"), part_bytes(pool, "swa")
    host.backup_from_device_all_layer(pool, h, T(old))
    assert host.has_swa_rows(h).tolist() == [True, False, False, False, True, True]
    assert host.swa_available_size() == host.swa_host.size - 4  # an SWA page for pages 0 and 2 of h
    pool.register_mapping(swa_mapping(pool.full_kv_pool.rows, {12: 8, 13: 9, 14: 4, 15: 5, 16: 10, 17: 11}, "cpu"))
    new = [12, 13, 14, 15, 16, 17]
    host.load_to_device_all_layer(pool, h, T(new))
    assert_part(pool, "full", moved(full0, list(zip(new, old))), "full rows")
    assert_part(pool, "swa", moved(swa0, [(8, 6), (10, 2), (11, 3)]), "SWA rows of the slots that had them")
    assert host.free(h[:2]) == 2 and host.swa_available_size() == host.swa_host.size - 2


def test_a_second_backup_gives_back_the_swa_page_it_no_longer_needs():
    pool = registered("cpu", OLD)
    host = SWAKVPoolHost(pool, 2.0, 0, 1, "layer_first")
    h = host.alloc(2)
    host.backup_from_device_all_layer(pool, h, T([1, 2]))
    assert host.swa_available_size() == host.swa_host.size - 2
    host.backup_from_device_all_layer(pool, h, T([3, 5]))  # 3 has no SWA part, 5 has
    assert host.has_swa_rows(h).tolist() == [False, True] and host.swa_available_size() == host.swa_host.size - 1
    pool.register_mapping(swa_mapping(FULL_ROWS, NEW, "cpu"))
    full0, swa0 = part_bytes(pool, "full"), part_bytes(pool, "swa")
    host.load_to_device_all_layer(pool, h, T([10, 11]))
    assert_part(pool, "full", moved(full0, [(10, 3), (11, 5)]), "full rows of the second backup")
    assert_part(pool, "swa", moved(swa0, [(NEW[11], OLD[5])]), "only the SWA row the second backup kept")
    host.clear()
    assert host.available_size() == host.size and host.swa_available_size() == host.swa_host.size
    assert not host.has_swa_rows(h).any()


def as_on_a_gpu(host: SWAKVPoolHost) -> SWAKVPoolHost:
    """A CPU host pool that backs up as on a GPU without validate: without reading the mapping first."""
    host._exact_backup = False
    return host


def test_a_backup_that_does_not_wait_keeps_the_right_rows_and_gives_back_unneeded_pages():
    pool = registered("cpu", OLD)
    host = as_on_a_gpu(SWAKVPoolHost(pool, 2.0, 0, 1, "layer_first"))
    h = host.alloc(6)
    old = [1, 3, 5, 9, 20, 17]
    full0, swa0 = part_bytes(pool, "full"), part_bytes(pool, "swa")
    host.backup_from_device_all_layer(pool, h, T(old))
    assert host.swa_available_size() == host.swa_host.size - 6  # an SWA page for every page, for now
    pool.register_mapping(swa_mapping(FULL_ROWS, NEW, "cpu"))
    new = [10, 11, 12, 13, 14, 15]
    host.load_to_device_all_layer(pool, h, T(new))  # before the host learns which pages needed one
    assert_part(pool, "full", moved(full0, list(zip(new, old))), "full rows")
    swa_pairs = [(NEW[n], OLD[o]) for n, o in zip(new, old) if o in OLD]
    assert_part(pool, "swa", moved(swa0, swa_pairs), "SWA rows only where the device record says so")
    assert host.has_swa_rows(h).tolist() == [True, False, True, True, False, True]
    assert host.swa_available_size() == host.swa_host.size - 4  # slots 3 and 20 gave theirs back

    # 18 more pages parked from slots without an SWA part take the rest of the SWA part, for now;
    # a backup that needs two more pages first learns that those 18 needed none.
    rest = host.alloc(18)
    host.backup_from_device_all_layer(pool, rest, T([3] * 18))
    assert host.swa_available_size() == 2
    more = host.alloc(4)
    pool.register_mapping(swa_mapping(FULL_ROWS, OLD, "cpu"))
    host.backup_from_device_all_layer(pool, more, T([1, 2, 3, 5]))
    assert host.swa_available_size() == host.swa_host.size - 4 - 4
    assert host.has_swa_rows(more).tolist() == [True, True, False, True] and not host.has_swa_rows(rest).any()
    assert host.swa_available_size() == host.swa_host.size - 4 - 3
    # A page backed up again before its record is read keeps the newer record.
    host.backup_from_device_all_layer(pool, more[:2], T([3, 3]))
    host.backup_from_device_all_layer(pool, more[:2], T([1, 3]))
    assert host.has_swa_rows(more).tolist() == [True, False, False, True]
    pool.register_mapping(swa_mapping(FULL_ROWS, {16: 9}, "cpu"))  # SWA row 9: not yet written by this test
    swa0 = part_bytes(pool, "swa")
    host.load_to_device_all_layer(pool, more[:1], T([16]))
    assert_part(pool, "swa", moved(swa0, [(9, OLD[1])]), "the newer backup's SWA row")
    assert host.free(more) == 4 and host.free(rest) == 18 and host.free(h) == 6
    assert host.swa_available_size() == host.swa_host.size
    # A page freed before its record is read: the record is dropped, the page holds no SWA rows.
    x = host.alloc(1)
    host.backup_from_device_all_layer(pool, x, T([16]))  # mapped to SWA slot 9 now
    assert host.free(x) == 1 and not host.has_swa_rows(x).any()
    assert host.swa_available_size() == host.swa_host.size


def test_a_backup_that_does_not_wait_still_refuses_when_the_swa_part_is_full():
    pool = registered("cpu", OLD)
    host = as_on_a_gpu(SWAKVPoolHost(pool, 2.0, 0, 1, "layer_first"))
    host.backup_from_device_all_layer(pool, host.alloc(22), T([1] * 22))  # 22 of 24 SWA pages held for good
    h = host.alloc(3)
    before = host_state(host)
    with pytest.raises(ValueError, match="sliding-window part has 2 free pages, this backup needs 3"):
        host.backup_from_device_all_layer(pool, h, T([1, 2, 5]))
    assert_host_state(host, before, "nothing changed")


def test_padding_keeps_host_rows_and_writes_nothing():
    pool = registered("cpu", OLD)
    host = SWAKVPoolHost(pool, 2.0, 0, 1, "layer_first")
    h = host.alloc(3)
    host.backup_from_device_all_layer(pool, h, T([1, -1, 5]))
    assert host.has_swa_rows(h).tolist() == [True, False, True]
    pool.register_mapping(swa_mapping(FULL_ROWS, NEW, "cpu"))
    full0, swa0 = part_bytes(pool, "full"), part_bytes(pool, "swa")
    kept = [host.full_host.k_buffer[:, 1].clone(), host.full_host.v_buffer[:, 1].clone()]  # the row padding kept
    host.load_to_device_all_layer(pool, h, T([-1, 11, 12]))  # the first entry is padding
    full = moved(full0, [(12, 5)])
    for i, f in enumerate(full):  # K0, K1, V0, V1
        f[11] = kept[i // len(FULL_LAYERS)][i % len(FULL_LAYERS)].view(torch.uint8)
    assert_part(pool, "full", full, "padding writes nothing; a padded backup's host row loads as it was")
    assert_part(pool, "swa", moved(swa0, [(NEW[12], OLD[5])]), "padding writes no SWA row")


# --- per-layer loads and the counter --------------------------------------------------------------


def test_per_layer_loads_move_one_layer_of_its_part_with_the_counter_registered(device):
    pool = registered(device, OLD, torch.bfloat16)
    host = SWAKVPoolHost(pool, 2.0, 0, 1, "page_first")
    pool.register_layer_transfer_counter(host.layer_transfer_counter)
    assert pool.full_kv_pool.layer_transfer_counter is host.full_host.layer_transfer_counter
    assert pool.swa_kv_pool.layer_transfer_counter is host.swa_host.layer_transfer_counter
    h = host.alloc(3)
    host.backup_from_device_all_layer(pool, h, T([1, 3, 5], device))
    settle(host, device)
    pool.register_mapping(swa_mapping(FULL_ROWS, NEW, device))
    full0, swa0 = part_bytes(pool, "full"), part_bytes(pool, "swa")
    new = T([10, 11, 12], device)
    full_pairs, swa_pairs = [(10, 1), (11, 3), (12, 5)], [(NEW[10], OLD[1]), (NEW[12], OLD[5])]
    host.load_to_device_per_layer(pool, h, new, SWA_LAYERS[1])  # global 2: dense SWA layer 1
    settle(host, device)
    swa = [b.clone() for b in swa0]
    for buf in (1, 1 + len(SWA_LAYERS)):  # its K and V buffers
        swa[buf] = moved([swa0[buf]], swa_pairs)[0]
    assert_part(pool, "swa", swa, "one SWA layer")
    assert_part(pool, "full", full0, "no full layer")
    host.load_to_device_per_layer(pool, h, new, FULL_LAYERS[0])  # global 1: dense full layer 0
    settle(host, device)
    full = [b.clone() for b in full0]
    for buf in (0, len(FULL_LAYERS)):
        full[buf] = moved([full0[buf]], full_pairs)[0]
    assert_part(pool, "full", full, "one full layer")
    # Each part's worker copies on a CPU pool: two workers running Triton's interpreter at once trip
    # over its global state (compiled kernels and torch copies do not), so interpreted runs queue in
    # the call.
    host.load_to_device_all_layer(pool, h, new, background=not copy_rows_launcher.kernel_on_cpu)
    host.wait_for_loads()
    settle(host, device)
    assert [pool.get_key_buffer(g).shape[0] for g in (0, 1)] == [13, 25]  # getters pass the counters' waits
    assert_part(pool, "full", moved(full0, full_pairs), "every full layer")
    assert_part(pool, "swa", moved(swa0, swa_pairs), "every SWA layer")
    pool.register_layer_transfer_counter(None)
    assert pool.full_kv_pool.layer_transfer_counter is None and pool.swa_kv_pool.layer_transfer_counter is None
    with pytest.raises(TypeError, match="layer_transfer_counter must be an SWALayerTransferCounters"):
        pool.register_layer_transfer_counter(host.full_host.layer_transfer_counter)
    assert pool.layer_transfer_counter is None
    assert isinstance(host.layer_transfer_counter, SWALayerTransferCounters)


# --- sizes and bad input --------------------------------------------------------------------------


def test_the_host_budget_is_split_as_the_device_parts_bytes():
    pool = registered("cpu", OLD)  # FP8, 3 heads, D 16, Dv 8: 72 bytes per layer and token
    full_bytes, swa_bytes = 24 * 2 * 72, 12 * 3 * 72  # usable slots x layers x bytes
    budget = (10 * (full_bytes + swa_bytes) + 126) / 1e9  # half a full slot and a quarter SWA slot over
    host = SWAKVPoolHost(pool, 1.0, budget, 1, "layer_first")
    assert (host.full_host.size, host.swa_host.size) == (240, 120)
    ratio = SWAKVPoolHost(pool, 3.0, 0, 4, "layer_first")
    assert (ratio.size, ratio.full_host.size, ratio.swa_host.size, ratio.page_size) == (72, 72, 36, 4)
    for args, exc, match in [
        ((object(), 1.0, 0, 1, "layer_first"), TypeError, "device_pool must be an SWAKVPool"),
        ((pool, 1.0, "1", 1, "layer_first"), ValueError, "host_size must be a number of GB"),
        ((pool, 0, 0, 1, "layer_first"), ValueError, "host_to_device_ratio must be a positive number"),
        ((pool, 1.0, 1e-9, 1, "layer_first"), ValueError, "at least one page"),
        ((pool, 1.0, 0, 1, "pages"), ValueError, "layout must be one of layer_first, page_first"),
    ]:
        with pytest.raises(exc, match=match):
            SWAKVPoolHost(*args)


def _other_layers():
    other = SWAKVPool(24, 12, 1, torch.float8_e4m3fn, 3, 16, [0, 1, 3], [2, 4], False, "cpu", v_head_dim=8, warmup=False)
    other.register_mapping(swa_mapping(FULL_ROWS, OLD, "cpu"))
    return other


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda h, p, s: h.backup_from_device_all_layer(p, s, T([1, 2, 3]), "copy"), ValueError, "io_backend must be one of kernel, direct"),
        (lambda h, p, s: h.backup_from_device_all_layer(p, s, T([1])), ValueError, "device_indices must have as many entries as host_indices"),
        (lambda h, p, s: h.backup_from_device_all_layer(p, s, T([1, 2, 25])), IndexError, r"device_indices\[2\] = 25 is out of range"),
        (lambda h, p, s: h.backup_from_device_all_layer(p, T([0, 0, 1]), T([1, 2, 3])), ValueError, "must name each page once"),
        (lambda h, p, s: h.backup_from_device_all_layer(p, T([0, 1, 48]), T([1, 2, 3])), IndexError, r"host_indices\[2\] = 48 is out of range"),
        (lambda h, p, s: h.backup_from_device_all_layer(p, s, T([1, 2, 3]).to(META)), ValueError, "device_indices must be on cpu"),
        (lambda h, p, s: h.load_to_device_all_layer(p, s, T([1.0, 2.0, 3.0], dtype=torch.float32)), ValueError, "device_indices must be int32 or int64"),
        (lambda h, p, s: h.backup_from_device_all_layer(object(), s, T([1, 2, 3])), TypeError, "device_pool must be an SWAKVPool"),
        (lambda h, p, s: h.backup_from_device_all_layer(make_swa_pool(device="cpu", warmup=False), s, T([1, 2, 3])), ValueError, "needs its full-to-SWA mapping"),
        (lambda h, p, s: h.load_to_device_all_layer(_other_layers(), s, T([1, 2, 3])), ValueError, "layer ids of the pool"),
        (lambda h, p, s: h.backup_from_device_all_layer(registered("cpu", OLD, torch.bfloat16), s, T([1, 2, 3])), ValueError, "device_pool must have dtype"),
        (lambda h, p, s: h.load_to_device_per_layer(p, s, T([1, 2, 3]), 5), ValueError, "layer_id 5 is not a layer of this pool"),
        (lambda h, p, s: h.load_to_device_per_layer(p, s, T([1, 2, 3]), 1.0), TypeError, "layer_id must be an int"),
        (lambda h, p, s: h.load_to_device_per_layer(p, s, T([1, 2, 30]), SWA_LAYERS[0]), IndexError, r"device_indices\[2\] = 30"),
        (lambda h, p, s: (p.full_to_swa_index_mapping.__setitem__(2, 13), h.backup_from_device_all_layer(p, s, T([1, 2, 3]))),
         IndexError, "the full-to-SWA mapping gives device_indices\\[1\\] the SWA slot 13"),
        (lambda h, p, s: h.backup_from_device_all_layer(p, s, T([1, 2, 5])), ValueError, "sliding-window part has 2 free pages, this backup needs 3"),
    ],
    ids=["backend", "lengths", "device-range", "host-twice", "host-range", "device", "dtype", "type", "no-mapping",
         "layers", "geometry", "layer-kind", "layer-type", "per-layer-range", "corrupt-mapping", "swa-part-full"],
)
def test_bad_input_raises_before_anything_is_copied(call, exc, match):
    pool = registered("cpu", OLD)
    host = SWAKVPoolHost(pool, 2.0, 0, 1, "layer_first")
    parked = host.alloc(3)
    host.backup_from_device_all_layer(pool, parked, T([1, 5, 9]))  # the host pool holds a request
    if "free pages" in match:  # 19 more host slots with an SWA row each: 2 of the SWA part's 24 left
        host.backup_from_device_all_layer(pool, host.alloc(19), T([1] * 19))
    h = host.alloc(3)
    host_before = host_state(host)
    full0, swa0 = part_bytes(pool, "full"), part_bytes(pool, "swa")
    with pytest.raises(exc, match=match):
        call(host, pool, h)
    assert_host_state(host, host_before, "nothing changed in the host pool")
    assert_part(pool, "full", full0, "nothing written")
    assert_part(pool, "swa", swa0, "nothing written")


@pytest.mark.parametrize("kw", [{}, {"kv_scale_mode": "per_token_head"}, {"dtype": "fp4_e2m1"}], ids=["fp8", "per_token_head", "fp4"])
def test_a_host_size_splits_between_the_parts_as_their_device_bytes_do(kw):
    """``host_size`` GB go to the two parts in proportion to the bytes their device slots hold, scales
    included: each host part then holds the same multiple of its device part's slots."""
    dtype = kw.pop("dtype", torch.float8_e4m3fn)
    pool = SWAKVPool(960, 480, 1, dtype, 2, 32, [0, 2], [1], False, "cpu", v_head_dim=16, swa_head_dim=16,
                     swa_v_head_dim=16, warmup=False, **kw)  # fmt: skip
    host = SWAKVPoolHost(pool, 1.0, 2e-4, 1, "layer_first", pin_memory=False)
    full_x = host.full_host.size / pool.full_kv_pool.size
    swa_x = host.swa_host.size / pool.swa_kv_pool.size
    assert full_x == pytest.approx(swa_x, rel=0.01), (host.full_host.size, host.swa_host.size)
    assert host.full_host.size * host.full_host.size_per_token + host.swa_host.size * host.swa_host.size_per_token <= 2e5
