"""serve_sim's requests, batches and scheduler: admission, slot allocation, retraction and freeing."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from kvpool import MHATokenToKVPool
from kvpool.pools.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from kvpool.pools.req_to_token import ReqToTokenPool
from support.sim.config import NEW_TOKEN_RATIO, SimConfig

@dataclass
class Request:
    """A request's progress. Its sequence has ``prompt_len + output_len`` tokens; the K/V of
    positions ``0..kv_len-1`` is in the pool at ``req_to_token[row, :kv_len]``."""

    rid: int
    prompt_len: int
    output_len: int
    arrival: int
    row: Optional[int] = None
    kv_len: int = 0
    generated: int = 0
    prefill_target: int = 0  # kv_len at which (re-)prefill ends and one token is produced

    @property
    def prefilling(self) -> bool:
        return self.kv_len < self.prefill_target

    @property
    def final_kv_len(self) -> int:
        return self.prompt_len + self.output_len - 1  # the last output token's K/V is never written

    def keys(self, start: int, end: int, device: torch.device) -> torch.Tensor:
        """What the K/V of positions ``start..end - 1`` derive from besides position and layer: Tensor
        [end - start] int64 below 2**31, here the request id (a prefix-cache workload's requests derive
        it from their tokens, so that equal prefixes hold equal K/V)."""
        return torch.full((end - start,), self.rid, dtype=torch.int64, device=device)


@dataclass
class Batch:
    """One forward step: prefill chunks first, then one decode token per decoding request."""

    prefill: list[tuple[Request, int, int]]  # (request, from position, to position)
    decode: list[Request]
    loc: torch.Tensor  # [T] int64 slots
    rids: torch.Tensor  # [T] int64: each token's key (Request.keys), what its K/V derive from
    positions: torch.Tensor  # [T] int64

    @property
    def prefill_tokens(self) -> int:
        return sum(end - start for _, start, end in self.prefill)




class Parking(Protocol):
    """Where a retracted request's K/V waits (``--host-tier``, ``--cpu-park``: support.sim.parking)."""

    def parked_len(self, r: Request) -> int: ...

    def park(self, r: Request, slots: torch.Tensor) -> None: ...

    def resume(self, r: Request, slots: torch.Tensor) -> None: ...


class Scheduler:
    """Admission, slot allocation, retraction and freeing, in the shape of SGLang's scheduler."""

    def __init__(self, cfg: SimConfig, pool: MHATokenToKVPool) -> None:
        self.cfg = cfg
        self.device = pool.device
        self.page_size = cfg.page_size
        self.allocator = self.make_allocator(cfg, pool)
        self.capacity = self.allocator.available_size()
        self.table = ReqToTokenPool(cfg.max_running, cfg.max_context_len, self.device)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.retractions = 0
        self.host: Optional[Parking] = None  # --host-tier / --cpu-park

    def make_allocator(self, cfg: SimConfig, pool: MHATokenToKVPool) -> Any:
        """The slot allocator over ``pool`` (a model with more than one pool part swaps it): the token
        allocator at ``--page-size 1``, else the paged one. Page size 1 allocates with ``alloc`` only."""
        if cfg.page_size == 1:
            return TokenToKVPoolAllocator(pool.size, pool.dtype, self.device, pool, validate=cfg.validate)
        return PagedTokenToKVPoolAllocator(pool.size, cfg.page_size, pool.dtype, self.device, pool, validate=cfg.validate)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def decode_reserve(self, r: Request, kv_len: int) -> int:
        """Pages request ``r`` is expected to add while decoding from ``kv_len`` tokens: a fraction
        of its remaining output (SGLang's new_token_ratio idea)."""
        expected = math.ceil(NEW_TOKEN_RATIO * (r.output_len - r.generated))
        return self.pages_for(kv_len + expected) - self.pages_for(kv_len)

    def schedule(self, with_decode: bool = True) -> Optional[Batch]:
        """Pick this step's work, reserve its slots and record them in the request table
        (``with_decode=False``: prefill only; --spec-decode decodes separately)."""
        decode = self._schedule_decode() if with_decode else []
        prefill = self._schedule_prefill(decode)
        if not prefill and not decode:
            return None
        loc = torch.cat((self.alloc_prefill(prefill), self._alloc_decode(decode)))
        segments = prefill + [(r, r.kv_len, r.kv_len + 1) for r in decode]
        starts = torch.tensor([s for _, s, _ in segments], dtype=torch.int64, device=self.device)
        counts = torch.tensor([e - s for _, s, e in segments], dtype=torch.int64, device=self.device)
        keys = torch.cat([r.keys(s, e, self.device) for r, s, e in segments])
        rows = torch.tensor([r.row for r, _, _ in segments], dtype=torch.int64, device=self.device)
        tokens = loc.shape[0]

        def per_token(per_segment: torch.Tensor) -> torch.Tensor:
            return torch.repeat_interleave(per_segment, counts, output_size=tokens)

        offsets = torch.arange(tokens, device=self.device) - per_token(torch.cumsum(counts, 0) - counts)
        positions = per_token(starts) + offsets
        self.table.write((per_token(rows), positions), loc.to(torch.int32))
        return Batch(prefill, decode, loc, keys, positions)

    def _schedule_decode(self) -> list[Request]:
        """Decoding requests, minus those retracted to make room for the rest (newest first)."""
        decode = [r for r in self.running if not r.prefilling]
        while decode:
            need = sum(1 for r in decode if r.kv_len % self.page_size == 0)
            if need * self.page_size <= self.room():
                return decode
            self.retract(decode.pop())
        return decode

    def _schedule_prefill(self, decode: list[Request]) -> list[tuple[Request, int, int]]:
        """Continue chunked prefills, then admit waiting requests, within the token budget and the
        free pages, keeping pages back for the running requests' expected decode."""
        budget = self.cfg.chunk_size
        free_pages = self.room() // self.page_size
        free_pages -= sum(1 for r in decode if r.kv_len % self.page_size == 0)
        plan: list[tuple[Request, int, int]] = []
        for r in [r for r in self.running if r.prefilling]:
            end = min(r.prefill_target, r.kv_len + budget)
            pages = self.pages_for(end) - self.pages_for(r.kv_len)
            if end > r.kv_len and pages <= free_pages:
                plan.append((r, r.kv_len, end))
                budget -= end - r.kv_len
                free_pages -= pages
        reserved = sum(self.decode_reserve(r, max(r.kv_len, r.prefill_target)) for r in self.running)
        while self.waiting and budget > 0:
            r = self.waiting[0]
            admitted = self.admit(r, budget, free_pages - reserved)
            if admitted is None:
                break
            start, end, pages = admitted
            self.waiting.popleft()
            self.running.append(r)
            plan.append((r, start, end))
            budget -= end - start
            free_pages -= pages
            reserved += self.decode_reserve(r, r.prefill_target)
        return plan

    def admit(self, r: Request, budget: int, pages: int) -> Optional[tuple[int, int, int]]:
        """Give waiting request ``r`` a table row if its first chunk (at most ``budget`` tokens) fits
        in ``pages`` free pages: returns (its first position to compute, the chunk's end, the pages
        the admission takes from the free ones), or None with nothing changed. A retracted request
        re-prefills its outputs too; with --host-tier its parked positions are reloaded instead."""
        if self.table.available_size() == 0:
            return None
        target = r.prompt_len + r.generated
        start = self.host.parked_len(r) if self.host is not None else 0
        end = min(target, start + budget)
        if self.pages_for(end) > pages:
            return None
        r.row = self.table.alloc(1)[0]  # type: ignore[index]
        r.prefill_target = target
        if start:
            self._resume(r, start)
        return start, end, self.pages_for(end)

    def room(self) -> int:
        """Slots a step may take: the allocator's free ones (a prefix cache adds what it can evict)."""
        return self.allocator.available_size()

    def alloc_prefill(self, plan: list[tuple[Request, int, int]]) -> torch.Tensor:
        """Slots for each ``(request, start, end)`` of ``plan``: positions ``start..end - 1``, in plan
        order (the paged allocator continues each request's last page). Public: speculative
        decoding's drafts and the disaggregated decode rank take slots the same way."""
        total = sum(end - start for _, start, end in plan)
        if self.page_size == 1:
            out = self.allocator.alloc(total)
        else:
            prefix = torch.tensor([s for _, s, _ in plan], dtype=torch.int64)
            seq = torch.tensor([e for _, _, e in plan], dtype=torch.int64)
            last_loc = self._last_loc([r for r, _, _ in plan], prefix)
            out = self.allocator.alloc_extend(
                prefix.to(self.device), prefix, seq.to(self.device), seq, last_loc, total
            )
        if out is None:  # the plan was sized from available_size(), so this is a bug
            raise RuntimeError(f"allocator refused a prefill of {total} tokens it said it had room for")
        return out

    def _alloc_decode(self, decode: list[Request]) -> torch.Tensor:
        if self.page_size == 1:
            out = self.allocator.alloc(len(decode))
        else:
            held = torch.tensor([r.kv_len for r in decode], dtype=torch.int64)
            out = self.allocator.alloc_decode((held + 1).to(self.device), held + 1, self._last_loc(decode, held))
        if out is None:
            raise RuntimeError(f"allocator refused {len(decode)} decode slots it said it had room for")
        return out

    def _last_loc(self, requests: list[Request], held: torch.Tensor) -> torch.Tensor:
        """Slot of each request's last token in the pool (-1 if it holds none), from the table."""
        rows = torch.tensor([r.row for r in requests], dtype=torch.int64, device=self.device)
        held = held.to(self.device)
        last = self.table.req_to_token[rows, (held - 1).clamp(min=0)].to(torch.int64)
        return torch.where(held > 0, last, torch.full_like(last, -1))

    def advance(self, batch: Batch) -> None:
        """Record what the forward step produced."""
        for r, _, end in batch.prefill:
            r.kv_len = end
            if not r.prefilling:
                r.generated += 1  # the prefill's last position yields the next token
        for r in batch.decode:
            r.kv_len += 1
            r.generated += 1

    def finished(self) -> list[Request]:
        return [r for r in self.running if not r.prefilling and r.generated >= r.output_len]

    def slots_of(self, r: Request) -> torch.Tensor:
        return self.table.req_to_token[r.row, : r.kv_len].to(torch.int64)

    def release(self, r: Request) -> None:
        self.allocator.free(self.slots_of(r))
        self.table.free(r.row)  # type: ignore[arg-type]
        self.running.remove(r)
        r.row = None

    def retract(self, r: Request) -> None:
        """Give back a request's slots and queue it again; it re-prefills prompt + outputs so far
        (with --host-tier its KV is parked in host memory first and loaded back when it resumes)."""
        if self.host is not None:
            self.host.park(r, self.slots_of(r))
        self.release(r)
        r.kv_len = 0
        self.waiting.appendleft(r)
        self.retractions += 1

    def settled_slots_in_use(self) -> int:
        """``slots_in_use()`` once the device has run every free: on a GPU the allocator's count of
        freed pages comes back behind the queued work, so a leak check waits for it first."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self.slots_in_use()

    def slots_in_use(self) -> int:
        return self.capacity - self.allocator.available_size()

    def check_integrity(self) -> None:
        """The allocator's and the request table's own checks (``IntegrityError``)."""
        self.allocator.check_integrity()
        self.table.check_integrity()

    def leaked_slots(self) -> int:
        """Slots still held once no request runs."""
        return self.settled_slots_in_use()

    def _resume(self, r: Request, parked: int) -> None:
        """--host-tier: slots for a parked request's first ``parked`` positions, recorded in the
        request table and filled from the host tier (its prefill then continues from there)."""
        slots = self.alloc_prefill([(r, 0, parked)])
        rows = torch.full((parked,), r.row, dtype=torch.int64, device=self.device)  # type: ignore[arg-type]
        self.table.write((rows, torch.arange(parked, device=self.device)), slots.to(torch.int32))
        self.host.resume(r, slots)  # type: ignore[union-attr]
        r.kv_len = parked
