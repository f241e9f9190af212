"""MambaPool.commit: the state after each request's last accepted draft step, and the track-slot
snapshots, against a plain-torch model on every path; the kernel against an independent expected
state; bad steps and slots refused before anything is written."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from kvpool.kernels.state_commit import launcher as SC
from kvassert import STATE_K as K
from kvassert import assert_states, poison_
from kvassert import make_state_pool as make_pool
from kvassert import slots_of as T
from kvassert import state_device  # noqa: F401 (a fixture)
from kvassert import state_snapshot as snapshot
from kvpool import MambaCacheParams, MambaPool, MambaStateShape

META = torch.device("meta")


@pytest.fixture
def device(state_device):
    return state_device


def expected_commit(pool: MambaPool, before: list[torch.Tensor], sets: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
    """Request ``i`` with ``1 <= steps[i] <= K`` gets scratch ``[i, steps[i] - 1]`` in slot ``slots[i]``."""
    scratch = [t.view(torch.uint8).cpu() for t in (*pool.intermediate_conv_window, pool.intermediate_ssm)]
    out = [b.clone() for b in before]
    k = pool.speculative_num_draft_tokens
    for slots, steps in sets:
        for i, (d, s) in enumerate(zip(slots, steps)):
            if 1 <= s <= k and 0 <= d <= pool.size:
                for o, sc in zip(out, scratch):
                    o[:, d] = sc[:, i, s - 1]
    return out


COMMITS = {
    "accepted-mixed": ([3, 1, 5, 8], [2, 0, 3, 1]),
    "all-rejected": ([3, 1], [0, 0]),
    "all-accepted": ([1, 2, 3, 4, 5], [3, 3, 3, 3, 3]),
    "padding-slot-0-and-negative": ([0, -1, 6], [1, 2, 2]),
}
#: What the kernel and the reference do where nothing checked the arguments (a device pool without
#: ``validate``): they never read or write outside the pool or the scratch.
UNCHECKED = {
    "steps-outside-0-K-skipped": ([2, 4, 6], [-1, 4, 100]),
    "slots-past-the-end-skipped": ([10, 99, 7], [1, 1, 1]),
}


@pytest.mark.parametrize("name", list(UNCHECKED))
def test_the_commit_under_the_pool_skips_what_it_cannot_read_or_write(device, name):
    pool = make_pool(device)
    slots, steps = UNCHECKED[name]
    expected = expected_commit(pool, snapshot(pool), [(slots, steps)])
    SC.commit_rows(pool.row_table, pool.spec_row_table, K, T(slots, device), T(steps, device))
    assert_states(pool, expected)


@pytest.mark.parametrize("name", list(COMMITS))
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_commit_matches_the_model(device, name, index_dtype):
    pool = make_pool(device)
    slots, steps = COMMITS[name]
    expected = expected_commit(pool, snapshot(pool), [(slots, steps)])
    pool.commit(T(slots, device, index_dtype), T(steps, device, index_dtype))
    assert_states(pool, expected)


def test_commit_with_track_slots_in_the_same_call(device):
    pool = make_pool(device)
    slots, steps = [3, 1, 5, 8], [2, 0, 3, 1]
    track, track_steps = [2, 4, 6, 9], [1, 0, 2, 0]  # requests 1 and 3 crossed no track point
    expected = expected_commit(pool, snapshot(pool), [(slots, steps), (track, track_steps)])
    pool.commit(T(slots, device), T(steps, device), T(track, device, torch.int32), T(track_steps, device))
    assert_states(pool, expected)


def test_commit_reads_the_steps_when_it_runs(device):
    """The step counts are device data: changing them after the call was queued but before it runs
    is what a CUDA graph replay sees; here, the same tensors reused for a second commit."""
    pool = make_pool(device)
    slots, steps = T([1, 2], device), T([1, 1], device)
    pool.commit(slots, steps)
    steps.copy_(T([0, 3], device))
    before = snapshot(pool)
    pool.commit(slots, steps)
    assert_states(pool, expected_commit(pool, before, [([1, 2], [0, 3])]))


@given(
    requests=st.lists(st.tuples(st.integers(-1, 9), st.integers(0, K)), min_size=0, max_size=5),
    track=st.booleans(),
    data=st.data(),
)
@settings(max_examples=40)
def test_commit_property_on_the_reference_path(requests, track, data):
    pool = make_pool(seed=len(requests))
    slots, steps = [r[0] for r in requests], [r[1] for r in requests]
    sets = [(slots, steps)]
    args = [T(slots), T(steps)]
    if track:
        tr = data.draw(st.lists(st.integers(-1, 9), min_size=len(slots), max_size=len(slots)))
        ts = data.draw(st.lists(st.integers(0, K), min_size=len(slots), max_size=len(slots)))
        sets.append((tr, ts))
        args += [T(tr), T(ts)]
    # distinct destinations only: a slot named twice gets one of its sources (unspecified which)
    named = [d for s, st_ in sets for d, x in zip(s, st_) if 1 <= x <= K and 0 <= d <= pool.size]
    if len(named) != len(set(named)):
        return
    expected = expected_commit(pool, snapshot(pool), sets)
    pool.commit(*args)
    assert_states(pool, expected)


def test_commit_kernel_and_reference_equal_a_hand_written_state(device):
    """One commit with track slots, on every path, against its expected state written out entry by
    entry: slot ``slots[i]`` takes scratch entry ``[i, steps[i] - 1]``, step 0 keeps the slot. Each
    scratch entry carries its own tag (NaN bit patterns among them), so a wrong entry shows up."""
    pool = make_pool(device, seed=7)
    scratch = [*pool.intermediate_conv_window, pool.intermediate_ssm]
    for t in scratch:
        raw = t.view(torch.uint8)
        for i in range(raw.shape[1]):
            for j in range(K):
                raw[:, i, j] = 0xF0 + i * K + j if (i + j) % 2 else 16 * i + j  # 0xF?: NaN bytes in fp32/bf16
    poison_(pool.temporal[:, 0])
    before = snapshot(pool)
    pool.commit(T([0, 4, 2, 9], device), T([3, 1, 0, 2], device), T([6, 7, 8, 5], device), T([1, 3, 2, 0], device))
    tag = [t.view(torch.uint8).cpu() for t in scratch]
    expected = [b.clone() for b in before]
    for e, s in zip(expected, tag):
        e[:, 0] = s[:, 0, 2]  # request 0, 3 steps accepted, into the padding slot
        e[:, 4] = s[:, 1, 0]  # request 1, 1 step
        # request 2 accepted nothing: slot 2 keeps its state
        e[:, 9] = s[:, 3, 1]  # request 3, 2 steps
        e[:, 6] = s[:, 0, 0]  # track slots: request 0 at step 1
        e[:, 7] = s[:, 1, 2]  # request 1 at step 3
        e[:, 8] = s[:, 2, 1]  # request 2 at step 2
        # request 3 crossed no track point: slot 5 keeps its state
    assert_states(pool, expected, "commit")


@pytest.mark.gpu
def test_commit_on_cuda_with_large_rows_and_a_captured_graph():
    """Rows of 512 KiB (Qwen3.5's SSM state at TP8 is 8 x 128 x 128 fp32) through the kernel, and a
    CUDA graph that replays with new step counts."""
    params = MambaCacheParams(MambaStateShape(conv=(1536, 3), temporal=(8, 128, 128)), layers=(0, 1))
    pool = make_pool("cuda", size=6, spec=3, k=4, params=params, seed=3)
    slots, steps = T([2, 5, 1], "cuda"), T([4, 0, 2], "cuda")
    pool.commit(slots, steps)  # compile outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pool.commit(slots, steps)
    steps.copy_(T([1, 3, 0], "cuda"))
    before = snapshot(pool)
    graph.replay()
    torch.cuda.synchronize()
    assert_states(pool, expected_commit(pool, before, [([2, 5, 1], [1, 3, 0])]))


def test_commit_validate_rejects_steps_and_slots_and_writes_nothing():
    pool = make_pool(validate=True)
    before = snapshot(pool)
    cases = [
        ((T([1, 2]), T([1, 4])), ValueError, r"accepted_steps\[1\] = 4 must be a step count in 0..3"),
        ((T([1, 2]), T([-1, 0])), ValueError, r"accepted_steps\[0\] = -1 must be a step count in 0..3"),
        ((T([1, 10]), T([1, 1])), IndexError, r"slots\[1\] = 10 is out of range: slots are 0..9"),
        ((T([1]), T([1]), T([3]), T([9])), ValueError, r"track_steps\[0\] = 9 must be a step count"),
        ((T([1]), T([1]), T([30]), T([1])), IndexError, r"track_slots\[0\] = 30 is out of range"),
    ]
    for args, exc, match in cases:
        with pytest.raises(exc, match=match):
            pool.commit(*args)
    assert_states(pool, before, "nothing written")
    pool.commit(T([1, -1]), T([3, 0]))  # in range: passes


@pytest.mark.parametrize(
    "args, exc, match",
    [
        ((torch.tensor([1.0]), T([1])), ValueError, "slots must be int32 or int64, got torch.float32"),
        ((T([1]), T([[1]])), ValueError, r"accepted_steps must be 1-D \[bs\], got shape \(1, 1\)"),
        ((T([1, 2]), T([1])), ValueError, r"accepted_steps must have as many entries as slots \(2\), got 1"),
        ((T([1]), T([1]).to(META)), ValueError, "accepted_steps must be on cpu, got meta"),
        (([1], T([1])), TypeError, "slots must be a torch.Tensor, got list"),
        ((T([1] * 6), T([1] * 6)), ValueError, r"slots must have at most spec_state_size \+ 1 = 5 entries"),
        ((T([1]), T([1]), T([2]), None), ValueError, "track_slots and track_steps must be given together"),
        ((T([1]), T([1]), T([2, 3]), T([1, 1])), ValueError, r"track_slots must have as many entries as slots \(1\)"),
        ((T([1]), T([1]), T([2]), torch.tensor([1.5])), ValueError, "track_steps must be int32 or int64"),
    ],
    ids=["float-slots", "2-d-steps", "lengths", "device", "list", "too-many", "track-alone", "track-length", "track-dtype"],
)
def test_commit_rejects_bad_input_before_writing(args, exc, match):
    pool = make_pool()
    before = snapshot(pool)
    with pytest.raises(exc, match=match):
        pool.commit(*args)
    assert_states(pool, before, "nothing written")


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda p: p.copy_from(T([1]), torch.tensor([2.0])), ValueError, "dst_index must be int32 or int64, got torch.float32"),
        (lambda p: p.copy_from(T([1, 2]), T([3])), ValueError, r"src_index must have as many entries as dst_index"),
        (lambda p: p.copy_from(T([1]).to(META), T([3])), ValueError, "src_index must be on cpu, got meta"),
        (lambda p: p.clear_slots(T([[1]])), ValueError, r"indices must be 1-D \[n\], got shape \(1, 1\)"),
        (lambda p: p.clear_slots([1]), TypeError, "indices must be a torch.Tensor, got list"),
        (lambda p: p.get_cpu_copy(T([1], dtype=torch.int16)), ValueError, "indices must be int32 or int64, got torch.int16"),
        (lambda p: p.load_cpu_copy(p.get_cpu_copy(T([1])), T([1]).to(META)), ValueError, "indices must be on cpu, got meta"),
    ],
    ids=["copy-dtype", "copy-lengths", "copy-device", "clear-2d", "clear-list", "cpu-copy-dtype", "load-device"],
)
def test_slot_operations_reject_bad_input_before_writing(call, exc, match):
    pool = make_pool()
    before = snapshot(pool)
    with pytest.raises(exc, match=match):
        call(pool)
    assert_states(pool, before, "nothing written")


# --- the host tier: state slots parked in host memory, alone and with their KV ---------------------



def test_the_commit_kernels_launch_cache_is_built_like_the_others():
    """Its arguments are what ``DirectLaunches`` takes (a wrong one fails only where direct launches
    run, on a GPU, at the first ``remember``)."""
    from kvpool.kernels.copy_rows import launcher as copy_rows
    from kvpool.kernels.state_commit import launcher as state_commit

    for cache in (state_commit.LAUNCHES, copy_rows.LAUNCHES):
        assert isinstance(cache.limit, int) and cache.limit > 0
        assert isinstance(cache.enabled, bool) and isinstance(cache.what, str)
