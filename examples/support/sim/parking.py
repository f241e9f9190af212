"""serve_sim's ways to keep a retracted request's K/V (``--host-tier``, ``--cpu-park``) and its
speculative decoding (``--spec-decode``)."""

from __future__ import annotations

import random
import time

import torch

from kvpool import MHATokenToKVPool, MLATokenToKVPool
from kvpool.host import MHATokenToKVPoolHost, MLATokenToKVPoolHost
from support.sim.config import SimConfig
from support.sim.result import SimResult
from support.sim.runner import ModelRunner
from support.sim.scheduler import Request, Scheduler
from support.sim.values import kv_values


# --- --host-tier: parking retracted requests in host memory ---------------------------------------


class HostParking:
    """Retracted requests' K/V in an ``MHATokenToKVPoolHost``: all layers are backed up when the
    request is retracted, and loaded back layer by layer (the pool's getters wait for each layer's
    event) when it resumes; the reloaded rows are then checked byte for byte. A request whose KV does
    not fit in the host tier is recomputed as without it.

    On CUDA the transfers run on the host pool's streams; this simulation synchronises around each
    one only to time it (the library itself never does)."""

    def __init__(self, cfg: SimConfig, pool: MHATokenToKVPool, runner: "ModelRunner", result: SimResult) -> None:
        self.cfg, self.pool, self.runner, self.result = cfg, pool, runner, result
        host_cls = MLATokenToKVPoolHost if isinstance(pool, MLATokenToKVPool) else MHATokenToKVPoolHost
        try:
            self.host = host_cls(pool, cfg.host_ratio, 0, cfg.page_size, cfg.host_layout, validate=cfg.validate)
        except ValueError as e:  # too few host slots for a page
            raise ValueError(f"--host-ratio {cfg.host_ratio:g} is too small: {e}") from None
        pool.register_layer_transfer_counter(self.host.layer_transfer_counter)
        self.bytes_per_token = self.host.size_per_token
        self.parked: dict[int, tuple[torch.Tensor, int]] = {}  # rid -> (host slots, tokens)

    def parked_len(self, r: Request) -> int:
        entry = self.parked.get(r.rid)
        return 0 if entry is None else entry[1]

    def _padded(self, slots: torch.Tensor, n: int) -> torch.Tensor:
        # Host transfers move whole pages; positions past the request's tokens are padding (-1).
        pad = torch.full((n - slots.shape[0],), -1, dtype=slots.dtype, device=slots.device)
        return torch.cat((slots, pad))

    def _timed(self, fn) -> None:
        cuda = self.pool.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.pool.device)
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(self.pool.device)
        self.result.host_seconds += time.perf_counter() - start

    def park(self, r: Request, slots: torch.Tensor) -> None:
        n = slots.shape[0]
        if n == 0:
            return
        host_slots = self.host.alloc(-(-n // self.host.page_size) * self.host.page_size)
        if host_slots is None:
            self.result.host_full += 1
            return
        device = self._padded(slots, host_slots.shape[0])
        backend = self.cfg.host_io_backend
        self._timed(lambda: self.host.backup_from_device_all_layer(self.pool, host_slots, device, backend))
        self.host.wait_for_backups()  # the slots are freed next: later writes wait for the backup
        self.parked[r.rid] = (host_slots, n)
        self.result.parked += 1
        self.result.host_bytes += n * self.bytes_per_token

    def resume(self, r: Request, slots: torch.Tensor) -> None:
        host_slots, n = self.parked.pop(r.rid)
        device = self._padded(slots, host_slots.shape[0])
        backend = self.cfg.host_io_backend
        self._timed(lambda: self.host.load_to_device_all_layer(self.pool, host_slots, device, backend))
        self.host.free(host_slots)  # a later backup into these pages waits for this load
        self.result.reloaded += 1
        self.result.reloaded_tokens += n
        self.result.host_bytes += n * self.bytes_per_token
        bad, _ = self.runner.verify(r, slots)  # reads through the getters: waits for each layer
        self.result.reload_mismatches += bad


# --- --cpu-park: parking retracted requests with get_cpu_copy / load_cpu_copy ----------------------


class CpuParking:
    """Retracted requests' K/V copied to host memory with ``pool.get_cpu_copy`` (all layers, exact
    bytes) and written back into the request's new slots with ``pool.load_cpu_copy`` when it resumes,
    as SGLang parks a retracted request; the reloaded rows are then checked byte for byte."""

    def __init__(self, pool: MHATokenToKVPool, runner: "ModelRunner", result: SimResult) -> None:
        self.pool, self.runner, self.result = pool, runner, result
        self.parked: dict[int, tuple[object, int]] = {}  # rid -> (KVCpuCopy, tokens)

    def parked_len(self, r: Request) -> int:
        entry = self.parked.get(r.rid)
        return 0 if entry is None else entry[1]

    def _bytes(self, copy: object) -> int:
        return sum(t.numel() * t.element_size() for t in (copy.k, copy.v))  # type: ignore[attr-defined]

    def park(self, r: Request, slots: torch.Tensor) -> None:
        if slots.shape[0] == 0:
            return
        copy = self.pool.get_cpu_copy(slots)
        self.parked[r.rid] = (copy, slots.shape[0])
        self.result.parked += 1
        self.result.cpu_bytes += self._bytes(copy)

    def resume(self, r: Request, slots: torch.Tensor) -> None:
        copy, n = self.parked.pop(r.rid)
        self.pool.load_cpu_copy(copy, slots)
        self.result.reloaded += 1
        self.result.reloaded_tokens += n
        self.result.cpu_bytes += self._bytes(copy)
        bad, _ = self.runner.verify(r, slots)
        self.result.reload_mismatches += bad


# --- --spec-decode: speculative decoding's verify write and compaction --------------------------


class SpecDecode:
    """Each step, every decoding request drafts K tokens (positions kv_len .. kv_len + K - 1) into K
    fresh slots, of which a random prefix of 1..K is accepted (never more than the request still
    produces). The drafts are laid out in reverse slot order (as a tree-shaped draft scatters them),
    the verify write stores only the accepted prefix with ``set_kv_buffer_prefix_valid``, and
    ``move_kv_cache`` then compacts the accepted tokens into position order (sources and targets
    overlap: the move must read every source before writing). Rejected slots are freed."""

    def __init__(self, cfg: SimConfig, sched: "Scheduler", runner: "ModelRunner", result: SimResult) -> None:
        self.cfg, self.sched, self.runner, self.result = cfg, sched, runner, result
        self.rng = random.Random(cfg.seed + 1)

    def step(self) -> int:
        """Decode every decoding request by its accepted drafts; returns the tokens accepted."""
        sched, k = self.sched, self.cfg.spec_k
        decode = [r for r in sched.running if not r.prefilling]
        while decode:  # every request needs room for all K drafts
            pages = sum(sched.pages_for(r.kv_len + k) - sched.pages_for(r.kv_len) for r in decode)
            if pages * sched.page_size <= sched.allocator.available_size():
                break
            sched.retract(decode.pop())
        if not decode:
            return 0
        bs, dev = len(decode), sched.device
        slots = sched.alloc_prefill([(r, r.kv_len, r.kv_len + k) for r in decode]).view(bs, k)
        start = torch.tensor([r.kv_len for r in decode], dtype=torch.int64, device=dev)
        positions = start[:, None] + torch.arange(k, device=dev)
        rows = torch.tensor([r.row for r in decode], dtype=torch.int64, device=dev)
        sched.table.write((rows[:, None].expand(bs, k).reshape(-1), positions.reshape(-1)), slots.reshape(-1).to(torch.int32))
        accepted = [min(self.rng.randint(1, k), r.output_len - r.generated) for r in decode]
        commit = torch.tensor(accepted, dtype=torch.int32, device=dev)
        drafts = slots.flip(1)  # draft j of request i sits in slot slots[i, k - 1 - j]
        rids = torch.stack([r.keys(r.kv_len, r.kv_len + k, dev) for r in decode])
        runner = self.runner
        for layer in runner.layers:
            kv = kv_values(rids.reshape(-1), positions.reshape(-1), layer.layer_id, self.cfg.heads, self.cfg.head_dim)
            k_scale, v_scale = runner.scales[layer.layer_id]
            runner.pool.set_kv_buffer_prefix_valid(layer, drafts, commit, kv[:, 0], kv[:, 1], k_scale, v_scale)
        # Accepted draft j moves from drafts[i, j] to slots[i, j], its position's slot in the table.
        keep = torch.arange(k, device=dev)[None, :] < commit[:, None]
        runner.pool.move_kv_cache(slots[keep], drafts[keep])
        sched.allocator.free(slots[~keep])
        self.after_verify(decode, accepted)
        for r, a in zip(decode, accepted):
            r.kv_len += a
            r.generated += a
        total = sum(accepted)
        self.result.spec_steps += 1
        self.result.drafted_tokens += bs * k
        self.result.accepted_tokens += total
        self.result.moved_slots += total
        return total

    def after_verify(self, decode: list[Request], accepted: list[int]) -> None:
        """What else a verify step keeps, before the requests advance (a hybrid model's states)."""
