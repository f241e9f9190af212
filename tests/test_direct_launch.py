"""The direct launch: after a kind of call's first launch through Triton's JIT, a ``KVWriter`` (and the
row copy and the state commit) launches the compiled kernel directly. If that direct launch fails (a
Triton whose compiled-kernel launcher takes its arguments differently), that writer, and only that
one, goes back to the JIT launch for good, logs one warning, and the write still happens. Also the
frames from a public call to the launch.

On the CPU there is no compiled kernel, so the JIT launch is wrapped (``kvassert.StandInJit``): it
runs the real (interpreted) kernel and hands back a stand-in for the compiled kernel that checks a
direct launch's positional arguments against the variant and launches the real kernel with them, or
raises like a launcher that takes its arguments differently.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

import kvpool
from kvassert import (
    StandInJit,
    assert_same_arguments,
    assert_same_bytes,
    bits,
    poison_,
)
from kvpool import MambaCacheParams, MambaPool, MambaStateShape, MHATokenToKVPool, reference_set_kv_buffer
from kvpool.pools.allocator import PagedTokenToKVPoolAllocator
from kvpool.kernels.allocator import kernel as allocator_kernel
from kvpool.kernels.allocator import launcher as allocator_kernels
from kvpool.kernels.copy_rows import launcher as copy_rows
from kvpool.kernels.copy_rows import kernel as copy_rows_kernel
from kvpool.kernels.state_commit import launcher as state_commit
from kvpool.kernels.state_commit import kernel as state_commit_kernel
from kvpool.kernels.store_kv import writer as store_kv
from kvpool.kernels.store_kv import kernel as store_kv_kernel
from kvpool.kernels.copy_rows import RowTable
from kvpool.kernels.store_kv.layout import storage_view
from kvpool.kernels.store_kv.writer import KVWriter
from kvpool.write_types import FUNCTION_NAMES, Geometry


# --- the launcher --------------------------------------------------------------------------------

#: The direct-launch tests stand in for the compiled kernel around the interpreter, on CPU tensors.
CPU = "cpu"


@pytest.fixture
def jit(monkeypatch):
    """The write kernel behind a JIT stand-in whose compiled stand-ins check every direct launch."""
    if not store_kv.INTERPRETER:
        pytest.skip("fakes the compiled kernel around Triton's interpreter")
    jit = StandInJit(store_kv_kernel.store_kv)
    monkeypatch.setattr(store_kv_kernel, "store_kv", jit)
    return jit


def _launcher(h=2, d=16, slots=12) -> tuple[KVWriter, torch.Tensor, torch.Tensor]:
    kc = poison_(torch.empty(slots, h, d, dtype=torch.float8_e4m3fn))
    vc = poison_(torch.empty(slots, h, d, dtype=torch.float8_e4m3fn))
    geometry = Geometry(kc.dtype, h, d, h, d, torch.device(CPU))
    launch = KVWriter(geometry, kc.stride(), vc.stride(), slots, "always")
    launch.launches.enabled = True  # as on a GPU; the interpreter turns it off
    return launch, kc, vc


def _write(launch, kc, vc, seed, scale=0.5):
    """One write through ``launch``, and the same write on fresh caches by the reference path."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(5, kc.shape[1], kc.shape[2], generator=g) * 100
    loc = torch.randperm(kc.shape[0], generator=g)[:5]
    loc[2] = -1
    launch.write(storage_view(kc), storage_view(vc), loc, k, k, scale, scale, FUNCTION_NAMES)
    ek, ev = poison_(torch.empty_like(kc)), poison_(torch.empty_like(vc))
    reference_set_kv_buffer(k, k, ek, ev, loc, scale, scale)
    return loc, ek, ev


def _assert_rows(kc, expected, loc, what):
    rows = [int(s) for s in loc if s >= 0]
    assert_same_bytes(kc[rows], expected[rows], what)


def test_failed_direct_launch_falls_back_for_that_launcher_only(jit, caplog):
    a, ka, va = _launcher()
    b, kb, vb = _launcher(h=1, d=32)
    jit.fail_next = True
    loc, ek, _ = _write(a, ka, va, seed=1)  # JIT launch; A keeps a compiled kernel that will fail
    _assert_rows(ka, ek, loc, "A, first write")
    jit.fail_next = False
    loc, ek, _ = _write(b, kb, vb, seed=2)  # JIT launch; B keeps a working one
    _assert_rows(kb, ek, loc, "B, first write")
    assert jit.launches == 2 and len(a.launches.entries) == len(b.launches.entries) == 1
    failing, working = jit.handed

    with caplog.at_level(logging.WARNING, logger="kvpool"):
        loc, ek, ev = _write(a, ka, va, seed=3, scale=2.0)  # direct launch fails -> JIT launch
    assert failing.calls == 1 and jit.launches == 3
    _assert_rows(ka, ek, loc, "A, the write whose direct launch failed")
    _assert_rows(va, ev, loc, "A (V), the write whose direct launch failed")
    warnings = [r for r in caplog.records if r.name == "kvpool" and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "direct launch of the compiled kernel failed" in warnings[0].getMessage()
    assert "takes its arguments differently" in warnings[0].getMessage()
    assert a.launches.enabled is False and not a.launches.entries

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvpool"):
        loc, ek, _ = _write(a, ka, va, seed=4)  # A no longer tries the direct launch
        loc_b, ek_b, _ = _write(b, kb, vb, seed=5)  # B still launches directly
    assert failing.calls == 1 and jit.launches == 4
    _assert_rows(ka, ek, loc, "A after the fallback")
    assert b.launches.enabled is True and working.calls == 1, "the other launcher must keep launching directly"
    _assert_rows(kb, ek_b, loc_b, "B, direct launch")
    assert not caplog.records, "one warning per launcher, not one per call"


def test_direct_launch_writes_what_the_jit_launch_writes(jit):
    """The direct launch's positional arguments (runtime ones, then the constexprs) reach the kernel
    in signature order: a write through the compiled stand-in equals the reference, for several
    scale kinds (each its own compiled variant)."""
    launch, kc, vc = _launcher(h=3, d=24)
    for scale in (None, 0.37, torch.tensor([1.5]), torch.tensor([0.2, 3.0, 9.0])):
        _write(launch, kc, vc, seed=6, scale=scale)  # JIT launch, keeps the compiled stand-in
        launches = jit.launches
        loc, ek, ev = _write(launch, kc, vc, seed=7, scale=scale)  # direct launch
        assert jit.launches == launches, f"scale {scale}: the second call did not launch directly"
        _assert_rows(kc, ek, loc, f"direct launch, scale {scale}")
        _assert_rows(vc, ev, loc, f"direct launch (V), scale {scale}")
    assert sum(c.calls for c in jit.handed) == 4


def test_pool_write_still_happens_when_its_direct_launch_fails(jit, caplog):
    pool = MHATokenToKVPool(16, 1, torch.float8_e4m3fn, 2, 8, 1, CPU, fused="always", warmup=False)
    other = MHATokenToKVPool(16, 1, torch.float8_e4m3fn, 2, 8, 1, CPU, fused="always", warmup=False)
    pool._writer.launches.enabled = other._writer.launches.enabled = True
    x = torch.randn(3, 2, 8) * 10
    loc = torch.tensor([1, 2, 3])
    jit.fail_next = True
    pool.set_kv_buffer(None, loc, x, x, layer_id_override=0)
    jit.fail_next = False
    other.set_kv_buffer(None, loc, x, x, layer_id_override=0)
    with caplog.at_level(logging.WARNING, logger="kvpool"):
        pool.set_kv_buffer(None, loc, x * 3, x * 3, layer_id_override=0)
        other.set_kv_buffer(None, loc, x * 3, x * 3, layer_id_override=0)
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    expected = MHATokenToKVPool(16, 1, torch.float8_e4m3fn, 2, 8, 1, CPU, fused="never")
    expected.set_kv_buffer(None, loc, x * 3, x * 3, layer_id_override=0)
    for p in (pool, other):
        for a, b in zip(p.get_kv_buffer(0), expected.get_kv_buffer(0)):
            assert_same_bytes(a, b, "after the failed direct launch")
        assert p.stats.fused_calls == 2
    assert pool._writer.launches.enabled is False and other._writer.launches.enabled is True


def test_a_repeated_write_launches_directly_what_its_jit_launch_bound(jit):
    """The same call twice: the direct launch passes, parameter by parameter in signature order,
    exactly what the JIT launch bound (the same tensors, equal values and constexprs)."""
    launch, kc, vc = _launcher(h=3, d=24)
    g = torch.Generator().manual_seed(8)
    k = torch.randn(4, 3, 24, generator=g)
    loc = torch.tensor([3, -1, 7, 1])
    for scale in (0.37, torch.tensor([1.5]), None):
        for _ in range(2):
            launch.write(storage_view(kc), storage_view(vc), loc, k, k, scale, scale, FUNCTION_NAMES)
        compiled = jit.handed[-1]
        assert compiled.calls == 1, f"scale {scale}: the second call did not launch directly"
        assert_same_arguments(compiled.direct[-1], compiled.bound, jit.params)


# --- the row copy's and the state commit's direct launches -------------------------------------------


@pytest.fixture
def row_jits(monkeypatch):
    """Both row kernels behind JIT stand-ins, on CPU tables, with their launch caches on and empty."""
    if not store_kv.INTERPRETER:
        pytest.skip("fakes the compiled kernels around Triton's interpreter")
    jits = {}
    for module, kernels, name in ((copy_rows, copy_rows_kernel, "copy_rows"),
                                  (state_commit, state_commit_kernel, "commit_rows")):  # fmt: skip
        jits[module] = StandInJit(getattr(kernels, name))
        monkeypatch.setattr(kernels, name, jits[module])
        monkeypatch.setattr(module, "kernel_on_cpu", True)
        monkeypatch.setattr(module.LAUNCHES, "enabled", True)
        monkeypatch.setattr(module.LAUNCHES, "entries", {})
    return jits[copy_rows], jits[state_commit]


def _random_bytes(shape, g) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)


def test_row_copies_launch_directly_after_their_first_launch_and_stay_exact(row_jits):
    """Copies of every kind Triton specialises on (index slices 16-byte aligned and not, int32 and
    int64 indices, 1, 16 and 17 pairs, a table moving rows within itself in one pass and through the
    staging buffer): the second round launches the compiled stand-ins only, each launch checked
    against its variant, and every result is the reference's."""
    jit, _ = row_jits
    g = torch.Generator().manual_seed(11)
    rows = 1100
    shapes = [(8, 16), (4, 6)]  # 128-byte rows and 24-byte rows (8-byte aligned)
    cases = [
        (16, 0, torch.int64, False), (16, 1, torch.int64, False), (1, 0, torch.int64, False),
        (17, 2, torch.int32, False), (7, 0, torch.int64, True), (1030, 0, torch.int64, True),
    ]  # fmt: skip
    for round_ in range(2):
        launches = jit.launches
        for n, offset, dtype, same in cases:
            dst = [_random_bytes((rows, *s), g) for s in shapes]
            src = dst if same else [_random_bytes((rows, *s), g) for s in shapes]
            expected = [b.clone() for b in dst]
            di = torch.randperm(rows, generator=g)[: n + offset].to(dtype)[offset:]
            si = torch.randperm(rows, generator=g)[: n + offset].to(dtype)[offset:]
            dt = RowTable.of(dst)
            st = dt if same else RowTable.of(src)
            et = RowTable.of(expected)
            copy_rows.copy_rows_reference(et, di, et if same else RowTable.of([b.clone() for b in src]), si)
            copy_rows.copy_rows(dt, di, st, si)
            for b, (got, want) in enumerate(zip(dst, expected)):
                what = f"round {round_}, {n} pairs at offset {offset}, {dtype}, same={same}: buffer {b}"
                assert_same_bytes(got, want, what)
        if round_ == 1:
            assert jit.launches == launches, f"{jit.launches - launches} launches went through the JIT in the second round"
    assert sum(c.calls for c in jit.handed) >= len(cases)


def test_a_repeated_row_copy_launches_directly_what_its_jit_launch_bound(row_jits):
    jit, _ = row_jits
    g = torch.Generator().manual_seed(12)
    dst, src = RowTable.of([_random_bytes((40, 32), g)]), RowTable.of([_random_bytes((40, 32), g)])
    di, si = torch.tensor([3, 9, -1, 20]), torch.tensor([5, 1, 2, 39])
    for _ in range(2):
        copy_rows.copy_rows(dst, di, src, si)
    compiled = jit.handed[-1]
    assert jit.launches == 1 and compiled.calls == 1
    assert_same_arguments(compiled.direct[-1], compiled.bound, jit.params)


STATE_PARAMS = MambaCacheParams(MambaStateShape(conv=(7, 3), temporal=(2, 3, 5)), (1, 2, 5))


def _state_pool(seed: int) -> MambaPool:
    pool = MambaPool(size=9, spec_state_size=4, cache_params=STATE_PARAMS, device="cpu", speculative_num_draft_tokens=3)
    g = torch.Generator().manual_seed(seed)
    for t in (*pool.conv, pool.temporal, *pool.intermediate_conv_window, pool.intermediate_ssm):
        t.view(torch.uint8).copy_(_random_bytes(t.view(torch.uint8).shape, g))
    pool.alloc_slots(pool.size)  # a commit names slots handed out
    return pool


def test_state_commits_launch_directly_after_their_first_launch_and_stay_exact(row_jits):
    """MambaPool.commit with int64 and int32 indices, one request (a count Triton specialises) and
    track slots: the second round launches the compiled stand-ins only (a launch cache built with
    the wrong arguments fails at its first ``remember``), and the states are the reference's."""
    _, jit = row_jits
    i32, i64 = torch.int32, torch.int64
    cases = [
        ([4, 1, 9], [3, 0, 2], None, None, i64),
        ([2, 7], [1, 3], None, None, i32),
        ([5], [2], None, None, i64),
        ([3, 6], [1, 2], [8, 2], [3, 0], i64),
    ]
    for round_ in range(2):
        launches = jit.launches
        for n, (slots, steps, track, track_steps, dtype) in enumerate(cases):
            pool, twin = _state_pool(n), _state_pool(n)
            args = [None if v is None else torch.tensor(v, dtype=dtype) for v in (slots, steps, track, track_steps)]
            pool.commit(*args)
            state_commit.commit_rows_reference(twin.row_table, twin.spec_row_table, 3, *args)
            for a, b, name in zip((*pool.conv, pool.temporal), (*twin.conv, twin.temporal), ("conv", "ssm")):
                assert_same_bytes(a.view(torch.uint8), b.view(torch.uint8), f"round {round_}, case {n}: {name}")
        if round_ == 1:
            assert jit.launches == launches, f"{jit.launches - launches} commits went through the JIT in the second round"
    assert sum(c.calls for c in jit.handed) == len(cases)


def test_a_repeated_state_commit_launches_directly_what_its_jit_launch_bound(row_jits):
    _, jit = row_jits
    pool = _state_pool(3)
    slots, steps = torch.tensor([4, 1]), torch.tensor([3, 1])
    for _ in range(2):
        pool.commit(slots, steps)
    compiled = jit.handed[-1]
    assert jit.launches == 1 and compiled.calls == 1
    assert_same_arguments(compiled.direct[-1], compiled.bound, jit.params)


def test_recorded_direct_launch_writes_the_same_bytes_again(jit):
    """``writer.launches.recording()`` hands a benchmark the direct launch a write made, and puts
    the compiled kernels back after the block; replaying the record, or launching it through the JIT
    with ``jit_launch_of``, writes the same bytes again."""
    pool = MHATokenToKVPool(16, 1, torch.float8_e4m3fn, 2, 8, 1, CPU, fused="always", warmup=False)
    writer = pool.writer
    writer.launches.enabled = True  # as on a GPU
    x = torch.randn(3, 2, 8) * 10
    loc = torch.tensor([1, 2, 3])
    pool.set_kv_buffer(None, loc, x, x, 0.5, 0.5, layer_id_override=0)  # JIT launch: keeps the compiled stand-in
    with writer.launches.recording() as records:
        pool.set_kv_buffer(None, loc, x, x, 0.5, 0.5, layer_id_override=0)
    assert len(records) == 1 and records[0].compiled is jit.handed[0]
    assert [b.compiled for b in writer.launches.entries.values()] == [jit.handed[0]], "the compiled kernel is back"
    assert [b.run for b in writer.launches.entries.values()] == [jit.handed[0].run], "the recorder is gone"
    expected = [bits(b).clone() for b in pool.get_kv_buffer(0)]
    replays = (("replay", records[0].replay), ("direct replay", records[0].replay_direct))
    for how, launch in (*replays, ("JIT launch", writer.jit_launch_of(records[0]))):
        for b in pool.get_kv_buffer(0):
            poison_(b)
        launch()
        for b, e in zip(pool.get_kv_buffer(0), expected):
            assert_same_bytes(bits(b)[loc], e[loc], f"{how} of the recorded launch")
            others = torch.ones(b.shape[0], dtype=torch.bool)
            others[loc] = False
            assert bool((bits(b)[others] == 0xFF).all()), f"{how}: rows the write does not name stay untouched"
    assert jit.launches == 2 and jit.handed[0].calls == 3, "one direct launch recorded, two replayed"
    assert pool.stats.fused_calls == 2, "replays are not pool writes"


@pytest.mark.parametrize("first, second", [(torch.int32, torch.int64), (torch.int64, torch.int32)], ids=["i32-i64", "i64-i32"])
def test_verify_writes_with_commit_lens_of_another_dtype_get_their_own_variant(jit, first, second):
    """commit_lens may be int32 or int64 whatever loc's type is; the compiled variant is typed by
    it, so a verify write whose commit_lens type differs from an earlier call's (all else equal)
    must not be launched directly on the earlier call's variant (it would read the lengths as the
    wrong integer type: int64 [3, 1] read as int32 is [3, 0])."""
    pool = MHATokenToKVPool(16, 1, torch.float8_e4m3fn, 2, 8, 1, CPU, fused="always", warmup=False)
    ref = MHATokenToKVPool(16, 1, torch.float8_e4m3fn, 2, 8, 1, CPU, fused="never")
    pool._writer.launches.enabled = True
    loc = torch.tensor([[1, 2, 3], [4, 5, 6]])
    x = torch.randn(6, 2, 8) * 10
    for step, dtype in enumerate([first, second, first, second]):
        commit = torch.tensor([[3, 1], [1, 2], [0, 3], [2, 0]][step], dtype=dtype)
        for p in (pool, ref):
            p.set_kv_buffer_prefix_valid(None, loc, commit, x * (step + 1), x, layer_id_override=0)
        for a, b in zip(pool.get_kv_buffer(0), ref.get_kv_buffer(0)):
            assert_same_bytes(a, b, f"step {step} (commit_lens {dtype})")
    assert jit.launches == 2, "one JIT launch per commit_lens type, then direct launches"

# --- frames from a public call to the kernel launch ------------------------------------------------

PACKAGE = Path(kvpool.__file__).resolve().parent


def _kvpool_frames() -> list[str]:
    """The kvpool functions on the caller's stack, innermost first."""
    names, frame = [], sys._getframe(1)
    while frame is not None:
        if Path(frame.f_code.co_filename).resolve().is_relative_to(PACKAGE):
            names.append(frame.f_code.co_name)
        frame = frame.f_back
    return names


@pytest.fixture
def frames(jit):
    """Direct launches record the kvpool frames under them; returns a function giving the frames of one call."""
    stacks: list[list[str]] = []
    jit.on_direct = lambda: stacks.append(_kvpool_frames())

    def of(call) -> list[str]:
        call()  # the first call of a kind launches through the JIT
        stacks.clear()
        call()
        assert len(stacks) == 1, f"{len(stacks)} direct launches for one call"
        return stacks[0]

    return of


def test_warm_eager_writes_reach_the_launch_in_two_kvpool_frames(frames):
    """A warm eager write is the entry and the writer's ``write``, which launches the compiled
    kernel: no other kvpool frame is on the stack when the launch happens."""
    mha = MHATokenToKVPool(16, 1, torch.float8_e4m3fn, 2, 8, 2, CPU, fused="always", warmup=False)
    mla = kvpool.MLATokenToKVPool(16, 1, torch.float8_e4m3fn, 16, 8, 2, CPU, fused="always", warmup=False)
    for pool in (mha, mla):
        pool._writer.launches.enabled = True
    x = torch.randn(3, 2, 8)
    row = torch.randn(3, 1, 24)
    loc = torch.tensor([1, 2, 3])
    scale = torch.tensor([0.5])
    assert frames(lambda: mha.set_kv_buffer(None, loc, x, x, scale, scale, layer_id_override=1)) == ["write", "set_kv_buffer"]
    assert frames(lambda: mha.set_kv_buffer_prefix_valid(None, loc.view(1, 3), torch.tensor([2]), x, x, 0.5, None, layer_id_override=0)) == ["write", "set_kv_buffer_prefix_valid"]  # fmt: skip
    assert frames(lambda: mla.set_kv_buffer(None, loc, row, None, scale, layer_id_override=0)) == ["write", "set_kv_buffer"]
    assert frames(lambda: mla.set_mla_kv_buffer(None, loc, row[:, :, :16], row[:, :, 16:], 0.5, layer_id_override=1)) == ["write", "set_mla_kv_buffer"]  # fmt: skip
    k_cache, v_cache = torch.zeros(8, 2, 8, dtype=torch.float8_e4m3fn), torch.zeros(8, 2, 8, dtype=torch.float8_e4m3fn)
    store_kv.writer_for(k_cache, v_cache, "always").launches.enabled = True
    assert frames(lambda: kvpool.fused_fp8_set_kv_buffer(x, x, k_cache, v_cache, loc, 0.5, 0.5)) == ["write", "fused_fp8_set_kv_buffer"]  # fmt: skip


def test_compiled_writes_reach_the_launch_in_two_kvpool_frames(frames):
    """Under torch.compile(fullgraph=True) the traced set_kv_buffer is gone at run time: the custom
    operator's implementation calls the writer's ``write``, which launches."""
    pool = MHATokenToKVPool(16, 1, torch.float8_e4m3fn, 2, 8, 1, CPU, fused="always", warmup=False)
    store_kv.writer_for(pool._k_views[0], pool._v_views[0], "always").launches.enabled = True
    torch._dynamo.reset()

    def step(x, loc, scale):
        pool.set_kv_buffer(None, loc, x, x, scale, scale, layer_id_override=0)
        return x.sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    x, loc, scale = torch.randn(3, 2, 8), torch.tensor([1, 2, 3]), torch.tensor([0.5])
    assert frames(lambda: compiled(x, loc, scale)) == ["write", "store_kv_custom_op"]


def test_a_launch_hook_keeps_triton_s_own_launch(jit):
    """With a launch hook set in Triton's knobs (a profiler's), a kept kernel launches through
    ``CompiledKernel[grid]``, which calls the hook; without one, through the launcher's entry."""
    from triton import knobs

    from kvpool.kernels.launch import Bound

    pool = MHATokenToKVPool(16, 1, torch.float8_e4m3fn, 2, 8, 1, CPU, fused="always", warmup=False)
    x, loc = torch.randn(3, 2, 8), torch.tensor([1, 2, 3])
    pool.set_kv_buffer(None, loc, x, x, 0.5, 0.5, layer_id_override=0)
    compiled = jit.handed[-1]
    assert Bound.of(compiled).run == compiled.run, "no hook: the launcher's entry"
    hook = knobs.runtime.launch_enter_hook
    seen: list = []
    if hasattr(hook, "add"):
        hook.add(seen.append)
        undo = lambda: hook.remove(seen.append)  # noqa: E731
    else:
        knobs.runtime.launch_enter_hook = seen.append
        undo = lambda: setattr(knobs.runtime, "launch_enter_hook", hook)  # noqa: E731
    try:
        bound = Bound.of(compiled)
    finally:
        undo()
    assert bound.run != compiled.run and bound.compiled is compiled, "a hook: Triton's own launch"
    calls = compiled.calls
    bound.run(1, 1, 1, 0, bound.function, bound.metadata, None, None, None, *compiled.bound)
    assert compiled.calls == calls + 1, "the launch went through compiled[grid]"


# --- the allocators' bookkeeping kernels' direct launches -----------------------------------------------


@pytest.fixture
def allocator_jits(monkeypatch):
    """Both bookkeeping kernels behind JIT stand-ins, for CPU allocators, launch caches on and empty."""
    if not store_kv.INTERPRETER:
        pytest.skip("fakes the compiled kernels around Triton's interpreter")
    jits = {}
    for name, cache in (("hand_out", allocator_kernels.HAND_OUTS), ("give_back", allocator_kernels.GIVE_BACKS)):
        jits[name] = StandInJit(getattr(allocator_kernel, name))
        monkeypatch.setattr(allocator_kernel, name, jits[name])
        monkeypatch.setattr(cache, "enabled", True)
        monkeypatch.setattr(cache, "entries", {})
    monkeypatch.setattr(allocator_kernels, "kernel_on_cpu", True)
    return jits


def test_allocator_calls_launch_directly_what_their_jit_launch_bound(allocator_jits):
    """A scheduler's step twice over (allocations of every kind at other sizes and offsets, frees to
    the ring, the release list and a free group): the second round launches only the compiled
    stand-ins, each checked against the variant of its kind, and the free lists end as the PyTorch
    path's do."""
    results = []
    for kernels in (False, True):
        allocator_kernels.kernel_on_cpu = kernels
        for need_sort in (False, True):
            a = PagedTokenToKVPoolAllocator(64, 4, need_sort=need_sort)
            for round_, n in enumerate((3, 6)):
                before = {k: j.launches for k, j in allocator_jits.items()}
                pre = torch.zeros(2, dtype=torch.int64)
                seq = torch.tensor([n, n + 1])
                first = a.alloc_extend(pre, pre, seq, seq, torch.tensor([-1, -1]), int(seq.sum()))
                held = torch.tensor([n, n + 1])
                last = torch.stack((first[n - 1], first[-1]))
                nxt = a.alloc_decode(held + 1, held + 1, last)
                whole = a.alloc(8)
                a.free(first[: n // 2])
                a.free_group_begin()
                a.free(torch.cat((first[n // 2 :], nxt)))
                a.free_group_end()
                a.free(whole)
                results.append((kernels, need_sort, round_, a.backup_state().free_pages.tolist()))
                if kernels and round_ == 1:
                    assert {k: j.launches for k, j in allocator_jits.items()} == before, "a launch went through the JIT"
    allocator_kernels.kernel_on_cpu = True
    half = len(results) // 2
    assert [r[1:] for r in results[:half]] == [r[1:] for r in results[half:]]
    for name, jit in allocator_jits.items():
        assert any(c.direct for c in jit.handed), f"{name} never launched directly"
