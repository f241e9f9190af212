"""The runners' requests, forward batches and scheduler: a ``ReqToTokenPool`` and a
``PagedTokenToKVPoolAllocator`` with continuous batching and chunked prefill."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from kvpool.checks import positive_int
from kvpool.pools.allocator import PagedTokenToKVPoolAllocator
from kvpool.pools.base import KVCache
from kvpool.pools.req_to_token import ReqToTokenPool
from support.cache_requests import CacheRequest
from support.runners.config import KV_LEN_MULTIPLE

@dataclass(eq=False)
class Request(CacheRequest):
    """A request's progress, with what a prefix cache reads and writes (``CacheRequest``):
    ``origin_input_ids`` is the prompt, ``output_ids`` the output, ``fill_ids`` the tokens with K/V."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    row: Optional[int] = None
    kv_len: int = 0  # tokens whose K/V is in the pool, at req_to_token[row, :kv_len]
    output: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def origin_input_ids(self) -> list[int]:
        return self.prompt

    @property
    def output_ids(self) -> list[int]:
        return self.output

    @property
    def fill_ids(self) -> list[int]:
        return (self.prompt + self.output)[: self.kv_len]

    @property
    def final_kv_len(self) -> int:
        return len(self.prompt) + self.max_new_tokens - 1  # the last token's K/V is never written

    @property
    def prefilling(self) -> bool:
        return self.kv_len < len(self.prompt)

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens


@dataclass
class ForwardBatch:
    """One forward step. Tokens are ragged (no padding), request after request; the attention
    metadata pads per request: ``B`` requests, at most ``Tq`` new tokens and ``L`` keys each.
    Padded query rows see key 0 only (a row with every key masked would be NaN) and are dropped."""

    requests: list[Request]
    is_prefill: bool
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    loc: torch.Tensor  # [T] int64: the slots this step's K/V go to
    q_index: torch.Tensor  # [B, Tq] int64: token of each padded query row (padding: the request's first)
    q_positions: torch.Tensor  # [B, Tq] int64: position of each query row (padding: 0)
    token_mask: torch.Tensor  # [B, Tq] bool: real query rows (row-major order = token order)
    last_index: torch.Tensor  # [B] int64: each request's last token (its logits)
    kv_slots: torch.Tensor  # [B, L] int64: slots of each request's keys from req_to_token (padding: 0)
    starts: list[int] = field(default_factory=list)  # per request: position of its first new token
    counts: list[int] = field(default_factory=list)  # per request: its new tokens this step
    # Models with a state per request (linear attention): each request's state slot, [B] int64.
    state_slots: Optional[torch.Tensor] = None
    # A verify step: each request's slots [B, Tq] int64 for its new tokens (padding: -1).
    loc_2d: Optional[torch.Tensor] = None


class Scheduler:
    """Admission, slot allocation and freeing, as a serving engine's scheduler does them.

    A request is admitted only when the free pages cover its whole length plus what the running
    requests will still add, so decode never runs out of pages (serve_sim shows retraction instead).
    A step prefills requests whose prompt is not all in the pool yet if there are any (in admission
    order, at most ``chunk_size`` prompt tokens in all; None: whole prompts), else decodes all running
    ones. A subclass that holds more per request than a table row overrides ``_take_row`` and
    ``_give_back_row``; one whose pool needs another allocator overrides ``_make_allocator``.
    """

    def __init__(
        self, pool: KVCache, max_running: int, max_context_len: int, chunk_size: Optional[int] = None
    ) -> None:
        if chunk_size is not None:
            positive_int(chunk_size, "chunk_size")
        self.device = pool.device
        self.page_size = pool.page_size
        self.allocator = self._make_allocator(pool)
        self.capacity = self.allocator.available_size()
        self.table = self._make_table(max_running, max_context_len, pool.device)
        self.max_context_len = max_context_len
        self.chunk_size = chunk_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.peak_running = 0

    def _make_allocator(self, pool: KVCache) -> Any:
        return PagedTokenToKVPoolAllocator(pool.size, pool.page_size, pool.dtype, pool.device, pool)

    def _make_table(self, max_running: int, max_context_len: int, device: torch.device) -> Any:
        return ReqToTokenPool(max_running, max_context_len, device)

    def _take_row(self, r: Request) -> bool:
        """Give ``r`` its table row (and whatever else it holds while running); False if none is free."""
        rows = self.table.alloc(1)
        if rows is None:
            return False
        r.row = rows[0]
        return True

    def _give_back_row(self, r: Request) -> None:
        self.table.free(r.row)  # type: ignore[arg-type]
        r.row = None

    def pages(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def add(self, r: Request) -> None:
        if r.final_kv_len > self.max_context_len:
            raise ValueError(f"request {r.rid} needs {r.final_kv_len} tokens, more than max_context_len")
        if self.pages(r.final_kv_len) * self.page_size > self.capacity:
            raise ValueError(f"request {r.rid} needs {r.final_kv_len} slots, the pool has {self.capacity}")
        self.waiting.append(r)

    def schedule(self) -> Optional[ForwardBatch]:
        """This step's batch, its slots reserved and recorded in the request table; None when idle."""
        self._admit()
        prefilling = [r for r in self.running if r.prefilling]
        if prefilling:
            return self._prefill(prefilling)
        if self.running:
            return self._decode(list(self.running))
        return None

    def _admit(self) -> list[Request]:
        free = self.allocator.available_size() // self.page_size
        free -= sum(self.pages(r.final_kv_len) - self.pages(r.kv_len) for r in self.running)
        out = []
        while self.waiting:
            need = self.pages(self.waiting[0].final_kv_len)
            if need > free or not self._take_row(self.waiting[0]):
                break
            r = self.waiting.popleft()
            self.running.append(r)
            out.append(r)
            free -= need
        self.peak_running = max(self.peak_running, len(self.running))
        return out

    def _prefill(self, reqs: list[Request]) -> ForwardBatch:
        """The next chunk of each prefilling request, within the step's ``chunk_size`` budget."""
        budget = self.chunk_size if self.chunk_size is not None else sum(len(r.prompt) for r in reqs)
        chosen, counts = [], []
        for r in reqs:
            n = self._chunk(r, budget)
            if n == 0:
                break
            chosen.append(r)
            counts.append(n)
            budget -= n
        starts = [r.kv_len for r in chosen]
        loc = self.alloc_extend(chosen, counts)
        ids = [t for r, s, n in zip(chosen, starts, counts) for t in r.prompt[s : s + n]]
        return self._batch(chosen, ids, starts, counts, loc, is_prefill=True)

    def _chunk(self, r: Request, budget: int) -> int:
        """How many of ``r``'s prompt tokens this step prefills, within ``budget``."""
        return min(len(r.prompt) - r.kv_len, budget)

    def alloc_extend(self, reqs: Sequence[Request], counts: Sequence[int]) -> torch.Tensor:
        """Slots for ``counts[i]`` more tokens of each request after its ``kv_len`` (continuing its
        last partial page), request after request."""
        pre = torch.tensor([r.kv_len for r in reqs], dtype=torch.int64)
        seq = pre + torch.tensor(list(counts), dtype=torch.int64)
        total = int(seq.sum() - pre.sum())
        last_loc = torch.full_like(pre, -1).to(self.device)
        held = [i for i, r in enumerate(reqs) if r.kv_len > 0]
        if held:
            rows = torch.tensor([reqs[i].row for i in held], dtype=torch.int64, device=self.device)
            last_loc[held] = self.table.req_to_token[rows, pre[held].to(self.device) - 1].to(torch.int64)
        loc = self.allocator.alloc_extend(pre.to(self.device), pre, seq.to(self.device), seq, last_loc, total)
        if loc is None:  # admission counted the pages, so this is a bug
            raise RuntimeError(f"allocator refused an extension of {total} tokens it said it had room for")
        return loc

    def _decode(self, reqs: list[Request]) -> ForwardBatch:
        held = torch.tensor([r.kv_len for r in reqs], dtype=torch.int64)
        rows = torch.tensor([r.row for r in reqs], dtype=torch.int64, device=self.device)
        last_loc = self.table.req_to_token[rows, held.to(self.device) - 1].to(torch.int64)
        loc = self.allocator.alloc_decode((held + 1).to(self.device), held + 1, last_loc)
        if loc is None:
            raise RuntimeError(f"allocator refused {len(reqs)} decode slots it said it had room for")
        ids = [r.output[-1] for r in reqs]
        return self._batch(reqs, ids, held.tolist(), [1] * len(reqs), loc, is_prefill=False)

    def record(self, reqs: Sequence[Request], starts: Sequence[int], counts: Sequence[int], loc: torch.Tensor) -> None:
        """Write ``loc`` (request after request, ``counts[i]`` slots from position ``starts[i]``) into
        the request table."""
        dev = self.device
        positions = torch.tensor([s + j for s, n in zip(starts, counts) for j in range(n)], dtype=torch.int64)
        row_of_token = torch.tensor([r.row for r, n in zip(reqs, counts) for _ in range(n)], dtype=torch.int64)
        self.table.write((row_of_token.to(dev), positions.to(dev)), loc.to(torch.int32))

    def _batch(
        self, reqs: list[Request], ids: list[int], starts: list[int], counts: list[int], loc: torch.Tensor,
        is_prefill: bool,
    ) -> ForwardBatch:  # fmt: skip
        """Record ``loc`` in the table and build the step's inputs and attention metadata."""
        self.record(reqs, starts, counts, loc)
        return self.metadata(reqs, ids, starts, counts, loc, is_prefill, key_lens=None)

    def metadata(
        self, reqs: list[Request], ids: list[int], starts: list[int], counts: list[int], loc: torch.Tensor,
        is_prefill: bool, key_lens: Optional[Sequence[int]],
    ) -> ForwardBatch:  # fmt: skip
        """The step's inputs and attention metadata; each request's keys are its first
        ``key_lens[i]`` table entries (None: ``starts[i] + counts[i]``, the step's tokens included)."""
        dev = self.device
        tq = max(counts)
        positions = torch.tensor([s + j for s, n in zip(starts, counts) for j in range(n)], dtype=torch.int64)
        first = torch.tensor([0] + counts[:-1], dtype=torch.int64).cumsum(0)
        n = torch.tensor(counts, dtype=torch.int64)
        j = torch.arange(tq, dtype=torch.int64)
        token_mask = j[None, :] < n[:, None]
        q_index = first[:, None] + torch.where(token_mask, j[None, :], 0)
        q_positions = torch.where(token_mask, torch.tensor(starts)[:, None] + j[None, :], 0)
        seq_lens = torch.tensor(starts, dtype=torch.int64) + n if key_lens is None else torch.tensor(key_lens)
        kv_len = -(-max(int(seq_lens.max()), 1) // KV_LEN_MULTIPLE) * KV_LEN_MULTIPLE
        rows = torch.tensor([r.row for r in reqs], dtype=torch.int64, device=dev)
        width = min(kv_len, self.max_context_len)
        slots = self.table.req_to_token[rows, :width].to(torch.int64)
        cols = torch.arange(width, device=dev)
        slots = torch.where(cols[None, :] < seq_lens.to(dev)[:, None], slots, 0)
        slots = F.pad(slots, (0, kv_len - slots.shape[1]))  # slot 0: the padding slot
        return ForwardBatch(
            requests=reqs, is_prefill=is_prefill,
            input_ids=torch.tensor(ids, dtype=torch.int64).to(dev), positions=positions.to(dev), loc=loc,
            q_index=q_index.to(dev), q_positions=q_positions.to(dev), token_mask=token_mask.to(dev),
            last_index=(first + n - 1).to(dev), kv_slots=slots, starts=list(starts), counts=list(counts),
        )  # fmt: skip

    def advance(self, batch: ForwardBatch, logits: torch.Tensor, keep_logits: bool) -> None:
        """Take each request's greedy next token from ``logits`` [B, vocab] (a prefill chunk that
        does not finish its prompt produces none); free the finished ones."""
        next_tokens = logits.argmax(dim=-1).tolist()
        host_logits = logits.float().cpu() if keep_logits else None
        for i, (r, tok, n) in enumerate(zip(batch.requests, next_tokens, batch.counts)):
            r.kv_len += n
            if r.prefilling:
                continue
            r.output.append(tok)
            if host_logits is not None:
                r.logits.append(host_logits[i])
        self.finish([r for r in batch.requests if r.done])

    def finish(self, done: Sequence[Request]) -> None:
        """Free the slots and rows of finished requests."""
        self.allocator.free_group_begin()  # a step's finished requests are freed together, as SGLang does
        for r in done:
            self.allocator.free(self.table.req_to_token[r.row, : r.kv_len].to(torch.int64))
            self._give_back_row(r)
            self.running.remove(r)
        self.allocator.free_group_end()
        self.finished.extend(done)

    def check_integrity(self) -> None:
        """The allocator's and the table's integrity checks (RuntimeError on a problem)."""
        self.allocator.check_integrity()
        self.table.check_integrity()

    def settled_slots_in_use(self) -> int:
        """``slots_in_use()`` once the device has run every free: on a GPU the allocator's count of
        freed pages comes back behind the queued work, so a leak check waits for it first."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self.slots_in_use()

    def slots_in_use(self) -> int:
        return self.capacity - self.allocator.available_size()

    def leaked_slots(self) -> int:
        """Slots still held once every request finished."""
        return self.settled_slots_in_use()
