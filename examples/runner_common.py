"""What the model runners in examples/ share: the scheduler, the request table, reading rows back from
a pool, the Hugging Face references and the comparisons with them.

A model family plugs in through an ``Architecture`` (build the seeded model of a ``RunConfig``, make its
pool, make its model runner); ``serve``, ``calibrate`` and ``run`` do the rest:

- ``Scheduler``: a ``ReqToTokenPool`` and a ``PagedTokenToKVPoolAllocator`` (page size > 1), continuous
  batching: it admits waiting prompts while request rows and pages allow, prefills them (whole, or in
  chunks of at most ``chunk_size`` tokens per step), otherwise decodes every running request by one
  token; requests finish at different steps and give their slots back.
- ``ForwardBatch``: one step's ragged tokens and the per-request padded attention metadata, with each
  request's key slots read back through ``req_to_token``; ``read_rows``, ``grouped_attention`` and
  ``attention_mask`` attend over them.
- ``hf_reference``: HF's greedy ``generate`` of each prompt alone, optionally through a cache that
  rounds the K/V it stores as a pool of a given dtype does (``RoundingCache``); ``compare`` reports
  token agreement, logit error and KL; ``run`` serves on a pool of each dtype and compares;
  ``format_summary`` prints it.
- ``RunConfig.prefix_cache`` (``--prefix-cache``): prompts that share prefixes, served on a prefix cache
  (examples/runner_prefix.py): each prefills only what the tree does not hold.

Used by examples/llama_runner.py (Llama, ``MHATokenToKVPool``), examples/deepseek_runner.py (DeepSeek-V3,
``MLATokenToKVPool``) and examples/qwen35_runner.py (Qwen3.5, hybrid KV and state pools).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence, Union

import torch
import torch.nn.functional as F

from kvpool.checks import positive_int
from kvpool.pools.allocator import PagedTokenToKVPoolAllocator
from kvpool.pools.base import KVCache
from kvpool.pools.req_to_token import ReqToTokenPool

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import runner_prefix  # noqa: E402  (the scheduler on a prefix cache, beside this module)
from cache_requests import CacheRequest  # noqa: E402

try:
    import transformers
    from transformers import DynamicCache, PreTrainedModel
except ImportError as e:
    raise ImportError(
        "the model runners need Hugging Face transformers as their model and reference: pip install -e '.[model]'"
    ) from e
if int(transformers.__version__.split(".")[0]) < 5:
    raise ImportError(
        f"the model runners need transformers >= 5, found {transformers.__version__}: pip install -e '.[model]'"
    )

DTYPES = {
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
MODEL_DTYPES = ("fp32", "bf16", "fp16")
#: fp32 model + fp32 pool: the largest allowed max|logits - HF| / max|HF logits| of any step.
LOGIT_RTOL = 1e-4
#: SDPA's memory-efficient CUDA kernel wants the mask's last dim a multiple of 16; padding keys are masked.
KV_LEN_MULTIPLE = 16

Scales = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k_scale, v_scale), float32 on the device
#: Scales by HF layer index, for a reference cache: a list, or a mapping when only some layers hold K/V.
LayerScales = Union[Scales, Mapping[int, tuple[torch.Tensor, torch.Tensor]]]


def unit_scales(layers: int, device: str | torch.device) -> Scales:
    one = torch.ones(1, dtype=torch.float32, device=device)
    return [(one, one)] * layers


# --- configuration --------------------------------------------------------------------------------


class Shape(Protocol):
    """What the shared code reads from a model family's shape (each runner has its own dataclass)."""

    layers: int
    vocab: int

    def describe(self) -> str: ...


@dataclass(frozen=True)
class RunConfig:
    """One run: the model, the prompts, the scheduler's limits and the pool dtypes to compare.

    ``prompt_len`` and ``new_tokens`` are inclusive ranges; each prompt draws its own (prompt lengths
    distinct where the range allows). ``batch`` is the most requests running at once (request table
    rows); prompts beyond it wait for a finished request's row and pages. ``chunk_size`` is the most
    prompt tokens one prefill step takes (None: whole prompts); a longer prompt is prefilled in chunks
    over several steps. ``prefix_cache``: the prompts share prefixes (each after the first begins
    with part of an earlier one) and the scheduler serves them on a prefix cache (runner_prefix.py).
    """

    shape: Shape
    model_dtype: str = "fp32"
    pool_dtypes: tuple[str, ...] = ("fp32", "bf16", "fp8_e4m3")
    prompts: int = 8
    batch: int = 4
    prompt_len: tuple[int, int] = (3, 40)
    new_tokens: tuple[int, int] = (2, 12)
    page_size: int = 16
    seed: int = 0
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    calibrate: bool = True
    # Small matmuls on a 2-core CPU run faster on one thread (as in serve_sim). None: torch's choice.
    cpu_threads: Optional[int] = 1
    chunk_size: Optional[int] = None
    prefix_cache: bool = False

    def __post_init__(self) -> None:
        for name in ("prompts", "batch", "page_size"):
            positive_int(getattr(self, name), name)
        if self.chunk_size is not None:
            positive_int(self.chunk_size, "chunk_size")
        for name in ("prompt_len", "new_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be a range (lo, hi) with 1 <= lo <= hi, got {(lo, hi)}")
        if self.model_dtype not in MODEL_DTYPES:
            raise ValueError(f"model_dtype must be one of {', '.join(MODEL_DTYPES)}, got {self.model_dtype!r}")
        if not self.pool_dtypes:
            raise ValueError("pool_dtypes must name at least one pool dtype, got none")
        for d in self.pool_dtypes:
            if d not in DTYPES:
                raise ValueError(f"pool dtype must be one of {', '.join(DTYPES)}, got {d!r}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be a positive int or None, got {self.cpu_threads}")

    @property
    def max_context_len(self) -> int:
        return self.prompt_len[1] + self.new_tokens[1]


# --- the prompts and the references ---------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    tokens: list[int]
    new_tokens: int


def make_prompts(cfg: RunConfig) -> list[Prompt]:
    """Seeded random token ids; prompt lengths distinct where the range allows, output lengths drawn
    independently (so requests finish at different steps). With ``cfg.prefix_cache`` each prompt
    after the first begins with half or more of an earlier one (as far as it is long enough)."""
    rng = random.Random(cfg.seed)
    lo, hi = cfg.prompt_len
    if hi - lo + 1 >= cfg.prompts:
        lengths = rng.sample(range(lo, hi + 1), cfg.prompts)
    else:
        lengths = [rng.randint(lo, hi) for _ in range(cfg.prompts)]
    prompts = []
    for n in lengths:
        shared: list[int] = []
        if cfg.prefix_cache and prompts:
            earlier = rng.choice(prompts).tokens
            most = min(len(earlier), n - 1)
            shared = earlier[: rng.randint(most // 2, most)] if most > 0 else []
        tokens = shared + [rng.randrange(cfg.shape.vocab) for _ in range(n - len(shared))]
        prompts.append(Prompt(tokens, rng.randint(*cfg.new_tokens)))
    return prompts


@dataclass
class Generation:
    """What one request generated: its tokens and, when kept, the logits each came from."""

    tokens: list[int]
    logits: Optional[torch.Tensor] = None  # [len(tokens), vocab] float32 on the CPU


def round_like_pool(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """``x`` [B, H, L, D] as a pool of ``dtype`` stores it and the runner reads it back, written out
    from docs/contract.md, "The write" (not through kvpool): FP8 divides by the scale (per tensor or
    per head), saturates, casts, and multiplies back; 16-bit and fp32 pools cast."""
    if dtype.itemsize == 1:
        fmax = torch.finfo(dtype).max
        s = scale.reshape(-1, 1, 1)
        return (torch.clamp(x.float() / s, -fmax, fmax).to(dtype).float() * s).to(x.dtype)
    return x.to(dtype).to(x.dtype)


class RoundingCache(DynamicCache):
    """HF's dynamic cache, storing every K/V rounded as a pool of ``dtype`` with ``scales`` would.
    HF's attention attends over what ``update`` returns, prefill included, as the runner does.
    ``scales`` is indexed by HF's layer index (a mapping where only some layers hold K/V).
    (DeepSeek-V3's attention hands ``update`` its latent as K and its rotary key as V; an MLA pool
    rounds both with the one ``k_scale``, so its scales are pairs ``(s, s)``.)"""

    def __init__(self, dtype: torch.dtype, scales: LayerScales, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.pool_dtype = dtype
        self.scales = scales

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # type: ignore[no-untyped-def]
        k_scale, v_scale = self.scales[layer_idx]
        key_states = round_like_pool(key_states, self.pool_dtype, k_scale)
        value_states = round_like_pool(value_states, self.pool_dtype, v_scale)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


@torch.no_grad()
def hf_reference(
    model: PreTrainedModel, prompts: Sequence[Prompt], pool_dtype: Optional[torch.dtype] = None,
    scales: Optional[LayerScales] = None,
) -> list[Generation]:  # fmt: skip
    """HF's greedy ``generate`` of each prompt alone (no padding), with its raw logits per step;
    with ``pool_dtype``, through a ``RoundingCache`` of that dtype and ``scales``."""
    device = model.device
    # transformers 5.x renamed generate's cache argument; take whichever this version has.
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = []
    for p in prompts:
        ids = torch.tensor([p.tokens], dtype=torch.int64, device=device)
        extra = {}
        if pool_dtype is not None:
            extra[cache_arg] = RoundingCache(pool_dtype, scales or unit_scales(len(model.model.layers), device),
                                             config=model.config)  # fmt: skip
        res = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=p.new_tokens,
            min_new_tokens=p.new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            **extra,
        )
        tokens = res.sequences[0, len(p.tokens) :].tolist()
        logits = torch.stack([s[0] for s in res.logits]).float().cpu()
        out.append(Generation(tokens, logits))
    return out


# --- the scheduler ---------------------------------------------------------------------------------


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
    ``_give_back_row``.
    """

    def __init__(
        self, pool: KVCache, max_running: int, max_context_len: int, chunk_size: Optional[int] = None
    ) -> None:
        if chunk_size is not None:
            positive_int(chunk_size, "chunk_size")
        self.device = pool.device
        self.page_size = pool.page_size
        self.allocator = PagedTokenToKVPoolAllocator(pool.size, pool.page_size, pool.dtype, pool.device, pool)
        self.capacity = self.allocator.available_size()
        self.table = self._make_table(max_running, max_context_len, pool.device)
        self.max_context_len = max_context_len
        self.chunk_size = chunk_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.peak_running = 0

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

    def slots_in_use(self) -> int:
        return self.capacity - self.allocator.available_size()

    def leaked_slots(self) -> int:
        """Slots still held once every request finished."""
        return self.slots_in_use()


# --- the model runner's attention over pool rows -------------------------------------------------


def read_rows(buf: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``slots`` ([B, L]) of a pool buffer ``[rows, H, D]`` as ``dtype``: ``[B, L, H, D]``. FP8
    rows are gathered as bytes (FP8 indexing is not implemented on every device) and multiplied by
    ``scale`` (per tensor, or per head ``[H]``) in float32; 16-bit and fp32 rows are cast."""
    if buf.element_size() == 1:
        rows = buf.view(torch.uint8)[slots].view(buf.dtype).to(torch.float32)
        return (rows * scale.reshape(-1, 1)).to(dtype)
    return buf[slots].to(dtype)


def grouped_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch: ForwardBatch, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of ragged queries ``q`` [T, Hq, D] over padded keys [B, L, Hkv, D] and values
    [B, L, Hkv, Dv].

    GQA without repeating K/V: the G = Hq/Hkv query heads that share a KV head (query head h uses
    KV head h // G, as HF's ``repeat_kv``) become G x Tq query rows of that KV head. ``mask``
    [B, 1, G*Tq, L] (from ``attention_mask``). Returns [T, Hq * Dv] in token order.
    """
    b, l, hkv, d = keys.shape
    dv = values.shape[-1]
    hq = q.shape[1]
    g, tq = hq // hkv, batch.q_index.shape[1]
    qp = q[batch.q_index].view(b, tq, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * tq, d)
    out = F.scaled_dot_product_attention(
        qp, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=scale
    )  # [B, Hkv, G*Tq, Dv]
    out = out.view(b, hkv, g, tq, dv).permute(0, 3, 1, 2, 4).reshape(b, tq, hq * dv)
    return out[batch.token_mask]


def attention_mask(batch: ForwardBatch, groups: int) -> torch.Tensor:
    """[B, 1, G*Tq, L] bool: query row (g, j) of a request sees keys 0..position(j) (causal; the
    request's own keys only, since position < its length)."""
    b, tq = batch.q_positions.shape
    keys = torch.arange(batch.kv_slots.shape[1], device=batch.kv_slots.device)
    base = keys[None, None, :] <= batch.q_positions[:, :, None]  # [B, Tq, L]
    return base[:, None].expand(b, groups, tq, keys.shape[0]).reshape(b, 1, groups * tq, keys.shape[0])


class ModelRunner:
    """A model runner: ``forward(batch) -> logits [B, vocab]`` of each request's last token, and
    ``step``, one scheduler step with it (a runner that verifies drafts overrides ``step``)."""

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        raise NotImplementedError

    def step(self, sched: Scheduler, keep_logits: bool) -> Optional[str]:
        """Schedule, run and advance one step; its kind (``"prefill"``, ``"decode"``), None when idle."""
        batch = sched.schedule()
        if batch is None:
            return None
        sched.advance(batch, self.forward(batch), keep_logits)
        return "prefill" if batch.is_prefill else "decode"


class Architecture:
    """What ``serve``, ``calibrate`` and ``run`` need from a model family: build the seeded model of
    a ``RunConfig``, make a pool for it, make the model runner (a ``ModelRunner``) over that pool,
    and the scheduler. Each runner module subclasses it (``LLAMA`` in llama_runner.py); their methods
    look the module's functions up when called, so a test can replace ``make_pool`` in the module."""

    program = "model_runner"
    model_name = "PreTrainedModel"

    def build_model(self, cfg: RunConfig) -> PreTrainedModel:
        raise NotImplementedError

    def make_pool(self, cfg: RunConfig, model: PreTrainedModel, dtype: torch.dtype) -> KVCache:
        raise NotImplementedError

    def runner(self, model: PreTrainedModel, pool: KVCache, scales: Optional[Scales]) -> ModelRunner:
        raise NotImplementedError

    def scheduler(
        self, pool: KVCache, max_running: int, max_context_len: int, chunk_size: Optional[int],
        prefix_cache: bool = False,
    ) -> Scheduler:  # fmt: skip
        cls = runner_prefix.caching(Scheduler) if prefix_cache else Scheduler
        return cls(pool, max_running, max_context_len, chunk_size)

    def reference_scales(self, model: PreTrainedModel, scales: Optional[Scales]) -> Optional[LayerScales]:
        """``scales`` (the runner's) by HF layer index, for ``hf_reference``'s rounding cache."""
        return scales


# --- serving and comparing -------------------------------------------------------------------------


@dataclass
class ServeResult:
    generations: list[Generation]  # by request id
    prefill_steps: int = 0
    decode_steps: int = 0
    verify_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    peak_running: int = 0
    wall_s: float = 0.0
    fused_calls: int = 0
    reference_calls: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    integrity_error: Optional[str] = None
    leaked_slots: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # per request and verify step: drafts accepted
    prompt_tokens: int = 0  # with a prefix cache: the admitted prompts' tokens, and those it held
    cached_tokens: int = 0

    @property
    def generated_tokens(self) -> int:
        return sum(len(g.tokens) for g in self.generations)

    @property
    def allocators_ok(self) -> bool:
        return self.integrity_error is None and self.leaked_slots == 0


def serve(
    model: PreTrainedModel,
    pool: KVCache,
    prompts: Sequence[Prompt],
    max_running: int,
    scales: Optional[Scales] = None,
    keep_logits: bool = True,
    arch: Optional[Architecture] = None,
    chunk_size: Optional[int] = None,
    prefix_cache: bool = False,
) -> ServeResult:
    """Serve ``prompts`` to completion with continuous batching, at most ``max_running`` at once,
    with ``arch``'s scheduler and model runner (on a prefix cache with ``prefix_cache``). The
    result's path counts are the pool writes of this run."""
    if arch is None:
        raise ValueError("arch must be a model family's Architecture, got None")
    max_context = max(len(p.tokens) + p.new_tokens for p in prompts)
    sched = arch.scheduler(pool, max_running, max_context, chunk_size, prefix_cache)
    runner = arch.runner(model, pool, scales)
    for rid, p in enumerate(prompts):
        sched.add(Request(rid, list(p.tokens), p.new_tokens))
    stats = pool.stats
    fused0, ref0, reasons0 = stats.fused_calls, stats.reference_calls, dict(stats.reasons)
    res = ServeResult(generations=[])
    start = time.perf_counter()
    while (kind := runner.step(sched, keep_logits)) is not None:
        setattr(res, f"{kind}_steps", getattr(res, f"{kind}_steps") + 1)
    res.wall_s = time.perf_counter() - start
    done = sorted(sched.finished, key=lambda r: r.rid)
    res.generations = [Generation(r.output, torch.stack(r.logits) if keep_logits else None) for r in done]
    res.peak_running = sched.peak_running
    res.drafted_tokens = getattr(runner, "drafted_tokens", 0)
    res.accepted_tokens = getattr(runner, "accepted_tokens", 0)
    res.accept_lengths = list(getattr(runner, "accept_lengths", []))
    res.fused_calls = stats.fused_calls - fused0
    res.reference_calls = stats.reference_calls - ref0
    res.reasons = {k: v - reasons0.get(k, 0) for k, v in stats.reasons.items() if v != reasons0.get(k, 0)}
    res.prompt_tokens = getattr(sched, "prompt_tokens", 0)
    res.cached_tokens = getattr(sched, "cached_tokens", 0)
    try:
        sched.check_integrity()
    except RuntimeError as e:
        res.integrity_error = str(e)
    res.leaked_slots = sched.leaked_slots()
    return res


@dataclass
class Agreement:
    """How a run's generations compare with a reference's. A token agrees when it and every token
    before it in its request equal the reference's; logits are compared only where the prefix so far
    is identical (after a divergence the two continue from different text)."""

    tokens_agreeing: int
    tokens_total: int
    requests_identical: int
    requests: int
    compared_steps: int
    max_rel_logit_err: float  # max over compared steps of max|a - b| / max|b|, b = the reference's
    mean_kl: float  # mean over compared steps of KL(reference || run) of the next-token distributions
    first_divergence: Optional[tuple[int, int]] = None  # (request id, step)
    # At the first divergence: the reference's logit of its token minus its logit of the run's token,
    # over max|logit| (small: the reference itself nearly chose the run's token).
    divergence_gap: Optional[float] = None

    @property
    def identical(self) -> bool:
        return self.tokens_agreeing == self.tokens_total


def compare(run: Sequence[Generation], ref: Sequence[Generation]) -> Agreement:
    """Tokens and (where both kept them) logits of ``run`` against ``ref``, request by request."""
    agreeing = total = identical = steps = 0
    max_rel, kl_sum = 0.0, 0.0
    first: Optional[tuple[int, int]] = None
    gap: Optional[float] = None
    for rid, (a, b) in enumerate(zip(run, ref, strict=True)):
        n = len(b.tokens)
        same = next((i for i in range(n) if a.tokens[i] != b.tokens[i]), n)
        agreeing += same
        total += n
        identical += same == n
        if same < n and first is None:
            first = (rid, same)
            if b.logits is not None:
                lb = b.logits[same]
                gap = float((lb[b.tokens[same]] - lb[a.tokens[same]]) / lb.abs().max())
        if a.logits is None or b.logits is None:
            continue
        cmp = min(same + 1, n)  # the diverging step's logits still come from the same prefix
        la, lb = a.logits[:cmp].double(), b.logits[:cmp].double()
        err = (la - lb).abs().amax(dim=-1) / lb.abs().amax(dim=-1)
        max_rel = max(max_rel, float(err.max()))
        lpa, lpb = F.log_softmax(la, dim=-1), F.log_softmax(lb, dim=-1)
        kl_sum += float((lpb.exp() * (lpb - lpa)).sum())
        steps += cmp
    mean_kl = kl_sum / steps if steps else float("nan")
    return Agreement(agreeing, total, identical, len(ref), steps, max_rel, mean_kl, first, gap)


@dataclass
class PoolRun:
    dtype: str
    scales: str  # "1.0" or "calibrated" for FP8; "-" for pools that ignore scales
    result: ServeResult
    vs_hf: Agreement  # against HF's plain generate
    vs_rounded: Optional[Agreement]  # against HF through a RoundingCache (None: pool dtype = model dtype)

    @property
    def label(self) -> str:
        return self.dtype if self.scales == "-" else f"{self.dtype}, scale {self.scales}"


@dataclass
class Report:
    config: RunConfig
    device: str
    transformers_version: str
    runs: list[PoolRun]
    program: str
    model_name: str
    notes: list[str] = field(default_factory=list)

    @property
    def fp32_check(self) -> Optional[bool]:
        """fp32 model and fp32 pool: identical tokens and logits within LOGIT_RTOL (None: not run)."""
        runs = [r for r in self.runs if r.dtype == "fp32"]
        if self.config.model_dtype != "fp32" or not runs:
            return None
        return all(r.vs_hf.identical and r.vs_hf.max_rel_logit_err <= LOGIT_RTOL for r in runs)

    @property
    def ok(self) -> bool:
        return self.fp32_check is not False and all(r.result.allocators_ok for r in self.runs)


def calibrate(
    cfg: RunConfig, model: PreTrainedModel, pool: KVCache, prompts: Sequence[Prompt], arch: Architecture
) -> LayerScales:
    """Per-layer scales from the K/V amax the pool observes while it serves ``prompts`` at scale 1.0:
    a list in layer order, or a mapping from layer id where the pool returns one (a hybrid model's).

    Uses the pool's ``reset_amax``/``observe_amax``/``calibrated_scales``, which a pool may not
    have: callers check ``hasattr(pool, "calibrated_scales")`` first.
    """
    pool.reset_amax()  # type: ignore[attr-defined]
    pool.observe_amax(True)  # type: ignore[attr-defined]
    try:
        serve(model, pool, prompts, cfg.batch, keep_logits=False, arch=arch, chunk_size=cfg.chunk_size,
              prefix_cache=cfg.prefix_cache)  # fmt: skip
    finally:
        pool.observe_amax(False)  # type: ignore[attr-defined]
    scales = pool.calibrated_scales(margin=1.0, per_head=False)  # type: ignore[attr-defined]
    return dict(scales) if isinstance(scales, Mapping) else [(k, v) for k, v in scales]


def run(cfg: RunConfig, arch: Architecture, progress: Optional[Callable[[str], None]] = None) -> Report:
    """Build ``arch``'s model, serve the prompts on a pool of each dtype, compare each run with HF;
    ``progress`` is told what starts."""
    with cpu_threads(cfg):
        return _run(cfg, arch, progress or (lambda msg: None))


class cpu_threads:
    """Within the block, torch uses ``cfg.cpu_threads`` threads when ``cfg.device`` is a CPU."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg

    def __enter__(self) -> None:
        self.threads = torch.get_num_threads()
        if self.cfg.cpu_threads is not None and torch.device(self.cfg.device).type == "cpu":
            torch.set_num_threads(self.cfg.cpu_threads)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.threads)


def _run(cfg: RunConfig, arch: Architecture, progress: Callable[[str], None]) -> Report:
    progress(f"building the model ({cfg.shape.describe()}) on {cfg.device}")
    model = arch.build_model(cfg)
    prompts = make_prompts(cfg)
    progress(f"HF generate of {len(prompts)} prompts (the reference)")
    hf = hf_reference(model, prompts)
    report = Report(cfg, str(model.device), transformers.__version__, [], arch.program, arch.model_name)

    def record(name: str, pool: KVCache, scales: Optional[LayerScales], label: str) -> None:
        dtype = DTYPES[name]
        progress(f"serving on a {name} pool" + (f", scale {label}" if label != "-" else ""))
        res = serve(model, pool, prompts, cfg.batch, scales=scales, arch=arch, chunk_size=cfg.chunk_size,
                    prefix_cache=cfg.prefix_cache)  # fmt: skip
        rounded = None
        if dtype != DTYPES[cfg.model_dtype]:
            progress(f"HF generate through a cache that rounds K/V as the {name} pool does")
            rounded = compare(res.generations, hf_reference(model, prompts, dtype, arch.reference_scales(model, scales)))
        report.runs.append(PoolRun(name, label, res, compare(res.generations, hf), rounded))

    for name in cfg.pool_dtypes:
        pool = arch.make_pool(cfg, model, DTYPES[name])
        fp8 = DTYPES[name].itemsize == 1
        record(name, pool, None, "1.0" if fp8 else "-")
        if not (fp8 and cfg.calibrate):
            continue
        if hasattr(pool, "calibrated_scales"):
            progress(f"calibrating the {name} pool's scales on the same prompts")
            record(name, pool, calibrate(cfg, model, pool, prompts, arch), "calibrated")
        else:
            note = f"FP8 with calibrated scales: not run ({type(pool).__name__} has no calibrated_scales)"
            if note not in report.notes:
                report.notes.append(note)
    return report


def agreement_line(a: Agreement) -> str:
    if a.identical:
        tokens = f"tokens identical ({a.tokens_total}/{a.tokens_total})"
    else:
        rid, step = a.first_divergence or (-1, -1)
        tokens = (
            f"tokens DIFFER: {a.tokens_agreeing}/{a.tokens_total} agree, {a.requests_identical}/{a.requests} "
            f"requests entirely; first divergence request {rid} step {step}"
        )
        if a.divergence_gap is not None:
            tokens += f" (the reference's logits for the two tokens {100 * a.divergence_gap:.2g}% of max|logit| apart)"
    logits = f"max rel logit error {a.max_rel_logit_err:.1e}, mean KL {a.mean_kl:.1e} over {a.compared_steps} steps"
    return f"{tokens}; {logits}"


#: Printed when a pool stores K/V in another dtype than the model computes in.
ROUNDING_NOTE = (
    "a pool of another dtype than the model's rounds every K/V it stores, so its logits differ from HF's "
    "unrounded cache and greedy tokens may part at near-ties (random weights have many); 'vs rounded' is "
    "the exact check"
)


def format_summary(rep: Report) -> str:
    cfg = rep.config
    lo, hi = cfg.prompt_len
    chunks = f", prefill chunks of {cfg.chunk_size} tokens" if cfg.chunk_size is not None else ""
    lines = [
        f"kvpool {rep.program}: {rep.model_name} ({cfg.shape.describe()}), {cfg.model_dtype} weights, "
        f"seed {cfg.seed}, on {rep.device}",
        f"  requests    {cfg.prompts} prompts of {lo}-{hi} tokens asking {cfg.new_tokens[0]}-{cfg.new_tokens[1]} "
        f"new tokens, at most {cfg.batch} running{chunks}; PagedTokenToKVPoolAllocator(page_size={cfg.page_size})",
        f"  reference   transformers {rep.transformers_version}: generate(do_sample=False) of each prompt alone; "
        f"'rounded': through a cache that rounds K/V as the pool does",
    ]
    if any(r.vs_rounded is not None for r in rep.runs):
        lines.append(f"  why         {ROUNDING_NOTE}")
    for r in rep.runs:
        s = r.result
        lines.append(f"  pool {r.label}")
        lines.append(f"    vs HF       {agreement_line(r.vs_hf)}")
        if r.vs_rounded is not None:
            lines.append(f"    vs rounded  {agreement_line(r.vs_rounded)}")
        lines.append(
            f"    served      {s.prefill_steps} prefill + {s.decode_steps} decode steps, peak {s.peak_running} "
            f"running, {s.generated_tokens / s.wall_s:,.0f} tokens/s; KV writes fused {s.fused_calls}, "
            f"reference {s.reference_calls}"
        )
        for reason, count in sorted(s.reasons.items(), key=lambda kv: -kv[1]):
            lines.append(f"                reference because {reason} ({count} calls)")
        if cfg.prefix_cache:
            rate = 100 * s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0
            lines.append(
                f"    cache       {s.cached_tokens} of {s.prompt_tokens} prompt tokens matched in the prefix cache "
                f"({rate:.0f}%), not prefilled"
            )
        if not s.allocators_ok:
            problem = s.integrity_error or f"{s.leaked_slots} slots still held after every request finished"
            lines.append(f"    allocators  FAILED: {problem}")
    for note in rep.notes:
        lines.append(f"  note        {note}")
    if all(r.result.allocators_ok for r in rep.runs):
        lines.append("  allocators  OK: integrity checks pass; every slot and row given back")
    check = rep.fp32_check
    if check is None:
        lines.append("  fp32 check  not run (needs --model-dtype fp32 and an fp32 pool)")
    else:
        bound = f"fp32 pool's tokens identical to HF and logits within {LOGIT_RTOL:g} (relative)"
        lines.append(f"  fp32 check  {'PASS' if check else 'FAILED'}: {bound}")
    lines.append("PASS" if rep.ok else "FAIL")
    return "\n".join(lines)


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RunConfig)}


def add_run_arguments(p: argparse.ArgumentParser, **defaults: Any) -> None:
    """The options every model family's runner takes (the model shape's are its own); ``defaults``
    replace ``RunConfig``'s for this runner."""
    d = {**_DEFAULTS, **defaults}
    p.add_argument("--model-dtype", choices=MODEL_DTYPES, default=d["model_dtype"], help="weights and activations")
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=list(d["pool_dtypes"]), help="pool dtypes")
    p.add_argument("--prompts", type=int, default=d["prompts"], help="prompts to serve")
    p.add_argument("--batch", type=int, default=d["batch"], help="most requests running at once")
    p.add_argument("--prompt-len", type=int, nargs=2, default=d["prompt_len"], metavar=("MIN", "MAX"),
                   help="prompt lengths drawn from this range")  # fmt: skip
    p.add_argument("--new-tokens", type=int, nargs=2, default=d["new_tokens"], metavar=("MIN", "MAX"),
                   help="tokens each request generates, drawn from this range")  # fmt: skip
    p.add_argument("--page-size", type=int, default=d["page_size"], help="slots per page")
    p.add_argument("--chunk-size", type=int, default=d["chunk_size"],
                   help="most prompt tokens per prefill step (chunked prefill; 0 or unset: whole prompts)")  # fmt: skip
    p.add_argument("--seed", type=int, default=d["seed"], help="seeds the weights and the prompts")
    p.add_argument("--device", default=d["device"], help="cuda when available, else cpu")
    p.add_argument("--no-calibrate", action="store_true", help="skip the calibrated-scale FP8 runs")
    p.add_argument("--cpu-threads", type=int, default=d["cpu_threads"], help="torch threads on a CPU (0: torch's choice)")
    p.add_argument("--prefix-cache", action="store_true",
                   help="prompts that share prefixes, served on a prefix cache (each prefills only what it does not hold)")  # fmt: skip


def run_config(a: argparse.Namespace, shape: Shape) -> RunConfig:
    """The ``RunConfig`` of parsed ``add_run_arguments`` options and a model shape."""
    return RunConfig(
        shape=shape, model_dtype=a.model_dtype, pool_dtypes=tuple(a.dtypes),
        prompts=a.prompts, batch=a.batch, prompt_len=tuple(a.prompt_len), new_tokens=tuple(a.new_tokens),
        page_size=a.page_size, seed=a.seed, device=a.device, calibrate=not a.no_calibrate,
        cpu_threads=a.cpu_threads or None, chunk_size=a.chunk_size or None, prefix_cache=a.prefix_cache,
    )  # fmt: skip


def run_main(
    argv: Optional[Sequence[str]], parse: Callable[[Optional[Sequence[str]]], tuple[RunConfig, Architecture]],
    program: str, execute: Optional[Callable[[RunConfig, Architecture], Any]] = None,
    summary: Callable[[Any], str] = format_summary,
) -> int:  # fmt: skip
    """Parse ``argv`` into a config and an architecture, run (``execute``, default ``run``), print
    the summary; 0 when the report is ok, 1 when not, 2 on bad arguments (reported as ``program``'s)."""
    try:
        cfg, arch = parse(argv)
        report = (execute or run)(cfg, arch)
    except ValueError as e:
        print(f"{program}: {e}", file=sys.stderr)
        return 2
    print(summary(report))
    return 0 if report.ok else 1
