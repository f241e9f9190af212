"""A state machine for MambaPool under speculative decoding with track slots (a DFLASH setup: a
HybridReqToTokenPool with the extra buffer, up to 16 draft steps, track points every 64 tokens),
against a plain-Python model: alloc, free, fork, copy, clear, commit and CPU copies, with every
slot's bytes tagged and checked byte for byte after every step, interleaved with bad calls that must
raise and change nothing, and injected faults (the pool exhausted, a fork whose copy fails).

CI runs a bounded profile; ``KVPOOL_LONG_TESTS=1`` a long one (``KVPOOL_LONG_STEPS`` steps).
"""

from __future__ import annotations

from types import SimpleNamespace

import hypothesis.strategies as st
import pytest
import torch
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvassert import machine_test, state_params
from kvpool import HybridReqToTokenPool, MambaCpuCopy

PAGE = 64  # tokens between track points
# Tiny state rows (bf16 conv 3 x 2: 12 bytes, fp32 SSM 1 x 2 x 3: 24 bytes), two layers.
PARAMS = state_params(conv=(3, 2), temporal=(1, 2, 3), layers=(0, 2))


def pattern(tags: torch.Tensor, layers: int, n: int) -> torch.Tensor:
    """The bytes of tag ``t`` in a row of ``n`` bytes of layer ``l``: bytes 0..3 spell ``t`` (each
    offset by its position and layer), the rest run on from it; tag 0 is a zeroed row.
    [layers, *tags.shape, n] uint8."""
    t = tags.to(torch.int64)[None, ..., None]
    layer = torch.arange(layers).view(layers, *([1] * tags.dim()), 1)
    i = torch.arange(n)
    shift = torch.where(i < 4, 8 * i, torch.zeros_like(i))
    values = ((t >> shift) + i + 17 * layer) & 0xFF
    return (values * (t != 0)).to(torch.uint8)


def rows_of(t: torch.Tensor, lead: int) -> torch.Tensor:
    """``t`` as bytes, one row per entry of its first ``lead`` dimensions."""
    return t.view(torch.uint8).reshape(*t.shape[:lead], -1)


class StatePoolMachine(RuleBasedStateMachine):
    @initialize(k=st.integers(1, 16), rows=st.integers(1, 4), spare=st.integers(0, 5))
    def setup(self, k, rows, spare):
        self.table = HybridReqToTokenPool(
            size=rows, mamba_size=2 * rows + spare, max_context_len=4, device="cpu", cache_params=PARAMS,
            enable_mamba_extra_buffer=True, speculative_num_draft_tokens=k,
        )  # fmt: skip
        self.pool, self.k = self.table.mamba_pool, k
        self.slot_bufs = [*self.pool.conv, self.pool.temporal]
        self.scratch_bufs = [*self.pool.intermediate_conv_window, self.pool.intermediate_ssm]
        self.tags = [0] * (self.pool.size + 1)  # every slot's content; 0: zero bytes (as built)
        self.scratch = [[0] * k for _ in range(self.pool.spec_state_size + 1)]
        self.next_tag = 1
        self.running: dict[int, list[int]] = {}  # row -> [state slot, track slot, tokens]
        self.cache: set[int] = set()  # slots a prefix cache holds (forks, kept track slots)
        self.parked: list[tuple[MambaCpuCopy, list[int]]] = []

    # --- helpers ---------------------------------------------------------------------------------

    def tag(self) -> int:
        self.next_tag += 1
        return self.next_tag

    def write_slot(self, slot: int, tag: int) -> None:
        for buf in self.slot_bufs:
            raw = rows_of(buf, 2)
            raw[:, slot] = pattern(torch.tensor(tag), raw.shape[0], raw.shape[2])
        self.tags[slot] = tag

    def free_slots(self) -> list[int]:
        return [s for s in range(1, self.pool.size + 1) if not self.pool.is_held(s)]

    def held(self) -> list[int]:
        return self.pool.held_slots()

    def snapshot(self):
        t, p = self.table, self.pool
        tensors = [t.req_to_token, t.req_index_to_mamba_index_mapping, t.req_index_to_mamba_ping_pong_track_buffer_mapping,
                   *self.slot_bufs, *self.scratch_bufs]  # fmt: skip
        return (list(t.free_slots), list(p._slots._free), p.held_slots(), p.available_size(), t.available_size(),
                [(t.mamba_slot(r), t.track_slots(r)) for r in range(t.size)],
                [x.view(torch.uint8).clone() for x in tensors])  # fmt: skip

    def assert_unchanged(self, before, what: str) -> None:
        after = self.snapshot()
        assert after[:6] == before[:6], f"{what} changed the bookkeeping"
        for i, (a, b) in enumerate(zip(after[6], before[6])):
            assert torch.equal(a, b), f"{what} changed tensor {i}"

    def refused(self, call, what: str) -> None:
        before = self.snapshot()
        with pytest.raises((ValueError, IndexError, TypeError)):
            call()
        self.assert_unchanged(before, what)

    def T(self, values, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype)

    # --- requests --------------------------------------------------------------------------------

    @rule(n=st.integers(0, 2), tokens=st.integers(0, 3 * PAGE))
    def admit(self, n, tokens):
        fits = n <= len(self.table.free_slots) and 2 * n <= self.pool.available_size()
        before = self.snapshot()
        held_before = set(self.held())
        model_held = {s for v in self.running.values() for s in v[:2]} | self.cache
        rows = self.table.alloc(n)
        if not fits:
            assert rows is None
            self.assert_unchanged(before, "alloc without room")
            return
        for r in rows:
            assert r not in self.running, f"alloc handed out running row {r}"
            main, (track,) = self.table.mamba_slot(r), self.table.track_slots(r)
            new = {main, track}
            assert len(new) == 2 and new.isdisjoint(held_before) and new.isdisjoint(model_held), (
                f"alloc gave row {r} slots {sorted(new)}, not all free before"
            )
            held_before |= new
            model_held |= new
            self.tags[main] = self.tags[track] = 0  # new slots are zeroed
            self.running[r] = [main, track, tokens]

    @precondition(lambda self: self.running)
    @rule(data=st.data(), row_first=st.booleans(), keep_track=st.booleans())
    def finish(self, data, row_first, keep_track):
        r = data.draw(st.sampled_from(sorted(self.running)))
        main, track, _ = self.running.pop(r)
        free_state = lambda: self.table.free_mamba_cache(r, 0 if keep_track else None)  # noqa: E731
        for call in (lambda: self.table.free(r), free_state) if row_first else (free_state, lambda: self.table.free(r)):
            call()
        if keep_track:
            self.cache.add(track)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def model_writes_a_state(self, data):
        r = data.draw(st.sampled_from(sorted(self.running)))
        self.write_slot(self.running[r][0], self.tag())

    # --- the prefix cache's state slots ----------------------------------------------------------

    @precondition(lambda self: self.running)
    @rule(data=st.data(), dtype=st.sampled_from([torch.int32, torch.int64]))
    def fork(self, data, dtype):
        r = data.draw(st.sampled_from(sorted(self.running)))
        src = self.running[r][0]
        room = self.pool.available_size() > 0
        before = self.snapshot()
        dst = self.pool.fork_from(self.T([src], dtype))
        if not room:
            assert dst is None
            self.assert_unchanged(before, "fork_from without room")
            return
        (d,) = dst.tolist()
        assert d not in self.cache and all(d not in v[:2] for v in self.running.values())
        self.tags[d] = self.tags[src]
        self.cache.add(d)

    @precondition(lambda self: self.cache and self.running)
    @rule(data=st.data())
    def copy_on_write(self, data):
        """Several copies in one call (cache slots into running states and back), every source
        read before any destination is written."""
        into_requests = data.draw(st.booleans())
        cache, mains = sorted(self.cache), sorted(v[0] for v in self.running.values())
        froms, tos = (cache, mains) if into_requests else (mains, cache)
        n = data.draw(st.integers(1, min(3, len(tos))))
        srcs = data.draw(st.lists(st.sampled_from(froms), min_size=n, max_size=n))
        dsts = data.draw(st.lists(st.sampled_from(tos), min_size=n, max_size=n, unique=True))
        old = list(self.tags)
        self.pool.copy_from(self.T(srcs), self.T(dsts, torch.int32))
        for s, d in zip(srcs, dsts):
            self.tags[d] = old[s]

    @precondition(lambda self: self.cache)
    @rule(data=st.data())
    def evict(self, data):
        gone = data.draw(st.lists(st.sampled_from(sorted(self.cache)), min_size=1, max_size=3, unique=True))
        self.pool.free(self.T(gone) if data.draw(st.booleans()) else gone)
        self.cache -= set(gone)

    @precondition(lambda self: self.pool.held_slots())
    @rule(data=st.data())
    def clear(self, data):
        slots = data.draw(st.lists(st.sampled_from([-1, 0, *self.held()]), min_size=0, max_size=3))
        self.pool.clear_slots(self.T(slots))
        for s in slots:
            if s >= 0:
                self.tags[s] = 0

    # --- the verify step and its commit ----------------------------------------------------------

    @precondition(lambda self: self.running)
    @rule(data=st.data(), dtype=st.sampled_from([torch.int32, torch.int64]), pad=st.booleans())
    def verify_and_commit(self, data, dtype, pad):
        rows = data.draw(st.permutations(sorted(self.running)))
        rows = rows[: data.draw(st.integers(1, len(rows)))]
        batch = [*rows, *([None] if pad and len(rows) <= self.pool.spec_state_size else [])]
        slots, steps, track_slots, track_steps = [], [], [], []
        for i, r in enumerate(batch):
            tags = [self.tag() for _ in range(self.k)]  # what the verify step wrote for position i
            for buf in self.scratch_bufs:
                raw = rows_of(buf, 3)
                raw[:, i] = pattern(torch.tensor(tags), raw.shape[0], raw.shape[3])
            self.scratch[i] = tags
            if r is None:  # a padded batch position: negative slots, skipped
                slots.append(-1), steps.append(data.draw(st.integers(0, self.k)))
                track_slots.append(-1), track_steps.append(0)
                continue
            main, track, tokens = self.running[r]
            accepted = data.draw(st.integers(0, self.k))
            crossed = [j for j in range(1, accepted + 1) if (tokens + j) % PAGE == 0]
            slots.append(main), steps.append(accepted)
            track_slots.append(track), track_steps.append(crossed[0] if crossed else 0)
            self.running[r][2] = tokens + accepted
        self.pool.commit(self.T(slots, dtype), self.T(steps, dtype), self.T(track_slots, dtype), self.T(track_steps))
        for i, (d, a, td, ta) in enumerate(zip(slots, steps, track_slots, track_steps)):
            if d >= 0 and a:
                self.tags[d] = self.scratch[i][a - 1]
            if td >= 0 and ta:
                self.tags[td] = self.scratch[i][ta - 1]

    # --- CPU copies ------------------------------------------------------------------------------

    @precondition(lambda self: self.running and len(self.parked) < 3)
    @rule(data=st.data(), keyword=st.booleans())
    def park(self, data, keyword):
        r = data.draw(st.sampled_from(sorted(self.running)))
        slots = self.running[r][:2]
        copy = self.pool.get_cpu_copy(mamba_indices=self.T(slots)) if keyword else self.pool.get_cpu_copy(self.T(slots))
        self.parked.append((copy, [self.tags[s] for s in slots]))

    @precondition(lambda self: self.parked and self.running)
    @rule(data=st.data(), sglang_form=st.booleans())
    def unpark(self, data, sglang_form):
        copy, tags = self.parked.pop(data.draw(st.integers(0, len(self.parked) - 1)))
        r = data.draw(st.sampled_from(sorted(self.running)))
        dst = self.running[r][:2]
        self.pool.load_cpu_copy((list(copy.conv), copy.temporal) if sglang_form else copy, self.T(dst))
        for d, t in zip(dst, tags):
            self.tags[d] = t

    # --- bad calls and injected faults -----------------------------------------------------------

    @rule(data=st.data())
    def bad_call(self, data):
        p, t, T = self.pool, self.table, self.T
        free, held, size = self.free_slots(), self.held(), p.size
        running = sorted(self.running)
        free_rows = [r for r in range(t.size) if r not in self.running]
        some_held = held[:1] or [0]
        calls = [
            ("fork_from slot 0", lambda: p.fork_from(T([0]))),
            ("fork_from past the end", lambda: p.fork_from(T([size + 1]))),
            ("fork_from two slots", lambda: p.fork_from(T([*some_held, *some_held]))),
            ("fork_from a float", lambda: p.fork_from(torch.tensor([1.0]))),
            ("clear past the end", lambda: p.clear_slots(T([*some_held, size + 1]))),
            ("copy lengths", lambda: p.copy_from(T(some_held * 2), T(some_held))),
            ("commit steps past K", lambda: p.commit(T(some_held), T([self.k + 1]))),
            ("commit negative steps", lambda: p.commit(T(some_held), T([-1]))),
            ("commit too many", lambda: p.commit(T([-1] * (p.spec_state_size + 2)), T([0] * (p.spec_state_size + 2)))),
            ("commit track alone", lambda: p.commit(T(some_held), T([1]), T(some_held), None)),
            ("free slot 0", lambda: p.free([0])),
            ("free twice in one call", lambda: p.free(some_held * 2) if held else p.free([size + 1])),
            ("alloc -1", lambda: p.alloc(-1)),
            ("load a wrong copy", lambda: p.load_cpu_copy(p.get_cpu_copy(T([0])), T([0, 0]))),
            ("load both index forms", lambda: p.load_cpu_copy(p.get_cpu_copy(T([0])), T([0]), mamba_indices=T([0]))),
            ("get_cpu_copy negative", lambda: p.get_cpu_copy(T([-1]))),
            ("table alloc -1", lambda: t.alloc(-1)),
            ("table alloc 1.5", lambda: t.alloc(1.5)),
            ("table alloc None", lambda: t.alloc(None)),
            ("table free a free row", lambda: t.free(free_rows[:1] or [t.size])),
            ("state of a free row", lambda: t.free_mamba_cache(free_rows[0] if free_rows else t.size)),
            ("keep index True", lambda: t.free_mamba_cache(running[0] if running else 0, True)),
            ("other track index 5", lambda: t.get_mamba_ping_pong_other_idx(5)),
            ("mamba_slot -1", lambda: t.mamba_slot(-1)),
            ("write floats", lambda: t.write((0, slice(0, 2)), torch.tensor([1.5, 2.5]))),
        ]
        if free:
            f = free[0]
            calls += [
                ("fork_from a free slot", lambda: p.fork_from(T([f]))),
                ("copy into a free slot", lambda: p.copy_from(T(some_held), T([f]))),
                ("clear a free slot", lambda: p.clear_slots(T([f]))),
                ("commit a free slot", lambda: p.commit(T([f]), T([1]))),
                ("commit into a free track slot", lambda: p.commit(T([-1]), T([0]), T([f]), T([1]))),
                ("get_cpu_copy a free slot", lambda: p.get_cpu_copy(T([f]))),
                ("free a free slot", lambda: p.free([*held[:1], f])),
                ("alloc with a free track slot", lambda: t.alloc([SimpleNamespace(req_pool_idx=None, mamba_pool_idx=None,
                                                                                   mamba_ping_pong_track_buffer=T([f]))])),
            ]  # fmt: skip
        if len(running) >= 1:
            r0 = running[0]
            calls += [
                ("two requests keep one row", lambda: t.alloc([SimpleNamespace(req_pool_idx=r0), SimpleNamespace(req_pool_idx=r0)])),
                ("a running row's slot for a new request",
                 lambda: t.alloc([SimpleNamespace(req_pool_idx=None, mamba_pool_idx=T(self.running[r0][0]))])),
            ]  # fmt: skip
        name, call = data.draw(st.sampled_from(calls))
        self.refused(call, name)

    @rule(data=st.data())
    def exhausted(self, data):
        """Every free slot taken: allocations return None and change nothing."""
        hog = self.pool.alloc_slots(self.pool.available_size())
        before = self.snapshot()
        assert self.pool.alloc(1) is None and self.pool.alloc_slots(1) is None
        assert self.table.alloc(1) is None
        if self.running:
            r = data.draw(st.sampled_from(sorted(self.running)))
            assert self.pool.fork_from(self.T([self.running[r][0]])) is None
        self.assert_unchanged(before, "an allocation from an exhausted pool")
        self.pool.free(hog)

    @precondition(lambda self: self.running and self.pool.available_size())
    @rule(data=st.data())
    def fork_whose_copy_fails(self, data):
        r = data.draw(st.sampled_from(sorted(self.running)))
        pool = self.pool

        def broken(*args):
            raise RuntimeError("injected: the copy failed")

        pool.copy_from = broken
        try:
            before = self.snapshot()
            with pytest.raises(RuntimeError, match="injected"):
                pool.fork_from(self.T([self.running[r][0]]))
            after = self.snapshot()
            assert after[2:5] == before[2:5], "the new slot went back"
        finally:
            del pool.copy_from

    # --- after every step ------------------------------------------------------------------------

    @invariant()
    def matches_the_model(self):
        if not hasattr(self, "pool"):
            return
        self.table.check_integrity(external_slots=sorted(self.cache))
        owned = {s for v in self.running.values() for s in v[:2]} | self.cache
        assert set(self.held()) == owned
        tags = torch.tensor(self.tags)
        for buf in self.slot_bufs:
            raw = rows_of(buf, 2)
            assert torch.equal(raw, pattern(tags, raw.shape[0], raw.shape[2])), "a slot's bytes differ from its tag"
        for buf in self.scratch_bufs:
            raw = rows_of(buf, 3)
            assert torch.equal(raw, pattern(torch.tensor(self.scratch), raw.shape[0], raw.shape[3])), "scratch changed"


TestStatePoolMachine = machine_test(StatePoolMachine, examples=40, steps=40, seed=34)
