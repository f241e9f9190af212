"""``serve_sim --model qwen3.5``: the simulation on a hybrid linear-attention model's pools.

As in Qwen3.5, every 4th layer is full attention and the others are Gated DeltaNet layers. The full
layers' K/V go into a ``HybridLinearKVPool`` exactly as serve_sim writes and checks any K/V; each
request also holds a state slot of a ``MambaPool`` (through a ``HybridReqToTokenPool`` row), sized
with ``plan_hybrid_pools`` from the same budget for three quarters of the request rows, so that state
slots as well as KV pages decide who runs. The linear layers' states follow an exact recurrence over
the request's tokens, read from and written back to the request's slot every step:

* the SSM state, per lane: ``s <- (A * s + h(request, position, layer, lane)) mod P`` (integers below
  2**31 in the float32 state's bytes), so it depends on every token in order: a stale, shared,
  unzeroed or mixed-up slot gives another value;
* the convolution window: the last ``conv_kernel - 1`` inputs ``x(request, position, layer)`` (bf16
  bytes), zero before the first token.

A request's states are recomputed from its length alone and compared byte for byte when it finishes
(and after a host-tier or CPU reload); finishing and retraction free its state slot with its KV.
``--spec-decode K`` writes, per draft step, the state after that step into the pool's scratch and
keeps the accepted one with ``MambaPool.commit``; ``--host-tier`` parks a retracted request's state
with its KV (``HybridPoolHost``); ``--cpu-park`` with ``get_cpu_copy``; ``--corrupt`` flips one state
byte, which the state check must catch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch

from kvpool import HybridLinearKVPool, HybridPoolHost, HybridReqToTokenPool, MambaCacheParams, MambaPool, MambaStateShape
from kvpool.cache.himamba_host import HOST_STATE
from kvpool.pools.sizing import KVGeometry, plan_hybrid_pools
from support.sim.config import DTYPES
from support.sim.loop import Parts, SimResult, simulate
from support.sim.parking import CpuParking, HostParking, SpecDecode
from support.sim.runner import Checker, ModelRunner
from support.sim.scheduler import Scheduler

#: A small Gated DeltaNet (Qwen3.5's is 16 key / 64 value heads of 128 over 8 ranks): convolution
#: windows (96, 3) bf16 and SSM states (2, 16, 16) float32.
GDN = MambaStateShape.gated_delta_net(num_k_heads=2, num_v_heads=2, head_k_dim=16, head_v_dim=16, conv_kernel=4)
#: State slots for this share of the request rows (the rest wait for a slot, as states cap Qwen3.5).
STATE_SHARE = 0.75
#: The SSM recurrence's modulus (a prime below 2**31) and multiplier.
P, A = 2_147_483_647, 48_271


def full_attention_layers(layers: int) -> list[int]:
    """Qwen3.5's pattern: layer ``i`` is full attention iff ``(i + 1) % 4 == 0``."""
    return [i for i in range(layers) if (i + 1) % 4 == 0]


def _mix(key: torch.Tensor, lanes: torch.Tensor) -> torch.Tensor:
    """[T] int64 keys x [L] lanes -> [T, L] int64 below 2**31 (the hash serve_sim's K/V use)."""
    h = (key[:, None] * 4_099 + lanes) % P
    for _ in range(2):
        h = (h * 48_271) % P
        h = h ^ (h >> 11)
    return h % P


class StateModel:
    """The states the linear layers of a request hold after its first ``n`` tokens, and the steps
    that keep a ``MambaPool``'s slots that way."""

    def __init__(self, mamba: MambaPool, max_len: int) -> None:
        self.mamba, self.device = mamba, mamba.device
        (self.conv_dim, self.width), = mamba.cache_params.shape.conv
        powers = [1]
        for _ in range(max_len + 1):
            powers.append(powers[-1] * A % P)
        self.powers = torch.tensor(powers, dtype=torch.int64, device=self.device)
        self.ssm_lanes = torch.arange(mamba.cache_params.temporal_bytes // 4, dtype=torch.int64, device=self.device)
        self.conv_lanes = torch.arange(self.conv_dim, dtype=torch.int64, device=self.device)

    def h(self, rids: torch.Tensor, positions: torch.Tensor, layer: int) -> torch.Tensor:
        return _mix((rids * 65_537 + positions) * 131 + layer + 7, self.ssm_lanes)

    def x(self, rids: torch.Tensor, positions: torch.Tensor, layer: int) -> torch.Tensor:
        """[T, conv_dim] int64 in 0..2**15 - 1 (a bf16 bit pattern), 0 for positions before the first."""
        values = _mix((rids * 65_537 + positions) * 131 + layer + 11, self.conv_lanes) % 32_768
        return torch.where(positions[:, None] >= 0, values, 0)

    def ssm(self, layer: int) -> torch.Tensor:
        """The pool's SSM states of ``layer`` as int32 lanes: [slots, lanes] (a view)."""
        t = self.mamba.get_ssm_state(layer)
        return t.view(torch.int32).view(t.shape[0], -1)

    def conv(self, layer: int) -> torch.Tensor:
        """The pool's convolution windows of ``layer`` as int16: [slots, conv_dim, width] (a view)."""
        return self.mamba.get_conv_state(layer).view(torch.int16)

    def advance(self, slots: torch.Tensor, keys: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor) -> None:
        """Every linear layer's state in ``slots[i]`` moves on over positions ``starts[i]..ends[i] - 1``
        (each [S] int64 on the pool's device) of tokens whose keys (``Request.keys``) are ``keys``
        ([sum(ends - starts)] int64, segment after segment)."""
        n = ends - starts
        total = int(n.sum())
        first = torch.cumsum(n, 0) - n
        seg = torch.repeat_interleave(torch.arange(slots.shape[0], device=self.device), n, output_size=total)
        pos = starts[seg] + torch.arange(total, device=self.device) - first[seg]
        weight = self.powers[ends[seg] - 1 - pos]
        for layer in self.mamba.layers:
            ssm = self.ssm(layer)
            old = ssm[slots].to(torch.int64)
            terms = (self.h(keys, pos, layer) * weight[:, None]) % P
            summed = torch.zeros_like(old).index_add_(0, seg, terms) % P
            ssm[slots] = ((old * self.powers[n][:, None] + summed) % P).to(torch.int32)
            conv = self.conv(layer)
            window = conv[slots].to(torch.int64)
            cols = []
            for j in range(self.width):  # column j: the old window's column n + j, or the new input at position p
                kept = window[torch.arange(slots.shape[0], device=self.device), :, (n + j).clamp(max=self.width - 1)]
                p = ends - self.width + j
                new = self.x(keys[(first + p - starts).clamp(0, max(total - 1, 0))], p, layer)
                cols.append(torch.where((n + j < self.width)[:, None], kept, new))
            conv[slots] = torch.stack(cols, -1).to(torch.int16)

    def speculate(self, slots: torch.Tensor, rids: torch.Tensor, starts: torch.Tensor, steps: int) -> None:
        """The verify step's scratch: for batch position ``i`` and draft step ``j``, the state after
        positions ``starts[i]..starts[i] + j`` (from the state in ``slots[i]``), as a model writes it."""
        bs = slots.shape[0]
        for layer in self.mamba.layers:
            s = self.ssm(layer)[slots].to(torch.int64)
            w = self.conv(layer)[slots].to(torch.int64)
            scratch_ssm = self.mamba.get_intermediate_ssm_state(layer)
            scratch_ssm = scratch_ssm.view(torch.int32).view(scratch_ssm.shape[0], steps, -1)
            scratch_conv = self.mamba.get_intermediate_conv_window(layer).view(torch.int16)
            for j in range(steps):
                s = (s * A + self.h(rids, starts + j, layer)) % P
                w = torch.cat((w[:, :, 1:], self.x(rids, starts + j, layer)[:, :, None]), dim=2)
                scratch_ssm[:bs, j] = s.to(torch.int32)
                scratch_conv[:bs, j] = w.to(torch.int16)

    def verify(self, keys: torch.Tensor, slot: int) -> int:
        """1 if any linear layer's state in ``slot`` differs from the state after tokens of keys
        ``keys`` ([length] int64, ``Request.keys``; recomputed from nothing), else 0."""
        dev, length = self.device, keys.shape[0]
        pos = torch.arange(length, dtype=torch.int64, device=dev)
        cols = torch.arange(self.width, dtype=torch.int64, device=dev) + length - self.width
        for layer in self.mamba.layers:
            ssm = ((self.h(keys, pos, layer) * self.powers[length - 1 - pos][:, None]) % P).sum(0) % P
            window = self.x(keys[cols.clamp(min=0)], cols, layer).t()
            if not (torch.equal(self.ssm(layer)[slot], ssm.to(torch.int32))
                    and torch.equal(self.conv(layer)[slot], window.to(torch.int16))):  # fmt: skip
                return 1
        return 0


def _slot_of(table: HybridReqToTokenPool, r: Any) -> torch.Tensor:
    return torch.tensor([table.mamba_slot(r.row)], dtype=torch.int64, device=table.device)


# --- the parts serve_sim's classes gain (combined with them in run) ---------------------------------


class SchedulerWithStates:
    """The request table holds a state slot per request; finishing and retraction free it with the KV."""

    def __init__(self, cfg: Any, pool: HybridLinearKVPool, table: HybridReqToTokenPool) -> None:
        super().__init__(cfg, pool)  # type: ignore[call-arg]
        self.table = table

    def release(self, r: Any) -> None:
        if self.table.mamba_slot(r.row):
            self.table.free_mamba_cache(r.row)
        super().release(r)  # type: ignore[misc]


class RunnerWithStates:
    """K/V for the full-attention layers (serve_sim's runner, by global layer id), states for the others."""

    def __init__(self, cfg: Any, pool: HybridLinearKVPool, table: HybridReqToTokenPool, states: StateModel) -> None:
        super().__init__(cfg, pool)  # type: ignore[call-arg]
        layer = type(self.layers[0])  # type: ignore[attr-defined]
        self.layers = [layer(i) for i in pool.full_attention_layer_ids]
        self.table, self.states = table, states

    def forward(self, batch: Any) -> None:
        super().forward(batch)  # type: ignore[misc]
        self.advance_states(batch.prefill + [(r, r.kv_len, r.kv_len + 1) for r in batch.decode])

    def advance_states(self, segments: list) -> None:
        """Each request's states move on over its segment ``(request, start, end)``'s positions."""
        if not segments:
            return
        dev = self.states.device
        slots = torch.tensor([self.table.mamba_slot(r.row) for r, _, _ in segments], dtype=torch.int64, device=dev)
        keys = torch.cat([r.keys(s, e, dev) for r, s, e in segments])
        starts = torch.tensor([s for _, s, _ in segments], dtype=torch.int64, device=dev)
        ends = torch.tensor([e for _, _, e in segments], dtype=torch.int64, device=dev)
        self.states.advance(slots, keys, starts, ends)

    def verify_state(self, r: Any, length: int, slot: Optional[int] = None) -> int:
        """1 if the state in ``slot`` (default: ``r``'s own) is not ``r``'s after ``length`` tokens."""
        slot = self.table.mamba_slot(r.row) if slot is None else slot
        return self.states.verify(r.keys(0, length, self.states.device), slot)


class CheckerWithStates:
    """Each request's states are checked with its K/V; ``--corrupt`` flips a state byte instead."""

    def check(self, r: Any, slots: torch.Tensor) -> None:
        runner = self.runner  # type: ignore[attr-defined]
        if self.corrupt_pending:  # type: ignore[has-type]
            ssm = runner.states.ssm(runner.states.mamba.layers[-1])
            ssm.view(torch.uint8).view(ssm.shape[0], -1)[runner.table.mamba_slot(r.row), 5] ^= 0x5A
            self.corrupt_pending = False
        super().check(r, slots)  # type: ignore[misc]
        self.result.state_checked += 1  # type: ignore[attr-defined]
        self.result.state_mismatches += runner.verify_state(r, r.kv_len)  # type: ignore[attr-defined]


class SpecWithStates:
    """The verify step writes every draft step's state into the scratch; commit keeps the accepted one."""

    def after_verify(self, decode: list, accepted: list[int]) -> None:
        runner = self.runner  # type: ignore[attr-defined]
        dev = runner.states.device
        slots = torch.tensor([runner.table.mamba_slot(r.row) for r in decode], dtype=torch.int64, device=dev)
        rids = torch.tensor([r.rid for r in decode], dtype=torch.int64, device=dev)
        starts = torch.tensor([r.kv_len for r in decode], dtype=torch.int64, device=dev)
        runner.states.speculate(slots, rids, starts, self.cfg.spec_k)  # type: ignore[attr-defined]
        runner.states.mamba.commit(slots, torch.tensor(accepted, dtype=torch.int32, device=dev))


class HostParkingWithStates:
    """A retracted request's state is parked with its KV pages (``HybridPoolHost``) and reloaded
    with them; both are checked after the reload."""

    def __init__(self, cfg: Any, pool: HybridLinearKVPool, runner: Any, result: Any) -> None:
        # Not serve_sim's constructor: the KV host pool is HybridPoolHost's.
        self.cfg, self.pool, self.runner, self.result = cfg, pool, runner, result
        try:
            self.hybrid = HybridPoolHost(pool, cfg.host_ratio, 0, cfg.page_size, cfg.host_layout, validate=cfg.validate)
        except ValueError as e:  # too few host slots for a page
            raise ValueError(f"--host-ratio {cfg.host_ratio:g} is too small: {e}") from None
        self.host = self.hybrid.kv_host
        pool.register_layer_transfer_counter(self.host.layer_transfer_counter)
        self.bytes_per_token = self.host.size_per_token
        self.parked: dict[int, tuple[torch.Tensor, int]] = {}
        self.states: dict[int, torch.Tensor] = {}

    def park(self, r: Any, slots: torch.Tensor) -> None:
        n = slots.shape[0]
        if n == 0:
            return
        states = self.hybrid.state_host
        kv_h = self.host.alloc(-(-n // self.host.page_size) * self.host.page_size)
        state_h = states.alloc(1) if kv_h is not None else None
        if state_h is None:
            if kv_h is not None:
                self.host.free(kv_h)
            self.result.host_full += 1
            return
        device, slot = self._padded(slots, kv_h.shape[0]), _slot_of(self.runner.table, r)  # type: ignore[attr-defined]
        backend = self.cfg.host_io_backend
        self._timed(lambda: self.hybrid.backup(kv_h, device, state_h, slot, backend))  # type: ignore[attr-defined]
        self.hybrid.wait_for_backups()  # the slots are freed next: later writes wait for the backups
        self.parked[r.rid], self.states[r.rid] = (kv_h, n), state_h
        self.result.parked += 1
        self.result.host_bytes += n * self.bytes_per_token + states.get_size_per_token()

    def resume(self, r: Any, slots: torch.Tensor) -> None:
        kv_h, n = self.parked.pop(r.rid)
        state_h = self.states.pop(r.rid)
        device, slot = self._padded(slots, kv_h.shape[0]), _slot_of(self.runner.table, r)  # type: ignore[attr-defined]
        backend = self.cfg.host_io_backend
        self._timed(lambda: self.hybrid.load(kv_h, device, state_h, slot, backend))  # type: ignore[attr-defined]
        self.hybrid.state_host.wait_for_loads()  # the next forward reads the state (the KV: through the getters)
        self.host.free(kv_h)
        self.hybrid.state_host.free(state_h)
        self.result.reloaded += 1
        self.result.reloaded_tokens += n
        self.result.host_bytes += n * self.bytes_per_token + self.hybrid.state_host.get_size_per_token()
        bad, _ = self.runner.verify(r, slots)
        self.result.reload_mismatches += bad
        self.result.state_checked += 1
        self.result.state_mismatches += self.runner.verify_state(r, n)


def host_pool(cfg: Any, pool: HybridLinearKVPool) -> HybridPoolHost:
    """``--host-tier``'s host pool for the hybrid prefix cache: KV pages and state slots, each
    ``--host-ratio`` of their device pool."""
    try:
        return HybridPoolHost(pool, cfg.host_ratio, 0, cfg.page_size, cfg.host_layout, validate=cfg.validate)
    except ValueError as e:  # too few host slots for a page
        raise ValueError(f"--host-ratio {cfg.host_ratio:g} is too small: {e}") from None


def parked_states(node: Any) -> int:
    """The state snapshots parked on the host from ``node`` (a match's ``last_host_node``) up to its
    first ancestor on the device: those ``init_load_back`` loads with the KV."""
    n = 0
    while node.device is None:
        n += HOST_STATE in node.records
        node = node.parent
    return n


def fork_loaded(cache: Any, params: Any, node: Any, prefix: torch.Tensor) -> None:
    """Start the loads a ``HiMambaRadixCache`` prepared and fork the loaded state into the request's
    slot: a second match with ``cow_mamba``, which must end on ``node`` with the slots ``prefix``."""
    cache.ready_to_load_host_cache()
    again = cache.match_prefix(params)
    if again.last_device_node is not node or not torch.equal(again.device_indices, prefix):
        raise RuntimeError(
            f"the match after a load back must end on the loaded node {node.id} with {prefix.numel()} slots, got "
            f"node {again.last_device_node.id} with {again.device_indices.numel()}"
        )


class CpuParkingWithStates:
    """``--cpu-park``: the state goes to host memory with ``MambaPool.get_cpu_copy`` beside the KV."""

    def __init__(self, pool: HybridLinearKVPool, runner: Any, result: Any) -> None:
        super().__init__(pool, runner, result)  # type: ignore[call-arg]
        self.states: dict[int, Any] = {}

    def park(self, r: Any, slots: torch.Tensor) -> None:
        super().park(r, slots)  # type: ignore[misc]
        if r.rid in self.parked:  # type: ignore[attr-defined]
            self.states[r.rid] = self.runner.states.mamba.get_cpu_copy(_slot_of(self.runner.table, r))  # type: ignore[attr-defined]

    def resume(self, r: Any, slots: torch.Tensor) -> None:
        n = self.parked[r.rid][1]  # type: ignore[attr-defined]
        super().resume(r, slots)  # type: ignore[misc]
        runner = self.runner  # type: ignore[attr-defined]
        runner.states.mamba.load_cpu_copy(self.states.pop(r.rid), _slot_of(runner.table, r))
        self.result.state_checked += 1  # type: ignore[attr-defined]
        self.result.state_mismatches += runner.verify_state(r, n)  # type: ignore[attr-defined]


def _with(mixin: type, base: type) -> type:
    return type(base.__name__, (mixin, base), {})


@dataclass
class Build:
    """What a hybrid run is made of, before it runs."""

    pool: HybridLinearKVPool
    table: HybridReqToTokenPool
    runner: Any
    result: Any
    parts: Any


def build(cfg: Any, extra_buffer: bool = False, spare_states: int = 0, runner_mixin: Optional[type] = None) -> Build:
    """The hybrid pools, runner, result and parts of ``cfg``'s run.
    ``extra_buffer``: each request also holds SGLang's track slots; ``spare_states``: state slots for
    that many more requests (a prefix cache's snapshots); ``runner_mixin``: mixed into the runner."""
    dtype = DTYPES[cfg.dtype]
    full = full_attention_layers(cfg.layers)
    linear = [i for i in range(cfg.layers) if i not in full]
    kv = KVGeometry(cfg.heads, cfg.head_dim, len(full), dtype)
    state = MambaCacheParams(GDN, linear)
    spec = cfg.spec_k or None
    tracks = (2 if spec is None else 1) if extra_buffer else 0
    try:
        plan = plan_hybrid_pools(
            int(cfg.kv_budget_mib * 2**20), kv.bytes_per_token, state, page_size=cfg.page_size,
            max_running_requests=max(1, int(cfg.max_running * STATE_SHARE)) + spare_states,
            speculative_num_draft_tokens=spec, track_slots_per_request=tracks,
        )  # fmt: skip
    except ValueError:  # the budget does not hold the states plus a page of KV
        raise ValueError(
            f"--kv-budget-mib must hold the states of the running requests plus a page of KV, got {cfg.kv_budget_mib:g} MiB"
        ) from None
    if -(-cfg.max_context_len // cfg.page_size) + 1 > plan.kv_size // cfg.page_size:
        raise ValueError(
            f"--kv-budget-mib must hold the longest request ({cfg.max_context_len} tokens) plus a page after the "
            f"states, got {cfg.kv_budget_mib:g} MiB = {plan.kv_size} KV slots and {plan.mamba_size} state slots"
        )
    table = HybridReqToTokenPool(
        size=cfg.max_running, mamba_size=plan.mamba_size, mamba_spec_state_size=plan.spec_state_size or None,
        max_context_len=cfg.max_context_len, device=cfg.device, cache_params=state,
        enable_mamba_extra_buffer=extra_buffer, speculative_num_draft_tokens=spec, validate=cfg.validate,
    )  # fmt: skip
    pool = HybridLinearKVPool(
        plan.kv_size, dtype, cfg.page_size, cfg.heads, cfg.head_dim, full, False, cfg.device, table.mamba_pool
    )
    states = StateModel(table.mamba_pool, cfg.max_context_len + cfg.spec_k)
    runner_cls = _with(RunnerWithStates, ModelRunner)
    if runner_mixin is not None:
        runner_cls = _with(runner_mixin, runner_cls)
    runner = runner_cls(cfg, pool, table, states)
    result = SimResult(cfg, plan.kv_size, kv.bytes_per_token, device=str(pool.device))
    parts = Parts(
        scheduler=functools.partial(_with(SchedulerWithStates, Scheduler), table=table),
        host_parking=_with(HostParkingWithStates, HostParking),
        cpu_parking=_with(CpuParkingWithStates, CpuParking),
        spec=_with(SpecWithStates, SpecDecode),
        checker=_with(CheckerWithStates, Checker),
    )  # fmt: skip
    return Build(pool, table, runner, result, parts)


def run(cfg: Any) -> Any:
    """serve_sim's run on the hybrid pools."""
    b = build(cfg)
    simulate(cfg, b.pool, b.runner, b.result, b.parts)
    return b.result
